"""The entry of every remote job: SageMaker Training and Processing, AWS Batch, HyperPod, Ray.

It runs the stage exactly as the local backend does,

    python -m tasks.<stage> --config CONFIG.json --result RESULT.json

and does around it what a container needs and a local process does not:

1. reads the stage config (a file, an s3:// object, or mounted input channel);
2. maps the config's input URIs to where the platform mounted them (SageMaker channels,
   Processing inputs: `--input-map`) and downloads any other s3:// input into the work dir,
   except those the stage streams itself (tasks.common.uris.STREAMED_INPUTS: pretraining's token
   shards), which it passes on as s3:// URIs;
3. gives the stage a local output_dir when the real one is an s3:// URI, and puts its
   checkpoints where a new attempt on a fresh machine finds them: linked to the platform's synced
   checkpoint dir (SageMaker's /opt/ml/checkpoints comes back on restart), or, where nothing syncs
   (Batch, HyperPod), the stage's own `checkpoint_uri` set to `--checkpoint-uri` so that every
   checkpoint is written through to S3 as it commits and restored from there before the first
   step (a shared mount given as a path is linked like a synced dir). Which stages checkpoint is
   the stage's to say (tasks.configs.CHECKPOINTED_STAGES), not whether its config names the key;
   one with nowhere off the node to put them is refused (exit 2) before it runs;
4. launches the processes: none (the platform already did: SageMaker's toolkit runs torchrun or
   mpirun around this script), `torchrun` (Batch multi-node, Kubeflow PyTorchJob) or
   `hyperpodrun` (HyperPod's elastic agent), with nodes and ranks from the platform's variables;
5. on the leader only (node 0 / rank 0 / first host): uploads the outputs and writes the result
   JSON, with local paths rewritten to their URIs, to `--result` (a path or an s3:// URI). The
   result names only what exists: every output path is checked, and `outputs.checkpoint` is the
   newest complete checkpoint (its manifest, written last, is there) in the run's storage.

A failed stage exits with its own code, and on SageMaker leaves the tail of its log in
/opt/ml/output/failure, which becomes the job's FailureReason.

Standard library (and boto3 for S3) only: this file is copied into the images as
/opt/llmops/job_entry.py and, for SageMaker Training, /opt/ml/code/job_entry.py.
`LLMOPS_WORKDIR` and `LLMOPS_CHECKPOINT_DIR` relocate the work and checkpoint dirs; each copy
started by a launcher (LOCAL_RANK / RANK set) keeps its config and result in `rank-<N>/` there.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tasks.configs import CHECKPOINTED_STAGES   # the image puts tasks/ on PYTHONPATH (/opt/llmops)
from tasks.common.uris import STREAMED_INPUTS, split_s3

log = logging.getLogger("llmops.entry")
FAILURE_FILE = "/opt/ml/output/failure"   # SageMaker reports its content as FailureReason
RDZV_PORT = "29500"
PAUSED_EXIT = 77   # tasks.train.supervisor.PAUSED_EXIT: the stage paused on request
CHECKPOINT_STEP = re.compile(r"^step_(\d{6,})$")   # tasks/train/checkpoint.py's layout
CHECKPOINT_COMMIT = "manifest.json"                 # written last: a step without it is unfinished
KMS_ENV = "LLMOPS_S3_KMS_KEY_ID"                    # llmops.infra.aws.s3.KMS_ENV, set by backends


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="job_entry.py", description=__doc__.split("\n\n")[0])
    # Hyperparameters reach this script as `--name value` (SageMaker's toolkit), so every option
    # also has an underscore spelling.
    p.add_argument("--entrypoint", required=True, help="Stage module, e.g. tasks.pretrain.")
    p.add_argument("--config", help="Stage config JSON: a path or an s3:// URI ($VARS expanded).")
    p.add_argument("--config-json", "--config_json", help="The stage config itself, as JSON text.")
    p.add_argument("--result", required=True, help="Where the leader writes the result JSON.")
    p.add_argument("--output-uri", "--output_uri", default="",
                   help="Where the outputs go when output_dir is a URI.")
    p.add_argument("--checkpoint-uri", "--checkpoint_uri", default="")
    p.add_argument("--checkpoint-dir", "--checkpoint_dir", default=None,
                   help="A local dir the platform syncs with checkpoint-uri (default $LLMOPS_CHECKPOINT_DIR).")
    p.add_argument("--output-local", "--output_local", default="",
                   help="The platform uploads this dir to output-uri itself (SageMaker Processing).")
    p.add_argument("--input-map", "--input_map", default="", help="JSON {URI prefix: local path}.")
    p.add_argument("--merge-output", "--merge_output", default="",
                   help="Copy every host-*/ tree under this dir into the output dir before the stage "
                        "runs (the shards of a multi-host job, for its finalize job).")
    p.add_argument("--input-map-file", "--input_map_file", default="", help="The same, as a file.")
    p.add_argument("--launcher", default="none", choices=("none", "torchrun", "hyperpodrun"))
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=0, help="Nodes, when the platform does not say.")
    p.add_argument("--workdir", default=None, help="Scratch space (default $LLMOPS_WORKDIR or a temp dir).")
    p.add_argument("--argv", default="", help="Extra stage arguments as a JSON list.")
    args, rest = p.parse_known_args(argv)
    extra = json.loads(args.argv) if args.argv else []
    if "--" in rest:
        extra += rest[rest.index("--") + 1:]
        rest = rest[: rest.index("--")]
    if rest:  # e.g. SageMaker's --mp_parameters, meant for the toolkit, not for the stage
        log.info("ignoring platform arguments %s", rest)
    return args, extra


# -- where are we ------------------------------------------------------------------------------

def hosts() -> tuple[int, int]:
    """(this host's index, number of hosts) on SageMaker; (0, 1) elsewhere."""
    for path in ("/opt/ml/input/config/resourceconfig.json", "/opt/ml/config/resourceconfig.json"):
        if os.path.exists(path):
            config = json.loads(Path(path).read_text())
            names = sorted(config.get("hosts", [])) or [config.get("current_host")]
            return names.index(config.get("current_host", names[0])), len(names)
    if os.environ.get("SM_HOSTS") and os.environ.get("SM_CURRENT_HOST"):
        names = sorted(json.loads(os.environ["SM_HOSTS"]))
        return names.index(os.environ["SM_CURRENT_HOST"]), len(names)
    return 0, 1


def node_rank_and_count(args: argparse.Namespace) -> tuple[int, int]:
    """(node rank, nodes) from whichever platform launched us."""
    env = os.environ
    if "AWS_BATCH_JOB_NUM_NODES" in env:
        return int(env.get("AWS_BATCH_JOB_NODE_INDEX", "0")), int(env["AWS_BATCH_JOB_NUM_NODES"])
    if "PET_NNODES" in env:  # Kubeflow training operator with nprocPerNode set
        nodes = env["PET_NNODES"].split(":")[-1]
        # Older operators give the pod's node rank as RANK only (WORLD_SIZE then counts processes).
        return int(env.get("PET_NODE_RANK", env.get("RANK", "0"))), int(nodes)
    if args.launcher != "none" and "WORLD_SIZE" in env and "RANK" in env:  # PyTorchJob, one process per pod
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return hosts()


def is_leader(args: argparse.Namespace) -> bool:
    """Only one process writes outputs and the result: node 0, and there rank 0.

    Under hyperpodrun (a HyperPodPyTorchJob pod) no variable names the pod's node: the elastic
    rendezvous numbers the nodes, and every pod would read itself as node 0 and write the result
    over the others'. The leader is the pod whose global rank 0 ran here: the stage writes its
    result only there (tasks.common.entry), into this process's dir of the work dir that the
    backend sets (LLMOPS_WORKDIR; main() puts `result.json` in process_dir(workdir))."""
    workdir = args.workdir or os.environ.get("LLMOPS_WORKDIR")
    if args.launcher == "hyperpodrun" and workdir:
        return (process_dir(Path(workdir)) / "result.json").exists()
    node, _ = node_rank_and_count(args)
    if args.launcher != "none":
        return node == 0
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name]) == 0 and node == 0
    return node == 0


