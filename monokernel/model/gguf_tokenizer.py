"""Tokenizers a model folder may lack: from GGUF metadata, and from a SentencePiece ``tokenizer.model``.

A GGUF has no ``tokenizer.json``; it lists the vocabulary as metadata under llama.cpp's keys
(``tokenizer.ggml.*``). :func:`build_tokenizer` turns that into a ``tokenizers.Tokenizer`` the way
transformers' own GGUF loader does (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``),
but for where SentencePiece puts its ``▁`` prefix, which follows llama.cpp (below). Two kinds are
supported (:data:`TOKENIZER_KINDS`):

- ``gpt2``: byte-level BPE with the file's merges, split first by the regex of the file's
  pre-tokenizer (:data:`PRE_TOKENIZERS`). SmolLM2, Qwen2/2.5/3, Llama-3.
- ``llama``: SentencePiece BPE with byte fallback (TinyLlama, Llama-2 and its fine-tunes). The file
  has tokens, scores and token types but no merges: every pair of vocabulary pieces that joins into
  another piece is a merge, ranked by the joined piece's score (``spm_merges``, transformers' rule).
  Spaces become ``▁``, characters missing from the vocabulary their UTF-8 bytes ``<0x..>``, and a
  BOS is added unless ``tokenizer.ggml.add_bos_token`` says otherwise. A ``▁`` is put in front of
  the text and again after each special token, as llama.cpp does (``tokenizer.ggml.add_space_prefix``,
  default true) and as the models' own legacy ``tokenizer.json`` (Prepend + Replace normalizer)
  does. transformers' GGUF loader differs there: its ``Metaspace(prepend_scheme="first")`` puts no
  ``▁`` after a special token nor before text that already starts with a space; on every other
  text the two agree token for token (tests/model/test_sentencepiece.py checks both facts).

:func:`tokenizer_from_sentencepiece_model` covers HF folders that ship only ``tokenizer.model``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..errors import TokenizerError

TOKENIZER_KINDS = ("gpt2", "llama")

# Pre-tokenizer split patterns, as llama.cpp's llama-vocab.cpp and the models' tokenizer.json have them.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# The pre-tokenizers (tokenizer.ggml.pre) of byte-level BPE files, by the names llama.cpp's
# src/llama-vocab.cpp gives them. "gpt-2" is what llama.cpp's convert_hf_to_gguf.py writes for
# GPT-2's regex; "gpt2" is an older spelling some converters wrote, read the same way.
LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3")
PRE_TOKENIZERS = ("smollm", "gpt-2", "gpt2") + LLAMA3_PRES + ("qwen2",)
# llama.cpp reads a missing tokenizer.ggml.pre, and "default", as its legacy pre-tokenizer
# (LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes in turn, not GPT-2's), warning "GENERATION
# QUALITY WILL BE DEGRADED! CONSIDER REGENERATING THE MODEL". We refuse such a file rather
# than guess which pre-tokenizer the model was trained with.
LEGACY_PRE = "default"

# llama.cpp's token types (tokenizer.ggml.token_type), the same numbers as SentencePiece's.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"  # ▁, SentencePiece's escaped space


# ==== GGUF metadata -> Tokenizer ===================================================================

def build_tokenizer(meta: Mapping[str, Any], path: Path):
    """A ``tokenizers.Tokenizer`` from a GGUF's ``tokenizer.ggml.*`` metadata (keys without the
    ``tokenizer.ggml.`` prefix: ``model``, ``tokens``, ``token_type``...) of file ``path``."""
    kind = meta.get("model")
    if kind is None:
        raise TokenizerError(f"{path}: metadata key 'tokenizer.ggml.model' is missing")
    if kind not in TOKENIZER_KINDS:
        raise TokenizerError(f"{path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not "
                             f"supported (supported: {', '.join(TOKENIZER_KINDS)})")
    tokens = meta.get("tokens")
    if tokens is None:
        raise TokenizerError(f"{path}: metadata key 'tokenizer.ggml.tokens' is missing")
    types = list(meta.get("token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        raise TokenizerError(f"{path}: the token list has duplicate entries")
    tok = (_byte_level_bpe if kind == "gpt2" else _sentencepiece_bpe)(meta, tokens, types, path)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerError(f"{path}: added tokens grew the vocabulary past {len(tokens)}")
    _post_processor(tok, meta, tokens, path)
    return tok


def add_bos_default(kind: str, pre: str | None = None) -> bool:
    """Whether llama.cpp adds a BOS when the file has no ``tokenizer.ggml.add_bos_token``:
    for a SentencePiece vocabulary, and for the Llama-3 pre-tokenizers (llama-vocab.cpp sets
    ``add_bos = true`` in their branch; Llama-3 GGUFs converted before the key existed rely on
    it); not for the other byte-level BPE ones."""
    return kind == "llama" or (kind == "gpt2" and pre in LLAMA3_PRES)


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int], path: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("pre")
    if pre is None or pre == LEGACY_PRE:
        what = ("has no pre-tokenizer (tokenizer.ggml.pre)" if pre is None
                else "names the pre-tokenizer 'default' (tokenizer.ggml.pre)")
        raise TokenizerError(
            f"{path}: {what}. llama.cpp reads that as its legacy pre-tokenizer and warns that "
            f"generation quality will be degraded; monokernel does not guess which one the model "
            f"was trained with. Re-convert the model with a current llama.cpp "
            f"convert_hf_to_gguf.py (supported: {', '.join(PRE_TOKENIZERS)})")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{path}: pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZERS)})")
    merges = meta.get("merges")
    if merges is None:
        raise TokenizerError(f"{path}: metadata key 'tokenizer.ggml.merges' is missing")
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
        bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                         ignore_merges=pre in LLAMA3_PRES)
    except Exception as e:
        raise TokenizerError(f"{path}: cannot build the BPE model ({e})") from None
    tok = Tokenizer(bpe)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in ("gpt-2", "gpt2"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = QWEN2_SPLIT if pre == "qwen2" else LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: each split of a piece into two pieces of
    the vocabulary, best joined score first (ties: shorter left, then shorter right piece).

    The same rule, and order, as transformers' ``generate_merges(vocab, vocab_scores)``: a piece's
    splits are listed by the ids of their halves, and a stable sort keeps that order among ties.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], float(score)) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int], path: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    scores = meta.get("scores")
    if scores is None:
        raise TokenizerError(f"{path}: metadata key 'tokenizer.ggml.scores' is missing "
                             "(a SentencePiece vocabulary needs its scores to rank merges)")
    if len(scores) != len(tokens):
        raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(scores)} scores")
    merges = meta.get("merges")
    pairs = ([tuple(m.split(" ")) for m in merges] if merges is not None
             else spm_merges(list(tokens), list(scores)))
    try:
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, pairs, fuse_unk=True,
                         byte_fallback=True, dropout=None)
    except Exception as e:
        raise TokenizerError(f"{path}: cannot build the SentencePiece BPE model ({e})") from None
    tok = Tokenizer(bpe)
    # llama.cpp's rule: "▁" for every space, and a "▁" in front of each stretch of text between
    # special tokens. The normalizer runs on each such stretch (special tokens are split out
    # first), and the whole stretch is one BPE word: SentencePiece has no pre-tokenizer.
    prefix = bool(meta.get("add_space_prefix", True))
    steps_in = [normalizers.Prepend(SPM_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence(steps_in + [normalizers.Replace(" ", SPM_SPACE)])
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # the prepended ▁ of the first piece is no part of the text
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    named = {int(meta[k]) for k in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                    "padding_token_id") if meta.get(k) is not None}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, (t, ty) in enumerate(zip(tokens, types))
                            if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) or i in named])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for i, (t, ty) in enumerate(zip(tokens, types))
                    if ty == TOKEN_USER_DEFINED and i not in named])
    return tok


def _post_processor(tok, meta: Mapping[str, Any], tokens: list[str], path: Path) -> None:
    """BOS (and EOS) around each sequence, as the file's add_bos_token/add_eos_token say."""
    from tokenizers import processors

    add_bos = bool(meta.get("add_bos_token", add_bos_default(meta["model"], meta.get("pre"))))
    add_eos = bool(meta.get("add_eos_token", False))
    ends = []
    for flag, key in ((add_bos, "bos_token_id"), (add_eos, "eos_token_id")):
        if not flag:
            ends.append(None)
            continue
        i = meta.get(key)
        if i is None or not 0 <= int(i) < len(tokens):
            raise TokenizerError(f"{path}: add_{key[:3]}_token is set but tokenizer.ggml.{key} "
                                 f"is {'missing' if i is None else f'{i}, out of range'}")
        ends.append((tokens[int(i)], int(i)))
    if ends == [None, None]:
        return
    bos, eos = ends

    def seq(name: str, type_id: int) -> str:
        parts = [f"{t[0]}:{type_id}" for t in (bos,) if t] + [f"${name}:{type_id}"]
        return " ".join(parts + [f"{t[0]}:{type_id}" for t in (eos,) if t])

    tok.post_processor = processors.TemplateProcessing(
        single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
        special_tokens=[x for x in dict.fromkeys(ends) if x is not None])


