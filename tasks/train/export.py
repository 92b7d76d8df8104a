"""The model directory a training stage hands to the next one, and its MLflow logged model.

    <output_dir>/model/        a Hugging Face causal-LM directory:
        config.json, model.safetensors, generation_config.json
                               AutoModelForCausalLM.from_pretrained loads and generates with it
                               (our GPT is saved as the GPT-2 it is exactly:
                               tasks/model/causal_lm.py)
        tokenizer.json, tokenizer_config.json
                               AutoTokenizer loads it as a PreTrainedTokenizerFast; tokenizer.json
                               is byte for byte the file the data was prepared with (stages check
                               its sha256 against the data manifest)
        README.md              a model card: what it is, how to load it, its lineage
        meta.json              lineage: stage, step, data content hash, source checkpoint, parent
                               model and run, and the MLflow model URI; written last

The directory is assembled beside its final place and renamed in, so a consumer sees either the
previous complete model or the new complete one. MLflow gets the same model with the transformers
flavor (text generation), so `mlflow.pyfunc.load_model(uri).predict(["..."])` returns text and
`mlflow models serve` serves it; meta.json travels in the MLmodel file's metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from tasks.common.io import publish_dir, read_json, write_json

log = logging.getLogger(__name__)

MODEL_DIR = "model"
META_KEY = "llmops"  # the MLmodel metadata key holding meta.json
# what a Hugging Face tokenizer directory may hold; copied as they are from a parent model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
# served generations: the completion without the prompt; greedy and short unless predict's params
# ask otherwise (the signature declares them)
SERVING_PARAMS = {"max_new_tokens": 64, "do_sample": False, "temperature": 1.0}


def write_tokenizer(tokenizer_path: str | Path, out_dir: Path, eos_id: int, block_size: int) -> None:
    """Tokenizer files for a Hugging Face directory: a parent model's as they are (beside its
    tokenizer.json), or a PreTrainedTokenizerFast around the project's trained BPE."""
    tokenizer_path = Path(tokenizer_path)
    source = tokenizer_path.parent
    if (source / "tokenizer_config.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out_dir / name)
        return
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    eos = Tokenizer.from_file(str(tokenizer_path)).id_to_token(eos_id)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), eos_token=eos,
                                   bos_token=eos, pad_token=eos, model_max_length=block_size)
    fast.save_pretrained(str(out_dir))
    # the exact bytes the data manifest hashes (save_pretrained re-serializes the JSON)
    shutil.copyfile(tokenizer_path, out_dir / "tokenizer.json")
    config_path = out_dir / "tokenizer_config.json"
    config = read_json(config_path)
    # transformers 5 writes its new name for the class; older readers (vLLM, TGI on 4.x) know
    # only PreTrainedTokenizerFast, which 5.x still resolves to the same class
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(config_path, config)


def model_card(meta: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in meta.items() if v not in (None, ""))
    return ("---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [llmops]\n---\n"
            f"# llmops {meta.get('stage', 'model')} model\n\n"
            "A causal language model written by the llmops pipeline.\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(path)\n"
            "tokenizer = AutoTokenizer.from_pretrained(path)\n```\n\n"
            f"## Lineage\n\n| key | value |\n|---|---|\n{rows}\n")


def _assemble(model: nn.Module, tmp: Path, tokenizer_path: str | Path, meta: dict[str, Any],
              eos_id: int) -> None:
    from transformers import GenerationConfig

    from tasks.model.causal_lm import to_transformers

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = to_transformers(model)
    hf.config.eos_token_id = hf.config.pad_token_id = eos_id
    if hf.config.bos_token_id is None:
        hf.config.bos_token_id = eos_id
    hf.generation_config = GenerationConfig(bos_token_id=hf.config.bos_token_id,
                                            eos_token_id=eos_id, pad_token_id=eos_id,
                                            do_sample=False)
    hf.save_pretrained(str(tmp))  # safetensors
    write_tokenizer(tokenizer_path, tmp, eos_id, model.config.block_size)
    meta["content_sha256"] = content_sha256(tmp)   # into the caller's lineage: tags, registry
    _write_meta(tmp, {**meta, "params": model.num_params(), "architecture": type(hf).__name__})


