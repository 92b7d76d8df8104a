"""Quality filters with their published defaults, and the blocklist filter.

Thresholds and drop reasons follow the papers and the reference implementations used to build
FineWeb (the reason strings are datatrove's, so a drop reads the same in both tools):

- Gopher repetition and quality: Rae et al. 2021, "Scaling Language Models: Methods, Analysis &
  Insights from Training Gopher", Table A1 and section A.1.1.
- C4: Raffel et al. 2020, section 2.2, as implemented in TensorFlow Datasets' c4_utils.
- FineWeb: Penedo et al. 2024, "The FineWeb Datasets", section 3.3 (custom filters).

Each filter reads `doc.word_ids` or `doc.words` (split once per text version, see text.py). The
n-gram statistics are computed on integer word ids with numpy instead of joined strings; they give
the same numbers.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tasks.data.steps import Doc, Filter, word_ids_of
from tasks.data.text import TABLE, TERMINAL_PUNCTUATION, count_sentences, split_lines, split_words


def duplicates(items: list[str]) -> tuple[int, int]:
    """(number of repeated items, characters in them): every occurrence after the first counts."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


# --------------------------------------------------------------------------------------------
# Gopher repetition


_PRIME = np.uint64(0x100000001B3)
_NOTHING = np.zeros(0, dtype=np.int64)


def _mixed(ids: np.ndarray) -> np.ndarray:
    """Word ids spread over 64 bits, so that n-gram keys of small ids do not collide."""
    return (ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)


_SCORE_SHIFT = np.int64(1 << 32)


