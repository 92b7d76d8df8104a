"""The lifecycle DAG's Params, generated from the stage configs' own fields and bounds.

Each knob maps a Param to one config path. Its JSON schema (type, minimum, maximum, enum) comes
from the dataclass field, so the UI form refuses exactly what the job would refuse. A knob left
empty (null) keeps the chosen recipe's value.

How Airflow 3.3's trigger form reads a schema (airflow/ui, FlexibleForm), and why these look as
they do:
- A Param is *required* (the Trigger button stays grey until it is filled) when its type does not
  include "null" and its value is None or "". Every optional Param is `["null", <type>]` with
  default None.
- A number field clamps what is typed to the schema's top-level `minimum`/`maximum` when it loses
  focus: 0 typed into n_layer would silently become 1. So the bounds sit in `allOf` (the form does
  not read them there, jsonschema does) and the server refuses an out-of-range value, naming the
  Param and its bounds; the description states them.
- An enum that holds None shows its option as "null" unless `values_display` names it.
- `section` groups Params under headings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from llmops.jobs.backends import BACKENDS
from tasks import configs

# Param name -> (config path, what a researcher should know)
KNOBS: dict[str, str] = {
    "data_inputs": "data.inputs",
    "sft_inputs": "data.sft_inputs",
    "vocab_size": "data.vocab_size",
    "seq_len": "data.seq_len",
    "data_engine": "data.engine",
    "n_layer": "pretrain.model.n_layer",
    "n_head": "pretrain.model.n_head",
    "n_embd": "pretrain.model.n_embd",
    "arch": "pretrain.model.arch",
    "n_kv_head": "pretrain.model.n_kv_head",
    "batch_size": "pretrain.batch_size",
    "pretrain_steps": "pretrain.max_steps",
    "pretrain_lr": "pretrain_lr",
    "pretrain_seed": "pretrain.seed",
    "sample_order": "pretrain.sample_order",
    "stream_cache_gb": "pretrain.stream_cache_gb",
    # which steps a pause, a retry or a fork can start from (the sweep's trials keep their own)
    "checkpoint_interval": "pretrain.checkpoint_interval",
    "keep_checkpoints": "pretrain.keep_checkpoints",
    "keep_every": "pretrain.keep_every",
    "sweep_trials": "sweep.trials",
    "lr_min": "sweep.lr_min",
    "lr_max": "sweep.lr_max",
    "sweep_steps": "sweep.steps",
    "sweep_sampler": "sweep.sampler",
    "sweep_pruner": "sweep.pruner",
    "sweep_evals": "sweep.evals",
    "sweep_search_space": "sweep.search_space",
    "sweep_study": "sweep.study",
    "budget_hours": "sweep.budget_hours",
    "pretrain_size_from_ladder": "sweep.size_from_ladder",
    "finetune_steps": "finetune.max_steps",
    "finetune_lr": "finetune.optim.lr",
    "finetune_seed": "finetune.seed",
    "finetune_replay_fraction": "finetune.replay_fraction",
    "lora_rank": "finetune.lora_rank",
    "sft_packing": "finetune.packing",
    "student_n_layer": "distill.student.n_layer",
    "student_n_embd": "distill.student.n_embd",
    "student_arch": "distill.student.arch",
    "student_model": "distill.student_model",
    "distill_steps": "distill.max_steps",
    "distill_temperature": "distill.temperature",
    "distill_alpha": "distill.alpha",
    "distill_replay_fraction": "distill.replay_fraction",
    "distill_seed": "distill.seed",
    "quantize_student": "distill.quantize_int8",
    "lm_eval": "evaluate.lm_eval",
    "eval_suites": "evaluate.suites",
    "min_task_accuracy": "gate.min_task_accuracy",
    "max_perplexity": "gate.max_perplexity",
    "prefer": "gate.prefer",
    "gate_metrics": "gate.metrics",
    "gate_policy": "gate.policy",
    "gate_margin": "gate.margin",
    "gate_guard_margin": "gate.guard_margin",
    "gate_confidence": "gate.confidence",
    "max_contaminated_share": "gate.max_contaminated_share",
    "exclude_contaminated": "gate.exclude_contaminated",
}

# The llm_retrain DAG's knobs (dags/retrain.py): fine-tune the champion, evaluate, gate.
RETRAIN_KNOBS: dict[str, str] = {
    "finetune_steps": "finetune.max_steps",
    "finetune_lr": "finetune.optim.lr",
    "finetune_replay_fraction": "finetune.replay_fraction",
    "lora_rank": "finetune.lora_rank",
    "sft_packing": "finetune.packing",
    "lm_eval": "evaluate.lm_eval",
    "eval_suites": "evaluate.suites",
    "min_task_accuracy": "gate.min_task_accuracy",
    "max_perplexity": "gate.max_perplexity",
    "require_approval": "gate.require_approval",
    "gate_metrics": "gate.metrics",
    "gate_policy": "gate.policy",
    "gate_margin": "gate.margin",
    "gate_guard_margin": "gate.guard_margin",
    "gate_confidence": "gate.confidence",
    "max_contaminated_share": "gate.max_contaminated_share",
    "exclude_contaminated": "gate.exclude_contaminated",
}

STAGES = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")

# Form headings, in the order a run goes through them.
DATA, MODEL, SWEEP, PRETRAINING, POST_TRAINING, GATE, WHERE, LADDER = (
    "Data", "Model", "Sweep", "Pretraining", "Post-training", "Evaluation and gate",
    "Where it runs", "Scaling ladder")
# Config path prefix -> heading; the longest matching prefix wins.
SECTIONS: dict[str, str] = {
    "data.": DATA, "pretrain.model.": MODEL, "pretrain.": PRETRAINING, "sweep.": SWEEP,
    "sweep.size_from_ladder": PRETRAINING, "pretrain_lr": PRETRAINING,
    "finetune.": POST_TRAINING, "distill.": POST_TRAINING,
    "evaluate.": GATE, "gate.": GATE, "ladder.": LADDER,
}

# Where a stage's job runs when its backend is remote; empty fields keep the backend's defaults
# (the `llmops_backends` Variable). Bounds are the services' own.
RESOURCES_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "instance_type": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9.-]{1,62}$",
                          "description": "e.g. ml.p5.48xlarge (SageMaker, HyperPod) or p5.48xlarge (Batch)"},
        "instance_count": {"type": "integer", "minimum": 1, "maximum": 1000},
        "nproc_per_node": {"type": "integer", "minimum": 1, "maximum": 64},
        "image": {"type": "string", "minLength": 1, "maxLength": 255},
        "max_run_seconds": {"type": "integer", "minimum": 60, "maximum": 28 * 24 * 3600},
    },
}
TEAM_PATTERN = r"^([a-z][a-z0-9]{0,30})?$"
STORAGE_ROOT_HELP = ("Where stage outputs go: an absolute directory or an s3://bucket/prefix under "
                     "one of the allowed storage roots (plugins/llmops/core/settings.py). Empty = "
                     "$LLMOPS_STORAGE_ROOT, else $LLMOPS_HOME/storage.")
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object"}

# The scaling_ladder DAG's knobs (dags/scaling_ladder.py): the same recipes, another stage.
LADDER_KNOBS: dict[str, str] = {
    "data_inputs": "data.inputs",
    "vocab_size": "data.vocab_size",
    "seq_len": "data.seq_len",
    "n_layer": "pretrain.model.n_layer",
    "n_head": "pretrain.model.n_head",
    "batch_size": "pretrain.batch_size",
    "lr": "pretrain.optim.lr",
    "ladder_widths": "ladder.widths",
    "ladder_tokens_per_param": "ladder.tokens_per_param",
    "ladder_held_out": "ladder.held_out",
    "target_flops": "ladder.target_flops",
    "budget_hours": "ladder.budget_hours",
}
LADDER_STAGES = ("data_prep", "ladder")


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


def section_of(path: str) -> str:
    return SECTIONS[max((p for p in SECTIONS if path.startswith(p)), key=len)]


def _number(value: float) -> str:
    return f"{value:,}" if float(value).is_integer() and abs(value) < 1e12 else f"{value:g}"


def bounds_text(py_type: type, lo: float | None, hi: float | None) -> str:
    kind = "Integer" if py_type is int else "Number"
    if lo is not None and hi is not None:
        return f"{kind} from {_number(lo)} to {_number(hi)}."
    if lo is not None:
        return f"{kind}, at least {_number(lo)}."
    if hi is not None:
        return f"{kind}, at most {_number(hi)}."
    return f"{kind}."


def schema_bounds(schema: dict[str, Any]) -> tuple[float | None, float | None]:
    """A Param's (minimum, maximum), wherever its schema keeps them."""
    for part in [schema, *schema.get("allOf", [])]:
        if "minimum" in part or "maximum" in part:
            return part.get("minimum"), part.get("maximum")
    return None, None


