"""Special-token strings typed in user text stay text.

A tokenizer matches its special tokens (``<|im_end|>``) anywhere in the string it encodes, so a
chat message that contains one would close the turn for the user. ``ControlTokens.encode``
encodes a string in which only chosen spans are control tokens; ``content_spans`` finds where
each message's content lies in a rendered conversation, so that the special-token strings in
there are left out of those spans.
"""

from __future__ import annotations

from typing import Any, Callable

import regex

MARK = "\ue000{}\ue001"  # private-use characters: no template writes them
MARK_RE = regex.compile("\ue000(\\d+)\ue001")


class ControlTokens:
    """The special tokens of a ``tokenizers.Tokenizer`` and a twin of it that parses none."""

    def __init__(self, tokenizer: Any):
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.ids = {t.content: i for i, t in added.items() if t.special and t.content}
        alt = "|".join(regex.escape(s) for s in sorted(self.ids, key=len, reverse=True))
        self.pattern = regex.compile(alt) if alt else None
        self.plain = Tokenizer.from_str(tokenizer.to_str())
        self.plain.encode_special_tokens = True  # special-token strings are split as text

    def find(self, text: str) -> list[tuple[int, int]]:
        """Spans of special-token strings in ``text`` (leftmost-longest, as the tokenizer)."""
        return [m.span() for m in self.pattern.finditer(text)] if self.pattern else []

    def encode(self, text: str, controls: list[tuple[int, int]]) -> list[int]:
        """Token ids of ``text`` with exactly the ``controls`` spans as control tokens; the
        text between them goes through the tokenizer with special-token parsing off. That is
        what the tokenizer does itself (it splits at control tokens before pre-tokenizing),
        so with every special-token span as a control the ids are the tokenizer's."""
        ids: list[int] = []
        cur = 0
        for a, b in sorted(controls) + [(len(text), len(text))]:
            if a > cur:
                ids += self.plain.encode(text[cur:a], add_special_tokens=False).ids
            if b > a:
                ids.append(self.ids[text[a:b]])
            cur = b
        return ids

    def encode_outside(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Token ids of ``text`` in which special-token strings inside ``spans`` are text."""
        controls = [(a, b) for a, b in self.find(text)
                    if not any(x < b and a < y for x, y in spans)]
        return self.encode(text, controls)


def content_spans(text: str, contents: list[str],
                  render_marked: Callable[[list[str]], str | None]) -> list[tuple[int, int]]:
    """Where each content lies in ``text``, a rendering of messages with those contents.
    ``render_marked(markers)`` renders the same messages with a marker in place of each
    content; when putting the contents back into it gives ``text``, the markers' places are
    exact. (A template that edits contents, say strips them, falls back to finding each
    content in order, which a content equal to a piece of the template can fool.)"""
    rendering = render_marked([MARK.format(i) for i in range(len(contents))]) or ""
    spans, parts, n = [], [], 0
    for k, piece in enumerate(MARK_RE.split(rendering)):
        if k % 2 == 1 and int(piece) < len(contents):  # a captured marker index
            piece = contents[int(piece)]
            spans.append((n, n + len(piece)))
        parts.append(piece)
        n += len(piece)
    if "".join(parts) == text:
        return spans
    spans, cur = [], 0
    for c in contents:
        for cand in (c, c.strip()):
            i = text.find(cand, cur) if cand else -1
            if i >= 0:
                spans.append((i, i + len(cand)))
                cur = i + len(cand)
                break
    return spans
