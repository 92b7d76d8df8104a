"""Resilient pretraining: faults injected on purpose and the job recovering from each of them.

The supervisor is tested on real child processes (small Python scripts standing in for workers),
then the whole entrypoint on the tiny data: a kill, a corrupt checkpoint, a hang, a loss spike
and a NaN in one supervised run that must end with the weights of an uninterrupted run that
skipped the same batch. The DDP and FSDP tests launch two processes with torchrun, as the local
backend does. The last sections: the watchdog's phase budgets (stand-in workers, then a job
with a slowed-down checkpoint writer and restore) and a peer failure heard through the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tasks.common.io import read_json
from tasks.configs import TrainConfig, from_dict, tiny, to_dict
from tasks.model.gpt import GPT
from tasks.train import checkpoint as ckpt
from tasks.train import goodput
from tasks.train import telemetry as tm
from tasks.train.prepared_data import DataDir, PretrainBatches
from tasks.train.faults import Fault, FaultSpecError, parse_faults
from tasks.train.guard import SpikeGuard
from tasks.train.losses import cross_entropy
from tasks.train.loop import LoopOptions, train
from tasks.train.runtime import pick_device, seed_everything
from tasks.train.scoring import shard_loss
from tasks.train.supervisor import FATAL_EXIT, Supervisor

REPO = Path(__file__).resolve().parents[1]


def tiny_cfg(data_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    cfg = tiny().pretrain
    cfg.data_dir, cfg.output_dir = str(data_dir), str(output_dir)
    return from_dict(TrainConfig, {**to_dict(cfg), **overrides})


def run_pretrain(cfg: TrainConfig, workdir: Path, *, faults: str = "", nproc: int = 1,
                 timeout: int = 300) -> tuple[subprocess.CompletedProcess, Path]:
    """The command a backend runs: python -m tasks.pretrain (under torchrun for nproc > 1)."""
    config, result = workdir / "config.json", workdir / "result.json"
    config.write_text(json.dumps(to_dict(cfg)))
    entry = ["-m", "tasks.pretrain", "--config", str(config), "--result", str(result)]
    if faults:
        entry += ["--faults", faults]
    if nproc > 1:
        entry = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry]
    env = {k: v for k, v in os.environ.items() if k != "LLMOPS_FAULTS"}
    proc = subprocess.run([sys.executable, *entry], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc, result


def reference_run(cfg: TrainConfig, data_dir: Path, *, skipped: list[int] = (),
                  batch_size: int | None = None) -> torch.nn.Module:
    """An uninterrupted single-process run of the same config, in this process, without MLflow
    (optionally with some batches marked bad up front, or a bigger per-process batch)."""
    data = DataDir(data_dir)
    threads = torch.get_num_threads()
    pick_device()  # the worker's thread count: another one sums in another order, not bitwise
    seed_everything(cfg.seed)
    model = GPT(cfg.model)
    run_dir = tm.run_dir(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "skipped_batches.json").write_text(json.dumps({"batches": list(skipped)}))
    val = data.split("val")
    try:
        train(model=model, cfg=cfg, device=torch.device("cpu"), resolved_config=to_dict(cfg),
              get_batch=PretrainBatches(data.split("train"), batch_size or cfg.batch_size, cfg.seed),
              loss_fn=cross_entropy, tracking=False,
              evaluate=lambda m: {"val_loss": shard_loss(m, val, 4, 1, torch.device("cpu"))},
              options=LoopOptions(spike_sigma=cfg.spike_sigma, spike_window=cfg.spike_window,
                                  spike_skip_batches=cfg.spike_skip_batches,
                                  max_rollbacks=cfg.max_rollbacks,
                                  skipped_file=run_dir / "skipped_batches.json"))
    finally:
        torch.set_num_threads(threads)
    return model


def final_weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(output_dir / "checkpoints" / f"step_{step:06d}")["model"]


def kinds(events: list[dict], kind: str, **match) -> list[dict]:
    return [e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


# --------------------------------------------------------------------------------------------
# Pieces


def test_fault_spec_parses_and_bad_specs_say_the_form():
    assert parse_faults("kill@120, hang@300:1,spike@450,nan@600,corrupt_ckpt@200") == [
        Fault("kill", 120), Fault("hang", 300, 1), Fault("spike", 450), Fault("nan", 600),
        Fault("corrupt_ckpt", 200)]
    assert parse_faults("") == []
    for bad in ("explode@5", "kill@", "kill@0", "kill 5"):
        with pytest.raises(FaultSpecError, match="kind@step"):
            parse_faults(bad)


def test_spike_detector_needs_a_full_window_and_flags_outliers_only():
    guard = SpikeGuard(sigma=6.0, window=10, warmup_steps=12)
    losses = [4.0 - 0.01 * i + (0.02 if i % 2 else -0.02) for i in range(12)]
    for i, loss in enumerate(losses):
        assert guard.check(i + 1, 50.0, 1.0) is None  # in the lr warm-up, or the window not full
        guard.add(i + 1, loss, 1.0 + 0.05 * (i % 3))
    assert guard.check(13, 3.95, 1.02) is None  # an ordinary step
    spike = guard.check(13, 20.0, 1.0)
    assert spike.kind == "loss_spike" and spike.threshold < 20.0
    assert guard.check(13, 9.0, 1.0) is None  # 2.3x the median: healthy models spike so far
    assert guard.check(13, 3.9, 25.0) is None  # a grad norm alone is no spike (it is clipped)
    assert guard.check(13, float("nan"), 1.0).kind == "nan"
    assert guard.check(13, 3.9, float("inf")).kind == "nan"
    guard.forget_after(5)  # a rollback to step 5: steps 6.. will run again
    assert [h[0] for h in guard.history] == [3, 4, 5]  # the window held steps 3..12
    assert guard.check(13, 50.0, 1.0) is None  # and detection waits for a full window again


def test_ranks_split_each_global_batch_like_distributed_sampler(tiny_data_dir):
    rows = DataDir(tiny_data_dir).split("train")
    whole = PretrainBatches(rows, 8, seed=3)  # one process, 8 per step
    halves = [PretrainBatches(rows, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    for b in range(5):
        together = torch.cat([h(b).inputs for h in halves])
        # the two ranks read exactly the rows of the single-process batch, none twice
        assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, whole(b).inputs.tolist()))
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        PretrainBatches(rows, 4, seed=3, rank=2, world_size=2)


def test_async_checkpoint_snapshot_is_isolated_and_one_save_at_a_time(tmp_path):
    w = torch.zeros(1000)
    saver = ckpt.Checkpointer(tmp_path / "checkpoints", keep=2, config={}, asynchronous=True)
    saver.save(1, {"model": {"w": w}})
    w.add_(1.0)  # the optimizer moves on while step 1 is being written
    saver.save(2, {"model": {"w": w}})  # waits for step 1 first: at most one in flight
    w.add_(1.0)
    assert saver.wait() == tmp_path / "checkpoints" / "step_000002"
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_000001")["model"]["w"],
                       torch.zeros(1000))
    assert torch.equal(ckpt.load_checkpoint(saver.last)["model"]["w"], torch.ones(1000))


def test_a_failed_background_save_is_raised_on_the_next_call(tmp_path):
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the checkpoint directory should be")
    saver = ckpt.Checkpointer(blocker, keep=2, config={}, asynchronous=True)
    saver.save(1, {"model": {"w": torch.zeros(3)}})  # returns at once; the write fails behind
    with pytest.raises(RuntimeError, match="saving a checkpoint under .* failed"):
        saver.wait()


def test_goodput_buckets_from_step_times_and_events(tmp_path):
    """A 20 s job: 2 s startup, steps 1-4 (1 s each, 0.1 s of it waiting for data), a save,
    a kill in step 5, 3 s to restart, a restore to step 2 and steps 3-6 again."""
    ev = tm.EventLog(tmp_path, echo=False)
    t = 1000.0
    ev.emit("job_start", t=t)
    ev.emit("resume", t=t + 2, t0=t + 2, t1=t + 2, step=0)
    steps = tm.StepLog(tmp_path)
    for i in range(4):
        steps.record(i + 1, i, t + 2 + i, t + 2.1 + i, t + 3 + i)
    ev.emit("save", t=t + 6.5, t0=t + 6, t1=t + 6.5, step=4)
    ev.emit("fault_injected", t=t + 7, fault="kill@5:0", fault_kind="kill", step=5)
    ev.emit("worker_exit", t=t + 7.5, code=-9)
    ev.emit("resume", t=t + 10.5, t0=t + 10.5, t1=t + 11, step=2)
    for i in range(4):
        steps.record(i + 3, i + 2, t + 11 + i, t + 11.1 + i, t + 12 + i)
    steps.close()
    report = goodput.compute(tmp_path, until=t + 20)
    b = report["buckets"]
    assert report["wall_s"] == pytest.approx(20)
    assert b["productive"] == pytest.approx(0.9 * 6)  # steps 1, 2 of the first try, 3-6 of the second
    assert b["data_loading"] == pytest.approx(0.1 * 6)
    assert b["wasted_progress"] == pytest.approx(2 + 1.0)  # steps 3, 4; 6.5 -> 7.5 of step 5
    assert b["checkpoint_save"] == pytest.approx(0.5)
    assert b["recovery"] == pytest.approx(3.0)  # 7.5 -> 10.5
    assert b["checkpoint_restore"] == pytest.approx(0.5)
    assert b["startup"] == pytest.approx(2.0)
    assert b["other"] == pytest.approx(5.0)  # 15 -> 20
    assert sum(b.values()) == pytest.approx(20)
    assert report["goodput"] == pytest.approx(5.4 / 20)
    [fault] = report["faults"]
    assert fault["recovery_s"] == pytest.approx(4.0) and fault["resumed_at_step"] == 2
    assert fault["lost_s"] == pytest.approx(2.0)  # steps 3 and 4 again, then step 5 starts at 13


# --------------------------------------------------------------------------------------------
# The supervisor, on real processes

WORKER = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    from tasks.train.supervisor import WorkerEnv
    from tasks.train.telemetry import Heartbeat
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    env = WorkerEnv.from_env()
    if env.role == "spare":
        env.wait_for_promotion()
    hb = Heartbeat(env.heartbeat_path)
    log = open(os.path.join(os.environ["LLMOPS_TRAIN_RUN_DIR"], "attempts"), "a")
    log.write(f"{env.attempt} {os.getpid()}\\n"); log.flush()
    for step in range(1, 4):
        hb.beat(step); time.sleep(0.05)
    behaviour = sys.argv[1].split(",")[min(env.attempt, len(sys.argv[1].split(","))) - 1]
    def stuck_in_a_deadlock():
        time.sleep(120)
    if behaviour == "hang":
        stuck_in_a_deadlock()
    if behaviour == "crash":
        time.sleep(1.0)  # time for the supervisor to start a spare
        sys.exit(1)
    sys.exit({"ok": 0, "fatal": 3}[behaviour])
""")