# ==== HF folder with only tokenizer.model ==========================================================

SPM_EXTRA = "pip install 'monokernel[sentencepiece]'  (transformers, sentencepiece, protobuf)"


def tokenizer_from_sentencepiece_model(model_dir: str | Path):
    """The ``tokenizers.Tokenizer`` transformers builds from ``model_dir/tokenizer.model`` (with the
    folder's tokenizer_config.json: its tokenizer class, legacy flag, add_bos_token...).

    This is transformers' own slow-to-fast converter; it needs transformers, sentencepiece and
    protobuf, and a TokenizerError naming them is raised where any is missing.
    """
    import importlib.util

    model_dir = Path(model_dir)
    spm_file = model_dir / "tokenizer.model"
    if not spm_file.is_file():
        raise TokenizerError(f"{model_dir}: no tokenizer.json and no tokenizer.model")
    missing = [name for name, module in (("transformers", "transformers"),
                                         ("sentencepiece", "sentencepiece"),
                                         ("protobuf", "google.protobuf"))
               if _find_spec(importlib.util, module) is None]
    if missing:
        raise TokenizerError(f"{model_dir}: has tokenizer.model but no tokenizer.json; building "
                             f"one needs {', '.join(missing)}, not installed here: {SPM_EXTRA}")
    import warnings

    from transformers import AutoTokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds on a bad file
        raise TokenizerError(f"{spm_file}: transformers cannot convert it "
                             f"({type(e).__name__}: {e})") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(f"{spm_file}: transformers gave a {type(hf).__name__}, which has no "
                             "tokenizers backend to use")
    return backend


def _find_spec(util, module: str):
    try:
        return util.find_spec(module)
    except (ImportError, ValueError):  # a missing parent package ("google")
        return None
