"""Reading what data prep wrote: token shards (memory-mapped, or streamed from S3) and
prompt/completion examples.

Batch order is a pure function of (seed, sample order, batch index): global batch `b` holds
positions b*G .. b*G+G-1 of an endless stream made of one seeded shuffle of all rows per epoch, G
sequences per optimizer step over all processes. The training loop's data cursor is the index of
the next global batch (the step, plus any batches skipped after a loss spike), kept in every
checkpoint, so a job resumed from one reads exactly the batches the uninterrupted job would. G
does not depend on the world size (gradient accumulation makes up the difference), so neither
does the cursor: a job resumed on another number of processes reads the same sequence of samples.

Two shuffles (TrainConfig.sample_order):
- `block_shuffle` (the default): rows are grouped in blocks of `block_rows` consecutive rows of
  one shard; each epoch shuffles the blocks, cuts that order into windows of `window_blocks`
  blocks, and shuffles the rows within each window. Every row is still read once per epoch and a
  batch is a random draw from its window, but the rows of one window come from only
  `window_blocks` places in the corpus, so a reader needs the blocks of one window at a time:
  token shards stream from S3 as sequential block reads (tasks/train/stream.py) instead of being
  downloaded before the first step. Rows of the same block tend to fall into the same few
  batches of a window (not into the same batch: the window is shuffled as a whole), and two
  windows never mix: with 16 blocks of 1024 rows a batch draws from 16K rows, not the whole
  corpus.
- `global_permutation`: one permutation of all rows per epoch, the order of every run made
  before block shuffling (its checkpoints record the sampler `epoch_permutation`); kept so such
  runs replay bitwise. Every batch draws from the whole corpus, so streaming it means fetching
  every block first (the stream cache must hold the whole split).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.common.io import read_json, sha256_file
from tasks.model.gpt import IGNORE_INDEX
from tasks.common.uris import is_s3

log = logging.getLogger(__name__)
BLOCK_ROWS = 1024     # TrainConfig.shuffle_block_rows' default: 8 MiB of 2048-token uint32 rows
WINDOW_BLOCKS = 16    # TrainConfig.shuffle_window_blocks' default


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, T) token ids
    targets: torch.Tensor  # (B, T) next-token ids, IGNORE_INDEX where no loss is taken
    tokens: int  # real (not padding) input tokens: what tokens/s counts

    def to(self, device: torch.device) -> "Batch":
        # pinned memory + non_blocking lets the copy overlap the previous step on a GPU
        if device.type == "cuda":
            return Batch(self.inputs.pin_memory().to(device, non_blocking=True),
                         self.targets.pin_memory().to(device, non_blocking=True), self.tokens)
        return self

    def split(self, n: int) -> list["Batch"]:
        """n equal micro-batches along the batch dimension (gradient accumulation); tokens are
        shared in proportion, which is exact for packed rows (every row has the same length)."""
        if n == 1:
            return [self]
        rows = self.inputs.shape[0]
        if rows % n:
            raise ValueError(f"a batch of {rows} rows does not split into {n} micro-batches.")
        return [Batch(i, t, self.tokens * i.shape[0] // rows)
                for i, t in zip(self.inputs.split(rows // n), self.targets.split(rows // n))]


class DataDir:
    """A data prep output directory, read through its manifest (which prep writes last).

    An s3:// prefix is read in place: its manifest and tokenizer (a few KB) are copied to the
    node's stream cache, and its token shards are streamed block by block by the splits
    (tasks/train/stream.py), at most `cache_gb` of them on this node's disk at once."""

    def __init__(self, path: str | Path, *, cache_gb: float = 8.0) -> None:
        self.uri = str(path).rstrip("/") if is_s3(str(path)) else ""
        self.cache_bytes = int(cache_gb * (1 << 30))
        if self.uri:
            from tasks.train.stream import S3Objects, local_copy_dir

            self.objects = S3Objects()
            path = local_copy_dir(self.uri)
            self.objects.fetch_file(f"{self.uri}/manifest.json", path / "manifest.json")
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.exists():
            raise FileNotFoundError(
                f"{manifest} is missing: {self.path} is not a finished data prep output. "
                "Run `python -m tasks.data.prep` first (it writes manifest.json last).")
        self.manifest: dict[str, Any] = read_json(manifest)
        self.eos_id: int = int(self.manifest["eos_id"])
        self.vocab_size: int = int(self.manifest["vocab_size"])
        self.seq_len: int = int(self.manifest["seq_len"])
        self.content_hash: str = self.manifest["content_hash"]
        if self.uri:
            self.objects.fetch_file(f"{self.uri}/{self.manifest['tokenizer']}", self.tokenizer_path)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]

    def check_tokenizer(self) -> None:
        actual = sha256_file(self.tokenizer_path)
        if actual != self.manifest["tokenizer_sha256"]:
            raise ValueError(f"{self.tokenizer_path} does not match the sha256 in the manifest; "
                             "the data dir was modified after prep. Rerun data prep.")

    def split(self, name: str, block_rows: int = BLOCK_ROWS) -> "TokenRows":
        """The split's rows, grouped in blocks of `block_rows` (the unit of block shuffling and
        of streamed reads)."""
        if name not in self.manifest["splits"]:
            raise KeyError(f"Split {name!r} is not in {self.path}/manifest.json; "
                           f"it has {sorted(self.manifest['splits'])}.")
        if self.uri:
            return TokenRows(self.path, self.manifest, name, block_rows=block_rows,
                             stream=(self.uri, self.cache_bytes, self.objects))
        return TokenRows(self.path, self.manifest, name, block_rows=block_rows)

    def sft_path(self, name: str) -> Path:
        return self.path / self.manifest["sft"][name]


