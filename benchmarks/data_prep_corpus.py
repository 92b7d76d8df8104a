"""A benchmark corpus made offline: documents composed from the standard library's docstrings.

Each document joins 3 to 12 prose paragraphs drawn at random (seeded) from every docstring and
help topic of the installed Python, so no two documents read alike but the language is real.
Planted on top, in known shares, is the work a web corpus gives a data pipeline: exact copies,
near copies (a few words changed), junk that the quality filters exist for (navigation stubs,
bullet lists, lorem ipsum, code, number tables, repeated lines) and contact details to redact.

    python benchmarks/data_prep_corpus.py OUT_DIR [--mb 50] [--files 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARES = {"exact_copy": 0.04, "near_copy": 0.04, "junk": 0.05, "pii": 0.05}


def _junk(rng: random.Random, paragraphs: list[str]) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return " | ".join(rng.sample(["Home", "About", "Contact", "Blog", "Login", "Cart", "FAQ"], 5))
    if kind == 1:
        return "\n".join(f"- {rng.choice(paragraphs)[:40]}" for _ in range(rng.randint(8, 20)))
    if kind == 2:
        return rng.choice(paragraphs) + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.\n" \
            + rng.choice(paragraphs)
    if kind == 3:
        return "\n".join(f"def f{i}(x):\n    return {{'k': x * {i}}}" for i in range(rng.randint(5, 15)))
    if kind == 4:
        return "\n".join(" ".join(str(rng.randint(0, 9999)) for _ in range(8)) for _ in range(20))
    line = rng.choice(paragraphs)
    return "\n".join([line] * rng.randint(5, 10))


def _contact(rng: random.Random) -> str:
    user = rng.choice(["ana", "li.wei", "j.smith", "mo", "sam_k"])
    return (f"Contact {user}@mail{rng.randint(1, 99)}.example.org, call +1 202 555 {rng.randint(1000, 9999)} "
            f"or reach the server at {rng.randint(11, 99)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.7.")


def _near_copy(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for pos in rng.sample(range(len(words)), max(1, len(words) // 50)):
        words[pos] = rng.choice(["really", "quite", "the", "data", "value", "often"])
    return " ".join(words)


def build_corpus(out_dir: Path, megabytes: float = 50, files: int = 16, seed: int = 0) -> dict:
    """Write JSONL files {"id", "text"} totalling at least `megabytes` of text; return counts."""
    from tasks.data.corpus import demo_paragraphs

    rng = random.Random(seed)
    paragraphs = [p["text"] for p in demo_paragraphs()]
    out_dir.mkdir(parents=True, exist_ok=True)
    handles = [open(out_dir / f"part-{k:05d}.jsonl", "w", encoding="utf-8") for k in range(files)]
    made: list[str] = []
    planted = {kind: 0 for kind in SHARES}
    total = n_docs = 0
    try:
        while total < megabytes * 1e6:
            roll = rng.random()
            if roll < SHARES["exact_copy"] and made:
                text, kind = rng.choice(made), "exact_copy"
            elif roll < SHARES["exact_copy"] + SHARES["near_copy"] and made:
                text, kind = _near_copy(rng, rng.choice(made)), "near_copy"
            elif roll < SHARES["exact_copy"] + SHARES["near_copy"] + SHARES["junk"]:
                text, kind = _junk(rng, paragraphs), "junk"
            else:
                text = "\n\n".join(rng.sample(paragraphs, rng.randint(3, 12)))
                kind = "pii" if rng.random() < SHARES["pii"] else None
                if kind:
                    text += "\n\n" + _contact(rng)
                if len(made) < 20000:
                    made.append(text)
            if kind:
                planted[kind] += 1
            line = json.dumps({"id": f"doc-{n_docs:08d}", "text": text}, ensure_ascii=False)
            handles[rng.randrange(files)].write(line + "\n")
            total += len(text.encode("utf-8"))
            n_docs += 1
    finally:
        for handle in handles:
            handle.close()
    return {"documents": n_docs, "text_mb": round(total / 1e6, 2), "files": files, "planted": planted}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--mb", type=float, default=50)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(build_corpus(args.out_dir, args.mb, args.files, args.seed)))
