"""Deduplication across all shards: exact (content hash) and near (MinHash LSH), sharded by key.

1. per shard (in parallel, with the filters): a 128-bit content hash and `bands` LSH keys per
   kept document. Shingles are word 5-grams of the simplified text (lowercase, digits folded,
   punctuation and accents dropped); the signature is `bands * rows` minima of random linear
   permutations of the shingle hashes; each band of `rows` minima is hashed to one 64-bit key.
   The shard writes both sorted (`shard_index`): hashes by value, band keys by (band, key).
2. per bucket (in parallel; datatrove's bucket design): bucket b of B owns the b-th range of the
   content-hash space and of the (band, key) space. It reads only its slice of every shard's
   sorted index (a binary search in a memory-mapped file) and emits pairs: (copy, first document
   with that hash) and (first document with a band key, another with the same key). Memory per
   bucket is about 1/B of all the keys, never all of them.
3. one process, over the pairs only (`resolve_pairs`): a document with an earlier exact copy is an
   exact duplicate of the first; among the others, connected components of the near pairs are
   clusters whose earliest document (input order) is kept.

The kept set is the same as `find_duplicates`, which does all of it in one process from every
document's keys (what data prep did before; kept as the reference the tests and the benchmark
compare against): the first document of a band-key group is never an exact copy (its first copy
would come earlier, with the same keys), so dropping the pairs that touch an exact copy leaves
exactly the pairs among the documents the one-process step compares.

With the default 14 bands x 8 rows (FineWeb's), a pair with Jaccard similarity s becomes a
candidate with probability 1 - (1 - s^8)^14: 0.92 at s = 0.8, 0.26 at s = 0.6, under 0.01 at 0.4.
"""

from __future__ import annotations

import hashlib
from itertools import chain

import numpy as np

from tasks.data.text import TABLE, simplify_for_shingles

NO_SIGNATURE = np.uint64(0)  # band key of a document too short to have a shingle


