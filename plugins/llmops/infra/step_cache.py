"""The step cache: a stage whose identity equals a finished earlier job's reuses that job's outputs
instead of submitting anything.

**Identity** (`identity`, hashed by `key_of`): the stage and entrypoint, its fully resolved config
and argv with every location written as a placeholder (the job's own output dir is `<output>`,
an input's path `<input:NAME>`), the content hash of every input (`spec.cache["inputs"]`: the
data manifest's hash, an upstream model's content hash, the raw data files' hashes), the code
version (`llmops.core.provenance.code_version`: git commit, plus a hash of uncommitted changes),
where the code runs (the image, or for the local backend the Python version and installed
distributions), instance type, count and processes per node, the job's env without what only
addresses this run (the MLflow run and tracking ids, the sweep study's name and trial number),
and the backend's resolved settings. Any change to any part is a different key. The run's id,
its MLflow ids and its storage paths are in no part, so two DAG runs of the same conf share keys.

**The index** lives under the storage root, beside the outputs: one small JSON record per key,
`<storage_root>/step_cache/<stage>/<key>.json` (a local directory or s3://), so it survives
across DAG runs and serves every deployment that shares the root. A record is written only after
the job succeeded and its result came back, atomically (a local file is renamed into place, an S3
PUT is all or nothing). It holds the job's result and every output file's content hash
(sha256 locally, the ETag on S3).

**A hit is verified**: every output the record lists must still exist with the same files and
hashes, and a manifest among them (data prep's, a checkpoint's) must agree with the files it
lists. Outputs that are gone or changed make it a miss, logged with the first difference, and the
job runs (and records itself afresh).

Nothing here imports torch or starts a job: it runs in Airflow workers (MWAA included).
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

from llmops.core import provenance, settings
from llmops.core.run import Run
from llmops.infra.aws import s3
from tasks.common.io import write_json as write_local  # stdlib only

log = logging.getLogger(__name__)

SCHEMA = 1
INDEX_DIR = "step_cache"
RECORD_ARTIFACT = "step_record.json"   # the same record, on the stage's MLflow child run
# Env of a job that only says where this run reports, not what it computes: the MLflow run and
# tracking ids (added per try) and the sweep study's address (llmops.policy.sweep_study.JOB_ENV).
RUN_LOCAL_ENV_PREFIXES = ("MLFLOW_", "LLMOPS_STUDY_", "LLMOPS_TRIAL_")
OUTPUT, INPUT = "<output>", "<input:{}>"
CHECKPOINTS = "<checkpoints>"


class StepCacheError(ValueError):
    """A record or an input cannot be read or does not verify; the message says which and why."""


# -- content of files ---------------------------------------------------------------------------

def _hook():
    return s3.s3_hook(settings.aws_conn_id())


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def listing(uri: str, hook: Any = None) -> dict[str, str] | None:
    """Every file under `uri` (a file, a directory or an S3 prefix) -> its content hash:
    `sha256:<hex>` for a local file, `etag:<etag>` for an S3 object (S3 computes it from the
    bytes and changes it on every overwrite). Keys are paths relative to `uri` ("" for `uri`
    itself being a file). Names starting with "." (atomic writes' temporaries) are not outputs.
    None when nothing is there."""
    if s3.is_s3(uri):
        return _s3_listing(uri, hook or _hook())
    if os.path.isfile(uri):
        return {"": f"sha256:{_sha256(uri)}"}
    if not os.path.isdir(uri):
        return None
    files: dict[str, str] = {}
    for base, dirs, names in os.walk(uri):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith("."):
                path = os.path.join(base, name)
                files[os.path.relpath(path, uri)] = f"sha256:{_sha256(path)}"
    return files


def _s3_listing(uri: str, hook: Any) -> dict[str, str] | None:
    bucket, key = s3.split_s3(uri)
    client = hook.get_conn()
    prefix = key.rstrip("/") + "/"
    files: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if rel and not rel.endswith("/") and not any(p.startswith(".") for p in rel.split("/")):
                files[rel] = f"etag:{obj['ETag'].strip(chr(34))}"
    if files:
        return files
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except Exception as exc:  # noqa: BLE001 - botocore's ClientError: 404 means not there
        if str(getattr(exc, "response", {}).get("Error", {}).get("Code")) in ("404", "NoSuchKey"):
            return None
        raise
    return {"": f"etag:{head['ETag'].strip(chr(34))}"}


def digest(files: dict[str, str]) -> str:
    """One hash of a listing: equal listings, equal digests."""
    text = "".join(f"{path}\t{value}\n" for path, value in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def raw_inputs_hash(patterns: list[str], hook: Any = None) -> str:
    """The content of a data prep's raw inputs (files, directories, globs; local or s3://): one
    hash over every matched file's hash. A pattern that matches nothing hashes as such (data prep
    refuses it anyway)."""
    files: dict[str, str] = {}
    for index, pattern in enumerate(patterns):
        for uri in _expand(pattern, hook):
            for rel, value in (listing(uri, hook) or {}).items():
                files[f"{index}:{uri}/{rel}"] = value
    return digest(files)


def _expand(pattern: str, hook: Any) -> list[str]:
    if not any(c in pattern for c in "*?["):
        return [pattern]
    if not s3.is_s3(pattern):
        return sorted(glob.glob(pattern, recursive=True))
    bucket, key = s3.split_s3(pattern)
    fixed = key[:min(key.find(c) for c in "*?[" if c in key)]
    client = (hook or _hook()).get_conn()
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=fixed):
        found += [f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", [])
                  if fnmatch.fnmatchcase(o["Key"], key)]
    return sorted(found)


# -- identity -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def local_environment() -> str:
    """What a local job runs on, standing in for an image: this Python and every installed
    distribution (the demo corpus is made of their docstrings; torch's version changes kernels)."""
    from importlib import metadata

    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                   if d.metadata["Name"])
    return f"python{sys.version.split()[0]}+{hashlib.sha256(chr(10).join(dists).encode()).hexdigest()[:16]}"