def supervise(tmp_path: Path, behaviours: str, **kwargs) -> tuple[int, list[dict], list[str]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    defaults = dict(max_restarts=2, hang_timeout_s=1.0, hot_spare=False, poll_s=0.02,
                    dump_grace_s=0.5, spare_delay_s=0.0)
    sup = Supervisor(run_dir=run_dir, worker_cmd=[sys.executable, str(script), behaviours],
                     **{**defaults, **kwargs})
    code = sup.run()
    attempts = (run_dir / "attempts").read_text().split("\n")[:-1] if (run_dir / "attempts").exists() else []
    return code, tm.read_events(run_dir), attempts


def test_supervisor_dumps_the_stacks_of_a_hung_worker_kills_it_and_restarts_it(tmp_path, capfd):
    code, events, attempts = supervise(tmp_path, "hang,ok")
    assert code == 0 and len(attempts) == 2
    [hang] = kinds(events, "hang")
    assert hang["step"] == 3 and hang["stale_s"] >= 1.0
    assert kinds(events, "restart")[0]["restart"] == 1
    err = capfd.readouterr().err
    assert "stuck_in_a_deadlock" in err, "faulthandler's dump of the hung worker's stack"


def test_supervisor_restarts_within_budget_then_fails_the_task(tmp_path):
    code, events, attempts = supervise(tmp_path, "crash,crash,crash,ok", max_restarts=2)
    assert code == 1 and len(attempts) == 3
    assert [e["code"] for e in kinds(events, "worker_exit")] == [1, 1, 1]
    assert kinds(events, "budget_exhausted")[0]["restarts"] == 2


def test_supervisor_never_restarts_a_worker_that_failed_setting_up(tmp_path):
    code, events, attempts = supervise(tmp_path, "fatal,ok")
    assert code == FATAL_EXIT and len(attempts) == 1 and kinds(events, "fatal")


def test_supervisor_promotes_the_hot_spare(tmp_path):
    code, events, attempts = supervise(tmp_path, "crash,ok", hot_spare=True)
    assert code == 0
    spawns = kinds(events, "spawn")
    assert [s["mode"] for s in spawns] == ["cold", "hot_spare"]
    # the promoted process is the spare started while attempt 1 was running
    assert spawns[1]["worker_pid"] == kinds(events, "spare_start")[0]["spare_pid"]
    assert attempts[1] == f"2 {spawns[1]['worker_pid']}"


# --------------------------------------------------------------------------------------------
# The whole job


def test_kill_corrupt_checkpoint_hang_spike_and_nan_in_one_supervised_run(tiny_data_dir, tmp_path):
    """Each fault is recovered from inside the job (the task never fails), and the run ends with
    bitwise the weights of an uninterrupted run that skipped the spike's batch: none lost, none
    repeated, the RNG (dropout) restored at every resume."""
    import mlflow

    common = dict(max_steps=40, checkpoint_interval=5, eval_interval=20, log_interval=5,
                  keep_checkpoints=3, spike_window=10, spike_sigma=6.0, spike_skip_batches=1,
                  max_restarts=3, max_rollbacks=3, hang_timeout_s=2.0,
                  model={**to_dict(tiny().pretrain.model), "dropout": 0.1})
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "faulty", **common)
    proc, result_file = run_pretrain(
        cfg, tmp_path, faults="kill@12,corrupt_ckpt@15,hang@18,spike@27,nan@33")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    result = json.loads(result_file.read_text())
    events = tm.read_events(tm.run_dir(cfg.output_dir))

    # kill and hang: the worker was restarted twice (hot spare or fresh), the hang after a
    # stack dump that shows where it hung
    assert len(kinds(events, "restart")) == 2 and result["metrics"]["restarts"] == 2
    assert kinds(events, "worker_exit", code=-9)
    assert kinds(events, "hang")[0]["step"] == 17  # the last completed step
    assert "_hang_forever" in out
    # the corrupt step-15 checkpoint was skipped by the restart after the hang
    assert "skipping checkpoint step 15" in out
    assert all(e["step"] != 15 for e in kinds(events, "resume") if e["t0"] > kinds(events, "hang")[0]["t"])
    # spike: its update never applied, so rolled back in place (no checkpoint read, nothing
    # recomputed) and its batch skipped; NaN: rolled back to a checkpoint and replayed
    spike = kinds(events, "anomaly", anomaly="loss_spike")[0]
    assert spike["step"] == 27
    assert kinds(events, "skip")[0]["batches"] == [spike["batch"]]
    assert kinds(events, "rollback", anomaly="loss_spike")[0]["in_place"] is True
    assert not kinds(events, "resume", reason="loss_spike")
    assert kinds(events, "resume", reason="nan")
    recovered = {f["fault"]: f for f in read_json(tm.run_dir(cfg.output_dir) / "goodput.json")["faults"]}
    assert recovered["spike@27:0"]["recovered"] and recovered["spike@27:0"]["lost_s"] == 0.0
    assert recovered["kill@12:0"]["recovered"] and recovered["kill@12:0"]["lost_s"] >= 0
    nan = kinds(events, "anomaly", anomaly="nan")[0]
    assert nan["step"] == 33 and len(kinds(events, "rollback")) == 2
    skipped = json.loads((tm.run_dir(cfg.output_dir) / "skipped_batches.json").read_text())
    assert skipped["batches"] == [spike["batch"]] and skipped["records"][0]["reason"] == "loss_spike"
    assert result["metrics"]["rollbacks"] == 2 and result["metrics"]["skipped_batches"] == 1

    # the data: each batch index before the final cursor trained once, except the skipped one
    trainer = ckpt.read_part(Path(result["outputs"]["checkpoint"]), "trainer")
    assert trainer["data_cursor"] == 41 and trainer["skipped_batches"] == [spike["batch"]]
    last_batch_of_step = {s["s"]: s["b"] for s in tm.read_steps(tm.run_dir(cfg.output_dir))}
    assert sorted(last_batch_of_step.values()) == sorted(set(range(41)) - {spike["batch"]})

    reference = reference_run(tiny_cfg(tiny_data_dir, tmp_path / "reference", **common),
                              tiny_data_dir, skipped=[spike["batch"]])
    final = final_weights(Path(cfg.output_dir), 40)
    different = [k for k, v in reference.state_dict().items() if not torch.equal(v, final[k])]
    assert not different, f"weights differ from the uninterrupted run in {different}"

    # goodput and every event on the MLflow run
    report = result["metrics"]["goodput"]
    assert 0 < report < 1
    client = mlflow.MlflowClient()
    run = client.get_run(result["mlflow_run_id"])
    for key in ("resilience/goodput", "resilience/badput_recovery_s",
                "resilience/badput_hang_detection_s", "resilience/restarts",
                "resilience/rollbacks", "resilience/event_rollback", "resilience/event_restart",
                "resilience/event_hang"):
        assert key in run.data.metrics, key
    assert run.data.metrics["resilience/restarts"] == 2
    artifacts = {a.path for a in client.list_artifacts(result["mlflow_run_id"], "resilience")}
    assert {"resilience/goodput.png", "resilience/goodput.json", "resilience/events.jsonl",
            "resilience/skipped_batches.json"} <= artifacts
    assert set(result["outputs"]) == {"model_dir", "checkpoint"}
    assert {"val_loss", "train_loss", "tokens_per_s", "params", "lr", "step"} <= set(result["metrics"])


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_process_run_survives_a_killed_rank(tiny_data_dir, tmp_path, parallelism):
    """torchrun, 2 CPU processes (gloo), rank 1 killed mid-run. DDP: only rank 1 is restarted,
    rank 0 rejoins a new process group in place; FSDP (shards cannot re-form in place): both
    workers restart. Either way the result matches one process training on the same global
    batches, within float tolerance (the ranks' gradients are summed in another order)."""
    common = dict(max_steps=16, batch_size=4, checkpoint_interval=5, eval_interval=8,
                  log_interval=4, hot_spare=False, hang_timeout_s=60.0, parallelism=parallelism)
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "ddp", **common)
    proc, result_file = run_pretrain(cfg, tmp_path, faults="kill@9:1", nproc=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    result = json.loads(result_file.read_text())
    assert result["metrics"]["step"] == 16 and "model_uri" in result

    events = tm.read_events(tm.run_dir(cfg.output_dir))
    assert kinds(events, "worker_exit", rank=1, code=-9)
    assert len(kinds(events, "restart", rank=1)) == 1
    rank0_workers = {e["pid"] for e in events if e["rank"] == 0 and e["source"] == "worker"}
    if parallelism == "ddp":
        assert not kinds(events, "restart", rank=0) and len(rank0_workers) == 1
        assert kinds(events, "peer_failure", rank=0)
        assert {e["round"] for e in kinds(events, "joined", rank=0)} == {0, 1}
    else:
        assert len(rank0_workers) == 2  # rank 0's worker failed with its group and restarted

    reference = reference_run(tiny_cfg(tiny_data_dir, tmp_path / "one", **common), tiny_data_dir,
                              batch_size=8)
    final = final_weights(Path(cfg.output_dir), 16)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=name)