def content_hash(data_dir: str | Path | None) -> str | None:
    """The content hash of the data prep output at `data_dir`, from its manifest; None where
    there is none to read here (no path given, or no finished output there)."""
    if not data_dir:
        return None
    manifest = Path(data_dir) / "manifest.json"
    return read_json(manifest).get("content_hash") if manifest.is_file() else None


class TokenRows:
    """All rows of one split across its shards: memory-mapped local files (nothing is read until
    used), or, with `stream` (s3:// data dir, cache bytes, client), blocks fetched from S3 into
    the node's cache as the sampler asks for them (tasks/train/stream.py)."""

    def __init__(self, root: Path, manifest: dict[str, Any], split: str, *,
                 block_rows: int = 0, stream: tuple[str, int, Any] | None = None) -> None:
        self.row_len = int(manifest["row_len"])
        self.content_hash: str = str(manifest.get("content_hash", ""))   # the data prep output's
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")  # shards are little-endian
        self.block_rows = int(block_rows or BLOCK_ROWS)
        shards = [s for s in manifest["splits"][split]["shards"] if int(s["rows"])]
        # first global row index of each shard, for searchsorted
        self.starts = np.cumsum([0] + [int(s["rows"]) for s in shards])
        self.rows = int(self.starts[-1])
        if self.rows == 0:
            raise ValueError(f"Split {split!r} has no rows; data prep produced too little text "
                             "for seq_len. Add input text or lower seq_len.")
        self.block_starts = _block_starts(self.starts, self.block_rows)
        self.streamed = None
        self.shards: list[np.memmap] = []
        if stream is not None:
            from tasks.train.stream import BlockCache, StreamedShards, cache_root

            uri, cache_bytes, objects = stream
            self.bytes = self.rows * self.row_len * self.dtype.itemsize
            self.streamed = StreamedShards(
                [f"{uri}/{s['path']}" for s in shards], [int(s["rows"]) for s in shards],
                self.row_len, self.dtype, self.block_starts,
                BlockCache(cache_root() / "blocks", cache_bytes), objects)
            self.cache_bytes = cache_bytes
            return
        for shard in shards:
            path = root / shard["path"]
            expected = int(shard["rows"]) * self.row_len * self.dtype.itemsize
            if not path.exists() or path.stat().st_size != expected:
                raise ValueError(f"Shard {path} should hold {shard['rows']} rows "
                                 f"({expected} bytes); it is missing or truncated. Rerun data prep.")
            self.shards.append(np.memmap(path, dtype=self.dtype, mode="r",
                                         shape=(int(shard["rows"]), self.row_len)))

    def take(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, dtype=np.int64)
        if self.streamed is not None:
            rows = self.streamed.take(indices)
        else:
            shard_of = np.searchsorted(self.starts, indices, side="right") - 1
            rows = np.stack([self.shards[s][i - self.starts[s]] for s, i in zip(shard_of, indices)])
        rows = torch.from_numpy(rows.astype(np.int64))
        return Batch(rows[:, :-1], rows[:, 1:], rows.shape[0] * (rows.shape[1] - 1))

    def prefetch(self, blocks: np.ndarray) -> None:
        """Have these blocks fetched in the background (streamed rows only; a no-op on local
        files, which the page cache serves)."""
        if self.streamed is not None:
            self.streamed.prefetch(blocks)

    def in_order(self, batch_size: int, max_batches: int) -> list[np.ndarray]:
        """The first max_batches batches in file order: a fixed val set, comparable across evals."""
        n = min(self.rows, batch_size * max_batches)
        return [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def _block_starts(shard_starts: np.ndarray, block_rows: int) -> np.ndarray:
    """Global row indices where the blocks begin, plus the row count at the end: each shard is cut
    into blocks of block_rows rows (its last block may be shorter), so no block crosses a shard."""
    cuts = [np.arange(a, b, block_rows) for a, b in zip(shard_starts[:-1], shard_starts[1:])]
    return np.concatenate(cuts + [shard_starts[-1:]]).astype(np.int64)


class EpochSampler:
    """Indices of batch `step`: an endless stream of seeded per-epoch permutations of n items
    (sample_order `global_permutation`; SFT examples and replayed rows)."""

    name = "epoch_permutation"   # as checkpoints record it (PretrainBatches.seen)

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.clear()
            self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._cache[epoch]

    def indices(self, step: int) -> np.ndarray:
        return self.at(np.arange(step * self.batch_size, (step + 1) * self.batch_size))

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Row indices at the given positions of the stream."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, out = positions // self.n, np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epochs).tolist():
            mask = epochs == e
            out[mask] = self._perm(e)[positions[mask] % self.n]
        return out

    def ahead(self, position: int, n_blocks: int) -> np.ndarray:
        """Blocks (of n_blocks) a streamed reader must have for positions from here on: any
        row may come next, so all of them."""
        return np.arange(n_blocks)


class BlockShuffleSampler:
    """Row indices at stream positions for sample_order `block_shuffle` (see the module's doc):
    per epoch e, the blocks in a seeded order, cut into windows of `window_blocks` blocks, the
    rows of each window in a seeded order of their own. Epochs are len(rows) positions long, as
    with EpochSampler. Only the windows a caller touches are ever built (a window's rows, a few
    hundred KB), so a job resumed deep into an epoch does not pay for the epoch's beginning."""

    name = "block_shuffle"

    def __init__(self, block_starts: np.ndarray, window_blocks: int, seed: int) -> None:
        if window_blocks < 1:
            raise ValueError(f"window_blocks must be at least 1, got {window_blocks}.")
        self.block_starts = np.asarray(block_starts, dtype=np.int64)
        self.sizes = np.diff(self.block_starts)
        self.n, self.window_blocks, self.seed = int(self.block_starts[-1]), window_blocks, seed
        self.n_blocks = len(self.sizes)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the blocks in this epoch's order, the first position of each window and the end)."""
        if epoch not in self._epochs:
            if len(self._epochs) > 2:
                self._epochs.clear()
            order = np.random.default_rng([self.seed, epoch, 1]).permutation(self.n_blocks)
            sizes = np.add.reduceat(self.sizes[order], np.arange(0, self.n_blocks, self.window_blocks))
            self._epochs[epoch] = order, np.concatenate([[0], np.cumsum(sizes)])
        return self._epochs[epoch]

    def window_blocks_of(self, epoch: int, window: int) -> np.ndarray:
        order, _ = self._epoch(epoch)
        return order[window * self.window_blocks:(window + 1) * self.window_blocks]

    def _window(self, epoch: int, window: int) -> np.ndarray:
        """The rows of the window at its positions, in order."""
        key = (epoch, window)
        if key not in self._windows:
            if len(self._windows) > 8:
                self._windows.clear()
            rows = np.concatenate([np.arange(self.block_starts[b], self.block_starts[b + 1])
                                   for b in self.window_blocks_of(epoch, window)])
            shuffle = np.random.default_rng([self.seed, epoch, 2, window]).permutation(len(rows))
            self._windows[key] = rows[shuffle]
        return self._windows[key]

    def _where(self, position: int) -> tuple[int, int, int]:
        """(epoch, window, offset in the window) of a stream position."""
        epoch, q = divmod(int(position), self.n)
        _, starts = self._epoch(epoch)
        window = int(np.searchsorted(starts, q, side="right") - 1)
        return epoch, window, q - int(starts[window])

    def at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        epochs, q = positions // self.n, positions % self.n
        for e in np.unique(epochs).tolist():
            in_epoch = epochs == e
            _, starts = self._epoch(e)
            windows = np.searchsorted(starts, q, side="right") - 1
            for w in np.unique(windows[in_epoch]).tolist():
                mask = in_epoch & (windows == w)
                out[mask] = self._window(e, w)[q[mask] - starts[w]]
        return out

    def ahead(self, position: int, n_blocks: int) -> np.ndarray:
        """The blocks of the window this position is in, then of the next one (across an epoch's
        end too): what a streamed reader fetches while the steps compute."""
        epoch, window, _ = self._where(position)
        _, starts = self._epoch(epoch)
        following = (epoch, window + 1) if window + 2 < len(starts) else (epoch + 1, 0)
        return np.concatenate([self.window_blocks_of(epoch, window),
                               self.window_blocks_of(*following)])


SAMPLE_ORDERS = {"block_shuffle": BlockShuffleSampler.name,
                 "global_permutation": EpochSampler.name}   # config value -> recorded sampler


def make_sampler(order: str, rows: "TokenRows", seed: int, window_blocks: int = WINDOW_BLOCKS
                 ) -> EpochSampler | BlockShuffleSampler:
    """The sampler of TrainConfig.sample_order over a split's rows."""
    if order == "global_permutation":
        return EpochSampler(rows.rows, 1, seed)
    if order == "block_shuffle":
        return BlockShuffleSampler(rows.block_starts, window_blocks, seed)
    raise ValueError(f"sample_order must be one of {sorted(SAMPLE_ORDERS)}, got {order!r}.")


class PretrainBatches:
    """This rank's share of global batch `b` of next-token training (input = row[:-1], target =
    row[1:]): the rows of all its micro-steps, in micro-step order (the loop splits them).

    Global batch b is positions b*G .. (b+1)*G - 1 of the stream, G = B x W x A (B per micro-step,
    W ranks, A micro-steps). It is cut into W x A slices of B consecutive positions; rank r's
    micro-step m reads slice m*W + r. Slice c is the same rows whatever the split, so world 1
    with A = 2 and world 2 with A = 1 train on the same micro-batches; with W = A = 1 this is
    batch b of the single-process stream.
    """

    def __init__(self, rows: TokenRows, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, accumulation: int = 1, *, order: str = "block_shuffle",
                 window_blocks: int = WINDOW_BLOCKS) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}.")
        self.rows, self.batch_size = rows, batch_size
        self.rank, self.world_size, self.accumulation = rank, world_size, accumulation
        self.global_batch = batch_size * world_size * accumulation
        self.order, self.window_blocks = order, window_blocks
        self.sampler = make_sampler(order, rows, seed, window_blocks)
        if rows.streamed is not None:
            self._check_cache()

    def _check_cache(self) -> None:
        """A streamed split's cache must hold what the sampler needs at once: two windows of
        blocks (the one trained on and the one fetched ahead), or, for the global permutation,
        every block."""
        block_bytes = self.rows.block_rows * self.rows.row_len * self.rows.dtype.itemsize
        need = (self.rows.bytes if self.order == "global_permutation"
                else min(self.rows.bytes, 2 * self.window_blocks * block_bytes))
        if self.rows.cache_bytes < need:
            raise ValueError(
                f"TrainConfig.stream_cache_gb ({self.rows.cache_bytes / (1 << 30):.3g}) is too "
                f"small for sample_order {self.order!r}: it must hold "
                + ("the whole streamed split, as every batch draws from all of it"
                   if self.order == "global_permutation" else
                   "two windows of blocks (shuffle_window_blocks x shuffle_block_rows rows each)")
                + f", {need / (1 << 30):.3g} GB. Raise stream_cache_gb"
                + (" or use sample_order 'block_shuffle'." if self.order == "global_permutation"
                   else " or lower shuffle_window_blocks or shuffle_block_rows."))

    def positions(self, b: int) -> np.ndarray:
        """Stream positions this rank reads for global batch b (all its micro-steps)."""
        slices = np.arange(self.accumulation) * self.world_size + self.rank
        offsets = (slices[:, None] * self.batch_size + np.arange(self.batch_size)).ravel()
        return b * self.global_batch + offsets

    def __call__(self, b: int) -> Batch:
        if self.rows.streamed is not None:   # this window's blocks and the next one's, from S3
            self.rows.prefetch(self.sampler.ahead(b * self.global_batch, len(self.rows.block_starts) - 1))
        return self.rows.take(self.sampler.at(self.positions(b)))

    def seen(self, cursor: int, skipped: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """What the global batches before `cursor` (less the skipped ones) consumed, exactly and
        in a few numbers: the sampler (and for block shuffling its block and window sizes), its
        seed, the global batch in rows, the split's row count, the data's content hash (which
        data: another prep output may have as many rows) and the trained batch ranges.
        tasks/train/seen.py turns it into shard rows on demand."""
        out = {"sampler": self.sampler.name, "seed": self.sampler.seed,
               "global_batch": self.global_batch, "rows": self.rows.rows,
               "data_hash": self.rows.content_hash, "batches": trained_ranges(cursor, skipped)}
        if self.sampler.name == BlockShuffleSampler.name:
            out.update(block_rows=self.rows.block_rows, window_blocks=self.window_blocks)
        return out

    def check_resume(self, seen: dict[str, Any] | None) -> None:
        """Refuse to continue a checkpoint in another sample order: its data cursor counts
        batches of the order it trained in, and this one would read other rows from there."""
        if not seen or "sampler" not in seen:
            return
        mine = self.seen(0)
        differ = {k: (seen.get(k), mine.get(k)) for k in ("sampler", "block_rows", "window_blocks")
                  if seen.get(k) != mine.get(k)}
        if differ:
            was = {v: k for k, v in SAMPLE_ORDERS.items()}.get(seen["sampler"], seen["sampler"])
            raise ValueError(
                f"the checkpoint trained in sample_order {was!r} (block_rows "
                f"{seen.get('block_rows')}, window_blocks {seen.get('window_blocks')}); this job "
                f"reads {self.order!r} ({', '.join(f'{k} {v[1]}' for k, v in differ.items())}), "
                "so its data cursor would resume on other rows. Set sample_order to "
                f"{was!r}" + (f", shuffle_block_rows to {seen['block_rows']} and "
                              f"shuffle_window_blocks to {seen['window_blocks']}"
                              if "block_rows" in seen else "") + " to continue it.")


def sampler_of(seen: dict[str, Any], rows: TokenRows) -> EpochSampler | BlockShuffleSampler:
    """The sampler a `seen` record was drawn with, over the rows it names (tasks/train/seen.py)."""
    if seen.get("sampler", EpochSampler.name) == EpochSampler.name:
        return EpochSampler(rows.rows, 1, int(seen["seed"]))
    return BlockShuffleSampler(_block_starts(rows.starts, int(seen["block_rows"])),
                               int(seen["window_blocks"]), int(seen["seed"]))


def trained_ranges(cursor: int, skipped: set[int] | frozenset[int] = frozenset()) -> list[list[int]]:
    """[start, end) ranges of the batch numbers before `cursor` that were trained (not skipped)."""
    trained, start = [], 0
    for b in sorted(x for x in skipped if x < cursor) + [cursor]:
        if b > start:
            trained.append([start, b])
        start = b + 1
    return trained


# --------------------------------------------------------------------------------------------
# Supervised fine-tuning: prompt/completion pairs, loss on the completion only


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


@dataclass
class SFTExample:
    id: str
    prompt: str
    completion: str
    skill: str
    prompt_ids: list[int]
    completion_ids: list[int]  # ends with EOS
    # chat: True where a prompt token is an earlier assistant turn, which carries loss too
    prompt_trainable: list[bool] | None = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_chat(messages: list[dict[str, Any]], where: str = "chat record") -> list[tuple[str, bool]]:
    """A chat as (text, trainable) segments: "User: ...\nAssistant: ...\n" with only the
    assistant replies trainable. The last message must be the assistant's: it is the completion."""
    if not messages or not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}.")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: every message needs a role in {sorted(CHAT_ROLES)} and a "
                             f"string content, got {m!r}.")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message must be the assistant's reply (the completion).")
    segments: list[tuple[str, bool]] = []
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        if m["role"] == "assistant":
            segments.append(("Assistant:", False))
            # the reply ends at a newline (where exact match and generation stop), except the last
            # one, whose end is the EOS collate appends
            segments.append((" " + m["content"].strip() + ("" if last else "\n"), True))
        else:
            segments.append((f"{CHAT_ROLES[m['role']]}: {m['content'].strip()}\n", False))
    return segments


