"""SentencePiece tokenizers: GGUFs with ``tokenizer.ggml.model == "llama"`` (tokens, scores, token
types, byte fallback, ``▁`` for spaces, add_bos), checked against transformers' own GGUF tokenizer
conversion and, where the ``sentencepiece`` package is installed, against SentencePiece itself on a
model trained here, applied as llama.cpp applies it (a ``▁`` prefix on each stretch of text
between special tokens); and HF folders that ship only ``tokenizer.model``.

transformers' GGUF tokenizer puts no ``▁`` after a special token nor before text that starts with
a space; llama.cpp and the models' own tokenizer.json do, and so does ours. Those texts are
compared with the llama.cpp rule; every other text with transformers too.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

pytest.importorskip("gguf")  # helpers.gguf (the tiny GGUF writer) needs it

from monokernel.errors import TokenizerError  # noqa: E402
from monokernel.model import gguf_tokenizer
from monokernel.model.gguf_import import convert_gguf
from monokernel.model.gguf_tokenizer import spm_merges
from helpers.gguf import SPM_TOKENS, leftovers, tiny_gguf

STRINGS = {  # texts on which llama.cpp's rule and transformers' Metaspace agree
    "plain": "the hello world",
    "unicode": "naïve café, Ünïcödé, 日本語, Привет",
    "emoji": "👍🏽 🇫🇷 👨‍👩‍👧",
    "code": "def f(x):\n\treturn x**2  # ok",
    "whitespace": "a    b\n\n\n  c\t\t end  ",
    "digits": "12345 3.14159 2024-11-30 123",
    "bytes": "\x00\x7f é\u200b\ufeff",
    "tabs_newlines": "\n\nthe\n\t the",
    "special_first": "<s>",
    "empty": "",
}
# texts with special tokens or leading spaces, and what the pieces spell, as llama.cpp has it:
# "▁" + the text, spaces as "▁", after each special token again
LLAMA_CPP_SPELLING = {
    "x<|im_end|>the": "▁x<|im_end|>▁the",
    "<s>the</s> hello": "<s>▁the</s>▁▁hello",
    "<|im_start|>user\nhi<|im_end|>\n": "<|im_start|>▁user\nhi<|im_end|>▁\n",
    "<think>a</think> the<think>": "<think>▁a</think>▁the<think>",
    "  two": "▁▁▁two",
    " the": "▁▁the",
}


def hf_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def converted(src: Path, out: Path) -> tuple[Path, Tokenizer]:
    out = convert_gguf(src, out, progress=False)
    return out, Tokenizer.from_file(str(out / "tokenizer.json"))


# ==== the hand-written vocabulary (test_gguf.SPM_TOKENS) ===========================================

@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    src = d / "spm.gguf"
    tiny_gguf(src, arch="llama", tokenizer="llama", pre=None, add_bos=True)
    out, ours = converted(src, d / "hf")
    return src, out, ours, hf_gguf_tokenizer(src)


@pytest.mark.parametrize("text", STRINGS.values(), ids=STRINGS.keys())
def test_tiny_spm_matches_transformers(tiny_spm, text):
    _, _, ours, theirs = tiny_spm
    enc = ours.encode(text)
    assert enc.ids == theirs.encode(text)
    assert ours.decode(enc.ids, skip_special_tokens=False) == theirs.decode(enc.ids)
    assert ours.decode(enc.ids, skip_special_tokens=True) == \
        theirs.decode(enc.ids, skip_special_tokens=True)


def test_tiny_spm_pieces(tiny_spm):
    """What each rule does, spelled out: BOS first, ▁ for spaces and one in front, merges by
    score, characters outside the vocabulary as their UTF-8 bytes, specials whole."""
    _, _, ours, _ = tiny_spm
    assert ours.encode("the hello").tokens == ["<s>", "▁the", "▁hello"]
    assert ours.encode("return  12").tokens == ["<s>", "▁return", "▁▁", "12"]
    assert ours.encode("ï日").tokens == ["<s>", "▁", "<0xC3>", "<0xAF>", "日"]
    assert ours.encode("the", add_special_tokens=False).tokens == ["▁the"]
    assert ours.encode("").tokens == ["<s>"]
    assert ours.decode(ours.encode("naïve 日本 👍").ids, skip_special_tokens=True) == "naïve 日本 👍"


@pytest.mark.parametrize("text", LLAMA_CPP_SPELLING)
def test_tiny_spm_prefix_after_specials_and_before_spaces_as_llama_cpp(tiny_spm, text):
    """A ▁ before each stretch of text that follows a special token, and before a text that
    starts with a space: where transformers' GGUF tokenizer has none."""
    _, _, ours, theirs = tiny_spm
    enc = ours.encode(text, add_special_tokens=False)
    assert "".join(enc.tokens) == LLAMA_CPP_SPELLING[text]
    assert theirs.encode(text, add_special_tokens=False) != enc.ids  # the known difference
    assert "".join(theirs.convert_ids_to_tokens(theirs.encode(text, add_special_tokens=False))) \
        .count("▁") < LLAMA_CPP_SPELLING[text].count("▁")


