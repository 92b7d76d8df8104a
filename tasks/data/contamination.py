"""The contamination audit: which evaluation items also appear in the training data.

A leaked benchmark inflates every score the gate reads. As the large evaluation reports do
(GPT-3's and Llama 2's 13-gram overlap audits, lm-evaluation-harness's decontamination), an item
counts as seen when any run of N words of it (13 by default) occurs in the training text.

    index   data_dir/ngrams/: per source, the sorted unique 64-bit hashes of every N-word run of
            its text, in `buckets` files by hash range (bucket-BBB.npy), and index.json (written
            last: the index is complete once it exists; it names its bucketing and its words, and
            an index of another version is rebuilt, never read). Sources: `pretrain` (the kept
            documents of the train split, documents/*.parquet) and `sft` (sft/train.jsonl, prompt
            and completion). Built map/reduce as the dedup index is: each documents file hashes its
            words into one sorted part (`build_parts`, shared-nothing), then each bucket merges
            its range of every part (`merge_bucket`); a lookup reads only the buckets its hashes
            fall in. Buckets are ranges of the hash, not residues, so a bucket's share of a sorted
            part is one slice: one part file per documents file, not one per file and bucket
            (each an fsync'd write; 16x fewer files, and on S3 16x fewer objects).
    audit   for each item's text (query + gold answer), its N-word runs looked up per source.
            Items shorter than N words cannot be checked this way: they are counted as
            `too_short`, never silently passed as clean.

Words: lm-evaluation-harness's definition (lm_eval/decontamination/janitor.py: Janitor's
`normalize_string`, then `word_ngrams`' whitespace split): ASCII letters lower-cased, every
character of string.punctuation deleted, then split on whitespace. So `I/O`, `i.e.`, `os.stat`,
`test's` and `dbm-like` are one word each (`io`, `ie`, `osstat`, `tests`, `dbmlike`), and a run of
12 whitespace words is never a 13-gram; case, punctuation and the amount of whitespace do not hide
an overlap (ASCII only, as in theirs: `É` keeps its case, `—` and `’` are kept). Their two lines
are mirrored here, not imported: importing their module prints a warning and a traceback whenever
its C++ extension is missing (pip does not build it), and the index is built in every data-prep
job. tests/test_contamination.py checks this copy against theirs item for item. Hashes: each word's blake2b (8 bytes), combined over the run with a
polynomial hash mod 2**64 (vectorised with numpy; a false hit needs a 64-bit collision).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import string
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from tasks.common.io import atomic_write, write_json
from tasks.data.markers import read_table

log = logging.getLogger("tasks.data.contamination")

N = 13
BUCKETS = 16
# lm-evaluation-harness's Janitor.translation_table (its default delete_chars)
_JANITOR_TABLE = str.maketrans(string.ascii_lowercase + string.ascii_uppercase,
                               string.ascii_lowercase * 2, string.punctuation)
_MULT = np.uint64(0x100000001B3)      # the FNV prime: odd, so the combination is invertible


def words(text: str) -> list[str]:
    """The text's words as lm-evaluation-harness counts them (module docstring)."""
    return text.translate(_JANITOR_TABLE).split()


def _word_hashes(tokens: list[str], cache: dict[str, int]) -> np.ndarray:
    out = np.empty(len(tokens), dtype=np.uint64)
    for i, word in enumerate(tokens):
        h = cache.get(word)
        if h is None:
            h = cache[word] = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
        out[i] = h
    return out


def gram_hashes(tokens: list[str], n: int, cache: dict[str, int] | None = None) -> np.ndarray:
    """The hash of every run of n consecutive words (none when there are fewer than n)."""
    if len(tokens) < n:
        return np.zeros(0, dtype=np.uint64)
    wh = _word_hashes(tokens, {} if cache is None else cache)
    count = len(tokens) - n + 1
    acc = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            acc = acc * _MULT + wh[k:k + count]
    return acc


# index.json's "bucketing" (how hashes map to buckets) and "words" (how text is split into the
# words hashed). Indexes of older versions lack them (residues mod `buckets`; lower-cased `\w+`
# runs, which made `I/O` two words): they are rebuilt, never read with the wrong map or words.
BUCKETING = "range"
WORDS = "lm_eval-janitor"


def _this_layout(meta: dict) -> bool:
    """Whether an index.json describes an index in this version's layout."""
    return meta.get("bucketing") == BUCKETING and meta.get("words") == WORDS


_HALF = np.uint64(32)


