"""AWS Batch jobs' API as the simulator answers it (Submit, Describe, List, Terminate, Cancel; moto
stores the job, the status fields are the simulator's; a multi-node job's `<id>#<node>` node jobs)
and how a job's node containers are made."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from tests.aws_fixtures import ENTRY, REGION, ROOT, free_port, image_root
from tests.chaos.fake_aws.faults import json_answer
from tests.chaos.fake_aws.jobs import BATCH_GROUP, Job, LogSink


class BatchApi:
    """The `_batch_<Operation>` handlers Simulator.handle dispatches to, and the containers a job
    runs; mixed into Simulator, whose state (jobs, lock) and helpers (unseen, end, _start,
    _jobdir, _sink, _aws_env) they use.

    Moto's Batch is not thread-safe (a DescribeJobs iterating its jobs while a SubmitJob adds one
    raises "dictionary changed size during iteration": a 500 AWS would not send), so these calls
    reach moto one at a time (`_moto_batch`)."""

    _moto_batch = threading.Lock()

    def _batch_SubmitJob(self, call, body, forward, user_agent):
        with self._moto_batch:
            answer = forward(body)
        if answer[0] == 200:
            request, submitted = json.loads(body), json.loads(answer[2])
            self._start(Job("batch", request["jobName"], submitted["jobId"], request,
                            self._jobdir(submitted["jobId"]), "SUBMITTED"))
        return answer

    def _batch_DescribeJobs(self, call, body, forward, user_agent):
        request = json.loads(body)
        # A job too new to be seen is left out of the answer, as Batch leaves out unknown ids.
        request["jobs"] = [i for i in request.get("jobs", []) if not self.unseen(self.jobs.get(i.split("#")[0]))]
        # A multi-node job's nodes are jobs of their own, `<id>#<node>`, which moto does not have.
        nodes = [n for n in (self._node_job(i) for i in request.get("jobs", []) if "#" in i) if n]
        rest = [i for i in request.get("jobs", []) if i not in {n["jobId"] for n in nodes}]
        if not rest:
            status, headers, described = 200, json_answer(call, {})[1], {"jobs": []}
        else:
            with self._moto_batch:
                status, headers, data = forward(json.dumps({**request, "jobs": rest}).encode())
            if status != 200:
                return status, headers, data
            described = json.loads(data)
        for item in described.get("jobs", []):
            self._rewrite_batch(item, detail=True)
        described["jobs"] = described.get("jobs", []) + nodes
        return status, headers, json.dumps(described).encode()

    def _node_job(self, node_id: str) -> dict[str, Any] | None:
        parent_id, _, index = node_id.partition("#")
        job = self.jobs.get(parent_id)
        if job is None or not index.isdigit() or int(index) >= self._nodes(job):
            return None
        node = int(index)
        item = {"jobArn": f"arn:aws:batch:{REGION}:123456789012:job/{node_id}", "jobId": node_id,
                "jobName": job.name, "jobQueue": job.request.get("jobQueue", ""),
                "jobDefinition": job.request.get("jobDefinition", ""), "createdAt": int(job.created_at * 1000),
                "nodeDetails": {"nodeIndex": node, "isMainNode": node == 0}, "tags": {}}
        self._rewrite_batch(item, detail=False, job=job)
        with self.lock:
            container = {}
            if node < len(job.streams):
                container["logStreamName"] = job.streams[node]
            if node < len(job.procs) and job.procs[node].returncode is not None:
                code = job.procs[node].returncode
                container["exitCode"] = 128 - code if code < 0 else code
            item["container"] = container
        return item

    @staticmethod
    def _nodes(job: Job) -> int:
        return int(job.request.get("nodeOverrides", {}).get("numNodes", 1))

    def _batch_ListJobs(self, call, body, forward, user_agent):
        request = json.loads(body or b"{}")
        wanted = request.pop("jobStatus", None) if not request.get("filters") else None
        with self._moto_batch:
            status, headers, data = forward(json.dumps(request).encode())
        if status != 200:
            return status, headers, data
        listed = json.loads(data)
        listed["jobSummaryList"] = [j for j in listed.get("jobSummaryList", [])
                                    if not self.unseen(self.jobs.get(j.get("jobId", "")))]
        for item in listed["jobSummaryList"]:
            self._rewrite_batch(item, detail=False)
        if wanted:
            listed["jobSummaryList"] = [j for j in listed["jobSummaryList"] if j["status"] == wanted]
        return status, headers, json.dumps(listed).encode()

    def _batch_TerminateJob(self, call, body, forward, user_agent, cancel: bool = False):
        with self._moto_batch:
            answer = forward(body)   # moto checks the job and the reason
        request = json.loads(body)
        job = self.jobs.get(request.get("jobId", ""))
        if answer[0] == 200 and job is not None:
            reason = request.get("reason", "")
            # CancelJob only reaches jobs that have not started (a no-op after); TerminateJob all.
            if not cancel or job.status in ("SUBMITTED", "PENDING", "RUNNABLE"):
                self.end(job, "client", reason, user_agent, call.operation)
            else:
                with self.lock:
                    job.stop_requests.append({"at": time.time(), "user_agent": user_agent,
                                              "operation": call.operation, "reason": reason})
        return answer

    def _batch_CancelJob(self, call, body, forward, user_agent):
        return self._batch_TerminateJob(call, body, forward, user_agent, cancel=True)

    def _rewrite_batch(self, item: dict[str, Any], detail: bool, job: Job | None = None) -> None:
        job = job or self.jobs.get(item.get("jobId", ""))
        if job is None:
            return
        with self.lock:
            item["status"] = job.status
            item["statusReason"] = job.reason or item.get("statusReason", "")
            for key, value in (("startedAt", job.started_at), ("stoppedAt", job.ended_at)):
                if value:
                    item[key] = int(value * 1000)
                else:
                    item.pop(key, None)
            container = {**item.get("container", {})}
            container.pop("exitCode", None)
            if job.exit_code is not None:
                container["exitCode"] = job.exit_code
            if detail and job.streams:
                container["logStreamName"] = job.streams[0]
                # What BatchClientHook.get_job_all_awslogs_info reads for multi-node jobs: one
                # container per node in the attempt's taskProperties.
                attempt = {"taskProperties": [{"containers": [{"logStreamName": s}]} for s in job.streams],
                           "startedAt": int((job.started_at or job.created_at) * 1000)}
                if job.ended_at:
                    attempt.update(stoppedAt=int(job.ended_at * 1000), statusReason=job.reason)
                item["attempts"] = [attempt]
            elif detail:
                item["attempts"] = []
            item["container"] = container

    def _prepare_batch(self, job: Job) -> list[tuple[list[str], dict[str, str], LogSink]]:
        request = job.request
        nodes = self._nodes(job)
        overrides = dict(request.get("containerOverrides", {}))
        for node_override in request.get("nodeOverrides", {}).get("nodePropertyOverrides", []):
            overrides.update(node_override.get("containerOverrides", {}))
        command = list(overrides.get("command") or [])
        if not command:
            raise ValueError("the simulator needs the command in containerOverrides")
        # The image's /opt/llmops/job_entry.py is the repository's docker/job_entry.py.
        if len(command) > 1 and command[1].endswith("job_entry.py"):
            command[1] = str(image_root() / ENTRY.relative_to(ROOT))
        if command[0].startswith("python"):
            command[0] = sys.executable
        definition = request["jobDefinition"].rsplit("/", 1)[-1].split(":")[0]
        port = str(free_port())
        out = []
        for node in range(nodes):
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
            env.update(self._aws_env())
            env.update({e["name"]: e["value"] for e in overrides.get("environment", [])})
            env.update({"AWS_BATCH_JOB_ID": job.job_id + (f"#{node}" if nodes > 1 else ""),
                        "AWS_BATCH_JOB_ATTEMPT": "1", "AWS_BATCH_JQ_NAME": request.get("jobQueue", ""),
                        "AWS_BATCH_CE_NAME": "fake-aws", "AWS_BATCH_JOB_NUM_NODES": str(nodes),
                        "AWS_BATCH_JOB_NODE_INDEX": str(node), "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
                        "MASTER_PORT": port, "PYTHONPATH": str(image_root()),
                        # each node its own disk: nothing it writes is seen by another node
                        "LLMOPS_WORKDIR": str(job.workdir / f"node{node}"),
                        "TMPDIR": str(job.workdir / f"node{node}" / "tmp")})
            (job.workdir / f"node{node}" / "tmp").mkdir(parents=True, exist_ok=True)
            # Batch tells the other nodes the main node's address, and the main node nothing.
            env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS" if node else "MASTER_ADDR"] = "127.0.0.1"
            stream = f"{definition}/default/{job.job_id}-node{node}"
            out.append((command, env, self._sink(job, BATCH_GROUP, stream)))
        return out