def knob_schema(path: str) -> dict[str, Any]:
    f, py_type = field_of(path)
    schema: dict[str, Any] = {"type": ["null", _JSON_TYPES[py_type]]}
    meta = f.metadata
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None or hi is not None:
        # Not top-level: the form's number field would clamp to them instead of refusing.
        schema["allOf"] = [{k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None}]
    defaults = ", ".join(f"{name}={get_path(fn(), path)!r}" for name, fn in configs.RECIPES.items())
    if meta.get("choices"):
        schema["enum"] = [None, *meta["choices"]]
        schema["values_display"] = {"null": f"(recipe's value: {defaults})"}
    if py_type is list:
        items = [type(v) for v in get_path(configs.base(), path)]
        schema["items"] = ({"type": "number"} if items and set(items) <= {int, float}
                           else {"type": "string", "minLength": 1})
    help_text = meta.get("help") or path
    kind = ""
    if py_type in (int, float):
        kind = " " + bounds_text(py_type, lo, hi)
    elif meta.get("choices"):
        kind = f" One of {', '.join(meta['choices'])}."
    schema["description"] = (f"{help_text}{kind} Empty = the recipe's value ({defaults}). "
                             f"Sets {path}.")
    schema["section"] = section_of(path)
    return schema


def optional_text(description: str, section: str, **schema: Any):
    """An optional string Param: empty (None) submits, the form does not mark it required."""
    from airflow.sdk import Param

    return Param(None, type=["null", "string"], description=description, section=section, **schema)