def test_tiny_spm_round_trips(tiny_spm):
    _, _, ours, _ = tiny_spm
    for text in list(STRINGS.values()) + ["  two", " the"]:
        if "<" in text:
            continue
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text, text


def test_tiny_spm_vocabulary_and_config(tiny_spm):
    _, out, ours, _ = tiny_spm
    assert ours.get_vocab_size(with_added_tokens=True) == len(SPM_TOKENS)
    vocab = ours.get_vocab(with_added_tokens=True)
    assert all(vocab[t] == i for i, t in enumerate(SPM_TOKENS))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"], tc["add_bos_token"]) == \
        ("<s>", "</s>", "<unk>", True)


def test_spm_merges_match_transformers_generate_merges():
    from transformers.tokenization_utils_base import generate_merges

    from helpers.gguf import SPM_SCORES

    vocab = {t: i for i, t in enumerate(SPM_TOKENS)}
    want = generate_merges(vocab, dict(zip(SPM_TOKENS, SPM_SCORES)))
    got = spm_merges(SPM_TOKENS, SPM_SCORES)
    assert got == want and ("▁t", "he") in got and len(got) >= 40


def test_add_bos_defaults_on_for_spm_and_flags_are_read(tmp_path):
    """llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to; add_eos and
    add_space_prefix are read too."""
    cases = {"default": {"add_bos_token": None}, "no_bos": {"add_bos_token": False},
             "eos": {"add_bos_token": False, "add_eos_token": True},
             "no_prefix": {"add_space_prefix": False, "add_bos_token": None}}
    got = {}
    for name, meta in cases.items():
        src = tmp_path / f"{name}.gguf"
        tiny_gguf(src, arch="llama", tokenizer="llama", pre=None, meta=meta)
        out, tok = converted(src, tmp_path / name)
        got[name] = tok.encode("the x").tokens
        tc = json.loads((out / "tokenizer_config.json").read_text())
        assert tc["add_bos_token"] is (name in ("default", "no_prefix")), name
        if name != "no_prefix":
            assert tok.decode(tok.encode("the x").ids, skip_special_tokens=True) == "the x"
    assert got == {"default": ["<s>", "▁the", "▁x"], "no_bos": ["▁the", "▁x"],
                   "eos": ["▁the", "▁x", "</s>"], "no_prefix": ["<s>", "t", "he", "▁x"]}


