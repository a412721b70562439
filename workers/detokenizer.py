"""Incremental detokenization with stop strings.

Text is emitted as deltas. While a request runs, the last (longest stop string - 1)
characters are held back, so a stop string that completes over several tokens is never
partly streamed; nothing past a matched stop string is ever emitted (the stop string itself is
when the request asks for it: vLLM's `include_stop_str_in_output`). A trailing incomplete
UTF-8 sequence (decoded as U+FFFD) is held back while the request runs, since the next token
may complete it, and emitted as decoded at the finish: the deltas always add up to the text.

Each token costs two decodes of a short window of ids, not a decode of the whole output:

    ids:   [ t0 t1 ... | t7 t8 | t9 t10 ]
                       ^prefix ^read    ^len(ids)
    text = stable + decode(ids[prefix:])[len(decode(ids[prefix:read])):]
           stable = the text of ids[:read]

The window starts at the last folded token, not at `read`, so whatever a decoder does to the
first token it sees (strip a leading space, garble a byte sequence cut in half) happens to both
decodes alike and cancels. New tokens are folded into `stable` once their text is non-empty and
does not end in U+FFFD (a complete character). `FullDecodeDetokenizer` is the reference: it
decodes the whole output every step.

A request's `skip_special_tokens=False` keeps the special tokens in the text (an
<|end_of_turn|> the model writes is read as such), as vLLM's detokenizer does.
"""

from __future__ import annotations

from workers.sampling import SamplingParams
from workers.tokenizer import ChatTokenizer

_INCOMPLETE = "\ufffd"


class _StopAndHold:
    """The emission rules over the output's text so far (shared by both detokenizers). With
    `min_tokens` (vLLM's), no stop string ends the output within its first min_tokens tokens: the
    first one searched for is one that completes in the text of token min_tokens + 1."""

    def __init__(self, stop: tuple[str, ...], min_tokens: int = 0, include_stop: bool = False):
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self.tokens = 0
        self.text = ""
        self._sent = 0

    def _advance(self, text: str) -> tuple[str, bool]:
        """`text` is the output's whole text now; returns (delta to emit, whether a stop string matched)."""
        self.tokens += 1
        if self.stop and self.tokens > self.min_tokens:
            # Each stop string is searched where it would end in the new text (as vLLM does); the
            # earliest match wins, at a tie the first listed.
            found = [(i, s) for s in self.stop if (i := text.find(s, max(0, len(self.text) - len(s) + 1))) >= 0]
            if found:
                cut, matched = min(found, key=lambda f: f[0])
                self.text = text[: cut + len(matched)] if self.include_stop else text[:cut]
                return self.flush(), True
        self.text = text
        upto = min(len(text) - self.hold, len(text.rstrip(_INCOMPLETE)))
        if upto <= self._sent:
            return "", False
        delta = text[self._sent : upto]
        self._sent = upto
        return delta, False

    def flush(self) -> str:
        delta = self.text[self._sent :]
        self._sent = len(self.text)
        return delta


class _Decode:
    """The tokenizer's decode as a request's `skip_special_tokens` / `spaces_between_special_tokens` ask."""

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool):
        self.tokenizer = tokenizer
        self.kwargs = {name: value for name, value in (("skip_special_tokens", skip_special_tokens),
                                                       ("spaces_between_special_tokens", spaces_between_special_tokens))
                       if not value}  # the defaults are the decode's own

    def __call__(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)


class Detokenizer(_StopAndHold):
    def __init__(self, tokenizer: ChatTokenizer, stop: tuple[str, ...], min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        super().__init__(stop, min_tokens, include_stop)
        self.decode = _Decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._stable = ""  # the text of ids[:read]
        self._prefix_text = ""  # decode(ids[prefix:read])

    def update(self, token_id: int) -> tuple[str, bool]:
        """One more output token; returns (text delta to emit, whether a stop string matched)."""
        ids = self._ids
        ids.append(token_id)
        window = self.decode(ids[self._prefix :])
        if window.startswith(self._prefix_text):
            tail = window[len(self._prefix_text) :]
            text, fold = self._stable + tail, tail and not tail.endswith(_INCOMPLETE)
        else:  # a decoder whose windows are not prefix-stable: the whole output, then fold from here
            text = self.decode(ids)
            fold = text and not text.endswith(_INCOMPLETE)
            if fold:
                self._read = len(ids) - 1  # the next window starts at the last token
        if fold:
            self._stable = text
            self._prefix, self._read = self._read, len(ids)
            self._prefix_text = self.decode(ids[self._prefix : self._read])
        return self._advance(text)


class FullDecodeDetokenizer(_StopAndHold):
    """The reference: decodes the whole output on every token."""

    def __init__(self, tokenizer: ChatTokenizer, stop: tuple[str, ...], min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        super().__init__(stop, min_tokens, include_stop)
        self.decode = _Decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._ids: list[int] = []

    def update(self, token_id: int) -> tuple[str, bool]:
        self._ids.append(token_id)
        return self._advance(self.decode(self._ids))


def detokenizer_for(tokenizer: ChatTokenizer, params: SamplingParams) -> Detokenizer:
    """A request's detokenizer, as its SamplingParams ask."""
    return Detokenizer(tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output,
                       params.skip_special_tokens, params.spaces_between_special_tokens)