def _chat_example(i: int, r: dict[str, Any], tokenizer, eos_id: int, where: str) -> SFTExample:
    segments = render_chat(r["messages"], where)
    encoded = tokenizer.encode_batch([text for text, _ in segments], add_special_tokens=False)
    prompt_ids: list[int] = []
    trainable: list[bool] = []
    for (text, train), enc in zip(segments[:-1], encoded[:-1]):
        prompt_ids += enc.ids
        trainable += [train] * len(enc.ids)
    return SFTExample(id=str(r.get("id", i)), prompt="".join(t for t, _ in segments[:-1]),
                      completion=segments[-1][0], skill=str(r.get("skill", "chat")),
                      prompt_ids=prompt_ids, completion_ids=encoded[-1].ids + [eos_id],
                      prompt_trainable=trainable if any(trainable) else None)


def load_sft(path: str | Path, tokenizer, eos_id: int, limit: int | None = None) -> list[SFTExample]:
    """Prompt/completion records ({"prompt", "completion"}) or chat records ({"messages": [...]},
    see render_chat), mixed freely in one JSONL file."""
    records = read_jsonl(path)[:limit]
    if not records:
        raise ValueError(f"{path} holds no examples; data prep should write prompt/completion "
                         "JSONL there.")
    chats = {i: _chat_example(i, r, tokenizer, eos_id, f"{path}:{i + 1}")
             for i, r in enumerate(records) if "messages" in r}
    plain = [(i, r) for i, r in enumerate(records) if i not in chats]
    for i, r in plain:
        if not isinstance(r.get("prompt"), str) or not isinstance(r.get("completion"), str):
            raise ValueError(f"{path}:{i + 1}: expected {{\"prompt\", \"completion\"}} strings or "
                             f"{{\"messages\": [...]}}, got keys {sorted(r)}.")
    if chats:
        out = dict(chats)
        out.update({i: ex for (i, _), ex in zip(plain, _plain_examples(plain, tokenizer, eos_id))})
        return [out[i] for i in range(len(records))]
    return _plain_examples(plain, tokenizer, eos_id)


