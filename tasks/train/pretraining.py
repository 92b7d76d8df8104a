"""Pretraining's library: what `python -m tasks.pretrain` (tasks/pretrain.py, its command line)
runs, and what sweep trials call in-process (`pretrain`).

- The job: `supervise` (the supervisor's side: the worker's config, a fork's seed, then
  tasks/train/supervisor.py's Supervisor running `python -m tasks.pretrain` as the worker, and the
  result or exit code it ends with) and `run_worker` (one rank's worker or hot spare: setup, the
  training, and the exit codes its supervisor reads: FATAL_EXIT, NODE_UNHEALTHY_EXIT).
- One training: `pretrain` / `_train` (the shared loop, tasks/train/loop.py, with the resilience
  options: checkpoint mirror, guard, faults, health, pause, heartbeat), set up by `_setup`
  (imports, data, model; what a hot spare does in advance) from `check_model_fits_data` and the
  seeded initial weights.
- What it reports: the result (finished, or `_paused_result`), goodput and resilience events on
  the MLflow run (`_report`, `_log_new_events`), the kept checkpoint steps (`record_kept_steps`),
  and the published model.
- The watchdog's budgets: `collective_timeout_s`, `phase_timeouts`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tasks.common.io import read_json, write_json
from tasks.common.job_tracking import stage_run
from tasks.configs import ModelConfig, TrainConfig, to_dict
from tasks.train import telemetry as tm
from tasks.train.supervisor import FATAL_EXIT, PAUSED_EXIT, Supervisor, WorkerEnv

log = logging.getLogger("tasks.pretrain")   # the command's log, as before it moved here
FORK_FILE = "fork.json"   # the fork's lineage (tasks/train/fork.py), for the worker's MLflow run
# The checkpoint steps the retention policy left (tasks/train/retention.py), on the MLflow run
# for the run page (llmops.stages.run_summary): comma-separated, ascending; the count beside it.
KEPT_TAG, KEPT_COUNT_TAG = "checkpoints.kept", "checkpoints.kept_count"
KEPT_TAG_CHARS = 4000   # under MLflow's tag value limit; a longer list keeps its newest steps


def check_model_fits_data(model: ModelConfig, vocab_size: int, seq_len: int) -> None:
    if model.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than the tokenizer's "
                         f"vocabulary ({vocab_size}); set model.vocab_size >= {vocab_size}.")
    if model.block_size < seq_len:
        raise ValueError(f"model.block_size ({model.block_size}) is shorter than the data's rows "
                         f"(seq_len {seq_len}); set model.block_size >= {seq_len}.")


def collective_timeout_s(cfg: TrainConfig) -> float:
    """Longer than the watchdog's wait (1.5x for a rank in a collective), so that a hang is
    caught by the watchdog, which dumps stacks, before a collective times out."""
    return 2 * cfg.hang_timeout_s + 30


def phase_timeouts(cfg: TrainConfig) -> dict[int, float]:
    """The watchdog's budget for each phase that is slow by nature (tasks/train/supervisor.py)."""
    return {tm.SAVE: cfg.save_timeout_s, tm.RESTORE: cfg.restore_timeout_s,
            tm.UPLOAD: cfg.upload_timeout_s, tm.COMPILE: cfg.compile_timeout_s}


@dataclass
class _Setup:
    device: Any
    data: Any
    train_rows: Any
    val_rows: Any
    model: Any
    peak_flops: float
    accumulation: int  # micro-steps per optimizer step (TrainConfig.global_batch_tokens)


