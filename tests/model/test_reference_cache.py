"""greedy_reference_run (model/reference.py): computed once, read back from the cache by the
GPU check's later processes, recomputed when the checkpoint changes."""

import os
import shutil

import numpy as np
import pytest

from monokernel.model import reference
from monokernel.model.loader import load_model


def test_greedy_reference_run_is_cached_and_keyed_by_the_checkpoint(synth_dir, tmp_path,
                                                                    monkeypatch):
    folder = shutil.copytree(synth_dir("tiny"), tmp_path / "tiny")
    m = load_model(folder, progress=False)
    fed, logits = reference.greedy_reference_run(m, [5, 17], 4)
    ref = reference.ReferenceModel(m.config, m.weights, 8)  # by hand: the same run
    want = [ref.forward([5], 0)[0], ref.forward([17], 1)[0]]
    want.append(ref.forward([int(np.argmax(want[-1]))], 2)[0])
    assert fed[:3] == [5, 17, int(np.argmax(want[1]))] and len(fed) == 4
    np.testing.assert_array_equal(logits[:3], np.stack(want))

    class Boom:
        def __init__(self, *a, **k):
            raise AssertionError("recomputed instead of read from the cache")

    monkeypatch.setattr(reference, "ReferenceModel", Boom)
    fed2, logits2 = reference.greedy_reference_run(m, [5, 17], 4)
    assert fed2 == fed and np.array_equal(logits2, logits)
    with pytest.raises(AssertionError, match="recomputed"):  # other tokens: another entry
        reference.greedy_reference_run(m, [5, 18], 4)
    st = os.stat(folder / "model.safetensors")  # a rewritten checkpoint: another entry
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(AssertionError, match="recomputed"):
        reference.greedy_reference_run(m, [5, 17], 4)
