"""tests/chaos/fake_aws/, the AWS that fails: botocore through its proxy classifies each injected
fault as it would AWS's (throttling and 5xx retried, resets and timeouts as connection errors),
clean passthrough without rules, and the job simulator takes our own SageMaker and Batch backends
through InProgress/RUNNING to Completed/SUCCEEDED with the result in S3 and the log lines in
CloudWatch, a client stop to Stopped with the process group gone, a crash to Failed, a deadline
to MaxRuntimeExceeded; a lost response (the request took effect, botocore resends it) leaves one
live job after CreateTrainingJob, a multi-node SubmitJob and a HyperPod create (simulated EKS).
The unkinder faults, each with what our code must do: reads that do not show a new job yet
(waited for, no second job), a 20 s outage of every read (neither failed nor stopped), log lines
that reach CloudWatch after the job's end (still in the task log, once), and 503 SlowDown on the
jobs' own S3 writes (waited out, no checkpoint lost, no step blocked)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

from llmops.jobs.backends import JobState
from llmops.jobs.backends.batch.batch_backend import BatchBackend, STOP_REASON
from llmops.jobs.backends.sagemaker.sagemaker_backend import SageMakerTrainingBackend
from llmops.jobs.spec import JobSpec, job_name
from llmops.jobs.watch import JobWatch
from tests.aws_fixtures import IMAGE, REGION, ROOT, free_port, sagemaker_settings, wait_http
from tests.chaos.fake_aws import ChaosClient, FakeAws
from tests.chaos.multinode import batch_queue as create_batch_queue, connected
from tests.test_jobs import pid_alive

CONN = "llmops_chaos"
BUCKET = "llmops-chaos"
QUEUE = "llmops-chaos-queue"


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """One fake AWS for the module, in this process, with an Airflow connection to its proxy."""
    server = FakeAws(free_port(), tmp_path_factory.mktemp("fake-aws"), pending_seconds=0.5,
                     stop_grace_seconds=2, stopping_seconds=0.5).start()
    client(server, "s3").create_bucket(Bucket=BUCKET)
    try:
        with connected(server, CONN):
            yield server
    finally:
        server.stop()


@pytest.fixture()
def chaos(fake):
    control = ChaosClient(fake.url)
    control.clear()
    yield control
    control.clear()


@pytest.fixture()
def visible_pending(chaos):
    """Jobs stay pending long enough for the first poll to see it on a loaded machine (the first
    describe after a submit was measured to come 1.5 s late at load 5): the module's 0.5 s
    pending phase keeps the other tests fast."""
    chaos.config(pending_seconds=3)
    yield
    chaos.config(pending_seconds=0.5)


@pytest.fixture()
def no_backoff(monkeypatch):
    """Retries without their sleeps: what is retried is botocore's decision, how long it waits is not
    under test."""
    from botocore.retries import standard

    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount", lambda self, context: 0.01)


def client(fake: FakeAws, service: str, attempts: int = 3, **config):
    return boto3.client(service, endpoint_url=fake.url, region_name=REGION, aws_access_key_id="testing",
                        aws_secret_access_key="testing",
                        config=Config(retries={"mode": "standard", "total_max_attempts": attempts}, **config))


def injections(chaos: ChaosClient, operation: str, since: float = 0.0) -> int:
    return sum(1 for i in chaos.report()["injections"] if i["operation"] == operation and i["at"] >= since)


# -- faults --------------------------------------------------------------------------------------

def test_no_rules_is_moto_unchanged(fake, chaos):
    s3 = client(fake, "s3")
    s3.put_object(Bucket=BUCKET, Key="plain/a.txt", Body=b"hello")
    s3.upload_file(__file__, BUCKET, "plain/this.py")   # chunked transfer with a checksum trailer
    assert s3.get_object(Bucket=BUCKET, Key="plain/a.txt")["Body"].read() == b"hello"
    assert s3.head_object(Bucket=BUCKET, Key="plain/this.py")["ContentLength"] == Path(__file__).stat().st_size
    assert client(fake, "sagemaker").list_training_jobs(NameContains="nothing")["TrainingJobSummaries"] == []
    assert client(fake, "sts").get_caller_identity()["Account"] == "123456789012"
    report = chaos.report()
    assert report["injections"] == [] and report["operations"]["PutObject"] >= 1
    assert report["operations"]["GetCallerIdentity"] == 1


def test_s3s_bandwidth_cap_and_first_byte_latency_apply_per_connection(fake, chaos):
    """The simulated S3 link (s3_mb_per_s_per_connection, s3_first_byte_ms): an 8 MB download at
    20 MB/s with 150 ms to the first byte takes at least 0.55 s, an upload as long, two downloads
    on two connections at once each get the whole cap (it is per connection, as S3's is: a
    shared cap would hold each to 0.95 s), a small request pays the latency, and with both at 0
    the same download is several times faster. Other services are untouched."""
    import concurrent.futures

    s3 = client(fake, "s3")
    body = os.urandom(8_000_000)
    s3.put_object(Bucket=BUCKET, Key="link/obj", Body=body)

    def get() -> float:
        t0 = time.perf_counter()
        assert s3.get_object(Bucket=BUCKET, Key="link/obj")["Body"].read() == body
        return time.perf_counter() - t0

    free = min(get() for _ in range(2))
    chaos.config(s3_mb_per_s_per_connection=20, s3_first_byte_ms=150)
    try:
        capped = get()
        assert 0.15 + 8 / 20 <= capped < 0.55 + 2.0, capped
        assert capped > 3 * free, (capped, free)
        t0 = time.perf_counter()
        s3.put_object(Bucket=BUCKET, Key="link/up", Body=body)
        assert time.perf_counter() - t0 >= 0.55
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            both = list(pool.map(lambda _: get(), range(2)))
        # two connections at once: each at its own cap, not half of one
        assert min(both) >= 0.55 and max(both) < 0.15 + 2 * 8 / 20, both
        t0 = time.perf_counter()
        s3.head_object(Bucket=BUCKET, Key="link/obj")
        assert time.perf_counter() - t0 >= 0.15
        sts = client(fake, "sts")

        def identity() -> float:
            t0 = time.perf_counter()
            sts.get_caller_identity()
            return time.perf_counter() - t0

        # the quickest of three: one call can take 0.3 s on a loaded machine (CI), but the delay
        # under test would hold every one of them to 0.15 s or more
        assert min(identity() for _ in range(3)) < 0.15
    finally:
        chaos.config(s3_mb_per_s_per_connection=0, s3_first_byte_ms=0)
    assert get() < capped / 3


@pytest.mark.parametrize("service, call, operation, code", [
    ("sagemaker", lambda c: c.describe_training_job(TrainingJobName="x"), "DescribeTrainingJob",
     "ThrottlingException"),
    ("logs", lambda c: c.get_log_events(logGroupName="g", logStreamName="s"), "GetLogEvents",
     "ThrottlingException"),
    ("batch", lambda c: c.describe_jobs(jobs=["x"]), "DescribeJobs", "TooManyRequestsException"),
    ("s3", lambda c: c.list_objects_v2(Bucket=BUCKET), "ListObjectsV2", "SlowDown"),
])
def test_a_throttling_storm_is_retried_then_raised(fake, chaos, no_backoff, service, call, operation, code):
    start = time.time()
    chaos.faults([{"operations": [operation], "kind": "throttle", "rate": 1.0, "seconds": 60}])
    with pytest.raises(ClientError) as err:
        call(client(fake, service, attempts=3))
    assert err.value.response["Error"]["Code"] == code
    # botocore classified it as retryable: three attempts, each one an injection.
    assert err.value.response["ResponseMetadata"]["RetryAttempts"] == 2
    assert injections(chaos, operation, since=start) == 3


def test_a_few_503s_and_500s_are_retried_through(fake, chaos, no_backoff):
    before = len(chaos.report()["injections"])   # the record keeps every injection of the server
    chaos.faults([{"operations": ["List*"], "kind": "503", "count": 1},
                  {"operations": ["ListTrainingJobs"], "kind": "500", "count": 1}])
    answer = client(fake, "sagemaker", attempts=3).list_training_jobs()
    assert answer["ResponseMetadata"]["RetryAttempts"] == 2
    assert [i["kind"] for i in chaos.report()["injections"][before:]] == ["503", "500"]
    chaos.faults([{"operations": ["DescribeJobs"], "kind": "503", "rate": 0.5, "seed": 1, "seconds": 0.5}])
    time.sleep(0.6)   # the window has passed: no more faults
    start = time.time()
    client(fake, "batch", attempts=1).describe_jobs(jobs=["nothing"])
    assert injections(chaos, "DescribeJobs", since=start) == 0
    with pytest.raises(RuntimeError, match="fault kind 'slow'"):
        chaos.faults([{"operations": ["*"], "kind": "slow"}])


def test_a_per_job_window_opens_at_each_jobs_first_call_and_outlives_a_re_push(monkeypatch):
    """A narrowed rule with `per_job_seconds` hits a job that comes late for as long as one
    that came first; pushing the same rule again (another row's rules changed) keeps the clocks."""
    from tests.chaos.fake_aws import faults as fake_faults

    clock = [1000.0]
    monkeypatch.setattr(fake_faults.time, "time", lambda: clock[0])
    faults = fake_faults.Faults()
    rule = {"operations": ["DescribeJobs"], "kind": "503", "jobs": ["run_id=r1"], "per_job_seconds": 60}
    faults.set([rule])
    call = fake_faults.Call("batch", "DescribeJobs", "rest-json")
    early, late = (lambda: {"job-a", "run_id=r1"}), (lambda: {"job-b", "run_id=r1"})
    assert faults.pick(call, early) is not None
    clock[0] += 50
    faults.set([rule])   # re-pushed: job-a's window still closes at 1060
    assert faults.pick(call, early) is not None
    clock[0] += 20       # 1070: job-a's window has closed; job-b's first call opens its own
    assert faults.pick(call, early) is None
    assert faults.pick(call, late) is not None
    clock[0] += 59
    assert faults.pick(call, late) is not None
    clock[0] += 2
    assert faults.pick(call, late) is None
    assert faults.pick(call, lambda: {"job-c", "run_id=r2"}) is None, "another run's job is not narrowed in"
    with pytest.raises(ValueError, match='"per_job_seconds" needs "jobs"'):
        faults.set([{"operations": ["*"], "kind": "503", "per_job_seconds": 5}])


def test_resets_and_timeouts_are_connection_errors(fake, chaos, no_backoff):
    start = time.time()
    chaos.faults([{"operations": ["ListTrainingJobs"], "kind": "reset"}])
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        client(fake, "sagemaker", attempts=2).list_training_jobs()
    assert injections(chaos, "ListTrainingJobs", since=start) == 2   # retried once
    chaos.faults([{"operations": ["GetObject"], "kind": "timeout", "hold_seconds": 2}])
    with pytest.raises(ReadTimeoutError):
        client(fake, "s3", attempts=1, read_timeout=0.5).get_object(Bucket=BUCKET, Key="plain/a.txt")


# -- SageMaker training jobs ---------------------------------------------------------------------

def sample(prefix: str, max_run_seconds: int = 3600, **config) -> JobSpec:
    return JobSpec(stage="sample", entrypoint="tests.sample_job", name=job_name(prefix, prefix=prefix),
                   config=config, instance_type="ml.m5.xlarge", max_run_seconds=max_run_seconds)


def wait_state(backend, handle, states: set[JobState], timeout: float = 45.0) -> tuple[object, list]:
    seen, deadline = [], time.monotonic() + timeout
    while True:
        status = backend.status(handle)
        if not seen or seen[-1] != status.state:
            seen.append(status.state)
        if status.state in states:
            return status, seen
        assert time.monotonic() < deadline, f"still {status.state} ({status.message}) after {timeout} s"
        time.sleep(0.3)


def sagemaker_backend() -> SageMakerTrainingBackend:
    return SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(BUCKET, aws_conn_id=CONN)})


