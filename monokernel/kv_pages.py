"""K/V pages for batched generation: a free list, reference counts and a prefix cache.

A sequence's K/V live in pages of ``page_size`` positions; its block table lists them in
position order. Pages are handed out as positions are reached and given back when the
sequence ends, so memory follows the tokens in use.

The prefix cache is vLLM's automatic prefix caching: a full page of prompt tokens is known by
its tokens chained with the key of the page before it, so a key names the whole prefix up to
the page's end. A page given back keeps its key and stays in the free list, least recently
freed first; a later prompt with the same prefix takes it back (reference count up) instead of
prefilling it, until the page is handed out for other tokens (evicted). Keys hold the tokens
themselves, so two prefixes never share a key by a hash collision.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence


class PagesExhausted(Exception):
    """No free page: the scheduler's reservation failed to hold (a bug, not a user error)."""


class PagePool:
    def __init__(self, page_ids: Sequence[int], page_size: int):
        if page_size < 1 or not page_ids:
            raise ValueError(f"a page pool needs pages and page_size >= 1, got "
                             f"{len(page_ids)} pages of {page_size}")
        self.page_size = page_size
        self.total = len(page_ids)
        self.refs = {p: 0 for p in page_ids}
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in page_ids)
        self.key_of: dict[int, Hashable] = {}  # cached page -> its key
        self.page_of: dict[Hashable, int] = {}  # key -> cached page

    @property
    def available(self) -> int:
        """Pages that can be handed out now (free ones, cached or not)."""
        return len(self.free)

    @property
    def in_use(self) -> int:
        return self.total - len(self.free)

    def allocate(self) -> int:
        """A free page for new tokens: the least recently freed (its cache entry goes)."""
        if not self.free:
            raise PagesExhausted(f"all {self.total} K/V pages are in use")
        page, _ = self.free.popitem(last=False)
        key = self.key_of.pop(page, None)
        if key is not None:
            del self.page_of[key]
        self.refs[page] = 1
        return page

    def release(self, pages: Sequence[int]) -> None:
        """A sequence is done with ``pages``: a page nobody holds goes back to the free list
        (most recently freed last), keeping its cache key."""
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free[p] = None
            assert self.refs[p] >= 0, p

    @staticmethod
    def key(parent: Hashable | None, tokens: Sequence[int]) -> Hashable:
        return (parent, tuple(tokens))

    def register(self, page: int, key: Hashable) -> None:
        """``page`` (held, full) holds the K/V of the prefix ``key`` names."""
        if key in self.page_of or page in self.key_of:
            return  # the same prefix computed twice at once: the first copy is the cached one
        self.key_of[page] = key
        self.page_of[key] = page

    def lookup(self, tokens: Sequence[int]) -> tuple[list[int], Hashable | None]:
        """The cached pages of the longest run of whole pages at the start of ``tokens``,
        taken (reference count up), and the key of the last one (None: no hit). Give them
        back with ``release``."""
        hits, key, ps = [], None, self.page_size
        for j in range(len(tokens) // ps):
            k = self.key(key, tokens[j * ps:(j + 1) * ps])
            page = self.page_of.get(k)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.free[page]
            self.refs[page] += 1
            hits.append(page)
            key = k
        return hits, key