def test_spm_without_scores_fails_naming_the_key(tmp_path, monkeypatch):
    src = tmp_path / "noscores.gguf"
    tiny_gguf(src, arch="llama", tokenizer="llama", pre=None)
    real = gguf_tokenizer._sentencepiece_bpe

    def drop_scores(meta, *a):
        return real({k: v for k, v in meta.items() if k != "scores"}, *a)

    monkeypatch.setattr(gguf_tokenizer, "_sentencepiece_bpe", drop_scores)
    with pytest.raises(TokenizerError, match=r"noscores\.gguf.*tokenizer\.ggml\.scores"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_spm_model_generates_through_llm(tiny_spm):
    """The converted llama-arch SentencePiece model loads and runs: prompt tokens with BOS, and
    the text is the decode of the generated ids."""
    from monokernel.llm import LLM
    from monokernel.sampling import SamplingParams

    _, out, ours, _ = tiny_spm
    llm = LLM(out, backend="numpy", progress=False)
    c = llm.generate("the hello", SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert c.prompt_token_ids == ours.encode("the hello").ids and c.prompt_token_ids[0] == 1
    assert len(c.token_ids) == 8 and c.text == ours.decode(c.token_ids)


# ==== a SentencePiece model trained here (needs the sentencepiece package) ==========================

CORPUS = ["The quick brown fox jumps over the lazy dog.", "def hello(world):\n    return world * 2",
          "naïve café résumé", "1234567890 3.14159", "Hello hello HELLO", "the theory of the thing",
          "  indented   text  ", "for i in range(10):\n\tprint(i)"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 400-piece BPE SentencePiece model with byte fallback and a user-defined symbol, and
    the GGUF llama.cpp's convert_hf_to_gguf.py would write from it."""
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 40), model_writer=buf, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", user_defined_symbols=["<|user|>"], minloglevel=2,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    d = tmp_path_factory.mktemp("trained")
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    (d / "gguf").mkdir()  # apart: transformers would read a tokenizer.model beside the GGUF
    src = d / "gguf" / "trained.gguf"
    _gguf_from_sentencepiece(sp, src)
    return sp, src, d / "tokenizer.model"


def _gguf_from_sentencepiece(sp, path: Path) -> None:
    """As llama.cpp's _create_vocab_sentencepiece: every piece, its score and its type."""
    import gguf

    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 4 if tokens[-1] == "<|user|>" else 1)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(True)
    w.add_add_bos_token(True)  # as convert_hf_to_gguf.py copies it from tokenizer_config.json
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TRAINED_STRINGS = [s for s in CORPUS if not s.startswith(" ")] + [
    "Hello world, the fox!", "naïve 日本 👍 Привет", "x  =  12345;\n\n\treturn", "tail spaces   ",
    "a\u00a0b", "\n\n  x"]
# where llama.cpp and transformers part: specials inside the text, leading spaces
TRAINED_SPECIAL = ["<s>hi</s> there", "hi <|user|> hello<|user|>", "<|user|>x", "  indented   text  ",
                   " one", "</s>\n<s>", "<s></s>"]
SPECIAL_PIECES = ("<s>", "</s>", "<|user|>")


def llama_cpp_reference(sp, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenize, with SentencePiece doing the BPE: BOS, then special
    pieces whole and each stretch of text between them encoded on its own, " " + text."""

    ids = [1]
    for part in re.split("(" + "|".join(map(re.escape, SPECIAL_PIECES)) + ")", text):
        if part in SPECIAL_PIECES:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)  # the model's add_dummy_prefix is llama.cpp's " " + text
    return ids


@pytest.fixture(scope="module")
def trained_tokenizers(trained, tmp_path_factory):
    sp, src, _ = trained
    _, ours = converted(src, tmp_path_factory.mktemp("trained-hf") / "hf")
    return sp, ours, hf_gguf_tokenizer(src)


@pytest.mark.parametrize("text", TRAINED_STRINGS)
def test_trained_gguf_matches_sentencepiece_and_transformers(trained_tokenizers, text):
    sp, ours, theirs = trained_tokenizers
    ids = ours.encode(text).ids
    assert ids == [1] + sp.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]) == text


@pytest.mark.parametrize("text", TRAINED_SPECIAL)
def test_trained_gguf_specials_and_leading_spaces_as_llama_cpp(trained_tokenizers, text):
    sp, ours, theirs = trained_tokenizers
    ids = ours.encode(text).ids
    assert ids == llama_cpp_reference(sp, text)
    if text != "<s></s>":  # no text between the specials: nothing to prefix
        mine = "".join(ours.encode(text).tokens)
        hf = "".join(theirs.convert_ids_to_tokens(theirs.encode(text)))
        assert hf.count("▁") < mine.count("▁") and hf.replace("▁", "") == mine.replace("▁", "")


# ==== HF folders with only tokenizer.model =========================================================

def _spm_only_folder(tmp_path: Path, model_file: Path) -> Path:
    """A folder as some HF repos ship it: tokenizer.model and tokenizer_config.json, no
    tokenizer.json."""
    d = tmp_path / "spm-only"
    d.mkdir()
    shutil.copy(model_file, d / "tokenizer.model")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "legacy": False}))
    return d


def test_tokenizer_model_only_folder_matches_sentencepiece(trained, tmp_path):
    pytest.importorskip("transformers")
    from monokernel.model.loader import load_tokenizer

    sp, _, model_file = trained
    tok = load_tokenizer(_spm_only_folder(tmp_path, model_file))
    for text in TRAINED_STRINGS:
        ids = tok.encode(text).ids
        assert ids == [1] + sp.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_model_only_folder_without_packages_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(b"\x0a\x00")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentencepiece" else real(name, *a))
    with pytest.raises(TokenizerError, match=r"tokenizer\.model but no tokenizer\.json.*"
                                             r"sentencepiece.*pip install 'monokernel\[sentencepiece\]'"):
        gguf_tokenizer.tokenizer_from_sentencepiece_model(d)


def test_folder_with_neither_tokenizer_file(tmp_path):
    from monokernel.model.loader import load_tokenizer

    with pytest.raises(TokenizerError, match="no tokenizer.json and no tokenizer.model"):
        load_tokenizer(tmp_path)
