"""Synthetic checkpoints (monokernel/model/synth.py): the streaming writer is bit for bit
``synth_weights``, chunk boundaries included, and the file loads as a checkpoint."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from monokernel.model import synth


@pytest.mark.parametrize("shape,chunk", [("tiny", 100), ("qwen2-tiny", 96 * 7 + 5),
                                         ("llama3-tiny", 1 << 22)])
def test_streamed_checkpoint_is_synth_weights(tmp_path, monkeypatch, shape, chunk):
    """Rows drawn a chunk at a time (small chunks: many boundaries, one not on a row multiple
    of anything), biases and untied heads included."""
    monkeypatch.setattr(synth, "CHUNK_VALUES", chunk)
    cfg = synth.synthetic_config(shape)
    synth.write_synth_safetensors(cfg, tmp_path / "m.safetensors", seed=3)
    got, want = load_file(str(tmp_path / "m.safetensors")), synth.synth_weights(cfg, seed=3)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint16), w.view(np.uint16), name)


def test_written_checkpoint_loads(tmp_path):
    from monokernel.model.loader import load_model

    out = synth.write_synthetic("tiny", tmp_path / "tiny", seed=0)
    m = load_model(out, progress=False)
    assert m.config == synth.synthetic_config("tiny").replace(name=m.config.name)
    emb = m.weights["model.embed_tokens.weight"]
    assert emb.shape == (1000, 96) and np.isfinite(emb.astype(np.float32)).all()
