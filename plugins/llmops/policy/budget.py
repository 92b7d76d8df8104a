"""What a run will cost, in accelerator-hours, and the refusal when it is too much: a sweep's or a
ladder's against its budget_hours Param, every stage of a run against its team's monthly budget.

Training a model of P parameters on T tokens costs about 6 * P * T FLOPs (forward and backward),
evaluating it 2 * P per token. Divided by an accelerator's effective throughput (its dense bf16
peak at ~40% model-FLOPs utilisation: a planning figure, not a promise) this gives
accelerator-seconds; each job also pays its start-up (instances, image pull, data). The number does
not depend on how many accelerators a job uses: more of them finish sooner at the same total.

Every stage on every backend (`run_estimate`): its upper bound is instances x accelerators per
instance x max run time (stage_resources, else the backend settings, else JobSpec's 24 h): the
service stops the job there. Where a training-FLOPs estimate applies (sweep, ladder, pretrain,
finetune, distill) the stage is charged that estimate plus every instance's start-up, capped at the upper
bound; data prep and evaluation are charged the upper bound. Accelerators per instance come from
the job ledger's price table (plugins/llmops/infra/ledger/prices.json; Batch `gpus`, HyperPod
`gpus_per_node` when set); a CPU instance has 0, a type in neither counts as 1 per instance (no
guess of 0), and a local stage runs on the worker's CPU: 0.

Checked by the first task of a run (`start_run`, `start_ladder`), before any job starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmops.infra.ledger.events import instance_rate
from llmops.jobs.backends import backend_settings
from llmops.jobs.backends import remote_settings
from llmops.jobs.spec import JobSpec
from llmops.policy.sweep_study import slot_count, trial_eval_interval
from tasks import configs
from tasks.common import hardware
from tasks.scaling.rungs import rungs

# Planning utilisation of an accelerator's dense bf16 peak (tasks/common/hardware.py, the table the
# jobs' MFU uses too)
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
    try:
        return stage_resources(backend, stage, params)["instance_type"]
    except remote_settings.BackendSettingsError:  # check_backends refuses it, naming the Param
        return ""


def stage_resources(backend: str, stage: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a stage's jobs will run on, as the backends resolve it (remote.merged): the run's
    stage_resources over the backend's settings for the stage: image, instance_type,
    instance_count, max_run_seconds and accelerators per instance (None = not known here)."""
    chosen = ((params or {}).get("stage_resources") or {}).get(stage) or {}
    max_run = int(chosen.get("max_run_seconds") or JobSpec.__dataclass_fields__["max_run_seconds"].default)
    if backend == "local":
        return {"image": "", "instance_type": "local", "instance_count": 1,
                "max_run_seconds": max_run, "accelerators": 0}
    block = backend_settings.load(backend, backend_settings.settings_class(backend)).for_stage(stage)
    per_node = getattr(block, "gpus", 0) or getattr(block, "gpus_per_node", 0)
    return {"image": str(chosen.get("image") or block.image),
            "instance_type": str(chosen.get("instance_type") or block.instance_type),
            "instance_count": int(chosen.get("instance_count") or block.instance_count or 1),
            "max_run_seconds": max_run, "accelerators": per_node or None}


def _training_flops(model: configs.ModelConfig, steps: int, batch_size: int, seq_len: int,
                    evals: int, eval_batches: int) -> float:
    params = model.approx_params  # with the output layer: it is matmul work on every token
    return 6 * params * steps * batch_size * seq_len + 2 * params * evals * eval_batches * batch_size * seq_len


def sweep_estimate(cfg: configs.LifecycleConfig, instance_type: str) -> Estimate:
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


# -- every stage of a run, against its team's monthly budget ---------------------------------

