"""GGUF -> Hugging Face folder.

A GGUF (llama.cpp's single-file format) holds quantized weights and, as metadata, the config and the
tokenizer. :func:`convert_gguf` turns one into the folder the rest of monokernel reads:
``model.safetensors`` (bf16, HF names, [out, in]), ``config.json`` (written by
:meth:`ModelConfig.to_hf_dict`), ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json`` and ``monokernel.json`` (where it came from; the cache marker).

Accepted: tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(:data:`TENSOR_TYPES`; so Q4_K_M, Q5_K_M and the other K-quant mixes); tokenizers ``gpt2``
(byte-level BPE, with llama.cpp's BOS default and pre-tokenizer names) and ``llama``
(SentencePiece), see :mod:`monokernel.model.gguf_tokenizer`;
architectures llama, qwen2, qwen3. Anything else is refused by name, with the supported list.

Invariants:
- The folder appears whole or not at all: everything is written into a temporary sibling folder
  that is renamed into place last, and removed on any failure, Ctrl-C and a full disk included
  (OutputWriteError). A process killed outright leaves it behind; its name holds the pid, and
  the next conversion into the same parent removes it once that process is gone.
- ``monokernel.json`` (:func:`source_marker`) identifies the source by content, not by name:
  the whole metadata section and the first and last MiB of the weights
  (:mod:`monokernel.model.gguf_header`), so a renamed copy is not converted again and an
  in-place metadata edit is.
- Nothing is guessed. A missing RoPE theta, an unknown pre-tokenizer or an unsupported tensor type
  is an error naming the file and the key, tensor or name.
- llama.cpp permutes the Q and K rows of arch ``llama`` (its RoPE rotates adjacent pairs, HF's
  rotates halves); we undo that. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig, RopeScaling
from .gguf_header import content_key, read_header
from .gguf_tokenizer import TOKEN_CONTROL, add_bos_default, build_tokenizer
from ..errors import GGUFError, OutputExistsError, OutputWriteError
from ..progress import progress_bar, waiting

# 2: llama-bpe files without add_bos_token get llama.cpp's BOS; the marker keys on content
CONVERTER_VERSION = 2

# Tensor types imported, each dequantized to float32 by the gguf package's own decoders
# (gguf.quants.dequantize), then rounded to bf16. The K-quants (256-value super-blocks) are what
# llama.cpp's Q2_K...Q6_K, Q4_K_M and Q5_K_M files hold.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# GGUF general.architecture -> our arch name (ModelConfig.arch).
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF per-layer tensor name -> HF name under model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}



# ==== public API ===================================================================================

def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, unpermute: bool = True,
                 progress: bool = True, overwrite: bool = False) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` and return its path.

    ``unpermute=False`` skips undoing llama.cpp's Q/K row order; it exists for the negative-control
    test only (for SmolLM2 the first 4 greedy tokens still agree, then the text goes elsewhere).
    """
    src = Path(gguf_path)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise OutputExistsError(f"{out}: exists and is not empty; nothing was written. Pass "
                                "--overwrite (overwrite=True) to replace it, or name a new folder")
    with waiting(f"reading {src.name}", enabled=progress):  # seconds for a big vocabulary
        reader = _open_gguf(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out.parent)
    # the owner's pid in the name: a later run removes the folder once that process is gone
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        cfg = read_config(reader, src)
        with waiting(f"building the tokenizer of {src.name}", enabled=progress):
            tokenizer = build_tokenizer(tokenizer_metadata(reader), src)
        try:
            _write_weights(reader, src, cfg, tmp / "model.safetensors", unpermute, progress)
            _write_json(tmp / "config.json", cfg.to_hf_dict())
            _write_text(tmp / "tokenizer.json", tokenizer.to_str())
            _write_json(tmp / "tokenizer_config.json", _tokenizer_config(reader, cfg))
            _write_json(tmp / "generation_config.json", _generation_config(reader, cfg))
            # Last, so a folder with a marker is a folder that was finished.
            _write_json(tmp / "monokernel.json", source_marker(src))
        except OSError as e:
            raise _write_error(e, out, tmp) from None
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_error(e: OSError, out: Path, tmp: Path) -> OutputWriteError:
    """A write that failed (a full disk, a quota, a read-only folder), said with the space."""
    need = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
    try:
        free = shutil.disk_usage(tmp).free
    except OSError:
        free = None
    what = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what += (f": {need / 1e6:.0f} MB were written before it"
                 + (f", {free / 1e6:.0f} MB are free there" if free is not None else ""))
    return OutputWriteError(f"{out}: cannot write the converted model ({what}); the partial "
                            f"output was removed")


