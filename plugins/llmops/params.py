"""The lifecycle DAG's Params, generated from the stage configs' own fields and bounds.

Each knob maps a Param to one config path. Its JSON schema (type, minimum, maximum, enum) comes
from the dataclass field, so the UI form refuses exactly what the job would refuse. A knob left
empty (null) keeps the chosen recipe's value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from tasks import configs

# Param name -> (config path, what a researcher should know)
KNOBS: dict[str, str] = {
    "data_inputs": "data.inputs",
    "sft_inputs": "data.sft_inputs",
    "vocab_size": "data.vocab_size",
    "seq_len": "data.seq_len",
    "n_layer": "pretrain.model.n_layer",
    "n_head": "pretrain.model.n_head",
    "n_embd": "pretrain.model.n_embd",
    "batch_size": "pretrain.batch_size",
    "pretrain_steps": "pretrain.max_steps",
    "sweep_trials": "sweep.trials",
    "lr_min": "sweep.lr_min",
    "lr_max": "sweep.lr_max",
    "sweep_steps": "sweep.steps",
    "finetune_steps": "finetune.max_steps",
    "finetune_lr": "finetune.optim.lr",
    "student_n_layer": "distill.student.n_layer",
    "student_n_embd": "distill.student.n_embd",
    "distill_steps": "distill.max_steps",
    "distill_temperature": "distill.temperature",
    "distill_alpha": "distill.alpha",
    "min_task_accuracy": "gate.min_task_accuracy",
    "max_perplexity": "gate.max_perplexity",
    "prefer": "gate.prefer",
}

STAGES = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array"}


def field_of(path: str) -> tuple[dataclasses.Field, type]:
    """The dataclass field (and its Python type) at a dotted path of LifecycleConfig."""
    cls: Any = configs.LifecycleConfig
    *parents, leaf = path.split(".")
    for name in parents:
        cls = get_type_hints(cls)[name]
    hints = get_type_hints(cls)
    return next(f for f in dataclasses.fields(cls) if f.name == leaf), hints[leaf]


def get_path(cfg: Any, path: str) -> Any:
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def set_path(cfg: Any, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        cfg = getattr(cfg, name)
    setattr(cfg, leaf, value)


def knob_schema(path: str) -> dict[str, Any]:
    f, py_type = field_of(path)
    schema: dict[str, Any] = {"type": ["null", _JSON_TYPES[py_type]]}
    meta = f.metadata
    if meta.get("minimum") is not None:
        schema["minimum"] = meta["minimum"]
    if meta.get("maximum") is not None:
        schema["maximum"] = meta["maximum"]
    if meta.get("choices"):
        schema["enum"] = [None, *meta["choices"]]
    if py_type is list:
        schema["items"] = {"type": "string", "minLength": 1}
    defaults = ", ".join(f"{name}={get_path(fn(), path)!r}" for name, fn in configs.RECIPES.items())
    help_text = meta.get("help") or path
    schema["description"] = f"{help_text} Empty = the recipe's value ({defaults}). Sets {path}."
    return schema


def lifecycle_params() -> dict[str, Any]:
    """Param objects for the DAG; pure data, cheap at parse time."""
    from airflow.sdk import Param

    from llmops.jobs.backends import BACKENDS

    params: dict[str, Any] = {
        "recipe": Param("demo", type="string", enum=sorted(configs.RECIPES),
                        description="Named sizes every knob starts from: tiny (tests), demo "
                                    "(make demo, CPU), gpu (one GPU)."),
        "storage_root": Param("", type="string",
                              description="Where stage outputs go; empty = $LLMOPS_STORAGE_ROOT "
                                          "or .llmops/storage."),
        "registered_model_name": Param("llm-lifecycle", type="string",
                                       pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
                                       description="MLflow Model Registry name for the champion."),
    }
    for name, path in KNOBS.items():
        schema = knob_schema(path)
        params[name] = Param(None, **schema)
    for stage in STAGES:
        params[f"backend_{stage}"] = Param("local", type="string", enum=sorted(BACKENDS),
                                           description=f"Where the {stage} job runs.")
    return params
