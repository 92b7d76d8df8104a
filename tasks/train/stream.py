"""Token shards read from S3 while training: blocks of rows, fetched ahead into a bounded cache.

A pretraining whose `data_dir` is an s3:// prefix (on Batch and HyperPod docker/job_entry.py
leaves it so: tasks/common/uris.py STREAMED_INPUTS) reads its token shards here instead of from a
downloaded copy. The unit is a *block*: `block_rows` consecutive rows of one shard (the last block
of a shard may be shorter), the same blocks the sample order shuffles (tasks/train/prepared_data.py
BlockShuffleSampler), so a block is one sequential ranged GET and every row of it is used.

- The client is Amazon's S3 Connector for PyTorch (`s3torchconnector`, its CRT-based Mountpoint
  client): ranged GETs split into parts fetched in parallel, its own retries with backoff, and
  credentials from the usual chain (environment, profile, web identity, container, instance).
  Its endpoint is boto3's (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL: a local moto in tests).
- The cache is a directory on the node's own disk (`$LLMOPS_WORKDIR/stream-cache`, else the temp
  dir), shared by the node's ranks: one file per block, written to a temporary name and renamed
  (a block is there whole or not at all), fetched once per node (a lock file per block: the
  second rank waits for the first's GET instead of sending its own). It holds at most
  `cache_bytes`: after each new block the least recently used ones go, never the blocks this
  process still needs (its current and next window), and a block another rank still reads stays
  readable to it (its open memmap keeps the file's data until it lets go).
- Prefetch: a few threads fetch the blocks of the window being trained on and of the next one
  (BlockShuffleSampler.ahead) while the steps compute, so a step waits only for a block nobody
  asked for in time: at the first step of an attempt, the blocks its first window needs.

Nothing is downloaded whole: a new attempt on a fresh node reads its manifest and tokenizer (a
few KB) and the blocks of the window its data cursor is in, whatever the corpus size.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.uris import split_s3

log = logging.getLogger(__name__)

PREFETCH_THREADS = 4        # blocks in flight at once; the client splits each into parts too
PART_BYTES = 8 << 20        # the client's part size: a block of up to 8 MiB is one GET
DEFAULT_REGION = "us-east-1"


def cache_root() -> Path:
    """The node-local directory streamed blocks are cached in (under the job's work dir, which
    every backend puts on the node's own disk)."""
    base = os.environ.get("LLMOPS_WORKDIR") or tempfile.gettempdir()
    return Path(base) / "stream-cache"


class S3Objects:
    """Whole small objects and byte ranges of large ones, through s3torchconnector's client."""

    def __init__(self) -> None:
        self._client: Any = None
        self._sizes: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        if self._client is None:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client

            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if not region:
                import boto3

                region = boto3.session.Session().region_name or DEFAULT_REGION
            # a custom endpoint (moto, a VPC endpoint given by URL) takes path-style addressing
            self._client = S3Client(region, endpoint=endpoint or None, s3client_config=S3ClientConfig(
                part_size=PART_BYTES, force_path_style=bool(endpoint)))
        return self._client

    def _info(self, bucket: str, key: str) -> Any:
        """The object's HEAD, once per object (its size bounds every ranged read)."""
        with self._lock:
            info = self._sizes.get((bucket, key))
        if info is None:
            info = self.client.head_object(bucket, key)
            with self._lock:
                self._sizes[(bucket, key)] = info
        return info

    def size(self, uri: str) -> int:
        return int(self._info(*split_s3(uri)).size)

    def read(self, uri: str, start: int = 0, length: int | None = None) -> bytes:
        """`length` bytes from `start` (None: to the end), one ranged GET split into parts."""
        from s3torchconnector import S3ReaderConstructor

        bucket, key = split_s3(uri)
        info = self._info(bucket, key)
        reader = self.client.get_object(bucket, key, object_info=info,
                                        reader_constructor=S3ReaderConstructor.range_based(buffer_size=0))
        reader.seek(start)
        return reader.read(length)

    def fetch_file(self, uri: str, path: Path) -> Path:
        """The whole (small) object at `path`, written atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(self.read(uri))
        os.replace(tmp, path)
        return path


def local_copy_dir(uri: str) -> Path:
    """Where a streamed data dir's small files (manifest, tokenizer) are kept on this node."""
    return cache_root() / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]