def lifecycle_params() -> dict[str, Any]:
    """Param objects for the DAG; pure data, cheap at parse time."""
    from airflow.sdk import Param

    params: dict[str, Any] = {
        "recipe": Param("demo", type="string", enum=sorted(configs.RECIPES),
                        description="Named sizes every knob starts from: tiny (tests), demo "
                                    "(make demo, CPU), gpu (one GPU). Every knob left empty "
                                    "keeps the recipe's value."),
    }
    for name, path in KNOBS.items():
        schema = knob_schema(path)
        params[name] = Param(None, **schema)
    params["base_model"] = optional_text(
        "Fine-tune this model instead of pretraining one (no sweep, no pretraining; the data is "
        "prepared with its tokenizer): a Hugging Face causal-LM directory (Llama, Qwen2, "
        "Mistral, GPT-2...: config.json, *.safetensors, tokenizer.json) under the allowed data "
        "roots, an s3:// prefix holding one, or a registered model (models:/<name>@<alias>). "
        "Empty = pretrain from scratch.", POST_TRAINING, maxLength=1024)
    params["registered_model_name"] = Param(
        "llm-lifecycle", type="string", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        section=GATE, description="MLflow Model Registry name for the champion: 1-128 letters, "
                                  "digits, _ . - (starting with a letter or digit).")
    params["storage_root"] = optional_text(STORAGE_ROOT_HELP, WHERE, maxLength=1024)
    for stage in STAGES:
        params[f"backend_{stage}"] = Param("local", type="string", enum=sorted(BACKENDS),
                                           section=WHERE,
                                           description=f"Where the {stage} job runs: local (this "
                                                       "machine), or a remote backend configured "
                                                       "in the Airflow Variable llmops_backends.")
    params["stage_resources"] = Param(
        None, type=["null", "object"], additionalProperties=False,
        properties={stage: RESOURCES_SCHEMA for stage in STAGES},
        description="Per stage, for remote backends: instance_type, instance_count, "
                    "nproc_per_node, image, max_run_seconds, e.g. {\"pretrain\": "
                    "{\"instance_type\": \"ml.p5.48xlarge\", \"instance_count\": 2, "
                    "\"nproc_per_node\": 8, \"max_run_seconds\": 432000}}. Empty = the "
                    "backend's defaults.", section=WHERE)
    params["team"] = optional_text("The team the run belongs to (a lowercase letter, then up to 30 "
                                   "lowercase letters and digits): AWS Batch fair-share "
                                   "identifier, HyperPod namespace and queue, a tag on every job. "
                                   "Where the Airflow Variable llmops_teams is set it must be one "
                                   "of its teams, and the run stays within that team's images, "
                                   "buckets, data, priorities and accelerator-hour budget. Empty = "
                                   "its default_team (none without the Variable).", WHERE,
                                   pattern=TEAM_PATTERN)
    params["force_rerun"] = Param(False, type="boolean", section=WHERE,
                                  description="Run every stage's job afresh, even one that already "
                                              "succeeded in this DAG run (a cleared task normally "
                                              "reattaches to its job). Retries still reattach to "
                                              "the job the forced try started.")
    params["cache"] = Param(True, type="boolean", section=WHERE,
                            description="Step cache: a stage whose identity (stage, resolved "
                                        "config, input content hashes, code version, image) "
                                        "matches a finished earlier job reuses its outputs "
                                        "(verified) and submits nothing. Off: every stage runs; "
                                        "its job is still recorded for later runs. force_rerun "
                                        "also runs every stage.")
    params["from_run"] = optional_text(
        "Start from an earlier llm_lifecycle run: its DAG run id (e.g. manual__2026-01-01T00:00:00"
        "+00:00) or its MLflow parent run id. With start_at, the stages before start_at take that "
        "run's outputs instead of running; checked before any job (the run exists, its outputs are "
        "complete and match their hashes and manifests, the same config for those stages). "
        "Lineage tags point at it.", WHERE, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,249}$")
    params["start_at"] = Param(None, type=["null", "string"],
                               enum=[None, "sweep", "pretrain", "finetune", "distill", "evaluate"],
                               values_display={"null": "(from the start: data_prep)"}, section=WHERE,
                               description="The first stage that runs when from_run is set, e.g. "
                                           "finetune: data prep, the sweep and pretraining are "
                                           "from_run's.")
    params["fork_step"] = Param(None, type=["null", "integer"],
                                allOf=[{"minimum": 1, "maximum": 10_000_000}], section=WHERE,
                                description="With from_run and start_at pretrain: fork that run's "
                                            "pretraining at this step, one of its kept checkpoints "
                                            "(weights, optimizer, RNG and data cursor restored "
                                            "exactly). Only the learning rate schedule, "
                                            "pretrain_steps and the guard may differ from it; "
                                            "checked before any job. Empty = no fork.")
    params["priority"] = Param(None, type=["null", "integer"], allOf=[{"minimum": 0, "maximum": 9999}],
                               section=WHERE,
                               description="Scheduling priority, higher first: AWS Batch "
                                           "schedulingPriorityOverride, HyperPod priority class. "
                                           "Integer from 0 to 9,999. Empty = the queue's default.")
    return params