def _setup(cfg: TrainConfig, env: WorkerEnv, *, warm: bool = False) -> _Setup:
    """Everything before training that a hot spare can do in advance: imports, data, model.
    warm: also pay now for what training would otherwise pay at its start (measured on a
    loaded 2-core box: MLflow's import ~2 s and its store ~1 s, the first optimizer ~1.4 s (it
    imports torch._dynamo), matplotlib ~1 s), so a promoted spare resumes in well under a
    second."""
    import torch

    from tasks.model.causal_lm import build_model
    from tasks.train.prepared_data import DataDir
    from tasks.train.runtime import peak_flops, pick_device, seed_everything

    device = pick_device(env.local_rank if env.world_size > 1 else None)
    data = DataDir(cfg.data_dir, cache_gb=cfg.stream_cache_gb)   # an s3:// one streams its shards
    data.check_tokenizer()
    check_model_fits_data(cfg.model, data.vocab_size, data.seq_len)
    accumulation = cfg.accumulation_steps(data.seq_len, env.world_size)  # refused here, not later
    train_rows, val_rows = data.split("train", cfg.shuffle_block_rows), data.split("val")
    if warm:
        import matplotlib.pyplot  # noqa: F401 - imported for its import time
        import mlflow

        from tasks.train import distributed, export, goodput, loop, scoring  # noqa: F401

        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        if env.rank == 0:
            mlflow.MlflowClient().search_experiments(max_results=1)  # opens the store
    seed_everything(cfg.seed)  # the initial weights are part of what the seed reproduces
    # A transformers Llama keeps RoPE's inverse frequencies in a non-persistent buffer, which no
    # state dict carries: built on the meta device it would come back as garbage. It is built
    # whole on every rank (same seed, same weights) and sharded from there.
    if cfg.parallelism == "fsdp" and env.world_size > 1 and cfg.model.arch == "gpt":
        # shapes only: each rank allocates its own shards (tasks/train/distributed.py wrap)
        with torch.device("meta"):
            model = build_model(cfg.model)
    else:
        model = build_model(cfg.model)
    if env.world_size > 1:
        # DDP starts every rank from rank 0's weights; dropout should differ per rank
        torch.manual_seed(cfg.seed + env.rank)
    return _Setup(device, data, train_rows, val_rows, model, peak_flops(device), accumulation)


def _initial_weights(cfg: TrainConfig) -> dict[str, Any]:
    """The weights a single-process run starts from (build_model(cfg.model) after seeding with
    cfg.seed), built on the CPU without disturbing this process's generators: FSDP's rank 0
    shards them."""
    import torch

    from tasks.model.causal_lm import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model).state_dict()


def pretrain(cfg: TrainConfig, stage: str = "pretrain", publish: bool = True, *,
             on_eval: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, Any]:
    """Train from scratch (or resume) on cfg.data_dir in this process. Sweep trials call this
    with publish=False: they only need the val loss, not a model directory or an MLflow model."""
    env = WorkerEnv.from_env()
    return _train(cfg, _setup(cfg, env), env, stage=stage, publish=publish, on_eval=on_eval)