class BlockCache:
    """Block files on the node's disk, at most `limit_bytes`, least recently used evicted first."""

    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root, self.limit = root, int(limit_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self._evict_lock = threading.Lock()   # this process's evict-then-rename, one at a time

    def path(self, name: str) -> Path:
        return self.root / f"{name}.blk"

    def get(self, name: str, fetch: Any, keep: set[str]) -> Path:
        """The block's file, fetched (fetch() -> bytes) unless the node has it already."""
        path = self.path(name)
        if path.exists():
            _touch(path)
            return path
        with open(self.root / f"{name}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # another rank of this node may be fetching it
            try:
                if path.exists():
                    _touch(path)
                    return path
                data = fetch()
                tmp = self.root / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
                tmp.write_bytes(data)
                with self._evict_lock:   # room first, then the block: never over the limit here
                    self._evict(keep, incoming=len(data))
                    os.replace(tmp, path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return path

    def _evict(self, keep: set[str], incoming: int) -> int:
        """Delete least recently used blocks (never those in `keep`) until `incoming` more bytes
        fit the limit; the caller holds the lock. Returns the bytes freed."""
        files = self._blocks()
        total = sum(size for _, size, _ in files)
        freed = 0
        for _, size, name in sorted(files):
            if total - freed + incoming <= self.limit:
                break
            if name in keep:
                continue
            try:
                self.path(name).unlink()
                (self.root / f"{name}.lock").unlink(missing_ok=True)
                freed += size
            except FileNotFoundError:
                pass
        return freed

    def size(self) -> int:
        return sum(size for _, size, _ in self._blocks())

    def _blocks(self) -> list[tuple[float, int, str]]:
        """(mtime, bytes, name) of every cached block. A block another rank or this process's
        prefetch thread evicts between the listing and its stat is passed over: it is gone."""
        blocks = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(".blk"):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                blocks.append((st.st_mtime, st.st_size, entry.name[:-4]))
        return blocks


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


class StreamedShards:
    """The rows of one split's shards in S3, read block by block through a BlockCache.

    `uris[i]` holds `rows[i]` rows of `row_len` tokens of `dtype`; `block_starts` are the global
    row indices where blocks begin (and the total at the end), none crossing a shard."""

    def __init__(self, uris: list[str], rows: list[int], row_len: int, dtype: np.dtype,
                 block_starts: np.ndarray, cache: BlockCache, objects: S3Objects | None = None) -> None:
        self.uris, self.row_len, self.dtype = uris, row_len, dtype
        self.row_bytes = row_len * dtype.itemsize
        self.shard_starts = np.cumsum([0] + list(rows))
        self.block_starts = block_starts
        self.cache, self.objects = cache, objects or S3Objects()
        self.keys = [hashlib.sha256(u.encode()).hexdigest()[:16] for u in uris]
        self._open: dict[int, np.ndarray] = {}      # block -> its rows, memory-mapped
        self._inflight: dict[int, Future] = {}
        self._wanted: set[int] = set()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.fetched_bytes = 0                       # what this process read from S3
        self.waited_s = 0.0                          # time take() waited for a block

    def _name(self, block: int) -> str:
        shard = int(np.searchsorted(self.shard_starts, self.block_starts[block], side="right") - 1)
        first = int(self.block_starts[block] - self.shard_starts[shard])
        return f"{self.keys[shard]}-{first:012d}-{int(self.block_starts[block + 1] - self.block_starts[block])}"

    def _fetch(self, block: int) -> bytes:
        start, end = int(self.block_starts[block]), int(self.block_starts[block + 1])
        shard = int(np.searchsorted(self.shard_starts, start, side="right") - 1)
        offset = (start - int(self.shard_starts[shard])) * self.row_bytes
        want = (end - start) * self.row_bytes
        data = self.objects.read(self.uris[shard], offset, want)
        if len(data) != want:
            raise ValueError(f"{self.uris[shard]} ended {want - len(data)} bytes early at row "
                             f"{start - int(self.shard_starts[shard])}: the shard is shorter than "
                             "its manifest says (truncated upload?). Rerun data prep.")
        with self._lock:
            self.fetched_bytes += want
        return data

    def _load(self, block: int) -> np.ndarray:
        rows = int(self.block_starts[block + 1] - self.block_starts[block])
        for attempt in range(3):
            path = self.cache.get(self._name(block), lambda: self._fetch(block), self._keep())
            try:   # once mapped, the rows stay readable whoever evicts the file
                return np.memmap(path, dtype=self.dtype, mode="r", shape=(rows, self.row_len))
            except FileNotFoundError:   # evicted (by another rank, or the val split) just now
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _keep(self) -> set[str]:
        with self._lock:
            wanted = set(self._wanted)
        return {self._name(b) for b in wanted}

    def block(self, block: int) -> np.ndarray:
        """The rows of `block`, waiting for its fetch if one is in flight."""
        with self._lock:
            have = self._open.get(block)
            pending = self._inflight.get(block)
        if have is not None:
            return have
        t0 = time.perf_counter()
        rows = pending.result() if pending is not None else self._load(block)
        self.waited_s += time.perf_counter() - t0
        with self._lock:
            self._open[block] = rows
        return rows

    def prefetch(self, blocks: np.ndarray) -> None:
        """Fetch these blocks in the background (in this order); forget open blocks not among
        them, so this process holds open only what it still needs."""
        wanted = [int(b) for b in blocks]
        with self._lock:
            self._wanted = set(wanted)
            for b in [b for b in self._open if b not in self._wanted]:
                del self._open[b]
            todo = [b for b in wanted if b not in self._open and b not in self._inflight]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="block-prefetch")
            for b in todo:
                future = self._pool.submit(self._load, b)
                self._inflight[b] = future
                future.add_done_callback(lambda f, b=b: self._landed(b, f))

    def _landed(self, block: int, future: Future) -> None:
        with self._lock:
            self._inflight.pop(block, None)
            if future.exception() is None and block in self._wanted:
                self._open[block] = future.result()

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The rows at these global indices, as one (len, row_len) array."""
        blocks = np.searchsorted(self.block_starts, indices, side="right") - 1
        out = np.empty((len(indices), self.row_len), dtype=self.dtype)
        for b in np.unique(blocks).tolist():
            mask = blocks == b
            out[mask] = self.block(b)[indices[mask] - self.block_starts[b]]
        return out
