"""The requests bench.vllm_parity sends to both servers: one per vLLM extension (a few per
endpoint), each built from the plain greedy reply where the field needs one of its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

HI = [{"role": "user", "content": "tell me about hybrid models"}]
OPENED = [*HI, {"role": "assistant", "content": "Hybrid models"}]
PROMPT = "Hybrid models are"
MAX_TOKENS = 12
COLOURS = ["red", "green", "blue and yellow"]
REGEX = r"(yes|no)-[0-9]{3}"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "degrees": {"type": "integer", "minimum": -50, "maximum": 50}},
          "required": ["city", "degrees"], "additionalProperties": False}


class Endpoint(str, Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


class Compare(str, Enum):
    """What must agree between the servers."""

    REPLY = "reply"  # every choice's text and finish reason, the prompt's and the reply's token counts
    SHAPE = "shape"  # seeded sampling (each engine draws its own): the number of choices, how each ended
    ID = "id"  # the response's id
    ECHO = "echo"  # the echoed text, the prompt's token count, its logprobs within ECHO_TOLERANCE


ECHO_TOLERANCE = 1e-3  # float32 on both, other kernels: the logprobs' last bits differ


@dataclass(frozen=True)
class Case:
    field: str  # the extension the case shows (the table's first column)
    body: dict[str, Any]  # sent to both servers beside model, messages or prompt, max_tokens
    endpoint: Endpoint = Endpoint.CHAT
    compare: Compare = Compare.REPLY
    messages: list[dict] = field(default_factory=lambda: HI)
    note: str = ""  # what the case expects, for the reader

    def request(self, model: str) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
        base |= {"messages": self.messages} if self.endpoint is Endpoint.CHAT else {"prompt": PROMPT}
        return base | self.body


def plain_cases() -> list[Case]:
    """The greedy replies every other case is read against (the fields' effects)."""
    return [Case("(none: greedy chat)", {}), Case("(none: greedy completion)", {}, Endpoint.COMPLETIONS)]


@dataclass(frozen=True)
class Greedy:
    """A plain greedy reply (the fields that stop a reply stop it at its 4th token)."""

    ids: list[int]
    text: str


def cases(chat_greedy: Greedy, completion_greedy: Greedy, eos: int, other_token: int) -> list[Case]:
    """The cases; eos: the end of turn, other_token: an id the greedy chat reply does not start with."""
    seeded = {"temperature": 1.0, "seed": 3}
    ends_at_once = {"logit_bias": {str(eos): 100}}
    greedy_ids, stop = chat_greedy.ids, chat_greedy.text[3:5]
    chat = [
        Case("top_k", seeded | {"top_k": 1}, note="top_k 1: the greedy reply"),
        Case("min_p", seeded | {"min_p": 1.0}, note="min_p 1: the greedy reply"),
        Case("repetition_penalty", {"repetition_penalty": 2.0}),
        Case("presence_penalty", {"presence_penalty": 2.0}),
        Case("frequency_penalty", {"frequency_penalty": 2.0}),
        Case("logit_bias", {"logit_bias": {str(other_token): 100}}, note="the biased token, again and again"),
        Case("logit_bias (end of turn)", ends_at_once, note="ends at once"),
        Case("min_tokens", ends_at_once | {"min_tokens": 4}, note="4 tokens, then the end of turn"),
        Case("ignore_eos", ends_at_once | {"ignore_eos": True, "max_tokens": 4}, note="past the end of turn"),
        Case("skip_special_tokens", ends_at_once | {"ignore_eos": True, "max_tokens": 4,
                                                     "skip_special_tokens": False}, note="the end of turn's text"),
        Case("stop_token_ids", {"stop_token_ids": [greedy_ids[3]]}, note="ends at the 4th token's first use"),
        Case("stop (OpenAI's)", {"stop": [stop]}, note="the text before the stop string"),
        Case("include_stop_str_in_output", {"stop": [stop], "include_stop_str_in_output": True}),
        Case("n", {"n": 2}, note="two equal greedy choices"),
        Case("n (seeded)", seeded | {"n": 2}, compare=Compare.SHAPE),
        Case("chat_template_kwargs", {"chat_template_kwargs": {"greeting": "hello"}}, note="rendered first"),
        Case("add_generation_prompt", {"add_generation_prompt": False}),
        Case("continue_final_message", {"add_generation_prompt": False, "continue_final_message": True},
             messages=OPENED),
        Case("structured_outputs (choice)", {"structured_outputs": {"choice": COLOURS}}),
        Case("structured_outputs (regex)", {"structured_outputs": {"regex": REGEX}}),
        Case("structured_outputs (json)", {"structured_outputs": {"json": SCHEMA}}),
        Case("guided_choice", {"guided_choice": COLOURS}, note="vLLM's older name of the choice"),
        Case("priority", {"priority": 1}, note="alone: the plain reply (both schedule by priority)"),
        Case("request_id", {"request_id": "parity-7"}, compare=Compare.ID),
    ]
    completions = [
        Case(f"{case.field} (completions)", case.body, Endpoint.COMPLETIONS, case.compare, note=case.note)
        for case in chat if case.field in ("top_k", "min_tokens", "n", "structured_outputs (regex)")
    ]
    completions.append(Case("stop_token_ids (completions)", {"stop_token_ids": [completion_greedy.ids[3]]},
                            Endpoint.COMPLETIONS, note="ends at the 4th token's first use"))
    completions.append(Case("echo + logprobs (completions)", {"echo": True, "logprobs": 1, "max_tokens": 1},
                            Endpoint.COMPLETIONS, Compare.ECHO, note="the prompt's logprobs, as lm-eval reads them"))
    return chat + completions