# --------------------------------------------------------------------------------------------
# Watchdog phases with budgets of their own (save, restore, upload, compile), and slow I/O

PHASED_WORKER = textwrap.dedent("""
    import json, os, sys, time
    from tasks.train import telemetry as tm
    from tasks.train.supervisor import WorkerEnv
    env = WorkerEnv.from_env()
    hb = tm.Heartbeat(env.heartbeat_path)
    with open(os.path.join(os.environ["LLMOPS_TRAIN_RUN_DIR"], "attempts"), "a") as log:
        log.write(f"{env.attempt} {os.getpid()}\\n")
    plans = json.loads(sys.argv[1])
    # each segment: [phase name, seconds in it, seconds between checkpoint-byte beats (0: none)]
    for phase, seconds, io_every in plans[min(env.attempt, len(plans)) - 1]:
        hb.beat(1, tm.PHASES.index(phase))
        end = time.time() + seconds
        while time.time() < end:
            time.sleep(io_every or 0.05)
            if io_every:
                hb.io_progress(1 << 20)
""")


def supervise_phases(tmp_path: Path, plans: list, **kwargs) -> tuple[int, list[dict]]:
    script = tmp_path / "phased_worker.py"
    script.write_text(PHASED_WORKER)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sup = Supervisor(run_dir=run_dir, worker_cmd=[sys.executable, str(script), json.dumps(plans)],
                     **{**dict(max_restarts=1, hot_spare=False, poll_s=0.02, dump_grace_s=0.2),
                        **kwargs})
    return sup.run(), tm.read_events(run_dir)


