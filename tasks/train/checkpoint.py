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

import ctypes
import hashlib
import logging
import math
import mmap
import os
import re
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.serialization import config as serialization_config

from tasks.common.io import fsync_dir, publish_dir, read_json, sha256_file, write_json
from tasks.train.retention import prunable

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SHARDED = "dcp"  # manifest "layout" of a torch.distributed.checkpoint checkpoint
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


BytesMoved = Callable[[int], None]  # n more bytes of a checkpoint moved (the watchdog's I/O beat)
WRITE_CHUNK = 64 << 20  # bytes per write() between progress beats


class _HashingFile:
    """What torch.save writes into: each chunk goes to the file and into its sha256 as it comes
    (the manifest's hash without reading the file back), and every WRITE_CHUNK bytes are a
    progress beat. No serialized copy of the state is held: a BytesIO doubled host memory and,
    growing by reallocation, copied the bytes again, under the GIL."""

    def __init__(self, fh: Any, progress: BytesMoved | None) -> None:
        self.fh, self.progress = fh, progress
        self.sha256 = hashlib.sha256()
        self.bytes = self.unreported = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_CHUNK):  # in chunks: a slow disk still beats
            chunk = view[start:start + WRITE_CHUNK]
            self.sha256.update(chunk)
            self.fh.write(chunk)
            self.unreported += len(chunk)
            if self.unreported >= WRITE_CHUNK:
                self.flush()
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:  # torch.save flushes once it has written everything
        if self.progress is not None and self.unreported:
            self.progress(self.unreported)
        self.unreported = 0


def _save_tensor_file(obj: Any, path: Path,
                      progress: BytesMoved | None = None) -> dict[str, Any]:
    """Write obj to path; returns its manifest entry."""
    # directly into the checkpoint's private temporary directory: the rename of the whole
    # directory is what makes it appear, so the file needs no temporary name of its own
    with open(path, "wb") as fh, serialization_config.patch({"save.compute_crc32": False}):
        # torch.save's own CRC32 of each record is redundant with the manifest's sha256, which
        # is checked before any load, and it is slow: serializing ran at 528 MB/s with it and
        # 1446 MB/s without (one core). (A process-wide setting, read as torch.save starts: a
        # save elsewhere at that moment may also leave it out, and torch.load reads either.)
        out = _HashingFile(fh, progress)
        torch.save(obj, out)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}


