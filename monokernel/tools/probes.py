"""``monokernel calibrate --probes smoke.json``: what the GPU's own probes measured, beside the
cost model's table, and what follows for its levers.

smoke (tools/smoke.py) writes the probes' rows into smoke.json: the L2 read rates
(CupyDevice.l2_read), the HBM stream rates by loads, cp.async and cp.async.bulk
(CupyDevice.hbm_stream) and the cluster placement (CupyDevice.cluster_placement). This reads
them and prints each measured rate beside the table constant the model charges for it, then the
two decisions benchmarks/NOTES.md ("What the K/V stream's rate is worth") wrote down before any
GPU ran them: whether ATTENTION's K/V stream as built already runs at the copy rate, or lever 2
(K/V by cp.async.bulk) would pay, or neither; and whether thread-block clusters of 2 and 4 keep
one block on every SM at once (lever 3, input multicast, needs it). A rate whose blocks did not
read every word (``read_all`` false) is void and says so. Nothing here changes the table: the
measurements go to benchmarks/RESULTS.md, the mends to gpu.py, by hand, with the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CostModelError
from ..kernel.costmodel.gpu import CONSTANTS

# NOTES.md's rule: the built stream "is" the copy rate within 3 %; bulk copies "pay" from 5 %
AS_BUILT_WITHIN = 0.97
BULK_PAYS = 1.05


def load_probes(path: str | Path) -> dict[str, dict]:
    """The probe rows of a smoke.json: {check name: row} for "l2 read", "hbm stream" and
    "cluster placement" (those present and not skipped)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CostModelError(f"{path}: not a readable smoke.json ({e})") from None
    rows = {r.get("check"): r for r in data.get("checks", []) if isinstance(r, dict)}
    out = {k: rows[k] for k in ("l2 read", "hbm stream", "cluster placement")
           if k in rows and "skipped" not in rows[k]}
    if not out:
        raise CostModelError(f"{path}: no probe rows (l2 read, hbm stream, cluster placement) "
                             "measured on a GPU")
    return out


def _tb_s(row: dict | None) -> float | None:
    """A probe case's rate in TB/s, or None where it is missing or its reads were not all
    checked (read_all false: the copies did not land where they should)."""
    if not isinstance(row, dict) or row.get("read_all") is False or not row.get("GB_s"):
        return None
    return float(row["GB_s"]) / 1e3


def _table(gpu_name: str, constant: str) -> str:
    unit, per_gpu, _src = CONSTANTS[constant]
    v, lo, hi = per_gpu[gpu_name]
    return f"table {v:g} {unit} (band {lo:g}-{hi:g})"


def _rate(x: float | None) -> str:
    return "void (not every word read)" if x is None else f"{x:.2f} TB/s"


def kv_verdict(hbm: dict) -> str:
    """NOTES.md's rule on the HBM stream rows: as built (cp.async, two stages, as attention's
    tile buffers) against the best rate measured and against the bulk row copies."""
    built = _tb_s(hbm.get("cp_async_16_x2"))
    rates = {k: _tb_s(v) for k, v in hbm.items() if isinstance(v, dict)}
    valid = {k: v for k, v in rates.items() if v is not None}
    bulk = [v for k, v in valid.items() if k.startswith("bulk_rows")]
    if built is None or not valid:
        return "no verdict: the as-built case (cp_async_16_x2) has no valid rate"
    best_name = max(valid, key=valid.get)
    best = valid[best_name]
    if built >= AS_BUILT_WITHIN * best:
        return (f"as built: cp.async with two stages runs {built:.2f} TB/s, within "
                f"{(1 - AS_BUILT_WITHIN):.0%} of the best measured ({best_name} {best:.2f}): "
                "the kernel's K/V stream already is lever 2's; charge ATTENTION's K/V at "
                f"{built:.2f} TB/s, not at gemv_bw")
    if bulk and max(bulk) >= BULK_PAYS * built:
        return (f"build lever 2: bulk row copies run {max(bulk):.2f} TB/s, "
                f"{max(bulk) / built - 1:.0%} above cp.async with two stages ({built:.2f}); "
                "segment_stage's rows by cp.async.bulk, an mbarrier a tile buffer")
    return (f"neither: cp.async with two stages {built:.2f} TB/s, the best {best_name} "
            f"{best:.2f}, bulk rows {max(bulk) if bulk else float('nan'):.2f}: no copy "
            "mechanism moves the K/V stream enough to build for; "
            + (f"a deeper ring ({best_name}) would" if best_name.startswith("cp_async")
               and best >= BULK_PAYS * built else "the stream is at its ceiling"))