def _plain_examples(indexed: list[tuple[int, dict[str, Any]]], tokenizer, eos_id: int
                    ) -> list[SFTExample]:
    records = [r for _, r in indexed]
    if not records:
        return []
    # Prompt and completion are tokenized separately, as at inference time the model sees the
    # prompt's tokens alone and must produce the completion's tokens from there.
    prompts = tokenizer.encode_batch([r["prompt"] for r in records], add_special_tokens=False)
    completions = tokenizer.encode_batch([r["completion"] for r in records], add_special_tokens=False)
    return [SFTExample(id=str(r.get("id", i)), prompt=r["prompt"], completion=r["completion"],
                       skill=str(r.get("skill", "all")), prompt_ids=p.ids,
                       completion_ids=c.ids + [eos_id])
            for (i, r), p, c in zip(indexed, prompts, completions)]


def collate_sft(examples: list[SFTExample], block_size: int, pad_id: int) -> Batch:
    """Right-padded (B, T) inputs and targets; targets are IGNORE_INDEX on prompt and padding,
    so only completion tokens (and the EOS that ends them) carry loss."""
    seqs, losses = [], []
    for ex in examples:
        ids, carries = sft_sequence(ex, block_size)
        seqs.append(ids)
        losses.append(carries)
    T = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
    for b, (ids, carries) in enumerate(zip(seqs, losses)):
        ids_t = torch.tensor(ids, dtype=torch.long)
        inputs[b, : len(ids) - 1] = ids_t[:-1]
        # target position t predicts token t+1, which carries loss only in the completion (and
        # in earlier assistant turns of a chat)
        targets[b, : len(ids) - 1] = torch.where(torch.tensor(carries[1:]), ids_t[1:],
                                                 torch.tensor(IGNORE_INDEX))
    return Batch(inputs, targets, sum(len(ids) - 1 for ids in seqs))