def test_supervisor_gives_save_restore_upload_and_compile_their_own_budgets(tmp_path):
    """Each slow phase lasts 3x hang_timeout_s without a beat: within its own budget, so no
    kill; the same stall in an ordinary step is a hang (the control, in the same run)."""
    budgets = {tm.SAVE: 3.0, tm.RESTORE: 3.0, tm.UPLOAD: 3.0, tm.COMPILE: 3.0}
    slow = [[phase, 1.2, 0] for phase in ("restore", "compile", "save", "upload")]
    code, events = supervise_phases(tmp_path, [slow + [["step", 1.2, 0]], []],
                                    hang_timeout_s=0.4, phase_timeouts=budgets)
    assert code == 0
    [hang] = kinds(events, "hang")
    assert hang["phase"] == "step" and hang["budget_s"] == 0.4 and hang["attempt"] == 1


def test_supervisor_counts_moving_checkpoint_bytes_as_progress_and_kills_a_stalled_save(tmp_path):
    """An upload beating its bytes lasts 4x its budget and is not killed; the same phase with no
    bytes moving is killed at its budget (not at hang_timeout_s, and no sooner)."""
    budgets = {tm.UPLOAD: 0.6, tm.SAVE: 0.6}
    plans = [[["upload", 2.4, 0.1], ["save", 5.0, 0]], []]
    code, events = supervise_phases(tmp_path, plans, hang_timeout_s=0.2, phase_timeouts=budgets)
    assert code == 0
    [hang] = kinds(events, "hang")
    assert hang["phase"] == "save" and 0.6 <= hang["stale_s"] < 2.0


