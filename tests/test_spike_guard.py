"""The spike guard (tasks/train/guard.py): no false alarms on healthy noise, real spikes caught
with only their batch skipped, a rollback budget counted per job, and repeated spikes after a
rollback treated as a weights/lr problem rather than skipping batch after batch.

Mostly the detector on synthetic sequences shaped like the benchmark's recorded ones
(benchmarks/spike_guard.py); three short in-process loop runs on the tiny data.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from tasks.configs import TrainConfig, from_dict, tiny, to_dict
from tasks.model.gpt import GPT
from tasks.train.prepared_data import DataDir, PretrainBatches
from tasks.train.faults import Fault, FaultInjector, parse_faults
from tasks.train.guard import MAX_ESCALATIONS, Anomaly, SpikeGuard, UnrecoverableAnomaly
from tasks.train.losses import cross_entropy
from tasks.train.loop import LoopOptions, LoopResult, train
from tasks.train.runtime import seed_everything
from tasks.train.scoring import shard_loss
from tasks.train.schedule import lr_at


def healthy_run(seed: int, steps: int = 600) -> list[tuple[int, float, float]]:
    """(step, loss, pre-clip grad norm) of a healthy run shaped as the benchmark recorded them: a
    loss falling fast then slowly, with batch-to-batch noise of a few percent and heavy tails (one
    step in fifty up to 1.35x), and a transient spike as the wider tiny model's clean runs have
    (loss x2.2 then x1.1, grad norm x100, then back); the grad norm falls through the warm-up and
    then rises again as the loss flattens, the pattern that made the old detector fire."""
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        loss = 2.0 + 3.5 * math.exp(-step / 60) + 0.3 * math.exp(-step / 600)
        loss *= 1 + rng.gauss(0, 0.02)
        if rng.random() < 0.02:
            loss *= rng.uniform(1.1, 1.35)
        norm = (0.9 * math.exp(-step / 40) + 0.4 + 0.6 * min(1.0, step / 300)) * rng.uniform(0.8, 1.25)
        transient = step - (60 + 37 * (seed % 5))
        if transient in (0, 1):
            loss, norm = loss * (2.2, 1.1)[transient], norm * 100
        out.append((step, loss, norm))
    return out


def replay(guard: SpikeGuard, run: list[tuple[int, float, float]]) -> list[Anomaly]:
    fired = []
    for step, loss, norm in run:
        anomaly = guard.check(step, loss, norm)
        if anomaly is None:
            guard.add(step, loss, norm)
        else:
            fired.append(anomaly)
    return fired


@pytest.mark.parametrize("window", [30, 100])
def test_healthy_noisy_falling_runs_never_fire(window):
    for seed in range(20):
        guard = SpikeGuard(sigma=6.0, window=window, warmup_steps=20)
        assert replay(guard, healthy_run(seed)) == [], f"seed {seed}"
    # the k-sigma rule alone (no min_ratio floor) cannot tell these tails from spikes
    sigma_only = [replay(SpikeGuard(sigma=6.0, window=window, min_ratio=1.0, warmup_steps=20),
                         healthy_run(seed)) for seed in range(20)]
    assert sum(map(bool, sigma_only)) >= 10


def test_a_spike_fires_once_and_nan_is_always_an_anomaly():
    run = healthy_run(3)
    guard = SpikeGuard(sigma=6.0, window=30, warmup_steps=20)
    spiked = [(s, loss * (5.0 if s == 400 else 1.0), n) for s, loss, n in run]
    assert [(a.kind, a.step) for a in replay(guard, spiked)] == [("loss_spike", 400)]
    assert guard.check(601, float("nan"), 1.0).kind == "nan"
    assert guard.check(601, 2.1, float("inf")).kind == "nan"
    # nothing before the lr warm-up and a full window: the steep first steps are not spikes
    fresh = SpikeGuard(sigma=6.0, window=30, warmup_steps=50)
    for step, loss, norm in run[:49]:
        fresh.add(step, loss, norm)
    assert fresh.check(50, 100.0, 1.0) is None and fresh.check(51, 100.0, 1.0) is not None


def test_the_rollback_budget_is_the_jobs_and_survives_a_restart_and_a_rollback():
    guard = SpikeGuard(sigma=6.0, window=30, max_rollbacks=2)
    assert guard.rollback(Anomaly("loss_spike", 100, 9.0, 3.0), skipped=True) is None
    checkpoint_before_second = guard.state_dict()
    assert guard.rollback(Anomaly("nan", 200, math.nan, math.nan), skipped=False) is None
    job_file = json.loads(json.dumps({"guard": guard.job_state()}))  # skipped_batches.json

    restarted = SpikeGuard(sigma=6.0, window=30, max_rollbacks=2)  # a new worker process
    restarted.load_job_state(job_file["guard"])
    restarted.load_state_dict(checkpoint_before_second)  # resumes from an older checkpoint
    assert restarted.rollbacks == 2
    problem = restarted.rollback(Anomaly("loss_spike", 300, 9.0, 3.0), skipped=True)
    assert "rollback 3 of this job, and max_rollbacks is 2" in problem
    assert "raise max_rollbacks" in problem


def test_spikes_right_after_a_rollback_lower_the_lr_then_fail_as_a_weights_problem():
    guard = SpikeGuard(sigma=6.0, window=30, max_rollbacks=100)
    assert guard.rollback(Anomaly("loss_spike", 100, 9.0, 3.0), skipped=True) is None
    assert guard.lr_scale(99) == 1.0  # a first spike is the data's: skip it, same lr
    skips = 1
    for i in range(1, MAX_ESCALATIONS + 1):  # the next candidates spike too
        assert guard.rollback(Anomaly("loss_spike", 100 + i, 9.0, 3.0), skipped=True) is None
        skips += 1
        assert guard.lr_scale(90) == 0.5 ** i and guard.lr_scale(100 + i + 29) == 0.5 ** i
        assert guard.lr_scale(100 + i + 30) == 1.0  # a window past the spike: the full lr again
    problem = guard.rollback(Anomaly("loss_spike", 100 + MAX_ESCALATIONS + 1, 9.0, 3.0),
                             skipped=True)
    assert "Skipping data does not help: the weights or the learning rate" in problem
    assert skips == MAX_ESCALATIONS + 1  # a bounded few batches per incident, never dozens
    # a spike far from the last skipped one is a new incident: no escalation
    again = SpikeGuard(sigma=6.0, window=30, max_rollbacks=100)
    again.rollback(Anomaly("loss_spike", 100, 9.0, 3.0), skipped=True)
    again.rollback(Anomaly("loss_spike", 150, 9.0, 3.0), skipped=True)
    assert again.escalation == 0 and again.lr_scale(149) == 1.0


def test_spike_fault_takes_a_size():
    assert parse_faults("spike@40*5,spike@60") == [Fault("spike", 40, 0, 5.0), Fault("spike", 60)]
    injector = FaultInjector(parse_faults("spike@3*2.5"), 0, None)
    assert float(injector.scale_loss(3, torch.tensor(2.0))) == 5.0
    with pytest.raises(ValueError, match="only spike takes a size"):
        parse_faults("kill@5*3")


# --------------------------------------------------------------------------------------------
# In the loop


def loop_run(data_dir: Path, output_dir: Path, *, faults: str, steps: int = 50,
             guard_state: dict | None = None, **overrides) -> LoopResult:
    cfg = tiny().pretrain
    cfg = from_dict(TrainConfig, {**to_dict(cfg), "data_dir": str(data_dir),
                                  "output_dir": str(output_dir), "max_steps": steps,
                                  "checkpoint_interval": 10, "keep_checkpoints": 3,
                                  "eval_interval": steps, "log_interval": 5,
                                  "async_checkpoint": False, "spike_window": 10, **overrides})
    data = DataDir(data_dir)
    val = data.split("val")
    skipped_file = output_dir / "skipped_batches.json"
    output_dir.mkdir(parents=True)
    if guard_state is not None:
        skipped_file.write_text(json.dumps({"batches": [], "guard": guard_state}))
    seed_everything(cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses to threads on a shared 2-core box
    try:
        return train(model=GPT(cfg.model), cfg=cfg, device=torch.device("cpu"),
                     resolved_config=to_dict(cfg), tracking=False, loss_fn=cross_entropy,
                     get_batch=PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed),
                     evaluate=lambda m: {"val_loss": shard_loss(m, val, 4, 1, torch.device("cpu"))},
                     options=LoopOptions(spike_sigma=cfg.spike_sigma, spike_window=cfg.spike_window,
                                         spike_min_ratio=cfg.spike_min_ratio,
                                         max_rollbacks=cfg.max_rollbacks, skipped_file=skipped_file,
                                         faults=FaultInjector(parse_faults(faults), 0, None)))
    finally:
        torch.set_num_threads(threads)


def test_in_the_loop_a_x5_spike_is_caught_and_only_its_batch_skipped(tiny_data_dir, tmp_path):
    result = loop_run(tiny_data_dir, tmp_path / "run", faults="spike@35*5")
    assert result.rollbacks == 1 and result.skipped_batches == [34]  # step 35 read batch 34
    saved = json.loads((tmp_path / "run" / "skipped_batches.json").read_text())
    assert saved["guard"]["rollbacks"] == 1 and saved["records"][0]["reason"] == "loss_spike"


def test_in_the_loop_a_repeat_spike_halves_the_lr_and_a_spent_budget_fails(tiny_data_dir, tmp_path):
    result = loop_run(tiny_data_dir, tmp_path / "repeat", faults="spike@31,spike@32")
    assert result.rollbacks == 2 and result.skipped_batches == [30, 32]
    lr = {int(h["step"]): h["lr"] for h in result.history if "lr" in h}
    optim = tiny().pretrain.optim
    assert lr[35] == pytest.approx(0.5 * lr_at(34, optim, 50))  # steps 33..41 at half the lr
    assert lr[45] == pytest.approx(lr_at(44, optim, 50))  # a window after: the full lr

    # a restarted worker of a job that already rolled back max_rollbacks times
    with pytest.raises(UnrecoverableAnomaly, match="rollback 2 of this job, and max_rollbacks is 1"):
        loop_run(tiny_data_dir, tmp_path / "budget", faults="spike@31", steps=35,
                 max_rollbacks=1, guard_state={"rollbacks": 1})


def test_a_worker_whose_guard_gave_up_exits_with_the_code_the_supervisor_does_not_restart(
        monkeypatch, tmp_path):
    import faulthandler
    import signal

    from tasks.train import pretraining
    from tasks.train.loop import LossSpikeError
    from tasks.train.supervisor import FATAL_EXIT, WorkerEnv

    def spent(*args, **kwargs):
        raise LossSpikeError("rollback 6 of this job, and max_rollbacks is 5")

    monkeypatch.setattr(pretraining, "_setup", lambda cfg, env, warm: None)
    monkeypatch.setattr(pretraining, "_train", spent)
    env = WorkerEnv(role="worker", attempt=2, rank=0, local_rank=0, world_size=1, run_dir=tmp_path)
    cfg = from_dict(TrainConfig, {**to_dict(tiny().pretrain), "data_dir": str(tmp_path),
                                  "output_dir": str(tmp_path)})
    try:
        with pytest.raises(SystemExit) as exit_:
            pretraining.run_worker(cfg, env)
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # run_worker registers the watchdog's stack dump
    assert exit_.value.code == FATAL_EXIT
