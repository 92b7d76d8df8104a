"""Shared fixtures. Tests never write MLflow data into the repo, and the prepared tiny data set
is built once per session for every stage's tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Set at import, before any test imports mlflow: MLflow's default would put mlflow.db in the cwd.
if not os.environ.get("MLFLOW_TRACKING_URI"):
    _mlflow_dir = tempfile.mkdtemp(prefix="llmops-test-mlflow-")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_mlflow_dir}/mlflow.db"


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output dir of the real data prep on the tiny recipe (demo corpus and demo SFT task):
    manifest.json, tokenizer.json, tokens/{train,val}_*.bin, sft/{train,eval}.jsonl."""
    from tasks.configs import tiny
    from tasks.data.prep import prepare

    config = tiny().data
    config.output_dir = str(tmp_path_factory.mktemp("tiny_data"))
    config.engine = "local"
    prepare(config)
    return Path(config.output_dir)
