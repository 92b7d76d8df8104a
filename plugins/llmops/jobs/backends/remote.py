"""What every remote backend does the same way around its own API call.

A remote job runs `docker/job_entry.py` (at `settings.entry_script` in the image), which runs the
stage's usual `python -m tasks.<stage> --config FILE --result FILE` and then writes the stage's
outputs and result JSON to the URIs it was given. Around that the Airflow side:

- names attempts: a backend reattaches to a job of its name that is running or succeeded; a failed
  or stopped one is followed by `<name>-r2`, `<name>-r3`, ... (SageMaker never reuses a name), all
  sharing one checkpoint URI so the next attempt resumes. A name is fitted to its service's
  length from the readable front, never cutting the spec name's hash, and checked against the
  service's rule (NAME_RULES): the name is what makes a create idempotent when its response is
  lost (SageMaker and Kubernetes refuse a second job of a name);
- finds the config's inputs (s3:// or fsx:// URIs, existing local paths and globs) so a backend
  can mount them (SageMaker channels) or let the entry download them;
- stages what lives on the Airflow machine: when a stage's storage is a local directory (the
  default `storage_root`), its local inputs are uploaded under `staging_uri` and, after success, its
  outputs are copied back, so `local` and a cloud backend can be mixed stage by stage;
- refuses secrets in a job's environment: AWS shows it to anyone who can describe the job.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from llmops.infra.aws import s3
from llmops.jobs import env_secrets
from llmops.jobs.spec import JobSpec, JobSpecError, cost_allocation_tags
from tasks.configs import CHECKPOINTED_STAGES, to_dict

MAX_ATTEMPTS = 99
LOG_INTERVAL = 10.0   # see log_due
# Settings that change how a job is watched, not what runs: they stay out of its fingerprint, so
# changing them never turns a clear-and-rerun into a second job.
WATCH_ONLY = ("poll_interval_seconds", "deadline_grace_seconds", "max_queue_seconds")
_WILDCARD = re.compile(r"[*?\[]")


# What each service accepts as a job name. The length is ours where a service derives longer
# names from it (HyperPod pods are `<job>-pod-<i>`, kept within Kubernetes' 63).
NAME_RULES = {
    "sagemaker": (63, re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")),
    "batch": (128, re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")),
    "kubernetes": (48, re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")),
}
_DIGEST = re.compile(r"[0-9a-f]{8,}")   # the hash llmops.jobs.spec.job_name ends a name with


def fit_name(base: str, max_len: int) -> str:
    """`base` within `max_len` characters, cut from its readable front so that what makes it
    unique survives: its trailing `-<hash>` (as job_name writes it), or, for a name without one,
    a hash of the whole name put in place of its end."""
    if len(base) <= max_len:
        return base
    head, sep, digest = base.rpartition("-")
    if not (sep and _DIGEST.fullmatch(digest) and len(digest) + 2 <= max_len):
        head, digest = base, hashlib.sha256(base.encode()).hexdigest()[:10]
    head = head[: max(0, max_len - len(digest) - 1)].rstrip("-_")
    return f"{head}-{digest}" if head else digest[:max_len]


def attempt_name(base: str, attempt: int, max_len: int = 63) -> str:
    """`base` for the first attempt, `base-r<N>` after it, within `max_len`: cut from the
    readable front, never from the trailing hash (two runs of one long task id would share a
    name, and the second would reattach to the first's job)."""
    suffix = f"-r{attempt}" if attempt > 1 else ""
    return fit_name(base, max_len - len(suffix)) + suffix


def check_name(service: str, name: str) -> str:
    """`name` if `service` accepts it as a job name, else a JobSpecError naming the rule."""
    max_len, rule = NAME_RULES[service]
    if len(name) > max_len or not rule.fullmatch(name):
        raise JobSpecError(f"{name!r} is not a valid {service} job name: at most {max_len} characters "
                           f"matching {rule.pattern}. Give the task (or JobSpec.name) a name of "
                           "letters, digits and hyphens.")
    return name


def latest_attempt(base: str, exists: Callable[[str], Any], max_len: int = 63) -> tuple[int, Any]:
    """(number, description) of the newest attempt that exists, or (0, None)."""
    found: tuple[int, Any] = (0, None)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        description = exists(attempt_name(base, attempt, max_len))
        if description is None:
            return found
        found = (attempt, description)
    raise JobSpecError(f"Job {base} already has {MAX_ATTEMPTS} attempts; rename the task or clear it.")


# Refuse credentials in a remote job's env, with the key named (one rule with the operator's masker).
check_environment = env_secrets.check_remote_env


def warn_if_unreachable(env: dict[str, str], log: Any) -> None:
    """A remote job cannot log to an MLflow store on the Airflow machine's disk."""
    uri = env.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("sqlite:", "file:", "/")) or (uri and "://" not in uri):
        log.warning("MLFLOW_TRACKING_URI is %s, a store on this machine: the remote job will not be "
                    "able to log to it. Point MLFLOW_TRACKING_URI at a tracking server (or a "
                    "SageMaker managed MLflow ARN) that both Airflow and the jobs reach.", redact(uri))


