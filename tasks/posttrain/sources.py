"""A stage's starting model (or a model to evaluate), from wherever it lives, as a local model
directory.

    /path/to/model                a Hugging Face causal-LM directory (config.json, safetensors
                                  weights, tokenizer.json), as every training stage writes and as
                                  transformers' save_pretrained writes any model (Llama, Qwen2,
                                  Mistral, GPT-2...); also a directory of the format before it
                                  (model.pt, model_config.json, meta.json)
    s3://bucket/prefix            such a directory on S3, downloaded once
    /path/to/checkpoints[/step_N] a training checkpoint (the newest valid one under a root);
                                  LoRA adapters in it are merged into the weights
    models:/<name>@<alias>        a registered model version by alias (e.g. @champion),
    models:/<name>/<version>      or by number,
    models:/m-<id>                or a logged model: logged with the transformers flavor (its
                                  model/ and components/tokenizer/ artifacts), or by the stages
                                  before it (the model directory as extra_files); downloaded
                                  through MLflow, so this works on any backend

The result is always a directory export.load_model reads; its meta.json records what it was
resolved from, which becomes the parent in the new model's lineage.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tasks.common.hf_dir import CONFIG, config_problem, files_problem
from tasks.common.io import read_json, write_json
from tasks.common.uris import split_s3

log = logging.getLogger(__name__)

LORA_A, LORA_B, BASE = ".lora_A.default.weight", ".lora_B.default.weight", ".base_layer."


def resolve_model_dir(ref: str, work_dir: str | Path) -> Path:
    """A local model directory for `ref` (see the module docstring). Downloads and conversions go
    under work_dir and are reused when a retried job asks again."""
    ref = str(ref)
    if ref.startswith("models:/"):
        return _from_registry(ref, Path(work_dir))
    if ref.startswith("s3://"):
        return _from_s3(ref, Path(work_dir))
    path = Path(ref)
    if (path / "model_int8.pt").is_file():  # distill's int8 copy (tasks/posttrain/quantize.py)
        return path
    legacy = (path / "model.pt").is_file() and (path / "model_config.json").is_file()
    # a checkpoint (step_N/) has a config.json too, the stage's, and a manifest beside it
    if not (path / "manifest.json").is_file() and ((path / CONFIG).is_file() or legacy):
        problem = model_dir_problem(path)
        if problem:
            raise ValueError(f"{ref} is not a usable model directory: {problem}.")
        return path
    if path.is_dir():
        return _from_checkpoint(path, Path(work_dir))
    raise FileNotFoundError(
        f"{ref!r} is neither a model directory (with config.json), a checkpoint directory, an "
        "s3://bucket/prefix holding a model directory, nor an MLflow model URI "
        "(models:/<name>@<alias>, models:/<name>/<version>, models:/m-<id>).")


def model_dir_problem(path: Path) -> str | None:
    """Why a local directory is not a causal LM with its tokenizer (None when it is one)."""
    if (path / "model.pt").is_file() and (path / "model_config.json").is_file():
        return None  # the format before Hugging Face directories
    problem = files_problem({p.name for p in path.iterdir()})
    if problem is None:
        problem = config_problem(read_json(path / CONFIG))
    return problem


# -- S3 -------------------------------------------------------------------------------------------


def _from_s3(uri: str, work_dir: Path) -> Path:
    """Every object under the prefix, downloaded into work_dir/s3-<hash of the URI>/ (assembled
    beside it and renamed in, so a retry reuses a complete copy)."""
    import hashlib

    from tasks.common.io import publish_dir
    from tasks.data.readers import s3_client

    uri = uri.rstrip("/")  # one prefix, however it is written
    target = work_dir / f"s3-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
    if (target / CONFIG).is_file():
        log.info("%s: using the copy already downloaded to %s", uri, target)
        return target
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    client = s3_client()
    tmp = work_dir / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        count = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if not rel or rel.endswith("/") or ".." in rel.split("/"):
                    continue
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(tmp / rel))
                count += 1
        if not count:
            raise FileNotFoundError(f"{uri} holds no objects: give the s3:// prefix of a model "
                                    "directory (config.json, *.safetensors, tokenizer.json).")
        problem = model_dir_problem(tmp)
        if problem:
            raise ValueError(f"{uri} is not a usable model directory: {problem}.")
        write_json(tmp / "meta.json", {**_meta_or_none(tmp), "resolved_from": uri})
        publish_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("%s -> %s (%d files)", uri, target, count)
    return target


def _meta_or_none(path: Path) -> dict[str, Any]:
    return read_json(path / "meta.json") if (path / "meta.json").is_file() else {"stage": "external"}


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
    root = logged.artifact_location.rstrip("/")
    tmp = work_dir / f".{model_id}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        local, meta = _download_logged(uri, model_id, root, tmp)
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


def _download_logged(uri: str, model_id: str, root: str, tmp: Path) -> tuple[Path, dict]:
    """A logged model's files as one model directory under tmp, and its meta: the transformers
    flavor's weights (model/) and tokenizer (components/tokenizer/) with meta.json from the
    MLmodel metadata, or (logged before the Hugging Face format) the extra_files directory."""
    import mlflow
    from mlflow.models import Model

    from tasks.train.export import META_KEY

    download = lambda path: Path(mlflow.artifacts.download_artifacts(  # noqa: E731
        artifact_uri=f"{root}/{path}", dst_path=str(tmp)))
    mlmodel = Model.load(str(download("MLmodel")))
    flavor = mlmodel.flavors.get("transformers")
    if flavor is not None:
        binary = flavor.get("model_binary") or "model"
        try:
            local = download(binary)
        except Exception as exc:  # noqa: BLE001 - MLflow raises several kinds for a missing path
            raise FileNotFoundError(
                f"{uri} (logged model {model_id}) holds no weights ({binary}/): it was logged "
                "with save_pretrained=False, a reference to the Hugging Face Hub, which jobs "
                "cannot download. Log it with save_pretrained=True.") from exc
        if "tokenizer" in flavor.get("components", []):
            for f in download("components/tokenizer").iterdir():
                shutil.copyfile(f, local / f.name)
        return local, dict((mlmodel.metadata or {}).get(META_KEY) or {"stage": "external"})
    try:
        local = download("extra_files")
    except Exception as exc:  # noqa: BLE001
        raise FileNotFoundError(
            f"{uri} (logged model {model_id}) is neither a transformers model nor a model logged "
            "with its model directory (extra_files/); register a model the stages logged, or "
            "log yours with mlflow.transformers.log_model.") from exc
    return local, read_json(local / "meta.json")


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


def vocab_and_context(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, context length) of a model directory, from its config alone."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").is_file():
        from types import SimpleNamespace

        from tasks.model.causal_lm import context_length

        config = read_json(model_dir / "config.json")
        return config["vocab_size"], context_length(SimpleNamespace(**config))
    config = read_json(model_dir / "model_config.json")  # the format before HF directories
    return config["vocab_size"], config["block_size"]


def student_config(student, teacher_dir: Path):
    """cfg.student with the teacher's vocabulary and context (capped at what ModelConfig allows:
    a long-context RoPE teacher does not need a GPT student with 128k learned positions)."""
    vocab, block = vocab_and_context(teacher_dir)
    return dataclasses.replace(student, vocab_size=vocab, block_size=min(block, 1 << 16))


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
    model.pt (LoRA merged) into the architecture that trained them (the pretraining or student
    ModelConfig saved beside them, or the fine-tuned base model's), tokenizer from that stage's
    data or parent model."""
    from tasks.model.causal_lm import build_model
    from tasks.configs import ModelConfig, from_dict
    from tasks.train import checkpoint as ckpt
    from tasks.train.prepared_data import DataDir
    from tasks.train.export import load_model, read_meta

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
        stage, arch = "pretrain", from_dict(ModelConfig, config["model"])
        tokenizer = DataDir(config["data_dir"]).tokenizer_path
        model = build_model(_gpt_sizes(arch, weights))
    elif "student" in config:  # distillation
        teacher_dir = resolve_model_dir(config["teacher_model"], work_dir)
        stage, tokenizer, parent = "distill", teacher_dir / "tokenizer.json", read_meta(teacher_dir)
        if config.get("student_model"):
            model, _ = load_model(resolve_model_dir(config["student_model"], work_dir))
        else:
            arch = student_config(from_dict(ModelConfig, config["student"]), teacher_dir)
            model = build_model(_gpt_sizes(arch, weights))
    elif "base_model" in config:  # fine-tuning
        base_dir = resolve_model_dir(config["base_model"], work_dir)
        stage, tokenizer, parent = "finetune", base_dir / "tokenizer.json", read_meta(base_dir)
        model, _ = load_model(base_dir)  # the base's architecture; the checkpoint's weights
    else:
        raise ValueError(f"{chosen}/config.json is not a pretrain, finetune or distill config.")
    model.load_state_dict(weights)
    meta = {"stage": f"{stage}-checkpoint", "step": state["step"], "source_checkpoint": str(chosen),
            "data_content_hash": parent.get("data_content_hash"), "run_id": None,
            "parent_run_id": parent.get("run_id"), "parent_model_uri": parent.get("model_uri"),
            "resolved_from": str(path)}
    return _export_to(model, target, tokenizer, meta, DataDir(config["data_dir"]).eos_id)


def _gpt_sizes(arch, weights: dict[str, torch.Tensor]):
    """A GPT's sizes as its weights fix them (vocab, width, context, depth); n_head and dropout
    come from the config. Other architectures are built as configured."""
    if arch.arch != "gpt":
        return arch
    return dataclasses.replace(
        arch, vocab_size=weights["transformer.wte.weight"].shape[0],
        n_embd=weights["transformer.wte.weight"].shape[1],
        block_size=weights["transformer.wpe.weight"].shape[0],
        n_layer=len({k.split(".")[2] for k in weights if k.startswith("transformer.h.")}))


def _export_to(model, target: Path, tokenizer: Path, meta: dict[str, Any], eos_id: int) -> Path:
    """export_model writes <dir>/model; move that to `target` (both atomic renames)."""
    from tasks.train.export import export_model

    staging = target.parent / f".{target.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    written = export_model(model, staging, tokenizer, meta, eos_id=eos_id)
    os.replace(written, target)
    shutil.rmtree(staging, ignore_errors=True)
    return target