def _relocate(value: Any, places: list[tuple[str, str]]) -> Any:
    """`value` with every string that is (or lies under) one of the places' paths written with
    the place's placeholder."""
    if isinstance(value, dict):
        return {k: _relocate(v, places) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relocate(v, places) for v in value]
    if isinstance(value, str):
        for path, placeholder in places:
            if value == path or value.startswith(path.rstrip("/") + "/"):
                return placeholder + value[len(path.rstrip("/")):]
    return value


def identity(spec: Any, backend_settings: str = "") -> dict[str, Any]:
    """Everything that decides what the job `spec` (a JobSpec) computes; see the module doc."""
    inputs = (spec.cache or {}).get("inputs") or {}
    places = [(i["uri"], INPUT.format(name)) for name, i in inputs.items() if i.get("uri")]
    places += [(p, ph) for p, ph in ((spec.output_uri, OUTPUT), (spec.checkpoint_uri, CHECKPOINTS))
               if p]
    places.sort(key=lambda p: len(p[0]), reverse=True)  # the innermost place names a path
    return {
        "schema": SCHEMA, "stage": spec.stage, "entrypoint": spec.entrypoint,
        "config": _relocate(spec.config, places), "argv": _relocate(list(spec.argv), places),
        "inputs": {name: i["hash"] for name, i in sorted(inputs.items())},
        "code": provenance.code_version(),
        "image": spec.image or (local_environment() if spec.backend == "local" else ""),
        "instance_type": spec.instance_type, "instance_count": spec.instance_count,
        "nproc_per_node": spec.nproc_per_node,
        "env": {k: _relocate(v, places) for k, v in sorted(spec.env.items())
                if not k.startswith(RUN_LOCAL_ENV_PREFIXES)},
        "job_inputs": _relocate(spec.inputs, places),
        "backend_settings": backend_settings,
    }


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths where two identities differ (what a miss changed)."""
    out = []
    for k in sorted(set(a) | set(b)):
        path = f"{prefix}{k}"
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += differences(a[k], b[k], f"{path}.")
        elif a.get(k) != b.get(k):
            out.append(path)
    return out


# -- the index ----------------------------------------------------------------------------------

def index_root(storage_root: str) -> str:
    return s3.join(storage_root, INDEX_DIR) if s3.is_s3(storage_root) else \
        os.path.join(storage_root, INDEX_DIR)


def _join(root: str, *parts: str) -> str:
    return s3.join(root, *parts) if s3.is_s3(root) else os.path.join(root, *parts)


def read_json(uri: str, hook: Any = None) -> Any | None:
    """The JSON at a local path or s3:// URI, or None if there is none."""
    if s3.is_s3(uri):
        return s3.read_json(hook or _hook(), uri)
    try:
        with open(uri) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def write_json(uri: str, data: Any, hook: Any = None) -> None:
    """Atomically: a local file is written beside its place, fsynced and renamed; a PUT to S3
    is never seen half-done."""
    if s3.is_s3(uri):
        s3.write_json(hook or _hook(), uri, data)
        return

    write_local(uri, data)


