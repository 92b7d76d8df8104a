"""The model directory a training stage hands to the next one, and its MLflow logged model.

    <output_dir>/model/
        model.pt            state_dict (loads with weights_only=True)
        model_config.json   the ModelConfig to rebuild the GPT
        tokenizer.json      the tokenizer it was trained with (copied from the data dir)
        meta.json           lineage: stage, step, data content hash, source checkpoint, parent
                            model and run, and the MLflow model URI; written last

The directory is assembled beside its final place and renamed in, so a consumer sees either the
previous complete model or the new complete one.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from tasks.common.io import publish_dir, read_json, write_json
from tasks.configs import ModelConfig, from_dict, to_dict
from tasks.model import GPT

log = logging.getLogger(__name__)

MODEL_DIR = "model"


def export_model(model: GPT, output_dir: str | Path, tokenizer_path: str | Path,
                 meta: dict[str, Any]) -> Path:
    """Write output_dir/model/ atomically and return its path."""
    output_dir = Path(output_dir)
    final = output_dir / MODEL_DIR
    tmp = output_dir / f".{MODEL_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        with open(tmp / "model.pt", "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        write_json(tmp / "model_config.json", to_dict(model.config))
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        write_json(tmp / "meta.json", {**meta, "params": model.num_params()})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, final)


def read_meta(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {model_dir} is not a finished model "
                                "directory (a training stage writes meta.json last).")
    return read_json(path)


def load_model(model_dir: str | Path, device: str | torch.device = "cpu"
               ) -> tuple[GPT, dict[str, Any]]:
    """Rebuild the GPT of a model directory; weights_only, so loading runs no code from it."""
    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    config = from_dict(ModelConfig, read_json(model_dir / "model_config.json"))
    model = GPT(config)
    state = torch.load(model_dir / "model.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.to(device), meta


class _LogitsOnly(nn.Module):
    """What a served model computes: token ids (B, T) -> next-token logits (B, T, vocab)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]


def log_mlflow_model(model: GPT, lineage: dict[str, Any], example: torch.Tensor,
                     model_dir: str | Path | None = None) -> str:
    """Log the model to the active MLflow run and return its model URI (models:/<id>).

    With model_dir, its files (model.pt, model_config.json, tokenizer.json, meta.json) travel
    with the MLflow model as extra_files: a registered version can then be fine-tuned or
    evaluated again from the registry alone (tasks/posttrain/sources.py downloads them).

    MLflow 3 saves PyTorch models as torch.export programs (pt2): a traced graph, loadable
    without our source code and without unpickling. Tracing needs an example input; the
    signature marks batch and sequence length as free. The tensors stay unnamed: a named input
    reaches the PyTorch pyfunc as a dict, which it refuses when serving. Explicit
    pip_requirements skip MLflow's requirement inference (~10 s of import scanning).
    """
    import mlflow
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    # trace a float32 CPU copy: the exported graph must not depend on where training ran
    served = _LogitsOnly(copy.deepcopy(model).float().cpu()).eval()
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.int64), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1, model.config.vocab_size))]))
    tags = {k: str(v) for k, v in lineage.items() if v not in (None, "")}
    info = mlflow.pytorch.log_model(
        served, name=MODEL_DIR, signature=signature,
        # contiguous: the exported graph guards on the example's strides, and a sliced example
        # would make every ordinary (contiguous) input fail that guard when served
        input_example=example.detach().cpu().to(torch.int64).contiguous().numpy(),
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                          f"mlflow=={mlflow.__version__}", "numpy"],
        extra_files=sorted(str(p) for p in Path(model_dir).iterdir()) if model_dir else None,
        params={"params": model.num_params(),
                **{f"model.{k}": v for k, v in to_dict(model.config).items()}},
        tags=tags)
    # the same lineage on the run, where the UI's run page and searches see it
    mlflow.set_tags({f"lineage.{k}": v for k, v in tags.items()})
    log.info("logged model %s", info.model_uri)
    return info.model_uri


def publish_model(model: GPT, output_dir: str | Path, *, stage: str, step: int, data_hash: str,
                  tokenizer_path: str | Path, source_checkpoint: str, example: torch.Tensor,
                  parent_model_dir: str | None = None, parent: dict[str, Any] | None = None,
                  extra_lineage: dict[str, Any] | None = None) -> tuple[Path, str]:
    """Log the final model to the active MLflow run, then write output_dir/model/ with the
    resulting model URI in meta.json. Returns (model_dir, model_uri). extra_lineage adds keys
    (e.g. the SFT files' hash, the registered version fine-tuned from) to the lineage."""
    import tempfile

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
    # the model directory, staged for MLflow before its URI exists (meta.json there lacks it;
    # sources.py adds it back on download)
    with tempfile.TemporaryDirectory(prefix="model-files-") as staging:
        staged = export_model(model, staging, tokenizer_path, lineage)
        model_uri = log_mlflow_model(model, lineage, example, model_dir=staged)
    model_dir = export_model(model, output_dir, tokenizer_path, {**lineage, "model_uri": model_uri})
    return model_dir, model_uri