redact = env_secrets.redact_uri


def kms_env(settings: Any) -> dict[str, str]:
    """The job's variable for its own S3 writes (SSE-KMS with this key), {} without a key."""
    key = getattr(settings, "kms_key_id", "")
    return {s3.KMS_ENV: key} if key else {}


def log_due(cursor: Any) -> bool:
    """Whether a log read is due: always from the start (cursor 0 or None), else every LOG_INTERVAL.
    For backends whose log read is a whole-log fetch (HyperPod's pod logs); SageMaker and Batch
    read CloudWatch from forward tokens at every poll."""
    return not isinstance(cursor, dict) or time.time() >= cursor.get("_next_read", 0)


def log_cursor(cursor: dict[str, Any]) -> dict[str, Any]:
    return {**cursor, "_next_read": time.time() + LOG_INTERVAL}


def settings_fingerprint(settings: Any) -> str:
    """A short hash of a stage's resolved settings block (image, instance type, role, ...): an
    admin's change to the `llmops_backends` Variable yields a new job name on the next clear.
    Pure: no I/O beyond what `settings` already holds."""
    data = {k: v for k, v in to_dict(settings).items() if k not in WATCH_ONLY}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def watch_fields(settings: Any, extra_grace: int = 0) -> dict[str, Any]:
    """What the operator and the trigger read from a handle to wait for the job: how often to
    poll, and how long past the job's max run time (counted from its start) Airflow waits before
    stopping it itself; how long it may wait before it first starts (`max_queue_seconds`, 0 = no
    bound). `extra_grace` is slack the service itself allows (spot waiting)."""
    return {"poll_interval": float(settings.poll_interval_seconds),
            "deadline_grace_seconds": int(settings.deadline_grace_seconds) + int(extra_grace),
            "max_queue_seconds": int(settings.max_queue_seconds)}


# How long after a create or submit a service's Describe/List calls may not show the job yet:
# they are eventually consistent (typically seconds; the margin covers a slow control plane).
VISIBILITY_SECONDS = 180.0


def not_visible_yet(handle: dict[str, Any], what: str) -> Any:
    """For a status call that found no job: PENDING while the handle's job was submitted less
    than VISIBILITY_SECONDS ago (the service may not show it yet), else None (it is gone).
    Read as 'gone' at once, a lagging read would fail a job that runs, or start another."""
    from llmops.jobs.backends.base import JobState, JobStatus

    submitted = float(handle.get("submitted_at") or 0)
    if not submitted or time.time() >= submitted + VISIBILITY_SECONDS:
        return None
    return JobStatus(JobState.PENDING, f"{what} submitted {time.time() - submitted:.0f} s ago is not "
                     "visible yet (the service's reads lag its create)", details={"submitted_at": submitted})


def epoch(value: Any) -> float | None:
    """A describe call's timestamp (datetime, or Batch's epoch milliseconds) as epoch seconds."""
    if value is None or value == "":
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value) / 1000.0


# -- inputs ---------------------------------------------------------------------------------

@dataclass
class InputRef:
    """One path the job reads, found in its config."""

    field: str          # where in the config, e.g. "data_dir", "models.teacher", "inputs.0"
    value: str          # as written in the config
    base: str           # the directory, file or prefix to make available (URI or local path)
    suffix: str = ""    # what follows `base` in `value`: a glob, or "" for the base itself
    is_file: bool = False
    channel: str = ""   # a short name for it (a SageMaker channel, an input directory)


