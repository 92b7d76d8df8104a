"""Atomic, verifiable checkpoints: <root>/step_{step:06d}/ with a manifest written last, written
in the background and optionally mirrored to S3.

A checkpoint is written into a hidden temporary directory, every file is fsynced, a manifest with
each file's sha256 and size is written last, and only then is the directory renamed into place.
A reader therefore never sees a half-written step_* directory; one that is damaged afterwards
(a truncated copy from S3, a bad disk) fails its checksum and `latest_valid_checkpoint` falls
back to the one before. Everything loads with torch.load(weights_only=True): no pickled code.

Two layouts, one contract. One process or DDP: rank 0 writes <name>.pt files (model, optimizer,
trainer). FSDP: every rank writes its own shards through torch.distributed.checkpoint
(__<rank>_<n>.distcp, plus DCP's .metadata): nothing is gathered, and a job on another world
size reads them resharded. Each rank hashes its own files; rank 0 adds trainer.pt (step, data
cursor, RNG, guard state) and the manifest, last, once every rank's files are done, then renames
the directory into place. The manifest's "layout" says which one a checkpoint is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tasks.common.io import fsync_dir, publish_dir, read_json, sha256_file, write_json
from tasks.train.checkpoint_io import (PROCESS_WRITER_MIN_BYTES, BytesMoved, SnapshotBuffers,
                                       Writer, WriterDied, WriterProcess, plan_snapshot,
                                       save_tensor_file, snapshot, state_bytes, write_files)
from tasks.train.retention import prunable

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SHARDED = "dcp"  # manifest "layout" of a torch.distributed.checkpoint checkpoint
SHARD_SUFFIX = ".distcp"  # a rank's shard file of a sharded checkpoint (the rest every rank reads)
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Finished-looking checkpoint directories, newest first (temporary ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def verify_checkpoint(path: str | Path) -> str | None:
    """None when every file the manifest lists is present with its size and sha256, else why not."""
    path = Path(path)
    try:
        manifest = read_json(path / MANIFEST)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc.__class__.__name__}: {exc})"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {info['bytes']}"
        if sha256_file(f) != info["sha256"]:
            return f"{name} fails its sha256"
    return None


def latest_valid_checkpoint(root: str | Path, *, max_step: int | None = None) -> Path | None:
    """The newest checkpoint under root (at or before max_step) that verifies; partial or
    corrupt ones are skipped."""
    for step, path in step_dirs(root):
        if max_step is not None and step > max_step:
            continue
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def save_checkpoint(root: str | Path, step: int, tensors: dict[str, Any], config: dict[str, Any],
                    keep: int, progress: BytesMoved | None = None, keep_every: int = 0,
                    files_writer: Callable[..., dict[str, Any]] = write_files) -> Path:
    """Write tensors[name] to <name>.pt and the resolved config to config.json under
    root/step_{step:06d}, atomically; then delete all but the newest `keep` checkpoints and the
    multiples of `keep_every` (tasks/train/retention.py). files_writer(tmp, tensors, progress)
    writes the .pt files (here, or in the writer process) and returns their manifest entries."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    # leftovers of a job killed mid-save are never read; clear them so they do not pile up
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        files = files_writer(tmp, tensors, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(tmp, final, step, files, config, keep, keep_every=keep_every)


def _file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _commit(tmp: Path, final: Path, step: int, files: dict[str, Any], config: dict[str, Any],
            keep: int, layout: str | None = None, keep_every: int = 0) -> Path:
    """Add config.json and the manifest (last) to the files written in tmp, rename tmp to final
    and prune to the retention policy (the newest `keep`, the multiples of `keep_every`)."""
    try:
        write_json(tmp / "config.json", config)
        files = {**files, "config.json": _file_entry(tmp / "config.json")}
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files, "created": time.time()}
        write_json(tmp / MANIFEST, {**manifest, "layout": layout} if layout else manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # A retry that reached the same step again replaces the old copy, which may be the damaged
    # one that sent us back.
    publish_dir(tmp, final)
    dirs = dict(step_dirs(final.parent))
    for old in prunable(dirs, keep_last=keep, keep_every=keep_every, newest=step):
        shutil.rmtree(dirs[old], ignore_errors=True)
    return final


def is_sharded(path: str | Path) -> bool:
    """Whether a checkpoint holds torch.distributed.checkpoint shards (FSDP) or .pt files."""
    return read_json(Path(path) / MANIFEST).get("layout") == SHARDED


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Every <name>.pt of a checkpoint by name, plus its config; weights_only, so loading runs no
    code from the file. A sharded checkpoint's model and optimizer come whole, read in this one
    process (for export, inspection, or a job without FSDP; FSDP reads its shards with
    distributed.load_sharded_state). Its optimizer state is keyed by parameter name, as
    torch.distributed.checkpoint.state_dict.set_state_dict takes it."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    out: dict[str, Any] = {"step": manifest["step"], "config": read_json(path / "config.json")}
    for name in manifest["files"]:
        if name.endswith(".pt"):
            out[name[:-3]] = torch.load(path / name, map_location=map_location, weights_only=True)
    if manifest.get("layout") == SHARDED:
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            whole = Path(scratch) / "whole.pt"
            dcp_to_torch_save(path, whole)
            out.update(torch.load(whole, map_location=map_location, weights_only=True))
    return out


def load_model_weights(path: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """The weights of a checkpoint of either layout into `model` (whole, in this process); of a
    sharded one only the model's tensors are read, not the optimizer's."""
    if is_sharded(path):
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(read_part(path, "model"))
    return model


def read_part(path: str | Path, name: str) -> Any:
    """One <name>.pt of a checkpoint (e.g. the small trainer state), or None if it has none."""
    f = Path(path) / f"{name}.pt"
    return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None


class Checkpointer:
    """Checkpoints under `root`, optionally mirrored to S3, written in the background.

    save() blocks only to wait for the previous save if it is still being written (at most one
    in flight, so host memory holds at most one extra copy of the state). The copy of the state
    (into reused host buffers) is made in save(), or with copy_in_background on the writer
    thread beside training's next forward and backward passes, which do not change it (the
    caller then calls wait_for_snapshot() before the optimizer step changes it). From a GPU the
    copy is made in save(). Serializing, fsync, the manifest, the rename, pruning (the newest
    `keep` and every multiple of `keep_every`, tasks/train/retention.py) and the upload run on a
    thread (the .pt files of a state of PROCESS_WRITER_MIN_BYTES or more are written by a process of
    its own, see WriterProcess). A background failure is raised by the next save() or wait(): a
    job must not train on for hours believing it has checkpoints it does not have.
    on_progress(n) is called (on whichever thread moves them) for every chunk of bytes written,
    uploaded or downloaded: the supervisor's watchdog counts it as progress while training waits
    on that I/O.
    """

    def __init__(self, root: str | Path, *, keep: int, config: dict[str, Any],
                 keep_every: int = 0, asynchronous: bool = True, mirror: Any = None,
                 on_commit: Callable[[int, Path], None] | None = None,
                 on_progress: BytesMoved | None = None,
                 before_write: Callable[[int], None] | None = None,
                 process_min_bytes: int = PROCESS_WRITER_MIN_BYTES) -> None:
        self.root, self.keep, self.config = Path(root), keep, config
        self.keep_every = keep_every
        self.on_progress, self.before_write = on_progress, before_write
        self.asynchronous, self.mirror, self.on_commit = asynchronous, mirror, on_commit
        self.last: Path | None = None  # newest checkpoint committed by this object
        self._writer: Writer | None = None  # the background thread, started at the first save
        self._error: BaseException | None = None
        self.process_min_bytes = process_min_bytes
        self._buffers: SnapshotBuffers | None = None  # chosen at the first save, by its size
        self._copied = threading.Event()  # clear while a save's copy of the state is under way
        self._copied.set()
        self._process: WriterProcess | None = None  # started by the first save that needs it
        # sharded (FSDP): every rank saves its shards, through this group (see shard_with)
        self.group: Any = None
        self.rank = 0

    def shard_with(self, group: Any, rank: int) -> None:
        """From now on every rank calls save() with its shards (distributed.sharded_state) and
        the trainer state; `group` (distributed.DistContext.checkpoint_group) carries the
        checkpoint's collectives, which run beside training's."""
        self.group, self.rank = group, rank

    def save(self, step: int, state: dict[str, Any], *, copy_in_background: bool = False) -> float:
        """Checkpoint `state` as step `step`; returns the seconds training was blocked.
        copy_in_background (asynchronous, from CPU memory): the state is copied on the writer
        thread after this returns; the caller promises to call wait_for_snapshot() before it
        changes any tensor of `state` in place."""
        t0 = time.perf_counter()
        self.wait()
        if self.group is not None:
            self._save_sharded(step, state)
            return time.perf_counter() - t0
        if self._buffers is None:
            self._buffers = SnapshotBuffers(
                pinned=torch.cuda.is_available(),
                shared=self.asynchronous and state_bytes(state) >= self.process_min_bytes)
        self._buffers.fit(state)
        snap, pairs = plan_snapshot(state, self._buffers)
        if copy_in_background and self.asynchronous and not self._buffers.pinned:
            # The copy runs on the writer thread while training computes the next step's forward
            # and backward, which read the state but do not change it; the loop calls
            # wait_for_snapshot() before anything changes it (the optimizer step, a rollback).
            # It runs on the cores training leaves idle (one, where training uses all): a copy
            # training waited for would be quicker on all of them, this one runs beside it.
            # Counted here: torch's thread count is a per-thread setting.
            threads = max(1, len(os.sched_getaffinity(0)) - torch.get_num_threads())
            self._copied.clear()
            self._background(self._copy_and_write, step, snap, pairs, threads)
            return time.perf_counter() - t0
        self._buffers.copy(pairs)
        if self._buffers.pinned:
            torch.cuda.synchronize()  # the pinned copies were queued non-blocking
        if self.asynchronous:
            self._background(self._write, step, snap)
        else:
            self._write(step, snap)
            self._raise()
        return time.perf_counter() - t0

    def _copy_and_write(self, step: int, snap: dict[str, Any],
                        pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> None:
        try:
            assert self._buffers is not None
            self._buffers.copy(pairs, threads=threads)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc
            return
        finally:
            self._copied.set()
        self._write(step, snap)

    def wait_for_snapshot(self) -> float:
        """Block until the state of the last save() has been copied, so training may change it
        again; the seconds waited (none when the copy finished during the forward and backward
        passes). Called before every in-place change to the saved tensors."""
        if self._copied.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - t0

    def _write(self, step: int, snap: dict[str, Any]) -> None:
        try:
            t0 = time.perf_counter()
            if self.before_write is not None:
                self.before_write(step)

            def commit(files_writer: Callable[..., dict[str, Any]]) -> Path:
                return save_checkpoint(self.root, step, snap, self.config, keep=self.keep,
                                       progress=self.on_progress, keep_every=self.keep_every,
                                       files_writer=files_writer)
            try:
                path = commit(self._files_writer())
            except WriterDied as exc:
                # the snapshot is still whole in shared memory (the next save waits for this
                # one): written here instead, no save is lost; the next save starts a new process
                log.warning("%s; checkpoint step %d is written on the writer thread instead",
                            exc, step)
                self._process = None
                path = commit(write_files)
            where = str(path)
            if self.mirror is not None:
                where = self.mirror.upload_checkpoint(path, progress=self.on_progress)
                self.mirror.prune(self.keep, every=self.keep_every, newest=step)
            self.last = path
            log.info("checkpoint step %d committed to %s in %.2fs", step, where,
                     time.perf_counter() - t0)
            if self.on_commit is not None:
                self.on_commit(step, path)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _files_writer(self) -> Callable[..., dict[str, Any]]:
        """How this save's .pt files are written: by the writer process, or here while it
        starts (the first save, or the next one after it died): the save must not wait for it."""
        buffers = self._buffers
        if buffers is None or not buffers.shared:
            return write_files
        if self._process is None or not self._process.alive:
            self._process = WriterProcess()
        process = self._process
        if not process.ready:
            return write_files
        return lambda tmp, tensors, progress: process.write_files(tmp, tensors, buffers, progress)

    def _save_sharded(self, step: int, state: dict[str, Any]) -> None:
        """torch.distributed.checkpoint's async_save returns once this rank's shards are staged
        in CPU memory (all training waits for) and writes them on its own thread; ours then
        commits the directory (_commit_sharded)."""
        import torch.distributed.checkpoint as dcp

        # one name on every rank: they all write into it (it is removed at the next resume if
        # this save never commits, see find_resume)
        tmp = self.root / f".tmp-step_{step:06d}-sharded"
        shards = {k: v for k, v in state.items() if k != "trainer"}
        trainer = snapshot(state["trainer"])
        writer = dcp.FileSystemWriter(tmp)
        if self.asynchronous:
            future = dcp.async_save(shards, storage_writer=writer, process_group=self.group)
            self._background(self._commit_sharded, step, tmp, trainer, future.result)
        else:
            dcp.save(shards, storage_writer=writer, process_group=self.group)
            self._commit_sharded(step, tmp, trainer, lambda: None)
            self._raise()

    def _commit_sharded(self, step: int, tmp: Path, trainer: dict[str, Any],
                        written: Callable[[], Any]) -> None:
        """Every rank: wait for its shards, hash them (and upload them: with several nodes each
        uploads its own ranks' files), hand the entries to rank 0. Rank 0: once every rank's are
        in, add trainer.pt, config.json and the manifest, rename, upload the rest, manifest last.
        All ranks wait for that before the next save may start."""
        import torch.distributed as dist

        try:
            t0 = time.perf_counter()
            written()
            if self.before_write is not None and self.rank == 0:
                self.before_write(step)
            final = self.root / f"step_{step:06d}"
            own = {f.name: _file_entry(f) for f in sorted(tmp.glob(f"__{self.rank}_*.distcp"))}
            if self.mirror is not None:
                self.mirror.upload_files(tmp, final.name, sorted(own), progress=self.on_progress)
            entries: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(entries, own, group=self.group)
            if self.rank == 0:
                files = {name: e for rank_files in entries for name, e in rank_files.items()}
                files[".metadata"] = _file_entry(tmp / ".metadata")  # DCP's index of the shards
                files["trainer.pt"] = save_tensor_file(trainer, tmp / "trainer.pt",
                                                       self.on_progress)
                path = _commit(tmp, final, step, files, self.config, self.keep, layout=SHARDED,
                               keep_every=self.keep_every)
                where = str(path)
                if self.mirror is not None:
                    where = self.mirror.upload_checkpoint(
                        path, progress=self.on_progress,
                        skip=[n for n in files if n.endswith(".distcp")])
                    self.mirror.prune(self.keep, every=self.keep_every, newest=step)
                log.info("sharded checkpoint step %d (%d ranks) committed to %s in %.2fs", step,
                         len(entries), where, time.perf_counter() - t0)
            dist.barrier(group=self.group)
            if tmp.exists():  # another node's copy (rank 0 renamed its own): its files are up
                shutil.rmtree(tmp, ignore_errors=True)
            self.last = final
            if self.on_commit is not None and self.rank == 0:
                self.on_commit(step, final)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"saving a checkpoint under {self.root} failed: {error}") from error

    def _background(self, fn: Callable[..., None], *args: Any) -> None:
        if self._writer is None:
            self._writer = Writer(f"checkpoint-writer-{self.root.name}")
        self._writer.submit(fn, *args)

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; returns the newest checkpoint."""
        if self._writer is not None:
            self._writer.wait()
        self._raise()
        return self.last

    def find_resume(self, *, skipped: set[int] | frozenset[int] = frozenset(),
                    max_step: int | None = None) -> Path | None:
        """The newest checkpoint to resume from: valid (a corrupt or partial local copy is
        skipped, or replaced by the mirror's copy), at or before max_step, and not trained on
        any batch in `skipped` (batches marked bad after it was saved). A checkpoint only the
        mirror has (a replaced node, a wiped disk) is fetched first: whole, or, when the job
        reads shards per rank (FSDP) and the checkpoint is sharded, only the files every rank
        reads, each rank then fetching its own shards as it loads them (fetch_files)."""
        self.wait()
        if self.group is not None:
            # a sharded save that never committed; no rank writes until this choice is shared
            for stale in self.root.glob(".tmp-step_*-sharded"):
                shutil.rmtree(stale, ignore_errors=True)
        local = dict((s, p) for s, p in step_dirs(self.root))
        remote = set(self.mirror.steps()) if self.mirror is not None else set()
        for step in sorted(set(local) | remote, reverse=True):
            if max_step is not None and step > max_step:
                continue
            path = local.get(step)
            problem = self._usable(path) if path is not None else "not on local disk"
            if problem is not None and step in remote:
                log.warning("checkpoint step %d: %s; fetching it from %s", step, problem,
                            self.mirror.uri)
                path, problem = self._fetch(step)
            if problem is not None:
                log.warning("skipping checkpoint step %d: %s", step, problem)
                continue
            why_not = _trained_on_skipped(path, skipped)
            if why_not:
                log.warning("skipping checkpoint %s: %s", path, why_not)
                continue
            return path
        return None

    def _per_rank_shards(self) -> bool:
        """Whether each rank restores its own shards from the mirror (FSDP with a mirror)."""
        return self.group is not None and self.mirror is not None

    def _usable(self, path: Path) -> str | None:
        """None if `path` can be restored from: whole and verified, or, where each rank fetches
        its own shards, a sharded copy whose shared files are there and verified."""
        problem = verify_checkpoint(path)
        if problem is None or not self._per_rank_shards():
            return problem
        return _verify_shared(path) or None

    def ensure_local(self, path: str | Path) -> Path:
        """`path` on this machine: another node's rank 0 chose it; fetch it from the mirror
        (for a sharded one read per rank, its shared files only: see fetch_files)."""
        path = Path(path)
        if self._usable(path) is None:
            return path
        if self.mirror is None:
            raise FileNotFoundError(
                f"checkpoint {path}, chosen by rank 0, is not valid on this node. With several "
                "nodes, put output_dir on shared storage (FSx for Lustre) or set checkpoint_uri "
                "to an s3:// prefix so that every node can fetch it.")
        fetched, problem = self._fetch(int(path.name[len("step_"):]))
        if problem is not None:
            raise RuntimeError(f"checkpoint {path} is not on this node and its mirror copy is "
                               f"bad: {problem}")
        return fetched

    def fetch_files(self, path: str | Path, names: list[str] | None = None) -> None:
        """Have these files of checkpoint `path` (default: all it lists) on this node, fetching
        the missing ones from the mirror, verified before they appear. A sharded restore calls
        it with the shard files its rank's load plan reads (tasks/train/distributed.py), so the
        ranks of a new attempt fetch their own parts in parallel instead of each node fetching
        every rank's."""
        path = Path(path)
        files = read_json(path / MANIFEST)["files"]
        names = sorted(files) if names is None else sorted(names)
        missing = [n for n in names if not (path / n).is_file()
                   or (path / n).stat().st_size != files[n]["bytes"]]
        if not missing:
            return
        if self.mirror is None:
            raise FileNotFoundError(f"checkpoint {path} lacks {missing[:5]} and has no mirror to "
                                    "fetch them from.")
        self.mirror.download_files(int(path.name[len("step_"):]), path, missing,
                                   progress=self.on_progress, expected=files)

    def _fetch(self, step: int) -> tuple[Path, str | None]:
        """Fetch a step from the mirror: whole, or its shared files (see find_resume). One rank
        of a node fetches; the node's other ranks wait for it and find it there."""
        final = self.root / f"step_{step:06d}"
        self.root.mkdir(parents=True, exist_ok=True)
        with _node_lock(self.root / f".fetch-{final.name}.lock"):
            if final.is_dir() and self._usable(final) is None:   # another rank of this node
                return final, None
            tmp = self.root / f".tmp-{final.name}-download-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                if self._per_rank_shards():
                    self.mirror.download_files(step, tmp, [MANIFEST], progress=self.on_progress)
                    manifest = read_json(tmp / MANIFEST)
                    if manifest.get("layout") == SHARDED:
                        shared = [n for n in manifest["files"] if not n.endswith(SHARD_SUFFIX)]
                        self.mirror.download_files(step, tmp, shared, progress=self.on_progress,
                                                   expected=manifest["files"])
                    else:
                        shutil.rmtree(tmp)
                        self.mirror.download(step, tmp, progress=self.on_progress)
                else:
                    self.mirror.download(step, tmp, progress=self.on_progress)
                problem = self._usable(tmp)
                if problem is not None:
                    return final, f"the mirror's copy is bad too: {problem}"
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(self.root)
                return final, None
            except ValueError as exc:   # a file that does not match its manifest entry
                return final, f"the mirror's copy is bad too: {exc}"
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


def _verify_shared(path: Path) -> str | None:
    """None when a sharded checkpoint's files other than its shards (manifest, DCP's index, the
    trainer state, the config) are there and match the manifest."""
    try:
        manifest = read_json(path / MANIFEST)
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc.__class__.__name__}: {exc})"
    if manifest.get("layout") != SHARDED:
        return "not a sharded checkpoint"
    for name, info in manifest["files"].items():
        if name.endswith(SHARD_SUFFIX):
            continue
        f = path / name
        if not f.is_file() or f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            return f"{name} is missing or fails its sha256"
    return None


@contextlib.contextmanager
def _node_lock(path: Path):
    """An exclusive lock shared by the processes of this node (the ranks sharing `root`)."""
    import fcntl

    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _trained_on_skipped(path: Path, skipped: set[int] | frozenset[int]) -> str | None:
    if not skipped:
        return None
    trainer = read_part(path, "trainer") or {}
    cursor = int(trainer.get("data_cursor", trainer.get("step", 0)))
    own = set(trainer.get("skipped_batches", []))
    used = sorted(b for b in skipped if b < cursor and b not in own)
    return f"it was trained on batches since marked bad: {used[:10]}" if used else None