def _bucket_of(hashes: np.ndarray, buckets: int) -> np.ndarray:
    """floor(hash * buckets / 2**64), from the top 32 bits: monotone in the hash."""
    return (((hashes >> _HALF) * np.uint64(buckets)) >> _HALF).astype(np.int64)


def _bucket_slice(hashes: np.ndarray, bucket: int, buckets: int) -> np.ndarray:
    """The hashes of `bucket` in a sorted array, found by binary search (a memory-mapped part is
    read only there). Bucket b starts at the first hash whose top 32 bits reach ceil(b * 2**32 / buckets)."""
    def start(b: int) -> int:
        return len(hashes) if b >= buckets else int(np.searchsorted(
            hashes, np.uint64(-(-b * (1 << 32) // buckets) << 32)))
    return hashes[start(bucket):start(bucket + 1)]


def _save(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda fh: np.save(fh, array))


def build_parts(texts: Iterable[str], parts_dir: Path, name: str, n: int = N,
                buckets: int = BUCKETS) -> int:
    """Map: hash one piece of a source's text into parts_dir/<name>.npy (sorted, unique; every
    bucket's share); the number of runs."""
    cache: dict[str, int] = {}
    chunks = [gram_hashes(words(t), n, cache) for t in texts]
    hashes = np.unique(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.uint64)
    _save(parts_dir / f"{name}.npy", hashes)
    return int(sum(len(c) for c in chunks))


def merge_bucket(parts_dir: Path, out: Path, bucket: int, buckets: int = BUCKETS) -> int:
    """Reduce: one bucket's range of every part into one sorted array of unique hashes; its size."""
    pieces = [_bucket_slice(np.load(p, mmap_mode="r"), bucket, buckets) for p in sorted(parts_dir.glob("*.npy"))]
    merged = np.unique(np.concatenate(pieces)) if pieces else np.zeros(0, dtype=np.uint64)
    _save(out / f"bucket-{bucket:03d}.npy", merged)
    return len(merged)


MapJobs = Callable[[Callable[[dict], dict], list[dict]], list[dict]]


def build_index(data_dir: str | Path, n: int = N, buckets: int = BUCKETS,
                out_dir: str | Path | None = None, map_jobs: MapJobs | None = None) -> dict[str, Any]:
    """Build <out_dir or data_dir>/ngrams/ from a finished data prep (see the module docstring);
    its index.json. Rebuilt only when missing or built for another n, bucket count or data.
    `map_jobs(fn, jobs)` runs the map and the reduce jobs (data prep's engine; default: in turn,
    here). A map job reads only its own documents file: no process holds the corpus's text."""
    map_jobs = map_jobs or (lambda fn, jobs: [fn(job) for job in jobs])
    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    root = Path(out_dir or data_dir) / "ngrams"
    done = root / "index.json"
    if done.is_file():
        index = json.loads(done.read_text())
        if (index.get("n"), index.get("buckets"), index.get("data_content_hash")) == (
                n, buckets, manifest.get("content_hash")) and _this_layout(index):
            return index
    sft = (manifest.get("sft") or {}).get("train")
    files = {"pretrain": list((manifest.get("documents") or {}).get("files") or []),
             "sft": [sft] if sft and (data_dir / sft).is_file() else []}
    common = {"data_dir": str(data_dir), "n": n, "buckets": buckets}
    shutil.rmtree(root / "parts", ignore_errors=True)  # a crashed build's parts are not this one's
    hashed = map_jobs(hash_file, [{**common, "source": source, "file": name, "parts": str(root / "parts" / source)}
                                  for source, names in files.items() for name in names])
    merged = map_jobs(merge_source_bucket, [{"source": source, "parts": str(root / "parts" / source),
                                             "out": str(root / source), "bucket": b, "buckets": buckets}
                                            for source in files for b in range(buckets)])
    sources = {source: {"documents": sum(h["documents"] for h in hashed if h["source"] == source),
                        "runs": sum(h["runs"] for h in hashed if h["source"] == source),
                        "unique_runs": sum(m["unique"] for m in merged if m["source"] == source)}
               for source in files}
    index = {"n": n, "buckets": buckets, "bucketing": BUCKETING, "words": WORDS,
             "data_content_hash": manifest.get("content_hash"), "sources": sources}
    write_json(done, index)
    shutil.rmtree(root / "parts", ignore_errors=True)  # the merge's input: the buckets hold it all
    log.info("contamination index: %d-word runs of %s", n,
             ", ".join(f"{s} ({v['documents']} documents, {v['unique_runs']} unique)"
                       for s, v in sources.items()))
    return index


def hash_file(job: dict) -> dict:
    """Map job: one documents file's training text (or the SFT train set) into its parts."""
    path = Path(job["data_dir"]) / job["file"]
    texts = _sft_texts(path) if job["source"] == "sft" else _pretrain_texts(path)
    name = "train" if job["source"] == "sft" else path.stem
    runs = build_parts(texts, Path(job["parts"]), name, job["n"], job["buckets"])
    return {"source": job["source"], "documents": len(texts), "runs": runs}


def merge_source_bucket(job: dict) -> dict:
    """Reduce job: one bucket of one source's parts."""
    return {"source": job["source"],
            "unique": merge_bucket(Path(job["parts"]), Path(job["out"]), job["bucket"], job["buckets"])}


def _pretrain_texts(path: Path) -> list[str]:
    table = read_table(path, columns=["text", "split"]).to_pydict()
    # only what the model trains on: the held-out split is evaluation's own text
    return [t for t, split in zip(table["text"], table["split"]) if split == "train"]


def _sft_texts(path: Path) -> list[str]:
    texts = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                record = json.loads(line)
                texts.append(" ".join(str(m.get("content", "")) for m in record["messages"])
                             if "messages" in record else
                             f"{record.get('prompt', '')} {record.get('completion', '')}")
    return texts


class NgramIndex:
    """<where>/ngrams/ (a data dir, or the directory build_index wrote to) for lookups; buckets
    are loaded when first needed."""

    def __init__(self, where: str | Path) -> None:
        self.root = Path(where) / "ngrams"
        meta = json.loads((self.root / "index.json").read_text())
        if not _this_layout(meta):
            raise ValueError(f"{self.root} was built by an older version (buckets by "
                             f"{meta.get('bucketing', 'residue')}, words by {meta.get('words', 'regex')}; "
                             f"this version: {BUCKETING}, {WORDS}): rebuild it with build_index.")
        self.n, self.buckets, self.sources = int(meta["n"]), int(meta["buckets"]), list(meta["sources"])
        self._loaded: dict[tuple[str, int], np.ndarray] = {}

    def _bucket(self, source: str, b: int) -> np.ndarray:
        if (source, b) not in self._loaded:
            self._loaded[(source, b)] = np.load(self.root / source / f"bucket-{b:03d}.npy")
        return self._loaded[(source, b)]

    def hits(self, text: str) -> dict[str, int] | None:
        """Per source, how many of the text's N-word runs it holds; None when the text is
        shorter than N words (it cannot be checked)."""
        hashes = np.unique(gram_hashes(words(text), self.n))
        if not len(hashes):
            return None
        which = _bucket_of(hashes, self.buckets)
        found: dict[str, int] = {}
        for source in self.sources:
            count = 0
            for b in np.unique(which):
                table, wanted = self._bucket(source, int(b)), hashes[which == b]
                if len(table):
                    at = np.minimum(np.searchsorted(table, wanted), len(table) - 1)
                    count += int(np.sum(table[at] == wanted))
            if count:
                found[source] = count
        return found


def audit(index: NgramIndex, texts: list[str]) -> dict[str, Any]:
    """One metric's items: which ones were seen in training (their positions, with where and how
    many runs), and how many were too short to check."""
    seen, too_short = [], 0
    for i, text in enumerate(texts):
        found = index.hits(text)
        if found is None:
            too_short += 1
        elif found:
            seen.append({"item": i, "found_in": found})
    return {"items": len(texts), "checked": len(texts) - too_short, "too_short": too_short,
            "contaminated": len(seen), "seen": seen}


def open_index(data_dir: str | Path, scratch: str | Path) -> NgramIndex:
    """The data dir's index, or one built now into `scratch` (data prepared before the index
    existed, or a read-only data dir without one)."""
    marker = Path(data_dir) / "ngrams" / "index.json"
    if marker.is_file() and _this_layout(json.loads(marker.read_text())):
        return NgramIndex(data_dir)
    log.info("%s has no contamination index of this version: building it in %s", data_dir, scratch)
    build_index(data_dir, out_dir=scratch)
    return NgramIndex(scratch)


def seen_mask(result: dict[str, Any]) -> str:
    """audit()'s result as one character per item ("1": seen in training), for per_item."""
    seen = {entry["item"] for entry in result["seen"]}
    return "".join("1" if i in seen else "0" for i in range(result["items"]))
