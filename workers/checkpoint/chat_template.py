"""The chat template shipped with the built-in checkpoints.

Every message renders to exactly

    <|start_of_role|>{role}<|end_of_role|>{content}<|end_of_turn|>

with nothing before the first message, nothing between messages and no trailing
newline, and the generation prompt is `<|start_of_role|>assistant<|end_of_role|>`.
The rendering of a conversation is therefore the plain concatenation of the renderings
of its messages, which is what makes the template *append-consistent*:

    render(history + [asst, user], gen=True)
      == render(history, gen=True) + asst.content + "<|end_of_turn|>" + render([user], gen=True)

so a conversation head (committed tokens ending in the generated <|end_of_turn|>) can be
extended by rendering only the new suffix messages.

`content` may be a string, a list of OpenAI content parts (text parts are concatenated,
others are ignored), or missing/None (rendered as empty). Tool calls are not rendered.
"""

from __future__ import annotations

from enum import Enum

from workers.checkpoint.tokens import SpecialToken


class Role(str, Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


GENERATION_PROMPT = f"{SpecialToken.START_OF_ROLE.value}{Role.ASSISTANT.value}{SpecialToken.END_OF_ROLE.value}"

_ROLE_LIST = ", ".join(f"'{r.value}'" for r in Role)

# Whitespace control (`{%-`, `-%}`) everywhere: the template must emit no stray text.
# The role is checked because it is spliced next to control tokens.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    f"{{%- if message['role'] not in [{_ROLE_LIST}] -%}}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    f"{{{{- '{SpecialToken.START_OF_ROLE.value}' + message['role'] + '{SpecialToken.END_OF_ROLE.value}' -}}}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is defined and message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    f"{{{{- '{SpecialToken.END_OF_TURN.value}' -}}}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    f"{{{{- '{GENERATION_PROMPT}' -}}}}"
    "{%- endif -%}"
)
