"""Typed, validated configs for every stage, and the named recipes built from one base.

Standard library only: the Airflow side imports this package to build its Param schemas and to
validate a run's settings before any job starts, and MWAA workers have no torch or ray.

A stage's config is written to a JSON file and handed to `python -m tasks.<stage> --config FILE`;
`from_dict` rejects unknown keys so a typo in an override fails loudly instead of being ignored.

Where each part lives (each imports only the ones above it):
    fields.py            ConfigError, bounded, check, check_bounds, from_dict, to_dict, flatten,
                         field_type
    model_config.py      the building blocks: ModelConfig, OptimConfig
    data_config.py       DataPrepConfig and DATA_QUALITY_FILTERS
    train_config.py      TrainConfig (and what a fork may change), FinetuneConfig, DistillConfig,
                         and which stages keep their progress in checkpoints (CHECKPOINTED_STAGES)
    evaluate_config.py   EvalConfig, the task suite format (SUITE_FORMATS, check_suite_text)
    sweep_config.py      SweepConfig, LadderConfig, LadderFitConfig
    gate_config.py       GateConfig and ITEM_METRIC
    lifecycle_config.py  LifecycleConfig: every stage's section of a run
    recipes.py           base, tiny, demo, gpu, RECIPES, recipe
Every public name is re-exported here: `from tasks import configs; configs.TrainConfig`.
"""

from __future__ import annotations

from tasks.configs.data_config import DATA_QUALITY_FILTERS, DataPrepConfig
from tasks.configs.evaluate_config import (SUITE_FORMATS, EvalConfig, check_suite_text,
                                           suite_item_kind)
from tasks.configs.fields import (
    ConfigError,
    T,
    bounded,
    check,
    check_bounds,
    field_type,
    flatten,
    from_dict,
    to_dict,
)
from tasks.configs.gate_config import ITEM_METRIC, ITEM_METRIC_HELP, GateConfig
from tasks.configs.lifecycle_config import LifecycleConfig
from tasks.configs.model_config import MODEL_ARCHS, ModelConfig, OptimConfig
from tasks.configs.recipes import RECIPES, base, demo, gpu, recipe, tiny
from tasks.configs.sweep_config import (SWEEP_PRUNERS, SWEEP_SAMPLERS, LadderConfig,
                                        LadderFitConfig, SweepConfig)
from tasks.configs.train_config import (CHECKPOINTED_STAGES, FORK_KNOBS, FORK_PLACES, DistillConfig,
                                        FinetuneConfig, TrainConfig, fork_refusals)

__all__ = [
    # fields
    "ConfigError", "T", "bounded", "check", "check_bounds", "field_type", "flatten", "from_dict",
    "to_dict",
    # the schemas
    "MODEL_ARCHS", "ModelConfig", "OptimConfig",
    "DATA_QUALITY_FILTERS", "DataPrepConfig",
    "FORK_KNOBS", "FORK_PLACES", "fork_refusals", "TrainConfig", "FinetuneConfig", "DistillConfig",
    "CHECKPOINTED_STAGES",
    "EvalConfig", "SUITE_FORMATS", "check_suite_text", "suite_item_kind",
    "SWEEP_SAMPLERS", "SWEEP_PRUNERS", "SweepConfig", "LadderConfig", "LadderFitConfig",
    "ITEM_METRIC", "ITEM_METRIC_HELP", "GateConfig",
    "LifecycleConfig",
    # recipes
    "base", "tiny", "demo", "gpu", "RECIPES", "recipe",
]