def find_inputs(config: dict[str, Any]) -> list[InputRef]:
    """Every input path in a stage config: s3:// and fsx:// URIs, existing local paths and globs.
    `output_dir` is the one output of every stage and is never an input."""
    found: list[InputRef] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if not path and key == "output_dir":
                    continue
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}")
        elif isinstance(value, str):
            ref = _input_ref(path, value)
            if ref:
                found.append(ref)

    walk(config, "")
    channels: dict[str, str] = {}
    for ref in found:
        if ref.base in channels:   # the same directory read by two fields: one channel
            ref.channel = channels[ref.base]
            continue
        name = re.sub(r"[^a-z0-9]+", "_", ref.field.lower()).strip("_")[:40] or "input"
        if name in channels.values():
            name = f"{name}_{hashlib.sha256(ref.base.encode()).hexdigest()[:6]}"
        channels[ref.base] = ref.channel = name
    return found


def _input_ref(field_path: str, value: str) -> InputRef | None:
    if value.startswith(("s3://", "fsx://")):
        head, wildcard = _split_glob(value)
        if wildcard:
            return InputRef(field_path, value, head, wildcard)
        last = value.rstrip("/").rsplit("/", 1)[-1]
        return InputRef(field_path, value, value.rstrip("/"), is_file="." in last)
    if "://" in value or not os.path.isabs(value):
        return None
    if os.path.exists(value):
        return InputRef(field_path, value, value.rstrip("/") or "/", is_file=os.path.isfile(value))
    head, wildcard = _split_glob(value)
    if wildcard and glob.glob(value, recursive=True):
        return InputRef(field_path, value, head, wildcard)
    return None


def _split_glob(value: str) -> tuple[str, str]:
    """("s3://b/raw", "part-*.jsonl") for "s3://b/raw/part-*.jsonl"; (value, "") without wildcards."""
    parts = value.split("/")
    for i, part in enumerate(parts):
        if _WILDCARD.search(part):
            return "/".join(parts[:i]), "/".join(parts[i:])
    return value, ""


def in_container(ref: InputRef, mount: str) -> str:
    """Where `ref.value` is inside the job when `ref.base` is mounted at `mount`."""
    if ref.suffix:
        return f"{mount.rstrip('/')}/{ref.suffix}"
    if ref.is_file:
        return f"{mount.rstrip('/')}/{ref.base.rsplit('/', 1)[-1]}"
    return mount


def replace_strings(data: Any, mapping: dict[str, str]) -> Any:
    """Rewrite every string that starts with a key of `mapping` (longest key first)."""
    keys = sorted(mapping, key=len, reverse=True)

    def fix(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str):
            for key in keys:
                base = key.rstrip("/")
                if value == key or value == base:
                    return mapping[key]
                if value.startswith(base + "/"):
                    return mapping[key].rstrip("/") + value[len(base):]
        return value

    return fix(data)


# -- staging --------------------------------------------------------------------------------

@dataclass
class Staged:
    """Where a remote job reads and writes, decided before submission."""

    config: dict[str, Any]           # the config as the job sees it (URIs, not Airflow-side paths)
    inputs: list[InputRef]           # its inputs, as URIs
    output_uri: str                  # where the job writes its outputs
    checkpoint_uri: str              # where its checkpoints live (shared by all attempts)
    result_uri: str                  # the result JSON the entry writes
    config_uri: str                  # the config JSON the entry reads
    prefix: str                      # this attempt's staging prefix
    copy_back: dict[str, str] = field(default_factory=dict)  # {output_uri: local dir} after success
    uploads: dict[str, str] = field(default_factory=dict)    # {local input: staged URI}


