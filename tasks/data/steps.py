"""The per-document steps of data prep: a document, two small base classes, and running them.

A step is a *filter* (implements `filter(doc) -> True | (False, reason)`) or a *formatter*
(implements `format(doc) -> new text`). The base classes do the rest: counting what went in,
what was kept and why each document was dropped, so every step reports its own stats and a
pipeline is a plain list of steps.

Thresholds live in a small params dataclass per step, with the published defaults; a config
overrides them by name (`DataPrepConfig.filter_params`), and an unknown name or key is refused.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from itertools import chain
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tasks.data.text import TABLE, split_lines, split_words


@dataclass(slots=True)
class Doc:
    id: str
    text: str
    source: int = 0  # index of the `inputs` entry the document came from
    line: int = 0  # 1-based line (JSONL, text) or row (Parquet) where it starts in its file
    metadata: dict = field(default_factory=dict)
    _words: list | None = None
    _line_words: list | None = None
    _ids: Any = None
    _ids_generation: int = -1
    _words_of: str | None = None

    def _forget_if_changed(self) -> None:
        """Drop what was computed from an older version of the text."""
        if self._words_of is not self.text:
            self._words = self._line_words = None
            self._ids, self._words_of = None, self.text

    def _split(self) -> None:
        self._forget_if_changed()
        if self._words is None:
            self._words = split_words(self.text)

    @property
    def words(self) -> list[str]:
        """The text split into words, computed once per version of the text."""
        self._split()
        return self._words

    @property
    def line_words(self) -> list[list[str]]:
        """The words of each line of split_lines(text) (words never span lines: their
        concatenation is `words`); split when a step first asks, C4 reuses a kept line's."""
        self._split()
        if self._line_words is None:
            self._line_words = [split_words(line) for line in split_lines(self.text)]
        return self._line_words

    @property
    def n_words(self) -> int:
        """len(words), from whichever of the words or their ids is at hand."""
        if self._words_of is self.text and self._words is not None:
            return len(self._words)
        return len(self.word_ids)

    def rewrite(self, text: str, line_words: list[list[str]]) -> None:
        """Replace the text by one whose lines are known to split into `line_words`."""
        self.text = text
        self._line_words = line_words
        self._words = list(chain.from_iterable(line_words))
        self._ids, self._words_of = None, text

    @property
    def word_ids(self) -> Any:
        """`words` as ids of the process's WordTable (numpy int64), for vectorized statistics
        (from the text directly: the list of words is made only when a step asks for it)."""
        return word_ids_of([self])[0]


def word_ids_of(docs: list[Doc]) -> list[Any]:
    """[doc.word_ids for doc in docs], the ones not known yet encoded in one batch; all of them
    ids of the table as it is on return."""
    for doc in docs:
        doc._forget_if_changed()
    todo = [doc for doc in docs if doc._ids is None or doc._ids_generation != TABLE.generation]
    if todo:
        generation = TABLE.generation
        _encode(todo)
        if TABLE.generation != generation and len(todo) < len(docs):
            _encode(docs)  # the table started over: the others' ids were of the old one
    return [doc._ids for doc in docs]


def _encode(docs: list[Doc]) -> None:
    for doc, ids in zip(docs, TABLE.encode_texts([doc.text for doc in docs])):
        doc._ids, doc._ids_generation = ids, TABLE.generation


@dataclass(kw_only=True)
class NoParams:
    pass


class Step:
    """One block of the per-document pipeline; `stats` counts what it saw and did. Documents
    go through it in batches (`apply`), so a step may compute over many at once."""

    name: ClassVar[str]
    Params: ClassVar[type] = NoParams

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()
        self.stats: Counter = Counter()

    def __call__(self, doc: Doc) -> str | None:
        """Apply the step; return the reason to drop `doc`, or None to keep it."""
        raise NotImplementedError

    def apply(self, docs: list[Doc]) -> list[str | None]:
        """The step on each of `docs`, in order: the reason to drop each, or None."""
        return [self(doc) for doc in docs]


class Filter(Step):
    """Keeps or drops a document. Subclasses implement `filter` only (or `filter_batch`, when
    many documents at once are cheaper than one at a time)."""

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        raise NotImplementedError

    def filter_batch(self, docs: list[Doc]) -> list[bool | tuple[bool, str]]:
        return [self.filter(doc) for doc in docs]

    def __call__(self, doc: Doc) -> str | None:
        return self.apply([doc])[0]

    def apply(self, docs: list[Doc]) -> list[str | None]:
        self.stats["in"] += len(docs)
        reasons: list[str | None] = []
        for result in self.filter_batch(docs):
            if result is True:
                self.stats["kept"] += 1
                reasons.append(None)
                continue
            reason = result[1] if isinstance(result, tuple) else self.name
            self.stats[f"dropped.{reason}"] += 1
            reasons.append(reason)
        return reasons


