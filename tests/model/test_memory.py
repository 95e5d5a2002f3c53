"""The NumPy backend keeps one copy of the weights: the float32 arrays it computes with. The
bf16 checkpoint is read from the file when a backend asks and is not kept. Measured in a fresh
process on the bundled SmolLM2-135M (135 M parameters: 515 MiB as float32): peak RSS was
938 MiB with the bf16 copy kept beside the float32 one, 680 MiB without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, resource


def peak_rss_mib():
    # VmHWM: this process's peak. ru_maxrss is kept across exec on Linux, so in a child of a
    # big pytest process it would report the parent's size at the fork.
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import numpy as np
from monokernel import LLM, SamplingParams
llm = LLM(backend="numpy", progress=False)
c = llm.generate("The capital of France is", SamplingParams(max_tokens=4))
ref = llm.engine.executor.ref
# every array reachable from the LLM (numpy arrays are not tracked by gc: walk the objects)
owned, seen, stack = {}, set(), [llm]
while stack:
    o = stack.pop()
    if id(o) in seen:
        continue
    seen.add(id(o))
    if isinstance(o, np.ndarray):
        while isinstance(o.base, np.ndarray):
            o = o.base
        owned[id(o)] = o.nbytes
    elif isinstance(o, dict):
        stack += list(o.values())
    elif isinstance(o, (list, tuple, set)):
        stack += list(o)
    elif type(o).__module__.startswith("monokernel") and hasattr(o, "__dict__"):
        stack += list(vars(o).values())
print(json.dumps({
    "text": c.text,
    "weight_elems": sum(a.size for a in
                        [ref.embed, ref.final_norm] + [v for L in ref.layers for v in L.values()]
                        + ([] if ref.lm_head is ref.embed else [ref.lm_head])),
    "owned_bytes": sum(owned.values()),
    "kv_bytes": ref.k_pages.nbytes + ref.v_pages.nbytes,  # the page pool, all sequences
    "peak_rss_mib": peak_rss_mib(),
}))
"""


def test_numpy_backend_holds_one_copy_of_the_weights(bundled_dir, session_cache):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]),
           "MONOKERNEL_CACHE": str(session_cache), "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["text"].startswith(" Paris")
    f32 = 4 * m["weight_elems"]
    assert 130e6 < m["weight_elems"] < 140e6  # SmolLM2-135M, tied embeddings counted once
    # every array the LLM holds: the float32 weights, the K/V cache (allocated, mostly
    # untouched), the RoPE tables; a second (bf16) copy would add 50 %
    assert f32 + m["kv_bytes"] <= m["owned_bytes"] <= f32 + m["kv_bytes"] + 0.05 * f32
    # the resident peak: the weights plus ~150-200 MiB of interpreter, numpy and tokenizer;
    # with the bf16 copy it was 938 MiB
    assert m["peak_rss_mib"] < f32 / 2**20 + 300, m


def test_weight_store_maps_the_file_privately(synth_dir):
    """A tensor is a copy-on-write map of the file, not a fresh copy: writable, and a write
    neither reaches the file nor the next access."""
    import mmap

    import numpy as np

    from monokernel.model.loader import BF16, load_model

    m = load_model(synth_dir("qwen2-tiny"), progress=False)
    name = "model.layers.1.self_attn.k_proj.weight"
    a = m.weights[name]
    assert a.dtype == BF16 and a.shape == (32, 96) and a.flags.writeable
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)
    before = a.copy()
    a[...] = 0
    assert np.array_equal(m.weights[name].view(np.uint16), before.view(np.uint16))


def test_bf16_to_float32_is_the_cast_for_every_bit_pattern():
    """The reference's shift of the bits equals ml_dtypes' cast (NaN payloads and signed zeros
    included), also into a slice of a larger array, as the q/k/v rows are written."""
    import numpy as np

    from monokernel.model.loader import BF16
    from monokernel.model.reference import as_float32, concat_float32

    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(BF16).astype(np.float32).view(np.uint32)
    assert np.array_equal(as_float32(bits.view(BF16)).view(np.uint32), want)
    parts = [bits[:1111].reshape(11, 101), bits[1111:1616].reshape(5, 101)]
    got = concat_float32([p.view(BF16) for p in parts])
    assert np.array_equal(got.view(np.uint32), want[:1616].reshape(16, 101))