# what a conversion writes: a partial folder holds nothing else
_OUTPUT_FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "monokernel.json"}


def remove_stale_partials(folder: Path, *, legacy_age_s: float = 3600.0) -> list[Path]:
    """Remove the ``.tmp-*`` / ``.old-*`` folders of conversions into ``folder`` whose process
    is gone (killed with -9, a power cut): their name ends in ``-<pid>-<8 hex>``. A live
    process's folder, a concurrent conversion's, is kept. Names from before the pid was
    recorded (``-<8 hex>`` only) are removed once an hour old (a conversion takes seconds).
    Only folders holding nothing but a conversion's files are touched: ``folder`` may be any
    folder of the user's (``monokernel convert x.gguf OUT``)."""
    removed = []
    for p in [*folder.glob(".tmp-*"), *folder.glob(".old-*")]:
        m = re.fullmatch(r"\.(?:tmp|old)-.+?(?:-(\d+))?-[0-9a-f]{8}", p.name)
        try:
            if not m or not p.is_dir() or not {c.name for c in p.iterdir()} <= _OUTPUT_FILES:
                continue
            if m.group(1) is not None:
                stale = not _alive(int(m.group(1)))
            else:
                stale = time.time() - p.stat().st_mtime > legacy_age_s
        except OSError:
            continue
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError:
        return True  # cannot tell: keep it
    return True


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows [n_heads * head_dim], any trailing shape).

    llama.cpp's convert script does ``w.reshape(n, 2, rows//n//2, in).swapaxes(1, 2)``: it
    interleaves each head's two rotary halves. This is its inverse.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot un-permute {rows} rows over {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_marker(gguf_path: str | Path) -> dict[str, Any]:
    """What a conversion was made from (``monokernel.json``, the cache marker): the file's
    name (for people), its size and content key (``gguf_header.content_key``: the whole
    metadata section and the first and last MiB of the weights) and the converter version."""
    path = Path(gguf_path)
    return {"source": path.name, "size": path.stat().st_size, "content_sha256": content_key(path),
            "converter_version": CONVERTER_VERSION}


