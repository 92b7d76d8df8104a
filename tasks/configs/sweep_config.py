"""What sizes and tunes pretraining: the learning-rate sweep (`SweepConfig`, searched by an
Optuna study with `SWEEP_SAMPLERS` and `SWEEP_PRUNERS`), the scaling ladder of small models
(`LadderConfig`) and its fit job (`LadderFitConfig`, `python -m tasks.ladder`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tasks.configs.fields import bounded, check, check_bounds, field_type
from tasks.configs.model_config import ModelConfig
from tasks.configs.train_config import TrainConfig


SWEEP_SAMPLERS = ("tpe", "random", "grid")
SWEEP_PRUNERS = ("median", "asha", "none")


@dataclass(kw_only=True)
class SweepConfig:
    """Short pretraining trials searched by an Optuna study (llmops.policy.sweep_study): the best by
    validation loss sets pretraining's hyperparameters. The learning rate is always searched (log
    scale over [lr_min, lr_max]); `search_space` adds other TrainConfig fields."""

    trials: int = bounded(3, minimum=1, maximum=64, help="Trials, run in parallel as mapped tasks.")
    lr_min: float = bounded(1e-3, minimum=1e-6, maximum=1.0, help="Lowest learning rate tried.")
    lr_max: float = bounded(1e-2, minimum=1e-6, maximum=1.0, help="Highest learning rate tried.")
    steps: int = bounded(60, minimum=1, maximum=1_000_000, help="Steps per trial.")
    sampler: str = bounded("tpe", choices=SWEEP_SAMPLERS,
                           help="tpe (Bayesian), random, or grid (`trials` log-spaced learning rates "
                                "x every choice of search_space).")
    pruner: str = bounded("median", choices=SWEEP_PRUNERS,
                          help="Stops hopeless trials early: median (worse than the median of finished "
                               "trials at the same step), asha (successive halving), none.")
    evals: int = bounded(4, minimum=1, maximum=1000,
                         help="Validation losses each trial reports; the pruner decides after each.")
    search_space: dict = bounded({}, help="More TrainConfig fields to tune: path -> {'low', 'high', "
                                          "'log'} or {'choices': [...]}, e.g. {'optim.weight_decay': "
                                          "{'low': 0.0, 'high': 0.2}}.")
    seed: int = bounded(0, minimum=0, maximum=2**31 - 1, help="Seed of the sampler.")
    study: str = bounded("", help="An Optuna study to continue, by name (a killed run's, say): its "
                                  "finished trials are kept. Empty = one study per DAG run, which a "
                                  "cleared run resumes.")
    budget_hours: float = bounded(100.0, minimum=0.0, maximum=1e7,
                                  help="Refuse to start when the sweep's estimated accelerator-hours "
                                       "exceed this; 0 = no limit.")
    size_from_ladder: bool = bounded(False, help="Size pretraining (width, steps) from the latest "
                                                 "scaling_ladder recommendation.")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(self.lr_min <= self.lr_max,
               f"SweepConfig.lr_min ({self.lr_min}) must be <= lr_max ({self.lr_max}).")
        check(isinstance(self.search_space, dict), "SweepConfig.search_space must be an object.")
        hints = {path: field_type(TrainConfig, path) for path in self.search_space}
        for path, spec in self.search_space.items():
            where = f"SweepConfig.search_space[{path!r}]"
            check(hints[path] in (int, float, str, bool),
                   f"{where}: not a number or string field of TrainConfig (e.g. 'optim.weight_decay', "
                   "'batch_size', 'model.dropout').")
            check(isinstance(spec, dict) and (set(spec) <= {"low", "high", "log"} and
                                               {"low", "high"} <= set(spec) or set(spec) == {"choices"}),
                   f"{where} must be {{'low': x, 'high': y[, 'log': true]}} or {{'choices': [...]}}.")
            if "choices" in spec:
                check(isinstance(spec["choices"], list) and len(spec["choices"]) > 0,
                       f"{where}.choices must be a non-empty list.")
            else:
                check(all(isinstance(spec[k], (int, float)) and not isinstance(spec[k], bool)
                           for k in ("low", "high")) and spec["low"] < spec["high"],
                       f"{where}: low and high must be numbers with low < high.")
                check(not spec.get("log") or spec["low"] > 0, f"{where}: a log range needs low > 0.")
        check(self.sampler != "grid" or all("choices" in s for s in self.search_space.values()),
               "SweepConfig.sampler 'grid' needs {'choices': [...]} for every search_space entry.")

    def space(self) -> dict[str, dict]:
        """Every searched TrainConfig path and its range: the learning rate first."""
        return {"optim.lr": {"low": self.lr_min, "high": self.lr_max, "log": True},
                **self.search_space}

    def learning_rates(self) -> list[float]:
        """Log-spaced over [lr_min, lr_max], deterministic so a rerun tries the same trials."""
        if self.trials == 1:
            return [math.sqrt(self.lr_min * self.lr_max)]
        ratio = (self.lr_max / self.lr_min) ** (1 / (self.trials - 1))
        return [float(f"{self.lr_min * ratio**i:.3g}") for i in range(self.trials)]


@dataclass(kw_only=True)
class LadderConfig:
    """A scaling ladder (dags/scaling_ladder.py): small models of the pretraining model's family,
    one per width x tokens-per-parameter, each trained to the end of its own schedule; the law
    L(N, D) = E + A/N^alpha + B/D^beta is fitted to their final validation losses (Chinchilla
    approach 3, tasks/scaling/law.py) and gives the compute-optimal N and D for a FLOP budget
    (C = 6ND). N counts non-embedding parameters, 12 * n_layer * n_embd^2 (Kaplan et al.: the
    embedding's share distorts the law at small sizes)."""

    widths: list = bounded([32, 64, 96], help="n_embd of each rung; depth, heads, vocabulary and "
                                              "context are the pretraining model's.")
    tokens_per_param: list = bounded([5, 10, 20], help="Training tokens per parameter (D/N); every "
                                                       "width trains at each.")
    held_out: int = bounded(1, minimum=0, maximum=64, help="Largest-compute rungs left out of the "
                                                           "fit, to measure its extrapolation error.")
    target_flops: float = bounded(1e15, minimum=1.0, maximum=1e30,
                                  help="FLOP budget C the compute-optimal N and D are given for.")
    budget_hours: float = bounded(100.0, minimum=0.0, maximum=1e7,
                                  help="Refuse to start when the ladder's estimated accelerator-hours "
                                       "exceed this; 0 = no limit.")
    huber_delta: float = bounded(1e-3, minimum=1e-6, maximum=1.0,
                                 help="Huber loss threshold on log-loss residuals (Chinchilla: 1e-3).")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(bool(self.widths) and all(isinstance(w, int) and not isinstance(w, bool) and w >= 8
                                         for w in self.widths),
               f"LadderConfig.widths must be a list of integers >= 8, got {self.widths!r}.")
        check(bool(self.tokens_per_param) and all(
                   isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
                   for t in self.tokens_per_param),
               f"LadderConfig.tokens_per_param must be a list of positive numbers, got "
               f"{self.tokens_per_param!r}.")
        rungs = len(set(self.widths)) * len(set(self.tokens_per_param))
        check(rungs - self.held_out >= 5,
               f"LadderConfig: {rungs} rungs minus held_out {self.held_out} leave {rungs - self.held_out} "
               "points to fit a law with 5 constants; give at least 5 + held_out rungs (more widths "
               "or tokens_per_param values).")


@dataclass(kw_only=True)
class LadderFitConfig:
    """The ladder's fit job (python -m tasks.ladder): its rungs' results in, the law and a
    recommendation out."""

    points: list = bounded([], help="One per finished rung: {'n_params', 'tokens', 'loss', ...}.")
    ladder: LadderConfig = field(default_factory=LadderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # the family recommended sizes keep
    tokens_per_step: int = bounded(2048, minimum=1, maximum=1 << 40,
                                   help="batch_size * seq_len of the pretraining run sized by the fit.")
    output_dir: str = ""

    def __post_init__(self) -> None:
        check_bounds(self)
        check(bool(self.output_dir), "LadderFitConfig.output_dir is required.")
        check(all(isinstance(p, dict) and {"n_params", "tokens", "loss"} <= set(p) for p in self.points),
               "LadderFitConfig.points must be objects with n_params, tokens and loss.")