def content_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads every input bit over the whole 64-bit word."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class MinHasher:
    """LSH band keys of a text. Deterministic across processes and machines (no Python hash())."""

    CHUNK = 4096  # shingles per block, to bound the (shingles x permutations) temporary array

    def __init__(self, ngram: int = 5, bands: int = 14, rows: int = 8, seed: int = 1) -> None:
        self.ngram, self.bands, self.rows = ngram, bands, rows
        rng = np.random.default_rng(seed)
        n = bands * rows
        # Odd multipliers make each a*x + b (mod 2^64) a permutation of the 64-bit hashes.
        self.a = rng.integers(0, 1 << 63, size=n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 1 << 63, size=n, dtype=np.uint64)
        self.band_mult = rng.integers(0, 1 << 63, size=rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def shingles(self, text: str) -> np.ndarray:
        """One 64-bit hash per word n-gram of the simplified text."""
        return self._shingles([simplify_for_shingles(text)])[0]

    def _shingles(self, texts_words: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        """The shingle hashes of several texts' words, concatenated, and how many each has."""
        n = self.ngram
        counts = np.array([max(0, len(words) - n + 1) for words in texts_words], dtype=np.int64)
        if not counts.any():
            return np.zeros(0, dtype=np.uint64), counts
        words = list(chain.from_iterable(texts_words))
        ids = TABLE.encode(words)  # first: encoding new words may replace TABLE.hash with a larger array
        h = TABLE.hash[ids]  # stable 64-bit word hashes, memoized per process
        span = len(h) - n + 1
        acc = np.zeros(span, dtype=np.uint64)
        for k in range(n):
            acc = _mix(acc ^ h[k:k + span])  # order-sensitive: "a b" and "b a" differ
        # Keep the n-grams that start and end in one text: text d's k-th starts at its first word + k.
        firsts = np.concatenate(([0], np.cumsum([len(w) for w in texts_words])))[:-1]
        before = np.cumsum(counts) - counts
        return acc[np.repeat(firsts - before, counts) + np.arange(counts.sum())], counts

    def band_keys(self, text: str) -> np.ndarray:
        """`bands` keys; all NO_SIGNATURE when the text is too short to compare."""
        return self.band_keys_batch([text])[0]

    def band_keys_batch(self, texts: list[str]) -> np.ndarray:
        """band_keys of each text, as a (len(texts), bands) array: the signatures of all texts
        in CHUNK-row blocks of (shingles x permutations), each row block's minima per text."""
        keys = np.zeros((len(texts), self.bands), dtype=np.uint64)
        shingles, counts = self._shingles([simplify_for_shingles(t) for t in texts])
        signed = np.flatnonzero(counts)
        if not signed.size:
            return keys
        bounds = np.concatenate(([0], np.cumsum(counts[signed])))
        sig = np.full((signed.size, self.a.size), np.iinfo(np.uint64).max, dtype=np.uint64)
        buffer = np.empty((min(self.CHUNK, shingles.size), self.a.size), dtype=np.uint64)
        for lo in range(0, shingles.size, self.CHUNK):
            hi = min(lo + self.CHUNK, shingles.size)
            first = int(np.searchsorted(bounds, lo, side="right")) - 1
            last = int(np.searchsorted(bounds, hi - 1, side="right")) - 1
            segments = np.maximum(bounds[first:last + 1], lo) - lo
            block = buffer[:hi - lo]
            np.multiply(shingles[lo:hi, None], self.a, out=block)
            np.add(block, self.b, out=block)
            np.minimum(sig[first:last + 1], np.minimum.reduceat(block, segments, axis=0), out=sig[first:last + 1])
        banded = _mix((sig.reshape(-1, self.bands, self.rows) * self.band_mult).sum(axis=2, dtype=np.uint64))
        banded[banded == NO_SIGNATURE] = np.uint64(1)  # keep 0 free to mean "no signature"
        keys[signed] = banded
        return keys


class UnionFind:
    """Disjoint sets over 0..n-1 whose root is always the smallest member."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]  # path halving
            x = parent[x]
        return int(x)

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def roots(self) -> np.ndarray:
        return np.array([self.find(i) for i in range(len(self.parent))], dtype=np.int64)


EXACT, NEAR = 1, 2


def _first_of_equal_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `keys` equal to an earlier row: (their indices, the index of that first row)."""
    order = np.lexsort(keys.T[::-1])  # stable: equal rows stay in index order
    ordered = keys[order]
    new_run = np.ones(len(order), dtype=bool)
    new_run[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    run_first = order[np.flatnonzero(new_run)][np.cumsum(new_run) - 1]
    repeat = ~new_run
    return order[repeat], run_first[repeat]


def find_duplicates(hashes: np.ndarray, band_keys: np.ndarray, *, exact: bool = True,
                    near: bool = True) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Documents are rows in input order. `hashes`: (n, 2) uint64 content hashes; `band_keys`:
    (n, bands) uint64. Returns (duplicate_of: index of the kept document or -1, kind: 0 / EXACT /
    NEAR, stats)."""
    n = len(hashes)
    duplicate_of = np.full(n, -1, dtype=np.int64)
    kind = np.zeros(n, dtype=np.int8)
    stats = {"in": n, "exact_duplicates": 0, "near_duplicates": 0, "candidate_pairs": 0, "clusters": 0}
    if n == 0:
        return duplicate_of, kind, stats
    if exact:
        rows, first = _first_of_equal_rows(hashes)
        duplicate_of[rows], kind[rows] = first, EXACT
        stats["exact_duplicates"] = int(rows.size)
    if near and band_keys.size:
        alive = np.flatnonzero((kind == 0) & (band_keys[:, 0] != NO_SIGNATURE))
        edges = []
        for band in range(band_keys.shape[1]):
            rows, first = _first_of_equal_rows(band_keys[alive, band:band + 1])
            edges.append(np.stack([alive[first], alive[rows]], axis=1))
        pairs = np.unique(np.concatenate(edges), axis=0) if edges else np.zeros((0, 2), np.int64)
        stats["candidate_pairs"] = int(len(pairs))
        if len(pairs):
            sets = UnionFind(n)
            for a, b in pairs.tolist():
                sets.union(a, b)
            members = np.unique(pairs)
            roots = np.array([sets.find(int(m)) for m in members], dtype=np.int64)
            dup = members != roots
            duplicate_of[members[dup]], kind[members[dup]] = roots[dup], NEAR
            stats["near_duplicates"] = int(dup.sum())
            stats["clusters"] = int(np.unique(roots).size)
    return duplicate_of, kind, stats


def hashes_to_array(digests: list[bytes]) -> np.ndarray:
    """16-byte content hashes -> (n, 2) uint64, for vectorized grouping."""
    return np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, 2) if digests \
        else np.zeros((0, 2), dtype=np.uint64)


# --------------------------------------------------------------------------------------------
# Sharded by key range: per-shard sorted indexes, per-bucket pairs, components over the pairs.

KEY_SPACE = 1 << 64
_NONE = np.zeros(0, dtype=np.int64)


def shard_index(hashes: np.ndarray, band_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A shard's documents (rows in input order) as the sorted indexes buckets slice.

    Returns `exact`, (3, n) uint64: content hash (2 words) and row, sorted by hash then row;
    `near`, (2, k) uint64: band key and row, sorted by band, key, row, without the documents too
    short to have a signature; and `band_starts`: where each band's keys begin in `near` (bands + 1)."""
    n = len(hashes)
    order = np.lexsort((hashes[:, 1], hashes[:, 0])) if n else np.zeros(0, np.int64)  # stable: row order
    exact = np.stack([hashes[order, 0], hashes[order, 1], order.astype(np.uint64)]) if n \
        else np.zeros((3, 0), np.uint64)
    keys, rows, starts = [], [], [0]
    for band in range(band_keys.shape[1]):
        column = band_keys[:, band]
        signed = np.flatnonzero(column != NO_SIGNATURE)
        by_key = signed[np.argsort(column[signed], kind="stable")]
        keys.append(column[by_key])
        rows.append(by_key.astype(np.uint64))
        starts.append(starts[-1] + len(by_key))
    near = np.stack([np.concatenate(keys), np.concatenate(rows)]) if keys else np.zeros((2, 0), np.uint64)
    return exact, near, starts


def bucket_range(bucket: int, buckets: int, span: int) -> tuple[int, int]:
    """[lo, hi) of bucket `bucket` of `buckets` equal ranges over [0, span)."""
    return bucket * span // buckets, (bucket + 1) * span // buckets


def _slice(sorted_keys: np.ndarray, lo: int, hi: int) -> slice:
    """Positions of the keys in [lo, hi) of an ascending uint64 array (memory-mapped: a binary
    search reads a few pages, not the array)."""
    if hi <= 0 or lo >= KEY_SPACE:
        return slice(0, 0)
    start = 0 if lo <= 0 else int(np.searchsorted(sorted_keys, np.uint64(lo)))
    end = len(sorted_keys) if hi >= KEY_SPACE else int(np.searchsorted(sorted_keys, np.uint64(hi)))
    return slice(start, end)


def bucket_pairs(shards: list[tuple[int, np.ndarray, np.ndarray, list[int]]], bucket: int, buckets: int,
                 bands: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs bucket `bucket` of `buckets` owns. `shards`: per shard in input order, (index of
    its first document among all shards, `exact`, `near`, `band_starts` from shard_index). Returns
    exact pairs (copy, first copy) and near pairs (first with the key, other), as (k, 2) int64 of
    global document indices. One band at a time: a bucket holds its share of one band's keys."""
    lo, hi = bucket_range(bucket, buckets, KEY_SPACE)
    hashes, owners = [], []
    for offset, exact, _, _ in shards:
        part = exact[:, _slice(exact[0], lo, hi)]
        hashes.append(part[:2].T)
        owners.append(part[2].astype(np.int64) + offset)
    found = np.concatenate(hashes) if hashes else np.zeros((0, 2), np.uint64)
    copies, first = _first_of_equal_rows(found) if len(found) else (_NONE, _NONE)
    owner = np.concatenate(owners) if owners else _NONE
    exact_pairs = np.stack([owner[copies], owner[first]], axis=1)

    lo, hi = bucket_range(bucket, buckets, bands * KEY_SPACE)
    near_pairs = [np.zeros((0, 2), np.int64)]
    for band in range(lo // KEY_SPACE, min(bands, -(-hi // KEY_SPACE))):
        key_lo, key_hi = lo - band * KEY_SPACE, hi - band * KEY_SPACE
        keys, owners = [], []
        for offset, _, near, starts in shards:
            segment = near[:, starts[band]:starts[band + 1]]
            part = segment[:, _slice(segment[0], key_lo, key_hi)]
            keys.append(part[0])
            owners.append(part[1].astype(np.int64) + offset)
        # Shards come in input order and a shard's equal keys in row order: a stable sort puts
        # the earliest document of every run of equal keys first.
        key = np.concatenate(keys)
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        repeat = np.flatnonzero(ordered[1:] == ordered[:-1]) + 1
        if not len(repeat):
            continue
        run_start = np.maximum.accumulate(np.where(np.concatenate(([True], ordered[1:] != ordered[:-1])),
                                                   np.arange(len(ordered)), 0))
        owner = np.concatenate(owners)[order]
        near_pairs.append(np.stack([owner[run_start[repeat]], owner[repeat]], axis=1))
    return exact_pairs, np.concatenate(near_pairs)


def components(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """The smallest member of each node's connected component, for nodes 0..n-1 joined by the
    edges (a[i], b[i]). Vectorized union-find: hook each edge's larger root under its smaller
    one, then halve paths until every node points at a root; repeat until no edge spans two."""
    parent = np.arange(n, dtype=np.int64)
    while len(a):
        ra, rb = parent[a], parent[b]
        apart = ra != rb
        if not apart.any():
            break
        a, b, ra, rb = a[apart], b[apart], ra[apart], rb[apart]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))
        while True:
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
    return parent


def resolve_pairs(n: int, exact_pairs: np.ndarray, near_pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Every bucket's pairs -> (removed documents ascending, the kept document each duplicates,
    kind EXACT / NEAR, stats as find_duplicates counts them). Holds the pairs, not the documents."""
    stats = {"in": n, "exact_duplicates": 0, "near_duplicates": 0, "candidate_pairs": 0, "clusters": 0}
    copies = exact_pairs[np.argsort(exact_pairs[:, 0], kind="stable")] if len(exact_pairs) else exact_pairs
    stats["exact_duplicates"] = len(copies)
    if len(near_pairs) and len(copies):
        touches = np.isin(near_pairs, copies[:, 0]).any(axis=1)
        near_pairs = near_pairs[~touches]
    pairs = np.unique(near_pairs, axis=0) if len(near_pairs) else np.zeros((0, 2), np.int64)
    stats["candidate_pairs"] = len(pairs)
    nodes = np.unique(pairs)
    root = nodes[components(np.searchsorted(nodes, pairs[:, 0]), np.searchsorted(nodes, pairs[:, 1]),
                            len(nodes))]
    near = nodes != root
    stats["near_duplicates"], stats["clusters"] = int(near.sum()), len(np.unique(root))
    removed = np.concatenate([copies[:, 0], nodes[near]]).astype(np.int64)
    kept_of = np.concatenate([copies[:, 1], root[near]]).astype(np.int64)
    kind = np.concatenate([np.full(len(copies), EXACT, np.int8), np.full(int(near.sum()), NEAR, np.int8)])
    order = np.argsort(removed, kind="stable")
    return removed[order], kept_of[order], kind[order], stats