def marker_matches(folder: Path, want: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a finished conversion of the content ``want`` describes (any
    file name: the same content under another name is the same model)."""
    have = _read_marker(folder)
    drop = lambda d: {k: v for k, v in d.items() if k != "source"}  # noqa: E731
    return have is not None and drop(have) == drop(want)


# ==== reading the file ===========================================================================

def _open_gguf(path: Path):
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF files needs the 'gguf' package, which is not "
                        "installed here: pip install 'gguf>=0.10'") from None
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    # Truncation first, from the header: GGUFReader would report a file cut inside the
    # weights as a numpy reshape error
    header = read_header(path)
    for t in header.tensors:
        try:
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        except (ValueError, KeyError):
            continue  # a type the gguf package does not know: named later, by _dequantize
        end = header.data_start + t.offset + int(np.prod(t.dims, dtype=np.int64)) // block * nbytes
        if end > header.size:
            raise GGUFError(f"{path}: truncated: tensor {t.name!r} ends at byte {end} of a "
                            f"{header.size}-byte file (an interrupted download or copy?)")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, OSError... on a bad file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default: Any = None, *, path: Path | None = None) -> Any:
    """The value of metadata ``key``; ``default`` when absent, or GGUFError when path is given."""
    f = reader.fields.get(key)
    if f is None:
        if path is not None:
            raise GGUFError(f"{path}: metadata key {key!r} is missing")
        return default
    v = f.contents()
    return v.item() if isinstance(v, np.generic) else v


def _f32(x: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def read_config(reader, path: Path) -> ModelConfig:
    """ModelConfig from the metadata of an open ``gguf.GGUFReader`` of file ``path``."""
    arch_name = _field(reader, "general.architecture", path=path)
    if arch_name not in _ARCHS:
        raise GGUFError(f"{path}: architecture {arch_name!r} is not supported "
                        f"(supported: {', '.join(_ARCHS)})")
    a = arch_name

    def need(key: str) -> Any:
        return _field(reader, f"{a}.{key}", path=path)

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{a}.attention.key_length", hidden // heads))
    rope_dims = _field(reader, f"{a}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(f"{path}: partial RoPE ({a}.rope.dimension_count={rope_dims}, "
                        f"head_dim={head_dim}) is not supported")
    # llama.cpp would fall back to 10000 for llama; a wrong theta gives plausible garbage, so no.
    theta = _f32(_field(reader, f"{a}.rope.freq_base", path=path))
    tokens = _field(reader, "tokenizer.ggml.tokens", path=path)
    names = {t.name: t for t in reader.tensors}
    emb = names.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    if int(emb.shape[1]) != len(tokens):
        raise GGUFError(f"{path}: token_embd.weight has {int(emb.shape[1])} rows but the "
                        f"tokenizer lists {len(tokens)} tokens")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        arch=_ARCHS[a], hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")), num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)), head_dim=head_dim,
        vocab_size=len(tokens), max_position_embeddings=int(need("context_length")),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=theta, rope_scaling=None,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=_eos_ids(reader, tokens),
        name=str(_field(reader, "general.name", path.stem)))
    return cfg.replace(rope_scaling=_rope_scaling(reader, path, cfg, names))


def _rope_scaling(reader, path: Path, cfg: ModelConfig, tensors: dict) -> RopeScaling | None:
    """Llama-3.x scaling. llama.cpp stores it only as the per-frequency divisors ``rope_freqs``;
    we fit the standard llama3 parameters to them and fail unless they reproduce every divisor."""
    a = _field(reader, "general.architecture")
    kind = _field(reader, f"{a}.rope.scaling.type")
    if kind not in (None, "none"):
        raise GGUFError(f"{path}: rope scaling type {kind!r} is not supported")
    t = tensors.get("rope_freqs.weight")
    if t is None:
        return None
    divisors = _dequantize(t, path).astype(np.float64)
    orig = int(_field(reader, f"{a}.rope.scaling.original_context_length", 8192))
    fit = RopeScaling(factor=float(np.float32(divisors.max())), low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=orig)
    plain = cfg.inv_freq()
    got = plain / cfg.replace(rope_scaling=fit).inv_freq()
    if divisors.shape != got.shape or not np.allclose(got, divisors, rtol=1e-4):
        raise GGUFError(f"{path}: rope_freqs.weight does not match llama3 RoPE scaling "
                        f"(factor {fit.factor}, low 1, high 4, original context {orig})")
    return fit


def _eos_ids(reader, tokens: list[str]) -> tuple[int, ...]:
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    ids = [] if eos is None else [int(eos)]
    types = _field(reader, "tokenizer.ggml.token_type", [])
    # ChatML: a turn ends with <|im_end|>, which is not always the file's eos.
    if "<|im_end|>" in tokens:
        i = tokens.index("<|im_end|>")
        if i < len(types) and types[i] == TOKEN_CONTROL and i not in ids:
            ids.append(i)
    return tuple(ids)


# ==== weights ====================================================================================

def _hf_name(name: str, path: Path) -> str | None:
    """HF name of GGUF tensor ``name``; None for tensors that are not weights (rope_freqs)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name == "rope_freqs.weight":
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and \
            parts[3] in ("weight", "bias"):
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFError(f"{path}: tensor {name!r} is not one monokernel knows how to map")


def _dequantize(t, path: Path) -> np.ndarray:
    """float32 array in numpy order of the GGUF dims reversed, i.e. HF's [out, in]."""
    from gguf.quants import dequantize

    if t.tensor_type.name not in TENSOR_TYPES:
        raise GGUFError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not "
                        f"supported (supported: {', '.join(TENSOR_TYPES)})")
    want = tuple(reversed([int(d) for d in t.shape]))
    try:
        with np.errstate(all="ignore"):  # inf * 0 in a corrupt block: reported below, by name
            w = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        w = w.reshape(want)
    except (ValueError, TypeError) as e:  # a byte count that is not whole blocks of the shape
        raise GGUFError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {want}) cannot "
                        f"be dequantized: {e}") from None
    bad = w.size - int(np.isfinite(w).sum())
    if bad:  # a corrupt scale; the model would only ever print NaN
        raise GGUFError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) dequantizes to {bad} "
                        "non-finite values (inf or NaN)")
    return w


