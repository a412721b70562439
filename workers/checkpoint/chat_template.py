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
others are ignored), or missing/None (rendered as empty).

Tools, in the style of Granite 4.0-H's template: with `tools`, the first message is a system
message that ends with the tool list and how to call them (one is made if the chat opens
otherwise). An assistant message's `tool_calls` follow its content as

    <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (the arguments' text verbatim)

which is the `hermes` form of workers/tools/formats.py: what the model writes when it calls a
tool is what this renders when the call comes back as history. A tool's result is a message
of role `tool`. Rendering a chat with tools stays append-consistent (the tools sit in the
first message), as long as every request of the chat sends the same tools.
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

TOOLS_PREAMBLE = "You can call these tools:\n<tools>\n"
TOOLS_INSTRUCTIONS = (
    "</tools>\nTo call tools, reply with one or more "
    '<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>.'
)
_START, _END = SpecialToken.START_OF_ROLE.value, SpecialToken.END_OF_ROLE.value

# Whitespace control (`{%-`, `-%}`) everywhere: the template must emit no stray text.
# The role is checked because it is spliced next to control tokens.
CHAT_TEMPLATE = (
    "{%- set tool_block = namespace(text='') -%}"
    "{%- if tools -%}"
    f"{{%- set tool_block.text = {TOOLS_PREAMBLE!r} -%}}"
    "{%- for tool in tools -%}"
    "{%- set tool_block.text = tool_block.text + (tool | tojson) + '\n' -%}"
    "{%- endfor -%}"
    f"{{%- set tool_block.text = tool_block.text + {TOOLS_INSTRUCTIONS!r} -%}}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    f"{{{{- '{_START}system{_END}' + tool_block.text + '{SpecialToken.END_OF_TURN.value}' -}}}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    f"{{%- if message['role'] not in [{_ROLE_LIST}] -%}}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    f"{{{{- '{_START}' + message['role'] + '{_END}' -}}}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is defined and message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if loop.first and tool_block.text and message['role'] == 'system' -%}"
    "{{- '\n\n' + tool_block.text -}}"
    "{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    """{{- '<tool_call>{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + args + '}</tool_call>' -}}"""
    "{%- endfor -%}"
    f"{{{{- '{SpecialToken.END_OF_TURN.value}' -}}}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    f"{{{{- '{GENERATION_PROMPT}' -}}}}"
    "{%- endif -%}"
)
