"""The GPU's constants: ONE table, each row with its range and its source
(shared/PERFORMANCE.md section 1 for the H200), and the GPU records built from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...errors import CostModelError

# name -> (unit, {gpu: (value, low, high)}, source)
CONSTANTS: dict[str, tuple[str, dict[str, tuple[float, float, float]], str]] = {
    "sms": ("", {"h200": (132, 132, 132), "h100": (132, 132, 132)},
            "H200: measured on the H200 we test on (PERFORMANCE.md 1); H100 SXM5: datasheet"),
    "clock_ghz": ("GHz", {"h200": (1.98, 1.98, 1.98), "h100": (1.98, 1.98, 1.98)},
                  "H200: measured (PERFORMANCE.md 1); H100 SXM5: datasheet boost clock. For "
                  "reading cycle counts; the latencies below are in us already"),
    "hbm_bw": ("TB/s", {"h200": (4.3, 4.3, 4.3), "h100": (3.0, 2.8, 3.2)},
               "device-to-device copy, read+write counted. H200: measured (PERFORMANCE.md 1); "
               "H100: assumed ~90% of the 3.35 TB/s datasheet figure, not measured"),
    "hbm_latency": ("us", {"h200": (0.53, 0.35, 0.6), "h100": (0.53, 0.35, 0.6)},
                    "one warp's coalesced load from HBM: ~0.35-0.5 us unloaded (570-700 cycle "
                    "pointer chase on H100, public microbenchmarks); nominal 0.53 = 8 KB x 132 "
                    "SMs / 2.0 TB/s, the cap PERFORMANCE.md 2 gives v1's 8 KB in flight per SM; "
                    "high = loaded"),
    "l2_latency": ("us", {"h200": (0.2, 0.13, 0.3), "h100": (0.2, 0.13, 0.3)},
                   "L2 hit round trip: 260-291 cycles pointer chase (0.13-0.15 us), up to "
                   "~0.3 us to the far L2 partition (public H100 microbenchmarks, "
                   "PERFORMANCE.md 1)"),
    "l2_bw": ("TB/s", {"h200": (7.0, 5.5, 10.0), "h100": (5.5, 4.5, 7.0)},
              "L2 hit bandwidth of the whole chip; assumed from public H100 L2 microbenchmarks "
              "(5.5-7 TB/s), H200 taken a little higher; only bounds prefetched streams"),
    "fence": ("us", {"h200": (0.58, 0.3, 0.8), "h100": (0.58, 0.3, 0.8)},
              "MEMBAR.SC.GPU (waits for every outstanding store of the SM): the rest of "
              "PERFORMANCE.md's ~1.07 us per v1 hop once the parts below are counted; fitted by "
              "`monokernel calibrate` from a GPU trace"),
    "release": ("us", {"h200": (0.3, 0.2, 0.45), "h100": (0.3, 0.2, 0.45)},
                "red.release.gpu (R4): on sm_90 it compiles to MEMBAR.ALL.GPU + REDG (SASS of "
                "4b0e6fe), so it drains the block's stores, >= one L2 round trip (0.13-0.3 us) "
                "after the last store, before the add; was assumed 0.15 before the SASS was read "
                "(fence + relaxed atomic ~ release atomic: mscclpp PR 505)"),
    "ticket": ("us", {"h200": (0.5, 0.4, 0.6), "h100": (0.5, 0.4, 0.6)},
               "atom.acq_rel.gpu (ticket_add): MEMBAR.ALL.GPU; ATOMG.E.ADD (a returning atomic: "
               "one L2 round trip); CCTL.IVALL (SASS of 4b0e6fe): the store drain, the round "
               "trip and the L1 invalidate (PERFORMANCE.md 0)"),
    "cctl": ("us", {"h200": (0.02, 0.01, 0.05), "h100": (0.02, 0.01, 0.05)},
             "CCTL.IVALL (L1 invalidate after an acquire, NVIDIA/cutlass issue 3117); assumed "
             "~40 cycles"),
    "bar_sync": ("us", {"h200": (0.02, 0.01, 0.04), "h100": (0.02, 0.01, 0.04)},
                 "__syncthreads of 8 warps; assumed ~40 cycles"),
    "shfl": ("us", {"h200": (0.015, 0.01, 0.025), "h100": (0.015, 0.01, 0.025)},
             "one dependent SHFL + FADD step of a warp reduction; assumed ~30 cycles"),
    "timer": ("us", {"h200": (0.01, 0.005, 0.02), "h100": (0.01, 0.005, 0.02)},
              "read %globaltimer in the poll loop; assumed"),
    "nanosleep": ("us", {"h200": (0.05, 0.03, 0.1), "h100": (0.05, 0.03, 0.1)},
                  "__nanosleep(32) in the poll loop (sleeps 0-2x the request, coarse "
                  "granularity); assumed"),
    "schedulers": ("", {"h200": (4, 4, 4), "h100": (4, 4, 4)},
                   "warp schedulers per SM, each issuing one warp instruction per clock (Hopper "
                   "SM: four partitions; NVIDIA H100 whitepaper). Turns instruction counts of "
                   "the SASS into issue time"),
    "gemv_bw": ("TB/s", {"h200": (3.8, 3.6, 4.3), "h100": (2.7, 2.5, 3.0)},
                "the weight stream's achieved rate in a GEMV: below the copy rate (a read-only "
                "stream with FMAs behind it, one block per SM); 3.6-4.0 TB/s on an H200 in the "
                "independent SASS model (PERFORMANCE.md 0), up to the copy rate; H100 scaled"),
    "hbm_loaded_latency": ("us", {"h200": (0.7, 0.6, 1.5), "h100": (0.7, 0.6, 1.5)},
                           "a lone dependent load that misses L2 while the other SMs stream "
                           "weights (HBM queues full): 0.6-1.5 us (PERFORMANCE.md 0); program "
                           "words and late norm weights pay it"),
    "fetch_miss": ("", {"h200": (0.75, 0.5, 1.0), "h100": (0.75, 0.5, 1.0)},
                   "share of an instruction's word fetches that miss L2: the program is re-read "
                   "every step after 0.27-2.5 GB of weights passed the 50 MB L2 (~3 in 4, "
                   "PERFORMANCE.md 0)"),
    "pcie_read": ("us", {"h200": (1.3, 0.9, 2.0), "h100": (1.3, 0.9, 2.0)},
                  "LDG.E.STRONG.SYS of mapped host memory (finish_step's host stop flag): a "
                  "PCIe round trip, ~1-2 us (PERFORMANCE.md 0); assumed"),
    "pcie_serial": ("us", {"h200": (0.98, 0.88, 1.2), "h100": (0.98, 0.88, 1.2)},
                    "one read of a mapped host word when every block reads it at once: the reads "
                    "are served one after another. Measured on the H200 (2026-12-04 trace: the "
                    "LM head's 132 READY events 0.98 us apart, 0.88-1.20, each behind its "
                    "block's read of the host's stop flag); H100 assumed alike"),
    "sys_fence": ("us", {"h200": (0.8, 0.4, 1.5), "h100": (0.8, 0.4, 1.5)},
                  "MEMBAR.SC.SYS (__threadfence_system after the step's token store to host "
                  "memory): drains the store over PCIe; assumed (PERFORMANCE.md 0: the host "
                  "read and this fence 1-3 us per step together)"),
    "mma_tflops": ("TFLOP/s", {"h200": (400.0, 300.0, 600.0), "h100": (400.0, 300.0, 600.0)},
                   "bf16 mma.sync m16n8k16 with fp32 accumulate, the whole chip: ~400 of the "
                   "~990 dense TFLOP/s that wgmma reaches (PERFORMANCE.md 0.1); assumed, a GPU "
                   "run of the mma test kernel measures it. Only steps of many tokens use it"),
    "l2_fill": ("B/clk", {"h200": (64.0, 32.0, 64.0), "h100": (64.0, 32.0, 64.0)},
                "one SM's fill path from L2 (bytes per clock into the SM): assumed 64, a 128-byte "
                "line every two clocks, 32 at the slow end. Without multicast the SMs' share of "
                "l2_bw (~27 B/clk each on an H200) binds first; only a cluster's multicast "
                "(input_multicast) can use the rest. A GPU probe of one SM reading L2 measures it"),
    "launch": ("us", {"h200": (8.0, 5.0, 12.0), "h100": (8.0, 5.0, 12.0)},
               "host submit + cooperative launch + drain per launch; assumed so that R6 (N steps "
               "per launch) saves 7-8 us per token, as PERFORMANCE.md 3 predicts"),
}


# "h200-fit": the H200's table with the four constants the first GPU run's decode steps moved
# (benchmarks/NOTES.md, "The first GPU run"): fitted by least squares on the log of the six
# measured device times per step (the megakernel, one sequence, SmolLM2 / Qwen3 / Llama at
# contexts 16 and 512) on the kernel they measured (costmodel/measured.py KNOBS: every block
# read the host's flag, `pcie_serial` each); all six within 2 % after the fit, 1.14-1.58x
# before (2.3x before the reads were charged). The loaded latencies came out long (L2 0.55 us,
# HBM 0.85) and the GEMV stream a little slow (3.59 TB/s): stand-ins for per-op costs the model
# does not have yet (the same run's trace: the layer ops' busy times 1.5-2.2x the table's),
# so "h200" keeps the physical table and `plan --predict h200-fit` shows the fitted one.
H200_FIT = {"l2_latency": 0.55, "hbm_latency": 0.85, "gemv_bw": 3.59, "release": 0.62}
for _c, (_unit, _per_gpu, _src) in CONSTANTS.items():
    _v = _per_gpu["h200"]
    _f = H200_FIT.get(_c, _v[0])
    _per_gpu["h200-fit"] = (_f, min(_v[1], _f), max(_v[2], _f))


@dataclass(frozen=True)
class GPU:
    """One GPU's constants, in microseconds and bytes per microsecond (see CONSTANTS)."""

    name: str
    sms: int
    clock_ghz: float
    hbm_bw: float  # bytes/us
    hbm_latency: float
    l2_latency: float
    l2_bw: float  # bytes/us
    fence: float
    release: float
    ticket: float
    cctl: float
    bar_sync: float
    shfl: float
    timer: float
    nanosleep: float
    schedulers: int
    gemv_bw: float  # bytes/us
    hbm_loaded_latency: float
    fetch_miss: float
    pcie_read: float
    pcie_serial: float
    sys_fence: float
    launch: float
    mma_tflops: float
    l2_fill: float  # bytes/us into one SM from L2 (CONSTANTS' B/clk x the clock)

    def replace(self, **changes) -> "GPU":
        return dataclasses.replace(self, **changes)


