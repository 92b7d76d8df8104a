"""The one training loop behind pretraining, sweep trials, fine-tuning and distillation.

A stage hands it a model, `get_batch(b) -> Batch` (batch number b of its data), a
`loss_fn(model, batch)` and an `evaluate(model) -> {"val_loss": ...}`; the loop owns the optimizer,
the schedule, clipping, logging, evaluation and checkpoints. When output_dir/checkpoints (or its
S3 mirror) holds a valid checkpoint the loop resumes from it — model, optimizer, step, random
state and the data cursor (the next batch number and the batches skipped so far) — which is how
a restarted worker or an Airflow retry continues exactly where the job was.

Pretraining adds, through LoopOptions:
  - several processes (DDP or FSDP, tasks/train/distributed.py); a rank whose peer died rejoins a
    new process group in place instead of being restarted;
  - a guard on every step: a NaN/Inf loss or a loss/grad-norm spike rolls the job back to the last
    good checkpoint (for a spike, skipping the offending batches, PaLM's recipe) instead of
    applying the update;
  - checkpoints written in the background, optionally mirrored to S3;
  - fault injection, events, step timestamps and a heartbeat for the supervisor and goodput.
Without options the loop behaves as it always has: one process, NaN fails fast. Fine-tuning and
distillation take `one_process_options`: the S3 write-through of their checkpoints and the
injected faults, nothing else.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import torch.nn as nn

from tasks.common.io import read_json, write_json
from tasks.configs import OptimConfig
from tasks.train import checkpoint as ckpt
from tasks.train import telemetry as tm
from tasks.train.prepared_data import Batch
from tasks.train.distributed import (DistContext, PeerFailure, is_peer_failure, load_full_state,
                                     load_sharded_state, sharded_state)
from tasks.train.faults import FaultInjector
from tasks.train.guard import DEFAULT_MIN_RATIO, Anomaly, SpikeGuard, UnrecoverableAnomaly
from tasks.train.losses import LossFn
from tasks.train.runtime import autocast, maybe_compile, rng_state, set_rng_state
from tasks.train.checkpoint_s3 import mirror_for
from tasks.train.schedule import lr_at

log = logging.getLogger(__name__)


class LoopConfig(Protocol):
    """The fields every training stage config shares (TrainConfig, FinetuneConfig, DistillConfig)."""

    output_dir: str
    optim: OptimConfig
    max_steps: int
    eval_interval: int
    checkpoint_interval: int
    keep_checkpoints: int
    checkpoint_uri: str  # "" or s3://...: every checkpoint written through there as it commits
    log_interval: int


class LossSpikeError(UnrecoverableAnomaly):
    """A loss spike the job could not roll back (its budget is spent, or the loss kept spiking
    after rollbacks at a lower lr: tasks/train/guard.py)."""


class RestartRequired(RuntimeError):
    """This process cannot go back in place (no checkpoint to return to): a fresh worker must
    start over from the initial weights. The supervisor restarts it."""


@dataclass(kw_only=True)
class LoopOptions:
    """What pretraining adds to the plain loop (see the module docstring)."""

    dist: DistContext | None = None
    async_checkpoint: bool = True
    checkpoint_mirror: Any = None  # an S3Mirror, or None for local checkpoints only
    spike_sigma: float = 0.0  # 0: no spike detection (NaN/Inf is always checked)
    spike_window: int = 100
    spike_min_ratio: float = DEFAULT_MIN_RATIO  # a spike is also this many times the window's median
    spike_skip_batches: int = 1
    max_rollbacks: int = 0  # per job; 0: a NaN or spike fails the job, as the plain loop always did
    guard: SpikeGuard | None = None  # None: built from the spike_* fields (pass one to observe it)
    max_rejoins: int = 0  # peer failures this process survives by joining a new group
    faults: FaultInjector | None = None
    events: tm.EventLog | None = None
    steps: tm.StepLog | None = None
    heartbeat: tm.Heartbeat | None = None
    skipped_file: Path | None = None  # where the skipped batches are kept across restarts
    flops_per_token: float = 0.0  # with peak_flops: MFU is logged
    peak_flops: float = 0.0
    compile: bool = False
    # the global batch: get_batch(b) returns all of this rank's rows of global batch b, trained
    # as `accumulation` micro-batches; global_batch (sequences over all ranks, 0 = not stated)
    # is checked at resume, which may then change the world size (tasks/train/prepared_data.py)
    accumulation: int = 1
    global_batch: int = 0
    # FSDP of a model built on the meta device: its full initial weights (tasks/train/distributed.py)
    init_weights: Callable[[], dict[str, torch.Tensor]] | None = None
    keep_every: int = 0  # also keep every checkpoint of a multiple of this step (retention.py)
    health: Any = None  # a tasks.train.health.JobHealth: burn-in, stragglers, replica checksums
    # a tasks.train.pause.PauseWatch on every rank (rank 0 alone reads the marker): a pause
    # request stops every rank after the same step, with that step's checkpoint committed
    pause: Any = None


@dataclass
class LoopResult:
    step: int
    train_loss: float  # mean over the last log interval
    val: dict[str, float]  # the final evaluation
    tokens_per_s: float  # over the optimizer steps only (not eval or checkpoint time), all ranks
    checkpoint: str  # the final checkpoint directory
    resumed_from: str | None
    history: list[dict[str, float]] = field(default_factory=list)
    skipped_batches: list[int] = field(default_factory=list)
    rollbacks: int = 0  # the job's, across worker restarts (skipped_batches.json)
    rejoins: int = 0
    trained_at: float = 0.0  # wall time when the final checkpoint was committed (the end of training)
    paused_at: int | None = None  # the step the job paused after, on request (its checkpoint)
    pause_request: dict[str, Any] | None = None  # the marker's content (tasks/train/pause.py)


def one_process_options(cfg: LoopConfig) -> LoopOptions:
    """The options of a stage that trains in one process (fine-tuning, distillation): its
    checkpoints written through to cfg.checkpoint_uri as pretraining's are, so a new attempt on
    a fresh node resumes from there, and the faults LLMOPS_FAULTS asks for (tasks/train/faults.py;
    with no event log here, a fault fires again in a process that inherits the variable)."""
    faults = FaultInjector.from_env(0, None)
    return LoopOptions(checkpoint_mirror=mirror_for(cfg.checkpoint_uri),
                       faults=faults if faults else None)


def build_optimizer(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (not biases, LayerNorm gains or anything 1-D).
    Only parameters with requires_grad are optimized, so frozen layers (adapters later) cost
    no optimizer state."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel for the whole update instead of several per parameter (CUDA only)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                             fused=device.type == "cuda")


def train(*, model: nn.Module, cfg: LoopConfig, get_batch: Callable[[int], Batch], loss_fn: LossFn,
          evaluate: Callable[[nn.Module], dict[str, float]], device: torch.device,
          resolved_config: dict[str, Any], tracking: bool = True,
          on_eval: Callable[[int, dict[str, float]], None] | None = None,
          options: LoopOptions | None = None) -> LoopResult:
    """Train model from the latest valid checkpoint in cfg.output_dir/checkpoints (or from its
    current weights) up to cfg.max_steps. With tracking, metrics go to the active MLflow run.
    on_eval(step, metrics) is called after every evaluation (an exception it raises, such as a
    pruned trial, stops training after the checkpoint in flight is committed)."""
    return _Trainer(model=model, cfg=cfg, get_batch=get_batch, loss_fn=loss_fn, evaluate=evaluate,
                    device=device, resolved_config=resolved_config, tracking=tracking,
                    on_eval=on_eval, options=options or LoopOptions()).run()


class _Trainer:
    def __init__(self, *, model: nn.Module, cfg: LoopConfig, get_batch: Callable[[int], Batch],
                 loss_fn: LossFn, evaluate: Callable[[nn.Module], dict[str, float]],
                 device: torch.device, resolved_config: dict[str, Any], tracking: bool,
                 on_eval: Callable[[int, dict[str, float]], None] | None,
                 options: LoopOptions) -> None:
        self.model, self.cfg, self.get_batch, self.loss_fn = model, cfg, get_batch, loss_fn
        self.evaluate, self.device, self.on_eval, self.opts = evaluate, device, on_eval, options
        self.dist = options.dist
        self.rank = self.dist.rank if self.dist else 0
        self.world = self.dist.world_size if self.dist else 1
        self.fsdp = self.dist is not None and self.dist.parallelism == "fsdp"
        if not self.fsdp and any(hasattr(p, "full_tensor") for p in model.parameters()):
            # its state is DTensors: a .pt snapshot cannot copy them and no rank has them whole
            raise ValueError(
                "the model's parameters are DTensors (sharded with fully_shard before train()); "
                "pass the unsharded model with LoopOptions(dist=DistContext(parallelism='fsdp', "
                "...)): the loop shards it and saves every rank's shards through "
                "torch.distributed.checkpoint.")
        self.tracking = tracking and self.rank == 0
        self.events, self.steps, self.hb = options.events, options.steps, options.heartbeat
        self.faults = options.faults
        self.ckpt_root = Path(cfg.output_dir) / "checkpoints"
        self.checkpointer = ckpt.Checkpointer(
            self.ckpt_root, keep=cfg.keep_checkpoints, config=resolved_config,
            keep_every=options.keep_every, asynchronous=options.async_checkpoint, mirror=options.checkpoint_mirror,
            on_commit=self.faults.after_checkpoint if self.faults else None,
            before_write=self.faults.before_checkpoint_write if self.faults else None,
            # bytes of a checkpoint moving are progress for the watchdog (tasks/train/telemetry.py)
            on_progress=self.hb.io_progress if self.hb else None)
        self.guard = options.guard or SpikeGuard(
            sigma=options.spike_sigma, window=options.spike_window,
            min_ratio=options.spike_min_ratio, warmup_steps=cfg.optim.warmup_steps,
            max_rollbacks=options.max_rollbacks)
        self.fwd: nn.Module = model  # what the forward pass runs: DDP-wrapped and/or compiled
        self.ddp: Any = None  # the DDP wrapper (its no_sync skips the all-reduce of a micro-step)
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.Tensor] = []
        # training state that checkpoints carry
        self.step, self.cursor = 0, 0
        self.skipped: set[int] = self._read_skipped()  # and the guard's job state (rollbacks)
        self.recent: deque[tuple[int, int]] = deque(maxlen=max(1, options.spike_skip_batches))
        self.train_loss = math.nan
        # this process's bookkeeping
        self.resumed_from: str | None = None
        self.rejoins = 0
        self.nan_batches: set[int] = set()  # batches that gave a NaN once: skipped if they do again
        self.history: list[dict[str, float]] = []
        self.val: dict[str, float] = {}
        self.total_tokens, self.total_time = 0, 0.0
        self.first_resume = True
        self.trained_at = 0.0
        self.compiling = False  # the next step runs a model torch.compile has not compiled yet
        self.progress = tm.Progress(cfg.max_steps)  # restarted with each _train
        self._reader: ThreadPoolExecutor | None = None  # reads the next batch (_prefetch)
        self._pending: tuple[int, Future] | None = None
        self.health = options.health
        self.pause = options.pause
        self.paused_at: int | None = None
        self.pause_request: dict[str, Any] | None = None
        self._t_sync = 0.0  # when this rank's step first waits on the others (_forward_backward)
        if self.health is not None:
            self.health.attach(emit=self._event, log_metrics=self._log_metrics)

    # -- the outer loop: (re)join, resume, train -------------------------------------------
    def run(self) -> LoopResult:
        try:
            while True:
                try:
                    self._connect()
                    self._resume(reason="start" if self.first_resume else "rejoin")
                    self.first_resume = False
                    self._train()
                    break
                except Exception as exc:
                    if (self.dist is None or self.fsdp or isinstance(exc, RestartRequired)
                            or not is_peer_failure(exc)):
                        raise  # FSDP shards cannot be re-formed in place: the worker restarts
                    self.rejoins += 1
                    self._event("peer_failure", step=self.step, error=str(exc)[:300])
                    self.dist.leave(failed=True)
                    if self.rejoins > self.opts.max_rejoins:
                        raise PeerFailure(f"a peer failed and this rank has used its "
                                          f"{self.opts.max_rejoins} rejoins: {exc}") from exc
            self._finish()
        finally:
            if self.pause is not None:
                self.pause.stop()
            self._drop_pending()
            if self._reader is not None:
                self._reader.shutdown(wait=True)
                self._reader = None
            if self.hb is not None:  # a save still in flight gets the upload budget, not a kill
                self.hb.beat(phase=tm.UPLOAD)
            try:
                self.checkpointer.wait()
            except Exception:  # noqa: BLE001 - do not mask the exception that got us here
                log.exception("the last checkpoint save failed")
            if self.hb is not None:
                self.hb.beat(phase=tm.FINISHING)
            if self.dist is not None:
                # leaving on an error ends the round: peers blocked on this rank hear of it
                # through the store at once (tasks/train/distributed.py)
                self.dist.leave(failed=sys.exc_info()[0] is not None)
        if self.tracking:
            _log_loss_curve(self.history)
        final = self.checkpointer.last or (Path(self.resumed_from) if self.resumed_from else None)
        end = self.paused_at if self.paused_at is not None else max(self.step, self.cfg.max_steps)
        if self.rank != 0:  # rank 0 wrote it; report the same path
            final = self.ckpt_root / f"step_{end:06d}"
        assert final is not None  # the last step always saves, or we resumed from one
        return LoopResult(step=end, train_loss=self.train_loss,
                          val=self.val, tokens_per_s=self.total_tokens / self.total_time
                          if self.total_time else 0.0, checkpoint=str(final),
                          resumed_from=self.resumed_from, history=self.history,
                          skipped_batches=sorted(self.skipped), rollbacks=self.guard.rollbacks,
                          rejoins=self.rejoins, trained_at=self.trained_at or time.time(),
                          paused_at=self.paused_at, pause_request=self.pause_request)

    def _connect(self) -> None:
        """Join a process group (several processes), wrap the model, build the optimizer."""
        if self.dist is not None:
            if self.hb is not None:
                self.hb.beat(phase=tm.RENDEZVOUS)  # the watchdog leaves rendezvous to its timeout
            t0 = time.time()
            r = self.dist.join()
            self._event("joined", round=r, seconds=round(time.time() - t0, 3))
            if self.fsdp:
                if self.optimizer is None:  # sharding happens once, before the optimizer exists
                    self.fwd = self.dist.wrap(self.model, self.opts.init_weights)
                    self.checkpointer.shard_with(self.dist.checkpoint_group(), self.rank)
            else:
                self.fwd = self.ddp = self.dist.wrap(self.model)
        if self.health is not None:  # burn-in (first group only) and every rank's host
            self.health.connect(rank=self.rank, world=self.world, device=self.device,
                                share=self.dist.share if self.dist else None,
                                replicas=not self.fsdp,
                                first_round=self.dist is None or self.dist.round == 0)
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model, self.cfg.optim, self.device)
            self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        compiled = maybe_compile(self.fwd, self.device, self.opts.compile)
        # torch.compile compiles in the first forward pass: that step has a budget of its own
        self.compiling = compiled is not self.fwd
        self.fwd = compiled

    # -- checkpoints -----------------------------------------------------------------------
    def _read_skipped(self) -> set[int]:
        f = self.opts.skipped_file
        if f is None or not f.exists():
            return set()
        saved = read_json(f)
        self.guard.load_job_state(saved.get("guard", {}))
        return set(saved["batches"])

    def _write_skipped(self, records: list[dict[str, Any]]) -> None:
        f = self.opts.skipped_file
        if f is None or self.rank != 0:
            return
        old = read_json(f) if f.exists() else {"batches": [], "records": []}
        write_json(f, {"batches": sorted(self.skipped), "guard": self.guard.job_state(),
                       "records": old.get("records", []) + records})

    def _state(self) -> dict[str, Any] | None:
        """The checkpoint: FSDP, every rank's shards; else on rank 0 the whole state, elsewhere
        None (after the collectives)."""
        assert self.optimizer is not None
        trainer: dict[str, Any] = {
            "step": self.step, "data_cursor": self.cursor, "skipped_batches": sorted(self.skipped),
            "recent_batches": [list(x) for x in self.recent], "train_loss": self.train_loss,
            "rng": rng_state(), "guard": self.guard.state_dict(), "world_size": self.world,
            "global_batch": self.opts.global_batch,
            "samples_seen": self.step * self.opts.global_batch}
        seen = getattr(self.get_batch, "seen", None)
        if seen is not None:  # the data consumed so far (tasks/train/seen.py)
            trainer["data_seen"] = seen(self.cursor, self.skipped)
        if self.dist is not None:
            trainer["rng_ranks"] = self.dist.gather(trainer["rng"])  # dropout differs per rank
        if self.fsdp:  # every rank saves its own shards: nothing is gathered
            return {**sharded_state(self.model, self.optimizer), "trainer": trainer}
        model_state, optim_state = self.model.state_dict(), self.optimizer.state_dict()
        if self.rank != 0:
            return None
        return {"model": model_state, "optimizer": optim_state, "trainer": trainer}

    def _save(self) -> None:
        if self.hb is not None:
            self.hb.beat(phase=tm.SAVE)
        t0 = time.time()
        state = self._state()
        if state is not None:
            # copied beside the next step's forward and backward: before anything changes the
            # weights, the loop waits for it (wait_for_snapshot)
            self.checkpointer.save(self.step, state, copy_in_background=True)
        t1 = time.time()
        self._event("save", step=self.step, t0=t0, t1=t1, blocked_s=round(t1 - t0, 4), echo=False)
        log.info("step %d/%d | checkpoint (%.3fs blocked)", self.step, self.cfg.max_steps, t1 - t0)

    def _resume(self, *, reason: str, max_step: int | None = None) -> None:
        """Load the checkpoint rank 0 picks (newest valid, not trained on a skipped batch); with
        none, start from the model as it was built (only possible at the start)."""
        if self.hb is not None:
            self.hb.beat(phase=tm.RESTORE)
        t0 = time.time()
        self.checkpointer.wait_for_snapshot()  # loading overwrites the weights a save may be copying
        # gradients of the step a failure interrupted would be added to the next step's
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

        def choose() -> dict[str, Any]:
            path = self.checkpointer.find_resume(skipped=self.skipped, max_step=max_step)
            return {"path": str(path) if path else None, "skipped": sorted(self.skipped)}

        choice = self.dist.share("resume", choose) if self.dist else choose()
        self.skipped = set(choice["skipped"])
        if choice["path"] is None:
            if not self.first_resume:
                # the weights have moved since they were built and nothing saved precedes them
                raise RestartRequired(
                    f"going back from step {self.step} ({reason}) found no usable checkpoint; a "
                    f"fresh worker must start over from step 0 (skipping {len(self.skipped)} "
                    "bad batches)")
            self.step, self.cursor = 0, 0
            path = None
        else:
            path = self.checkpointer.ensure_local(choice["path"])
            if self.faults:
                self.faults.before_restore(int(path.name.rsplit("_", 1)[-1]))
            self._load(path)
            self.resumed_from = str(path)
        t1 = time.time()
        if self.hb is not None:
            self.hb.beat(self.step, tm.READY)
        self._event("resume", step=self.step, reason=reason, path=str(path) if path else None,
                    t0=t0, t1=t1)
        if path is not None:
            log.info("resuming from %s at step %d of %d", path, self.step, self.cfg.max_steps)

    def _load(self, path: Path) -> None:
        assert self.optimizer is not None
        if self.fsdp and ckpt.is_sharded(path):
            # this rank's shards only, resharded by DCP when another world size wrote them, and
            # fetched from the mirror as DCP plans to read them (a fresh node has none of them)
            load_sharded_state(self.model, self.optimizer, path,
                               fetch=lambda names: self.checkpointer.fetch_files(path, names))
            trainer = ckpt.read_part(path, "trainer")
        else:
            self.checkpointer.fetch_files(path)   # a copy fetched for shard reads: all of it
            # onto the CPU first: RNG states must stay CPU tensors, and load_state_dict copies the
            # weights and optimizer moments onto the parameters' device anyway
            state = ckpt.load_checkpoint(path, map_location="cpu")
            if self.fsdp or ckpt.is_sharded(path):  # whole weights to shard, or shards read whole
                load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            trainer = state["trainer"]
        check_resume = getattr(self.get_batch, "check_resume", None)
        if check_resume is not None:   # the same sample order, or the cursor means other rows
            check_resume(trainer.get("data_seen"))
        self.step = int(trainer["step"])
        self.cursor = int(trainer.get("data_cursor", self.step))
        self.skipped |= set(trainer.get("skipped_batches", []))
        self.recent.clear()
        self.recent.extend(tuple(x) for x in trainer.get("recent_batches", []))
        self.train_loss = float(trainer["train_loss"])
        self.guard.load_state_dict(trainer.get("guard", {}))
        self._restore_rng(trainer)

    def _restore_rng(self, trainer: dict[str, Any]) -> None:
        """Same world size: every rank's generators as saved (a resume is bitwise). Another world
        size, allowed when the global batch is the same (the cursor then means the same samples):
        ranks have no saved generators of their own, so each is re-seeded from the saved state
        of rank 0 and its rank, deterministically; only dropout draws differ from a run that
        was never resized."""
        saved_world = int(trainer.get("world_size", 1))
        saved_batch = int(trainer.get("global_batch", 0))
        if saved_world != self.world or (saved_batch and self.opts.global_batch
                                         and saved_batch != self.opts.global_batch):
            if not (saved_batch and saved_batch == self.opts.global_batch):
                raise ValueError(
                    f"the checkpoint was written by {saved_world} processes with global batches "
                    f"of {saved_batch or 'unrecorded'} sequences; this job has {self.world} "
                    f"processes and {self.opts.global_batch or 'unstated'}: its data cursor "
                    "counts global batches of the old size. Set global_batch_tokens to the old "
                    "global batch x seq_len (or resume with the old world size).")
            set_rng_state(trainer["rng"])
            _reseed(trainer["rng"], self.rank)
            log.info("resuming on %d processes from a checkpoint of %d: same samples, generators "
                     "re-seeded per rank", self.world, saved_world)
            return
        ranks = trainer.get("rng_ranks")
        set_rng_state(ranks[self.rank] if ranks else trainer["rng"])

    # -- the step loop -----------------------------------------------------------------------
    def _train(self) -> None:
        cfg, opts, device = self.cfg, self.opts, self.device
        assert self.optimizer is not None
        # The loss is summed on the host: the guard already reads it every step (stats.tolist(),
        # the one host sync per step), so a device-side sum would only add kernel launches.
        # Throughput is wall time per log interval (synchronized once, at the log), minus
        # the time spent evaluating and checkpointing, so it measures training alone. The first
        # step of every (re)start is not timed: it compiles the model (torch.compile on GPU, up to
        # minutes) and warms the allocator and caches, which says nothing about the steady rate.
        interval_loss = 0.0
        interval_steps, interval_tokens = 0, 0
        interval_start, paused = time.perf_counter(), 0.0
        warmed_up = False
        grad_norm = torch.zeros(())
        lr = 0.0
        self.progress = tm.Progress(cfg.max_steps, self.step)
        self.model.train()
        if self.pause is not None and self.rank == 0:
            self.pause.start()  # a marker already there is seen before the first step
        while self.step < cfg.max_steps:
            step = self.step
            done = step + 1  # optimizer steps completed; checkpoints and metrics are indexed by it
            if self.hb is not None:
                self.hb.beat(step, tm.COMPILE if self.compiling else tm.STEP)
            t0, t_own = time.time(), time.perf_counter()
            batch_index = self._next_batch_index()
            batch = self._batch(batch_index).to(device)
            t_data = time.time()
            self._prefetch(self._index_after(batch_index))
            # the generators as this step starts: a spike skipped in place (_on_anomaly) puts them
            # back, so the step redone on the next batch draws the dropout masks it would have
            rng_before = _step_rng() if self.opts.spike_sigma > 0 else None
            lr = lr_at(step, cfg.optim, cfg.max_steps) * self.guard.lr_scale(step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.faults:
                self.faults.before_compute(done)
            if self.hb is not None and self.dist is not None and not self.compiling:
                self.hb.phase(tm.SYNC)  # from here on this rank may be waiting for its peers
            loss = self._forward_backward(batch, done)
            # clip_grad_norm_ also returns the norm before clipping: with grad_clip 0 we still want it
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
                grad_norm = grad_norm.full_tensor()
            # The guard reads both numbers every step (the one host sync per step). With several
            # ranks the loss is averaged so that every rank takes the same decision.
            parts = [loss.detach().float(), grad_norm.detach().float()]
            if self.pause is not None:  # rank 0's answer, agreed by every rank in the same reduce
                wanted = self.rank == 0 and self.pause.wanted(done)
                parts.append(torch.tensor(1.0 if wanted else 0.0, device=parts[0].device))
            stats = torch.stack(parts)
            if self.dist is not None:
                self.dist.all_reduce_mean(stats)
            loss_value, norm_value, *pause_flag = stats.tolist()
            anomaly = self.guard.check(done, loss_value, norm_value)
            if anomaly is not None:
                self.optimizer.zero_grad(set_to_none=True)
                self._on_anomaly(anomaly, batch_index, t0, rng_before)
                interval_loss = 0.0
                interval_steps, interval_tokens = 0, 0
                interval_start, paused = time.perf_counter(), 0.0
                continue
            self.checkpointer.wait_for_snapshot()  # a save's copy of the weights is complete
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.add(done, loss_value, norm_value)
            self.step, self.cursor = done, batch_index + 1
            self.compiling = False
            self.recent.append((done, batch_index))
            if self.faults:
                self.faults.after_update(done, self.params)
            if self.health is not None:
                self.health.step_time(self._t_sync - t_own)
                to_step = self.health.after_step(
                    done, self.params,
                    checkpoint=done % cfg.checkpoint_interval == 0 or done == cfg.max_steps)
                if to_step is not None:  # the replicas disagree: back to where they agreed
                    self._resume(reason="sdc", max_step=to_step)
                    self.guard.forget_after(self.step)
                    self.health.rolled_back(self.step)
                    self._event("rollback", from_step=done, to_step=self.step, anomaly="sdc",
                                path=self.resumed_from)
                    interval_loss = 0.0
                    interval_steps, interval_tokens = 0, 0
                    interval_start, paused = time.perf_counter(), 0.0
                    continue
            if self.steps is not None:
                self.steps.record(done, batch_index, t0, t_data, time.time())
            interval_loss += loss_value  # the global batch's (averaged over ranks)
            interval_steps += 1
            if warmed_up:
                interval_tokens += batch.tokens * self.world
            else:  # the untimed first step: the clock starts when it has finished
                warmed_up = True
                if device.type == "cuda":
                    torch.cuda.synchronize()
                interval_start, paused = time.perf_counter(), 0.0

            # step 1 too: the first loss (about ln(vocab) from scratch) is the quickest sanity check
            if done % cfg.log_interval == 0 or done in (1, cfg.max_steps):
                if device.type == "cuda":
                    torch.cuda.synchronize()  # honest timing: wait for the queued kernels
                elapsed = max(time.perf_counter() - interval_start - paused, 1e-9)
                self.train_loss = interval_loss / interval_steps
                metrics = {"loss": self.train_loss, "lr": lr, "grad_norm": float(grad_norm)}
                if interval_tokens:  # not at a first step, which is untimed
                    self.total_tokens += interval_tokens
                    self.total_time += elapsed
                    metrics["tokens_per_s"] = interval_tokens / elapsed
                    if opts.flops_per_token and opts.peak_flops:
                        per_device = metrics["tokens_per_s"] / self.world
                        metrics["mfu"] = per_device * opts.flops_per_token / opts.peak_flops
                self._log_metrics(metrics, done)
                self.history.append({"step": done, **metrics})
                # "step N/M | loss X" and "| T tok/s" are parsed by SageMaker's metric regexes
                # (llmops.jobs.backends.sagemaker.sagemaker_requests.METRICS): keep them as they
                # are. MFU only with a known peak (tasks.train.runtime.peak_flops).
                log.info("step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f%s%s | %s",
                         done, cfg.max_steps, self.train_loss, lr, metrics["grad_norm"],
                         f" | {metrics['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in metrics
                         else "", f" | mfu {metrics['mfu']:.2%}" if "mfu" in metrics else "",
                         self.progress.line(done))
                interval_loss = 0.0
                interval_steps, interval_tokens = 0, 0
                interval_start, paused = time.perf_counter(), 0.0

            if done % cfg.eval_interval == 0 or done == cfg.max_steps:
                t_eval = time.perf_counter()
                self._evaluate(done)
                paused += time.perf_counter() - t_eval

            if done % cfg.checkpoint_interval == 0 or done == cfg.max_steps:
                t_save = time.perf_counter()
                self._save()
                paused += time.perf_counter() - t_save

            if pause_flag and pause_flag[0] > 0 and self.step == done < cfg.max_steps:
                self._pause(done, saved=done % cfg.checkpoint_interval == 0)
                return

    def _pause(self, done: int, *, saved: bool) -> None:
        """Every rank, after the same step (the reduce above): checkpoint this step where it was
        not just saved, at the point of the loop a periodic save is taken (a resume from it is
        exact), and wait for it to be committed (written and, with a mirror, uploaded)."""
        if not saved:
            self._save()
        if self.hb is not None:  # the step the supervisor's "paused" event names
            self.hb.beat(done, tm.UPLOAD)
        self.checkpointer.wait()
        self.paused_at = done
        if self.rank == 0 and self.pause is not None:
            self.pause_request = self.pause.consume()
        self._event("paused", step=done, request=self.pause_request)
        log.info("paused at step %d of %d: checkpoint %s committed; resume with fork_from %s, "
                 "fork_step %d", done, self.cfg.max_steps, self.ckpt_root / f"step_{done:06d}",
                 self.ckpt_root, done)

    def _forward_backward(self, batch: Batch, done: int) -> torch.Tensor:
        """This rank's loss on its share of the global batch (the mean over its micro-batches),
        with the gradients of all of them accumulated; they are averaged across ranks once, in
        the last micro-batch's backward (DDP no_sync and FSDP's gradient sync off before it)."""
        micro = batch.split(self.opts.accumulation)
        losses = []
        for i, part in enumerate(micro):
            last = i == len(micro) - 1
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
            sync = self.ddp.no_sync() if self.ddp is not None and not last else nullcontext()
            with sync:
                with autocast(self.device):
                    loss = self.loss_fn(self.fwd, part)
                if self.faults:
                    loss = self.faults.scale_loss(done, loss)
                if last and self.health is not None:  # the straggler clock (tasks/train/health.py)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()  # the forward's kernels, not their launch
                    self._t_sync = time.perf_counter()
                (loss / len(micro) if len(micro) > 1 else loss).backward()
            losses.append(loss.detach())
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    def _next_batch_index(self) -> int:
        while self.cursor in self.skipped:
            self.cursor += 1
        return self.cursor

    def _index_after(self, batch_index: int) -> int:
        index = batch_index + 1
        while index in self.skipped:
            index += 1
        return index

    # Batch b is a pure function of b (tasks/train/prepared_data.py), so the next one is read on a
    # thread while this step computes (torch releases the GIL in its kernels): the step no longer
    # waits for the gather from the memory-mapped shards, the tokenization of SFT examples or the
    # teacher cache. At most one read is in flight; a batch sources are never read concurrently.
    def _prefetch(self, batch_index: int) -> None:
        if self._pending is not None and self._pending[0] == batch_index:
            return
        self._drop_pending()
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._pending = (batch_index, self._reader.submit(self.get_batch, batch_index))

    def _batch(self, batch_index: int) -> Batch:
        if self._pending is not None and self._pending[0] == batch_index:
            future, self._pending = self._pending[1], None
            return future.result()
        self._drop_pending()  # a rollback or a skip changed what comes next
        return self.get_batch(batch_index)

    def _drop_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending[1], None
            try:
                pending.result()  # never two reads at once: batch sources are not thread-safe
            except Exception:  # noqa: BLE001 - a batch nobody will use; the next read raises anew
                pass

    def _evaluate(self, done: int) -> None:
        if self.hb is not None:
            self.hb.beat(done, tm.EVAL)
        t0 = time.time()
        self.val = self.evaluate(self.model)
        t1 = time.time()
        if self.hb is not None:
            self.hb.beat(done, tm.STEP)
        self._log_metrics(self.val, done)
        self.history.append({"step": done, **self.val})
        self._event("eval", step=done, t0=t0, t1=t1, echo=False)
        log.info("step %d/%d | %s | %s", done, self.cfg.max_steps,
                 " | ".join(f"{k} {v:.4f}" for k, v in self.val.items()),
                 self.progress.line(done))
        if self.on_eval is not None:
            self.on_eval(done, dict(self.val))

    def _on_anomaly(self, anomaly: Anomaly, batch_index: int, t0: float,
                    rng_before: tuple[torch.Tensor, Any] | None = None) -> None:
        """Do not apply the update; roll back. For a spike, the batches of the last
        spike_skip_batches steps are skipped from now on; a NaN is first replayed (a transient
        fault, such as a flipped bit, does not recur) and its batch is skipped only if it fails
        again. The guard counts the rollback against the job's budget and lowers the lr when
        skipping did not help (tasks/train/guard.py); when it gives up, the job fails with
        UnrecoverableAnomaly.

        Where the rollback goes: a spike whose batch is the only one to skip never touched the
        weights (the guard runs before the optimizer step), so it is rolled back in place: the
        step's random state is put back and the step is redone on the next batch, with no
        checkpoint read and no steps recomputed (bitwise the run that skipped the batch up
        front). Otherwise (earlier batches to skip, a NaN, an lr reduction that retrains from
        the checkpoint) the job goes back to the newest checkpoint that never saw a bad batch."""
        opts = self.opts
        self._event("anomaly", step=anomaly.step, anomaly=anomaly.kind, value=anomaly.value,
                    threshold=anomaly.threshold, batch=batch_index, t0=t0)
        if anomaly.kind == "nan" and batch_index not in self.nan_batches:
            self.nan_batches.add(batch_index)
            bad: list[int] = []
        else:
            window = [b for s, b in self.recent if s > anomaly.step - opts.spike_skip_batches]
            bad = sorted({*window, batch_index})
        self.skipped |= set(bad)
        problem = self.guard.rollback(anomaly, skipped=bool(bad))
        # the job file, not the checkpoint, keeps the count: the rollback below goes back to a
        # checkpoint older than this anomaly, and a restarted worker must continue the count
        self._write_skipped([{"step": anomaly.step, "batches": bad, "reason": anomaly.kind,
                              "value": anomaly.value, "t": time.time()}] if bad else [])
        if bad:
            self._event("skip", step=anomaly.step, batches=bad, reason=anomaly.kind)
        if problem is not None:
            error = UnrecoverableAnomaly if anomaly.kind == "nan" else LossSpikeError
            raise error(problem)
        if self.guard.escalation:  # skipping did not help: this rollback retrains at a lower lr
            self._event("lr_reduced", step=anomaly.step, lr_scale=self.guard.lr_scale_value,
                        until_step=self.guard.lr_scale_until)
        from_step = self.step
        if (anomaly.kind != "nan" and bad == [batch_index] and not self.guard.escalation
                and rng_before is not None):
            _set_step_rng(rng_before)
            self._event("rollback", from_step=from_step, to_step=self.step, anomaly=anomaly.kind,
                        path=None, in_place=True)
            return
        self._resume(reason=anomaly.kind, max_step=anomaly.step - 1)
        self.guard.forget_after(self.step)
        self._event("rollback", from_step=from_step, to_step=self.step, anomaly=anomaly.kind,
                    path=self.resumed_from)

    def _finish(self) -> None:
        if self.step >= self.cfg.max_steps and not self.val:
            # a retry of a job that had already finished training: report, do not train further
            log.info("checkpoint %s is already at step %d >= max_steps %d; nothing to train",
                     self.resumed_from, self.step, self.cfg.max_steps)
            self.val = self.evaluate(self.model)
        t0 = time.time()
        if self.hb is not None:  # the upload budget, with the writer's bytes as progress
            self.hb.beat(phase=tm.UPLOAD)
        self.checkpointer.wait()  # the final checkpoint must be committed before we report it
        self.trained_at = time.time()
        self._event("save", step=self.step, t0=t0, t1=self.trained_at,
                    blocked_s=round(self.trained_at - t0, 4), echo=False)
        if self.tracking:
            import mlflow

            mlflow.flush_async_logging()

    # -- reporting ---------------------------------------------------------------------------
    def _event(self, kind: str, *, echo: bool = True, **fields: Any) -> None:
        if self.events is None:
            return
        if echo:
            self.events.emit(kind, **fields)
        else:
            old, self.events.echo = self.events.echo, False
            try:
                self.events.emit(kind, **fields)
            finally:
                self.events.echo = old
        if self.tracking and kind in ("anomaly", "rollback", "skip", "peer_failure"):
            self._log_metrics({f"event.{kind}": 1.0}, int(fields.get("step", self.step)))

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log under the chart names (loss/train, loss/val, optim/lr...:
        tasks.common.job_tracking)."""
        if self.tracking:
            import mlflow

            from tasks.common.job_tracking import chart_metrics

            # asynchronous: a metric write to the tracking store is a network or database round
            # trip that should not stall the training thread
            mlflow.log_metrics(chart_metrics(metrics), step=step, synchronous=False)


