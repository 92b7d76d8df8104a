"""Task suites defined as local files, and how a model is scored on them.

A suite is a JSONL file; its name is the file's stem. Each line is one item, of either kind:

    {"query": "Q: What number comes after 41?\\nA:", "choices": [" 42", " 40", " 17"], "gold": 0}
        multiple choice, scored by log-likelihood: the model picks the choice whose tokens it
        finds most likely after the query (accuracy), and the same per byte of the choice
        (acc_norm, which does not favour short choices), as lm-evaluation-harness does
    {"prompt": "Q: What number comes after 41?\\nA:", "answer": " 42"}
        generation, scored by exact match of the greedy answer (up to the first newline)

Either kind may carry a `passage` (any string or number): items with the same passage share a
text (several questions about one document), so the gate counts them as one cluster, not as
independent items (plugins/llmops/policy/paired.py).

Nothing is downloaded: suites are files in the repo, made by data prep, or written by
`write_demo_suites` from a prepared data dir (a multiple-choice version of the held-out SFT task
and a prose cloze from the held-out documents, which shows lost general ability directly).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tasks.common.io import atomic_write
from tasks.configs.evaluate_config import suite_item_kind
from tasks.train.prepared_data import SFTExample, read_jsonl
from tasks.train.runtime import autocast

log = logging.getLogger(__name__)


@dataclass
class Suite:
    name: str
    path: Path
    choice_items: list[dict[str, Any]]
    generation_items: list[dict[str, Any]]

    @property
    def size(self) -> int:
        return len(self.choice_items) + len(self.generation_items)


def suite_files(paths: list[str], work_dir: str | Path | None = None) -> list[Path]:
    """Suite files from files, directories (every *.jsonl inside) and s3:// URIs of either
    (downloaded into work_dir/suites_in first), in a stable order."""
    found: list[Path] = []
    for entry in paths:
        if str(entry).startswith("s3://"):
            if work_dir is None:
                raise ValueError(f"suite {entry}: an s3:// suite needs a work dir to download into.")
            found += _from_s3(str(entry), Path(work_dir) / "suites_in")
            continue
        p = Path(entry)
        if p.is_dir():
            found += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            found.append(p)
        else:
            raise FileNotFoundError(f"suite {p} does not exist; give JSONL files or directories.")
    names = [f.stem for f in found]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"suite names must be unique (the file stem); {dupes} appear twice.")
    return found


def _from_s3(uri: str, into: Path) -> list[Path]:
    """The object `uri` (a .jsonl key) or every .jsonl object under the prefix `uri`/."""
    import boto3

    from tasks.common.uris import split_s3

    bucket, key = split_s3(uri)
    client = boto3.client("s3")
    if key.endswith(".jsonl"):
        keys = [key]
    else:
        prefix = key.rstrip("/") + "/" if key else ""
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keys = sorted(o["Key"] for page in pages for o in page.get("Contents", [])
                      if o["Key"].endswith(".jsonl") and "/" not in o["Key"][len(prefix):])
        if not keys:
            raise FileNotFoundError(f"suite {uri} holds no .jsonl objects.")
    out = []
    for k in keys:
        target = into / bucket / k
        target.parent.mkdir(parents=True, exist_ok=True)
        body = client.get_object(Bucket=bucket, Key=k)["Body"].read()
        out.append(atomic_write(target, lambda fh, data=body: fh.write(data)))
    return out


def load_suite(path: str | Path, limit: int | None = None) -> Suite:
    path = Path(path)
    choice, generation = [], []
    for i, item in enumerate(read_jsonl(path)[:limit]):
        kind = suite_item_kind(item, f"{path}:{i + 1}")
        (choice if kind == "choice" else generation).append(item)
    if not choice and not generation:
        raise ValueError(f"suite {path} holds no items.")
    return Suite(path.stem, path, choice, generation)


# -- scoring --------------------------------------------------------------------------------------


@torch.no_grad()
def continuation_logprobs(model, pairs: list[tuple[list[int], list[int]]], device: torch.device,
                          batch_size: int = 32) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): the summed log-probability of the continuation
    after the context, and whether greedy decoding would have produced it exactly. Sequences
    longer than the model's context lose their oldest context tokens."""
    block = model.config.block_size
    out: list[tuple[float, bool]] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            seqs = [(ctx + cont)[-(block + 1):] for ctx, cont in chunk]
            T = max(len(s) for s in seqs) - 1
            inputs = torch.zeros((len(seqs), T), dtype=torch.long)
            for b, s in enumerate(seqs):
                inputs[b, :len(s) - 1] = torch.tensor(s[:-1])
            with autocast(device):
                logits = model(inputs.to(device))[0].float()
            logp = F.log_softmax(logits, dim=-1).cpu()
            for b, ((_, cont), s) in enumerate(zip(chunk, seqs)):
                n = min(len(cont), len(s) - 1)  # a continuation longer than the context: its end
                positions = torch.arange(len(s) - 1 - n, len(s) - 1)  # predicting the continuation
                target = torch.tensor(s[-n:])
                scores = logp[b, positions]
                out.append((float(scores.gather(1, target[:, None]).sum()),
                            bool((scores.argmax(-1) == target).all())))
    finally:
        model.train(was_training)
    return out