def cluster_verdict(rows: dict, sms: int) -> list[str]:
    """Per cluster size: whether a grid of one block an SM in such clusters covers all ``sms``
    SMs and was resident at once, plainly and cooperatively."""
    out = []
    for name, r in rows.items():
        if not isinstance(r, dict) or "cluster" not in r:
            continue
        c = int(r["cluster"])
        most = r.get("max_active_clusters")
        if str(r.get("launch")).startswith("not launched"):
            what = str(r["launch"])
        elif r.get("launch") != "ok":
            what = f"refused ({r.get('launch')})"
        else:
            whole = r.get("blocks") == sms and r.get("distinct_sms") == sms
            what = ("every SM, all resident" if whole and r.get("all_resident") else
                    f"{r.get('distinct_sms')} of {sms} SMs, all resident: "
                    f"{bool(r.get('all_resident'))}")
        out.append(f"  {name:<24} at most {most} clusters at once (need {sms // c}); {what}")
    return out


def _measured_sms(probes: dict[str, dict]) -> int | None:
    """The probed GPU's SMs: the blocks of a probe case with a block on every SM."""
    l2 = probes.get("l2 read", {}).get("every_sm_own_lines", {})
    hbm = next((v for v in probes.get("hbm stream", {}).values() if isinstance(v, dict)), {})
    n = l2.get("blocks") or hbm.get("blocks")
    return int(n) if n else None


def probes_report(probes: dict[str, dict], gpu_name: str = "h200") -> str:
    """The report ``monokernel calibrate --probes`` prints (MEASURED beside the table)."""
    if gpu_name not in CONSTANTS["sms"][1]:
        raise CostModelError(f"unknown GPU {gpu_name!r}")
    sms = _measured_sms(probes) or int(CONSTANTS["sms"][1][gpu_name][0])
    lines = [f"the GPU's probes (MEASURED) beside the cost model's {gpu_name} table "
             "(assumptions):"]
    l2 = probes.get("l2 read")
    if l2:
        own = l2.get("every_sm_own_lines", {}).get("GB_s")
        same = l2.get("every_sm_same_lines", {}).get("GB_s")
        one = l2.get("one_sm", {}).get("GB_s")
        if own:
            lines.append(f"  l2_bw: every SM its own lines {own / 1e3:.2f} TB/s; "
                         + _table(gpu_name, "l2_bw"))
        if same:
            lines.append(f"  L2 broadcast: every SM the same lines {same / 1e3:.2f} TB/s (the "
                         "token groups' shared input, charged at l2_bw)")
        if one:
            lines.append(f"  one SM alone: {one:.1f} GB/s (the model's share: l2_bw / sms)")
    hbm = probes.get("hbm stream")
    if hbm:
        names = {"loads_16": "16-byte loads (gemv_bw's kind)",
                 "cp_async_16": "cp.async, 4 stages", "cp_async_16_x2":
                 "cp.async, 2 stages (attention as built)",
                 "bulk_rows_128": "bulk rows of 128 B, 4 stages",
                 "bulk_rows_128_x2": "bulk rows of 128 B, 2 stages",
                 "bulk_rows_256": "bulk rows of 256 B, 4 stages",
                 "bulk_stage": "bulk, a stage a copy"}
        for k, v in hbm.items():
            if isinstance(v, dict):
                lines.append(f"  HBM {names.get(k, k)}: {_rate(_tb_s(v))}")
        lines.append("  (" + "gemv_bw " + _table(gpu_name, "gemv_bw") + "; hbm_bw, the copy "
                     "rate, " + _table(gpu_name, "hbm_bw") + ")")
        lines.append("K/V stream: " + kv_verdict(hbm))
    cl = probes.get("cluster placement")
    if cl:
        lines.append(f"clusters (lever 3 needs one block on each of the {sms} SMs):")
        lines += cluster_verdict(cl, sms)
    return "\n".join(lines)