def test_a_training_job_runs_logs_live_and_completes(fake, chaos, visible_pending):
    backend = sagemaker_backend()
    handle = backend.submit(sample("sm-chaos-ok", seconds=3))
    status, seen = wait_state(backend, handle, {JobState.RUNNING})
    assert seen[0] is JobState.PENDING and status.details["secondary"] == "Training"
    live = []
    while not any("working 1" in line for line in live):   # lines arrive while it runs
        lines, cursor = backend.read_logs(handle, None)
        live = lines
        time.sleep(0.3)
    status, _ = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.result["metrics"] == {"answer": 42.0}
    lines, _ = backend.read_logs(handle, None)
    assert "sample job starting" in "\n".join(lines) and any("result written to s3://" in line for line in lines)
    described = client(fake, "sagemaker").describe_training_job(TrainingJobName=handle["job_name"])
    assert described["TrainingJobStatus"] == "Completed"
    assert [t["Status"] for t in described["SecondaryStatusTransitions"]] == \
        ["Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert described["TrainingEndTime"] > described["TrainingStartTime"]
    # billed: Downloading to the end of Uploading, whole seconds; the ledger's cost takes it
    running = status.details["ended_at"] - status.details["started_at"]
    assert described["BillableTimeInSeconds"] == described["TrainingTimeInSeconds"] >= running
    assert status.details["billed_seconds"] == described["BillableTimeInSeconds"]
    job = chaos.job(handle["job_name"])
    assert job["exit_code"] == 0 and job["log_lines"] == len(lines) and job["stopped_by"] is None
    with pytest.raises(ClientError, match="ResourceInUse"):   # SageMaker refuses a second job of a name
        client(fake, "sagemaker").create_training_job(**json.loads(
            (fake.workdir / "jobs" / handle["job_name"] / "request.json").read_text()))


def test_a_rule_narrowed_to_jobs_fires_only_for_calls_about_them(fake, chaos):
    """`jobs` globs match the name or a `tag=value` of the job a call is about; a call about
    another job, or about none (S3), is never touched: one row's faults beside another's."""
    backend = sagemaker_backend()
    mine = backend.submit(sample("sm-chaos-mine", seconds=1).replace(stage="pretrain"))
    other = backend.submit(sample("sm-chaos-other", seconds=1))
    sm, s3 = client(fake, "sagemaker", attempts=1), client(fake, "s3", attempts=1)
    since = time.time()
    for jobs in (["llmops:stage=pretrain"], ["sm-chaos-mine-*"]):
        chaos.faults([{"operations": ["*"], "kind": "throttle", "jobs": jobs}])
        with pytest.raises(ClientError, match="Throttl"):
            sm.describe_training_job(TrainingJobName=mine["job_name"])
        assert sm.describe_training_job(TrainingJobName=other["job_name"])["TrainingJobName"] == other["job_name"]
        s3.list_objects_v2(Bucket=BUCKET)
    assert {i["operation"] for i in chaos.report()["injections"] if i["at"] >= since} == {"DescribeTrainingJob"}
    chaos.clear()
    for handle in (mine, other):
        wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED})


