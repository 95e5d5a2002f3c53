"""tools/probes.py: the GPU's probe rows (smoke.json) beside the cost model's table, and the
decisions benchmarks/NOTES.md wrote down for them ("What the K/V stream's rate is worth").

The smoke.json rows here are made up, shaped as CupyDevice.l2_read, hbm_stream and
cluster_placement write them: test inputs for the rule, not measurements."""

from __future__ import annotations

import json

import pytest

from monokernel.cli import main
from monokernel.errors import CostModelError
from monokernel.tools.probes import cluster_verdict, kv_verdict, load_probes, probes_report

SMS = 132


def hbm_rows(**tb_s) -> dict:
    """HBM stream rows at these TB/s (names as CupyDevice.hbm_stream's cases)."""
    return {name: {"blocks": SMS, "GB_s": v * 1e3, "read_all": True} for name, v in tb_s.items()}


def smoke(tmp_path, hbm=None, clusters=None, l2=None, skipped=False):
    checks = [{"check": "timer tick", "ok": True, "tick_ns": 32}]
    if skipped:
        checks.append({"check": "hbm stream", "ok": True, "skipped": "the emulator has no HBM"})
    if l2 is not None:
        checks.append({"check": "l2 read", "ok": True, **l2})
    if hbm is not None:
        checks.append({"check": "hbm stream", "ok": True, **hbm})
    if clusters is not None:
        checks.append({"check": "cluster placement", "ok": True, **clusters})
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps({"backend": "cuda", "checks": checks}))
    return path


def test_kv_verdict_follows_the_rule_written_before_the_probe():
    # cp.async with two stages within 3 % of the best: the kernel as built is lever 2's stream
    v = kv_verdict(hbm_rows(loads_16=3.7, cp_async_16=4.10, cp_async_16_x2=4.05,
                            bulk_rows_128=4.12, bulk_stage=4.15))
    assert v.startswith("as built") and "4.05 TB/s" in v and "bulk_stage 4.15" in v
    # bulk row copies 5 % or more above it: build lever 2
    v = kv_verdict(hbm_rows(cp_async_16=3.7, cp_async_16_x2=3.6, bulk_rows_128=3.9,
                            bulk_rows_256=4.0, bulk_stage=4.1))
    assert v.startswith("build lever 2") and "4.00 TB/s" in v and "11%" in v
    # bulk rows no better, but a deeper cp.async ring is: neither copy lever, the ring depth
    v = kv_verdict(hbm_rows(cp_async_16=3.9, cp_async_16_x2=3.5, bulk_rows_128=3.55))
    assert v.startswith("neither") and "deeper ring (cp_async_16)" in v
    # all alike and low: the stream is at its ceiling
    v = kv_verdict(hbm_rows(cp_async_16=3.52, cp_async_16_x2=3.5, bulk_rows_128=3.55,
                            bulk_stage=3.58))
    assert v.startswith("as built")  # within 3 % of the best: no lever moves it
    v = kv_verdict(hbm_rows(cp_async_16=3.40, cp_async_16_x2=3.3, bulk_rows_128=3.42,
                            loads_16=3.5))
    assert v.startswith("neither") and "at its ceiling" in v


def test_a_case_whose_reads_did_not_check_out_is_void():
    rows = hbm_rows(cp_async_16_x2=3.6, bulk_rows_128=4.2)
    rows["bulk_rows_128"]["read_all"] = False  # the copies did not land: no rate
    v = kv_verdict(rows)
    assert v.startswith("as built")  # the void bulk case is not the best, nor paying
    rows["cp_async_16_x2"]["read_all"] = False
    assert kv_verdict(rows).startswith("no verdict")
    report = probes_report({"hbm stream": rows})
    assert "void (not every word read)" in report


def test_cluster_verdict_needs_every_sm_resident():
    rows = {"cluster_2": {"cluster": 2, "cooperative": False, "blocks": 132,
                          "max_active_clusters": 66, "launch": "ok", "distinct_sms": 132,
                          "all_resident": True},
            "cluster_4_cooperative": {"cluster": 4, "cooperative": True, "blocks": 132,
                                      "max_active_clusters": 30,
                                      "launch": "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (720)"},
            "cluster_4": {"cluster": 4, "cooperative": False, "blocks": 132,
                          "max_active_clusters": 30, "launch": "ok", "distinct_sms": 120,
                          "all_resident": False}}
    lines = cluster_verdict(rows, SMS)
    assert "every SM, all resident" in lines[0] and "need 66" in lines[0]
    assert "refused (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (720))" in lines[1]
    assert "120 of 132 SMs, all resident: False" in lines[2]


def test_calibrate_probes_prints_the_report(tmp_path, capsys):
    path = smoke(tmp_path, l2={"every_sm_own_lines": {"blocks": SMS, "GB_s": 8100.0},
                               "every_sm_same_lines": {"blocks": SMS, "GB_s": 9000.0},
                               "one_sm": {"blocks": 1, "GB_s": 120.0}},
                 hbm=hbm_rows(loads_16=3.7, cp_async_16=4.0, cp_async_16_x2=3.7,
                              bulk_rows_128=4.0),
                 clusters={"cluster_2": {"cluster": 2, "blocks": SMS, "launch": "ok",
                                         "max_active_clusters": 66, "distinct_sms": SMS,
                                         "all_resident": True}})
    assert main(["calibrate", "--probes", str(path)]) == 0
    out = capsys.readouterr().out
    assert "l2_bw: every SM its own lines 8.10 TB/s; table 7 TB/s (band 5.5-10)" in out
    assert "HBM cp.async, 2 stages (attention as built): 3.70 TB/s" in out
    assert "K/V stream: build lever 2" in out
    assert "cluster_2" in out and "every SM, all resident" in out


def test_calibrate_without_probes_or_trace_is_a_clear_error(tmp_path, capsys):
    assert main(["calibrate"]) != 0
    assert "needs a trace JSON" in capsys.readouterr().err
    empty = smoke(tmp_path, skipped=True)  # the emulator's smoke: its probes skipped
    with pytest.raises(CostModelError, match="no probe rows"):
        load_probes(empty)
    assert main(["calibrate", "--probes", str(empty)]) != 0
    assert "no probe rows" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["calibrate", "--probes", str(tmp_path / "bad.json")]) != 0
    assert "not a readable smoke.json" in capsys.readouterr().err
