"""A user's Hugging Face model through the lifecycle DAG (issue 13), one `airflow dags test` run
on the tiny recipe: a tiny random Llama named as `base_model` is fine-tuned (no sweep, no
pretraining; the data prepared with its tokenizer), distilled into a GPT student (saved as
GPT-2: another architecture, the same tokenizer), evaluated (lm-evaluation-harness's HF model
type included) and promoted; the registered champion then loads with transformers and
generates, and through mlflow.pyfunc predicts text."""

from __future__ import annotations

from pathlib import Path

import pytest

NAME = "lifecycle-hf-test"
PROMPT = "Q: What number comes after 41?\nA:"


def assert_champion_serves(name: str) -> dict:
    """The champion of `name`: transformers loads it and generates; mlflow.pyfunc predicts text
    for a batch of prompts (the completion only). Returns what was checked."""
    import mlflow
    import torch
    from mlflow.artifacts import download_artifacts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(download_artifacts(f"models:/{name}@champion"))
    model = AutoModelForCausalLM.from_pretrained(local / "model")
    tokenizer = AutoTokenizer.from_pretrained(local / "components" / "tokenizer")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1] and out.dtype == torch.long
    served = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    answers = served.predict([PROMPT, "The"], params={"max_new_tokens": 4})
    assert isinstance(answers, list) and len(answers) == 2 and all(isinstance(a, str) for a in answers)
    assert not answers[0].startswith(PROMPT)  # the completion, not the prompt echoed
    return {"architecture": type(model).__name__, "answers": answers}


@pytest.fixture(scope="module")
def hf_run(airflow_db, tiny_llama_dir):
    from tests.lifecycle_run import run_lifecycle

    run = run_lifecycle({"recipe": "tiny", "cache": False, "base_model": str(tiny_llama_dir),
                         "registered_model_name": NAME})
    return {**run, "by_stage": {r.data.tags["stage"]: r for r in run["children"]}}


def test_a_llama_base_model_is_fine_tuned_distilled_into_a_gpt_evaluated_and_promoted(
        hf_run, tiny_llama_dir):
    client, by_stage = hf_run["client"], hf_run["by_stage"]
    assert set(by_stage) == {"data_prep", "finetune", "distill", "evaluate"}  # no sweep, no pretrain
    assert "fine-tuned: no sweep, no pretraining" in hf_run["output"]
    finetune = by_stage["finetune"]
    assert finetune.data.tags["base_model"] == str(tiny_llama_dir)
    assert finetune.data.tags["lineage.parent_model_dir"] == str(tiny_llama_dir)
    scored = by_stage["evaluate"].data.metrics
    for name in ("pretrained", "teacher", "student"):
        assert {f"{name}/perplexity", f"{name}/bits_per_byte", f"{name}/task_accuracy",
                f"{name}/harness.sft_choice.acc"} <= set(scored), name
    assert scored["student/params"] < scored["teacher/params"] == scored["pretrained/params"]
    mv = client.get_model_version_by_alias(NAME, "champion")
    assert hf_run["parent"].data.tags["champion"] == f"{NAME}/{mv.version}"
    assert mv.tags["candidate"] in ("teacher", "student") and len(mv.tags["data_hash"]) == 64
    assert mv.tags["training_run_id"] == by_stage[{"teacher": "finetune", "student": "distill"}[
        mv.tags["candidate"]]].info.run_id


def test_the_registered_champion_loads_with_transformers_and_serves_through_pyfunc(hf_run):
    served = assert_champion_serves(NAME)
    # the teacher is the fine-tuned Llama; the student our GPT, saved as the GPT-2 it is
    expected = {"teacher": "LlamaForCausalLM", "student": "GPT2LMHeadModel"}
    mv = hf_run["client"].get_model_version_by_alias(NAME, "champion")
    assert served["architecture"] == expected[mv.tags["candidate"]]


def test_mlflow_models_serve_answers_an_invocation_with_text(hf_run):
    """The README's command, as a serving host would run it: `mlflow models serve` on the
    registered champion (the venv's own packages: --env-manager local), then one POST to
    /invocations over HTTP."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from tests.aws_fixtures import free_port, wait_http

    port = free_port()
    bin_dir = str(Path(sys.executable).parent)   # the server execs `uvicorn` from PATH
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    server = subprocess.Popen([os.path.join(bin_dir, "mlflow"), "models", "serve", "-m",
                               f"models:/{NAME}@champion", "--env-manager", "local", "-p", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", timeout=120)
        body = json.dumps({"inputs": [PROMPT, "The"], "params": {"max_new_tokens": 4}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            predictions = json.loads(response.read())["predictions"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert len(predictions) == 2 and all(isinstance(p, str) for p in predictions), predictions
    assert not predictions[0].startswith(PROMPT)  # the completion, as pyfunc gives it