def plan(spec: JobSpec, job_name: str, staging_uri: str) -> Staged:
    """Decide where the job reads and writes under `staging_uri/<spec name>/` (no I/O, so a
    reattaching task computes the same URIs as the try that submitted).

    Local inputs map to `<staging>/<spec name>/inputs/<channel>`; a local `output_dir` becomes
    `<staging>/<spec name>/output` and is copied back after success; an s3:// one is written
    directly by the job. Checkpoints live beside the outputs, shared by every attempt.
    """
    if not s3.is_s3(staging_uri):
        raise JobSpecError(f"staging_uri must be an s3:// prefix for this backend, got {staging_uri!r}.")
    root = s3.join(staging_uri, spec.name)
    prefix = s3.join(root, job_name)
    config = dict(spec.config)
    uploads: dict[str, str] = {}   # local path as written in the config -> its staged URI
    for ref in find_inputs(config):
        if "://" in ref.base or ref.value in uploads:
            continue
        target = s3.join(root, "inputs", ref.channel)
        uploads[ref.value] = (s3.join(target, ref.suffix) if ref.suffix else
                              s3.join(target, Path(ref.base).name) if ref.is_file else target)
    if uploads:
        config = replace_strings(config, uploads)
    copy_back: dict[str, str] = {}
    output_dir = str(config.get("output_dir") or spec.output_uri or "")
    if output_dir and "://" not in output_dir:
        output_uri = s3.join(root, "output")
        copy_back[output_uri] = output_dir
    else:
        output_uri = output_dir or s3.join(root, "output")
    if "output_dir" in config:
        config["output_dir"] = output_uri
    checkpoint_uri = checkpoint_place(spec, s3.join(root, "checkpoints") if copy_back
                                      else s3.join(output_uri, "checkpoints"))
    return Staged(config=config, inputs=find_inputs(config), output_uri=output_uri,
                  checkpoint_uri=checkpoint_uri, result_uri=s3.join(prefix, "result.json"),
                  config_uri=s3.join(prefix, "llmops", "config.json"), prefix=prefix,
                  copy_back=copy_back, uploads={local: uri for local, uri in uploads.items()})


def checkpoint_place(spec: JobSpec, default: str) -> str:
    """Where the job's checkpoints live, the same for every attempt: JobSpec.checkpoint_uri, else
    the config's own `checkpoint_uri` (the stage writes through there: the handle, the pause
    marker and the chain's progress must look there too), else `default`, beside the outputs.

    A stage that keeps its progress in checkpoints (tasks.configs.CHECKPOINTED_STAGES, or any
    config naming the key) has them taken off the node by the image's entry: synced (SageMaker) or
    written through to this URI (Batch, HyperPod). A place that cannot hold them is refused here,
    before any job, naming the field and the fix."""
    own = str(spec.config.get("checkpoint_uri") or "")
    given = spec.checkpoint_uri if "://" in spec.checkpoint_uri else ""
    if given and not s3.is_s3(given):
        raise JobSpecError(f"JobSpec.checkpoint_uri is {given!r}: a remote job's checkpoints go to "
                           "S3. Set it to an s3://bucket/prefix, or leave it empty for the run's "
                           f"storage ({default}); a shared file system belongs in output_dir.")
    if spec.entrypoint in CHECKPOINTED_STAGES or "checkpoint_uri" in spec.config:
        if own and not s3.is_s3(own):
            raise JobSpecError(
                f"JobSpec.config.checkpoint_uri is {own!r}: the {spec.stage} stage's checkpoints "
                "must leave the node, and only an s3:// prefix takes them there. Set it to "
                f"s3://bucket/prefix, or leave it out: every checkpoint is then written through "
                f"to {given or default}.")
        if own and given and own.rstrip("/") != given.rstrip("/"):
            raise JobSpecError(
                f"JobSpec.checkpoint_uri ({given}) and JobSpec.config.checkpoint_uri ({own}) name "
                "two places for one job's checkpoints: the job would write to one and its next "
                "attempt look in the other. Set one of them.")
    return given or own or default


def upload(staged: Staged, hook: Any, log: Any) -> None:
    """Put the job's local inputs and its config where `plan` said."""
    for local, uri in staged.uploads.items():
        head, wildcard = _split_glob(local)
        if wildcard:  # only the matching files, below the glob's fixed directory
            size = 0
            base = uri[: -len(wildcard)].rstrip("/")
            for path in sorted(glob.glob(local, recursive=True)):
                if os.path.isfile(path):
                    rel = os.path.dirname(os.path.relpath(path, head))
                    size += s3.upload_path(hook, path, s3.join(base, rel))
        elif os.path.isfile(local):
            size = s3.upload_path(hook, local, uri.rsplit("/", 1)[0])
        else:
            size = s3.upload_path(hook, local, uri)
        log.info("Staged local input %s (%.1f MB) at %s", local, size / 1e6, uri)
    s3.write_json(hook, staged.config_uri, staged.config)