def test_a_stopped_training_job_stops_its_processes(fake, chaos, tmp_path):
    backend = sagemaker_backend()
    marker = tmp_path / "marker"
    handle = backend.submit(sample("sm-chaos-stop", seconds=60, spawn_child=True, marker_dir=str(marker)))
    wait_state(backend, handle, {JobState.RUNNING})
    while not (marker / "child_pid").exists():
        time.sleep(0.2)
    child, stage = int((marker / "child_pid").read_text()), int((marker / "starts").read_text().split()[0])
    assert pid_alive(child) and pid_alive(stage)
    backend.stop(handle)
    sm = client(fake, "sagemaker")
    assert sm.describe_training_job(TrainingJobName=handle["job_name"])["TrainingJobStatus"] == "Stopping"
    status, _ = wait_state(backend, handle, {JobState.STOPPED, JobState.FAILED, JobState.SUCCEEDED})
    assert status.state is JobState.STOPPED, status.message
    assert not pid_alive(stage) and not pid_alive(child), "the stage and its own child die with the job"
    job = chaos.job(handle["job_name"])
    assert job["stopped_by"] == "client" and len(job["stop_requests"]) == 1
    assert "Botocore" in job["stop_requests"][0]["user_agent"]
    with pytest.raises(ClientError, match="ValidationException"):   # only an InProgress job stops
        sm.stop_training_job(TrainingJobName=handle["job_name"])


def test_a_crash_and_a_deadline_end_training_jobs(fake, chaos):
    backend = sagemaker_backend()
    crashing = backend.submit(sample("sm-chaos-crash", seconds=60))
    late = backend.submit(sample("sm-chaos-late", max_run_seconds=3, seconds=60))
    wait_state(backend, crashing, {JobState.RUNNING})
    chaos.fail(crashing["job_name"], reason="the GPU fell off the bus")
    status, _ = wait_state(backend, crashing, {JobState.FAILED, JobState.STOPPED, JobState.SUCCEEDED})
    assert status.state is JobState.FAILED and "AlgorithmError: the GPU fell off the bus" in status.message
    status, _ = wait_state(backend, late, {JobState.FAILED, JobState.STOPPED, JobState.SUCCEEDED})
    assert status.state is JobState.STOPPED and "MaxRuntimeExceeded" in status.message
    assert chaos.job(late["job_name"])["stopped_by"] == "deadline"


# -- AWS Batch -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batch_queue(fake):
    return create_batch_queue(client(fake, "batch"), client(fake, "iam"), QUEUE)


def batch_backend() -> BatchBackend:
    return BatchBackend(settings={"batch": {"aws_conn_id": CONN, "job_queue": QUEUE, "image": IMAGE,
                                            "staging_uri": f"s3://{BUCKET}/batch-staging"}})