class Formatter(Step):
    """Rewrites a document's text. Subclasses implement `format` (and may count in `stats`).
    A document whose text becomes empty is dropped with reason `empty_after_<name>`."""

    def format(self, doc: Doc) -> str:
        raise NotImplementedError

    def __call__(self, doc: Doc) -> str | None:
        self.stats["in"] += 1
        text = self.format(doc)
        if text != doc.text:
            self.stats["modified"] += 1
            doc.text = text
        if not text:
            reason = f"empty_after_{self.name}"
            self.stats[f"dropped.{reason}"] += 1
            return reason
        self.stats["kept"] += 1
        return None


# --------------------------------------------------------------------------------------------
# Always-on steps: clean the text, refuse binary junk and tiny fragments.

# Runs of whitespace other than newline (Unicode spaces too) that are not already one plain
# space: matching only those leaves the common case, a single space, untouched and fast.
_HORIZONTAL_SPACE = re.compile(r"[^\S\n]{2,}|[^\S\n ]")
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SPACE_AROUND_NEWLINE = re.compile(r" \n ?|\n ")
_BLANK_LINES = re.compile(r"\n{3,}")


_SPACES = re.compile(" {2,}")


def normalize_text(text: str) -> str:
    """NFC, one space for any run of spaces, at most one blank line, no control characters."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.isascii():  # ASCII is already NFC; skipping the call saves most of its cost
        text = unicodedata.normalize("NFC", text)
    # Each rule runs only where a substring test (memory speed) says it has work: most text is
    # clean, and a regular expression scans at a tenth of the speed.
    if text.replace("\n", "").isprintable():  # so no control characters, and no space but " "
        if "  " in text:
            text = _SPACES.sub(" ", text)
    else:
        # Whitespace controls (tab, form feed) become spaces first, so words they separate stay apart.
        text = _CONTROL_CHARS.sub("", _HORIZONTAL_SPACE.sub(" ", text))
    if " \n" in text or "\n " in text:
        text = _SPACE_AROUND_NEWLINE.sub("\n", text)
    if "\n\n\n" in text:
        text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()


class Normalize(Formatter):
    name = "normalize"

    def format(self, doc: Doc) -> str:
        return normalize_text(doc.text)


_JUNK = re.compile("[\x00-\x08\x0e-\x1f\x7f\ufffd\ufffe\uffff]")


@dataclass(kw_only=True)
class BinaryParams:
    max_junk_ratio: float = 0.05  # share of control / replacement characters in the raw text


class BinaryJunk(Filter):
    """Binary data that happens to decode (or was decoded with replacement characters):
    normalization would strip its control characters and leave plausible-looking garbage."""

    name = "binary"
    Params = BinaryParams

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        if _JUNK.search(doc.text) is None:  # the common case, one scan
            return True
        junk = len(_JUNK.findall(doc.text))
        if junk and junk > self.params.max_junk_ratio * len(doc.text):
            return False, "binary_junk"
        return True


@dataclass(kw_only=True)
class MinCharsParams:
    min_chars: int = 20


class MinChars(Filter):
    name = "min_chars"
    Params = MinCharsParams

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        return True if len(doc.text) >= self.params.min_chars else (False, "too_short")


# --------------------------------------------------------------------------------------------
# Running steps over documents (a run's list of steps: tasks/data/pipeline.py).


def run_steps(steps: list[Step], doc: Doc) -> tuple[str, str] | None:
    """Run `doc` through the steps in order; (step name, reason) of the first drop, else None."""
    return run_batch(steps, [doc])[0]


def run_batch(steps: list[Step], docs: list[Doc]) -> list[tuple[str, str] | None]:
    """run_steps for each of `docs`: each step sees the batch's documents still kept."""
    drops: list[tuple[str, str] | None] = [None] * len(docs)
    alive = list(range(len(docs)))
    for step in steps:
        if not alive:
            break
        still = []
        for i, reason in zip(alive, step.apply([docs[i] for i in alive])):
            if reason is None:
                still.append(i)
            else:
                drops[i] = (step.name, reason)
        alive = still
    return drops


def merge_stats(into: dict[str, dict[str, int]], stats: dict[str, dict[str, int]]) -> None:
    for step, counts in stats.items():
        target = into.setdefault(step, {})
        for key, value in counts.items():
            target[key] = target.get(key, 0) + value