def ngram_repetition(ids: list[np.ndarray], lengths: list[np.ndarray], max_n: int,
                     dup_ns: set[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Gopher's n-gram statistics of a batch of documents (each one's word ids and lengths), in
    one pass per n for the whole batch: {n: (characters covered by each document's most frequent
    n-gram, characters in its n-grams that repeat an earlier one (n in dup_ns, else 0))}, for
    n = 2 .. max_n; a document with fewer than n words gets -1 for both.

    The top n-gram's characters are its length (words joined by spaces) times its count, ties
    going to the n-gram seen first, as with collections.Counter. An n-gram is a uint64 key, a
    polynomial hash of its words' ids, sorted together with its document's index so that one
    sort groups every document's n-grams. Only bigrams are all sorted: an n-gram can repeat only
    if both (n-1)-grams in it repeat, so each longer n is counted over those positions alone,
    which in prose are few and soon none (then a document's top n-gram is its first, seen once)."""
    sizes = np.array([len(x) for x in ids], dtype=np.int64)
    n_docs = len(ids)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    words = np.concatenate(ids) if n_docs else _NOTHING
    doc_of = np.repeat(np.arange(n_docs, dtype=np.int64), sizes)
    local = np.arange(len(words), dtype=np.int64) - offsets[doc_of]
    mixed = _mixed(words)
    prefix = np.concatenate(([0], np.cumsum(np.concatenate(lengths) if n_docs else _NOTHING)))
    positions = np.flatnonzero(doc_of[:-1] == doc_of[1:])  # bigrams inside one document
    keys = mixed[positions] * _PRIME + mixed[positions + 1]
    owner_type = np.uint16 if n_docs <= 1 << 16 else np.int64  # radix-sorted when 16 bits
    stats = {}
    for n in range(2, max_n + 1):
        fits = sizes >= n
        # Every document's first n-gram, seen once: what its top is when nothing repeats.
        best = np.where(fits, _SCORE_SHIFT + _SCORE_SHIFT - 1, -1)
        repeated = _NOTHING
        if len(keys):
            owner = doc_of[positions]
            # By document, then key: numpy's vectorised (unstable) sort groups the keys, then a
            # stable radix sort of the small document numbers brings each document's together,
            # 4x faster than lexsort's two stable sorts. Within a group positions are in no order.
            order = np.argsort(keys)
            order = order[np.argsort(owner[order].astype(owner_type), kind="stable")]
            ordered, owners = keys[order], owner[order]
            starts = np.flatnonzero(np.concatenate(([True], (ordered[1:] != ordered[:-1])
                                                    | (owners[1:] != owners[:-1]))))
            counts = np.diff(np.append(starts, len(keys)))
            first = positions[np.minimum.reduceat(order, starts)]  # each n-gram where it is first seen
            # Sorted by document first: each document's runs are adjacent, its best is a reduceat.
            run_owner = owners[starts]
            per_doc = np.flatnonzero(np.concatenate(([True], run_owner[1:] != run_owner[:-1])))
            scores = counts * _SCORE_SHIFT + (_SCORE_SHIFT - 1 - local[first])
            docs = run_owner[per_doc]
            best[docs] = np.maximum(best[docs], np.maximum.reduceat(scores, per_doc))
            repeated = np.sort(order[np.repeat(counts > 1, counts)])
        top_count = np.where(fits, best >> 32, 0)
        start = offsets[:-1] + (_SCORE_SHIFT - 1 - (best & (_SCORE_SHIFT - 1)))
        top = np.where(fits, (prefix[np.minimum(start + n, len(words))] - prefix[np.minimum(start, len(words))]
                              + n - 1) * top_count, -1)
        positions, keys = positions[repeated], keys[repeated]
        dup = np.where(fits, 0, -1)
        if n in dup_ns and len(positions):
            _repeated_chars(positions, keys, doc_of, prefix, n, dup)
        stats[n] = (top, dup)
        if len(positions):  # (n+1)-grams whose two n-grams both repeat
            repeats = np.zeros(len(words) + 1, dtype=bool)
            repeats[positions] = True
            follows = repeats[positions + 1] & (doc_of[np.minimum(positions + 1, len(words) - 1)] == doc_of[positions])
            positions = positions[follows]
            keys = keys[follows] * _PRIME + mixed[positions + n]
    return stats


def _repeated_chars(positions: np.ndarray, keys: np.ndarray, doc_of: np.ndarray, prefix: np.ndarray,
                    n: int, out: np.ndarray) -> None:
    """Per document, characters in n-grams that repeat an earlier one, scanning left to right and
    jumping past each repeat (so overlapping repeats are not counted twice). Word characters
    only, no spaces. Added into `out`.

    Only n-grams that occur more than once (`positions`, ascending, with their keys) can ever be a
    repeat, and an n-gram occurring once only ever adds itself to the seen set, which nothing
    later looks up: so the scan visits just those positions, remembering how far the last jump
    reached."""
    seen: set[int] = set()
    doc, resume_at = -1, 0
    for i, key, owner in zip(positions.tolist(), keys.tolist(), doc_of[positions].tolist()):
        if owner != doc:
            seen, doc, resume_at = set(), owner, 0
        if i < resume_at:
            continue
        if key in seen:
            out[owner] += int(prefix[i + n] - prefix[i])
            resume_at = i + n
        else:
            seen.add(key)


@dataclass(kw_only=True)
class GopherRepetitionParams:
    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: list = field(default_factory=lambda: [[2, 0.2], [3, 0.18], [4, 0.16]])
    dup_n_grams: list = field(default_factory=lambda: [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12],
                                                       [9, 0.11], [10, 0.10]])


_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAK = re.compile(r"\n+")


class GopherRepetition(Filter):
    """Drops documents that repeat themselves: duplicated lines or paragraphs, one n-gram
    covering too much of the text, or too many characters inside repeated n-grams."""

    name = "gopher_repetition"
    Params = GopherRepetitionParams

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        return self.filter_batch([doc])[0]

    def filter_batch(self, docs: list[Doc]) -> list[bool | tuple[bool, str]]:
        p = self.params
        results: list[bool | tuple[bool, str]] = [self._lines_and_paragraphs(doc) for doc in docs]
        todo = [i for i, r in enumerate(results) if r is True]
        top, dup = dict(p.top_n_grams), dict(p.dup_n_grams)
        if not todo or not (top or dup):
            return results
        ids = word_ids_of([docs[i] for i in todo])
        stats = ngram_repetition(ids, [TABLE.length[x] for x in ids], max([*top, *dup]), set(dup))
        text_chars = np.array([len(docs[i].text) for i in todo])
        # The checks in the order they are published; a document fails at the first one.
        checks, reasons = [], []
        for n, (top_chars, dup_chars) in stats.items():
            if n in top:
                checks.append(top_chars / text_chars > top[n])
                reasons.append(f"top_{n}_gram")
            if n in dup:
                checks.append((dup_chars > 0) & (dup_chars / text_chars > dup[n]))
                reasons.append(f"duplicated_{n}_n_grams")
        if not checks:
            return results
        failed = np.stack(checks, axis=1)
        first = failed.argmax(axis=1)
        for k, i in enumerate(todo):
            if failed[k, first[k]]:
                results[i] = (False, reasons[first[k]])
        return results

    def _lines_and_paragraphs(self, doc: Doc) -> bool | tuple[bool, str]:
        p, text = self.params, doc.text
        stripped = text.strip()
        # Normalized text has no run of three newlines: then str.split does what the pattern does.
        paragraphs = stripped.split("\n\n") if "\n\n\n" not in stripped else _PARAGRAPH_BREAK.split(stripped)
        repeated, chars = duplicates(paragraphs)
        if p.dup_para_frac and repeated / len(paragraphs) > p.dup_para_frac:
            return False, "dup_para_frac"
        if p.dup_para_char_frac and chars / len(text) > p.dup_para_char_frac:
            return False, "dup_para_char_frac"
        if "\n\n" not in text:
            lines = text.split("\n")
        elif text[:1] != "\n" and text[-1:] != "\n":  # no empty piece at either end to keep
            lines = [line for line in text.split("\n") if line]
        else:
            lines = _LINE_BREAK.split(text)
        repeated, chars = duplicates(lines)
        if p.dup_line_frac and repeated / len(lines) > p.dup_line_frac:
            return False, "dup_line_frac"
        if p.dup_line_char_frac and chars / len(text) > p.dup_line_char_frac:
            return False, "dup_line_char_frac"
        return True


# --------------------------------------------------------------------------------------------
# Gopher quality

GOPHER_STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")


@dataclass(kw_only=True)
class GopherQualityParams:
    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3
    max_avg_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    max_non_alpha_words_ratio: float | None = 0.8  # the minimum share of words with a letter
    min_stop_words: int | None = 2
    stop_words: list = field(default_factory=lambda: list(GOPHER_STOP_WORDS))


class GopherQuality(Filter):
    """Drops documents that do not read like prose: too short or long, odd mean word length,
    many hashes or ellipses, mostly bullets, few words with letters, too few stop words."""

    name = "gopher_quality"
    Params = GopherQualityParams

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        p, text, ids = self.params, doc.text, doc.word_ids
        n_words = len(ids)
        kinds = TABLE.kind[ids]
        is_word = kinds != TABLE.SYMBOL
        n_non_symbol = int(np.count_nonzero(is_word))
        if p.min_doc_words and n_non_symbol < p.min_doc_words:
            return False, "gopher_short_doc"
        if p.max_doc_words and n_non_symbol > p.max_doc_words:
            return False, "gopher_long_doc"
        if not n_non_symbol:  # only reachable with min_doc_words disabled
            return False, "gopher_short_doc"
        mean_length = int(TABLE.length[ids][is_word].sum()) / n_non_symbol
        if p.min_avg_word_length and mean_length < p.min_avg_word_length:
            return False, "gopher_below_avg_threshold"
        if p.max_avg_word_length and mean_length > p.max_avg_word_length:
            return False, "gopher_above_avg_threshold"
        if p.max_symbol_word_ratio and text.count("#") / n_words > p.max_symbol_word_ratio:
            return False, "gopher_too_many_hashes"
        if p.max_symbol_word_ratio and (text.count("...") + text.count("…")) / n_words > p.max_symbol_word_ratio:
            return False, "gopher_too_many_ellipsis"
        lines = text.splitlines()
        if p.max_bullet_lines_ratio and sum(
                line.lstrip().startswith(("•", "-")) for line in lines) / len(lines) > p.max_bullet_lines_ratio:
            return False, "gopher_too_many_bullets"
        if p.max_ellipsis_lines_ratio and sum(
                line.rstrip().endswith(("...", "…")) for line in lines) / len(lines) > p.max_ellipsis_lines_ratio:
            return False, "gopher_too_many_end_ellipsis"
        if p.max_non_alpha_words_ratio and \
                np.count_nonzero(kinds == TABLE.ALPHA) / n_words < p.max_non_alpha_words_ratio:
            return False, "gopher_below_alpha_threshold"
        # Case-sensitive, as published: "The" at the start of a sentence is not counted.
        if p.min_stop_words and self._stop_words_in(doc) < p.min_stop_words:
            return False, "gopher_enough_stop_words"
        return True


    _stop_ids: tuple[int, set[int]] = (-1, set())  # (word table generation, ids of the stop words)

    def _stop_words_in(self, doc: Doc) -> int:
        """How many of the stop words the document holds, by word id (the strings if the word
        table started over in between, which would leave the two sets of ids apart)."""
        ids = doc.word_ids
        generation = TABLE.generation
        if self._stop_ids[0] != generation:
            self._stop_ids = (generation, set(TABLE.encode(self.params.stop_words).tolist()))
        if TABLE.generation != generation:
            return len(set(self.params.stop_words).intersection(doc.words))
        return len(self._stop_ids[1].intersection(ids.tolist()))


# --------------------------------------------------------------------------------------------
# C4

_CITATION = re.compile(r"\[(?:\d*|edit|citation needed)\]")
_C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
_POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies",
                   "use of cookies", "use cookies")