def test_a_batch_job_runs_with_torchrun_and_a_terminate_fails_it(fake, chaos, batch_queue, tmp_path,
                                                                 visible_pending):
    backend = batch_backend()
    handle = backend.submit(sample("batch-chaos-ok", seconds=2).replace(instance_type="m5.xlarge"))
    _, seen = wait_state(backend, handle, {JobState.RUNNING})
    assert seen == [JobState.PENDING, JobState.RUNNING]
    marker = tmp_path / "marker"
    doomed = backend.submit(sample("batch-chaos-stop", seconds=60, marker_dir=str(marker))
                            .replace(instance_type="m5.xlarge"))
    status, _ = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED}, timeout=50)
    assert status.state is JobState.SUCCEEDED, status.message
    assert status.result["metrics"] == {"answer": 42.0}
    lines, _ = backend.read_logs(handle, None)
    text = "\n".join(lines)
    assert "torch.distributed.run --standalone" in text and "sample job starting" in text
    # The provider's reader finds the same stream in the job's attempts.
    from airflow.providers.amazon.aws.hooks.batch_client import BatchClientHook

    infos = BatchClientHook(aws_conn_id=CONN).get_job_all_awslogs_info(handle["job_id"])
    assert [i["awslogs_group"] for i in infos] == ["/aws/batch/job"]
    assert infos[0]["awslogs_stream_name"] == chaos.job(handle["job_id"])["streams"][0]

    wait_state(backend, doomed, {JobState.RUNNING})
    while not (marker / "starts").exists():
        time.sleep(0.2)
    backend.stop(doomed)
    status, _ = wait_state(backend, doomed, {JobState.STOPPED, JobState.FAILED, JobState.SUCCEEDED})
    assert status.state is JobState.STOPPED, status.message
    job = chaos.job(doomed["job_id"])
    assert job["status"] == "FAILED" and job["reason"] == STOP_REASON and job["stopped_by"] == "client"
    assert job["stop_requests"][0]["operation"] == "TerminateJob"
    described = client(fake, "batch").describe_jobs(jobs=[doomed["job_id"]])["jobs"][0]
    assert described["statusReason"] == STOP_REASON and described["stoppedAt"] > described["startedAt"]


def test_a_batch_job_paused_on_request_tells_its_step(fake, chaos, batch_queue):
    """A stage that paused on request (rank 0's result says so; torchrun exits 1 for it) ends the
    Batch job with PAUSED_EXIT, and the backend reads the result the entry published: the task
    can say "paused at step N" on Batch as it does locally (llmops.airflow.operators.job_pause)."""
    from llmops.airflow.operators.job_pause import paused

    backend = batch_backend()
    handle = backend.submit(sample("batch-pause", pause_at_step=6).replace(instance_type="m5.xlarge"))
    status, _ = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED},
                           timeout=60)
    assert status.state is JobState.FAILED and status.details["exit_code"] == 77, status
    assert "(exit code 77)" in status.message
    assert paused(status) == (True, 6)
    assert chaos.job(handle["job_id"])["exit_code"] == 77


# -- the command line ----------------------------------------------------------------------------