def content_sha256(model_dir: Path) -> str:
    """What makes two published models the same model: their weights and tokenizer, byte for
    byte (safetensors files are deterministic for equal tensors). The registry keys on it, so the
    same weights are never registered twice."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")) + [model_dir / "tokenizer.json"]:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _write_meta(model_dir: Path, meta: dict[str, Any]) -> None:
    (model_dir / "README.md").write_text(model_card(meta))
    write_json(model_dir / "meta.json", meta)


def export_model(model: nn.Module, output_dir: str | Path, tokenizer_path: str | Path,
                 meta: dict[str, Any], *, eos_id: int) -> Path:
    """Write output_dir/model/ (a Hugging Face directory, see the module docstring) atomically
    and return its path. eos_id: the token the model was trained to end a completion with."""
    output_dir = Path(output_dir)
    tmp = output_dir / f".{MODEL_DIR}.tmp-{os.getpid()}"
    try:
        _assemble(model, tmp, tokenizer_path, meta, eos_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, output_dir / MODEL_DIR)


def published(model_dir: str | Path, model_uri: str) -> dict[str, str]:
    """What a training stage's result says of the model it published: its MLflow model URI and
    the hash of its weights and tokenizer (evaluation and the registry key on it)."""
    return {"model_uri": model_uri, "content_sha256": read_meta(model_dir)["content_sha256"]}


def read_meta(model_dir: str | Path) -> dict[str, Any]:
    """meta.json of a stage's model directory; a Hugging Face directory from elsewhere (no
    meta.json) has only where it came from."""
    model_dir = Path(model_dir)
    if (model_dir / "meta.json").exists():
        return read_json(model_dir / "meta.json")
    if (model_dir / "config.json").exists():
        return {"stage": "external", "model_dir": str(model_dir)}
    raise FileNotFoundError(f"{model_dir} is not a model directory: it has neither config.json "
                            "(a Hugging Face model) nor meta.json.")


def load_model(model_dir: str | Path, device: str | torch.device = "cpu"
               ) -> tuple[nn.Module, dict[str, Any]]:
    """The model of a directory (our GPT when it is one, else a transformers model: see
    tasks/model/causal_lm.py) and its meta. Weights from safetensors, or with weights_only for the
    model.pt of directories written before the Hugging Face format."""
    from tasks.model.causal_lm import from_pretrained

    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    if (model_dir / "model.pt").is_file() and (model_dir / "model_config.json").is_file():
        from tasks.configs import ModelConfig, from_dict
        from tasks.model.gpt import GPT

        model = GPT(from_dict(ModelConfig, read_json(model_dir / "model_config.json")))
        model.load_state_dict(torch.load(model_dir / "model.pt", map_location="cpu",
                                         weights_only=True))
        return model.to(device), meta
    return from_pretrained(model_dir, device), meta


def model_params(model: nn.Module) -> dict[str, Any]:
    """The MLflow params of a logged model: its size and shape."""
    from dataclasses import asdict

    return {"params": model.num_params(), **{f"model.{k}": v for k, v in asdict(model.config).items()}}


def log_mlflow_model(model_dir: str | Path, lineage: dict[str, Any], params: dict[str, Any]) -> str:
    """Log a model directory to the active MLflow run with the transformers flavor (task
    text-generation) and return its model URI (models:/<id>). The lineage goes on the logged
    model's tags and the run's (lineage.<key>), meta.json into the MLmodel metadata. Explicit
    pip_requirements skip MLflow's requirement inference (~10 s of import scanning); the model
    card is ours, so nothing asks the Hub for one."""
    import mlflow
    import transformers
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlflow.models import infer_signature

    from tasks.model.causal_lm import context_length

    model_dir = Path(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    tags = {k: str(v) for k, v in lineage.items() if v not in (None, "")}
    # a small model's context can be shorter than the default answer: keep prompt room
    defaults = {**SERVING_PARAMS, "max_new_tokens": min(SERVING_PARAMS["max_new_tokens"],
                                                        max(1, context_length(hf.config) // 4))}
    info = mlflow.transformers.log_model(
        {"model": hf, "tokenizer": tokenizer}, name=MODEL_DIR, task="text-generation",
        model_card=ModelCard((model_dir / "README.md").read_text()),
        model_config={**defaults, "return_full_text": False},
        signature=infer_signature(["a prompt"], ["its completion"], params=defaults),
        metadata={META_KEY: json.loads((model_dir / "meta.json").read_text())},
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                          f"transformers=={transformers.__version__}",
                          f"mlflow=={mlflow.__version__}", "numpy"],
        params=params, tags=tags)
    # the same lineage on the run, where the UI's run page and searches see it
    mlflow.set_tags({f"lineage.{k}": v for k, v in tags.items()})
    log.info("logged model %s", info.model_uri)
    return info.model_uri


def publish_model(model: nn.Module, output_dir: str | Path, *, stage: str, step: int,
                  data_hash: str, tokenizer_path: str | Path, source_checkpoint: str, eos_id: int,
                  parent_model_dir: str | None = None, parent: dict[str, Any] | None = None,
                  extra_lineage: dict[str, Any] | None = None) -> tuple[Path, str]:
    """Log the final model to the active MLflow run, then write output_dir/model/ with the
    resulting model URI in meta.json. Returns (model_dir, model_uri). extra_lineage adds keys
    (e.g. the SFT files' hash, the registered version fine-tuned from) to the lineage."""
    import mlflow

    parent = parent or {}
    lineage = {
        "stage": stage,
        "step": step,
        "data_content_hash": data_hash,
        "source_checkpoint": source_checkpoint,
        "parent_model_dir": parent_model_dir,
        "parent_run_id": parent.get("run_id"),
        "parent_model_uri": parent.get("model_uri"),
        "run_id": mlflow.active_run().info.run_id,
        **(extra_lineage or {}),
    }
    # assembled beside its final place, logged to MLflow, then published with the model URI in
    # meta.json: the weights are written once
    output_dir = Path(output_dir)
    tmp = output_dir / f".{MODEL_DIR}.tmp-{os.getpid()}"
    try:
        _assemble(model, tmp, tokenizer_path, lineage, eos_id)
        model_uri = log_mlflow_model(tmp, lineage, model_params(model))
        _write_meta(tmp, {**read_json(tmp / "meta.json"), "model_uri": model_uri})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, output_dir / MODEL_DIR), model_uri