def ladder_params() -> dict[str, Any]:
    """Param objects for the scaling_ladder DAG; pure data, cheap at parse time."""
    from airflow.sdk import Param

    params: dict[str, Any] = {
        "recipe": Param("demo", type="string", enum=sorted(configs.RECIPES),
                        description="Named sizes every knob starts from: tiny (tests), demo (CPU), "
                                    "gpu. The ladder's rungs are the recipe's pretraining model at "
                                    "other widths."),
        "storage_root": optional_text(STORAGE_ROOT_HELP, WHERE, maxLength=1024),
    }
    for name, path in LADDER_KNOBS.items():
        params[name] = Param(None, **knob_schema(path))
    for stage in LADDER_STAGES:
        params[f"backend_{stage}"] = Param("local", type="string", enum=sorted(BACKENDS),
                                           section=WHERE, description=f"Where the {stage} jobs run.")
    return params


def retrain_params() -> dict[str, Any]:
    """Param objects for the llm_retrain DAG; pure data, cheap at parse time."""
    from airflow.sdk import Param

    params: dict[str, Any] = {
        "recipe": Param("demo", type="string", enum=sorted(configs.RECIPES),
                        description="Named sizes the fine-tuning and the gate start from."),
        "registered_model_name": Param("llm-lifecycle", type="string",
                                       pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
                                       description="MLflow Model Registry name whose `champion` is "
                                                   "retrained."),
        "data_dir": optional_text("A data prep output to fine-tune on; empty = the newest "
                                  "curated-data asset event's data_dir.", DATA, maxLength=1024),
        "storage_root": optional_text(STORAGE_ROOT_HELP, WHERE, maxLength=1024),
        "backend": Param("local", type="string", enum=sorted(BACKENDS), section=WHERE,
                         description="Where the fine-tuning and evaluation jobs run."),
    }
    for name, path in RETRAIN_KNOBS.items():
        params[name] = Param(None, **knob_schema(path))
    return params
