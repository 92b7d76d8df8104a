"""Every input is checked in start_run before any job, and before the MLflow parent run opens:
unknown conf keys, storage roots and data paths outside the allowed roots, remote backends
without their settings, S3 buckets that do not exist, cross-field rules naming the field path and
the Param. After each refusal there is no job directory, no job and no MLflow run.

Real functions throughout: the session's MLflow SQLite store (tests/isolated_env.py), a moto
server behind the Airflow connection `llmops_aws` for the AWS checks (tests/aws_fixtures.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from llmops.infra import tracking
from llmops.policy import params as knobs
from llmops.policy import promotion
from llmops.stages import lifecycle
from tests.aws_fixtures import CONN_ID, sagemaker_settings

DAG_ID = "validation_test"


def jobs_dir() -> Path:
    return Path(os.environ["LLMOPS_HOME"], "jobs")


def snapshot() -> set:
    return set(jobs_dir().iterdir()) if jobs_dir().exists() else set()


def mlflow_runs() -> list:
    exp = tracking.client().get_experiment_by_name(DAG_ID)
    return [] if exp is None else tracking.client().search_runs([exp.experiment_id])


@pytest.fixture()
def refused(tmp_path):
    """Call start_run, expect a refusal matching every pattern; nothing may exist afterwards."""
    jobs, runs = snapshot(), len(mlflow_runs())

    def check(params: dict, *patterns: str, conf: dict | None = None) -> str:
        with pytest.raises(lifecycle.validation_errors()) as info:
            lifecycle.start_run({"recipe": "tiny", **params}, dag_id=DAG_ID,
                                run_id=f"manual__{len(mlflow_runs())}", conf=conf)
        message = str(info.value)
        for pattern in patterns:
            assert re.search(pattern, message), f"{pattern!r} not in: {message}"
        assert snapshot() == jobs, "a refused run left a job directory"
        assert len(mlflow_runs()) == runs, "a refused run opened an MLflow run"
        return message

    return check


@pytest.mark.parametrize("conf, patterns", [
    ({"foo_bar": 1}, [r"Unknown Param in the run's conf: 'foo_bar'"]),
    ({"pretrain_step": 5}, [r"'pretrain_step' \(did you mean 'pretrain_steps'\?\)"]),
    ({"backend_pretrian": "local"}, [r"did you mean 'backend_pretrain'"]),
    ({"recipe": "tiny", "Sweep_Trials": 2, "lr_mx": 0.1},
     [r"'Sweep_Trials'", r"'lr_mx' \(did you mean 'lr_max'\?\)"]),
])
def test_unknown_conf_keys_are_refused_with_the_nearest_name(refused, conf, patterns):
    refused({}, *patterns, conf=conf)


def test_unknown_keys_in_the_params_themselves_are_refused(refused):
    refused({"pretrain_step": 5}, r"in the run's Params: 'pretrain_step' \(did you mean")


@pytest.mark.parametrize("root, pattern", [
    ("/etc", r"outside the allowed storage roots"),
    ("/root/.ssh", r"outside the allowed storage roots"),
    ("/home/someone-else/storage", r"outside the allowed storage roots"),
    ("relative/out", r"is relative, so it would land wherever the worker runs \(now /"),
    ("./out", r"is relative"),
    ("/tmp/../etc/cron.d", r"has a '\.\.' component"),
    ("/tmp/x$(touch /tmp/pwned)", r"shell metacharacter"),
    ("/tmp/x`id`", r"shell metacharacter"),
    ("/tmp/x; rm -rf /", r"shell metacharacter"),
    ("/tmp/a|b", r"shell metacharacter"),
    ("/tmp/a&b", r"shell metacharacter"),
    ("/tmp/a\nb", r"control character"),
    ("/tmp/a\x00b", r"control character"),
    ("file:///tmp/x", r"neither a local path nor s3://"),
    ("gs://bucket/x", r"neither a local path nor s3://"),
    ("s3://Bad_Bucket/x", r"is not an S3 bucket name"),
    ("s3://my-bucket/../x", r"has a '\.' or '\.\.' component"),
    ("s3://not-allowed-bucket/x", r"outside the allowed storage roots"),
])
def test_storage_roots_outside_the_allowed_roots_are_refused(refused, root, pattern):
    refused({"storage_root": root}, r"Param 'storage_root'", pattern)


def test_a_storage_root_symlinked_out_of_the_allowed_roots_is_refused(refused, tmp_path):
    (tmp_path / "escape").symlink_to("/etc")
    refused({"storage_root": str(tmp_path / "escape")}, r"outside the allowed storage roots")


def test_storage_roots_are_normalised(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_ALLOWED_STORAGE_ROOTS", f"{tmp_path} s3://llmops-bucket/runs")
    assert lifecycle.check_storage_root(f"{tmp_path}//a/./b/") == str(tmp_path / "a" / "b")
    assert lifecycle.check_storage_root("s3://llmops-bucket//runs/x/") == "s3://llmops-bucket/runs/x"
    with pytest.raises(lifecycle.LifecycleParamError, match="outside the allowed storage roots"):
        lifecycle.check_storage_root("s3://llmops-bucket/runsx")   # a prefix, not a sibling
    with pytest.raises(lifecycle.LifecycleParamError, match="outside the allowed storage roots"):
        lifecycle.check_storage_root("/tmp/elsewhere")             # the explicit list replaces defaults


@pytest.mark.parametrize("param, value, pattern", [
    ("data_inputs", ["/proc/self/environ"], r"outside the allowed data roots"),
    ("data_inputs", ["/etc/passwd"], r"outside the allowed data roots"),
    ("data_inputs", ["/etc/*.conf"], r"outside the allowed data roots"),
    ("data_inputs", ["/root/corpus.jsonl"], r"outside the allowed data roots"),
    ("data_inputs", ["/home/someone-else/corpus.jsonl"], r"outside the allowed data roots"),
    ("data_inputs", ["corpus.jsonl"], r"is relative"),
    ("data_inputs", ["/tmp/../etc/passwd"], r"'\.\.' component"),
    ("data_inputs", ["/tmp/x;cat /etc/passwd"], r"shell metacharacter"),
    ("data_inputs", ["s3://somebody-elses-bucket/corpus.jsonl"], r"outside the allowed data roots"),
    ("data_inputs", "/tmp/corpus.jsonl", r"must be a list of paths"),
    ("sft_inputs", ["/etc/passwd", "/etc/group"], r"outside the allowed data roots"),
])
def test_data_paths_outside_the_data_roots_are_refused(refused, param, value, pattern):
    refused({param: value}, rf"Param '{param}'", pattern)


def test_a_data_file_symlinked_out_of_the_data_roots_is_refused(refused, tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"id": "1", "text": "hello"}\n')
    (tmp_path / "corpus" / "b.jsonl").symlink_to("/etc/passwd")
    refused({"data_inputs": [str(tmp_path / "corpus" / "*.jsonl")]},
            r"/etc/passwd resolves elsewhere|outside the allowed data roots")


@pytest.mark.parametrize("params, patterns", [
    ({"student_n_embd": 31}, [r"Param 'student_n_embd'", r"distill\.student\.n_embd \(31\) must be "
                                                         r"a multiple of n_head"]),
    ({"student_n_layer": 0}, [r"Param 'student_n_layer'", r"distill\.student\.n_layer must be >= 1"]),
    ({"n_embd": 100, "n_head": 3}, [r"Param 'n_embd'", r"pretrain\.model\.n_embd \(100\)"]),
    ({"lr_min": 0.1, "lr_max": 0.01}, [r"Param 'lr_min'", r"sweep\.lr_min \(0\.1\) must be <= lr_max"]),
    ({"sweep_sampler": "grid", "sweep_search_space": {"optim.weight_decay": {"low": 0, "high": 1}}},
     [r"Param 'sweep_sampler'", r"sweep\.sampler 'grid' needs"]),
    # keep_every must fall on saved steps: both Params named, whichever of them the run set
    ({"checkpoint_interval": 5, "keep_every": 7},
     [r"Param 'keep_every' \(pretrain\.keep_every\), Param 'checkpoint_interval' "
      r"\(pretrain\.checkpoint_interval\)", r"pretrain\.keep_every \(7\) must be 0 or a multiple "
      r"of pretrain\.checkpoint_interval \(5\).*Set keep_every to 5"]),
    ({"recipe": "tiny", "keep_every": 15}, [r"Param 'keep_every'.*Param 'checkpoint_interval'",
                                            r"multiple of pretrain\.checkpoint_interval \(10\)"]),
    ({"recipe": "tiny", "checkpoint_interval": 5, "keep_checkpoints": 1, "keep_every": 10}, []),
    ({"finetune_replay_fraction": 0.5, "recipe": "tiny", "sft_inputs": []}, []),  # valid: control
])
def test_cross_field_rules_name_the_field_path_and_the_param(refused, params, patterns):
    if not patterns:
        lifecycle.check_params({"recipe": "tiny", **params})
        lifecycle.resolve({"recipe": "tiny", **params})
        return
    refused(params, *patterns)


def _schema_bad_values():
    """Bad values from the Params' own schemas, passed straight to start_run (as a caller that
    skips the form would): each must be refused there too, naming the Param."""
    params = knobs.lifecycle_params()
    for name, path in knobs.KNOBS.items():
        schema = params[name].schema
        kinds = [k for k in schema["type"] if k != "null"]
        lo, hi = knobs.schema_bounds(schema)
        if lo is not None:
            yield name, (lo - 1 if "integer" in kinds else lo - abs(lo) - 1)
        if hi is not None:
            yield name, (hi * 2 + 1 if "integer" in kinds else hi * 2 + 1.0)
        wrong = {"integer": "seven", "number": "0.1x", "boolean": "yes", "array": 5,
                 "object": [1], "string": 7}
        yield name, wrong[kinds[0]]
        if schema.get("enum"):
            yield name, "no-such-choice"


BAD = list(_schema_bad_values())


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_schema_generated_bad_values_are_refused_by_start_run_too(refused, name, value):
    refused({name: value}, rf"Param '{name}'")


@pytest.mark.parametrize("params, patterns", [
    ({"gate_metrics": ["bits_per_byte"]},
     [r"Param 'gate_metrics' \(gate\.metrics\)", r"'bits_per_byte' is not compared item by item",
      r"heldout\.bits_per_byte"]),
    ({"gate_metrics": []}, [r"Param 'gate_metrics'", r"must name at least one item-level metric"]),
    ({"gate_policy": "non_inferior", "gate_margin": 0.0},
     [r"Param 'gate_margin'", r"margin must be above 0 for policy non_inferior"]),
    ({"gate_policy": "better"}, [r"Param 'gate_policy'", r"superior.*non_inferior"]),
    ({"gate_confidence": 1.5}, [r"Param 'gate_confidence'"]),
    ({"max_contaminated_share": -0.1}, [r"Param 'max_contaminated_share'"]),
    ({"gate_metrics": ["suite.sft_choice.accuracy", "task_accuracy"], "gate_policy": "non_inferior",
      "gate_margin": 0.05, "gate_confidence": 0.9, "max_contaminated_share": 0.1,
      "exclude_contaminated": False, "pretrain_seed": 7, "finetune_seed": 8, "distill_seed": 9}, []),
])
def test_the_gate_s_params_are_checked_by_name(refused, params, patterns):
    """The promotion policy a researcher sets on the form reaches the gate's config, and what it
    cannot decide by is refused before any job, naming the Param."""
    if not patterns:
        cfg = lifecycle.resolve({"recipe": "tiny", **params})
        assert (cfg.gate.metrics, cfg.gate.policy, cfg.gate.margin, cfg.gate.confidence) == (
            ["suite.sft_choice.accuracy", "task_accuracy"], "non_inferior", 0.05, 0.9)
        assert (cfg.gate.max_contaminated_share, cfg.gate.exclude_contaminated) == (0.1, False)
        assert (cfg.pretrain.seed, cfg.finetune.seed, cfg.distill.seed) == (7, 8, 9)
        return
    refused(params, *patterns)


GOOD_ITEM = {"query": "Q: What number comes after 41?\nA:", "choices": [" 42", " 40"], "gold": 0}


def test_task_suites_are_checked_before_any_job(refused, tmp_path):
    """Param eval_suites: files, directories or s3:// URIs in the documented formats; a bad line,
    a missing file, a path outside the data roots or two suites of one name are refused with the
    file, the line and the format, before any job (evaluation runs hours later)."""
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps(GOOD_ITEM) + "\n" + json.dumps({"prompt": "1+1=", "answer": "2",
                                                              "passage": 3}) + "\n")
    folder = tmp_path / "more"
    folder.mkdir()
    (folder / "other.jsonl").write_text(json.dumps(GOOD_ITEM) + "\n")
    lifecycle.check_params({"recipe": "tiny", "eval_suites": [str(good), str(folder)]})   # control
    assert lifecycle.resolve({"recipe": "tiny", "eval_suites": [str(good)]}).evaluate.suites == [str(good)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD_ITEM) + "\n" + json.dumps({"query": "Q", "choices": ["a"], "gold": 0}) + "\n")
    refused({"eval_suites": [str(bad)]}, r"Param 'eval_suites'", rf"{re.escape(str(bad))}:2: a "
            r"multiple-choice item needs", r"The format: multiple choice")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "Q", "label": 1}\n')
    refused({"eval_suites": [str(wrong)]}, rf"{re.escape(str(wrong))}:1: expected multiple choice",
            r"got \['label', 'question'\]")
    refused({"eval_suites": [str(tmp_path / "nope.jsonl")]}, r"Param 'eval_suites'.*does not exist")
    refused({"eval_suites": ["/etc/passwd"]}, r"Param 'eval_suites'.*outside the allowed data roots")
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "mine.jsonl").write_text(json.dumps(GOOD_ITEM) + "\n")
    refused({"eval_suites": [str(good), str(twin)]}, r"\['mine'\] would be two suites of one name")


def test_s3_task_suites_are_read_through_the_aws_connection(refused, aws, monkeypatch):
    monkeypatch.setenv("LLMOPS_ALLOWED_DATA_ROOTS", "s3://llmops-validation/")
    s3 = aws.client("s3")
    s3.put_object(Bucket="llmops-validation", Key="suites/a.jsonl", Body=json.dumps(GOOD_ITEM) + "\n")
    s3.put_object(Bucket="llmops-validation", Key="suites/b.jsonl", Body=json.dumps(GOOD_ITEM) + "\n")
    s3.put_object(Bucket="llmops-validation", Key="broken/c.jsonl", Body="not json\n")
    lifecycle.check_params({"recipe": "tiny", "eval_suites": ["s3://llmops-validation/suites/"]})
    refused({"eval_suites": ["s3://llmops-validation/broken"]},
            r"s3://llmops-validation/broken/c\.jsonl:1: not JSON")
    refused({"eval_suites": ["s3://llmops-validation/none.jsonl"]},
            r"s3://llmops-validation/none\.jsonl could not be read through AWS connection 'llmops_aws'")
    refused({"eval_suites": ["s3://llmops-validation/empty"]}, r"holds no \.jsonl suite objects")


def test_a_remote_backend_without_its_settings_is_refused_up_front(refused, monkeypatch):
    monkeypatch.delenv("AIRFLOW_VAR_LLMOPS_BACKENDS", raising=False)
    refused({"backend_pretrain": "sagemaker"},
            r"Param 'backend_pretrain' = 'sagemaker', but the Airflow Variable 'llmops_backends' "
            r"has no role_arn, staging_uri, image", r"or set backend_pretrain to 'local'")
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS", json.dumps({"batch": {"job_queue": "q"}}))
    refused({"backend_finetune": "batch"}, r"Param 'backend_finetune' = 'batch'.* has no staging_uri, image")
    refused({"backend_data_prep": "hyperpod"}, r"has no staging_uri, image, eks_cluster_name")
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS", json.dumps({"sagemaker": {"role_arnn": "x"}}))
    refused({"backend_evaluate": "sagemaker"}, r"Param 'backend_evaluate'.*Unknown config key.*role_arnn")


# -- through AWS (moto) -------------------------------------------------------------------------

@pytest.fixture()
def aws(moto_server, monkeypatch):
    monkeypatch.setenv("LLMOPS_AWS_CONN_ID", CONN_ID)
    bucket = moto_server.bucket("llmops-validation")
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS",
                       json.dumps({"sagemaker": sagemaker_settings(bucket)}))
    return moto_server


def test_an_s3_storage_root_whose_bucket_does_not_exist_is_refused_naming_it(refused, aws, monkeypatch):
    monkeypatch.setenv("LLMOPS_ALLOWED_STORAGE_ROOTS", "s3://no-such-bucket/ s3://llmops-validation/")
    refused({"storage_root": "s3://no-such-bucket"},
            r"S3 bucket 'no-such-bucket' \(from storage_root\) does not exist, checked through AWS "
            r"connection 'llmops_aws'")


def test_a_staging_bucket_that_does_not_exist_is_refused(refused, aws, monkeypatch):
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS",
                       json.dumps({"sagemaker": sagemaker_settings("no-staging-bucket")}))
    refused({"backend_pretrain": "sagemaker"},
            r"S3 bucket 'no-staging-bucket' \(from staging_uri\) does not exist")


def test_an_aws_connection_that_does_not_answer_is_refused_quickly(refused, aws, monkeypatch):
    import time

    dead = {"conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": "us-east-1", "endpoint_url": "http://127.0.0.1:9"}}
    monkeypatch.setenv("AIRFLOW_CONN_DEAD_AWS", json.dumps(dead))
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS", json.dumps(
        {"sagemaker": sagemaker_settings("llmops-validation", aws_conn_id="dead_aws")}))
    start = time.monotonic()
    refused({"backend_pretrain": "sagemaker"},
            r"AWS connection 'dead_aws' does not work: GetCallerIdentity failed")
    assert time.monotonic() - start < 30


def test_a_configured_remote_backend_and_s3_storage_pass(aws, monkeypatch):
    """The control: the same checks let a good configuration through (and open the run)."""
    monkeypatch.setenv("LLMOPS_ALLOWED_STORAGE_ROOTS", "s3://llmops-validation/")
    run = lifecycle.start_run({"recipe": "tiny", "backend_pretrain": "sagemaker",
                               "storage_root": "s3://llmops-validation/out/"},
                              dag_id=DAG_ID, run_id="manual__aws_ok", conf={"recipe": "tiny"})
    assert run["root"] == "s3://llmops-validation/out/validation_test/manual__aws_ok"
    assert run["backends"]["pretrain"] == "sagemaker"


# -- after the parent run opened ------------------------------------------------------------------

def test_a_failure_after_the_parent_run_opened_marks_it_failed_with_the_reason(monkeypatch, tmp_path):
    def broken(name):
        raise RuntimeError("registry unreachable")

    monkeypatch.setattr(promotion, "current_champion", broken)
    with pytest.raises(RuntimeError, match="registry unreachable"):
        lifecycle.start_run({"recipe": "tiny"}, dag_id=DAG_ID, run_id="manual__late_failure")
    [parent] = [r for r in mlflow_runs() if r.data.tags.get("run_id") == "manual__late_failure"]
    assert parent.info.status == "FAILED"
    assert parent.data.tags["failure_reason"] == "start_run: registry unreachable"


# -- the DAG's wiring -------------------------------------------------------------------------------

def lifecycle_dag():
    from airflow.dag_processing.dagbag import DagBag

    from tests.test_dags import ROOT

    return DagBag(dag_folder=str(ROOT / "dags")).dags["llm_lifecycle"]


def test_pick_best_skips_when_start_run_was_refused():
    from airflow.sdk.exceptions import AirflowSkipException

    task = lifecycle_dag().get_task("pick_best")
    assert task.trigger_rule == "all_done"   # a failed trial still does not sink the sweep
    with pytest.raises(AirflowSkipException, match="start_run did not finish"):
        task.python_callable(None)


def test_a_refusal_fails_start_run_without_a_retry(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    task = lifecycle_dag().get_task("start_run")

    class DagRun:
        conf = {"pretrain_step": 5}

    class Dag:
        dag_id = DAG_ID

    class TaskInstance:
        pushed: dict = {}

        def xcom_push(self, key, value):
            self.pushed[key] = value

    ti = TaskInstance()
    context = {"params": {"recipe": "tiny"}, "dag": Dag(), "run_id": "manual__x", "dag_run": DagRun(),
               "ti": ti}
    monkeypatch.setitem(task.python_callable.__globals__, "get_current_context", lambda: context)
    with pytest.raises(AirflowFailException, match="did you mean 'pretrain_steps'"):
        task.python_callable()
    # the refusal is left where the run's note and page read it
    (refusal,) = ti.pushed.values()
    assert "Unknown Param in the run's conf: 'pretrain_step' (did you mean 'pretrain_steps'?)" in refusal


def test_an_unknown_conf_key_fails_the_dag_run_at_start_run(airflow_db):
    """End to end through `airflow dags test`: refused at start_run, no retry, no job."""
    from tests.isolated_env import airflow_cli

    before = snapshot()
    proc = airflow_cli("dags", "test", "llm_lifecycle", "-c", json.dumps({"foo_bar": 1}), timeout=300)
    output = proc.stdout + proc.stderr
    assert "Unknown Param in the run's conf: 'foo_bar'" in output, output[-3000:]
    assert "AirflowFailException" in output or "FAILED" in output
    assert "up_for_retry" not in output.lower()
    assert snapshot() == before, "no job may start when the conf is refused"
