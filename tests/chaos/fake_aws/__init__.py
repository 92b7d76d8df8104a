"""AWS that fails: a fault-injecting proxy and a job-lifecycle simulator in front of moto.

    python -m tests.chaos.fake_aws --port 4566 --workdir /tmp/fake-aws [--moto-port 4567]

One process, two servers: moto (5.2.5, `ThreadedMotoServer`) on the moto port, and in front of it
on `--port` an HTTP proxy that every AWS client (Airflow, the backends) is pointed at through its
connection's `endpoint_url`. Control calls live on the same port under `/_chaos/`; `ChaosClient`
below wraps them.

What is real moto, untouched: every request and answer that no fault rule and no simulated
operation below touches, byte for byte (S3, IAM, STS, job definitions and queues, CloudWatch Logs
reads, request validation and storage of every Create/Submit call). botocore signs requests for
the proxy's host; moto does not check signatures, so forwarding needs no re-signing.

What is simulated here, because moto does not do it:
- Faults (`POST /_chaos/faults`): throttling, 500, 503, connection resets (RST via SO_LINGER 0)
  and read timeouts, all before the request goes on, and lost responses (`lost`: the request is
  handled, a job is created, submitted or stopped, then the connection is reset without an
  answer, so botocore sends the same request again, as after a read timeout on AWS), on
  operations picked by name or glob, with a rate, a window and a count;
  `origin` ("clients", the default; "jobs"; "*") says whose calls it touches (see below);
  `jobs` (globs) narrows a rule to calls about jobs whose name or a tag `key=value` matches
  (`"llmops:stage=pretrain"`): the job a Describe/Stop/Terminate names, the jobs a Batch
  DescribeJobs lists, the job whose log stream GetLogEvents reads, the job a
  CreateTrainingJob/SubmitJob makes (by the tags in its request); a call about no known job
  (S3, a ListJobs without a name) never fires such a rule, so a row can throttle its own jobs
  while others run beside it. Resets are not logged as errors (no traceback per reset).
  Error bodies are in each service's protocol (JSON: SageMaker, Logs; REST-JSON: Batch; REST-XML:
  S3; query: STS/IAM), so botocore's retry handler classifies them as it would AWS's.
- SageMaker training jobs: moto stores the job (and says Completed at once); the simulator keeps
  the real lifecycle. InProgress/Starting for `pending_seconds`, Downloading (channels from S3
  into an /opt/ml layout on each instance's own disk, tests/aws_fixtures.training_container),
  Training (the image's entry, docker/job_entry.py, one subprocess per instance with its own
  process group; several instances with torch_distributed under torchrun, as the toolkit runs
  it), Uploading (every instance's checkpoints back to CheckpointConfig.S3Uri), then Completed
  (every instance done), Failed (FailureReason from the log's tail) or Stopped. StopTrainingJob (moto: HTTP 500) and MaxRuntimeInSeconds are handled
  here; a duplicate job name is refused with ResourceInUse as SageMaker does (moto accepts it).
  Describe/ListTrainingJobs answers are moto's with the status fields rewritten.
- AWS Batch jobs: moto stores the job (finished at once with use_docker false); the simulator
  runs SUBMITTED -> RUNNABLE (`pending_seconds`) -> STARTING -> RUNNING -> SUCCEEDED/FAILED,
  one entry process per node (AWS_BATCH_JOB_* set as Batch sets them, node 0 the main node on
  127.0.0.1), enforces timeout.attemptDurationSeconds, and handles TerminateJob/CancelJob.
  DescribeJobs/ListJobs are rewritten with the status, times, exit code and log streams.
- CloudWatch Logs lines: the containers' stdout/stderr are written, as they come, into moto's
  Logs (`/aws/sagemaker/TrainingJobs` `<job>/algo-1-<epoch>`; `/aws/batch/job`
  `<definition>/default/<job id>-node<i>`), so GetLogEvents through the proxy sees them live.
- Late log lines (`log_delay_seconds`, config): each line reaches CloudWatch that long after the
  container printed it, so a job's last lines arrive after Describe* already says it ended, as
  the awslogs driver's and SageMaker's batched delivery do.
- Capacity waits (`capacity_wait_seconds`): a job first stays queued that long for want of
  instances, saying so as the services do (Batch RUNNABLE with statusReason
  `CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - ...`, SageMaker Starting with the StatusMessage
  "Insufficient capacity error from EC2 while launching instances, retrying!").
- Eventual consistency (`consistency_seconds`, config): for that long after its create/submit a
  job is unknown to DescribeTrainingJob (ValidationException "Requested resource not found."),
  left out of Batch DescribeJobs (as an unknown id is: an empty list) and missing from
  ListTrainingJobs / ListJobs. Its Stop/Terminate and the create's name check see it at once.
- Spot reclaims (`/_chaos/jobs/<name>/reclaim`): a SageMaker managed spot job gets SIGTERM,
  shows SecondaryStatus Interrupted and restarts inside the same job on fresh disks with its
  synced checkpoints, while MaxWaitTimeInSeconds allows (else Stopped, MaxWaitTimeExceeded); a
  Batch job's main node's host is terminated (Batch runs multi-node jobs on on-demand only).
- Service-side events: `/_chaos/jobs/<name>/fail` (the container crashes), `/stop` (stopped from
  the console), `/host` (node N's host dies: its container killed, the attempt failed),
  `fail_first_attempt` (the host of a job's first attempt dies).
- S3's link (`s3_mb_per_s_per_connection`, `s3_first_byte_ms`, config): every S3 request and
  answer body moves at most that fast over its connection (as S3 serves each connection), and
  each answer's first byte leaves that long after its request, so that reading a corpus whole
  and reading a few blocks of it pay what they would (benchmarks/pretrain_first_step.py). The
  proxy logs every S3 request it answers (`FakeAws.s3_log`: when, which port, the operation,
  path, Range and bytes), so a test can say what a job fetched before its first step.
- Disks: every node of a job (Batch node, SageMaker instance) has its own work dir and TMPDIR,
  and every new attempt starts on empty ones: only S3 (and MLflow) outlive a node.
The containers' own AWS calls (their checkpoint uploads, result writes) go through a second proxy
port (`FakeAws.jobs_url`, their AWS_ENDPOINT_URL): a rule touches them only when its `origin` is
"jobs" (or "*"), e.g. `{"operations": ["PutObject", "UploadPart"], "kind": "throttle",
"origin": "jobs", "seconds": 30}` answers S3's 503 SlowDown to their uploads; rules without an
origin touch only the clients' port, as before. A rule narrowed to `jobs` may time its window
per job instead (`"per_job_seconds": 60`): each job meets it for that long from the first call
about that job the rule matched. Their calls are counted apart (the report's
`job_operations`). SageMaker's own checkpoint sync (the service's traffic) reaches moto directly.
HyperPod pods (fake_eks) get the endpoint their harness passes. Jobs belong to
this process, not to the client: they keep running when Airflow dies, and end when this stops.

Not simulated: SageMaker Processing jobs (moto's Completed-at-once), RetryStrategy/retryStrategy,
waiting for spot capacity after a reclaim (the restart follows at once), warm pools, model.tar.gz upload, Batch fair-share scheduling, pagination
changes, eventual consistency of Stop/Terminate/ListTags (they see a new job at once), a lag on
the jobs' own S3 reads after their writes.

The package, one module per concern: faults.py (which operation a request is, the protocols' error
answers, the fault rules), jobs.py (a simulated job, its CloudWatch stream, what both services
share), sagemaker.py and batch.py (each service's API as the simulator answers it), simulator.py
(the jobs' lifecycle and the control calls on them), proxy.py (the proxy, FakeAws, ChaosClient),
__main__.py (the command line above).
"""

from tests.chaos.fake_aws.jobs import BATCH_CAPACITY, BATCH_GROUP, CREDENTIALS, SM_CAPACITY, SM_GROUP
from tests.chaos.fake_aws.proxy import ChaosClient, FakeAws

__all__ = ["BATCH_CAPACITY", "BATCH_GROUP", "CREDENTIALS", "SM_CAPACITY", "SM_GROUP", "ChaosClient", "FakeAws"]