def entry_args(spec: JobSpec, staged: Staged, *, config: str | None = None,
               input_map: dict[str, str] | None = None, input_map_file: str = "",
               launcher: str = "none", nproc_per_node: int = 1, nnodes: int = 0,
               output_local: str = "", checkpoint_dir: str = "") -> list[str]:
    """The argument list of docker/job_entry.py for this job (no shell anywhere)."""
    args = ["--entrypoint", spec.entrypoint, "--config", config or staged.config_uri,
            "--result", staged.result_uri, "--output-uri", staged.output_uri,
            "--checkpoint-uri", staged.checkpoint_uri, "--launcher", launcher,
            "--nproc-per-node", str(nproc_per_node)]
    if nnodes:
        args += ["--nnodes", str(nnodes)]
    if input_map:
        args += ["--input-map", json.dumps(input_map, sort_keys=True)]
    if input_map_file:
        args += ["--input-map-file", input_map_file]
    if output_local:
        args += ["--output-local", output_local]
    if checkpoint_dir:
        args += ["--checkpoint-dir", checkpoint_dir]
    if spec.argv:
        args += ["--", *spec.argv]
    return args


# A stage that paused on request exits with this (tasks.train.supervisor.PAUSED_EXIT); the image's
# entry (docker/job_entry.py) publishes its result first, which names the step.
PAUSED_EXIT = 77


def paused_result(handle: dict[str, Any], hook: Any) -> dict | None:
    """The result of a job that ended because it paused on request, else None (a failed job
    writes no result, and an unreadable one only costs the step in the task's message)."""
    try:
        result = s3.read_json(hook, handle["result_uri"])
    except Exception:  # noqa: BLE001 - the job has ended either way
        return None
    return result if isinstance(result, dict) and result.get("paused") else None


def fetch_result(handle: dict[str, Any], hook: Any, log: Any) -> tuple[dict | None, str]:
    """The job's result JSON (with outputs copied back to local storage if needed), or
    (None, why not)."""
    result = s3.read_json(hook, handle["result_uri"])
    if result is None:
        return None, (f"the job finished but wrote no result at {handle['result_uri']}: was the "
                      f"image built from docker/ (its entry writes the result)?")
    for uri, local in (handle.get("copy_back") or {}).items():
        marker = Path(local, ".llmops-copied-from")
        if not (marker.exists() and marker.read_text() == handle["job_name"]):
            count = s3.download_prefix(hook, uri, local)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(handle["job_name"])
            log.info("Copied %d output files of %s from %s to %s", count, handle["job_name"], uri, local)
        result = replace_strings(result, {uri: local})
    return result, ""


def merged(spec: JobSpec, settings: Any) -> dict[str, Any]:
    """The job's resources: the run's choice (the spec) over the deployment's (settings)."""
    return {
        "image": spec.image or settings.image,
        "instance_type": spec.instance_type if spec.instance_type not in ("", "local")
        else settings.instance_type,
        "instance_count": spec.instance_count if spec.instance_count != 1
        else (settings.instance_count or 1),
        "nproc_per_node": spec.nproc_per_node if spec.nproc_per_node != 1
        else (settings.nproc_per_node or 1),
        "env": {**settings.env, **spec.env},
        "tags": {k: str(v) for k, v in {**settings.tags, **spec.tags, **cost_allocation_tags(spec),
                                        "llmops:stage": spec.stage, "llmops:job": spec.name}.items()
                 if str(v)},
    }


def resource_fields(spec: JobSpec, settings: Any) -> dict[str, Any]:
    """The resolved image and instances, kept in the handle for the job ledger
    (llmops.infra.ledger)."""
    res = merged(spec, settings)
    return {"image": res["image"], "instance_type": res["instance_type"],
            "instance_count": res["instance_count"]}
