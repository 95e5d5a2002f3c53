"""Every error on a deliberately broken input: the specific exception type, a message that names
the file, tensor or token, and nothing left behind (the model folder, its parent and the cache are
byte-for-byte as before, and a model that refused a prompt still generates correctly after).
GGUF failures are covered in test_gguf.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from monokernel import LLM, SamplingParams
from monokernel.errors import (CheckpointError, ConfigError, MonokernelError, NumericalError,
                               PromptError, TensorMismatchError, TokenizerError,
                               UnsupportedArchitectureError)
from monokernel.model.loader import BF16, load_model
from monokernel.model.synth import write_synthetic

GREEDY8 = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file under the roots -> sha256 of its content (folders as entries too)."""
    out: dict[str, str] = {}
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            out[dirpath] = "dir"
            for f in filenames:
                p = os.path.join(dirpath, f)
                out[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


@pytest.fixture
def broken(tmp_path, synth_dir):
    """A private copy of the tiny checkpoint, in a folder of its own, to break."""
    d = tmp_path / "models" / "tiny"
    shutil.copytree(synth_dir("tiny"), d)
    return d


def expect_clean_failure(exc, match, fn, *watched: Path):
    """Run fn on a private, empty MONOKERNEL_CACHE, expect exc matching `match`, and check
    that neither that cache nor the watched folders changed. (The session's cache is shared
    with the other pytest-xdist workers, which write builds, proofs and models into it at any
    time: a snapshot of it raced them in CI.)"""
    with tempfile.TemporaryDirectory(prefix="monokernel-clean-failure-") as private:
        cache = Path(private) / "cache"
        shared = os.environ["MONOKERNEL_CACHE"]
        os.environ["MONOKERNEL_CACHE"] = str(cache)
        try:
            before = snapshot(cache, *watched)
            with pytest.raises(exc, match=match) as e:
                fn()
            assert isinstance(e.value, MonokernelError) or exc is FileExistsError
            assert snapshot(cache, *watched) == before
        finally:
            os.environ["MONOKERNEL_CACHE"] = shared
    return e.value


def test_a_failure_that_leaves_a_cache_entry_is_caught():
    """expect_clean_failure's negative control: a call that writes an entry into the cache it
    runs on (cache_dir(), read when it runs), then fails, does not pass it."""
    from monokernel.model.cache import cache_dir

    def leaves_one():
        (cache_dir() / "models").mkdir(parents=True)
        (cache_dir() / "models" / "half-written").write_bytes(b"x")
        raise ConfigError("bad")

    with pytest.raises(AssertionError):
        expect_clean_failure(ConfigError, "bad", leaves_one)


def edit_config(d: Path, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def rewrite_weights(d: Path, edit):
    w = load_file(str(d / "model.safetensors"))
    edit(w)
    save_file(w, str(d / "model.safetensors"))


# ==== prompts ===================================================================================

@pytest.fixture(scope="module")
def tiny_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", max_seq_len=16, progress=False)


def assert_still_works(llm, ids, want):
    assert llm.generate(ids, GREEDY8).token_ids == want


@pytest.fixture(scope="module")
def good_run(tiny_llm):
    ids = [5, 6, 7]
    return ids, tiny_llm.generate(ids, GREEDY8).token_ids


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-str", "empty-ids"])
def test_empty_prompt(tiny_llm, good_run, synth_dir, prompt):
    expect_clean_failure(PromptError, "empty", lambda: tiny_llm.generate(prompt, GREEDY8),
                         synth_dir("tiny"))
    with pytest.raises(PromptError):
        tiny_llm.stream(prompt, GREEDY8)  # raised at the call, not at the first next()
    assert_still_works(tiny_llm, *good_run)


def test_prompt_longer_than_context(tiny_llm, good_run, synth_dir):
    ids = list(range(3, 23))  # 20 tokens, context 16
    err = expect_clean_failure(PromptError, "20 tokens", lambda: tiny_llm.generate(ids, GREEDY8),
                               synth_dir("tiny"))
    assert "16" in str(err)
    text = "the " * 20
    assert len(tiny_llm.encode(text)) >= 16
    with pytest.raises(PromptError, match="context"):
        tiny_llm.generate(text, GREEDY8)
    with pytest.raises(PromptError):  # exactly full: no room for one generated token
        tiny_llm.generate(list(range(3, 19)), GREEDY8)
    assert_still_works(tiny_llm, *good_run)


def test_prompt_that_nearly_fills_the_context_stops_at_the_end(tiny_llm):
    # 14 prompt tokens + at most 2 generated = the 16 positions of the context
    c = tiny_llm.generate(list(range(3, 17)), SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert len(c.token_ids) == 2 and c.finish_reason == "length"


@pytest.mark.parametrize("ids, bad", [([5, 99999], 99999), ([5, 1000], 1000), ([-1, 5], -1)])
def test_token_outside_vocabulary(tiny_llm, good_run, synth_dir, ids, bad):
    err = expect_clean_failure(PromptError, "vocabulary",
                               lambda: tiny_llm.generate(ids, GREEDY8), synth_dir("tiny"))
    assert str(bad) in str(err) and "1000" in str(err)  # the id and the vocabulary size
    assert_still_works(tiny_llm, *good_run)


# ==== config ====================================================================================

def test_unknown_architecture(broken):
    edit_config(broken, architectures=["GPTNeoXForCausalLM"])
    err = expect_clean_failure(UnsupportedArchitectureError, "GPTNeoXForCausalLM",
                               lambda: LLM(broken, backend="numpy", progress=False),
                               broken.parent)
    assert broken.name in str(err)


@pytest.mark.parametrize("field", ["num_hidden_layers", "vocab_size", "rms_norm_eps"])
def test_missing_config_field(broken, field):
    edit_config(broken, **{field: None})
    expect_clean_failure(ConfigError, field, lambda: load_model(broken, progress=False),
                         broken.parent)


def test_missing_rope_theta(broken):
    edit_config(broken, rope_theta=None)
    expect_clean_failure(ConfigError, "rope_theta", lambda: load_model(broken, progress=False),
                         broken.parent)


def test_config_not_json(broken):
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    expect_clean_failure(ConfigError, "config.json", lambda: load_model(broken, progress=False),
                         broken.parent)


def test_no_such_model(tmp_path):
    expect_clean_failure(CheckpointError, "nowhere",
                         lambda: load_model(tmp_path / "nowhere", progress=False), tmp_path)


# ==== tensors ===================================================================================

def test_missing_extra_and_misshaped_tensors_all_named(broken):
    def edit(w):
        del w["model.layers.1.mlp.up_proj.weight"]
        del w["model.norm.weight"]
        w["model.layers.2.mlp.up_proj.weight"] = np.ones((160, 96), np.float32).astype(BF16)
        k = "model.layers.0.self_attn.k_proj.weight"
        w[k] = w[k][:31]
    rewrite_weights(broken, edit)
    err = expect_clean_failure(TensorMismatchError, "tensors do not match",
                               lambda: load_model(broken, progress=False), broken.parent)
    msg = str(err)
    assert "missing: model.norm.weight, model.layers.1.mlp.up_proj.weight;" in msg
    assert "unexpected: model.layers.2.mlp.up_proj.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight (31, 96) (expected (32, 96))" in msg
    assert str(broken) in msg


@pytest.mark.parametrize("what", ["missing", "extra", "misshaped"])
def test_each_tensor_mismatch_alone(broken, what):
    name = "model.layers.0.mlp.gate_proj.weight"

    def edit(w):
        if what == "missing":
            del w[name]
        elif what == "extra":
            w["model.layers.0.mlp.gate_proj.bias"] = np.ones(160, np.float32).astype(BF16)
        else:
            w[name] = np.ones((160, 95), np.float32).astype(BF16)
    rewrite_weights(broken, edit)
    err = expect_clean_failure(TensorMismatchError, what.replace("extra", "unexpected"),
                               lambda: load_model(broken, progress=False), broken.parent)
    assert (name if what != "extra" else "gate_proj.bias") in str(err)
    assert isinstance(err, CheckpointError)


def test_untied_checkpoint_without_lm_head(tmp_path):
    d = write_synthetic("llama3-tiny", tmp_path / "m")  # untied: lm_head.weight required
    rewrite_weights(d, lambda w: w.pop("lm_head.weight"))
    expect_clean_failure(TensorMismatchError, "missing: lm_head.weight",
                         lambda: load_model(d, progress=False), tmp_path)


@pytest.mark.parametrize("keep", [4, 100, 0.5, -1], ids=["in-length", "in-header", "half",
                                                          "last-byte"])
def test_truncated_safetensors(broken, keep):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) - 1)
    f.write_bytes(data[:n])
    err = expect_clean_failure(CheckpointError, "model.safetensors",
                               lambda: load_model(broken, progress=False), broken.parent)
    assert str(f) in str(err)
    assert not isinstance(err, TensorMismatchError)


@pytest.mark.parametrize("corruption", ["json", "length", "offset"])
def test_corrupt_safetensors_header(broken, corruption):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, body = data[8:8 + n], data[8 + n:]
    if corruption == "json":
        header = b"{" * n
    elif corruption == "length":
        data = (1 << 40).to_bytes(8, "little") + data[8:]
    else:
        assert b'"data_offsets":[0,' in header
        header = header.replace(b'"data_offsets":[0,', b'"data_offsets":[7,')
    if corruption != "length":
        data = data[:8] + header + body
    f.write_bytes(data)
    err = expect_clean_failure(CheckpointError, "safetensors",
                               lambda: load_model(broken, progress=False), broken.parent)
    assert str(f) in str(err)


def test_missing_weights_file(broken):
    (broken / "model.safetensors").unlink()
    expect_clean_failure(CheckpointError, "model.safetensors",
                         lambda: load_model(broken, progress=False), broken.parent)


def test_sharded_index_with_missing_shard(broken):
    (broken / "model.safetensors").rename(broken / "model-00001-of-00002.safetensors")
    w = load_file(str(broken / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in w}}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_clean_failure(CheckpointError, "model-00002-of-00002.safetensors",
                         lambda: load_model(broken, progress=False), broken.parent)


def test_sharded_checkpoint_loads(broken, synth_dir):
    """Control for the test above: a complete two-shard checkpoint loads the same weights."""
    w = load_file(str(broken / "model.safetensors"))
    (broken / "model.safetensors").unlink()
    names = sorted(w)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for fname, ns in shards.items():
        save_file({n: w[n] for n in ns}, str(broken / fname))
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    got = load_model(broken, progress=False).weights
    want = load_model(synth_dir("tiny"), progress=False).weights
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[n].view(np.uint16), want[n].view(np.uint16)) for n in want)


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    expect_clean_failure(TokenizerError, "tokenizer.json",
                         lambda: load_model(broken, progress=False), broken.parent)