def launch_command(args: argparse.Namespace, stage_argv: list[str]) -> list[str]:
    module = [args.entrypoint, *stage_argv]
    if args.launcher == "none":
        return [sys.executable, "-m", *module]
    node, nodes = node_rank_and_count(args)
    nodes = max(nodes, args.nnodes)
    if args.launcher == "hyperpodrun":
        # HyperPod's elastic agent: torchrun's interface, rendezvous handled by the operator.
        return ["hyperpodrun", f"--nnodes={nodes}:{nodes}", f"--nproc_per_node={args.nproc_per_node}",
                "-m", *module]
    if "PET_NNODES" in os.environ:  # the Kubeflow operator set every PET_* torchrun reads
        return [sys.executable, "-m", "torch.distributed.run", "-m", *module]
    if nodes == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.nproc_per_node}", "-m", *module]
    main = os.environ.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS") or os.environ.get("MASTER_ADDR")
    if not main:  # Batch's main node is not told its own address
        main = socket.gethostbyname(socket.gethostname())
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
            f"--nproc_per_node={args.nproc_per_node}", f"--master_addr={main}",
            f"--master_port={os.environ.get('MASTER_PORT', RDZV_PORT)}", "-m", *module]


# -- storage -----------------------------------------------------------------------------------

S3_RETRIES = {"mode": "standard", "total_max_attempts": 20}