def test_the_command_line_serves_until_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.chaos.fake_aws", "--port", str(port),
                             "--workdir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/_chaos/health")
        ready = json.loads(proc.stdout.readline())
        assert ready["connection"]["extra"]["endpoint_url"] == f"http://127.0.0.1:{port}"
        assert ChaosClient(ready["url"]).config(pending_seconds=1)["pending_seconds"] == 1.0
        with pytest.raises(RuntimeError, match="unknown config keys"):
            ChaosClient(ready["url"]).config(pending=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- lost responses: the request took effect, the client never heard --------------------------

@pytest.fixture()
def held_pending(chaos):
    """Jobs stay pending (no containers run): what is under test is how many exist."""
    chaos.config(pending_seconds=60)
    yield
    chaos.config(pending_seconds=0.5)


def live(chaos: ChaosClient, name: str) -> list[dict]:
    return [j for j in chaos.report()["jobs"] if j["name"] == name and j["ended_at"] is None
            and not j["stop_requests"]]


@pytest.mark.parametrize("framing", [b"Content-Length: 100\r\n\r\n0123456789",
                                     b"Transfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n"],
                         ids=["length", "chunked"])
def test_a_request_cut_short_by_its_dying_client_takes_no_effect(fake, chaos, framing):
    """A worker SIGKILLed while it sends leaves half a request: the service acts on none of it
    (here a PutObject of 10 of its 100 bytes, or of its first chunk only, writes no object) and
    goes on serving."""
    url = urlsplit(fake.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(f"PUT /{BUCKET}/cut/short.txt HTTP/1.1\r\nHost: {url.netloc}\r\n".encode() + framing)
        sock.shutdown(socket.SHUT_WR)   # the client is gone
        assert sock.recv(1024) == b""   # no answer: closed
    s3 = client(fake, "s3")
    with pytest.raises(ClientError, match="404|Not Found"):
        s3.head_object(Bucket=BUCKET, Key="cut/short.txt")
    s3.put_object(Bucket=BUCKET, Key="cut/whole.txt", Body=b"whole")
    assert s3.get_object(Bucket=BUCKET, Key="cut/whole.txt")["Body"].read() == b"whole"


def test_a_lost_response_is_resent_by_botocore_after_the_request_took_effect(fake, chaos, no_backoff):
    start = time.time()
    chaos.faults([{"operations": ["PutObject"], "kind": "lost", "count": 1}])
    s3 = client(fake, "s3", attempts=2)
    # The first send wrote the object; botocore's resend finds it there.
    with pytest.raises(ClientError, match="PreconditionFailed") as err:
        s3.put_object(Bucket=BUCKET, Key="lost/a.txt", Body=b"once", IfNoneMatch="*")
    assert err.value.response["ResponseMetadata"]["RetryAttempts"] == 1
    assert injections(chaos, "PutObject", since=start) == 1
    assert s3.get_object(Bucket=BUCKET, Key="lost/a.txt")["Body"].read() == b"once"


def test_a_lost_submit_job_response_leaves_one_live_multi_node_job(fake, chaos, batch_queue, held_pending):
    """AWS accepted SubmitJob, the answer was lost, botocore resent it: two multi-node jobs. The
    backend terminates the copy it did not get the id of; one job lives, the one it watches."""
    backend = batch_backend()
    spec = sample("batch-chaos-lost", seconds=1).replace(instance_type="m5.xlarge", instance_count=2)
    chaos.faults([{"operations": ["SubmitJob"], "kind": "lost", "count": 1}])
    handle = backend.submit(spec)
    jobs = [j for j in chaos.report()["jobs"] if j["name"] == handle["job_name"]]
    assert len(jobs) == 2, "the lost response made a second job"
    [copy] = [j for j in jobs if j["job_id"] != handle["job_id"]]
    ended = chaos.wait(copy["job_id"], {"FAILED"}, timeout=20)
    assert ended["reason"].endswith("duplicate submission") and ended["stopped_by"] == "client"
    assert [j["job_id"] for j in live(chaos, handle["job_name"])] == [handle["job_id"]]
    assert backend.status(handle).state is JobState.PENDING
    # A lost TerminateJob answer: the resend is accepted, the job ends once.
    chaos.faults([{"operations": ["TerminateJob"], "kind": "lost", "count": 1}])
    backend.stop(handle)
    stopped = chaos.wait(handle["job_id"], {"FAILED"}, timeout=20)
    assert stopped["reason"] == STOP_REASON and len(stopped["stop_requests"]) >= 2


def test_a_lost_create_training_job_response_leaves_one_job_this_try_owns(fake, chaos, held_pending):
    backend = sagemaker_backend()
    spec = sample("sm-chaos-lost", seconds=1)
    chaos.faults([{"operations": ["CreateTrainingJob"], "kind": "lost", "count": 1}])
    handle = backend.submit(spec)
    assert handle["reattached"] is False   # ResourceInUse on the resend, and the job is ours
    assert [j["name"] for j in chaos.report()["jobs"] if j["name"].startswith("sm-chaos-lost")] == \
        [handle["job_name"]]
    assert injections(chaos, "CreateTrainingJob") >= 1
    chaos.faults([{"operations": ["StopTrainingJob"], "kind": "lost", "count": 1}])
    backend.stop(handle)   # the resent stop finds it Stopping, which SageMaker accepts
    status, _ = wait_state(backend, handle, {JobState.STOPPED, JobState.FAILED, JobState.SUCCEEDED})
    assert status.state is JobState.STOPPED, status.message


# -- capacity waits: visible, and bounded by max_queue_seconds ------------------------------------

def test_a_capacity_wait_shows_the_services_reason_and_max_queue_seconds_ends_it(fake, chaos,
                                                                                 batch_queue):
    """Simulated: each job is held for capacity (Batch RUNNABLE with statusReason CAPACITY:...,
    SageMaker Starting with EC2's capacity message). The real watch says so once, with the
    service's words, and stops the job when it has waited past max_queue_seconds."""
    from tests.chaos.fake_aws import BATCH_CAPACITY, SM_CAPACITY

    chaos.config(capacity_wait_seconds=120)
    try:
        for backend, spec, words in (
                (batch_backend(), sample("batch-capacity").replace(instance_type="m5.xlarge"),
                 BATCH_CAPACITY),
                (sagemaker_backend(), sample("sm-capacity"), SM_CAPACITY)):
            handle = backend.submit(spec)
            watch = JobWatch(backend, handle, poll_interval=0.5, max_run_seconds=3600,
                             max_queue_seconds=4)
            waiting = []
            while True:
                step = watch.poll()
                waiting += [step.waiting] if step.waiting else []
                if step.done:
                    break
                time.sleep(step.delay)
            assert step.status.state is JobState.STOPPED, step.status.message
            assert "max_queue_seconds" in step.status.message and words in step.status.message
            assert len([w for w in waiting if words in w]) == 1, waiting   # said once, in its words
            job = chaos.job(handle["job_name"])
            assert job["started_at"] is None and job["stop_requests"], job   # never ran, was stopped
    finally:
        chaos.config(capacity_wait_seconds=0)


# -- eventual consistency: a job the service does not show yet -------------------------------------

@pytest.fixture()
def unseen_jobs(chaos, monkeypatch):
    """Simulated: for `consistency_seconds` after its create/submit a job is unknown to
    DescribeTrainingJob (ValidationException "Requested resource not found."), left out of Batch
    DescribeJobs, and missing from ListTrainingJobs / ListJobs. Long here (100 s) so that the
    whole test runs inside the window; Batch's submit stops looking for its job after 1 s instead
    of 60 (what is under test is what comes after)."""
    from llmops.jobs.backends.batch import batch_backend as batch

    monkeypatch.setattr(batch, "SETTLE_SECONDS", 1.0)
    chaos.config(consistency_seconds=100)
    yield
    chaos.config(consistency_seconds=0)


def test_a_job_not_visible_yet_is_waited_for_not_failed_nor_submitted_again(fake, chaos, batch_queue,
                                                                              unseen_jobs):
    submitted = []
    for backend, spec in ((sagemaker_backend(), sample("sm-unseen", seconds=1)),
                          (batch_backend(), sample("batch-unseen", seconds=1).replace(instance_type="m5.xlarge"))):
        handle = backend.submit(spec)
        submitted.append((backend, handle))
        if backend.name == "sagemaker":
            with pytest.raises(ClientError, match="Requested resource not found"):
                client(fake, "sagemaker").describe_training_job(TrainingJobName=handle["job_name"])
            assert client(fake, "sagemaker").list_training_jobs(
                NameContains=handle["job_name"])["TrainingJobSummaries"] == []
        else:
            assert client(fake, "batch").describe_jobs(jobs=[handle["job_id"]])["jobs"] == []
            assert client(fake, "batch").list_jobs(jobQueue=QUEUE, filters=[
                {"name": "JOB_NAME", "values": [handle["job_name"]]}])["jobSummaryList"] == []
        status = backend.status(handle)
        assert status.state is JobState.PENDING and "not visible yet" in status.message, status.message
        # A retry of the task inside the window finds the same job, and starts no other.
        again = backend.submit(spec)
        assert again["job_name"] == handle["job_name"] and again.get("job_id") == handle.get("job_id")
        assert backend.status(again).state is JobState.PENDING
        assert [j["job_id"] for j in chaos.report()["jobs"] if j["name"] == handle["job_name"]] == \
            [handle.get("job_id") or chaos.job(handle["job_name"])["job_id"]]
    chaos.config(consistency_seconds=0)   # the reads catch up: both run to the end
    for backend, handle in submitted:
        status, _ = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})
        assert status.state is JobState.SUCCEEDED, status.message


