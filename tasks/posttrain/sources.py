"""A post-training stage's starting model, from wherever it lives, as a local model directory.

    /path/to/model                a model directory (model.pt, model_config.json, tokenizer.json,
                                  meta.json), as every training stage writes
    /path/to/checkpoints[/step_N] a training checkpoint (the newest valid one under a root);
                                  LoRA adapters in it are merged into the weights
    models:/<name>@<alias>        a registered model version by alias (e.g. @champion),
    models:/<name>/<version>      or by number,
    models:/m-<id>                or a logged model: the model directory logged beside the
                                  MLflow model (export.log_mlflow_model's extra_files) is
                                  downloaded through MLflow, so this works on any backend

The result is always a directory load_model reads; its meta.json records what it was resolved
from, which becomes the parent in the new model's lineage.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tasks.common.io import read_json, write_json

log = logging.getLogger(__name__)

LORA_A, LORA_B, BASE = ".lora_A.default.weight", ".lora_B.default.weight", ".base_layer."


def resolve_model_dir(ref: str, work_dir: str | Path) -> Path:
    """A local model directory for `ref` (see the module docstring). Downloads and conversions go
    under work_dir and are reused when a retried job asks again."""
    ref = str(ref)
    if ref.startswith("models:/"):
        return _from_registry(ref, Path(work_dir))
    path = Path(ref)
    if (path / "meta.json").is_file():
        return path
    if path.is_dir():
        return _from_checkpoint(path, Path(work_dir))
    raise FileNotFoundError(
        f"{ref!r} is neither a model directory (with meta.json), a checkpoint directory, nor an "
        "MLflow model URI (models:/<name>@<alias>, models:/<name>/<version>, models:/m-<id>).")


# -- the MLflow registry --------------------------------------------------------------------------


def parse_models_uri(uri: str) -> dict[str, str]:
    """models:/name@alias, models:/name/3 or models:/m-abc -> its parts."""
    body = uri[len("models:/"):].strip("/")
    if m := re.fullmatch(r"(?P<name>[^@/]+)@(?P<alias>[^@/]+)", body):
        return m.groupdict()
    if m := re.fullmatch(r"(?P<name>[^@/]+)/(?P<version>\d+)", body):
        return m.groupdict()
    if re.fullmatch(r"m-[0-9a-f]+", body):
        return {"model_id": body}
    raise ValueError(f"{uri!r} is not a model URI this stage understands; use "
                     "models:/<name>@<alias>, models:/<name>/<version> or models:/m-<id>.")


def _from_registry(uri: str, work_dir: Path) -> Path:
    import mlflow

    client = mlflow.MlflowClient()
    parts = parse_models_uri(uri)
    version = None
    if "alias" in parts:
        version = client.get_model_version_by_alias(parts["name"], parts["alias"])
    elif "version" in parts:
        version = client.get_model_version(parts["name"], parts["version"])
    model_id = parts.get("model_id") or (version.model_id if version else None)
    if not model_id and version is not None and str(version.source).startswith("models:/m-"):
        model_id = str(version.source)[len("models:/"):]
    if not model_id:
        raise ValueError(f"{uri} resolves to version {version.version} whose source "
                         f"{version.source!r} is not an MLflow logged model.")
    target = work_dir / model_id
    if (target / "meta.json").is_file():
        log.info("%s: using the copy already downloaded to %s", uri, target)
        return target
    logged = client.get_logged_model(model_id)
    tmp = work_dir / f".{model_id}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        local = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"{logged.artifact_location.rstrip('/')}/extra_files", dst_path=str(tmp)))
        if not (local / "model.pt").is_file():
            raise FileNotFoundError(
                f"{uri} (logged model {model_id}) was logged without its model directory "
                "(extra_files/model.pt); register a model logged by this version of the stages.")
        meta = read_json(local / "meta.json")
        meta.update(model_uri=f"models:/{model_id}", resolved_from=uri,
                    run_id=meta.get("run_id") or logged.source_run_id)
        if version is not None:
            meta.update(registered_model=version.name, registered_version=str(version.version))
        write_json(local / "meta.json", meta)
        if target.exists():
            shutil.rmtree(target)
        os.replace(local, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s -> logged model %s -> %s", uri, model_id, target)
    return target


# -- checkpoints ----------------------------------------------------------------------------------


def merge_lora_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict with peft LoRA layers (x.base_layer.weight, x.lora_A/B.default.weight) ->
    the plain one: W + scaling * B @ A, as peft's merge_and_unload computes."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if BASE in key:
            prefix, leaf = key.split(BASE)
            new_key = f"{prefix}.{leaf}"
            if leaf == "weight":
                a, b = state[prefix + LORA_A], state[prefix + LORA_B]
                value = value + scaling * (b.float() @ a.float()).to(value.dtype)
            out[new_key] = value
        else:
            out[key] = value
    return out


def _checkpoint_path(path: Path) -> Path:
    from tasks.train import checkpoint as ckpt

    if (path / "manifest.json").is_file():
        problem = ckpt.verify_checkpoint(path)
        if problem:
            raise ValueError(f"checkpoint {path} is damaged: {problem}")
        return path
    for root in (path, path / "checkpoints"):
        found = ckpt.latest_valid_checkpoint(root)
        if found is not None:
            return found
    raise FileNotFoundError(f"{path} holds no valid checkpoint (step_*/ with a manifest).")


def _from_checkpoint(path: Path, work_dir: Path) -> Path:
    """A model directory from a pretraining, fine-tuning or distillation checkpoint: weights from
    model.pt (LoRA merged), architecture from the stage config saved beside it (sizes checked
    against the weights), tokenizer from that stage's data or parent model."""
    from tasks.configs import ModelConfig, from_dict
    from tasks.model import GPT
    from tasks.train import checkpoint as ckpt
    from tasks.train.data import DataDir

    chosen = _checkpoint_path(path)
    target = work_dir / f"checkpoint-{chosen.parent.parent.name}-{chosen.name}"
    if (target / "meta.json").is_file():
        return target
    state = ckpt.load_checkpoint(chosen, map_location="cpu")
    config: dict[str, Any] = state["config"]
    weights = state["model"]
    if any(".lora_" in k for k in weights):
        weights = merge_lora_state(weights, config["lora_alpha"] / config["lora_rank"])
    parent: dict[str, Any] = {}
    if "model" in config:  # pretraining or a sweep trial
        stage, arch = "pretrain", dict(config["model"])
        tokenizer = DataDir(config["data_dir"]).tokenizer_path
    elif "student" in config:  # distillation
        teacher_dir = resolve_model_dir(config["teacher_model"], work_dir)
        stage, arch = "distill", dict(config["student"])
        tokenizer, parent = teacher_dir / "tokenizer.json", read_json(teacher_dir / "meta.json")
    elif "base_model" in config:  # fine-tuning
        base_dir = resolve_model_dir(config["base_model"], work_dir)
        stage, arch = "finetune", read_json(base_dir / "model_config.json")
        tokenizer, parent = base_dir / "tokenizer.json", read_json(base_dir / "meta.json")
    else:
        raise ValueError(f"{chosen}/config.json is not a pretrain, finetune or distill config.")
    # sizes the weights fix; n_head and dropout come from the config
    arch.update(vocab_size=weights["transformer.wte.weight"].shape[0],
                n_embd=weights["transformer.wte.weight"].shape[1],
                block_size=weights["transformer.wpe.weight"].shape[0],
                n_layer=len({k.split(".")[2] for k in weights if k.startswith("transformer.h.")}))
    model = GPT(from_dict(ModelConfig, arch))
    model.load_state_dict(weights)
    meta = {"stage": f"{stage}-checkpoint", "step": state["step"], "source_checkpoint": str(chosen),
            "data_content_hash": parent.get("data_content_hash"), "run_id": None,
            "parent_run_id": parent.get("run_id"), "parent_model_uri": parent.get("model_uri"),
            "resolved_from": str(path)}
    return _export_to(model, target, tokenizer, meta)


def _export_to(model, target: Path, tokenizer: Path, meta: dict[str, Any]) -> Path:
    """export_model writes <dir>/model; move that to `target` (both atomic renames)."""
    from tasks.train.export import export_model

    staging = target.parent / f".{target.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    written = export_model(model, staging, tokenizer, meta)
    os.replace(written, target)
    shutil.rmtree(staging, ignore_errors=True)
    return target