def _s3():
    import boto3  # in the job images; not needed for jobs that only touch shared paths
    from botocore.config import Config

    # S3 answers 503 SlowDown for a while when a prefix's request rate climbs. botocore's default
    # (legacy mode, 5 tries within about 15 s) gave up on such a burst and failed the job after
    # its training; standard mode's 20 tries wait up to 20 s apart (minutes in all).
    return boto3.client("s3", config=Config(retries=S3_RETRIES))


def sse_args() -> dict[str, str]:
    """SSE-KMS for every object this job writes, when the backend named a key
    ($LLMOPS_S3_KMS_KEY_ID): a bucket policy may refuse any PutObject without it."""
    key = os.environ.get(KMS_ENV, "")
    return {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": key} if key else {}


def read_text(location: str) -> str:
    if location.startswith("s3://"):
        bucket, key = split_s3(location)
        return _s3().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    return Path(location).read_text()


def write_text(location: str, text: str) -> None:
    if location.startswith("s3://"):
        bucket, key = split_s3(location)
        _s3().put_object(Bucket=bucket, Key=key, Body=text.encode(), **sse_args())
        return
    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def download(uri: str, target: Path) -> None:
    """Everything under an s3:// prefix (or the one object) into `target`, once."""
    if target.exists():
        return
    bucket, key = split_s3(uri)
    client = _s3()
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    prefix = key.rstrip("/") + "/"
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if rel and not rel.endswith("/"):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(tmp / rel))
                count += 1
    if count == 0:  # not a prefix: a single object
        client.download_file(bucket, key, str(tmp / key.rsplit("/", 1)[-1]))
    try:
        os.replace(tmp, target)
    except OSError:  # another rank on this host downloaded it first
        if not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return
    log.info("downloaded %s (%d files) to %s", uri, max(count, 1), target)


def upload(local: Path, uri: str, skip: tuple[str, ...] = ("checkpoints",)) -> int:
    """Copy a directory tree to an s3:// prefix, or to a shared path; skips `checkpoints`, which
    the platform syncs (or which already sit at the checkpoint URI)."""
    if not uri:   # Path("") is the working directory: never copy a job's outputs there
        raise ValueError(f"no destination for the outputs in {local}")
    files = [p for p in sorted(local.rglob("*"))
             if p.is_file() and p.relative_to(local).parts[0] not in skip]
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        client = _s3()
        extra = {"ExtraArgs": sse} if (sse := sse_args()) else {}
        for path in files:
            client.upload_file(str(path), bucket, f"{key.rstrip('/')}/{path.relative_to(local).as_posix()}",
                               **extra)
    else:
        for path in files:
            target = Path(uri, path.relative_to(local))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return len(files)


def exists(location: str) -> bool:
    """An s3:// object or prefix with at least one object under it, or a local path."""
    if not location.startswith("s3://"):
        return os.path.exists(location)
    bucket, key = split_s3(location)
    listed = _s3().list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents", [])
    return any(obj["Key"] == key or obj["Key"].startswith(key.rstrip("/") + "/") for obj in listed)