def sft_sequence(ex: SFTExample, block_size: int) -> tuple[list[int], list[bool]]:
    """An example's token ids (at most block_size + 1) and, per token, whether predicting it
    carries loss. Too long: the oldest prompt tokens are dropped, never the completion."""
    ids = ex.prompt_ids + ex.completion_ids
    carries = (ex.prompt_trainable or [False] * len(ex.prompt_ids)) + [True] * len(ex.completion_ids)
    cut = max(0, len(ids) - (block_size + 1))
    return ids[cut:], carries[cut:]


class SFTBatches:
    def __init__(self, examples: list[SFTExample], batch_size: int, seed: int, block_size: int,
                 pad_id: int) -> None:
        self.examples, self.block_size, self.pad_id = examples, block_size, pad_id
        self.sampler = EpochSampler(len(examples), batch_size, seed)

    def __call__(self, step: int) -> Batch:
        return collate_sft([self.examples[i] for i in self.sampler.indices(step)],
                           self.block_size, self.pad_id)


def model_tokenizer(data: DataDir, model_dir: str | Path):
    """The tokenizer a model directory was trained with, after checking that the data was
    prepared with it too: otherwise the same token ids would stand for other text."""
    path = Path(model_dir) / "tokenizer.json"
    if not shares_tokenizer(data, path):
        raise ValueError(f"{path} differs from the tokenizer of {data.path}; use data prepared "
                         "with the model's tokenizer (DataPrepConfig.tokenizer_path = "
                         f"{path}).")
    return load_tokenizer(path)