def _reseed(saved_rng: dict[str, Any], rank: int) -> None:
    """Seed every generator from a saved state and a rank: the same numbers on every rerun."""
    digest = hashlib.sha256(saved_rng["torch"].numpy().tobytes() + rank.to_bytes(4, "little"))
    seed = int.from_bytes(digest.digest()[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _step_rng() -> tuple[torch.Tensor, Any]:
    """The generators a training step draws from (dropout: torch's, per device), cheaply: python's
    and numpy's are not used inside a step (batches come from their own seeded generators)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _set_step_rng(state: tuple[torch.Tensor, Any]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _log_loss_curve(history: list[dict[str, float]]) -> None:
    """Plot loss and val_loss on one chart from the run's metric history, which also holds the
    steps of earlier attempts when a retry resumed into the same run; fall back to this
    attempt's."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker
    import matplotlib.pyplot as plt
    import mlflow

    from tasks.common.job_tracking import chart_name, log_figure

    client = mlflow.MlflowClient()
    run_id = mlflow.active_run().info.run_id
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for key in ("loss", "val_loss"):
        points = sorted((m.step, m.value)
                        for m in client.get_metric_history(run_id, chart_name(key)))
        if not points:
            points = [(int(h["step"]), h[key]) for h in history if key in h]
        if points:
            curves[key] = ([s for s, _ in points], [v for _, v in points])
    if not curves:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o" if key == "val_loss" else None, markersize=3,
                label={"loss": "train", "val_loss": "validation"}[key])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    log_figure(fig, "loss_curve.png")
