"""The tokenizer built from GGUF metadata, checked against transformers' own GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), which is built by independent code."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from monokernel.model.bundled import bundled_gguf_path
from monokernel.model.gguf_import import convert_gguf
from monokernel.model.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT
from monokernel.errors import TokenizerError
pytest.importorskip("gguf")  # helpers.gguf (the tiny GGUF writer) needs it
from helpers.gguf import leftovers, tiny_gguf  # noqa: E402

STRINGS = {
    "unicode": "naïve café, Ünïcödé, 日本語, Привет",
    "emoji": "👍🏽 🇫🇷 👨‍👩‍👧",
    "code": "def f(x):\n\treturn x**2  # ok",
    "whitespace": "a    b\n\n\n  c\t\t",
    "digits": "12345 3.14159 2024-11-30",
    "special": "<|im_start|>user\nhi<|im_end|>",
    "edges": " leading space, trailing space ",
    "contractions": "I'm sure they'll say it's DON'T",
}


def hf_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(bundled_dir):  # noqa: F811
    return Tokenizer.from_file(str(bundled_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def theirs():
    return hf_gguf_tokenizer(bundled_gguf_path())


# ==== the bundled SmolLM2 tokenizer ================================================================

@pytest.mark.parametrize("text", STRINGS.values(), ids=STRINGS.keys())
def test_bundled_matches_transformers(ours, theirs, text):
    ids = ours.encode(text).ids
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert theirs.decode(ids) == text


def test_bundled_digits_one_per_token(ours):
    enc = ours.encode(STRINGS["digits"])
    digit_tokens = [t for t in enc.tokens if any(c.isdigit() for c in t)]
    assert len(digit_tokens) == sum(c.isdigit() for c in STRINGS["digits"])
    assert all(sum(c.isdigit() for c in t) == 1 for t in digit_tokens)
    pieces = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str("x2024 y")]
    assert pieces == ["x", "2", "0", "2", "4", "Ġy"]


def test_bundled_special_tokens_are_single_ids(ours):
    assert ours.encode("<|im_start|>").ids == [1]
    assert ours.encode("<|im_end|>").ids == [2]
    assert ours.encode("<|endoftext|>").ids == [0]
    assert ours.encode("hi").ids == ours.encode("hi", add_special_tokens=True).ids  # no BOS added


def test_bundled_tokenizer_config(bundled_dir):  # noqa: F811
    import gguf

    tc = json.loads((bundled_dir / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tc["add_bos_token"] is False
    reader = gguf.GGUFReader(bundled_gguf_path())
    assert tc["chat_template"] == reader.fields["tokenizer.chat_template"].contents()


def test_bundled_chat_template(bundled_dir, ours, theirs):  # noqa: F811
    from monokernel.model.chat_template import render_chat_template

    tc = json.loads((bundled_dir / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4."}]
    text = render_chat_template(tc, messages, add_generation_prompt=True)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = ours.encode(text).ids
    assert ids[0] == 1 and ids[1] != 1  # the template's <|im_start|>, no BOS added in front
    assert ids.count(1) == text.count("<|im_start|>") == 4
    assert ours.decode(ids, skip_special_tokens=False) == text


# ==== tiny files: each pre-tokenizer ===============================================================

TINY_STRINGS = ["the in thea 12 x123", "Hello  world\n\n 42!", "ünï 日本 👍", "<think>a</think>",
                "<|im_start|>the<|im_end|>"]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_tiny_matches_transformers(tmp_path, pre):
    src = tmp_path / f"{pre}.gguf"
    tiny_gguf(src, pre=pre)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    theirs = hf_gguf_tokenizer(src)
    for s in TINY_STRINGS:
        ids = ours.encode(s).ids
        assert ids == theirs.encode(s), (pre, s)
        assert ours.decode(ids, skip_special_tokens=False) == s


def test_tiny_smollm_splits_digits_where_gpt2_merges(tmp_path):
    """The tiny vocabulary has the merge "1 2": the gpt2 pre-tokenizer uses it, smollm may not."""
    got = {}
    for pre in ("gpt2", "smollm"):
        src = tmp_path / f"{pre}.gguf"
        tiny_gguf(src, pre=pre)
        tok = Tokenizer.from_file(str(convert_gguf(src, tmp_path / pre, progress=False)
                                      / "tokenizer.json"))
        got[pre] = tok.encode("x12").tokens
    assert got == {"gpt2": ["x", "12"], "smollm": ["x", "1", "2"]}


def test_tiny_added_tokens(tmp_path):
    """Control tokens (type 3) are special; user-defined ones (type 4) are whole but not special."""
    src = tmp_path / "t.gguf"
    tiny_gguf(src)
    tok = Tokenizer.from_file(str(convert_gguf(src, tmp_path / "hf", progress=False)
                                  / "tokenizer.json"))
    ids = tok.encode("<|im_start|><think>the").ids
    assert ids[:2] == [1, 3]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>the"
    assert tok.get_vocab_size(with_added_tokens=True) == tok.get_vocab_size(False)


def test_tiny_add_bos(tmp_path):
    src = tmp_path / "bos.gguf"
    tiny_gguf(src, add_bos=True)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("the").ids[0] == 1 and tok.encode("the").ids.count(1) == 1
    assert tok.encode("the", add_special_tokens=False).ids[0] != 1
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_split_patterns_match_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert GGUF_PRE_TOKENIZER_SPLITS["qwen2"] == QWEN2_SPLIT
    assert GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"] == LLAMA3_SPLIT


@pytest.mark.parametrize("kind", ["bert", "t5", "rwkv"])
def test_unsupported_tokenizer_model_names_itself_and_the_supported(tmp_path, kind):
    src = tmp_path / "t.gguf"
    tiny_gguf(src, tokenizer=kind)
    with pytest.raises(TokenizerError, match=rf"'{kind}'.*supported: gpt2, llama"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


# ==== GGUF edges, against llama.cpp's src/llama-vocab.cpp ========================================

@pytest.mark.parametrize("pre, bos", [("llama-bpe", True), ("llama3", True), ("llama-v3", True),
                                      ("qwen2", False), ("smollm", False), ("gpt-2", False)])
def test_bos_without_add_bos_token_follows_llamacpp(tmp_path, pre, bos):
    """No tokenizer.ggml.add_bos_token: llama.cpp adds a BOS for its Llama-3 pre-tokenizers
    (their branch sets add_bos = true), not for the other byte-level BPE ones."""
    src = tmp_path / f"{pre}.gguf"
    tiny_gguf(src, pre=pre, meta={"add_bos_token": None})
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert (tok.encode("the").ids[0] == 1) is bos
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is bos
    # the file's own flag wins
    src2 = tmp_path / f"{pre}-said.gguf"
    tiny_gguf(src2, pre=pre, meta={"add_bos_token": not bos})
    tok2 = Tokenizer.from_file(str(convert_gguf(src2, tmp_path / "hf2", progress=False)
                                   / "tokenizer.json"))
    assert (tok2.encode("the").ids[0] == 1) is (not bos)


@pytest.mark.parametrize("pre, words", [(None, "has no pre-tokenizer"),
                                        ("default", "names the pre-tokenizer 'default'")])
def test_a_missing_or_default_pre_tokenizer_is_refused_not_read_as_gpt2(tmp_path, pre, words):
    src = tmp_path / "legacy.gguf"
    tiny_gguf(src, pre=pre)
    with pytest.raises(TokenizerError, match=rf"legacy\.gguf: {words} \(tokenizer\.ggml\.pre\)\. "
                                             r"llama\.cpp reads that as its legacy") as e:
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert "convert_hf_to_gguf.py" in str(e.value)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_the_converters_spelling_gpt_2_is_gpt2s_regex(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py writes "gpt-2" (llama-vocab.cpp reads it as its GPT2
    pre-tokenizer); it used to be refused. It splits as our "gpt2" does."""
    toks = {}
    for pre in ("gpt-2", "gpt2"):
        src = tmp_path / f"{pre}.gguf"
        tiny_gguf(src, pre=pre)
        toks[pre] = Tokenizer.from_file(str(convert_gguf(src, tmp_path / pre, progress=False)
                                            / "tokenizer.json"))
    for s in TINY_STRINGS + ["x12 the's  1234!!"]:
        assert toks["gpt-2"].encode(s).ids == toks["gpt2"].encode(s).ids, s
    assert toks["gpt-2"].encode("x12").tokens == ["x", "12"]