def test_rendezvous_and_finishing_are_left_to_their_own_timeouts(tmp_path):
    plans = [[["rendezvous", 1.0, 0], ["finishing", 1.0, 0]]]
    code, events = supervise_phases(tmp_path, plans, hang_timeout_s=0.3)
    assert code == 0 and not kinds(events, "hang")


def test_slow_save_restore_and_final_upload_do_not_trip_the_watchdog(tiny_data_dir, tmp_path):
    """A slowed-down writer: the step-5 checkpoint stalls 3x hang_timeout_s before its first
    byte (so the step-10 save waits on it), the restore after a kill stalls as long, and so does
    the final checkpoint, which the job waits for before it reports. No hang is declared, the
    only restart is the kill's, and the final checkpoint is committed."""
    common = dict(max_steps=20, checkpoint_interval=5, eval_interval=20, log_interval=5,
                  hot_spare=False, max_restarts=2, hang_timeout_s=1.5, save_timeout_s=60.0,
                  restore_timeout_s=60.0, upload_timeout_s=60.0)
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "slow", **common)
    proc, result_file = run_pretrain(
        cfg, tmp_path, faults="slow_save@5+4.5s,kill@13,slow_restore@5+4.5s,slow_save@20+4.5s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    events = tm.read_events(tm.run_dir(cfg.output_dir))
    assert not kinds(events, "hang"), "a slow save, restore or upload was taken for a hang"
    assert len(kinds(events, "restart")) == 1 and kinds(events, "worker_exit", code=-9)
    assert max(e["blocked_s"] for e in kinds(events, "save", step=10)) > cfg.hang_timeout_s
    [restore] = [e for e in kinds(events, "resume") if e["path"]]
    assert restore["t1"] - restore["t0"] >= 4.5
    assert max(e["blocked_s"] for e in kinds(events, "save", step=20)) > cfg.hang_timeout_s
    assert ckpt.verify_checkpoint(Path(cfg.output_dir) / "checkpoints" / "step_000020") is None
    assert json.loads(result_file.read_text())["metrics"]["step"] == 20


def test_slow_io_faults_take_a_duration_and_only_they_do():
    assert parse_faults("slow_save@5+4.5s,slow_restore@10:1") == [
        Fault("slow_save", 5, seconds=4.5), Fault("slow_restore", 10, 1)]
    with pytest.raises(FaultSpecError, match=r"take a duration, as kind@step\+Ds"):
        parse_faults("kill@5+3s")


# --------------------------------------------------------------------------------------------
# A peer failure heard through the store (tasks/train/distributed.py: the stale-round watcher)

STALE_ROUND_WORKER = textwrap.dedent("""
    import datetime, sys, time
    import torch, torch.distributed as dist
    from tasks.train.distributed import DistContext
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    timeout = datetime.timedelta(seconds=60)
    def connect():
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    ctx = DistContext(rank=rank, world_size=2, local_rank=0, device=torch.device("cpu"),
                      timeout=timeout, store=connect(), key="job", watch_store=connect(),
                      stale_grace_s=1.0)
    ctx.join()
    dist.all_reduce(torch.ones(1))
    print("in round", ctx.round, flush=True)
    if rank == 1:
        time.sleep(120)  # hung, not dead: its sockets stay open, so no connection reset
    dist.all_reduce(torch.ones(1))  # blocks on the hung rank
""")


def test_a_rank_blocked_on_a_hung_peer_hears_the_round_is_over_and_exits_for_a_restart(tmp_path):
    """Rank 1 hangs with its connections open; its replacement moves the round on (here the
    test does, as join() would). Rank 0, blocked in a gloo all_reduce that would wait out the
    60 s collective timeout, learns it from the store and exits for its supervisor to restart
    it, within its 1 s grace."""
    import datetime
    import time

    import torch.distributed as dist

    from tasks.train.distributed import STALE_GROUP_EXIT, DistContext

    script = tmp_path / "stale_round_worker.py"
    script.write_text(STALE_ROUND_WORKER)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'plugins'}"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(master.port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["in round 0"] * 2
        time.sleep(0.5)  # rank 0 is in its second all_reduce, rank 1 asleep
        replacement = DistContext(rank=1, world_size=2, local_rank=0, device=torch.device("cpu"),
                                  timeout=datetime.timedelta(seconds=60), store=master, key="job")
        t0 = time.time()
        replacement._move_on(0)
        code = procs[0].wait(timeout=30)
        took = time.time() - t0
        err = procs[0].stderr.read()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert code == STALE_GROUP_EXIT, err[-3000:]
    assert "round 0 is over" in err
    assert 1.0 <= took < 5.0, took
    assert master.get("job/round") == b"1"