# ==== numerics ==================================================================================

def test_nan_weights_give_numerical_error(broken):
    def edit(w):
        norm = w["model.norm.weight"].astype(np.float32)
        norm[17] = np.nan
        w["model.norm.weight"] = norm.astype(BF16)
    rewrite_weights(broken, edit)
    llm = LLM(broken, backend="numpy", progress=False)
    err = expect_clean_failure(NumericalError, "NaN", lambda: llm.generate("the", GREEDY8),
                               broken.parent)
    assert "token id" in str(err)


def test_nan_mid_generation(tiny_llm, good_run, monkeypatch):
    """Logits that turn NaN at the second decode step stop generation with NumericalError
    (the numpy backend batches: every step is a run_table)."""
    ex = tiny_llm.engine.executor
    real_run = ex.run_table
    calls = []

    def run_table(table):
        out = real_run(table)
        calls.append(len(table))
        if len(calls) == 3:
            out.logits = out.logits.copy()
            out.logits[:, 42] = np.nan
        return out

    monkeypatch.setattr(ex, "run_table", run_table)
    with pytest.raises(NumericalError, match="42"):
        tiny_llm.generate([5, 6, 7], GREEDY8)
    assert len(calls) == 3
    monkeypatch.undo()
    assert_still_works(tiny_llm, *good_run)


# ==== synthetic checkpoints =====================================================================

def test_write_synthetic_refuses_non_empty_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    expect_clean_failure(FileExistsError, "not empty", lambda: write_synthetic("tiny", out),
                         tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_write_synthetic_into_empty_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    write_synthetic("tiny", out)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_write_synthetic_interrupted_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C after the checkpoint's header and its first chunk are written (the writer's
    pwrite calls; synth.write_synth_safetensors): no folder, no partial file."""
    import os

    from monokernel.model import synth

    calls, real = [], os.pwrite

    def pwrite_then_interrupt(fd, data, pos):
        calls.append(pos)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(fd, data, pos)

    monkeypatch.setattr(synth.os, "pwrite", pwrite_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic("tiny", tmp_path / "out")
    assert calls[0] == 0 and len(calls) > 2  # the header, chunks, then the interrupt
    assert list(tmp_path.iterdir()) == []


def test_write_synthetic_unknown_shape(tmp_path):
    expect_clean_failure(ConfigError, "nosuch", lambda: write_synthetic("nosuch", tmp_path / "o"),
                         tmp_path)
    assert list(tmp_path.iterdir()) == []