_TB_S = 1e6  # 1 TB/s = 1e12 B/s = 1e6 B/us


def gpu(name: str) -> GPU:
    """The named GPU's nominal constants (CONSTANTS' values; ``constant_range`` has the ends)."""
    key = name.lower()
    if key not in CONSTANTS["sms"][1]:
        raise CostModelError(f"unknown GPU {name!r} (known: {', '.join(CONSTANTS['sms'][1])})")
    vals = {c: row[1][key][0] for c, row in CONSTANTS.items()}
    vals["hbm_bw"] *= _TB_S
    vals["l2_bw"] *= _TB_S
    vals["gemv_bw"] *= _TB_S
    vals["l2_fill"] *= vals["clock_ghz"] * 1e3
    vals["sms"] = int(vals["sms"])
    vals["schedulers"] = int(vals["schedulers"])
    return GPU(name=key, **vals)


def constant_range(gpu_name: str, constant: str) -> tuple[float, float]:
    _unit, per_gpu, _src = CONSTANTS[constant]
    v = per_gpu[gpu_name.lower()]
    return v[1], v[2]


# Constants whose HIGH end makes a step faster (rates, counts); for every other one, the low end.
_FASTER_WHEN_HIGH = frozenset({"sms", "clock_ghz", "hbm_bw", "l2_bw", "gemv_bw", "schedulers",
                               "mma_tflops", "l2_fill"})


def corner(gpu_name: str, fast: bool) -> GPU:
    """The GPU with every constant at the end of its range that makes a step faster (``fast``)
    or slower: the ends of `plan --predict`'s low / high range."""
    base = gpu(gpu_name)
    vals = {}
    for c in CONSTANTS:
        lo, hi = constant_range(base.name, c)
        v = hi if (c in _FASTER_WHEN_HIGH) == fast else lo
        vals[c] = v * _TB_S if c in ("hbm_bw", "l2_bw", "gemv_bw") else v
    vals["l2_fill"] *= vals["clock_ghz"] * 1e3
    vals["sms"], vals["schedulers"] = int(vals["sms"]), int(vals["schedulers"])
    return base.replace(**vals)