def _write_files(tmp: Path, tensors: dict[str, Any],
                 progress: BytesMoved | None) -> dict[str, Any]:
    """tensors[name] to tmp/<name>.pt; their manifest entries."""
    return {f"{name}.pt": _save_tensor_file(obj, tmp / f"{name}.pt", progress)
            for name, obj in tensors.items()}


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
                    write_files: Callable[..., dict[str, Any]] = _write_files) -> Path:
    """Write tensors[name] to <name>.pt and the resolved config to config.json under
    root/step_{step:06d}, atomically; then delete all but the newest `keep` checkpoints and the
    multiples of `keep_every` (tasks/train/retention.py). write_files(tmp, tensors, progress)
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
        files = write_files(tmp, tensors, progress)
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


# --------------------------------------------------------------------------------------------
# Asynchronous saving


class _SnapshotBuffers:
    """Host buffers reused from one save to the next (a save waits for the previous write, so
    they are free again by then): copying into memory that is already mapped is 2.5x faster
    than allocating a fresh copy (measured: 1.1 vs 2.7 ms for a 0.5M-parameter model's state on
    one core), and on a GPU the buffers are page-locked, so the device -> host copy runs
    asynchronously at full PCIe speed without pinning memory at every save.

    `shared`: the buffers are slices of one anonymous shared-memory file (a memfd, the arena)
    that the writer process maps too (_WriterProcess); one file, so one descriptor to hand over
    however many tensors the state has, and again to a writer that had to be restarted. Each
    slice is a tensor of its own size, so torch.save writes just its bytes. Pinned as well, the
    arena is registered with CUDA (cudaHostRegister), as torch's process-based DCP saver does
    with its shared buffers."""

    ALIGN = 64  # bytes: every slice starts on a cache line (and suits any dtype's alignment)
    SLICE = 16 << 20  # bytes: the unit of the parallel copy

    def __init__(self, pinned: bool, shared: bool = False) -> None:
        self.pinned, self.shared = pinned, shared
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.arena_fd: int | None = None
        self.layout: list[tuple[tuple, torch.dtype, tuple, int]] = []  # key, dtype, shape, offset
        self.generation = 0  # +1 with each new arena: the writer process maps it again
        self._pool: ThreadPoolExecutor | None = None  # the copy's threads, from the first save

    def buffer(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        """The buffer `t` is copied into."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
        return buf

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (buffer, tensor). From a GPU: queued on the stream, pinned, non-blocking.
        From CPU memory: on every core, in slices of even size (training waits for this copy,
        and a copy on one thread runs at one core's memory bandwidth: 1 GB took 0.161 s on one
        thread and 0.086 s on two here; a job that trains on one thread, as the accelerator's
        does, would leave the others idle meanwhile)."""
        if self.pinned or len(pairs) == 0:
            for buf, t in pairs:
                buf.copy_(t.detach(), non_blocking=self.pinned)
            return
        slices = []
        for buf, t in pairs:
            to, source = buf.view(-1), t.detach().reshape(-1)
            step = max(1, self.SLICE // buf.element_size())  # elements per slice
            slices += [(to[i:i + step], source[i:i + step]) for i in range(0, to.numel(), step)]
        threads = min(len(os.sched_getaffinity(0)), len(slices))
        total = sum(d.numel() * d.element_size() for d, _ in slices)
        if threads < 2 or total <= self.SLICE:  # not worth a hand-over
            _copy_run(slices)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-copy")
        # contiguous runs of slices of about equal bytes, one per thread
        runs: list[list] = [[] for _ in range(threads)]
        done = 0
        for d, t in slices:
            runs[min(threads - 1, done * threads // max(total, 1))].append((d, t))
            done += d.numel() * d.element_size()
        for future in [self._pool.submit(_copy_run, run) for run in runs]:
            future.result()

    def fit(self, state: Any) -> None:
        """Shared: lay a new arena out for the tensors of `state` unless the current one fits
        them already (every save after the first, unless the state changed shape)."""
        if not self.shared:
            return
        specs: list[tuple[tuple, torch.dtype, tuple]] = []
        _map_state(state, lambda x, key: isinstance(x, torch.Tensor) and x.numel()
                   and specs.append((key, x.dtype, tuple(x.shape))))
        if [spec[:3] for spec in self.layout] == specs:
            return
        layout, size = [], 0
        for key, dtype, shape in specs:
            layout.append((key, dtype, shape, size))
            size += -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN
        fd = os.memfd_create("llmops-checkpoint", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(size, 1))
        arena = mmap.mmap(fd, max(size, 1))
        if self.pinned:
            from torch.cuda import _pin_memory_utils as pinning

            address = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
            pinning.pin_memory(address, len(arena))
            weakref.finalize(arena, pinning.unpin_memory, address)
        if self.arena_fd is not None:
            os.close(self.arena_fd)
        self.arena_fd, self.layout, self.generation = fd, layout, self.generation + 1
        self.buffers = arena_tensors(arena, layout)


def _copy_run(run: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for to, source in run:
        to.copy_(source)


def arena_tensors(arena: mmap.mmap, layout: list[tuple[tuple, torch.dtype, tuple, int]]
                  ) -> dict[tuple, torch.Tensor]:
    """The tensors a shared arena holds, by key (in the training and in the writer process)."""
    return {key: torch.frombuffer(arena, dtype=dtype, count=math.prod(shape),
                                  offset=offset).view(shape)
            for key, dtype, shape, offset in layout}


def _map_state(state: Any, leaf: Callable[[Any, tuple], Any], key: tuple = ()) -> Any:
    """A nested state (dicts, lists, tuples) with each leaf x replaced by leaf(x, its key path)."""
    if isinstance(state, dict):
        return {k: _map_state(v, leaf, (*key, k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map_state(v, leaf, (*key, i)) for i, v in enumerate(state))
    return leaf(state, key)


def snapshot(state: Any, buffers: _SnapshotBuffers | None = None) -> Any:
    """A CPU copy of every tensor in a nested state, detached from the live training state,
    which the optimizer goes on updating in place while the copy is written; into `buffers`
    when given (the caller must not snapshot into them again while a copy is still being
    written). Call torch.cuda.synchronize() before using a copy made from GPU tensors into
    pinned buffers."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(x: Any, key: tuple) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if buffers is None:
            return x.detach().to("cpu", copy=True)
        pairs.append((buffers.buffer(key, x), x))
        return pairs[-1][0]
    copied = _map_state(state, copy)
    if buffers is not None:
        buffers.copy(pairs)
    return copied


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a nested state."""
    sizes: list[int] = []
    _map_state(state, lambda x, _: isinstance(x, torch.Tensor)
               and sizes.append(x.numel() * x.element_size()))
    return sum(sizes)


class _Writer:
    """One long-lived thread that runs the background part of each save, one at a time.

    Not a thread per save: Thread.start() waits for the new thread to signal that it runs, and
    that thread, busy pickling the state, then holds the GIL for up to the interpreter's switch
    interval (5 ms) before training gets it back (measured: 2.6-4.5 ms blocked per save, most of
    it this). Handing the job to a waiting thread costs training nothing: the writer runs when
    the training thread next releases the GIL, inside torch's kernels."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._idle.wait()  # at most one save in flight
        self._idle.clear()
        self._jobs.put((fn, args))

    def wait(self) -> None:
        self._idle.wait()

    def _serve(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                fn(*args)  # records its own failure for the training thread (Checkpointer._error)
            finally:
                self._idle.set()


# A state of at least this many bytes is written by a process of its own. The writer thread
# holds the GIL while torch.save pickles and frames the state, and training waits for it: on a
# 5M-parameter model (62 MB checkpoint) its steps ran 3.6% slower while a save was written.
# A process costs one start (it imports torch: ~1.5 s of CPU, off the training thread) and
# shared memory for the snapshot; below this size the thread's cost is smaller than that.
PROCESS_WRITER_MIN_BYTES = 16 << 20


@dataclass(frozen=True)
class _Shared:
    """Stands in a state sent to the writer process for the shared buffer under `key`."""
    key: tuple


def _writer_process_main(sock_fd: int) -> None:
    """The writer process. Messages from the training process: ("arena", size, layout) followed
    by the arena's memfd; ("write", directory, the state with _Shared references). It answers a
    write with ("progress", n)... then ("done", manifest entries) or ("error", why). It exits
    when the training process closes the socket or dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a killed job leaves no writer behind
    torch.set_num_threads(1)  # it moves bytes; the cores are training's
    sock = socket.socket(fileno=sock_fd)
    conn = Connection(os.dup(sock_fd))
    shared: dict[tuple, torch.Tensor] = {}
    try:
        conn.send(("ready",))
        while True:
            kind, *body = conn.recv()
            if kind == "arena":
                size, layout = body
                [fd] = recvfds(sock, 1)
                shared = arena_tensors(mmap.mmap(fd, size), layout)
                os.close(fd)  # the mapping stays
                continue
            tmp, state = body
            try:
                tensors = _map_state(state, lambda x, _: shared[x.key]
                                     if isinstance(x, _Shared) else x)
                files = _write_files(Path(tmp), tensors, lambda n: conn.send(("progress", n)))
            except Exception as exc:  # noqa: BLE001 - reported to the training process
                conn.send(("error", f"{exc.__class__.__name__}: {exc}"))
            else:
                conn.send(("done", files))
    except (EOFError, OSError):  # the training process closed the socket or is gone
        return


# what the writer process runs: argv = the project root, the socket's file descriptor
_WRITER_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from tasks.train.checkpoint import _writer_process_main; "
                "_writer_process_main(int(sys.argv[2]))")
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class _WriterProcess:
    """A process that writes the .pt files of each save from shared memory, so that no part of
    a save holds the training process's GIL; the writer thread hands it the job, relays its
    progress beats and commits what it wrote. A fresh interpreter (subprocess), not a fork: the
    training process has threads (and perhaps CUDA), which a fork does not survive; and not
    multiprocessing's spawn, which re-imports the caller's __main__ (a user's script without a
    __main__ guard would run again). Each buffer's memfd crosses the socket once; after that a
    job is a few kilobytes."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER_MAIN, _PROJECT_ROOT, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock, self._conn = ours, Connection(os.dup(ours.fileno()))
        self._generation = 0  # of the arena the process has mapped (none yet)
        self._ready = False
        # stopped with its Checkpointer, or at exit
        weakref.finalize(self, _stop_writer, self._sock, self._conn, self._proc)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def ready(self) -> bool:
        """Whether it has started (imported torch: ~1.5 s of CPU) and takes jobs."""
        if not self._ready and self._conn.poll():
            self._ready = self._conn.recv() == ("ready",)
        return self._ready

    def write_files(self, tmp: Path, snap: dict[str, Any], buffers: _SnapshotBuffers,
                    progress: BytesMoved | None) -> dict[str, Any]:
        try:
            if self._generation != buffers.generation:
                self._conn.send(("arena", os.fstat(buffers.arena_fd).st_size, buffers.layout))
                sendfds(self._sock, [buffers.arena_fd])
                self._generation = buffers.generation
            shared = {id(buffers.buffers[key]): key for key, *_ in buffers.layout}
            # tensors outside the arena (empty ones) travel in the message itself
            self._conn.send(("write", str(tmp), _map_state(
                snap, lambda x, _: _Shared(shared[id(x)]) if id(x) in shared else x)))
            while True:
                kind, value = self._conn.recv()
                if kind == "done":
                    return value
                if kind == "error":
                    raise RuntimeError(f"the checkpoint writer process failed: {value}")
                if progress is not None:
                    progress(value)
        except (EOFError, OSError) as exc:
            self.close()
            raise RuntimeError(f"the checkpoint writer process died (exit code "
                               f"{self._proc.poll()})") from exc

    def close(self) -> None:
        _stop_writer(self._sock, self._conn, self._proc)


def _stop_writer(sock: socket.socket, conn: Connection, proc: subprocess.Popen) -> None:
    """Stop a writer process; a save it was writing is left as a temporary directory, which the
    next save removes."""
    conn.close()
    sock.close()
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


class Checkpointer:
    """Checkpoints under `root`, optionally mirrored to S3, written in the background.

    save() blocks only to wait for the previous save if it is still being written (at most one
    in flight, so host memory holds at most one extra copy of the state) and to copy the state
    to CPU memory. Serializing, fsync, the manifest, the rename, pruning (the newest `keep` and
    every multiple of `keep_every`, tasks/train/retention.py) and the upload
    run on a thread (the .pt files of a state of PROCESS_WRITER_MIN_BYTES or more are written by
    a process of its own, see _WriterProcess). A background failure is raised by the next save() or wait(): a job must not
    train on for hours believing it has checkpoints it does not have. on_progress(n) is called
    (on whichever thread moves them) for every chunk of bytes written, uploaded or downloaded:
    the supervisor's watchdog counts it as progress while training waits on that I/O.
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
        self._writer: _Writer | None = None  # the background thread, started at the first save
        self._error: BaseException | None = None
        self.process_min_bytes = process_min_bytes
        self._buffers: _SnapshotBuffers | None = None  # chosen at the first save, by its size
        self._process: _WriterProcess | None = None  # started by the first save that needs it
        # sharded (FSDP): every rank saves its shards, through this group (see shard_with)
        self.group: Any = None
        self.rank = 0

    def shard_with(self, group: Any, rank: int) -> None:
        """From now on every rank calls save() with its shards (distributed.sharded_state) and
        the trainer state; `group` (distributed.DistContext.checkpoint_group) carries the
        checkpoint's collectives, which run beside training's."""
        self.group, self.rank = group, rank

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Checkpoint `state` as step `step`; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        if self.group is not None:
            self._save_sharded(step, state)
            return time.perf_counter() - t0
        if self._buffers is None:
            self._buffers = _SnapshotBuffers(
                pinned=torch.cuda.is_available(),
                shared=self.asynchronous and state_bytes(state) >= self.process_min_bytes)
        self._buffers.fit(state)
        snap = snapshot(state, self._buffers)
        if self._buffers.pinned:
            torch.cuda.synchronize()  # the pinned copies were queued non-blocking
        if self.asynchronous:
            self._background(self._write, step, snap)
        else:
            self._write(step, snap)
            self._raise()
        return time.perf_counter() - t0

    def _write(self, step: int, snap: dict[str, Any]) -> None:
        try:
            t0 = time.perf_counter()
            if self.before_write is not None:
                self.before_write(step)
            path = save_checkpoint(self.root, step, snap, self.config, keep=self.keep,
                                   progress=self.on_progress, keep_every=self.keep_every,
                                   write_files=self._files_writer())
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
            return _write_files
        if self._process is None or not self._process.alive:
            self._process = _WriterProcess()
        process = self._process
        if not process.ready:
            return _write_files
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
                files["trainer.pt"] = _save_tensor_file(trainer, tmp / "trainer.pt",
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
            self._writer = _Writer(f"checkpoint-writer-{self.root.name}")
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
        mirror has (a replaced node, a wiped disk) is downloaded first."""
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
            problem = verify_checkpoint(path) if path is not None else "not on local disk"
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

    def ensure_local(self, path: str | Path) -> Path:
        """`path` on this machine: another node's rank 0 chose it; fetch it from the mirror."""
        path = Path(path)
        if verify_checkpoint(path) is None:
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

    def _fetch(self, step: int) -> tuple[Path, str | None]:
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}-download-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.mirror.download(step, tmp, progress=self.on_progress)
            problem = verify_checkpoint(tmp)
            if problem is not None:
                return final, f"the mirror's copy is bad too: {problem}"
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            return final, None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _trained_on_skipped(path: Path, skipped: set[int] | frozenset[int]) -> str | None:
    if not skipped:
        return None
    trainer = read_part(path, "trainer") or {}
    cursor = int(trainer.get("data_cursor", trainer.get("step", 0)))
    own = set(trainer.get("skipped_batches", []))
    used = sorted(b for b in skipped if b < cursor and b not in own)
    return f"it was trained on batches since marked bad: {used[:10]}" if used else None
