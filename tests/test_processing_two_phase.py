"""Data prep on several SageMaker Processing instances: a shards job on N instances, then a
finalize job on one over every host's shards, in one handle. Both requests are checked against
botocore's model, and the real tasks.data.prep shards and finalize stages run here through
docker/job_entry.py as two hosts and a finalize host would run them: the data set equals a
one-instance run's (same manifest content hash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llmops.infra.aws.validation import validate_request
from llmops.jobs.backends import remote
from llmops.jobs.backends.sagemaker.sagemaker_backend import finalize_name
from llmops.jobs.backends.sagemaker.sagemaker_requests import processing_request
from llmops.jobs.backends.sagemaker.sagemaker_settings import ProcessingSettings
from llmops.jobs.spec import JobSpec, job_name
from tasks.configs import to_dict
from tests.aws_fixtures import ENTRY, IMAGE, ROLE, ROOT
from tests.test_data_prep import PROSE, small_config, write_jsonl

STAGING = "s3://llmops-test/staging"


def data_prep(instances: int) -> JobSpec:
    return JobSpec(stage="data_prep", entrypoint="tasks.data.prep", name=job_name("dp", prefix="data_prep"),
                   config={"inputs": ["s3://corpus/raw/*.jsonl"], "output_dir": "s3://out/data_prep"},
                   instance_type="ml.m5.4xlarge", instance_count=instances)


def test_the_two_requests_split_the_work_and_merge_it():
    spec = data_prep(3)
    settings = ProcessingSettings(role_arn=ROLE, staging_uri=STAGING, image=IMAGE)
    staged = remote.plan(spec, spec.name, STAGING)
    shards, _ = processing_request(spec, settings, staged, spec.name, "shards")
    final, _ = processing_request(spec, settings, staged, finalize_name(spec.name), "finalize")
    validate_request("sagemaker", "CreateProcessingJob", shards)
    validate_request("sagemaker", "CreateProcessingJob", final)
    assert shards["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 3
    assert final["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 1
    args = shards["AppSpecification"]["ContainerArguments"]
    assert args[-3:] == ["--", "--stage", "shards"]
    assert args[args.index("--result") + 1] == f"{staged.prefix}/shards/result.json"
    # Every host sees every input file: prep gives host i the shards with index % N == i.
    raw = [i for i in shards["ProcessingInputs"] if i["InputName"] != "llmops_config"]
    assert [i["S3Input"]["S3DataDistributionType"] for i in raw] == ["FullyReplicated"]
    assert shards["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"] == f"{staged.prefix}/shards"
    fargs = final["AppSpecification"]["ContainerArguments"]
    assert fargs[-3:] == ["--", "--stage", "finalize"]
    assert fargs[fargs.index("--merge-output") + 1] == "/opt/ml/processing/input/llmops_shards"
    assert fargs[fargs.index("--result") + 1] == staged.result_uri
    merged = {i["InputName"]: i["S3Input"] for i in final["ProcessingInputs"]}
    assert merged["llmops_shards"]["S3Uri"] == f"{staged.prefix}/shards/"
    assert final["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"] == "s3://out/data_prep"
    # One instance and no phases: unchanged.
    single, _ = processing_request(data_prep(1), settings, staged, spec.name)
    assert "--stage" not in single["AppSpecification"]["ContainerArguments"]
    assert finalize_name(spec.name) != finalize_name(remote.attempt_name(spec.name, 2))
    assert len(finalize_name("x" * 63)) <= 63


def _entry(tmp_path: Path, config: dict, out: Path, result: Path, stage_argv: list[str],
           env: dict | None = None, extra: list[str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(ENTRY), "--entrypoint", "tasks.data.prep", "--config-json", json.dumps(config),
         "--result", str(result), "--output-local", str(out), *(extra or []), "--", *stage_argv],
        env={**os.environ, "PYTHONPATH": str(ROOT), "LLMOPS_WORKDIR": str(tmp_path / "work"), **(env or {})},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_two_hosts_then_finalize_write_the_one_host_data_set(tmp_path):
    docs = [{"id": f"d{i}", "text": f"{PROSE[i % 6]} Case {i}: {PROSE[(i * 5) % 6]}"} for i in range(60)]
    inputs = [write_jsonl(tmp_path / f"part{k}.jsonl", docs[k::3]) for k in range(3)]
    config = to_dict(small_config(tmp_path, inputs, near_dedup=False))

    _entry(tmp_path, config, tmp_path / "single", tmp_path / "single.json", [])
    single = json.loads((tmp_path / "single.json").read_text())

    hosts = json.dumps(["algo-1", "algo-2"])
    for rank, host in enumerate(("algo-1", "algo-2")):   # each host's ProcessingOutput: shards/host-<i>
        _entry(tmp_path, config, tmp_path / "shards", tmp_path / "shards" / "result.json", ["--stage", "shards"],
               env={"SM_HOSTS": hosts, "SM_CURRENT_HOST": host,
                    "DATA_PREP_HOST_RANK": str(rank), "DATA_PREP_NUM_HOSTS": "2"})
    assert sorted(p.name for p in (tmp_path / "shards").glob("host-*")) == ["host-0", "host-1"]
    assert not list((tmp_path / "shards").glob("host-*/manifest.json"))
    _entry(tmp_path, config, tmp_path / "final", tmp_path / "final.json", ["--stage", "finalize"],
           extra=["--merge-output", str(tmp_path / "shards")])
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["data_hash"] == single["data_hash"] != ""
    manifest = json.loads((tmp_path / "final" / "manifest.json").read_text())
    assert manifest["content_hash"] == single["data_hash"]
    assert manifest["counts"]["input_documents"] == 60


def test_one_handle_runs_shards_then_finalize_against_moto(moto_server):
    """moto completes a processing job at creation: the shards job's result, then the finalize
    job's, are written as the hosts would write them."""
    from llmops.jobs.backends import JobState
    from llmops.jobs.backends.sagemaker.sagemaker_backend import SageMakerProcessingBackend
    from tests.aws_fixtures import sagemaker_settings

    moto_server.bucket("llmops-test")
    s3c = moto_server.client("s3")
    s3c.put_object(Bucket="llmops-test", Key="raw/part0.jsonl", Body=b'{"id": "a", "text": "x"}\n')
    backend = SageMakerProcessingBackend(settings={"sagemaker_processing": sagemaker_settings(
        "llmops-test", instance_type="ml.m5.xlarge")})
    spec = data_prep(2).replace(name=job_name("dp-moto", prefix="data_prep"),
                                config={"inputs": ["s3://llmops-test/raw/*.jsonl"],
                                        "output_dir": "s3://llmops-test/data_prep"})
    handle = backend.submit(spec)
    fin = handle["finalize"]["job_name"]
    sm = moto_server.client("sagemaker")
    key = lambda uri: uri.split("/", 3)[3]   # noqa: E731
    sent = lambda uri: json.loads(s3c.get_object(Bucket="llmops-test", Key=key(uri))["Body"].read())  # noqa: E731
    # moto keeps little of a processing request: the backend's own records of what it sent.
    shards = sent(f"{handle['staging_prefix']}/request.json")
    assert shards["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 2
    assert shards["AppSpecification"]["ContainerArguments"][-1] == "shards"
    s3c.put_object(Bucket="llmops-test", Key=key(handle["finalize"]["shards_result_uri"]), Body=b"{}")
    first = backend.status(handle)
    assert first.state is JobState.RUNNING and fin in first.message
    assert sm.describe_processing_job(ProcessingJobName=fin)["ProcessingJobStatus"] == "Completed"
    final = sent(handle["finalize"]["request_uri"])
    assert final["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 1
    assert final["AppSpecification"]["ContainerArguments"][-1] == "finalize"
    assert backend.status(handle).state is JobState.FAILED   # finished, but no result yet
    s3c.put_object(Bucket="llmops-test", Key=key(handle["result_uri"]),
                   Body=json.dumps({"data_hash": "h", "outputs": {}}).encode())
    done = backend.status(handle)
    assert done.state is JobState.SUCCEEDED and done.result["data_hash"] == "h"
    again = backend.submit(spec)   # a retried task: the same two jobs
    assert again["reattached"] and again["finalize"]["job_name"] == fin
    names = [j["ProcessingJobName"] for j in sm.list_processing_jobs()["ProcessingJobSummaries"]]
    assert sorted(n for n in names if n in (handle["job_name"], fin)) == sorted([handle["job_name"], fin])