def _write_weights(reader, path: Path, cfg: ModelConfig, out: Path, unpermute: bool,
                   progress: bool) -> None:
    """model.safetensors, written tensor by tensor as each is dequantized: the header first
    (every shape is known from the GGUF's tensor table), then the bf16 bytes. So memory holds
    one tensor, not the model twice, and the bar counts the bytes as they reach the disk (the
    safetensors package's save_file wrote everything in one silent call at the end, ~13 s for
    SmolLM2 on a busy machine). The format: u64 header length, the JSON header padded with
    spaces to 8 bytes, the data in header order; safetensors.safe_open checks it on load."""
    import ml_dtypes

    permuted = cfg.arch == "llama" and unpermute
    plan = [(t, hf) for t in reader.tensors if (hf := _hf_name(t.name, path)) is not None]
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": path.name}}
    offset = 0
    for t, hf in plan:
        shape = [int(d) for d in reversed(t.shape)]  # HF's [out, in]
        n = int(np.prod(shape, dtype=np.int64)) * 2
        header[hf] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out, "wb") as f, progress_bar(total=offset, desc=f"converting {path.name}",
                                            unit="B", unit_scale=True, enabled=progress) as bar:
        _write_bytes(f, len(blob).to_bytes(8, "little") + blob)
        for t, hf in plan:
            w = _dequantize(t, path)
            if permuted and ".attn_q." in t.name:
                w = unpermute_qk(w, cfg.num_heads)
            elif permuted and ".attn_k." in t.name:
                w = unpermute_qk(w, cfg.num_kv_heads)
            data = np.ascontiguousarray(w.astype(ml_dtypes.bfloat16)).tobytes()
            _write_bytes(f, data)
            bar.update(len(data))


def _write_bytes(f, data: bytes) -> None:
    """Every byte of a conversion goes through here (a test makes it fail as a full disk)."""
    f.write(data)


# ==== tokenizer ==================================================================================

def tokenizer_metadata(reader) -> dict[str, Any]:
    """The file's ``tokenizer.ggml.*`` metadata, keys without that prefix (for build_tokenizer)."""
    prefix = "tokenizer.ggml."
    return {key[len(prefix):]: _field(reader, key) for key in reader.fields
            if key.startswith(prefix)}


def _token(tokens: list[str], reader, key: str) -> str | None:
    i = _field(reader, f"tokenizer.ggml.{key}")
    return None if i is None else tokens[int(i)]


def _tokenizer_config(reader, cfg: ModelConfig) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    d: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(tokens, reader, "bos_token_id"),
        "eos_token": _token(tokens, reader, "eos_token_id"),
        "pad_token": _token(tokens, reader, "padding_token_id"),
        "unk_token": _token(tokens, reader, "unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token",
                                     add_bos_default(_field(reader, "tokenizer.ggml.model"),
                                                     _field(reader, "tokenizer.ggml.pre")))),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        d["chat_template"] = template
    return d


_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def _generation_config(reader, cfg: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        ids = list(cfg.eos_token_ids)
        d["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        d["pad_token_id"] = int(pad)
    for key, hf in _SAMPLING_KEYS.items():
        v = _field(reader, f"general.sampling.{key}")
        if v is not None:
            d[hf] = v
    if "temperature" in d:
        d["do_sample"] = d["temperature"] > 0
    return d


# ==== files ======================================================================================

def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _write_text(path: Path, text: str) -> None:
    with open(path, "wb") as f:
        _write_bytes(f, text.encode("utf-8"))


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "monokernel.json").read_text())
    except (OSError, ValueError):
        return None


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an old ``out`` is moved aside first, then removed."""
    old = None
    if out.exists():
        old = out.parent / f".old-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        old.unlink()