def newest_checkpoint(location: str) -> str | None:
    """The newest complete checkpoint (a step_* whose manifest is there) under a local dir or an
    s3:// prefix, or None."""
    if location.startswith("s3://"):
        bucket, key = split_s3(location)
        prefix = key.rstrip("/") + "/"
        names = []
        for page in _s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                                   Delimiter="/"):
            names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
    else:
        names = [p.name for p in Path(location).iterdir()] if os.path.isdir(location) else []
    steps = sorted(((int(m.group(1)), name) for name in names if (m := CHECKPOINT_STEP.match(name))),
                   reverse=True)
    for _, name in steps:
        candidate = f"{location.rstrip('/')}/{name}"
        if exists(f"{candidate}/{CHECKPOINT_COMMIT}"):
            return candidate
    return None


def settle_outputs(result: dict[str, Any], checkpoints: str) -> list[str]:
    """Make the result name only what exists, before its paths are rewritten: `checkpoint` becomes
    the newest complete one under `checkpoints` (the run's checkpoint storage; dropped, with a
    warning, when there is none), and every other output path or URI is checked. Returns the
    outputs that are missing."""
    outputs = result.get("outputs") or {}
    if "checkpoint" in outputs:
        newest = newest_checkpoint(checkpoints)
        if newest is None:
            log.warning("no complete checkpoint under %s: the result names none", checkpoints)
            outputs.pop("checkpoint")
        else:
            if os.path.basename(str(outputs["checkpoint"]).rstrip("/")) != os.path.basename(newest):
                log.warning("the stage reported checkpoint %s; the newest complete one in the run's "
                            "storage is %s", outputs["checkpoint"], newest)
            outputs["checkpoint"] = newest
    return [f"{key}: {value}" for key, value in outputs.items() if key != "checkpoint"
            and isinstance(value, str) and value.startswith(("/", "s3://")) and not exists(value)]


def rewrite(data: Any, mapping: dict[str, str]) -> Any:
    """Replace path prefixes in every string of `data`, longest prefix first."""
    keys = sorted((k for k in mapping if k), key=len, reverse=True)
    if isinstance(data, dict):
        return {k: rewrite(v, mapping) for k, v in data.items()}
    if isinstance(data, list):
        return [rewrite(v, mapping) for v in data]
    if isinstance(data, str):
        for key in keys:
            base = key.rstrip("/")
            if data == base or data.startswith(base + "/"):
                return mapping[key].rstrip("/") + data[len(base):]
    return data


def map_inputs(config: dict[str, Any], input_map: dict[str, str], workdir: Path,
               streamed: tuple[str, ...] = ()) -> dict[str, Any]:
    """Mounted inputs to their mount points; any other s3:// input downloaded into the work dir,
    but for the top-level keys in `streamed`: the stage reads those from S3 as it goes."""
    config = rewrite(config, input_map)
    kept = {k: config.pop(k) for k in streamed if k in config}
    downloads: dict[str, str] = {}

    def find(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in ("output_dir", "checkpoint_uri"):   # where it writes, not inputs
                    find(v, k)
        elif isinstance(value, list):
            for v in value:
                find(v)
        elif isinstance(value, str) and value.startswith(("s3://", "fsx://")):
            if value.startswith("fsx://"):
                raise SystemExit(f"{value}: FSx inputs must be mounted by the platform (SageMaker "
                                 "FSx channels, a Kubernetes volume); this job has no mount for it.")
            parts = value.split("/")
            cut = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
            base = "/".join(parts[:cut])
            if base not in downloads:
                target = workdir / "inputs" / hashlib.sha256(base.encode()).hexdigest()[:12]
                target.parent.mkdir(parents=True, exist_ok=True)
                download(base, target)
                single = [p for p in target.iterdir()] if target.is_dir() else []
                is_object = len(single) == 1 and single[0].name == base.rsplit("/", 1)[-1] and "." in single[0].name
                downloads[base] = str(single[0] if is_object else target)

    find(config)
    return {**rewrite(config, downloads), **kept}


def keeps_checkpoints(entrypoint: str, config: dict[str, Any]) -> bool:
    """Whether the stage's progress is checkpoints that must leave the node. Ours say so in
    CHECKPOINTED_STAGES, whatever their config names; a stage of someone else's by the
    `checkpoint_uri` key of its config."""
    return entrypoint in CHECKPOINTED_STAGES or "checkpoint_uri" in config


def merge_hosts(source: Path, target: Path) -> None:
    """The hosts' output dirs (`host-<i>/`, or `source` itself from a single host) into one."""
    hosts_dirs = sorted(p for p in source.glob("host-*") if p.is_dir()) or [source]
    for path in hosts_dirs:
        shutil.copytree(path, target, dirs_exist_ok=True, symlinks=True)
    log.info("merged %d host output dir(s) from %s into %s", len(hosts_dirs), source, target)


# -- run ---------------------------------------------------------------------------------------

def run(cmd: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run the stage, echoing its output; SIGTERM (stop, spot interruption) is passed on so the
    stage can checkpoint. Returns the exit code and the last lines for a failure report."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    signal.signal(signal.SIGTERM, lambda signum, _: proc.send_signal(signum))
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))
    return proc.wait(), list(tail)