@dataclass(kw_only=True)
class C4QualityParams:
    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int = 5  # -1 disables
    min_words_per_line: int = 3  # -1 disables
    max_word_length: int = 1000  # -1 disables
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


class C4Quality(Filter):
    """C4's rules. Line rules remove lines (no terminal punctuation, fewer than 3 words, a word
    over 1000 characters, "javascript", cookie and policy boilerplate) and rewrite the text with
    the kept lines; document rules drop the page ("lorem ipsum", a curly bracket, fewer than 5
    sentences left)."""

    name = "c4_quality"
    Params = C4QualityParams

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        p = self.params
        kept_lines: list[str] = []
        kept_words: list[list[str]] = []
        sentences = 0
        for line, tokens in zip(split_lines(doc.text), doc.line_words):
            line = line.strip()  # a line's tokens do not change: they never hold whitespace
            words = line.split()
            # A word cannot be longer than its line: most lines skip the per-word check.
            if p.max_word_length != -1 and len(line) > p.max_word_length \
                    and any(len(w) > p.max_word_length for w in words):
                self.stats["lines_dropped.too_long_word"] += 1
                continue
            if p.remove_citations and "[" in line:
                cited, line = line, _CITATION.sub("", line)
                if line != cited:
                    tokens = split_words(line)
            if p.filter_no_terminal_punct and (not line.endswith(_C4_END_PUNCTUATION) or line.endswith("...")):
                self.stats["lines_dropped.no_terminal_punct"] += 1
                continue
            if len(words) < p.min_words_per_line:
                self.stats["lines_dropped.too_few_words"] += 1
                continue
            lower = line.lower()
            if p.filter_lorem_ipsum and "lorem ipsum" in lower:
                return False, "lorem_ipsum"
            if p.filter_javascript and "javascript" in lower:
                self.stats["lines_dropped.javascript"] += 1
                continue
            if p.filter_curly_bracket and "{" in line:
                return False, "curly_bracket"
            if p.filter_policy and any(phrase in lower for phrase in _POLICY_PHRASES):
                self.stats["lines_dropped.policy"] += 1
                continue
            if p.min_num_sentences != -1 and sentences < p.min_num_sentences:  # enough is enough
                sentences += count_sentences(line, tokens)
            kept_lines.append(line)
            kept_words.append(tokens)
        if sentences < p.min_num_sentences:
            return False, "too_few_sentences"
        text = "\n".join(kept_lines)
        if text != doc.text:
            self.stats["modified"] += 1
            if text == text.strip():  # as always with the default rules: kept lines hold words
                doc.rewrite(text, kept_words)
            else:
                doc.text = text.strip()
        return True


