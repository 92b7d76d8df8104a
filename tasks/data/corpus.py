"""The demo pretraining corpus: prose from the installed Python's own documentation.

Made offline from what every Python install carries (module, class and function docstrings, and
`pydoc_data.topics`, the text behind `help('if')`), so the demo needs no download and is the same
on every run with the same Python. A document is a run of consecutive prose paragraphs of one
module (or help topic), at least DOC_MIN_WORDS words, paragraphs separated by a blank line: long
enough to be judged by the web-text quality filters the way a page would be. Paragraphs repeated
across the library (inherited method docs) are kept on purpose: deduplication has real work to do.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import logging
import random
import re
from pathlib import Path

from tasks.common.io import atomic_write

log = logging.getLogger(__name__)

# Well-documented modules that import without printing, opening windows or starting anything.
# Fixed (not sys.stdlib_module_names) so the corpus does not depend on what the platform ships,
# and so nothing like `this` or `antigravity` is ever imported.
STDLIB_MODULES = tuple(sorted("""
    abc argparse array ast asyncio base64 bdb binascii bisect builtins bz2 calendar cmath cmd
    codecs codeop collections colorsys compileall concurrent.futures configparser contextlib
    contextvars copy copyreg csv dataclasses datetime decimal difflib dis doctest email
    email.message email.utils enum errno filecmp fileinput fnmatch fractions ftplib functools
    gc getopt gettext glob graphlib gzip hashlib heapq hmac html html.parser http http.client
    http.cookies http.server imaplib importlib inspect io ipaddress itertools json keyword
    linecache locale logging logging.handlers lzma mailbox marshal math mimetypes netrc numbers
    operator optparse os os.path pathlib pdb pickle pickletools pkgutil platform plistlib
    poplib posixpath pprint profile pstats queue quopri random re reprlib rlcompleter runpy
    sched secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3
    stat statistics string stringprep struct subprocess symtable sys sysconfig tabnanny tarfile
    tempfile textwrap threading time timeit token tokenize trace traceback types typing
    unicodedata unittest unittest.mock urllib.parse urllib.request uuid warnings wave weakref
    xml.dom.minidom xml.etree.ElementTree zipapp zipfile zipimport zlib zoneinfo
""".split()))

MIN_PARAGRAPH_CHARS = 40
DOC_MIN_WORDS = 100  # Gopher's quality filter wants 50 words after C4 has removed some lines
# Share of words (punctuation tokens included) that hold a letter, per paragraph: the Gopher
# quality filter's own minimum, so reference tables and signatures are left out.
MIN_ALPHA_WORD_RATIO = 0.8


def _docstrings_of(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) for the module, its public classes, their methods, functions."""
    try:
        # A module that prints on import must not write into the caller's stdout.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            module = importlib.import_module(module_name)
    except Exception as exc:  # an optional C extension may be missing from this build
        log.info("demo corpus: skipping %s (%s)", module_name, exc)
        return []
    found = [(module_name, inspect.getdoc(module))]
    for name, obj in sorted(vars(module).items()):
        # Only what the module defines itself, so a re-exported name is not counted twice.
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        found.append((f"{module_name}.{name}", inspect.getdoc(obj)))
        if inspect.isclass(obj):
            for member_name, member in sorted(vars(obj).items()):
                if not member_name.startswith("_") and (callable(member) or isinstance(member, property)):
                    found.append((f"{module_name}.{name}.{member_name}", inspect.getdoc(member)))
    return [(qualname, doc) for qualname, doc in found if doc]


def _prose_paragraphs(text: str) -> list[str]:
    """Blank-line-separated paragraphs with their hard line wraps undone; code and tables skipped."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        paragraph = " ".join(line.strip() for line in block.splitlines()).strip()
        if len(paragraph) < MIN_PARAGRAPH_CHARS or paragraph.startswith((">>>", "...")):
            continue
        # Mostly letters means prose; signatures, tables and examples are mostly punctuation.
        if sum(c.isalpha() or c == " " for c in paragraph) / len(paragraph) < 0.85:
            continue
        paragraphs.append(paragraph)
    return paragraphs


def demo_paragraphs() -> list[dict[str, str]]:
    """Every prose paragraph available, in a fixed order: [{"text", "source"}]."""
    import pydoc_data.topics

    sources: list[tuple[str, str]] = []
    for module_name in STDLIB_MODULES:
        sources += [(f"stdlib:{qualname}", doc) for qualname, doc in _docstrings_of(module_name)]
    sources += [(f"pydoc_topics:{topic}", text)
                for topic, text in sorted(pydoc_data.topics.topics.items())]
    return [{"text": paragraph, "source": source}
            for source, text in sources for paragraph in _prose_paragraphs(text)]


def _module_of(source: str) -> str:
    kind, _, name = source.partition(":")
    return f"{kind}:{name if kind == 'pydoc_topics' else name.split('.')[0]}"


def demo_documents() -> list[str]:
    """Every demo document, in a fixed order: consecutive prose paragraphs of one module or
    topic, joined by blank lines, cut once a document reaches DOC_MIN_WORDS words."""
    from tasks.data.text import has_alpha, split_words

    by_module: dict[str, list[str]] = {}
    for paragraph in demo_paragraphs():
        words = split_words(paragraph["text"])
        if sum(map(has_alpha, words)) >= MIN_ALPHA_WORD_RATIO * len(words):
            by_module.setdefault(_module_of(paragraph["source"]), []).append(paragraph["text"])
    documents = []
    for paragraphs in by_module.values():
        current: list[str] = []
        n_words = 0
        for text in paragraphs:
            current.append(text)
            n_words += len(text.split())
            if n_words >= DOC_MIN_WORDS:
                documents.append("\n\n".join(current))
                current, n_words = [], 0
        if n_words >= DOC_MIN_WORDS // 2:  # a module's short tail stands on its own if long enough
            documents.append("\n\n".join(current))
    return documents


def write_demo_corpus(out_dir: str | Path, n_docs: int, seed: int, n_shards: int = 4) -> list[Path]:
    """Write `n_docs` documents, sampled with `seed`, as JSONL shards {"id", "text"}.

    Asking for more documents than this Python has writes all of them (a warning says so):
    repeating documents would only feed the deduplicator, not the model.
    """
    out_dir = Path(out_dir)
    pool = demo_documents()
    if n_docs > len(pool):
        log.warning("demo corpus: %d documents requested but this Python's documentation makes %d; "
                    "writing %d. Pass real `inputs` for a bigger corpus.", n_docs, len(pool), len(pool))
    chosen = sorted(random.Random(seed).sample(range(len(pool)), min(n_docs, len(pool))))
    n_shards = max(1, min(n_shards, len(chosen)))
    paths = []
    for shard in range(n_shards):
        rows = [{"id": f"demo-{i:07d}", "text": pool[i]} for i in chosen[shard::n_shards]]
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        paths.append(atomic_write(out_dir / f"demo_{shard:05d}.jsonl",
                                  lambda fh, data=data: fh.write(data)))
    return paths
