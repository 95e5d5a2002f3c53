"""`monokernel plan | bench | trace` end to end on the CPU emulator (the same code runs the GPU
backends), and the trace helpers against the program they trace."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from monokernel.tools import bench, trace
from monokernel.cli import main
from monokernel.model.config import ModelConfig
from monokernel.kernel.isa import Op
from monokernel.kernel.schedule import schedule

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path


def non_noop(prog) -> list[tuple[int, int]]:
    return [(b, i) for b, q in enumerate(prog.queues) for i, ins in enumerate(q)
            if ins.op != Op.NOOP]


# ---- bench ----------------------------------------------------------------------------------
def test_bench_emulator_and_numpy(tmp_path, capsys):
    out = tmp_path / "results"
    rc = main(["bench", "--shape", "tiny", "--backends", "emulator,emulator-multi,numpy",
               "--context", "4,16", "--steps", "3", "--warmup", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    (jpath,) = out.glob("bench-*-cpu-*.json")
    (ppath,) = out.glob("bench-*-cpu-*.png")
    assert ppath.stem == jpath.stem
    assert_png(ppath)
    doc = json.loads(jpath.read_text())
    for key in ("date", "device", "commit", "commit_source", "command", "method", "floors",
                "results",
                "resources", "weight_bytes_per_token", "backends"):
        assert key in doc, key
    assert doc["command"].startswith("monokernel bench --shape tiny --backends "
                                     "emulator,emulator-multi,numpy --context 4,16 --steps 3")
    assert str(tmp_path) not in jpath.read_text()  # no absolute path of this machine
    assert doc["resources"] == {"emulator": {}}
    assert doc["floors"]["cpu"]["copy_bandwidth_GBps"] > 0
    wb = ModelConfig.from_name("tiny").weight_bytes_per_token()
    assert doc["weight_bytes_per_token"] == {"tiny": wb}
    rows = {(r["backend"], r["context"]): r for r in doc["results"]}
    assert set(rows) == {(b, c) for b in ("emulator", "emulator-multi", "numpy") for c in (4, 16)}
    for r in rows.values():
        assert r["error"] is None
        if r["backend"] == "emulator":  # many steps per launch: launches of the 3 steps, 5 times
            assert r["n"] == bench.CHAINED_REPEATS == 5 and len(r["times_us"]) == 5
            assert "one launch of 3 steps" in r["timing"]["timer"]
        else:
            assert r["n"] == 3 and len(r["times_us"]) == 3
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert r["tokens_per_s"] == pytest.approx(1e6 / r["median_us"])
        assert r["GBps"] == pytest.approx(wb / r["median_us"] / 1e3)
        assert r["x_floor"] == pytest.approx(r["median_us"] / r["floor_us"])
        # end to end through the Engine: host work on top of the device step, same order
        assert r["e2e_us_per_token"] > 0 and r["timing"]["timer"]
        assert 0.3 * r["median_us"] < r["e2e_us_per_token"] < 20 * r["median_us"]
    assert not list(out.glob("*.tmp"))  # rewritten atomically after every row
    assert "device_time" in doc["method"] and "end_to_end" in doc["method"]
    assert rows[("emulator", 4)]["blocks"] == 4
    assert doc["backends"]["tiny/emulator"]["critical_path_hops"] > 0
    for b, n in (("emulator", 5), ("emulator-multi", 3), ("numpy", 3)):  # the n column
        assert re.search(rf"^{b}\s+tiny\s+16\s+{n}\s+[\d.]+\s", printed, re.M), printed


def test_bench_json_is_rewritten_after_every_row(tmp_path, monkeypatch):
    """A run killed half way keeps the rows it finished: the CLI rewrites its JSON per row."""
    seen = []
    real = bench.write_json

    def spy(doc, out_dir):
        seen.append(len(doc["results"]))
        return real(doc, out_dir)

    monkeypatch.setattr(bench, "write_json", spy)
    rc = main(["bench", "--shape", "tiny", "--backends", "numpy", "--context", "3,5",
               "--steps", "2", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    assert seen[:2] == [1, 2]  # one write per row, then the final one
    (jpath,) = tmp_path.glob("bench-*.json")
    assert len(json.loads(jpath.read_text())["results"]) == 2


def test_bench_without_arguments_on_a_cpu_runs_the_cpu_backends(tmp_path, capsys, monkeypatch):
    if bench.cuda_unavailable_reason() is None:
        pytest.skip("a CUDA device is present")
    from monokernel.tools import commands

    monkeypatch.setitem(commands.CPU_DEFAULTS, "steps", 2)  # keep the test short
    monkeypatch.setitem(commands.CPU_DEFAULTS, "context", "3")
    rc = main(["bench", "--shape", "tiny", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "no CUDA device" in cap.err and "running the CPU backends numpy,emulator" in cap.err
    (jpath,) = tmp_path.glob("bench-*.json")
    doc = json.loads(jpath.read_text())
    assert {r["backend"] for r in doc["results"]} == {"numpy", "emulator"}
    assert all(r["error"] is None for r in doc["results"])


def test_bench_cuda_without_gpu_exits_nonzero(tmp_path, capsys):
    if bench.cuda_unavailable_reason() is None:
        pytest.skip("a CUDA device is present")
    rc = main(["bench", "--shape", "tiny", "--backends", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "no CUDA device" in err
    assert not list(tmp_path.iterdir())  # failed before writing anything


def test_bench_unknown_backend(tmp_path, capsys):
    assert main(["bench", "--shape", "tiny", "--backends", "emulatr", "--out",
                 str(tmp_path)]) != 0
    assert "unknown backend" in capsys.readouterr().err


# ---- trace ----------------------------------------------------------------------------------
def test_trace_cli(tmp_path, capsys):
    rc = main(["trace", "--shape", "tiny", "--backend", "emulator", "--context", "5",
               "--max-seq", "24", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    (jpath,) = tmp_path.glob("trace-tiny-emulator-ctx5.json")
    assert_png(tmp_path / "trace-tiny-emulator-ctx5.png")
    doc = json.loads(jpath.read_text())
    meta = doc["otherData"]
    blocks, step_us = meta["blocks"], meta["step_us"]
    # the timer's tick, measured before the step, for calibrate's check
    assert meta["timer"] == "host steady clock (emulator)" and 1 <= meta["timer_tick_ns"] < 1000
    events = doc["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e), e
        assert e["pid"] == 0
    xs = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == set(range(blocks))
    prog = schedule(ModelConfig.from_name("tiny"), blocks, 6)
    ops = [e for e in xs if e["cat"] == "op"]
    assert sorted((e["tid"], e["args"]["slot"]) for e in ops) == sorted(non_noop(prog))
    for e in ops:
        ins = prog.queues[e["tid"]][e["args"]["slot"]]
        assert e["name"] == f"{ins.op.name} L{ins.layer}"
    for e in xs:
        assert 0 <= e["ts"] and 0 <= e["dur"] and e["ts"] + e["dur"] <= step_us + 1e-3, e
    assert min(e["ts"] for e in xs) == 0
    waits = [e for e in xs if e["cat"] == "wait"]
    assert len(waits) == sum(prog.queues[b][i].wait is not None for b, i in non_noop(prog))
    # per-op summary: every op once, and all of them take at most the step
    share = re.search(r"^all ops\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%", printed,
                      re.M)
    assert share and float(share.group(1)) <= step_us + 0.1 and float(share.group(4)) <= 100
    for op in {ins.op for q in prog.queues for ins in q} - {Op.NOOP}:
        assert re.search(rf"^{op.name}\s", printed, re.M), op.name


def test_trace_helpers_against_records(synth_dir, tmp_path):
    from monokernel.tools import trace
    from monokernel.model.loader import load_model
    from monokernel.runtime import make_executor

    model = load_model(synth_dir("tiny"), progress=False)
    ex = make_executor("emulator", model, 8, blocks=3, trace=True)
    for pos, tok in enumerate([5, 17, 999]):
        ex.launch_step(tok, pos, None)
    rec = ex.trace_records()
    step_ns = trace.step_time_ns(rec)
    assert step_ns > 0
    rows = trace.op_summary(ex, rec)
    assert [r["op"] for r in rows] == [op.name for op in Op if op != Op.NOOP]
    assert sum(r["instructions"] for r in rows) == len(non_noop(ex.program))
    total_us = sum(r["time_us"] for r in rows)
    assert 0 < total_us <= step_ns / 1e3
    assert sum(r["share"] for r in rows) <= 1.0 + 1e-9
    for r in rows:
        assert 0 <= r["wait_us"] <= r["time_us"]
    events = trace.trace_events(ex, rec)
    path = trace.write_chrome_trace(tmp_path / "t.json", events)
    assert json.loads(path.read_text())["traceEvents"] == events
    trace.plot_timeline(tmp_path / "t.png", ex, rec)
    assert_png(tmp_path / "t.png")
    # an untraced record set is refused with a message, not silently plotted empty
    with pytest.raises(ValueError, match="empty"):
        trace.op_summary(ex, np.zeros_like(rec))


# ---- plan -----------------------------------------------------------------------------------
def test_plan_smollm2_shape(capsys):
    assert main(["plan", "--shape", "smollm2-135m", "--blocks", "8", "--context", "256"]) == 0
    out = capsys.readouterr().out
    prog = schedule(ModelConfig.from_name("smollm2-135m"), 8, 257)
    for r in prog.op_table(256):
        m = re.search(rf"^{r['op']}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
        assert m, r["op"]
        assert int(m.group(1)) == r["instructions"]
        assert float(m.group(4)) == pytest.approx(r["bytes"] / 1e6, abs=1e-3)
    assert re.search(r"^EMBED\s+8\s", out, re.M) and re.search(r"^RMS_LM_HEAD\s+8\s", out, re.M)
    assert re.search(r"^RMS_GATE_UP\s+240\s", out, re.M)  # 30 layers x 8 blocks
    assert "critical path:          151 dependency hops per token" in out
    assert "269.030 MB per token" in out  # ModelConfig.weight_bytes_per_token()
    assert "counters:               152" in out


def test_plan_bundled_model(bundled_dir, capsys):
    assert main(["plan", "--blocks", "6", "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "30 layers, hidden 576" in out
    assert "151 dependency hops" in out


def test_commit_comes_from_the_environment_then_the_commit_file(tmp_path, monkeypatch):
    """The GPU machine gets the tree without .git: MONOKERNEL_COMMIT, else .commit (written by
    the caller before the run), else git; every result says which."""
    monkeypatch.setattr(bench, "COMMIT_FILE", tmp_path / ".commit")
    monkeypatch.setenv("MONOKERNEL_COMMIT", "abc1234")
    (tmp_path / ".commit").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert bench.commit_info() == ("abc1234", "$MONOKERNEL_COMMIT")
    monkeypatch.delenv("MONOKERNEL_COMMIT")
    assert bench.commit_info() == ("0123456789abcdef0123456789abcdef01234567", ".commit file")
    assert bench.git_commit() == "0123456"
    (tmp_path / ".commit").unlink()
    commit, source = bench.commit_info()  # tmp_path is no git checkout
    assert commit == "unknown" and "no .commit file" in source, (commit, source)


def test_max_seq_too_short_is_refused_before_any_work(tmp_path, capsys):
    """--max-seq (the GPU check's one KV-cache length) must hold what the rows or the traced
    step need: refused with the need, nothing written."""
    with pytest.raises(SystemExit, match=r"--max-seq 20 is too short .* \(needs 25\)"):
        main(["bench", "--shape", "tiny", "--backends", "numpy", "--context", "16",
              "--steps", "6", "--warmup", "1", "--max-seq", "20", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--max-seq 5 leaves no position"):
        main(["trace", "--shape", "tiny", "--context", "5", "--max-seq", "5",
              "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_times_within_a_block_come_from_the_cycle_counter():
    """trace.timestamps: a %globaltimer that ticks every 1 us (as on some drivers) quantises a
    0.3 us op to 0 or 1 us; the cycle counter (2 cycles per ns here), scaled by the block's own
    timer span, gives it to the ns, and blocks stay aligned by their first START's timer."""
    from monokernel.kernel.isa import TRACE_WORDS, TraceWord as W

    epoch, tick, ghz = 1_700_000_000_000_000_000, 1000, 2.0
    true = {0: [(0, 100, 400), (400, 2_000, 2_300), (2_300, 2_300, 50_000)],
            1: [(5_000, 5_200, 5_500), (5_500, 9_000, 9_350), (9_350, 9_400, 60_000)]}
    rec = np.zeros((2, 3, TRACE_WORDS), np.uint64)
    clk0 = {0: 123_456_789, 1: 987}  # every SM's counter starts anywhere
    for b, slots in true.items():
        for i, moments in enumerate(slots):
            for t, gw, cw in zip(moments, (W.START, W.READY, W.END),
                                 (W.START_CLK, W.READY_CLK, W.END_CLK)):
                rec[b, i, gw] = epoch + t // tick * tick  # the coarse global timer
                rec[b, i, cw] = clk0[b] + round((t - slots[0][0]) * ghz)
    ts = trace.timestamps(rec)
    want = np.array([true[0], true[1]], np.float64)
    # within a block: to a fraction of a ns (the rate comes from a span of ~50 ticks)
    busy = ts[..., 2] - ts[..., 1]
    np.testing.assert_allclose(busy, want[..., 2] - want[..., 1], rtol=0.02, atol=1.0)
    # across blocks: to one tick of the timer
    assert np.abs(ts - want).max() <= tick
    assert trace.ns_per_cycle(rec) == pytest.approx(1 / ghz, rel=0.03)
    # without cycle counts: the timer's stamps as recorded, quantised
    rec[..., [W.START_CLK, W.READY_CLK, W.END_CLK]] = 0
    coarse = trace.timestamps(rec)
    assert trace.ns_per_cycle(rec) is None
    assert coarse[0, 0, 2] - coarse[0, 0, 1] == 0.0  # the 0.3 us op reads 0 us
