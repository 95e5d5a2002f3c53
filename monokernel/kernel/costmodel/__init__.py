"""The cost model: predicted time of one decode step of a Program on a named GPU.

Split by concern, each in one place:

- ``gpu``: the GPU's constants, ONE table, each row with its range and its source
  (shared/PERFORMANCE.md section 1 for the H200);
- ``design``: the kernel's design knobs (``KernelDesign``), the named designs and
  ``design_for`` (what megakernel.cu implements now: change it in the commit that changes the
  kernel);
- ``parts``: the costs the ops share and the types of an op's cost entry;
- each op's own entry: ``cost`` in kernel/ops/<op>.py, beside its tiling;
- ``tokens``: steps of many tokens (designs v7, v8); ``levers``: what the throughput levers
  of the many-token design charge (design v8's knobs); ``floor``: what no kernel tiling its
  mat-muls as the built one does can beat (the L2 bytes of a mat-mul's busiest block, the
  weights and K/V from HBM, the mma), and the floor with the input split;
- ``simulate``: the discrete-event simulation of the per-block queues, ``predict``.

Every number this package prints is a prediction, not a measurement.
"""

from .design import (BUILT_MMA, DESIGNS, GENERATION_STEPS, V5, V6, KernelDesign, design,
                     design_for)
from .gpu import CONSTANTS, GPU, constant_range, corner, gpu
from .measured import KNOBS as MEASURED_KNOBS
from .measured import SOURCE as MEASURED_SOURCE
from .measured import measured_decode
from .parts import OpBatch, Phases, block_sum_us, hop_latency, hop_parts, step_end_us
from .simulate import (Prediction, Static, busy_constants, busy_us, predict, predict_range,
                       prefetch_issue_us, sensitivity)

__all__ = ["BUILT_MMA", "CONSTANTS", "DESIGNS", "GENERATION_STEPS", "GPU", "KernelDesign",
           "MEASURED_KNOBS", "MEASURED_SOURCE", "OpBatch", "Phases", "Prediction", "Static", "V5",
           "V6",
           "block_sum_us", "busy_constants", "busy_us", "constant_range", "corner", "design",
           "design_for", "gpu", "hop_latency", "hop_parts", "measured_decode", "predict",
           "predict_range", "prefetch_issue_us", "sensitivity", "step_end_us"]