# -- HyperPod on the simulated EKS ---------------------------------------------------------------

@pytest.fixture()
def eks_backend(fake, tmp_path, monkeypatch):
    """(the simulated EKS cluster, a HyperPod backend on it) with the fake AWS for S3; the
    backend's settings are the test's (`make(staging prefix, **settings)`)."""
    from llmops.jobs.backends.hyperpod import hyperpod_backend as hyperpod
    from llmops.jobs.backends.hyperpod import hyperpod_hook
    from tests.chaos.fake_aws import CREDENTIALS
    from tests.chaos.fake_eks import FakeEks

    eks = FakeEks(tmp_path / "eks", {**CREDENTIALS, "AWS_ENDPOINT_URL": fake.moto_url,
                                     "AWS_ENDPOINT_URL_S3": fake.moto_url})
    monkeypatch.setattr(hyperpod_hook, "connect", lambda *key: eks)
    monkeypatch.setattr(hyperpod_hook, "_CLIENTS", {})

    def make(prefix: str, **settings):
        return eks, hyperpod.HyperPodBackend(settings={"hyperpod": {
            "aws_conn_id": CONN, "staging_uri": f"s3://{BUCKET}/{prefix}", "image": IMAGE,
            "eks_cluster_name": "hp", **settings}})
    yield make
    eks.shutdown()


def test_a_lost_hyperpod_create_answer_is_resent_and_leaves_one_job_this_try_owns(fake, chaos, eks_backend):
    """Simulated (tests/chaos/fake_eks.py): the API server creates the job, the connection drops
    before its answer (urllib3's ProtocolError; a POST is not resent by urllib3). The backend sends
    the create again, the API server answers AlreadyExists (409), and the job's token annotation
    says it is this try's: one job, a submit (not a reattach) for the ledger."""
    eks, backend = eks_backend("hp-lost", kind="HyperPodPyTorchJob")
    eks.lose_responses("create_namespaced_custom_object", 1)
    handle = backend.submit(sample("hp-lost", seconds=1).replace(instance_type="ml.m5.xlarge"))
    creates = [kw for method, kw in eks.calls if method == "create_namespaced_custom_object"]
    assert len(creates) == 2, "the create whose answer was lost is sent again"
    assert [j.name for j in eks.jobs.values()] == [handle["k8s_name"]]
    assert handle["reattached"] is False
    status, _ = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})
    assert status.state is JobState.SUCCEEDED, status.message


def test_a_job_kueue_preempts_waits_in_kueues_words_and_runs_again_as_the_same_job(fake, chaos, tmp_path,
                                                                                     eks_backend):
    """Simulated (tests/chaos/fake_eks.py `preempt`): Kueue evicts a running HyperPod job's
    Workload for a higher-priority one, its pods are deleted, and it is admitted again later on
    fresh disks. The watch the task runs reads that as a wait in Kueue's words (never a stop or a
    failure, so no new attempt is submitted), and the same job then runs to its end."""
    eks, backend = eks_backend("hp-preempt", kind="PyTorchJob", queue_name="research-queue")
    marker = tmp_path / "marker"
    handle = backend.submit(sample("hp-preempt", seconds=4, marker_dir=str(marker))
                            .replace(instance_type="ml.m5.xlarge"))
    watch = JobWatch(backend, handle, poll_interval=0.3, max_run_seconds=600)
    said, preempted, deadline = [], False, time.monotonic() + 120
    while not (step := watch.poll()).done:
        said += [step.waiting] if step.waiting else []
        if not preempted and (marker / "starts").exists():
            eks.preempt(handle["k8s_name"], hold_seconds=3)
            preempted = True
        assert time.monotonic() < deadline, said
        time.sleep(0.3)
    assert step.status.state is JobState.SUCCEEDED, step.status.message
    assert any(w.startswith("waiting: suspended by Kueue: Preempted to accommodate a workload")
               for w in said), said
    assert len((marker / "starts").read_text().split()) == 2, "its pods ran again after the eviction"
    assert eks.job(handle["k8s_name"]).preemptions == 1
    assert [j["name"] for j in eks.report()["jobs"]] == [handle["k8s_name"]], "one job, never resubmitted"


# -- a sustained outage of the read calls -----------------------------------------------------------

OUTAGE_SECONDS = 20.0   # the 10 minutes, compressed 30x (see the test's docstring)


