"""What a sweep or a ladder will cost, in accelerator-hours, and the refusal when it is too much.

Training a model of P parameters on T tokens costs about 6 * P * T FLOPs (forward and backward),
evaluating it 2 * P per token. Divided by an accelerator's effective throughput (its dense bf16
peak at ~40% model-FLOPs utilisation: a planning figure, not a promise) this gives
accelerator-seconds; each job also pays its start-up (instances, image pull, data). The number does
not depend on how many accelerators a job uses: more of them finish sooner at the same total.

Checked by the first task of a run (`start_run`, `start_ladder`), before any job starts.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from tasks import configs, hardware

# Planning utilisation of an accelerator's dense bf16 peak (tasks/hardware.py, the table the jobs'
# MFU uses too)
PLANNING_MFU = 0.4
# This project's CPU jobs: the tiny and demo models reach ~1e10 FLOP/s on 2 cores (small matmuls
# are overhead-bound; measured from the loop's tokens/s).
LOCAL = ("CPU", 1e10)
UNKNOWN = ("an unknown accelerator, assumed A10G-class",
           PLANNING_MFU * hardware.ACCELERATORS["A10G"].peak_tflops * 1e12)
JOB_OVERHEAD_SECONDS = {"local": 10.0, "remote": 300.0}


class BudgetError(ValueError):
    """The estimate exceeds the run's budget; the message gives both and what to change."""


@dataclass
class Estimate:
    what: str                 # "sweep", "ladder"
    jobs: int
    flops: float
    accelerator: str
    flops_per_second: float
    overhead_seconds: float   # per job
    detail: str               # what was counted, in words

    @property
    def hours(self) -> float:
        return (self.flops / self.flops_per_second + self.jobs * self.overhead_seconds) / 3600


def accelerator(instance_type: str) -> tuple[str, float]:
    if instance_type == "local":
        return LOCAL
    found = hardware.for_instance_type(instance_type)
    if found is None:
        return UNKNOWN
    return found.name, PLANNING_MFU * found.peak_tflops * 1e12


def instance_type_for(backend: str, stage: str, params: dict[str, Any] | None = None) -> str:
    """The instance type a stage's jobs will get: the run's stage_resources Param, else the
    backend's deployment settings (the Airflow Variable llmops_backends), else unknown ("")."""
    if backend == "local":
        return "local"
    chosen = ((params or {}).get("stage_resources") or {}).get(stage) or {}
    if isinstance(chosen, dict) and chosen.get("instance_type"):
        return str(chosen["instance_type"])
    text = None
    try:
        from airflow.sdk import Variable

        text = Variable.get("llmops_backends", default=None)
    except Exception:  # outside a task
        text = os.environ.get("AIRFLOW_VAR_LLMOPS_BACKENDS")
    try:
        block = (json.loads(text) if isinstance(text, str) else text or {}).get(backend) or {}
    except (ValueError, AttributeError):
        return ""
    stage_block = (block.get("stages") or {}).get(stage) or {}
    return str(stage_block.get("instance_type") or block.get("instance_type") or "")


def _training_flops(model: configs.ModelConfig, steps: int, batch_size: int, seq_len: int,
                    evals: int, eval_batches: int) -> float:
    params = model.approx_params  # with the output layer: it is matmul work on every token
    return 6 * params * steps * batch_size * seq_len + 2 * params * evals * eval_batches * batch_size * seq_len


def sweep_estimate(cfg: configs.LifecycleConfig, instance_type: str) -> Estimate:
    from llmops.sweep.study import slot_count, trial_eval_interval

    sweep, train = cfg.sweep, cfg.pretrain
    trials = slot_count(sweep)
    evals = math.ceil(sweep.steps / trial_eval_interval(sweep))
    per_trial = _training_flops(train.model, sweep.steps, train.batch_size, cfg.data.seq_len,
                                evals, train.eval_batches)
    name, speed = accelerator(instance_type)
    overhead = JOB_OVERHEAD_SECONDS["local" if instance_type == "local" else "remote"]
    return Estimate("sweep", trials, trials * per_trial, name, speed, overhead,
                    f"{trials} trials x {sweep.steps} steps of a {train.model.approx_params / 1e6:.2f}M-"
                    f"parameter model")


def ladder_estimate(cfg: configs.LifecycleConfig, instance_type: str) -> Estimate:
    from tasks.scaling.ladder import rungs

    plan = rungs(cfg.ladder, cfg.pretrain.model, cfg.pretrain.batch_size * cfg.data.seq_len)
    flops = sum(_training_flops(r.model, r.steps, cfg.pretrain.batch_size, cfg.data.seq_len,
                                1, cfg.pretrain.eval_batches) for r in plan)
    name, speed = accelerator(instance_type)
    overhead = JOB_OVERHEAD_SECONDS["local" if instance_type == "local" else "remote"]
    steps = sum(r.steps for r in plan)
    return Estimate("ladder", len(plan), flops, name, speed, overhead,
                    f"{len(plan)} rungs, {steps} steps in all, up to "
                    f"{max(r.model.approx_params for r in plan) / 1e6:.2f}M parameters")


def check(estimate: Estimate, budget_hours: float, *, knob: str, lower: str) -> None:
    """Refuse when the estimate exceeds the budget (0 = no limit)."""
    if budget_hours <= 0 or estimate.hours <= budget_hours:
        return
    raise BudgetError(
        f"The {estimate.what} would use an estimated {estimate.hours:.3g} accelerator-hours, more "
        f"than this run's budget of {budget_hours:g} ({knob}). Estimate: {estimate.detail} = "
        f"{estimate.flops:.3g} FLOPs on {estimate.accelerator} at {estimate.flops_per_second:.3g} "
        f"FLOP/s effective, plus {estimate.overhead_seconds:.0f} s start-up for each of its "
        f"{estimate.jobs} jobs. Raise {knob}, or lower {lower}. Nothing was started.")


def check_sweep(cfg: configs.LifecycleConfig, backend: str, params: dict[str, Any] | None = None) -> Estimate:
    estimate = sweep_estimate(cfg, instance_type_for(backend, "sweep", params))
    check(estimate, cfg.sweep.budget_hours, knob="budget_hours",
          lower="sweep_trials or sweep_steps")
    return estimate


def check_ladder(cfg: configs.LifecycleConfig, backend: str, params: dict[str, Any] | None = None) -> Estimate:
    estimate = ladder_estimate(cfg, instance_type_for(backend, "ladder", params))
    check(estimate, cfg.ladder.budget_hours, knob="budget_hours",
          lower="ladder_widths or ladder_tokens_per_param")
    return estimate
