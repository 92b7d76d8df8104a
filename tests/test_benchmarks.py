"""The benchmarks' own code paths, run small on the CPU on every `make test`, so a benchmark that
would fail the day it gets a GPU (or a results file that would lose its rows) fails here first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_smoke(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    """benchmarks/gpu_throughput.py --cpu-smoke: the same rows as on a GPU (the recipe model,
    the 355M shape, the same under FSDP through the loop's distributed context with async
    DCP saves, and a SIGKILLed job that resumes and publishes), on tiny models."""
    work = tmp_path_factory.mktemp("gpu-smoke")
    out = work / "result.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--cpu-smoke",
                           "--steps", "10", "--work", str(work), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_gpu_benchmark_cpu_smoke_measures_every_row(gpu_smoke):
    report, proc = gpu_smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["errors"] == []
    rows = {r["config"]: r for r in report["runs"]}
    assert list(rows) == ["gpu-recipe", "gpt-355m", "gpt-355m-fsdp"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_of_measured_matmul"] < 1
        # checkpoint every 10 steps and at the end: the save at step 10 is the last one here
        assert len(row["checkpoint_blocked_s"]) >= 1
        assert row["val_loss"] < 7.0  # ln(512) = 6.24 from random weights: it trained, not NaN
    # FSDP: sharded by the loop, saved asynchronously through torch.distributed.checkpoint
    assert rows["gpt-355m-fsdp"]["fsdp"] and rows["gpt-355m-fsdp"]["checkpoint_layout"] == "dcp"
    assert rows["gpt-355m"]["checkpoint_layout"] == "pt"
    # the same weights and data with and without FSDP: the same training, to float precision
    assert rows["gpt-355m-fsdp"]["final_loss"] == pytest.approx(rows["gpt-355m"]["final_loss"],
                                                                abs=1e-3)


def test_gpu_benchmark_kill_and_resume_publishes_a_loadable_model(gpu_smoke):
    report, _ = gpu_smoke
    kr = report["kill_and_resume"]
    assert kr is not None, report["errors"]
    assert kr["restarts"] == 1 and kr["final_step"] == 20  # --steps 10: the job trains 20
    assert 0 < kr["resumed_at_step"] <= kr["kill_at_step"]  # from a checkpoint, not step 0
    assert kr["steps_redone"] == kr["kill_at_step"] - kr["resumed_at_step"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kr["model_dir"])  # the tokenizer data prep would write
    text = "hello world"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_results_record_commit_and_load_at_both_ends(gpu_smoke):
    report, _ = gpu_smoke
    m = report["machine"]
    for key in ("git_commit_at_start", "git_commit"):  # commits of this repository's history
        commit = m[key].split("+")[0]
        assert len(commit) == 40
        assert subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"],
                              cwd=ROOT).returncode == 0, m[key]
    assert len(m["load_avg_1_5_15_at_start"]) == 3 and len(m["load_avg_1_5_15_at_end"]) == 3
    assert m["started_utc"] <= m["finished_utc"] and m["torch"]


def test_gpu_benchmark_keeps_rows_measured_before_a_failure(tmp_path, monkeypatch):
    """A part that fails is recorded with its error, the others still run, and the rows measured
    before it stay in the file (which is rewritten after every part)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_throughput

    measure = gpu_throughput.measure

    def failing_355m(name, *args, **kwargs):
        if name.startswith("gpt-355m"):
            raise RuntimeError(f"CUDA out of memory in {name}")
        return measure(name, *args, **kwargs)

    def failing_kill(*args, **kwargs):
        raise RuntimeError("the kill-and-resume job failed")

    monkeypatch.setattr(gpu_throughput, "measure", failing_355m)
    monkeypatch.setattr(gpu_throughput, "kill_and_resume", failing_kill)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["gpu_throughput.py", "--cpu-smoke", "--steps", "10",
                                      "--work", str(tmp_path), "--out", str(out)])
    with pytest.raises(SystemExit) as stopped:
        gpu_throughput.main()
    assert "3 part(s) failed" in str(stopped.value.code)
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["runs"]] == ["gpu-recipe"]
    assert [(e["part"], e["error"]) for e in report["errors"]] == [
        ("gpt-355m", "RuntimeError: CUDA out of memory in gpt-355m"),
        ("gpt-355m-fsdp", "RuntimeError: CUDA out of memory in gpt-355m-fsdp"),
        ("kill-and-resume", "RuntimeError: the kill-and-resume job failed")]