class Index:
    """The records under `<storage_root>/step_cache/`."""

    def __init__(self, root: str, hook: Any = None):
        self.root = root
        self._hook = hook

    def uri(self, stage: str, key: str) -> str:
        return _join(self.root, stage, f"{key}.json")

    def get(self, stage: str, key: str) -> dict[str, Any] | None:
        record = read_json(self.uri(stage, key), self._hook)
        return record if isinstance(record, dict) and record.get("key") == key else None

    def put(self, record: dict[str, Any]) -> str:
        uri = self.uri(record["stage"], record["key"])
        write_json(uri, record, self._hook)
        return uri

    def latest(self, stage: str) -> dict[str, Any] | None:
        """The newest record of a stage (for saying what a miss changed), local indexes only."""
        folder = _join(self.root, stage)
        if s3.is_s3(folder) or not os.path.isdir(folder):
            return None
        paths = sorted((os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json")),
                       key=os.path.getmtime)
        return read_json(paths[-1]) if paths else None


# -- records ------------------------------------------------------------------------------------

def output_fingerprints(outputs: dict[str, Any], hook: Any = None) -> dict[str, dict[str, Any]]:
    """Each output (name -> path or URI, as in a job's result) with its files' hashes and their
    digest; an output that is missing raises (a job that says it wrote one must have)."""
    found = {}
    for name, uri in sorted((outputs or {}).items()):
        if not isinstance(uri, str) or not uri:
            continue
        files = listing(uri, hook)
        if files is None:
            raise StepCacheError(f"output {name!r} ({uri}) does not exist")
        found[name] = {"uri": uri, "hash": digest(files), "files": files}
    return found


def make_record(*, key: str, parts: dict[str, Any], result: dict[str, Any],
                where: dict[str, Any], hook: Any = None) -> dict[str, Any]:
    """The record of a job that just succeeded: its identity, result and outputs' hashes.
    `where`: job_name, mlflow_run_id, dag_id, run_id, task_id, map_index, job_seconds."""
    outputs = output_fingerprints(result.get("outputs") or {}, hook)
    return {"schema": SCHEMA, "key": key, "stage": parts["stage"], "identity": parts,
            "result": {**result, "content_hashes": {n: o["hash"] for n, o in outputs.items()}},
            "outputs": outputs, "recorded_at": time.time(), **where}


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The record without its file listings: small enough for XCom and the run dict."""
    return {k: v for k, v in record.items() if k not in ("outputs", "identity")} | {
        "outputs": {n: {"uri": o["uri"], "hash": o["hash"]} for n, o in record["outputs"].items()}}


def verify(record: dict[str, Any], hook: Any = None) -> str | None:
    """None when every output the record lists is still there with the same files and hashes,
    and agrees with any manifest among its files (a data prep's content hash also with the
    record's data hash); else the first difference, in words."""
    data_hash = (record.get("result") or {}).get("data_hash")
    for name, output in record.get("outputs", {}).items():
        uri = output["uri"]
        now = listing(uri, hook)
        if now is None:
            return f"output {name!r} ({uri}) is gone"
        was = output["files"]
        for path in sorted(set(was) | set(now)):
            shown = os.path.join(uri, path) if path else uri
            if path not in now:
                return f"output {name!r}: {shown} is gone"
            if path not in was:
                return f"output {name!r}: {shown} was not there when the job finished"
            if now[path] != was[path]:
                return f"output {name!r}: {shown} changed since the job finished (its hash differs)"
        manifests: dict[str, Any] = {}

        def read(rel: str, base: str = uri) -> Any:
            if rel not in manifests:
                manifests[rel] = read_json(_join(base, rel) if rel else base, hook)
            return manifests[rel]

        problem = manifest_problem(now, read)
        if problem:
            return f"output {name!r} ({uri}): {problem}"
        if data_hash and "manifest.json" in now:
            recorded = (read("manifest.json") or {}).get("content_hash")
            if recorded and recorded != data_hash:
                return (f"{_join(uri, 'manifest.json')} has content hash {recorded[:12]}, the run "
                        f"recorded data hash {data_hash[:12]}")
    return None


def manifest_problem(files: dict[str, str], read: Any) -> str | None:
    """A manifest.json among `files` (data prep's: {"files": {path: sha256}, "content_hash"};
    a checkpoint's: {"files": {name: {"sha256": ...}}}) must list files that are there with the
    hashes it gives. Only sha256 listings (local outputs) can be compared with it."""
    for path, value in files.items():
        if os.path.basename(path) != "manifest.json" or not value.startswith("sha256:"):
            continue
        manifest = read(path)
        listed = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(listed, dict):
            continue
        base = os.path.dirname(path)
        for rel, entry in sorted(listed.items()):
            want = entry.get("sha256") if isinstance(entry, dict) else entry
            have = files.get(os.path.join(base, rel) if base else rel)
            if have is None:
                return f"{path} lists {rel}, which is missing"
            if have != f"sha256:{want}":
                return f"{rel} does not match the sha256 in {path}"
        if "content_hash" in manifest:
            text = "".join(f"{p}\t{s}\n" for p, s in sorted(listed.items()))
            if hashlib.sha256(text.encode()).hexdigest() != manifest["content_hash"]:
                return f"{path}'s content_hash does not match the files it lists (edited?)"
    return None


def lookup(index: Index, stage: str, key: str, hook: Any = None) -> tuple[dict | None, str]:
    """(the verified record, "") on a hit; (None, why) on a miss."""
    try:
        record = index.get(stage, key)
    except Exception as exc:  # noqa: BLE001 - an unreadable index is a miss, never a failure
        return None, f"the index at {index.uri(stage, key)} could not be read ({type(exc).__name__}: {exc})"
    if record is None:
        return None, "no finished job has this identity"
    try:
        problem = verify(record, hook)
    except Exception as exc:  # noqa: BLE001
        problem = f"its outputs could not be checked ({type(exc).__name__}: {exc})"
    if problem:
        return None, (f"job {record.get('job_name')} (run {record.get('run_id')}) had this "
                      f"identity, but {problem}")
    return record, ""


def for_spec(run: Run | dict[str, Any], stage: str, inputs: dict[str, tuple[str, str]] | None = None
             ) -> dict[str, Any]:
    """A JobSpec's `cache` field for a lifecycle stage: where the index is, the content hash of
    each input (name -> (path, hash)), whether to look up (the run's `cache` Param), and the
    earlier run's record when the stage is taken from one (`from_run`). {} when the run has no
    storage root to keep an index under, or an input's hash is unknown (nothing to key on)."""
    run = Run.of(run)
    storage_root = run.storage_root
    if not storage_root:
        return {}
    taken = ((run.from_run or {}).get("stages") or {}).get(stage)
    if taken:
        return {"index": index_root(storage_root), "taken": taken}
    inputs = inputs or {}
    if any(not h for _, h in inputs.values()):
        return {}
    return {"index": index_root(storage_root), "lookup": bool(run.cache),
            "inputs": {n: {"uri": p or "", "hash": h} for n, (p, h) in inputs.items()}}
