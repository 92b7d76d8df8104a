"""How a checkpoint's bytes reach the disk: the snapshot of the training state into reusable
host buffers, torch.save streamed through a sha256 into the file, and the background writers (a
thread; for a large state, a process of its own over shared memory). What a checkpoint is
(layout, manifest, commit, retention, resume) is tasks/train/checkpoint.py."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.serialization import config as serialization_config

log = logging.getLogger(__name__)

BytesMoved = Callable[[int], None]  # n more bytes of a checkpoint moved (the watchdog's I/O beat)
WRITE_CHUNK = 64 << 20  # bytes per write() between progress beats


class HashingFile:
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


def save_tensor_file(obj: Any, path: Path,
                     progress: BytesMoved | None = None) -> dict[str, Any]:
    """Write obj to path; returns its manifest entry."""
    # directly into the checkpoint's private temporary directory: the rename of the whole
    # directory is what makes it appear, so the file needs no temporary name of its own
    with open(path, "wb") as fh, serialization_config.patch({"save.compute_crc32": False}):
        # torch.save's own CRC32 of each record is redundant with the manifest's sha256, which
        # is checked before any load, and it is slow: serializing ran at 528 MB/s with it and
        # 1446 MB/s without (one core). (A process-wide setting, read as torch.save starts: a
        # save elsewhere at that moment may also leave it out, and torch.load reads either.)
        out = HashingFile(fh, progress)
        torch.save(obj, out)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}


def write_files(tmp: Path, tensors: dict[str, Any],
                progress: BytesMoved | None) -> dict[str, Any]:
    """tensors[name] to tmp/<name>.pt; their manifest entries."""
    return {f"{name}.pt": save_tensor_file(obj, tmp / f"{name}.pt", progress)
            for name, obj in tensors.items()}


class SnapshotBuffers:
    """Host buffers reused from one save to the next (a save waits for the previous write, so
    they are free again by then): copying into memory that is already mapped is 2.5x faster
    than allocating a fresh copy (measured: 1.1 vs 2.7 ms for a 0.5M-parameter model's state on
    one core), and on a GPU the buffers are page-locked, so the device -> host copy runs
    asynchronously at full PCIe speed without pinning memory at every save.

    `shared`: the buffers are slices of one anonymous shared-memory file (a memfd, the arena)
    that the writer process maps too (WriterProcess); one file, so one descriptor to hand over
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

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int | None = None) -> None:
        """Copy each (buffer, tensor). From a GPU: queued on the stream, pinned, non-blocking.
        From CPU memory: on `threads` threads (default every core), in slices of even size (a
        copy on one thread runs at one core's memory bandwidth: 1 GB took 0.161 s on one thread
        and 0.086 s on two here; a job that trains on one thread, as the accelerator's does,
        would leave the others idle meanwhile)."""
        if self.pinned or len(pairs) == 0:
            for buf, t in pairs:
                buf.copy_(t.detach(), non_blocking=self.pinned)
            return
        slices = []
        for buf, t in pairs:
            to, source = buf.view(-1), t.detach().reshape(-1)
            step = max(1, self.SLICE // buf.element_size())  # elements per slice
            slices += [(to[i:i + step], source[i:i + step]) for i in range(0, to.numel(), step)]
        threads = min(threads or len(os.sched_getaffinity(0)), len(slices))
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
        map_state(state, lambda x, key: isinstance(x, torch.Tensor) and x.numel()
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


def map_state(state: Any, leaf: Callable[[Any, tuple], Any], key: tuple = ()) -> Any:
    """A nested state (dicts, lists, tuples) with each leaf x replaced by leaf(x, its key path)."""
    if isinstance(state, dict):
        return {k: map_state(v, leaf, (*key, k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(map_state(v, leaf, (*key, i)) for i, v in enumerate(state))
    return leaf(state, key)


def snapshot(state: Any, buffers: SnapshotBuffers | None = None) -> Any:
    """A CPU copy of every tensor in a nested state, detached from the live training state,
    which the optimizer goes on updating in place while the copy is written; into `buffers`
    when given (the caller must not snapshot into them again while a copy is still being
    written). Call torch.cuda.synchronize() before using a copy made from GPU tensors into
    pinned buffers."""
    copied, pairs = plan_snapshot(state, buffers)
    if buffers is not None:
        buffers.copy(pairs)
    return copied


def plan_snapshot(state: Any, buffers: SnapshotBuffers | None = None
                  ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """snapshot() up to its copy: the state's structure with each tensor replaced by its buffer
    (its containers are new, its other leaves the same), and the (buffer, tensor) pairs still to
    copy. Without buffers every tensor is copied here and no pair is left."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(x: Any, key: tuple) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if buffers is None:
            return x.detach().to("cpu", copy=True)
        pairs.append((buffers.buffer(key, x), x))
        return pairs[-1][0]
    return map_state(state, copy), pairs


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a nested state."""
    sizes: list[int] = []
    map_state(state, lambda x, _: isinstance(x, torch.Tensor)
              and sizes.append(x.numel() * x.element_size()))
    return sum(sizes)


class Writer:
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
# shared memory for the snapshot, which small states (every test's tiny model) need not pay.
# The size is a judgement between the two, not a measured crossover.
PROCESS_WRITER_MIN_BYTES = 16 << 20


class WriterDied(RuntimeError):
    """The writer process is gone (killed, out of memory) before it finished a save's files."""


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
                tensors = map_state(state, lambda x, _: shared[x.key]
                                    if isinstance(x, _Shared) else x)
                files = write_files(Path(tmp), tensors, lambda n: conn.send(("progress", n)))
            except Exception as exc:  # noqa: BLE001 - reported to the training process
                conn.send(("error", f"{exc.__class__.__name__}: {exc}"))
            else:
                conn.send(("done", files))
    except (EOFError, OSError):  # the training process closed the socket or is gone
        return


# what the writer process runs: argv = the project root, the socket's file descriptor
_WRITER_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from tasks.train.checkpoint_io import _writer_process_main; "
                "_writer_process_main(int(sys.argv[2]))")
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class WriterProcess:
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
        """Whether it has started (imported torch: ~1.5 s of CPU) and takes jobs; False if it
        died starting (the next save starts another)."""
        try:
            if not self._ready and self._conn.poll():
                self._ready = self._conn.recv() == ("ready",)
        except (EOFError, OSError):
            return False
        return self._ready

    def write_files(self, tmp: Path, snap: dict[str, Any], buffers: SnapshotBuffers,
                    progress: BytesMoved | None) -> dict[str, Any]:
        try:
            if self._generation != buffers.generation:
                self._conn.send(("arena", os.fstat(buffers.arena_fd).st_size, buffers.layout))
                sendfds(self._sock, [buffers.arena_fd])
                self._generation = buffers.generation
            shared = {id(buffers.buffers[key]): key for key, *_ in buffers.layout}
            # tensors outside the arena (empty ones) travel in the message itself
            self._conn.send(("write", str(tmp), map_state(
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
            raise WriterDied(f"the checkpoint writer process died (exit code "
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