def shares_tokenizer(data: DataDir, tokenizer_path: str | Path) -> bool:
    """Was the data prepared with this tokenizer.json (the same file, or the same vocabulary,
    merges, special tokens and pre-/post-processing as transformers re-saves it)?"""
    from tasks.common.hf_dir import same_tokenizer

    if sha256_file(tokenizer_path) == data.manifest["tokenizer_sha256"]:
        return True
    return same_tokenizer(Path(tokenizer_path).read_bytes(), data.tokenizer_path.read_bytes())


def load_sft_splits(data_dir: str | Path, model_dir: str | Path, block_size: int, eval_limit: int
                    ) -> tuple[DataDir, Any, list[SFTExample], list[SFTExample]]:
    """(data dir, the model's tokenizer, SFT train examples, the first eval_limit eval examples)."""
    data = DataDir(data_dir)
    tokenizer = model_tokenizer(data, model_dir)
    train_examples = load_sft(data.sft_path("train"), tokenizer, data.eos_id)
    eval_examples = load_sft(data.sft_path("eval"), tokenizer, data.eos_id, limit=eval_limit)
    too_long = sum(len(e.prompt_ids) + len(e.completion_ids) > block_size + 1 for e in train_examples)
    if too_long:
        log.warning("%d of %d SFT examples exceed block_size %d; their prompts are cut from the "
                    "left", too_long, len(train_examples), block_size)
    return data, tokenizer, train_examples, eval_examples
