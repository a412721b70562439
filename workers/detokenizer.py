"""Incremental detokenization with stop strings.

Text is emitted as deltas. While a request runs, the last (longest stop string - 1)
characters are held back, so a stop string that completes over several tokens is never
partly streamed; nothing past a matched stop string is ever emitted. A trailing incomplete
UTF-8 sequence (decoded as U+FFFD) is held back while the request runs, since the next token
may complete it, and emitted as decoded at the finish: the deltas always add up to the text.
"""

from __future__ import annotations

from workers.tokenizer import ChatTokenizer


class Detokenizer:
    def __init__(self, tokenizer: ChatTokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0

    def update(self, output_ids: list[int]) -> tuple[str, bool]:
        """Returns (text delta to emit, whether a stop string matched)."""
        text = self.tokenizer.decode(output_ids)
        search_from = max(0, len(self.text) - self.hold)
        cut = min((i for i in (text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = text[:cut]
            return self.flush(), True
        self.text = text
        upto = min(len(text) - self.hold, len(text.rstrip("\ufffd")))
        if upto <= self._sent:
            return "", False
        delta = text[self._sent : upto]
        self._sent = upto
        return delta, False

    def flush(self) -> str:
        delta = self.text[self._sent :]
        self._sent = len(self.text)
        return delta