def score_choices(model, tokenizer, items: list[dict[str, Any]], device: torch.device
                  ) -> dict[str, float]:
    """Accuracy (argmax of summed log-likelihood) and acc_norm (per UTF-8 byte of the choice)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    pairs, owners = [], []
    for i, item in enumerate(items):
        ctx = encode(item["query"])
        for choice in item["choices"]:
            pairs.append((ctx, encode(choice) or encode(" ")))
            owners.append(i)
    scores = continuation_logprobs(model, pairs, device)
    per_item: dict[int, list[float]] = {}
    for i, (logprob, _) in zip(owners, scores):
        per_item.setdefault(i, []).append(logprob)
    correct, right_norm = [], 0
    for i, item in enumerate(items):
        lls = per_item[i]
        norm = [ll / max(1, len(c.encode())) for ll, c in zip(lls, item["choices"])]
        correct.append(max(range(len(lls)), key=lls.__getitem__) == item["gold"])
        right_norm += int(max(range(len(norm)), key=norm.__getitem__) == item["gold"])
    n = max(1, len(items))
    return {"accuracy": sum(correct) / n, "acc_norm": right_norm / n, "correct": correct}


def score_generation(model, tokenizer, eos_id: int, items: list[dict[str, Any]],
                     device: torch.device) -> dict[str, float]:
    from tasks.train.scoring import answer_budget, exact_match

    examples = []
    for i, item in enumerate(items):
        prompt = tokenizer.encode(item["prompt"], add_special_tokens=False).ids
        answer = tokenizer.encode(item["answer"], add_special_tokens=False).ids
        examples.append(SFTExample(id=str(i), prompt=item["prompt"], completion=item["answer"],
                                   skill="all", prompt_ids=prompt, completion_ids=answer + [eos_id]))
    result = exact_match(model, tokenizer, examples, eos_id, answer_budget(examples), device)
    return {"accuracy": result["accuracy"], "correct": result["correct"]}


def score_suite(model, tokenizer, eos_id: int, suite: Suite, device: torch.device
                ) -> dict[str, float]:
    """accuracy over every item of the suite, plus the per-kind figures."""
    return score_suite_items(model, tokenizer, eos_id, suite, device)[0]


def score_suite_items(model, tokenizer, eos_id: int, suite: Suite, device: torch.device
                      ) -> tuple[dict[str, float], list[bool]]:
    """score_suite's figures and whether each item was right (choice items, then generation
    items: the order of `suite_item_ids`)."""
    metrics: dict[str, float] = {}
    correct: list[bool] = []
    if suite.choice_items:
        mc = score_choices(model, tokenizer, suite.choice_items, device)
        metrics.update({"choice_accuracy": mc["accuracy"], "acc_norm": mc["acc_norm"]})
        correct += mc["correct"]
    if suite.generation_items:
        gen = score_generation(model, tokenizer, eos_id, suite.generation_items, device)
        metrics["exact_match"] = gen["accuracy"]
        correct += gen["correct"]
    metrics["accuracy"] = sum(correct) / suite.size
    metrics["items"] = suite.size
    return metrics, correct


def suite_item_ids(suite: Suite) -> list[str]:
    """A stable id per item (its content), in score_suite_items' order."""
    return [item_id(json.dumps(item, sort_keys=True, ensure_ascii=False))
            for item in [*suite.choice_items, *suite.generation_items]]