def _train(cfg: TrainConfig, setup: _Setup, env: WorkerEnv, *, stage: str, publish: bool,
           on_eval: Callable[[int, dict[str, float]], None] | None) -> dict[str, Any]:
    from tasks.train.prepared_data import PretrainBatches
    from tasks.train.distributed import DistContext
    from tasks.train.export import publish_model, published
    from tasks.train.faults import FaultInjector
    from tasks.train.health import JobHealth, health_settings
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import LoopOptions, train
    from tasks.model.causal_lm import position_params
    from tasks.train.runtime import gpt_flops_per_token
    from tasks.train.checkpoint_s3 import mirror_for
    from tasks.train.scoring import shard_loss

    device, data, model = setup.device, setup.data, setup.model
    if not any(p.is_meta for p in model.parameters()):  # FSDP allocates its shards itself
        model = model.to(device)
    run_dir = tm.run_dir(cfg.output_dir)
    supervised = env.role is not None
    events = tm.EventLog(run_dir, rank=env.rank, source="worker")
    if not supervised and env.rank == 0:
        events.emit("job_start", in_process=True)  # goodput is measured from here
    dist = DistContext.from_env(device, parallelism=cfg.parallelism,
                                timeout_s=collective_timeout_s(cfg))
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)
    mirror = mirror_for(cfg.checkpoint_uri)
    faults = FaultInjector.from_env(rank, events)
    health = JobHealth(health_settings(cfg), state_file=run_dir / "health.json",
                       faults=faults if faults else None)
    from tasks.train.pause import PauseWatch, marker_path

    pause = PauseWatch(marker_path(cfg.output_dir), mirror)  # read by rank 0 only (the loop)
    options = LoopOptions(
        dist=dist, async_checkpoint=cfg.async_checkpoint, checkpoint_mirror=mirror,
        spike_sigma=cfg.spike_sigma, spike_window=cfg.spike_window,
        spike_min_ratio=cfg.spike_min_ratio,
        spike_skip_batches=cfg.spike_skip_batches, max_rollbacks=cfg.max_rollbacks,
        max_rejoins=cfg.max_restarts, faults=faults if faults else None, events=events,
        steps=tm.StepLog(run_dir, rank=0, attempt=env.attempt) if rank == 0 else None,
        heartbeat=tm.Heartbeat(env.heartbeat_path) if supervised and env.heartbeat_path else None,
        skipped_file=run_dir / "skipped_batches.json",
        flops_per_token=gpt_flops_per_token(model.num_params(), cfg.model.n_layer, cfg.model.n_embd,
                                            data.seq_len, position_params(model)),
        peak_flops=setup.peak_flops, compile=cfg.compile, accumulation=setup.accumulation,
        global_batch=cfg.batch_size * world * setup.accumulation,
        init_weights=lambda: _initial_weights(cfg), keep_every=cfg.keep_every, health=health,
        pause=pause)
    val_rows = setup.val_rows

    tracked = stage_run(stage, cfg) if rank == 0 else contextlib.nullcontext(None)
    with tracked as run:
        if run is not None:
            import mlflow

            if supervised and not os.environ.get("MLFLOW_RUN_ID"):
                # a restarted worker of this job must log into this run, not open another
                (run_dir / "mlflow_run_id").write_text(run.info.run_id)
            mlflow.set_tags({"data.content_hash": data.content_hash})
            if (run_dir / FORK_FILE).exists():   # the parent run and step it forked from
                mlflow.set_tags({k: str(v) for k, v in read_json(run_dir / FORK_FILE).items()})
            mlflow.log_metric("params", model.num_params())
            _log_new_events(run_dir)
        log.info("%s: %d parameters on %s (rank %d of %d); %d train rows x %d tokens, data %s",
                 stage, model.num_params(), device, rank, world, setup.train_rows.rows,
                 data.seq_len, data.content_hash[:12])

        result = train(
            model=model, cfg=cfg, device=device, resolved_config=to_dict(cfg),
            get_batch=PretrainBatches(setup.train_rows, cfg.batch_size, cfg.seed, rank, world,
                                      setup.accumulation, order=cfg.sample_order,
                                      window_blocks=cfg.shuffle_window_blocks),
            loss_fn=cross_entropy, on_eval=on_eval, options=options, tracking=run is not None,
            evaluate=lambda m: {"val_loss": shard_loss(m, val_rows, cfg.batch_size,
                                                       cfg.eval_batches, device)})
        paused = result.paused_at is not None
        if rank != 0:
            return {"metrics": {"step": result.step}, "outputs": {"checkpoint": result.checkpoint},
                    "rank": rank, **({"paused": True, "paused_at_step": result.paused_at}
                                     if paused else {})}
        if paused:
            return _paused_result(run_dir, result, run, cfg)

        report = _report(run_dir, result)
        named = health.report()
        out: dict[str, Any] = {
            "metrics": {"val_loss": result.val["val_loss"], "train_loss": result.train_loss,
                        "tokens_per_s": result.tokens_per_s, "params": model.num_params(),
                        "lr": cfg.optim.lr, "step": result.step,
                        "goodput": report["goodput"], "rollbacks": result.rollbacks,
                        "skipped_batches": len(result.skipped_batches),
                        "stragglers": len(named["stragglers"]),
                        "sdc_mismatches": len(named["sdc_mismatches"])},
            "health": named,  # the ranks and hosts named, with their numbers, for the ledger
            "outputs": {"checkpoint": result.checkpoint},
            "resumed_from": result.resumed_from,
            "mlflow_run_id": run.info.run_id,
        }
        if (run_dir / FORK_FILE).exists():
            out["fork"] = read_json(run_dir / FORK_FILE)
        out["kept_steps"] = record_kept_steps(cfg)
        if publish:
            if dist is not None and dist.parallelism == "fsdp":
                model = _from_checkpoint(cfg, result.checkpoint)  # the sharded one cannot export
            model_dir, model_uri = publish_model(
                model, cfg.output_dir, stage=stage, step=result.step, data_hash=data.content_hash,
                tokenizer_path=data.tokenizer_path, source_checkpoint=result.checkpoint,
                eos_id=data.eos_id)
            out["outputs"]["model_dir"] = str(model_dir)
            out.update(published(model_dir, model_uri))
        return out


