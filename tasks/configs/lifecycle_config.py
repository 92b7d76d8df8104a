"""The whole lifecycle (`LifecycleConfig`): what the DAG resolves from a recipe plus the run's
Params, one section per stage (data, sweep, pretrain, finetune, distill, evaluate), the gate,
the ladder, and the settings that belong to no single stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.configs.data_config import DataPrepConfig
from tasks.configs.evaluate_config import EvalConfig
from tasks.configs.fields import bounded, check_bounds
from tasks.configs.gate_config import GateConfig
from tasks.configs.sweep_config import LadderConfig, SweepConfig
from tasks.configs.train_config import DistillConfig, FinetuneConfig, TrainConfig


@dataclass(kw_only=True)
class LifecycleConfig:
    data: DataPrepConfig
    sweep: SweepConfig
    pretrain: TrainConfig
    finetune: FinetuneConfig
    distill: DistillConfig
    evaluate: EvalConfig
    gate: GateConfig = field(default_factory=GateConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    # Not in `pretrain` or `sweep`: a run that takes an earlier run's sweep (start_at pretrain,
    # a fork) must be free to set it, and those sections are compared with that run's.
    pretrain_lr: float = bounded(0.0, minimum=0.0, maximum=1.0,
                                 help="Pretraining's learning rate instead of the sweep's best (a "
                                      "fork's new rate, say); 0 = the sweep's best.")

    def __post_init__(self) -> None:
        check_bounds(self)
