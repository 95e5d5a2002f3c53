"""`monokernel bench --batch B --prompt P` (tools/bench_batch.py): served rates through the
Engine on this machine: a batched backend runs its sequences in one step loop, a kernel backend
one at a time unless built with slots (said in the row); every sequence generates its tokens;
bad input is refused."""

from __future__ import annotations

import json

import pytest

from monokernel.cli import main


def test_bench_batch_rows(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["bench", "--shape", "tiny", "--backends", "numpy,emulator", "--batch", "3",
                 "--prompt", "9", "--new-tokens", "3", "--repeats", "2", "--blocks", "2",
                 "--step-tokens", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT ms" in text and "tokens/s" in text
    [path] = out.glob("bench-batch-*.json")
    doc = json.loads(path.read_text())
    assert doc["command"].startswith("monokernel bench --shape tiny --backends numpy,emulator "
                                     "--batch 3 --prompt 9")
    rows = {r["backend"]: r for r in doc["results"]}
    assert rows["numpy"]["mode"].startswith("batched") and "one sequence" in rows["emulator"]["mode"]
    assert rows["emulator"]["options"] == {"step_tokens": 4, "blocks": 2}
    for r in rows.values():
        assert r["generated"] == 3 * 3 and r["tokens_per_s"] > 0
        assert len(r["ttft_s"]) == 2 and min(r["ttft_s"]) > 0


def test_bench_batch_on_a_kernel_of_slots(tmp_path, capsys):
    """``--slots 3``: the emulator runs the 3 sequences in one step loop, steps of up to 4
    rows (the Engine's rows capped at the kernel's step_tokens)."""
    out = tmp_path / "res"
    assert main(["bench", "--shape", "tiny", "--backends", "emulator", "--batch", "3",
                 "--prompt", "5", "--new-tokens", "3", "--repeats", "1", "--blocks", "2",
                 "--step-tokens", "4", "--slots", "3", "--out", str(out)]) == 0
    [path] = out.glob("bench-batch-*.json")
    doc = json.loads(path.read_text())
    assert "--step-tokens 4 --slots 3" in doc["command"]
    [row] = doc["results"]
    assert row["mode"] == "batched: up to 3 sequences a step", row
    assert row["options"] == {"step_tokens": 4, "slots": 3, "blocks": 2}
    assert row["generated"] == 3 * 3


def test_bench_batch_on_tensor_cores(tmp_path, capsys):
    """``--slots 2 --tensor-cores``: the kernel of slots with its mat-muls on tensor cores
    (issue 17 slice 6a), said in the command and the row's options."""
    out = tmp_path / "res"
    assert main(["bench", "--shape", "tiny", "--backends", "emulator", "--batch", "2",
                 "--prompt", "5", "--new-tokens", "2", "--repeats", "1", "--blocks", "2",
                 "--slots", "2", "--tensor-cores", "--out", str(out)]) == 0
    [path] = out.glob("bench-batch-*.json")
    doc = json.loads(path.read_text())
    assert "--slots 2 --tensor-cores" in doc["command"]
    [row] = doc["results"]
    assert row["options"] == {"slots": 2, "tensor_cores": True, "blocks": 2}
    assert row["generated"] == 2 * 2


def test_bench_batch_device_times(tmp_path, capsys):
    """A kernel of slots' own steps on its device, beside the H200 prediction: a 9-token
    prompt's 3 chunk launches of up to 4 rows, 10 decode steps of 3 sequences in launches of
    up to 8 (the kernel's steps per launch: the first GPU run asked one launch for 16 and lost
    the row); ``--device-only`` skips the Engine, ``--no-predict`` the cost model; the JSON is
    on disk after each row."""
    out = tmp_path / "res"
    argv = ["bench", "--shape", "tiny", "--backends", "emulator", "--batch", "3", "--prompt",
            "9", "--new-tokens", "10", "--repeats", "1", "--blocks", "2", "--slots", "3",
            "--step-tokens", "4", "--tensor-cores", "--out", str(out)]
    assert main(argv) == 0
    assert main(argv + ["--device-only", "--no-predict"]) == 0
    text = capsys.readouterr().out
    assert "device time: a 9-token prompt in 3 steps of up to 4 rows" in text
    assert "device times only" in text and "; predicted on h200: " in text
    assert "; predicted on h200-fit: " in text
    docs = [json.loads(p.read_text()) for p in sorted(out.glob("bench-batch-*.json"))]
    [both] = [d for d in docs if "--device-only" not in d["command"]]
    [only] = [d for d in docs if d["command"].endswith("--device-only --no-predict --out res")]
    for doc in (both, only):
        [row] = doc["results"]
        dev = row["device"]
        assert len(dev["prompt_chunks_us"]) == 3 and dev["chunk_rows"] == 4
        assert dev["prompt_us"] == pytest.approx(sum(dev["prompt_chunks_us"]))
        assert dev["decode_steps"] == 10 and dev["decode_launches"] == 2
        assert dev["decode_tokens_per_s"] == pytest.approx(3 / dev["decode_step_us"] * 1e6)
    assert "predicted" not in only["results"][0]["device"]
    pred = both["results"][0]["device"]["predicted"]
    assert list(pred) == ["h200", "h200-fit"]
    for p in pred.values():
        assert p["design"].startswith("v6-mma") and len(p["prompt_chunks_us"]) == 3
        assert 0 < p["decode_step_us"] < 1e4
    # the fitted table's latencies are longer: every figure slower
    assert pred["h200-fit"]["prompt_us"] > pred["h200"]["prompt_us"]
    assert both["results"][0]["generated"] == 3 * 10
    assert "generated" not in only["results"][0] and "ttft_ms" not in only["results"][0]


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--batch", "2", "--prompt", "0"], "--prompt must be >= 1"),
    (["--batch", "2", "--backends", "hf"], "monokernel's backends only"),
    (["--batch", "2", "--tensor-cores"], "--tensor-cores needs --slots"),
    (["--batch", "2", "--device-only"], "--device-only needs --slots"),
])
def test_bench_batch_refuses_bad_input(tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--shape", "tiny", "--out", str(tmp_path)] + argv)
    assert message in str(e.value)