def _paused_result(run_dir: Path, result: Any, run: Any, cfg: TrainConfig) -> dict[str, Any]:
    """The result of a job that paused on request: its step and checkpoint, no model (it has
    not finished), and how to resume (a fork of its checkpoints at that step)."""
    import mlflow

    mlflow.set_tags({"paused_at_step": str(result.paused_at)})
    report = _report(run_dir, result)
    checkpoints = str(Path(cfg.output_dir) / "checkpoints")
    out: dict[str, Any] = {
        "paused": True, "paused_at_step": result.paused_at, "max_steps": cfg.max_steps,
        "pause_request": result.pause_request,
        "metrics": {"step": result.step, "paused_at_step": result.paused_at,
                    "train_loss": result.train_loss, "tokens_per_s": result.tokens_per_s,
                    "goodput": report["goodput"], "rollbacks": result.rollbacks},
        "outputs": {"checkpoint": result.checkpoint, "paused_at_step": result.paused_at,
                    "checkpoints": checkpoints,
                    **({"checkpoint_uri": cfg.checkpoint_uri} if cfg.checkpoint_uri else {})},
        "resume": {"fork_from": checkpoints, "fork_step": result.paused_at},
        "resumed_from": result.resumed_from,
        "mlflow_run_id": run.info.run_id,
        "kept_steps": record_kept_steps(cfg),
    }
    if (run_dir / FORK_FILE).exists():
        out["fork"] = read_json(run_dir / FORK_FILE)
    return out


def record_kept_steps(cfg: TrainConfig) -> list[int]:
    """The steps whose checkpoints the retention policy left (the newest keep_checkpoints plus
    every keep_every-th), ascending, tagged on the active MLflow run: the points a fork or a
    rollback can start from, listed on the run page without it reading this disk."""
    import mlflow

    from tasks.train.checkpoint import step_dirs

    kept = sorted(step for step, _ in step_dirs(Path(cfg.output_dir) / "checkpoints"))
    listed = ",".join(map(str, kept))
    while len(listed) > KEPT_TAG_CHARS:   # drop the oldest: the count says how many there are
        listed = listed.split(",", 1)[1]
    mlflow.set_tags({KEPT_TAG: listed, KEPT_COUNT_TAG: str(len(kept))})
    return kept


def _from_checkpoint(cfg: TrainConfig, path: str) -> Any:
    from tasks.model.causal_lm import build_model
    from tasks.train.checkpoint import load_model_weights

    return load_model_weights(path, build_model(cfg.model))


def _log_new_events(run_dir: Path) -> None:
    """Supervisor events (restarts, hangs, exits) reach the MLflow run through the next worker:
    the supervisor itself does not import MLflow (it must start in milliseconds)."""
    import mlflow

    from tasks.common.job_tracking import chart_name

    marker = run_dir / "events_logged"
    done = int(marker.read_text()) if marker.exists() else 0
    events = tm.read_events(run_dir)
    for e in events[done:]:
        if e.get("source") == "supervisor" and e["kind"] in ("restart", "hang", "worker_exit",
                                                                "budget_exhausted"):
            if e["kind"] == "worker_exit" and e.get("code") == 0:
                continue
            mlflow.log_metric(chart_name(f"event.{e['kind']}"), 1.0,
                              step=max(0, int(e.get("step", 0))), timestamp=int(e["t"] * 1000))
    marker.write_text(str(len(events)))


def _report(run_dir: Path, result: Any) -> dict[str, Any]:
    """Goodput and the job's resilience events, on the MLflow run and in the task log."""
    import mlflow

    from tasks.common.job_tracking import log_figure, log_json_artifact
    from tasks.train import goodput

    report = goodput.compute(run_dir, until=result.trained_at)
    write_json(run_dir / "goodput.json", report)
    _log_new_events(run_dir)
    events = tm.read_events(run_dir)
    counts = {name: sum(e["kind"] == kind for e in events)
              for kind, name in (("restart", "restarts"), ("hang", "hangs"),
                                 ("rollback", "rollbacks"), ("peer_failure", "peer_failures"),
                                 ("anomaly", "anomalies"), ("straggler", "stragglers"),
                                 ("sdc_mismatch", "sdc_mismatches"))}
    # one chart section, after the loss curves (see tasks.common.job_tracking.CHART_NAMES)
    metrics = {"resilience/goodput": report["goodput"],
               "resilience/goodput_excluding_hang_wait": report["goodput_excluding_hang_wait"],
               **{f"resilience/badput_{k}_s": v for k, v in report["buckets"].items()
                  if k != "productive"},
               "resilience/productive_s": report["buckets"]["productive"],
               **{f"resilience/{k}": float(v) for k, v in counts.items()},
               "resilience/skipped_batches": float(len(result.skipped_batches))}
    mlflow.log_metrics(metrics, step=result.step)
    log_json_artifact(report, "goodput.json", artifact_path="resilience")
    mlflow.log_artifact(str(run_dir / "events.jsonl"), artifact_path="resilience")
    if (run_dir / "skipped_batches.json").exists():
        mlflow.log_artifact(str(run_dir / "skipped_batches.json"), artifact_path="resilience")
    log_figure(goodput.chart(report), "resilience/goodput.png")
    log.info("goodput %.2f%% over %.1fs (%.2f%% without the hang wait); %s", 100 * report["goodput"],
             report["wall_s"], 100 * report["goodput_excluding_hang_wait"],
             ", ".join(f"{k} {v:.1f}s" for k, v in report["buckets"].items() if v > 0.05))
    for fault in report["faults"]:
        log.info("fault %s: %s", fault["fault"], fault)
    return report


