"""Deduplication across all shards: exact (content hash) and near (MinHash LSH, union-find).

The only step that needs every shard, staged explicitly:

1. per shard (in parallel, with the filters): a 128-bit content hash and `bands` LSH keys per
   kept document. Shingles are word 5-grams of the simplified text (lowercase, digits folded,
   punctuation and accents dropped); the signature is `bands * rows` minima of random linear
   permutations of the shingle hashes; each band of `rows` minima is hashed to one 64-bit key.
2. global (one process, reading only the hashes and keys, never the text): documents with equal
   content hashes keep the first; the others are exact duplicates. Among the rest, two documents
   sharing any band key are candidates; union-find joins candidates into clusters and the
   earliest document (input order) of each cluster is kept.

With the default 14 bands x 8 rows (FineWeb's), a pair with Jaccard similarity s becomes a
candidate with probability 1 - (1 - s^8)^14: 0.92 at s = 0.8, 0.26 at s = 0.6, under 0.01 at 0.4.
"""

from __future__ import annotations

import hashlib

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
        words = simplify_for_shingles(text)
        n = self.ngram
        if len(words) < n:
            return np.zeros(0, dtype=np.uint64)
        h = TABLE.hash[TABLE.encode(words)]  # stable 64-bit word hashes, memoized per process
        count = len(h) - n + 1
        acc = np.zeros(count, dtype=np.uint64)
        for k in range(n):
            acc = _mix(acc ^ h[k:k + count])  # order-sensitive: "a b" and "b a" differ
        return acc

    def signature(self, text: str) -> np.ndarray | None:
        """bands * rows minhash values, or None when the text has fewer words than a shingle."""
        shingles = self.shingles(text)
        if shingles.size == 0:
            return None
        sig = np.full(self.a.size, np.iinfo(np.uint64).max, dtype=np.uint64)
        for start in range(0, shingles.size, self.CHUNK):
            block = shingles[start:start + self.CHUNK, None]
            np.minimum(sig, (block * self.a + self.b).min(axis=0), out=sig)
        return sig

    def band_keys(self, text: str) -> np.ndarray:
        """`bands` keys; all NO_SIGNATURE when the text is too short to compare."""
        sig = self.signature(text)
        if sig is None:
            return np.zeros(self.bands, dtype=np.uint64)
        keys = _mix((sig.reshape(self.bands, self.rows) * self.band_mult).sum(axis=1, dtype=np.uint64))
        keys[keys == NO_SIGNATURE] = np.uint64(1)  # keep 0 free to mean "no signature"
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
