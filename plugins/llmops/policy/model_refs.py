"""Models a run names (the `base_model` and `student_model` Params), checked before any job starts.

A reference is a Hugging Face causal-LM directory (local, under the allowed data roots, like every
data path), an s3:// prefix holding one (also under the allowed roots), or a registered MLflow
model (models:/<name>@<alias>, models:/<name>/<version>). Checked from the files alone, with no
torch or transformers (MWAA): it exists; config.json names a causal-LM architecture transformers
implements (no remote code); the weights are safetensors; a fast tokenizer (tokenizer.json) is
there. Two models that must share a tokenizer (a distillation's teacher and student) are
compared by what turns text into ids (tasks/common/hf_dir.py), and a refusal names both.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from llmops.core import paths, settings
from llmops.core.paths import LifecycleParamError
from llmops.infra import step_cache, tracking
from llmops.infra.aws import s3
from tasks.common import hf_dir

HINT = ("Give a Hugging Face model directory (config.json, *.safetensors, tokenizer.json: what "
        "save_pretrained writes), an s3://bucket/prefix holding one, or a registered model "
        "(models:/<name>@<alias>, models:/<name>/<version>).")


@dataclass
class ModelFiles:
    """What start_run needs of a checked model: its config, its tokenizer.json, and where a job
    (data prep) can read that tokenizer: a local path or s3:// URI, or None."""

    ref: str
    config: dict[str, Any]
    tokenizer: bytes
    tokenizer_uri: str | None
    pinned: str = ""  # a registered model by version number (an alias moves; a version does not)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (its vocabulary and added tokens)."""
        spec = json.loads(self.tokenizer)
        ids = list((spec.get("model") or {}).get("vocab", {}).values())
        ids += [t.get("id", 0) for t in spec.get("added_tokens") or []]
        return max([int(i) for i in ids if isinstance(i, int)] or [0]) + 1


def _error(name: str, value: str, problem: str) -> Exception:
    return LifecycleParamError(f"Param '{name}': {value!r} {problem}. {HINT} Nothing was started.")


def check_model(name: str, value: Any) -> ModelFiles:
    """Refuse a model reference that no job could load, naming the Param and the fix."""
    value = paths.safe_text(name, value)
    if value.startswith("models:/"):
        return _registered(name, value)
    paths.check_data_path(name, value)  # local or s3, inside the allowed roots
    if value.startswith("s3://"):
        return _on_s3(name, value)
    return _local(name, value)


def _checked(name: str, value: str, names: set[str], read: Any, tokenizer_uri: str | None
             ) -> ModelFiles:
    problem = hf_dir.files_problem(names)
    if problem:
        raise _error(name, value, f"is not a model directory: {problem}")
    try:
        config = json.loads(read(hf_dir.CONFIG))
    except ValueError as exc:
        raise _error(name, value, f"has a config.json that is not JSON ({exc})") from None
    problem = hf_dir.config_problem(config)
    if problem:
        raise _error(name, value, f"is not a causal language model: {problem}")
    tokenizer = read(hf_dir.TOKENIZER)
    try:
        spec = json.loads(tokenizer)
        declared = (hf_dir.eos_token(json.loads(read(hf_dir.TOKENIZER_CONFIG)))
                    if hf_dir.TOKENIZER_CONFIG in names else None)
    except ValueError as exc:
        raise _error(name, value, f"has a tokenizer file that is not JSON ({exc})") from None
    check_end_of_text(name, value, spec, declared)
    return ModelFiles(value, config, tokenizer, tokenizer_uri)


def check_end_of_text(name: str, value: str, spec: dict[str, Any], declared: str | None) -> None:
    """Data prep separates documents (and ends completions) with <|endoftext|>, or with the
    eos_token tokenizer_config.json declares: the tokenizer must have one of them."""
    tokens = set((spec.get("model") or {}).get("vocab") or {})
    tokens |= {t.get("content") for t in spec.get("added_tokens") or []}
    if "<|endoftext|>" not in tokens and declared not in tokens:
        raise _error(name, value, "has a tokenizer with no end-of-text token (neither "
                                  "<|endoftext|> nor the eos_token of a tokenizer_config.json)")


def _local(name: str, value: str) -> ModelFiles:
    if not os.path.isdir(value):
        raise _error(name, value, "is not a directory on this machine")
    read = lambda f: open(os.path.join(value, f), "rb").read()  # noqa: E731
    return _checked(name, value, set(os.listdir(value)), read,
                    os.path.join(value, hf_dir.TOKENIZER))


def _on_s3(name: str, value: str) -> ModelFiles:
    hook = s3.s3_hook(settings.aws_conn_id())
    bucket, prefix = s3.split_s3(value.rstrip("/") + "/")
    try:
        keys = hook.list_keys(bucket_name=bucket, prefix=prefix) or []
    except Exception as exc:  # noqa: BLE001 - credentials, a missing bucket, the network
        raise _error(name, value, f"could not be listed ({exc})") from None
    names = {k[len(prefix):] for k in keys if "/" not in k[len(prefix):]}
    read = lambda f: hook.read_key(prefix + f, bucket_name=bucket).encode()  # noqa: E731
    return _checked(name, value, names, read, s3.join(value, hf_dir.TOKENIZER))


