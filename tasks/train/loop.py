"""The one training loop behind pretraining, sweep trials, fine-tuning and distillation.

A stage hands it a model, `get_batch(step) -> Batch`, a `loss_fn(model, batch)` and an
`evaluate(model) -> {"val_loss": ...}`; the loop owns the optimizer, the schedule, clipping,
logging, evaluation and checkpoints. When output_dir/checkpoints holds a valid checkpoint the loop
resumes from it (model, optimizer, step, random state), which is how an Airflow retry continues
instead of starting over; batches are a function of the step, so the data resumes exactly too.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from tasks.configs import OptimConfig
from tasks.train import checkpoint as ckpt
from tasks.train.data import Batch
from tasks.train.losses import LossFn
from tasks.train.runtime import autocast, rng_state, set_rng_state
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
    log_interval: int


@dataclass
class LoopResult:
    step: int
    train_loss: float  # mean over the last log interval
    val: dict[str, float]  # the final evaluation
    tokens_per_s: float  # over the optimizer steps only (not eval or checkpoint time)
    checkpoint: str  # the final checkpoint directory
    resumed_from: str | None
    history: list[dict[str, float]] = field(default_factory=list)


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
          resolved_config: dict[str, Any], tracking: bool = True) -> LoopResult:
    """Train model from the latest valid checkpoint in cfg.output_dir/checkpoints (or from its
    current weights) up to cfg.max_steps. With tracking, metrics go to the active MLflow run."""
    ckpt_root = Path(cfg.output_dir) / "checkpoints"
    optimizer = build_optimizer(model, cfg.optim, device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    start_step, last_train_loss, resumed_from = 0, math.nan, None

    found = ckpt.latest_valid_checkpoint(ckpt_root)
    if found is not None:
        # onto the CPU: RNG states must stay CPU tensors, and load_state_dict below copies the
        # weights and optimizer moments onto the parameters' device anyway
        state = ckpt.load_checkpoint(found, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        trainer = state["trainer"]
        set_rng_state(trainer["rng"])
        start_step, last_train_loss = int(trainer["step"]), float(trainer["train_loss"])
        resumed_from = str(found)
        log.info("resuming from %s at step %d of %d", found, start_step, cfg.max_steps)

    def save(step: int, train_loss: float) -> Path:
        trainer_state = {"step": step, "data_cursor": step, "train_loss": train_loss,
                         "rng": rng_state()}
        return ckpt.save_checkpoint(
            ckpt_root, step,
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "trainer": trainer_state},
            resolved_config, keep=cfg.keep_checkpoints)

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        if tracking:
            import mlflow

            mlflow.log_metrics(metrics, step=step)

    history: list[dict[str, float]] = []
    val: dict[str, float] = {}
    last_saved: Path | None = found
    # Running sums as tensors: reading a loss with .item() every step would stall a GPU queue.
    # Throughput is wall time per log interval (synchronized once, at the log), minus the time
    # spent evaluating and checkpointing, so it measures training alone.
    interval_loss = torch.zeros((), device=device)
    interval_steps, interval_tokens = 0, 0
    interval_start, paused = time.perf_counter(), 0.0
    total_tokens, total_time = 0, 0.0

    model.train()
    for step in range(start_step, cfg.max_steps):
        lr = lr_at(step, cfg.optim, cfg.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = get_batch(step).to(device)
        with autocast(device):
            loss = loss_fn(model, batch)
        loss.backward()
        # clip_grad_norm_ also returns the norm before clipping: with grad_clip 0 we still want it
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        interval_loss += loss.detach().float()
        interval_steps += 1
        interval_tokens += batch.tokens
        done = step + 1  # optimizer steps completed; checkpoints and metrics are indexed by it

        # step 1 too: the first loss (about ln(vocab) from scratch) is the quickest sanity check
        if done % cfg.log_interval == 0 or done in (1, cfg.max_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()  # honest timing: wait for the queued kernels
            elapsed = max(time.perf_counter() - interval_start - paused, 1e-9)
            total_tokens, total_time = total_tokens + interval_tokens, total_time + elapsed
            last_train_loss = float(interval_loss) / interval_steps
            if not math.isfinite(last_train_loss):
                # fail fast: continuing would only overwrite good checkpoints with NaN weights
                raise FloatingPointError(f"loss is {last_train_loss} at step {done}; lower "
                                         "optim.lr or raise optim.warmup_steps.")
            metrics = {"loss": last_train_loss, "lr": lr, "grad_norm": float(grad_norm),
                       "tokens_per_s": interval_tokens / elapsed}
            log_metrics(metrics, done)
            history.append({"step": done, **metrics})
            log.info("step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s",
                     done, cfg.max_steps, last_train_loss, lr, metrics["grad_norm"],
                     metrics["tokens_per_s"])
            interval_loss.zero_()
            interval_steps, interval_tokens = 0, 0
            interval_start, paused = time.perf_counter(), 0.0

        if done % cfg.eval_interval == 0 or done == cfg.max_steps:
            t_eval = time.perf_counter()
            val = evaluate(model)
            log_metrics(val, done)
            history.append({"step": done, **val})
            log.info("step %d/%d | %s", done, cfg.max_steps,
                     " | ".join(f"{k} {v:.4f}" for k, v in val.items()))
            paused += time.perf_counter() - t_eval

        if done % cfg.checkpoint_interval == 0 or done == cfg.max_steps:
            t_save = time.perf_counter()
            last_saved = save(done, last_train_loss)
            log.info("step %d/%d | checkpoint %s (%.2fs)", done, cfg.max_steps, last_saved,
                     time.perf_counter() - t_save)
            paused += time.perf_counter() - t_save

    if start_step >= cfg.max_steps:
        # a retry of a job that had already finished training: report, do not train further
        log.info("checkpoint %s is already at step %d >= max_steps %d; nothing to train",
                 found, start_step, cfg.max_steps)
        val = evaluate(model)
    assert last_saved is not None  # the last step always saves, or we resumed from one

    if tracking:
        _log_loss_curve(history)
    return LoopResult(step=max(start_step, cfg.max_steps), train_loss=last_train_loss, val=val,
                      tokens_per_s=total_tokens / total_time if total_time else 0.0,
                      checkpoint=str(last_saved), resumed_from=resumed_from, history=history)


def _log_loss_curve(history: list[dict[str, float]]) -> None:
    """Plot loss and val_loss from the run's metric history, which also holds the steps of
    earlier attempts when a retry resumed into the same run; fall back to this attempt's."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker
    import matplotlib.pyplot as plt
    import mlflow

    from tasks.common.tracking import log_figure

    client = mlflow.MlflowClient()
    run_id = mlflow.active_run().info.run_id
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for key in ("loss", "val_loss"):
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        if not points:
            points = [(int(h["step"]), h[key]) for h in history if key in h]
        if points:
            curves[key] = ([s for s, _ in points], [v for _, v in points])
    if not curves:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o" if key == "val_loss" else None, markersize=3, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    log_figure(fig, "loss_curve.png")