# --------------------------------------------------------------------------------------------
# The job: supervisor, worker, spare


def run_worker(cfg: TrainConfig, env: WorkerEnv) -> dict[str, Any]:
    import faulthandler
    import signal

    # the watchdog's SIGUSR1 prints every thread's Python stack to stderr (the task log), even
    # when the main thread is stuck in C code
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        setup = _setup(cfg, env, warm=env.role == "spare")
    except (ValueError, KeyError, FileNotFoundError) as exc:
        # bad config or data: restarting would fail the same way
        log.error("worker setup failed: %s", exc)
        sys.exit(FATAL_EXIT)
    if env.role == "spare":
        tm.EventLog(env.run_dir or tm.run_dir(cfg.output_dir), rank=env.rank,
                    source="spare").emit("spare_ready")
        env.wait_for_promotion()
    from tasks.train.guard import UnrecoverableAnomaly
    from tasks.train.health import NODE_UNHEALTHY_EXIT, NodeUnhealthy

    try:
        result = _train(cfg, setup, env, stage="pretrain", publish=True, on_eval=None)
    except UnrecoverableAnomaly as exc:
        # the rollback budget is the job's (skipped_batches.json): a restart would fail again
        log.error("training stopped: %s", exc)
        sys.exit(FATAL_EXIT)
    except NodeUnhealthy as exc:
        # a restart here would run on the same hardware: the job stops for the node's replacement
        log.error("training stopped, a node is unhealthy: %s", exc)
        sys.exit(NODE_UNHEALTHY_EXIT)
    result.pop("seconds", None)
    return result


def supervise(cfg: TrainConfig, env: WorkerEnv, config_path: str) -> dict[str, Any] | None:
    """Run this rank's worker (`config_path`: the job's config file, which `cfg` was read from
    and every worker reads again) under the Supervisor, and return rank 0's result."""
    run_dir = tm.run_dir(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    result_path = run_dir / f"worker_result.rank{env.rank}.json"
    result_path.unlink(missing_ok=True)
    if env.rank == 0:
        (run_dir / "mlflow_run_id").unlink(missing_ok=True)  # a new job opens (or gets) its own
        # health strikes name ranks of this job's nodes; a new job may run on other nodes
        (run_dir / "health.json").unlink(missing_ok=True)
        (run_dir / FORK_FILE).unlink(missing_ok=True)
        if cfg.fork_from:   # before any worker starts: a refused fork trains nothing
            from tasks.train.fork import seed

            write_json(run_dir / FORK_FILE, seed(cfg))
    supervisor = Supervisor(
        run_dir=run_dir, rank=env.rank, max_restarts=cfg.max_restarts,
        hang_timeout_s=cfg.hang_timeout_s, phase_timeouts=phase_timeouts(cfg),
        hot_spare=cfg.hot_spare,
        worker_cmd=[sys.executable, "-m", "tasks.pretrain", "--config", os.path.abspath(config_path),
                    "--result", str(result_path)])
    code = supervisor.run()
    if code == PAUSED_EXIT:
        # Only rank 0 exits PAUSED_EXIT (in __main__, after its result is written): under torchrun
        # a rank that exits non-zero gets every other process stopped, rank 0's result unwritten.
        if env.rank != 0:
            return None
        result = read_json(result_path)
        result.setdefault("metrics", {})["restarts"] = supervisor.restarts
        log.info("pretraining paused at step %d on request; its result says so, and it exits "
                 "with %d", result["paused_at_step"], PAUSED_EXIT)
        return result
    if code != 0:
        log.error("pretraining failed with exit code %d after %d restarts; the events above say "
                  "why. The task fails; its retry resumes from the newest valid checkpoint.",
                  code, supervisor.restarts)
        sys.exit(code)
    if env.rank != 0:
        # Rank 0 alone publishes the model and writes the job's result. Nothing here waits for
        # it: on a multi-node job its files are on another node's disk, and a rank waiting for
        # them kept every other node's GPUs idle until torchrun's exit barrier gave up (300 s).
        return None
    result = read_json(result_path)
    result.setdefault("metrics", {})["restarts"] = supervisor.restarts
    return result