@pytest.mark.parametrize("which", ["sagemaker", "batch"])
def test_a_sustained_outage_on_reads_neither_fails_nor_stops_the_job_and_the_watch_picks_up(
        fake, chaos, batch_queue, no_backoff, which):
    """Simulated: for OUTAGE_SECONDS every Describe* / List* call of SageMaker and Batch answers 503
    and every CloudWatch Logs call has its connection reset; the job ends in the
    middle of it. Compression: botocore's own budget (11 attempts, llmops.infra.aws.retry) is spent
    in milliseconds here (its backoff zeroed), so a 20 s outage outlasts it dozens of times, as 10
    minutes outlast its 20 s-capped backoff on AWS; the watch's own backoff is capped at 2 s (300
    s in production) so the test polls through the outage about as often. The real JobWatch (what
    the worker and the trigger run) must keep waiting without stopping the job, then report the
    job's end with its log, no line twice."""
    from llmops.jobs.errors import Backoff

    backend = sagemaker_backend() if which == "sagemaker" else batch_backend()
    spec = sample(f"{which}-outage", seconds=3)
    handle = backend.submit(spec if which == "sagemaker" else spec.replace(instance_type="m5.xlarge"))
    wait_state(backend, handle, {JobState.RUNNING})
    watch = JobWatch(backend, handle, poll_interval=0.5, max_run_seconds=3600,
                     backoff=Backoff(base=0.5, cap=2.0))
    since = time.time()
    chaos.faults([{"operations": ["Describe*", "List*"], "services": ["sagemaker", "batch"], "kind": "503",
                   "seconds": OUTAGE_SECONDS},
                  {"operations": ["*"], "services": ["logs"], "kind": "reset", "seconds": OUTAGE_SECONDS}])
    lines, warnings, errors = [], [], []
    while True:
        step = watch.poll()
        lines += step.lines
        warnings += step.warnings
        errors += [step.error] if step.error else []
        if step.done or step.error:
            break
        assert time.time() < since + OUTAGE_SECONDS + 60, "the watch did not pick up after the outage"
        time.sleep(step.delay)
    assert not errors and step.status.state is JobState.SUCCEEDED, (errors, step.status)
    assert time.time() >= since + OUTAGE_SECONDS - 1, "the job's end was read while the reads were down"
    assert any("could not read the job's status" in w for w in warnings)
    reads = injections(chaos, "DescribeTrainingJob" if which == "sagemaker" else "DescribeJobs", since)
    assert reads >= 3 * 11, f"{reads} failed describes: the outage did not outlast botocore's budget"
    job = chaos.job(handle["job_name"])
    assert job["stop_requests"] == [] and job["exit_code"] == 0   # never stopped: it ran to its end
    assert sum("sample job starting" in line for line in lines) == 1
    assert sum("working 2" in line for line in lines) == 1


# -- log lines that arrive after the job's end -------------------------------------------------------

@pytest.mark.parametrize("which", ["sagemaker", "batch"])
def test_log_lines_delivered_after_the_end_still_close_the_task_log_once(fake, chaos, batch_queue, which):
    """Simulated (`log_delay_seconds`): every line reaches CloudWatch 2 s after the container printed
    it, so when Describe* first says the job ended its last lines are not there yet. The watch
    (what the worker and the trigger run) reads once more before it reports the end: the lines it
    showed are the job's whole stream, in order, none twice, and the log tail a failure's message
    quotes ends with the job's last line."""
    backend = sagemaker_backend() if which == "sagemaker" else batch_backend()
    chaos.config(log_delay_seconds=2)
    try:
        for spec, last in ((sample(f"{which}-late-ok", seconds=1), "result written to s3://"),
                           (sample(f"{which}-late-bad", seconds=1, exit_code=3), "sample job failing on purpose")):
            handle = backend.submit(spec if which == "sagemaker" else spec.replace(instance_type="m5.xlarge"))
            watch = JobWatch(backend, handle, poll_interval=5, max_run_seconds=3600)
            shown = []
            while not (step := watch.poll()).done:
                shown += step.lines
                time.sleep(step.delay)
            shown += step.lines
            tail = backend.log_tail(handle, 40)   # what the failure message quotes, read now
            assert chaos.job(handle["job_name"])["ended_at"] is not None
            assert any(last in line for line in shown), (step.status, shown[-3:])
            time.sleep(3)   # every line is in CloudWatch by now
            everything, _ = backend.read_logs(handle, None)
            assert shown == everything, "the task log is the job's whole stream, once"
            assert tail == everything[-40:]
    finally:
        chaos.config(log_delay_seconds=0)


# -- 503 SlowDown on the containers' own S3 traffic ----------------------------------------------------

SLOWDOWN = {"operations": ["PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload"],
            "kind": "throttle", "origin": "jobs"}   # S3's throttle: 503 SlowDown


def test_slow_down_on_a_jobs_own_writes_is_waited_out_and_touches_only_the_job(fake, chaos, batch_queue):
    """Simulated: the container's S3 calls go through the jobs' proxy port, and for 25 s every
    write there is answered 503 SlowDown (rules with origin "jobs"; the clients' port is left
    alone). The entry's result write must wait it out: botocore's default (5 tries, about 15 s at
    most) gave up inside the window and failed a job whose work was done."""
    backend = batch_backend()
    handle = backend.submit(sample("batch-slowdown", seconds=3, print_env=["AWS_ENDPOINT_URL_S3"])
                            .replace(instance_type="m5.xlarge"))
    deadline = time.monotonic() + 120
    while not any("working 0" in line for line in backend.read_logs(handle, None)[0]):
        assert time.monotonic() < deadline, "the job did not start working"
        time.sleep(0.3)
    chaos.faults([{**SLOWDOWN, "seconds": 25}])   # from before its result is written to its end
    since = time.time()
    status, _ = wait_state(backend, handle, {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}, timeout=120)
    assert status.state is JobState.SUCCEEDED, status.message
    lines, _ = backend.read_logs(handle, None)
    assert f"env AWS_ENDPOINT_URL_S3={fake.jobs_url}" in lines   # the job's S3 goes through the faults
    report = chaos.report()
    faulted = [i for i in report["injections"] if i["at"] >= since]
    assert faulted and {i["origin"] for i in faulted} == {"jobs"}, (faulted, report["job_operations"])
    assert chaos.job(handle["job_id"])["ended_at"] >= since + 20   # it waited the storm out