# --------------------------------------------------------------------------------------------
# FineWeb


@dataclass(kw_only=True)
class FineWebQualityParams:
    line_punct_thr: float = 0.12
    line_punct_exclude_zero: bool = False
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3


class FineWebQuality(Filter):
    """FineWeb's rules: enough lines end in punctuation, not mostly short lines, few characters
    in duplicated lines, not a list (many newlines per word)."""

    name = "fineweb_quality"
    Params = FineWebQualityParams

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        p, text = self.params, doc.text
        lines = [line for line in text.split("\n") if line.strip()]
        if not lines:
            return False, "empty"
        ratio = sum(line.endswith(TERMINAL_PUNCTUATION) for line in lines) / len(lines)
        if ratio < p.line_punct_thr and not (ratio == 0 and p.line_punct_exclude_zero):
            return False, "line_punct_ratio"
        if sum(len(line) <= p.short_line_length for line in lines) / len(lines) > p.short_line_thr:
            return False, "short_line_ratio"
        if duplicates(lines)[1] / len(text.replace("\n", "")) > p.char_duplicates_ratio:
            return False, "char_dup_ratio"
        if text.count("\n") / doc.n_words > p.new_line_ratio:
            return False, "list_ratio"
        return True


QUALITY_FILTERS: dict[str, type[Filter]] = {
    f.name: f for f in (GopherRepetition, GopherQuality, C4Quality, FineWebQuality)}


# --------------------------------------------------------------------------------------------
# Blocklist


@dataclass(kw_only=True)
class BlocklistParams:
    words: list = field(default_factory=list)  # words or phrases, matched as whole words


class Blocklist(Filter):
    """Drops a document that contains any blocked word or phrase (whole words, any case)."""

    name = "blocklist"
    Params = BlocklistParams

    def __init__(self, params: BlocklistParams | None = None) -> None:
        super().__init__(params)
        words = sorted({w.strip().lower() for w in self.params.words if w.strip()}, key=len, reverse=True)
        # One alternation, longest first, so a phrase wins over a word it starts with.
        self._pattern = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, words)) + r")(?!\w)",
                                   re.IGNORECASE) if words else None

    def filter(self, doc: Doc) -> bool | tuple[bool, str]:
        if self._pattern is not None and self._pattern.search(doc.text):
            return False, "blocklisted_word"
        return True


def step_stats(steps: list) -> dict[str, dict[str, int]]:
    return {step.name: dict(Counter(step.stats)) for step in steps}