def _registered(name: str, value: str) -> ModelFiles:
    """A registered version's logged model: the transformers flavor's model/ and
    components/tokenizer/ artifacts, or the model directory the stages logged before it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    body = value[len("models:/"):].strip("/")
    client = tracking.client()
    try:
        if "@" in body:
            model, alias = body.split("@", 1)
            version = client.get_model_version_by_alias(model, alias)
        elif "/" in body:
            model, number = body.split("/", 1)
            version = client.get_model_version(model, number)
        else:
            raise _error(name, value, "names no version: add @<alias> or /<version>")
        model_id = version.model_id or str(version.source).removeprefix("models:/")
        root = client.get_logged_model(model_id).artifact_location.rstrip("/")
    except MlflowException as exc:
        raise _error(name, value, f"is not in the model registry ({exc.message})") from None
    with tempfile.TemporaryDirectory(prefix="model-ref-") as scratch:
        def fetch(path: str) -> bytes | None:
            try:
                local = mlflow.artifacts.download_artifacts(artifact_uri=f"{root}/{path}",
                                                            dst_path=scratch)
            except Exception:  # noqa: BLE001 - MLflow raises several kinds for a missing file
                return None
            with open(local, "rb") as fh:
                return fh.read()

        config, tokenizer_path = fetch(f"model/{hf_dir.CONFIG}"), f"components/tokenizer/{hf_dir.TOKENIZER}"
        if config is None:  # logged by the stages before the transformers flavor: extra_files/
            tokenizer_path = f"extra_files/{hf_dir.TOKENIZER}"
        tokenizer = fetch(tokenizer_path)
        if tokenizer is None:
            raise _error(name, value, f"(logged model {model_id}) holds neither model/config.json "
                                      "with components/tokenizer/ (the transformers flavor) nor "
                                      "extra_files/ with a tokenizer.json")
    parsed = json.loads(config) if config is not None else {}
    problem = hf_dir.config_problem(parsed) if config is not None else None
    if problem:
        raise _error(name, value, f"is not a causal language model: {problem}")
    # data prep reads a tokenizer from a local path or S3, not through MLflow
    where = f"{root}/{tokenizer_path}".removeprefix("file://")
    readable = where.startswith("s3://") or os.path.isabs(where)
    return ModelFiles(value, parsed, tokenizer, where if readable else None,
                      pinned=f"models:/{version.name}/{version.version}")


def check_same_tokenizer(a_name: str, a: ModelFiles, b_name: str, b: ModelFiles) -> None:
    if not hf_dir.same_tokenizer(a.tokenizer, b.tokenizer):
        raise LifecycleParamError(
            f"Params '{a_name}' ({a.ref}) and '{b_name}' ({b.ref}) have different tokenizers: "
            "distillation matches the teacher's and the student's token distributions id by id. "
            f"Pick a {b_name} with the {a_name}'s tokenizer, or leave '{b_name}' empty to build "
            "the student from student_n_layer / student_n_embd. Nothing was started.")


def check_run_models(params: dict[str, Any], cfg: Any) -> str | None:
    """A lifecycle run's `base_model` (fine-tuning starts from it; no sweep, no pretraining) and
    `student_model` (distillation starts the student from it): each checked, their tokenizers
    compared, and the run's data prepared with that tokenizer (so replayed rows and SFT examples
    are in the model's ids). A registered model is pinned by version, as the champion is, so
    every try of the run's jobs gets the same one. Returns the base model reference, or None."""
    base = check_model("base_model", params["base_model"]) if params.get("base_model") else None
    student = (check_model("student_model", cfg.distill.student_model)
               if cfg.distill.student_model else None)
    if student is not None and student.pinned:
        cfg.distill.student_model = student.pinned
    if base is not None and student is not None:
        check_same_tokenizer("base_model", base, "student_model", student)
    source = base or student
    if source is None:
        return None
    name = "base_model" if base is not None else "student_model"
    if source.tokenizer_uri is None:
        raise LifecycleParamError(
            f"Param '{name}': {source.ref!r} is in an MLflow artifact store that data prep cannot "
            "read (neither a local path nor s3://); give the model's directory or S3 prefix "
            "instead. Nothing was started.")
    cfg.data.tokenizer_path = source.tokenizer_uri
    # the vocabulary is the model's: data prep trains no tokenizer, models built here match it
    for model in (cfg.pretrain.model, cfg.distill.student):
        model.vocab_size = max(source.vocab_size, int(source.config.get("vocab_size") or 0))
    if base is None:
        return None
    return base.pinned or base.ref


def content_hash(ref: str) -> str:
    """What the step cache knows a model reference's content by: a pinned registered version is
    immutable (its URI), a directory or S3 prefix is hashed file by file (ETags on S3)."""
    import hashlib

    if ref.startswith("models:/"):
        return hashlib.sha256(ref.encode()).hexdigest()
    return step_cache.raw_inputs_hash([ref])