def test_slow_down_on_checkpoint_uploads_loses_no_checkpoint_and_blocks_no_step(fake, chaos, monkeypatch,
                                                                                  tmp_path):
    """The container's checkpoint mirror (tasks/train/checkpoint_s3.py) through the jobs' port, with
    every upload answered SlowDown for 30 s, longer than its fixed 8 tries (about 19 s of backoff):
    the save returns at once (the upload runs beside training), the upload waits the storm out, and
    the checkpoint is complete in S3 afterwards."""
    import torch

    from tasks.train import checkpoint as ckpt
    from tasks.train.checkpoint_s3 import S3Mirror

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", fake.jobs_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    chaos.faults([{**SLOWDOWN, "seconds": 30}])
    since = time.time()
    mirror = S3Mirror(f"s3://{BUCKET}/slowdown/checkpoints")
    saver = ckpt.Checkpointer(tmp_path / "local", keep=2, config={"run": 1}, mirror=mirror)
    blocked = saver.save(1, {"model": {"w": torch.arange(1000.0)}, "trainer": {"step": 1, "data_cursor": 1}})
    assert blocked < 5, f"training was blocked {blocked:.1f} s by a save"
    saver.wait()
    assert time.time() >= since + 25 and mirror.retries >= 8
    assert mirror.steps() == [1]
    assert {i["origin"] for i in chaos.report()["injections"] if i["at"] >= since} == {"jobs"}


# -- spot reclaims ---------------------------------------------------------------------------------

def test_a_reclaimed_managed_spot_job_is_interrupted_and_restarts_inside_the_same_job(fake, chaos, tmp_path):
    """Simulated (`/reclaim`): EC2 takes a managed spot job's capacity back; SageMaker shows
    SecondaryStatus Interrupted and starts the job again on a fresh instance, inside the same job
    (MaxWaitTimeInSeconds allows it). Our backend reads the interruption as a wait after the start,
    not as an end: no new attempt, no failure, and the same job completes."""
    backend = SageMakerTrainingBackend(settings={"sagemaker": sagemaker_settings(
        BUCKET, aws_conn_id=CONN, spot=True)})
    marker = tmp_path / "marker"
    handle = backend.submit(sample("sm-spot", seconds=4, marker_dir=str(marker)))
    wait_state(backend, handle, {JobState.RUNNING})
    while not (marker / "starts").exists():
        time.sleep(0.2)
    assert chaos.reclaim(handle["job_name"])["reclaimed"] is True
    seen, messages = [], []
    deadline = time.monotonic() + 90
    while (status := backend.status(handle)).state not in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED):
        if not seen or seen[-1] != status.state:
            seen.append(status.state)
            messages.append(status.message)
        assert time.monotonic() < deadline, status.message
        time.sleep(0.3)
    assert status.state is JobState.SUCCEEDED, status.message
    assert JobState.PENDING in seen and any("Interrupted" in m or "Starting" in m for m in messages), messages
    assert len((marker / "starts").read_text().split()) == 2   # its container ran twice, one job
    job = chaos.job(handle["job_name"])
    assert job["reclaims"] == 1 and [j["name"] for j in chaos.report()["jobs"]].count(handle["job_name"]) == 1
    described = client(fake, "sagemaker").describe_training_job(TrainingJobName=handle["job_name"])
    statuses = [t["Status"] for t in described["SecondaryStatusTransitions"]]
    assert statuses[statuses.index("Interrupted"):] == ["Interrupted", "Starting", "Downloading", "Training",
                                                         "Uploading", "Completed"], statuses
    # managed spot bills less than the time it ran (the simulator's share), and the backend says so
    assert described["BillableTimeInSeconds"] < described["TrainingTimeInSeconds"]
    assert status.details["billed_seconds"] == described["BillableTimeInSeconds"]


def test_a_timed_job_runs_no_container_writes_its_result_and_the_list_says_what_changed(fake, chaos):
    """The triggerer benchmark's jobs (benchmarks/triggerer_watch.py): with `timed_jobs` a job
    runs no process, only its SIM_RUN_SECONDS, logging into its stream and writing the result its
    entry would; LastModifiedTime moves only when its status does, and ListTrainingJobs filtered
    by it lists the jobs that changed since, as SageMaker's does (what a trigger's shared read
    relies on: llmops.jobs.backends.shared.ChangedSince)."""
    chaos.config(timed_jobs=True, timed_line_seconds=1.0)
    try:
        backend = sagemaker_backend()
        quick = backend.submit(sample("sm-timed-quick").replace(env={"SIM_RUN_SECONDS": "2"}))
        failing = backend.submit(sample("sm-timed-fail").replace(env={"SIM_RUN_SECONDS": "30", "SIM_EXIT_CODE": "3"}))
        status, _ = wait_state(backend, quick, {JobState.SUCCEEDED, JobState.FAILED})
        assert status.state is JobState.SUCCEEDED and status.result["timed"] is True
        lines, _ = backend.read_logs(quick, None)
        assert lines[0].endswith("started: runs 2 s") and lines[-1].endswith("exit code 0")
        sm = client(fake, "sagemaker")
        running = sm.describe_training_job(TrainingJobName=failing["job_name"])
        assert running["SecondaryStatus"] == "Training" and not chaos.job(failing["job_name"])["exit_code"]
        time.sleep(1.5)   # botocore sends the filter's time in whole seconds
        assert sm.describe_training_job(TrainingJobName=failing["job_name"])["LastModifiedTime"] == \
            running["LastModifiedTime"]   # still training: unchanged
        since = time.time()
        assert sm.list_training_jobs(LastModifiedTimeAfter=since, MaxResults=100)["TrainingJobSummaries"] == []
        listed = sm.list_training_jobs(MaxResults=100)["TrainingJobSummaries"]
        assert {quick["job_name"], failing["job_name"]} <= {s["TrainingJobName"] for s in listed}
        backend.stop(failing)
        wait_state(backend, failing, {JobState.STOPPED, JobState.FAILED})
        changed = sm.list_training_jobs(LastModifiedTimeAfter=since, MaxResults=100)["TrainingJobSummaries"]
        assert [(s["TrainingJobName"], s["TrainingJobStatus"]) for s in changed] == [(failing["job_name"], "Stopped")]
        assert chaos.job(failing["job_name"])["timed"] and chaos.job(failing["job_name"])["stopped_by"] == "client"
    finally:
        chaos.config(timed_jobs=False)
