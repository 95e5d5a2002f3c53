"""What a GPU measured, beside what the model predicts: ``plan --predict`` prints the nearest
measurement under its prediction, so the model's error stays in sight (benchmarks/RESULTS.md
has every row, benchmarks/NOTES.md "The first GPU run" what the model missed)."""

from __future__ import annotations

# (gpu, shape) -> {context: device us per decode step}: the megakernel (backend cuda), one
# sequence, median of 50 steps, synthetic weights of the shape, one block per SM.
DECODE_US: dict[tuple[str, str], dict[int, float]] = {
    ("h200", "smollm2-135m"): {16: 653.5, 512: 679.9},
    ("h200", "qwen3-0.6b"): {16: 871.1, 512: 937.2},
    ("h200", "llama-3.2-1b"): {16: 1033.2, 512: 1052.8},
}
SOURCE = "benchmarks/RESULTS.md, 2026-12-04, commit a5ee726"
# How the kernel those rows measured differs from the one built now (design knobs): every
# block read the host's stop flag before the LM head's wait (one block per SM on the H200).
KNOBS = {"host_flag_readers": 132}

# the fields that fix a decode step's work (the name and the token ids do not)
_ARCH = ("arch", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
         "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "qk_norm")


def measured_decode(gpu_name: str, cfg, context: int) -> tuple[str, int, float] | None:
    """(shape, context, us) of the measurement nearest ``context`` for a model of the same
    architecture as a measured shape on ``gpu_name`` (h200-fit: the H200's), or None."""
    from ...model.config import ModelConfig

    want = gpu_name.lower().removesuffix("-fit")
    for (gpu, shape), rows in DECODE_US.items():
        ref = ModelConfig.from_name(shape)
        if gpu == want and all(getattr(cfg, f) == getattr(ref, f) for f in _ARCH):
            near = min(rows, key=lambda c: abs(c - context))
            return shape, near, rows[near]
    return None
