"""Hugging Face model folder -> ModelConfig + bf16 weights + tokenizer.

A model is a folder with ``config.json``, ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), ``tokenizer.json`` and optionally ``tokenizer_config.json`` and
``generation_config.json``. A ``.gguf`` file is converted once into such a folder in the cache
(see :mod:`monokernel.model.gguf_import`); ``None`` means the bundled SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import ml_dtypes
import numpy as np

from .config import ModelConfig
from .cache import cache_dir, gguf_cache_dir
from ..errors import (CacheError, CheckpointError, ConfigError, TensorMismatchError,
                      TokenizerError)

BF16 = np.dtype(ml_dtypes.bfloat16)
# safetensors dtype names -> NumPy (the ones safetensors.numpy reads, and BF16)
_DTYPES = {"BF16": BF16, "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
           "F64": np.dtype(np.float64), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
           "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
           "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
           "BOOL": np.dtype(bool)}


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    weights: Mapping[str, np.ndarray]  # HF names -> bf16 arrays, [out, in] orientation
    tokenizer: Any  # tokenizers.Tokenizer
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name map: every tensor a checkpoint of this config must hold, with its shape."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_dim)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_dim,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


# Tensors a checkpoint may hold that we do not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


class WeightStore(Mapping):
    """HF name -> bf16 array [out, in], read from the safetensors files at each access and
    never kept: a backend holds the one copy of the weights it computes with (the NumPy
    reference float32, a kernel backend its device buffers), not a second bf16 one.

    A bf16 tensor is a copy-on-write memory map of its bytes in the file (writable; writes stay
    in this process): reading it costs page-cache hits, not a fresh anonymous copy, and the
    mapping goes when the array does. Other dtypes are converted to bf16 as safetensors'
    ``astype`` would, into a new array."""

    def __init__(self, files: dict[str, Path]):
        self._files = files  # name -> the file holding it

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._files[name]
        try:
            return _map_tensor(path, name).astype(BF16, copy=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} (was the file changed "
                                  f"after loading?): {type(e).__name__}: {e}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _map_tensor(path: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file (8-byte little-endian header length, JSON header of
    dtype / shape / data_offsets, then the data) as an array over a private map of its bytes.
    The header is read again at every access, so a file changed since loading fails here
    with its reason instead of yielding other bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + n > size:
            raise ValueError(f"header of {n} bytes does not fit the file's {size}")
        header = json.loads(f.read(n))
        data_end = 8 + n + max((int(t["data_offsets"][1]) for k, t in header.items()
                                if k != "__metadata__"), default=0)
        if data_end != size:  # what safetensors checks on opening: a truncated or padded file
            raise ValueError(f"the header's data ends at byte {data_end}, the file at {size}")
        info = header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"unsupported dtype {info['dtype']}")
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dtype.itemsize or start < 0 or 8 + n + end > size:
            raise ValueError(f"data_offsets [{start}, {end}] do not hold {info['dtype']} "
                             f"{list(shape)} within the file's {size} bytes")
        if count == 0:
            return np.empty(shape, dtype)
        offset = 8 + n + start
        page = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(f.fileno(), offset + end - start - page, access=mmap.ACCESS_COPY,
                           offset=page)
    return np.frombuffer(mapped, dtype, count, offset - page).reshape(shape)


def load_weights(model_dir: str | Path, cfg: ModelConfig) -> WeightStore:
    """Check every tensor's name and shape against the config from the file headers
    (safetensors checks there that the data section fits the file, so a truncated file fails
    now); the data is read when a backend asks for it."""
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    expected = expected_tensors(cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, Path] = {}
    unexpected: list[str] = []
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="numpy") as f:
                names = list(f.keys())
                for name in names:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints store the shared matrix twice
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    files[name] = path
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file "
                                  f"(truncated or corrupt?): {e}") from None
    missing = [n for n in expected if n not in shapes]
    misshaped = [f"{n} {shapes[n]} (expected {expected[n]})"
                 for n in expected if n in shapes and shapes[n] != expected[n]]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected)}")
        if misshaped:
            parts.append(f"misshaped: {', '.join(misshaped)}")
        raise TensorMismatchError(f"{model_dir}: tensors do not match config.json; "
                                  + "; ".join(parts))
    return WeightStore(files)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def load_tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():  # some folders ship only SentencePiece's tokenizer.model
        from .gguf_tokenizer import tokenizer_from_sentencepiece_model

        return tokenizer_from_sentencepiece_model(model_dir)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from None


def resolve_model_dir(model: str | Path | None, progress: bool = True) -> Path:
    """A model argument -> an HF folder: None is the bundled model, a .gguf file is converted
    into the cache once, a folder is used as it is."""
    if model is None:
        from .bundled import bundled_model_dir

        with _cache_writes():
            return bundled_model_dir(progress=progress)
    if isinstance(model, (bytes, bytearray)) or not isinstance(model, (str, Path)):
        raise CheckpointError(f"model must be a folder or .gguf path (str or Path), got "
                              f"{type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from . import gguf_import

        out = gguf_cache_dir(path)
        if not gguf_import.marker_matches(out, gguf_import.source_marker(path)):
            with _cache_writes():
                gguf_import.convert_gguf(path, out, progress=progress, overwrite=True)
        return out
    if path.is_dir():
        return path
    raise CheckpointError(f"{model}: no such model folder or .gguf file")


class _cache_writes:
    """OSError while converting into the cache -> CacheError naming the cache and the fix."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if isinstance(err, OSError):
            raise CacheError(f"cannot write the monokernel cache {cache_dir()} "
                             f"({type(err).__name__}: {err}); set MONOKERNEL_CACHE to a "
                             f"writable folder") from None
        return False


def load_model(model: str | Path | None = None, progress: bool = True) -> LoadedModel:
    model_dir = resolve_model_dir(model, progress=progress)
    cfg = ModelConfig.from_hf(model_dir)
    gen = _read_json(model_dir / "generation_config.json")
    eos = gen.get("eos_token_id")
    if eos is not None:  # generation_config often names more stop ids (e.g. <|im_end|>)
        extra = tuple(eos) if isinstance(eos, list) else (eos,)
        cfg = cfg.replace(eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + extra)))
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    template_file = model_dir / "chat_template.jinja"  # where newer HF folders keep it
    if "chat_template" not in tokenizer_config and template_file.is_file():
        tokenizer_config["chat_template"] = template_file.read_text()
    return LoadedModel(path=model_dir, config=cfg, weights=load_weights(model_dir, cfg),
                       tokenizer=load_tokenizer(model_dir), tokenizer_config=tokenizer_config,
                       generation_config=gen)