def item_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def item_results(ids: list[str], correct: list[bool],
                 passages: list[Any] | None = None) -> dict[str, Any]:
    """Per-item results in a compact form for the job result and the gate: the items' digest (two
    models were scored on the same items, in the same order, exactly when their digests match),
    one character per item, and, when items share passages, each item's passage (`clusters`)."""
    if len(ids) != len(correct):
        raise ValueError(f"{len(ids)} item ids but {len(correct)} results")
    out = {"n": len(ids), "items": hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16],
           "correct": "".join("1" if ok else "0" for ok in correct)}
    if passages and any(p is not None for p in passages):
        out["clusters"] = [f"p:{p}" if p is not None else f"i:{i}" for i, p in enumerate(passages)]
    return out


def suite_passages(items: list[dict[str, Any]]) -> list[Any]:
    """Each item's `passage` (None without one), in the order of the items given."""
    return [item.get("passage") for item in items]


# -- demo suites from a prepared data dir ---------------------------------------------------------


def _write_jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items).encode()
    return atomic_write(path, lambda fh: fh.write(data))


def write_demo_suites(data_dir: str | Path, out_dir: str | Path, n_items: int, seed: int = 0
                      ) -> list[Path]:
    """Two multiple-choice suites from a data dir's held-out material:
    sft_choice   each held-out SFT prompt with its completion among 3 completions of other
                 held-out examples of the same skill;
    prose_cloze  the opening words of a held-out document, to be continued by its own next words
                 rather than the same span of 3 other documents."""
    from tasks.train.prepared_data import DataDir, load_tokenizer

    data = DataDir(data_dir)
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    written = []

    records = read_jsonl(data.sft_path("eval"))
    by_skill: dict[str, list[str]] = {}
    for r in records:
        if "prompt" in r:
            by_skill.setdefault(str(r.get("skill", "all")), []).append(r["completion"])
    items = []
    for r in records:
        if "prompt" not in r:
            continue
        others = sorted({c for c in by_skill[str(r.get("skill", "all"))] if c != r["completion"]})
        if len(others) < 3:
            continue
        choices = [r["completion"], *rng.sample(others, 3)]
        rng.shuffle(choices)
        items.append({"query": r["prompt"], "choices": choices, "gold": choices.index(r["completion"])})
        if len(items) >= n_items:
            break
    if items:
        written.append(_write_jsonl(out_dir / "sft_choice.jsonl", items))

    tokenizer = load_tokenizer(data.tokenizer_path)
    rows = data.split("val")
    # the held-out documents: val rows are one token stream with EOS between documents
    batches = [rows.take(b) for b in rows.in_order(64, 64)]  # up to 4096 rows
    stream = np.concatenate([torch.cat([b.inputs, b.targets[:, -1:]], 1).reshape(-1).numpy()
                             for b in batches])
    docs, start = [], 0
    for end in [*np.flatnonzero(stream == data.eos_id), len(stream)]:
        if end > start:
            docs.append(tokenizer.decode(stream[start:end].tolist()))
        start = end + 1
    spans = []  # (document, context, continuation): 24 words, then the next 6, every 30 words
    for doc, text in enumerate(docs):
        words = text.split()
        for at in range(0, len(words) - 29, 30):
            context, truth = " ".join(words[at:at + 24]), " " + " ".join(words[at + 24:at + 30])
            if "\ufffd" not in context + truth:  # a token cut mid-character at a stream edge
                spans.append((doc, context, truth))
    items = []
    for i, (doc, context, truth) in enumerate(spans[:n_items]):
        pool = [s[2] for j, s in enumerate(spans) if j != i and s[2] != truth]
        if len(pool) < 3:
            break
        choices = [truth, *rng.sample(pool, 3)]
        rng.shuffle(choices)
        # the spans of one document share its text: one cluster for the gate's interval
        items.append({"query": context, "choices": choices, "gold": choices.index(truth),
                      "passage": doc})
    if items:
        written.append(_write_jsonl(out_dir / "prose_cloze.jsonl", items))
    log.info("demo suites: %s", {p.stem: sum(1 for _ in open(p)) for p in written})
    return written