@dataclass
class StageEstimate:
    stage: str
    backend: str
    instance_type: str
    instances: int                # per job
    jobs: int
    accelerators: int             # per instance
    max_run_seconds: int
    flops_hours: float | None     # the training-FLOPs estimate plus start-up; None = not a training stage
    counted_as: str               # how the accelerators per instance were found

    @property
    def upper_hours(self) -> float:
        """The most the stage can use: the service stops each job at its max run time."""
        return self.jobs * self.instances * self.accelerators * self.max_run_seconds / 3600

    @property
    def hours(self) -> float:
        return self.upper_hours if self.flops_hours is None else min(self.flops_hours, self.upper_hours)

    def line(self) -> str:
        if self.backend == "local":
            return f"{self.stage} on local: 0 (the worker's CPU)"
        what = (f"{self.stage} on {self.backend}: {self.jobs} jobs x " if self.jobs > 1 else
                f"{self.stage} on {self.backend}: ") + \
            f"{self.instances} x {self.instance_type or 'unknown type'} ({self.accelerators} {self.counted_as})"
        bound = f"max run {self.max_run_seconds / 3600:g} h, at most {self.upper_hours:.4g}"
        if self.flops_hours is None:
            return f"{what}, {bound} = {self.hours:.4g}"
        return f"{what}, training FLOPs + start-up {self.flops_hours:.4g} ({bound}) = {self.hours:.4g}"


def accelerators_per_instance(instance_type: str, from_settings: int | None) -> tuple[int, str]:
    """(count, how it was found): the backend's own count, else the ledger's price table, else 1."""
    if from_settings:
        return from_settings, "accelerators per node, from the backend settings"
    count = instance_rate(instance_type)[0] if instance_type else None
    if count is None:
        return 1, "accelerator per instance assumed: type not in the price table"
    return count, "accelerators per instance"


def _stage_flops(cfg: configs.LifecycleConfig, stage: str) -> tuple[float, int] | None:
    """(training FLOPs, jobs) of a training stage; None for data prep and evaluation."""
    seq = cfg.data.seq_len
    if stage in ("sweep", "ladder"):
        estimate = (sweep_estimate if stage == "sweep" else ladder_estimate)(cfg, "local")
        return estimate.flops, estimate.jobs
    if stage == "pretrain":
        t = cfg.pretrain
        return _training_flops(t.model, t.max_steps, t.batch_size, seq,
                               math.ceil(t.max_steps / t.eval_interval), t.eval_batches), 1
    if stage == "finetune":
        t = cfg.finetune
        return _training_flops(cfg.pretrain.model, t.max_steps, t.batch_size, seq,
                               math.ceil(t.max_steps / t.eval_interval), t.eval_batches), 1
    if stage == "distill":
        t = cfg.distill
        # the student trains; the teacher (the pretraining model) runs forward on the same tokens
        student = _training_flops(t.student, t.max_steps, t.batch_size, seq,
                                  math.ceil(t.max_steps / t.eval_interval), t.eval_batches)
        return student + 2 * cfg.pretrain.model.approx_params * t.max_steps * t.batch_size * seq, 1
    return None


def run_estimate(cfg: configs.LifecycleConfig, backends: dict[str, str],
                 params: dict[str, Any] | None = None) -> list[StageEstimate]:
    """An accelerator-hour estimate for every stage of the run, on its backend."""
    out = []
    for stage, backend in backends.items():
        res = stage_resources(backend, stage, params)
        accelerators, how = (0, "") if backend == "local" else \
            accelerators_per_instance(res["instance_type"], res["accelerators"])
        found = _stage_flops(cfg, stage)
        jobs, flops_hours = 1, None
        if found is not None:
            flops, jobs = found
            _, speed = accelerator(res["instance_type"] or "unknown")
            flops_hours = (flops / speed + jobs * res["instance_count"] * accelerators
                           * JOB_OVERHEAD_SECONDS["remote"]) / 3600
        out.append(StageEstimate(stage, backend, res["instance_type"], res["instance_count"], jobs,
                                 accelerators, res["max_run_seconds"], flops_hours, how))
    return out
