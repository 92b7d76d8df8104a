"""SageMaker training jobs' API as the simulator answers it (Create, Describe, List, Stop; moto
stores the job, the status fields are the simulator's) and how a job's containers are made."""

from __future__ import annotations

import json
import time

from tests.aws_fixtures import free_port, training_container
from tests.chaos.fake_aws.faults import error, json_answer
from tests.chaos.fake_aws.jobs import SM_GROUP, Job, LogSink


class SageMakerApi:
    """The `_sagemaker_<Operation>` handlers Simulator.handle dispatches to, and the containers a job
    runs; mixed into Simulator, whose state (jobs, lock, s3, moto_url) and helpers (unseen, end, _start,
    _jobdir, _sink, _aws_env) they use."""

    def _sagemaker_CreateTrainingJob(self, call, body, forward, user_agent):
        request = json.loads(body)
        name = request["TrainingJobName"]
        if name in self.jobs:  # moto would accept a second job of the same name
            return error("json", 400, "ResourceInUse",
                         f"Training job names must be unique within an AWS account and region, and a "
                         f"training job with this name already exists ({name})")
        answer = forward(body)
        if answer[0] == 200:
            arn = json.loads(answer[2])["TrainingJobArn"]
            job = Job("sagemaker", name, arn, request, self._jobdir(name), "InProgress")
            job.move("InProgress", "Starting")
            self._start(job)
        return answer

    def _sagemaker_DescribeTrainingJob(self, call, body, forward, user_agent):
        job = self.jobs.get(json.loads(body).get("TrainingJobName", ""))
        if self.unseen(job):   # SageMaker's answer for a job it does not know
            return error("json", 400, "ValidationException", "Requested resource not found.")
        status, headers, data = forward(body)
        if status != 200 or job is None:
            return status, headers, data
        described = json.loads(data)
        with self.lock:
            described.update(TrainingJobStatus=job.status, SecondaryStatus=job.secondary,
                             LastModifiedTime=job.modified_at,
                             SecondaryStatusTransitions=[dict(t) for t in job.transitions])
            for key, value in (("TrainingStartTime", job.started_at), ("TrainingEndTime", job.ended_at),
                               ("FailureReason", job.reason)):
                if value:
                    described[key] = value
                else:
                    described.pop(key, None)
            if job.ended:
                described.update(job.billing())
        return status, headers, json.dumps(described, default=str).encode()

    def _sagemaker_ListTrainingJobs(self, call, body, forward, user_agent):
        """Moto's summaries with the simulated status, secondary status and times; the filters
        (status, name, creation and last-modified times), the sort and the pages are applied here
        to those (moto filters by its own status and times, and pages before it filters). A job
        too new to be seen (`consistency_seconds`) is not listed."""
        request = json.loads(body or b"{}")
        status, headers, data = forward(b"{}")   # every job moto has, unfiltered and unpaged
        if status != 200:
            return status, headers, data
        listed = json.loads(data)
        summaries = []
        with self.lock:
            for summary in listed.get("TrainingJobSummaries", []):
                if self.unseen(job := self.jobs.get(summary["TrainingJobName"])):
                    continue
                if job:
                    summary.update(TrainingJobStatus=job.status, SecondaryStatus=job.secondary,
                                   CreationTime=job.created_at, LastModifiedTime=job.modified_at)
                    if job.ended_at:
                        summary["TrainingEndTime"] = job.ended_at
                    else:
                        summary.pop("TrainingEndTime", None)
                if _listed(summary, request):
                    summaries.append(summary)
        order = {"Name": "TrainingJobName", "Status": "TrainingJobStatus"}.get(request.get("SortBy"),
                                                                                "CreationTime")
        summaries.sort(key=lambda s: s.get(order) or 0, reverse=request.get("SortOrder", "Descending") == "Descending")
        start, size = int(request.get("NextToken") or 0), int(request.get("MaxResults") or 10)
        page = {"TrainingJobSummaries": summaries[start:start + size]}
        if start + size < len(summaries):
            page["NextToken"] = str(start + size)
        return status, headers, json.dumps(page, default=str).encode()

    def _sagemaker_StopTrainingJob(self, call, body, forward, user_agent):
        name = json.loads(body).get("TrainingJobName", "")
        job = self.jobs.get(name)
        if job is None:
            return error("json", 400, "ValidationException", "Requested resource not found.")
        with self.lock:
            status = job.status
            job.stop_requests.append({"at": time.time(), "user_agent": user_agent,
                                      "operation": "StopTrainingJob", "reason": ""})
        if status == "Stopping":
            return json_answer(call, {})  # SageMaker accepts a repeated stop while stopping
        if status != "InProgress":
            return error("json", 400, "ValidationException",
                         f"The request was rejected because the training job is in status {status}.")
        self.end(job, "client")
        return json_answer(call, {})

    def _prepare_sagemaker(self, job: Job) -> list[tuple[list[str], dict[str, str], LogSink]]:
        """One container per instance, each on its own disk (channels and checkpoints downloaded
        to each), as SageMaker runs a multi-instance job."""
        port, out = free_port(), []
        for host in range(job.request["ResourceConfig"]["InstanceCount"]):
            cmd, env = training_container(self.s3, job.request, job.workdir, self.moto_url,
                                          self._aws_env(), host=host, master_port=port)
            epoch = int(time.time())
            while any(s.endswith(f"/algo-{host + 1}-{epoch}") for s in job.streams):
                epoch += 1   # a restart within the same second (a spot reclaim)
            stream = f"{job.name}/algo-{host + 1}-{epoch}"
            out.append((cmd, env, self._sink(job, SM_GROUP, stream)))
        return out


def _listed(summary: dict, request: dict) -> bool:
    """Whether a ListTrainingJobs request's filters keep this summary (times are epoch seconds,
    as botocore sends and moto answers them)."""
    created, modified = float(summary.get("CreationTime") or 0), float(summary.get("LastModifiedTime") or 0)
    return ((request.get("StatusEquals") is None or summary["TrainingJobStatus"] == request["StatusEquals"])
            and (not request.get("NameContains") or request["NameContains"] in summary["TrainingJobName"])
            and (request.get("CreationTimeAfter") is None or created > float(request["CreationTimeAfter"]))
            and (request.get("CreationTimeBefore") is None or created < float(request["CreationTimeBefore"]))
            and (request.get("LastModifiedTimeAfter") is None or modified > float(request["LastModifiedTimeAfter"]))
            and (request.get("LastModifiedTimeBefore") is None or modified < float(request["LastModifiedTimeBefore"])))
