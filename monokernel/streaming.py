"""Incremental detokenization for streaming.

Pieces never split a UTF-8 character (a byte-level token can end mid-character: the decoder then
yields U+FFFD) nor a grapheme cluster (an emoji with skin tone or ZWJ spans several tokens): the
last cluster is held back until the next one starts or the stream ends. Text that could be the
start of a stop string is held back too, and a stop string ends the text before it. With
``min_tokens``, stop strings are looked for only once that many tokens were generated (vLLM's
rule), in the text from then on (and a stop string's length before it).
"""

from __future__ import annotations

import regex


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.stop_hit: str | None = None  # the stop string that ended the text
        self._search_from = 0
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already handed out
        self.stopped = False  # a stop string was found
        self.text = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to show."""
        self.ids.append(token_id)
        text = self._decode()
        if len(self.ids) < self.min_tokens:
            self._search_from = max(0, len(text) - max(map(len, self.stop), default=1) + 1)
        elif self._cut_at_stop(text):
            return self._flush()
        safe = len(text.rstrip("\ufffd"))
        # hold back the last grapheme cluster: the next token may still extend it
        clusters = regex.findall(r"\X", text[:safe])
        if clusters:
            safe -= len(clusters[-1])
        # hold back a tail that could begin a stop string
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k:safe] == s[:k]:
                    safe = min(safe, safe - k)
                    break
        self.text = text
        return self._take(max(safe, self.emitted))

    def _cut_at_stop(self, text: str) -> bool:
        hits = [(i, s) for i, s in ((text.find(s, self._search_from), s) for s in self.stop)
                if i >= 0]
        if hits:
            i, self.stop_hit = min(hits, key=lambda h: h[0])
            self.text = text[:i]
            self.stopped = True
        return bool(hits)

    def _take(self, upto: int) -> str:
        piece = self.text[self.emitted:upto]
        self.emitted = upto
        return piece

    def finish(self) -> str:
        """End of generation: hand out whatever was held back."""
        return self._flush()

    def _flush(self) -> str:
        if not self.stopped:
            self.text = self._decode()
        return self._take(len(self.text))