def process_dir(workdir: Path) -> Path:
    """Where this process keeps its own files (config, result). When a launcher started one
    copy of this script per rank (SageMaker's toolkit runs torchrun around it), the copies on a
    host share LLMOPS_WORKDIR: each gets `rank-<LOCAL_RANK>` (or RANK) so they do not overwrite
    each other's config or delete each other's result. Inputs and outputs stay shared."""
    rank = os.environ.get("LOCAL_RANK") or os.environ.get("RANK")
    return workdir / f"rank-{int(rank)}" if rank is not None and rank.isdigit() else workdir


def paused_result(result_file: Path) -> dict[str, Any] | None:
    """The result of a stage that paused on request, else None (a failed stage writes none)."""
    try:
        result = json.loads(result_file.read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("paused") else None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, stage_argv = parse_args(argv)
    workdir = Path(args.workdir or os.environ.get("LLMOPS_WORKDIR") or tempfile.mkdtemp(prefix="llmops-job-"))
    workdir.mkdir(parents=True, exist_ok=True)
    own = process_dir(workdir)
    own.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = args.checkpoint_dir if args.checkpoint_dir is not None else os.environ.get(
        "LLMOPS_CHECKPOINT_DIR", "")

    if args.config_json:
        config = json.loads(args.config_json)
    elif args.config:
        config = json.loads(read_text(os.path.expandvars(args.config)))
    else:
        raise SystemExit("job_entry.py needs --config or --config-json.")
    input_map = json.loads(args.input_map) if args.input_map else {}
    if args.input_map_file:
        input_map.update(json.loads(read_text(os.path.expandvars(args.input_map_file))))
    input_map = {k: os.path.expandvars(v) for k, v in input_map.items()}
    config = map_inputs(config, input_map, workdir, STREAMED_INPUTS.get(args.entrypoint, ()))

    host, n_hosts = hosts()
    output_uri = args.output_uri
    target = str(config.get("output_dir", ""))
    upload_outputs = False
    if args.output_local:  # the platform uploads this dir (Processing): one subdir per host
        local_out = Path(args.output_local) / (f"host-{host}" if n_hosts > 1 else "")
        if n_hosts > 1:
            output_uri = f"{output_uri.rstrip('/')}/host-{host}"
    elif "://" in target:
        # the stage writes on this node; its outputs go where its config says once it ends
        # (--output-uri, when given, says where instead)
        local_out, upload_outputs = workdir / "output", True
        output_uri = output_uri or target
    else:  # a path on storage the job shares with Airflow
        local_out = Path(target or workdir / "output")
    local_out.mkdir(parents=True, exist_ok=True)
    if args.merge_output:
        merge_hosts(Path(os.path.expandvars(args.merge_output)), local_out)
    checkpoint_uri = os.path.expandvars(args.checkpoint_uri)   # a tuning job's trial: its name
    mirrored = keeps_checkpoints(args.entrypoint, config)
    if checkpoint_uri and not checkpoint_dir and mirrored:
        if checkpoint_uri.startswith("s3://"):
            # Nothing syncs this node's disk (Batch, HyperPod): the stage writes every checkpoint
            # through to S3 as it commits, and restores from there on a fresh node. Set whether
            # or not the config names the key: the stage decides, not the config's author.
            config["checkpoint_uri"] = config.get("checkpoint_uri") or checkpoint_uri
        else:
            checkpoint_dir = checkpoint_uri   # a shared mount (FSx, EFS), linked like a synced dir
    node_local = upload_outputs or bool(args.output_local)   # uploaded only once the stage ends
    if mirrored and node_local and not checkpoint_dir and not config.get("checkpoint_uri"):
        log.error("%s keeps its progress in checkpoints, and nothing would take them off this "
                  "node: its output_dir %s is uploaded only when it ends, this job has no "
                  "--checkpoint-uri and no synced checkpoint dir. Set the config's checkpoint_uri "
                  "to an s3:// prefix, or pass --checkpoint-uri (the backends pass the run's "
                  "checkpoint storage).", args.entrypoint, target or "(none)")
        return 2
    if checkpoint_dir:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        link = local_out / "checkpoints"
        if not link.exists() and not link.is_symlink():
            try:
                link.symlink_to(checkpoint_dir, target_is_directory=True)
            except FileExistsError:  # another rank on this host made it a moment ago
                pass
    if "output_dir" in config:
        config["output_dir"] = str(local_out)

    config_file, result_file = own / "config.json", own / "result.json"
    config_file.write_text(json.dumps(config, indent=2))
    result_file.unlink(missing_ok=True)
    cmd = launch_command(args, ["--config", str(config_file), "--result", str(result_file), *stage_argv])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log.info("running %s", " ".join(cmd))
    mapping = {str(local_out): output_uri or str(local_out)}
    if checkpoint_uri:
        mapping[str(local_out / "checkpoints")] = checkpoint_uri
        if checkpoint_dir:
            mapping[checkpoint_dir] = checkpoint_uri
            mapping[os.path.realpath(checkpoint_dir)] = checkpoint_uri
    destination = args.result if n_hosts == 1 or host == 0 else args.result.replace(
        "result.json", f"result-host-{host}.json")
    code, tail = run(cmd, env)
    paused = paused_result(result_file) if code != 0 and is_leader(args) else None
    if paused is not None:
        # Paused on request (tasks/train/pause.py): the result names the step and its checkpoint
        # (written through to checkpoint_uri as it committed), which the task reports; published
        # like a finished job's. The exit is PAUSED_EXIT whatever the launcher made of rank 0's
        # (torchrun turns any non-zero exit into its own 1).
        write_text(destination, json.dumps(rewrite(paused, mapping), indent=2, sort_keys=True, default=str))
        log.info("paused at step %s on request; result written to %s", paused.get("paused_at_step"),
                 destination)
        return PAUSED_EXIT
    if code != 0:
        if os.path.isdir(os.path.dirname(FAILURE_FILE)):
            Path(FAILURE_FILE).write_text(f"{args.entrypoint} exited with {code}:\n" + "\n".join(tail[-15:]))
        log.error("%s exited with code %d", args.entrypoint, code)
        return code
    # Processing hosts each own a share of the data and report it; elsewhere only the leader does.
    if not is_leader(args) and not args.output_local:
        return 0
    if not result_file.exists():
        log.error("%s exited 0 but wrote no result JSON", args.entrypoint)
        return 3
    result = json.loads(result_file.read_text())
    mirror = str(config.get("checkpoint_uri") or "")
    missing = settle_outputs(result, mirror or checkpoint_dir or str(local_out / "checkpoints"))
    if missing:
        log.error("%s's result names outputs that do not exist: %s", args.entrypoint,
                  "; ".join(missing))
        return 3
    if upload_outputs:
        count = upload(local_out, output_uri)
        log.info("uploaded %d output files to %s", count, output_uri)
    result = rewrite(result, mapping)
    write_text(destination, json.dumps(result, indent=2, sort_keys=True, default=str))
    log.info("result written to %s", destination)
    return 0


if __name__ == "__main__":
    sys.exit(main())
