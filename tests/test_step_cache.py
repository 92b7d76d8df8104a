"""The step cache's identity and index (plugins/llmops/infra/step_cache.py), without a DAG run:
every part of a stage's identity changes its key and nothing that only addresses a run does; the
lifecycle's specs of two DAG runs key alike; a record is a hit only while its outputs still exist
and match their hashes and manifests, in a local directory and on S3 (the moto server)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from llmops.infra import step_cache
from llmops.jobs.spec import JobSpec

RUN1, RUN2 = "/store/llm_lifecycle/manual__1", "/store/llm_lifecycle/manual__2"


def finetune_spec(root: str = RUN1, **changes) -> JobSpec:
    fields = dict(
        stage="finetune", entrypoint="tasks.finetune", name="finetune-abc",
        config={"base_model": f"{root}/pretrain/model", "data_dir": f"{root}/data_prep",
                "output_dir": f"{root}/finetune", "max_steps": 10, "optim": {"lr": 1e-3}},
        output_uri=f"{root}/finetune", env={"MLFLOW_RUN_ID": f"run-of-{root}", "OMP_NUM_THREADS": "1"},
        tags={"run_id": root, "base_run_id": f"mlflow-{root}"}, mlflow_parent_run_id=f"parent-{root}",
        cache={"index": "/store/step_cache", "lookup": True,
               "inputs": {"base": {"uri": f"{root}/pretrain/model", "hash": "base-hash"},
                          "data": {"uri": f"{root}/data_prep", "hash": "data-hash"}}})
    fields.update(changes)
    return JobSpec(**fields)


def key(spec: JobSpec, settings: str = "") -> str:
    return step_cache.key_of(step_cache.identity(spec, settings))


def test_what_only_addresses_a_run_is_not_part_of_the_identity():
    base = key(finetune_spec())
    other_run = finetune_spec(RUN2, env={"MLFLOW_RUN_ID": "another", "MLFLOW_TRACKING_URI": "x",
                                         "OMP_NUM_THREADS": "1", "LLMOPS_STUDY_NAME": "llm/run2",
                                         "LLMOPS_TRIAL_NUMBER": "7"},
                              name="finetune-def", mlflow_experiment="other")
    assert key(other_run) == base, "another run's paths, MLflow ids, study address: same job"
    off = finetune_spec(cache={**finetune_spec().cache, "lookup": False, "index": "s3://b/step_cache"})
    assert key(off) == base


@pytest.mark.parametrize("change", [
    {"stage": "distill"},
    {"entrypoint": "tasks.distill"},
    {"config": {**finetune_spec().config, "max_steps": 11}},
    {"config": {**finetune_spec().config, "optim": {"lr": 2e-3}}},
    {"argv": ("--seed", "2")},
    {"image": "123.dkr.ecr.us-east-1.amazonaws.com/llmops@sha256:" + "a" * 64},
    {"instance_type": "ml.p5.48xlarge"},
    {"nproc_per_node": 2},
    {"env": {"MLFLOW_RUN_ID": "x", "OMP_NUM_THREADS": "2"}},
    {"cache": {**finetune_spec().cache, "inputs": {**finetune_spec().cache["inputs"],
                                                   "base": {"uri": f"{RUN1}/pretrain/model",
                                                            "hash": "another-model"}}}},
    {"cache": {**finetune_spec().cache, "inputs": {**finetune_spec().cache["inputs"],
                                                   "data": {"uri": f"{RUN1}/data_prep",
                                                            "hash": "another-data"}}}},
])
def test_every_part_of_the_identity_changes_the_key(change):
    assert key(finetune_spec(**change)) != key(finetune_spec())


def test_code_version_and_backend_settings_change_the_key(monkeypatch):
    base = key(finetune_spec())
    assert key(finetune_spec(), settings="role-v2") != base
    from llmops.core import provenance

    monkeypatch.setattr(provenance, "code_version", lambda: "0123abc")
    assert key(finetune_spec()) != base


def test_a_miss_says_what_changed():
    a = step_cache.identity(finetune_spec())
    b = step_cache.identity(finetune_spec(config={**finetune_spec().config, "max_steps": 11}))
    assert step_cache.differences(a, b) == ["config.max_steps"]


def _lifecycle_run(root: str, run_id: str) -> dict:
    from tasks import configs

    return {"dag_id": "llm_lifecycle", "run_id": run_id, "root": root, "storage_root": "/store",
            "config": configs.to_dict(configs.tiny()), "champion": None, "cache": True,
            "backends": {s: "local" for s in ("data_prep", "sweep", "pretrain", "finetune",
                                                 "distill", "evaluate")},
            "experiment": "llm_lifecycle", "parent_run_id": f"parent-{run_id}", "team": "",
            "resources": {}, "model_name": "llm-lifecycle"}


def _lifecycle_keys(root: str, run_id: str, champion: dict | None = None) -> dict[str, str]:
    from llmops.policy import sweep_study as studies
    from llmops.stages import specs

    run = {**_lifecycle_run(root, run_id), "champion": champion}
    data = {"outputs": {"data_dir": f"{root}/data_prep"}, "data_hash": "d" * 64,
            "mlflow_run_id": f"data-{run_id}"}

    def model(stage: str) -> dict:
        return {"outputs": {"model_dir": f"{root}/{stage}/model"}, "content_sha256": f"{stage}-weights",
                "content_hashes": {"model_dir": f"{stage}-hash"}, "mlflow_run_id": f"{stage}-{run_id}"}

    best = {"lr": 3e-3, "params": {"optim.lr": 3e-3}, "mlflow_run_id": f"trial-{run_id}"}
    study = studies.study_ref(dag_id="llm_lifecycle", run_id=run_id, sweep=run["config"]["sweep"])
    stage_specs = {"data_prep": specs.data_prep_spec(run),
             "trial": specs.trial_spec(run, data, study, 0, {"number": 0, "params": {"optim.lr": 2e-3}}),
             "pretrain": specs.pretrain_spec(run, data, best),
             "finetune": specs.finetune_spec(run, data, model("pretrain")),
             "distill": specs.distill_spec(run, data, model("finetune")),
             "evaluate": specs.evaluate_spec(run, data, model("pretrain"), model("finetune"),
                                                 model("distill"))}
    return {stage: key(JobSpec.from_dict(spec)) for stage, spec in stage_specs.items()}


def test_the_lifecycle_specs_of_two_dag_runs_key_alike():
    """Every stage's spec names its run's paths, study and MLflow runs; none of it is identity.
    (A path of the run that is no declared input or output would make every run miss.)"""
    first = _lifecycle_keys(RUN1, "manual__1")
    assert first == _lifecycle_keys(RUN2, "manual__2")
    assert len(set(first.values())) == len(first), "each stage its own key"


def test_an_evaluation_keys_on_the_champions_weights_not_on_its_version():
    """Issue 24: the champion an evaluation compares with is part of its identity by content. The
    same weights under another version (or run) are the same job; other weights are not; a
    champion that is one of the run's own models (an identical rerun's student, crowned by the
    run before) is scored once, as that model, so the job equals the one without a champion."""
    def champion(version: str, content: str) -> dict:
        return {"version": version, "uri": f"models:/llm-lifecycle/{version}", "run_id": f"r{version}",
                "content_sha256": content}

    without = _lifecycle_keys(RUN1, "manual__1")
    against = _lifecycle_keys(RUN1, "manual__1", champion("3", "a" * 64))
    assert without["evaluate"] != against["evaluate"]
    assert {k: v for k, v in without.items() if k != "evaluate"} == \
        {k: v for k, v in against.items() if k != "evaluate"}
    assert _lifecycle_keys(RUN2, "manual__2", champion("4", "a" * 64)) == against
    assert _lifecycle_keys(RUN1, "manual__1", champion("3", "b" * 64))["evaluate"] != against["evaluate"]
    assert _lifecycle_keys(RUN2, "manual__2", champion("5", "distill-weights")) == without
    # a version registered without a content hash is keyed by its version, as before
    old = {**champion("3", ""), "content_sha256": ""}
    assert _lifecycle_keys(RUN1, "manual__1", old)["evaluate"] not in (
        without["evaluate"], against["evaluate"],
        _lifecycle_keys(RUN1, "manual__1", {**old, "uri": "models:/llm-lifecycle/4"})["evaluate"])


def test_an_evaluation_scores_a_champion_that_is_one_of_its_models_once():
    from llmops.stages import specs

    run = {**_lifecycle_run(RUN1, "manual__1"),
           "champion": {"version": "5", "uri": "models:/llm-lifecycle/5", "run_id": "r5",
                        "content_sha256": "distill-weights"}}
    data = {"outputs": {"data_dir": f"{RUN1}/data_prep"}, "data_hash": "d" * 64}
    student = {"outputs": {"model_dir": f"{RUN1}/distill/model"}, "content_sha256": "distill-weights",
               "content_hashes": {"model_dir": "distill-hash"}, "mlflow_run_id": "s"}
    spec = specs.evaluate_models_spec(run, data, {"student": student})
    assert spec["config"]["models"] == {"student": f"{RUN1}/distill/model"}
    assert spec["tags"]["champion_run_id"] == "r5"   # which champion it stood for
    other = {**run, "champion": {**run["champion"], "content_sha256": "e" * 64}}
    assert specs.evaluate_models_spec(other, data, {"student": student})["config"]["models"] == {
        "student": f"{RUN1}/distill/model", "champion": "models:/llm-lifecycle/5"}


# -- the index -------------------------------------------------------------------------------------

def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def _data_dir(root: Path) -> Path:
    """A data prep output: files and a manifest listing their sha256 and their content hash."""
    files = {"tokens/train_00000.bin": _write(root / "tokens/train_00000.bin", "tokens"),
             "tokenizer.json": _write(root / "tokenizer.json", "{}")}
    listing = "".join(f"{p}\t{s}\n" for p, s in sorted(files.items()))
    manifest = {"files": files, "content_hash": hashlib.sha256(listing.encode()).hexdigest(),
                "counts": {"kept_documents": 3}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / ".manifest.json.tmp").write_text("a temporary: never an output")
    return root


def _record(uri: str, data_hash: str = "") -> dict:
    parts = step_cache.identity(finetune_spec())
    result = {"outputs": {"data_dir": uri}, "metrics": {"rows": 3}, "data_hash": data_hash,
              "job_name": "data-prep-abc"}
    return step_cache.make_record(key=step_cache.key_of(parts), parts=parts, result=result,
                                  where={"job_name": "data-prep-abc", "run_id": "manual__1",
                                         "mlflow_run_id": "m1"})


def test_a_local_record_hits_until_its_outputs_change(tmp_path):
    data = _data_dir(tmp_path / "run1" / "data_prep")
    content_hash = json.loads((data / "manifest.json").read_text())["content_hash"]
    index = step_cache.Index(step_cache.index_root(str(tmp_path)))
    record = _record(str(data), content_hash)
    where = index.put(record)
    assert where == str(tmp_path / "step_cache" / "finetune" / f"{record['key']}.json")
    assert set(record["outputs"]["data_dir"]["files"]) == {"manifest.json", "tokenizer.json",
                                                          "tokens/train_00000.bin"}
    hit, why = step_cache.lookup(index, "finetune", record["key"])
    assert hit is not None and why == "" and hit["job_name"] == "data-prep-abc"
    assert hit["result"]["content_hashes"]["data_dir"] == record["outputs"]["data_dir"]["hash"]
    assert step_cache.lookup(index, "finetune", "0" * 64) == (None, "no finished job has this identity")

    (data / "tokens/train_00000.bin").write_text("tampered")
    hit, why = step_cache.lookup(index, "finetune", record["key"])
    assert hit is None and "tokens/train_00000.bin changed since the job finished" in why
    (data / "tokens/train_00000.bin").write_text("tokens")       # the same bytes: a hit again
    assert step_cache.lookup(index, "finetune", record["key"])[0] is not None
    (data / "tokenizer.json").unlink()
    assert "tokenizer.json is gone" in step_cache.lookup(index, "finetune", record["key"])[1]


def test_outputs_must_agree_with_their_manifest_and_the_recorded_data_hash(tmp_path):
    data = _data_dir(tmp_path / "data_prep")
    (data / "tokens/train_00000.bin").write_text("not what the manifest lists")
    record = _record(str(data))   # recorded as found: only the manifest can tell
    assert "tokens/train_00000.bin does not match the sha256 in manifest.json" in step_cache.verify(record)

    data = _data_dir(tmp_path / "data_prep2")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["content_hash"] = "f" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert "content_hash does not match the files it lists" in step_cache.verify(_record(str(data)))

    data = _data_dir(tmp_path / "data_prep3")
    assert step_cache.verify(_record(str(data), data_hash="e" * 64)).endswith(
        f"the run recorded data hash {'e' * 12}")


def test_the_s3_index_and_outputs_on_the_moto_server(moto_s3, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps({"conn_type": "aws", "extra": {
        "endpoint_url": moto_s3.meta.endpoint_url, "region_name": "us-east-1"}}))
    moto_s3.create_bucket(Bucket="llmops-cache")
    for name, body in {"model.pt": b"weights", "meta.json": b"{}", ".part": b"temporary"}.items():
        moto_s3.put_object(Bucket="llmops-cache", Key=f"root/run1/pretrain/model/{name}", Body=body)
    output = "s3://llmops-cache/root/run1/pretrain/model"
    parts = step_cache.identity(finetune_spec())
    record = step_cache.make_record(
        key=step_cache.key_of(parts), parts=parts,
        result={"outputs": {"model_dir": output}, "job_name": "pretrain-abc"},
        where={"job_name": "pretrain-abc", "run_id": "manual__1", "mlflow_run_id": "m1"})
    files = record["outputs"]["model_dir"]["files"]
    assert set(files) == {"model.pt", "meta.json"} and files["model.pt"].startswith("etag:")
    index = step_cache.Index(step_cache.index_root("s3://llmops-cache/root"))
    assert index.put(record) == f"s3://llmops-cache/root/step_cache/finetune/{record['key']}.json"
    stored = json.loads(moto_s3.get_object(Bucket="llmops-cache",
                                           Key=f"root/step_cache/finetune/{record['key']}.json")["Body"].read())
    assert stored["result"]["content_hashes"]["model_dir"] == record["outputs"]["model_dir"]["hash"]

    hit, why = step_cache.lookup(index, "finetune", record["key"])
    assert hit is not None, why
    moto_s3.put_object(Bucket="llmops-cache", Key="root/run1/pretrain/model/model.pt", Body=b"other")
    hit, why = step_cache.lookup(index, "finetune", record["key"])
    assert hit is None and f"{output}/model.pt changed since the job finished" in why
    moto_s3.delete_object(Bucket="llmops-cache", Key="root/run1/pretrain/model/model.pt")
    assert f"{output}/model.pt is gone" in step_cache.lookup(index, "finetune", record["key"])[1]
    assert step_cache.listing("s3://llmops-cache/root/nothing-here") is None


def test_raw_inputs_hash_follows_their_content(tmp_path):
    _write(tmp_path / "raw" / "a.jsonl", '{"text": "a"}\n')
    _write(tmp_path / "raw" / "b.jsonl", '{"text": "b"}\n')
    pattern = [str(tmp_path / "raw" / "*.jsonl")]
    before = step_cache.raw_inputs_hash(pattern)
    assert step_cache.raw_inputs_hash([str(tmp_path / "raw")]) != before  # another source layout
    _write(tmp_path / "raw" / "b.jsonl", '{"text": "B"}\n')
    assert step_cache.raw_inputs_hash(pattern) != before


def test_a_reused_job_is_ledgered_once_per_reusing_task_and_charged_nothing():
    from llmops.infra.ledger.events import JobEvent, with_usage

    rows = [with_usage(JobEvent(event="cached", job_name="pretrain-abc", run_id=run, task_id="pretrain",
                                instance_type="ml.p5.48xlarge", state="succeeded"))
            for run in ("manual__2", "manual__3")]
    assert rows[0].event_id != rows[1].event_id
    assert all((r.accelerator_hours, r.estimated_cost_usd, r.instance_hours) == (0.0, 0.0, 0.0)
               for r in rows)