def test_loop_refuses_a_model_sharded_outside_it(tmp_path):
    """The GPU benchmark's FSDP row used to call fully_shard itself: the loop then saved a plain
    state dict of DTensors and the async snapshot failed mid-run. Now it is refused up front."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tasks.configs import ModelConfig, TrainConfig
    from tasks.model.gpt import GPT
    from tasks.train.loop import train

    model_cfg = ModelConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    cfg = TrainConfig(data_dir=str(tmp_path), output_dir=str(tmp_path / "out"), model=model_cfg)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = GPT(model_cfg)
        fully_shard(model)
        with pytest.raises(ValueError, match=r"DTensors .* LoopOptions\(dist=DistContext"):
            train(model=model, cfg=cfg, get_batch=None, loss_fn=None, evaluate=None,
                  device=torch.device("cpu"), resolved_config={}, tracking=False)
    finally:
        dist.destroy_process_group()


def test_make_test_timings_tells_each_pytest_run_apart():
    """The README's test-time figures come from benchmarks/results/make_test.json, which
    benchmarks/make_test_timings.py writes from `make test`'s own output: each pytest run's
    summary line, a run with failures or skips counted as such."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.make_test_timings import labelled, summaries

    # the parts are told apart by their commands, not their order: here the matrix prints first
    output = "\n".join([
        ".venv/bin/python -m pytest tests --ignore=tests/test_fault_matrix.py -n 2",
        "tests/test_x.py::test_a PASSED",
        "============ 1107 passed, 1 skipped, 3 warnings in 1455.12s (0:24:15) ============",
        ".venv/bin/python -m pytest tests/test_fault_matrix.py",
        "1 passed in 1304.00s (0:21:44)",
        "LLMOPS_SLOW_TESTS=1 .venv/bin/python -m pytest tests/test_lifecycle_gate.py \\",
        "================ 4 passed, 1 failed in 700.50s (0:11:40) ================",
        "===== short test summary info =====",
    ])
    assert summaries(output) == [
        {"seconds": 1455.12, "passed": 1107, "skipped": 1, "warning": 3},
        {"seconds": 1304.0, "passed": 1},
        {"seconds": 700.5, "passed": 4, "failed": 1}]
    assert [part for part, _ in labelled(output)] == ["suite", "test_matrix", "test_slow"]


def test_data_prep_scaling_measures_each_part_of_both_runs(tmp_path):
    """benchmarks/data_prep_scaling.py on an 8 MB corpus (above processes_above_bytes, so 2 workers
    start a pool): the 2-core run's pool, its worker's share of every stage and the forkserver are
    measured, the 1-core run has none, and the result records where and on what it ran."""
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, "benchmarks/data_prep_scaling.py", "--corpora", "stdlib", "--sizes", "8",
                           "--rounds", "1", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["corpora"]["stdlib"]["8"]
    assert summary["engines"] == ["local", "processes"]
    one, two = summary["runs"]["1"][0], summary["runs"]["2"][0]
    assert "pool_wait" not in one and two["pool_wait"] > 0 and two["forkserver_cpu"] > 0
    for run in (one, two):
        assert 0 < run["outside"] < run["whole"] and 0 < run["driver"] and 0 < run["maps"] < run["whole"]
    probe = json.loads((tmp_path / "work" / "runs" / "scaling-stdlib-8-2.probe.json").read_text())
    by_stage = {m["fn"]: m for m in probe["maps"]}
    assert {"process_shard", "finalize_shard", "hash_file"} <= set(by_stage)
    # the worker took part in the stages with jobs to spare, the first one (where it comes up) too
    assert by_stage["process_shard"]["worker_cpu_s"] > 0 and by_stage["finalize_shard"]["worker_cpu_s"] > 0
    assert summary["bound_ideal"]["speedup"] > 1 and summary["bound_with_measured_costs"]["speedup"] > 1
    assert report["machine"]["git_commit"] and len(report["machine"]["load_avg_1_5_15_at_start"]) == 3
