"""Benchmark corpora made offline: documents composed from the docstrings of what is installed.

Each document joins 3 to 12 prose paragraphs drawn at random (seeded) from a pool, so no two
documents read alike but the language is real. Two pools: `stdlib` (every docstring and help
topic of the installed Python, the demo corpus's paragraphs) and `packages` (docstrings of
installed third-party packages, read from their source with `ast`, nothing imported: numpy,
pandas, SQLAlchemy, networkx, SymPy, MLflow, Airflow and others; different authors, styles and
vocabulary).
Planted on top, in known shares, is the work a web corpus gives a data pipeline: exact copies,
near copies (a few words changed), junk that the quality filters exist for (navigation stubs,
bullet lists, lorem ipsum, code, number tables, repeated lines) and contact details to redact.

    python benchmarks/data_prep_corpus.py OUT_DIR [--mb 50] [--files 16] [--seed 0] [--source stdlib]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARES = {"exact_copy": 0.04, "near_copy": 0.04, "junk": 0.05, "pii": 0.05}
PACKAGES = ("numpy", "sqlalchemy", "werkzeug", "pydantic", "pygments", "setuptools", "pip", "networkx",
            "sympy", "pandas", "mlflow", "airflow")


def package_paragraphs(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Prose paragraphs of the module, class and function docstrings in the installed packages'
    source files (tests left out), in a fixed order. Parsed, not imported: no side effects."""
    from tasks.data.corpus import _prose_paragraphs

    paragraphs = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for path in sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py")):
            if {"tests", "test", "testing"} & set(path.parts):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    paragraphs += _prose_paragraphs(ast.get_docstring(node) or "")
    return paragraphs


def pool(source: str) -> list[str]:
    if source == "packages":
        return package_paragraphs()
    from tasks.data.corpus import demo_paragraphs

    return [p["text"] for p in demo_paragraphs()]


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


def build_corpus(out_dir: Path, megabytes: float = 50, files: int = 16, seed: int = 0,
                 paragraphs: list[str] | None = None) -> dict:
    """Write JSONL files {"id", "text"} totalling at least `megabytes` of text; return counts.
    `paragraphs`: the pool documents are composed from (default: the stdlib's)."""
    rng = random.Random(seed)
    paragraphs = paragraphs if paragraphs is not None else pool("stdlib")
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
    parser.add_argument("--source", choices=("stdlib", "packages"), default="stdlib")
    args = parser.parse_args()
    print(json.dumps(build_corpus(args.out_dir, args.mb, args.files, args.seed, pool(args.source))))
