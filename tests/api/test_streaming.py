"""TextStream on real byte-level tokenizers (the bundled SmolLM2 one and the synthetic one, which
spells every non-ASCII character byte by byte): pieces are whole UTF-8 characters and whole
grapheme clusters, they join to the decoded text, and stop strings are cut, never half-shown."""

from __future__ import annotations

import pytest
import regex
from tokenizers import Tokenizer

from monokernel.streaming import TextStream

TEXTS = [
    "Hi 👍🏽 and 👨\u200d👩\u200d👧\u200d👦 family 🏳️\u200d🌈!",  # skin tone, ZWJ family, flag
    "é ü 中文 👩🏿\u200d🚀 end",
    "e\u0301\u0302 x",  # combining accents spread over tokens
    "🇫🇷🇩🇪",  # regional-indicator pairs: two clusters of two code points each
    "plain ascii, nothing held back for long",
    "👍🏽",  # the whole text is one cluster
]


@pytest.fixture(scope="module", params=["smollm2", "synthetic"])
def tokenizer(request, synth_dir):
    if request.param == "smollm2":
        d = request.getfixturevalue("bundled_dir")
    else:
        d = synth_dir("tiny")
    return Tokenizer.from_file(str(d / "tokenizer.json"))


def stream_pieces(tok, ids, stop=(), min_tokens=0):
    s = TextStream(tok, tuple(stop), min_tokens=min_tokens)
    pieces = []
    for i in ids:
        pieces.append(s.push(i))
        if s.stopped:
            break
    pieces.append(s.finish())
    return s, pieces


def cluster_bounds(text: str) -> set[int]:
    """Character offsets at which a grapheme cluster starts or the text ends."""
    bounds, pos = {0}, 0
    for cl in regex.findall(r"\X", text):
        pos += len(cl)
        bounds.add(pos)
    return bounds


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_never_split_characters_or_clusters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    if not text.isascii():
        # the test means something only if some character spans several tokens
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    s, pieces = stream_pieces(tokenizer, ids)
    assert "".join(pieces) == text == s.text
    bounds = cluster_bounds(text)
    end = 0
    for p in pieces:
        assert "\ufffd" not in p
        p.encode("utf-8")  # no lone surrogates
        end += len(p)
        assert end in bounds, f"piece {p!r} ends inside a grapheme cluster of {text!r}"


def test_last_cluster_is_held_until_the_next_starts(tokenizer):
    text = "ab 👍🏽"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    s = TextStream(tokenizer)
    shown = "".join(s.push(i) for i in ids)
    # the emoji could still take a ZWJ sequence: held back until finish
    assert shown == "ab " and s.finish() == "👍🏽"


def test_stop_string_spanning_tokens_is_cut(tokenizer):
    text = "The cat is a pet. More text after the stop."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    stop = "is a p"
    # the stop string must span several tokens, or this test would not test the spanning case
    decoded = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in d for d in decoded)
    s, pieces = stream_pieces(tokenizer, ids, stop=[stop])
    assert s.stopped
    assert "".join(pieces) == s.text == "The cat "
    # nothing after the stop was consumed: the stream stopped at the token completing it
    assert len(s.ids) < len(ids)
    assert stop in tokenizer.decode(s.ids)


def test_stop_prefix_held_back_then_released(tokenizer):
    """'cat' could begin the stop string 'cat dog': it is not shown until ' is' rules it out."""
    ids = tokenizer.encode("The cat is", add_special_tokens=False).ids
    s = TextStream(tokenizer, ("cat dog",))
    shown = ""
    for i in ids:
        shown += s.push(i)
        if tokenizer.decode(s.ids).endswith("cat"):
            assert "c" not in shown
    shown += s.finish()
    assert shown == "The cat is" and not s.stopped


def test_several_stop_strings_earliest_wins(tokenizer):
    ids = tokenizer.encode("one, two; three", add_special_tokens=False).ids
    s, pieces = stream_pieces(tokenizer, ids, stop=["three", ";"])
    assert "".join(pieces) == "one, two" and s.stopped
    assert s.stop_hit == ";"  # the one that ended the text (vLLM's stop_reason)


def test_stop_at_very_start_gives_empty_text(tokenizer):
    ids = tokenizer.encode("STOP here", add_special_tokens=False).ids
    s, pieces = stream_pieces(tokenizer, ids, stop=["STOP"])
    assert "".join(pieces) == "" and s.stopped


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """vLLM's rule: no stop check before min_tokens tokens; then the text from there on (and a
    stop string's length before it, so one completed by the min_tokens-th token counts)."""
    text = "a; b; c; d; e; f; g"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    s, pieces = stream_pieces(tokenizer, ids, stop=[";"])
    assert "".join(pieces) == "a"
    first_len = len(s.ids)
    s, pieces = stream_pieces(tokenizer, ids, stop=[";"], min_tokens=first_len + 1)
    assert s.stopped and s.stop_hit == ";"
    joined = "".join(pieces)
    assert joined == s.text and text.startswith(joined) and joined.startswith("a; ")
    assert len(s.ids) >= first_len + 1
    # the cut is the first ';' the check could see: none between the start of the search and
    # the end of the text it returned
    assert ";" not in joined[len(tokenizer.decode(s.ids[:first_len])):]
    s, pieces = stream_pieces(tokenizer, ids, stop=[";"], min_tokens=len(ids) + 5)
    assert not s.stopped and "".join(pieces) == text
