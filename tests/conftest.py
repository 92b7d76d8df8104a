"""Shared fixtures. Tests never write MLflow data into the repo, and the prepared tiny data set
is built once per session for every stage's tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Set at import, before any test imports mlflow: MLflow's default would put mlflow.db in the cwd.
if not os.environ.get("MLFLOW_TRACKING_URI"):
    _mlflow_dir = tempfile.mkdtemp(prefix="llmops-test-mlflow-")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_mlflow_dir}/mlflow.db"


@pytest.fixture(autouse=True)
def _own_shared_reads():
    """A test's triggers share reads among themselves only (llmops.jobs.backends.shared keeps
    them per process): values read in one test never answer another's."""
    yield
    from llmops.jobs.backends import shared

    shared.clear()


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


@pytest.fixture(scope="session")
def prose_documents() -> list[str]:
    """Realistic multi-paragraph prose that passes the quality filters: the demo documents."""
    from tasks.data.corpus import demo_documents

    return demo_documents()


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch):
    """A local S3 (moto_server on 127.0.0.1, a free port) and a boto3 client for it. Every boto3
    client made during the test talks to it through AWS_ENDPOINT_URL; never to real AWS."""
    import boto3

    server = Path(sys.executable).parent / "moto_server"
    if not server.exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        deadline = time.time() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.05)
        from tasks.data.readers import s3_client

        s3_client.cache_clear()  # a client cached by an earlier test points elsewhere
        yield boto3.client("s3")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        from tasks.data.readers import s3_client

        s3_client.cache_clear()


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's model as transformers saves one: a tiny random-initialised LlamaForCausalLM
    (RoPE, RMSNorm, SwiGLU, 4 query heads sharing 2 key/value heads; built from its config, no
    download) and the tiny data's BPE as a PreTrainedTokenizerFast, via save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(out)
    eos = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_file=str(tiny_data_dir / "tokenizer.json"), eos_token=eos,
                            bos_token=eos, pad_token=eos).save_pretrained(out)
    return out


# -- two test processes on two cores (pytest-xdist, `make test`) ------------------------------
# Many tests wait on a subprocess (an Airflow DAG run, a job, a browser) with one core idle, so
# `make test` runs two workers. Each test module is one unit of work (its module-scoped fixtures
# are built once), except that modules sharing a session-scoped DAG run share a worker (the run is
# made once). The slowest modules are handed out first (make test passes --no-loadscope-reorder,
# so xdist keeps this order), so that no worker is left with a long one while the other idles.
SHARED_RUN_GROUPS = {
    "test_lifecycle_e2e": "tiny_lifecycle_run",
    "test_lifecycle_reuse": "tiny_lifecycle_run",
    "test_lifecycle_gate": "tiny_lifecycle_run",
    "test_pause_resume_dag": "tiny_lifecycle_run",   # make test-slow: one tiny run for both
}
# Slow modules whose cases share only cheap fixtures (a fake AWS, one reference run): each case
# is a unit of its own, so `make test-slow`'s two workers split them (as one group, the eight
# node-loss cases ran one after another on one worker while the other idled).
SPREAD_CASES = {"test_node_loss_every_stage", "test_multiweek"}
SLOWEST_FIRST = [  # by their seconds on 2 cores (--durations), the slowest first
    # test-slow: the gate's DAG test before the pause/resume one, while the session's first
    # tiny run is still the champion it is compared with
    "test_lifecycle_gate", "test_pause_resume_dag",
    "test_lifecycle_e2e", "test_lifecycle_reuse", "test_browser",
    "test_post_training", "test_lifecycle_hf", "test_multinode_no_shared_disk",
    "test_backend_sagemaker_lifecycle",
    "test_resilience", "test_pause", "test_pause_ui", "test_fork", "test_run_failure", "test_mwaa",
    "test_notify",
    "test_training_scale", "test_streaming", "test_retrain", "test_training", "test_links",
    "test_sweep_dag",
    "test_processing_two_phase", "test_jobs", "test_secrets", "test_start_run_validation",
    "test_fake_aws", "test_data_prep", "test_hf_models", "test_eval",
]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    def module(item) -> str:
        return item.path.stem

    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(module(item), len(rank)))  # stable: file order kept
    for item in items:
        group = item.nodeid if module(item) in SPREAD_CASES else module(item)
        item.add_marker(pytest.mark.xdist_group(SHARED_RUN_GROUPS.get(module(item), group)))
