"""The per-document steps on crafted documents: each quality filter at its published thresholds
(the reason strings are datatrove's), PII redaction, the blocklist, and deduplication recall and
precision on planted duplicates."""

from __future__ import annotations

import random
import string
from collections import Counter

import numpy as np
import pytest

from tasks.configs import ConfigError, DataPrepConfig
from tasks.data.dedup import EXACT, NEAR, MinHasher, UnionFind, content_hash, find_duplicates, hashes_to_array
from tasks.data.filters import (Blocklist, BlocklistParams, C4Quality, FineWebQuality, GopherQuality,
                                GopherRepetition, ngram_repetition)
from tasks.data.pii import RedactPII
from tasks.data.pipeline import build_pipeline
from tasks.data.steps import Doc, run_steps
from tasks.data.text import count_sentences, split_words

# Fifty distinct words of three to ten letters, with two of Gopher's stop words among them.
WORDS = ("the river carried small boats past quiet farms and old mills toward harbor towns where "
         "traders sold grain wool timber salt copper glass paper leather honey wine cheese bread "
         "rope nails lamps baskets pottery cloth dyes spices herbs candles soap iron tools maps "
         "books music letters news stories poems with").split()
assert len(WORDS) == 50 and len(set(WORDS)) == 50


STEPS = (1, 3, 7, 9, 11, 13, 17, 19, 21, 23, 27, 29, 31, 33, 37, 39, 41, 43, 47, 49)  # coprime to 50


def prose(n_words: int, start: int = 0, step: int = 1) -> str:
    """n words of WORDS, walking it `step` at a time: different steps share no word pairs."""
    return " ".join(WORDS[(start + i * step) % len(WORDS)] for i in range(n_words)) + "."


def sentences(n: int) -> list[str]:
    """n distinct sentences of eight words, each ending with a period (C4 and FineWeb like it)."""
    return [prose(8, 3 * k, STEPS[k % len(STEPS)]).capitalize() for k in range(n)]


def reason(step, text: str) -> str | None:
    doc = Doc("d", text)
    return step(doc)


# --------------------------------------------------------------------------------------------
# Gopher quality: Rae et al. 2021, A.1.1


def test_gopher_quality_word_count_boundary_is_fifty():
    f = GopherQuality()
    assert reason(f, prose(49)) == "gopher_short_doc"
    assert reason(f, prose(50)) is None
    assert f.stats == Counter({"in": 2, "kept": 1, "dropped.gopher_short_doc": 1})
    # Punctuation is not a word: 49 words and plenty of commas are still too short.
    assert reason(f, prose(49).replace(" ", " , ", 20)) == "gopher_short_doc"


@pytest.mark.parametrize("text, expected", [
    (" ".join(["to be of it at by an in on as"] * 6) + " the of", "gopher_below_avg_threshold"),
    ("the of " + " ".join(["internationalization"] * 40) + " " + prose(20), "gopher_above_avg_threshold"),
    (prose(60) + " #" * 7, "gopher_too_many_hashes"),  # 7 / 67 tokens > 0.1
    (prose(60) + " ..." * 7, "gopher_too_many_ellipsis"),
    ("\n".join("- " + prose(8, 8 * i) for i in range(10)), "gopher_too_many_bullets"),
    ("\n".join(prose(8, 8 * i)[:-1] + ("..." if i < 4 else ".") for i in range(10)),
     "gopher_too_many_end_ellipsis"),  # 4 of 10 lines end in an ellipsis > 0.3
    (prose(50) + " 1234" * 15, "gopher_below_alpha_threshold"),  # 51 of 66 tokens have a letter
    (prose(60).replace("the ", "The ").replace(" with", " With"), "gopher_enough_stop_words"),
])
def test_gopher_quality_rules(text, expected):
    assert reason(GopherQuality(), text) == expected


def test_gopher_quality_thresholds_are_inclusive_where_published():
    f = GopherQuality()
    assert reason(f, prose(60) + " #" * 6) is None  # 6 / 66 <= 0.1
    assert reason(f, "\n".join(("- " if i < 9 else "") + prose(8, 8 * i) for i in range(10))) is None  # 0.9
    assert reason(f, prose(60) + " 1234" * 14) is None  # 60 / 75 = 0.8 is enough
    assert reason(GopherQuality(GopherQuality.Params(min_doc_words=10)), prose(20)) is None


# --------------------------------------------------------------------------------------------
# Gopher repetition: Rae et al. 2021, Table A1


def test_gopher_repetition_rules():
    f = GopherRepetition()
    paragraphs = [prose(12, 5 * i, STEPS[i]) for i in range(10)]
    assert reason(f, "\n\n".join(paragraphs)) is None
    # 4 of 10 paragraphs repeat an earlier one: 0.4 > 0.3.
    assert reason(f, "\n\n".join(paragraphs[:6] + [paragraphs[0]] * 4)) == "dup_para_frac"
    # One repeat only (0.1 of paragraphs), but it holds over 20% of the characters.
    long = prose(200, 3)
    assert reason(f, "\n\n".join([long] + paragraphs[:8] + [long])) == "dup_para_char_frac"
    assert reason(f, "\n".join(paragraphs[:6] + [paragraphs[1]] * 4)) == "dup_line_frac"
    # Every line is new, but "the cat" covers over 20% of the text.
    cat = "\n".join(f"the cat {w} {WORDS[(i * 3) % 50]} today." for i, w in enumerate(WORDS[:20]))
    assert reason(f, cat) == "top_2_gram"
    # A 15-word phrase said three times in one line: its repeats are > 15% of the characters.
    phrase = prose(15, 30)[:-1]
    assert reason(f, " ".join([prose(100), phrase, prose(10, 7), phrase, prose(10, 20), phrase])) \
        == "duplicated_5_n_grams"


def _reference_top(words: list[str], n: int) -> int:
    """The published definition, with strings: most frequent n-gram's length times its count."""
    grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    top, count = Counter(grams).most_common(1)[0]
    return len(top) * count


def _reference_dup(words: list[str], n: int) -> int:
    seen, chars, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = "".join(words[i:i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def test_fast_ngram_statistics_equal_the_string_definitions():
    """One batch of 200 documents (some shorter than an n-gram) at once: each document's numbers
    are its own, as the string definitions give them."""
    rng = random.Random(0)
    batch = []
    for _ in range(200):
        vocab = WORDS[: rng.randint(3, 50)]
        batch.append([rng.choice(vocab) for _ in range(rng.randint(1, 120))])
    lookup: dict[str, int] = {}
    ids = [np.array([lookup.setdefault(w, len(lookup)) for w in words]) for words in batch]
    lengths = [np.array([len(w) for w in words]) for words in batch]
    stats = ngram_repetition(ids, lengths, 10, {5, 6, 10})
    for d, words in enumerate(batch):
        for n, (top, dup) in stats.items():
            if len(words) < n:
                assert top[d] == dup[d] == -1
                continue
            assert top[d] == _reference_top(words, n), (d, n)
            assert dup[d] == (_reference_dup(words, n) if n in (5, 6, 10) else 0), (d, n)


# --------------------------------------------------------------------------------------------
# C4: Raffel et al. 2020, section 2.2


def test_c4_keeps_five_sentences_and_rewrites_lines():
    f = C4Quality()
    doc = Doc("d", "\n".join(["Main menu", *sentences(3), "Please enable JavaScript to see the map.",
                              "This site uses cookies to work well.", "Too short.",
                              f"{sentences(4)[3][:-1]} [1][citation needed].", "And then we waited...",
                              sentences(5)[4]]))
    assert f(doc) is None
    assert doc.text == "\n".join([*sentences(3), f"{sentences(4)[3][:-1]} .", sentences(5)[4]])
    assert f.stats["lines_dropped.no_terminal_punct"] == 2  # "Main menu" and the ellipsis
    assert f.stats["lines_dropped.javascript"] == f.stats["lines_dropped.policy"] == 1
    assert f.stats["lines_dropped.too_few_words"] == 1


@pytest.mark.parametrize("lines, expected", [
    (sentences(4), "too_few_sentences"),
    (sentences(4) + ["Lorem ipsum dolor sit amet."], "lorem_ipsum"),
    (sentences(5) + ["Write x = {1, 2} in braces."], "curly_bracket"),
    (sentences(4) + ["Menu { not a sentence"], "too_few_sentences"),  # a dropped line's bracket is gone
])
def test_c4_document_rules(lines, expected):
    assert reason(C4Quality(), "\n".join(lines)) == expected


def test_sentences_are_counted_like_a_sentencizer():
    assert count_sentences("One thing. Two things! Three? Four.") == 4
    assert count_sentences("See e.g. the U.S. report by J. Smith and Mr. Jones.") == 1
    assert count_sentences("Version 3.11 is out.") == 1
    assert count_sentences("") == 0


# --------------------------------------------------------------------------------------------
# FineWeb: Penedo et al. 2024, section 3.3


def long_line(i: int, end: str = ".") -> str:
    return prose(8, 8 * i)[:-1] + end


@pytest.mark.parametrize("text, expected", [
    ("\n".join(long_line(i, "." if i == 0 else "") for i in range(10)), "line_punct_ratio"),  # 0.1 < 0.12
    ("\n".join([long_line(i) for i in range(3)] + [f"Short {w}." for w in WORDS[:7]]), "short_line_ratio"),
    ("\n".join([long_line(i) for i in range(20)] + [long_line(0)]), "char_dup_ratio"),
    ("\n".join(f"Pneumonoultramicroscopicsilicovolcanoconiosis{i}." for i in range(12)), "list_ratio"),
    ("\n".join(long_line(i, "." if i < 2 else "") for i in range(10)), None),  # 0.2 >= 0.12
])
def test_fineweb_rules(text, expected):
    assert reason(FineWebQuality(), text) == expected


# --------------------------------------------------------------------------------------------
# Blocklist and PII


def test_blocklist_matches_whole_words_and_phrases_in_any_case():
    f = Blocklist(BlocklistParams(words=["grimace", "dark arts"]))
    assert reason(f, "He made a GRIMACE at it.") == "blocklisted_word"
    assert reason(f, "They studied the Dark  Arts.".replace("  ", " ")) == "blocklisted_word"
    assert reason(f, "Grimaces are not the word; darkarts neither.") is None
    assert f.stats["dropped.blocklisted_word"] == 2


def test_pii_redaction_replaces_each_kind_and_counts_it():
    step = RedactPII()
    doc = Doc("d", "Mail jane.doe+news@mail.example.org or call +44 20 7946 0958 or (202) 555-0143. "
                   "Server 8.8.8.8 and 2606:4700:4700::1111 answered; 192.168.1.10, 10.0.0.1, ::1 and "
                   "127.0.0.1 are private. Python 3.11.2 shipped on 2023-02-08, pages 1999-2001, "
                   "ISBN 978-3-16-148410-0, order 12345678.")
    assert step(doc) is None
    assert doc.text == ("Mail email@example.com or call 555-0100 or 555-0100. "
                        "Server 192.0.2.1 and 2001:db8::1 answered; 192.168.1.10, 10.0.0.1, ::1 and "
                        "127.0.0.1 are private. Python 3.11.2 shipped on 2023-02-08, pages 1999-2001, "
                        "ISBN 978-3-16-148410-0, order 12345678.")
    assert {k: v for k, v in step.stats.items() if k.startswith("redacted.")} == {
        "redacted.email": 1, "redacted.phone": 2, "redacted.ipv4": 1, "redacted.ipv6": 1}
    assert step.stats["modified"] == 1
    redacted = doc.text
    assert step(doc) is None and doc.text == redacted  # the replacements are not PII themselves


def test_pipeline_refuses_unknown_filter_settings(tmp_path):
    config = DataPrepConfig(output_dir=str(tmp_path), filter_params={"gopher_quality": {"min_words": 3}})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['min_words'\].*min_doc_words"):
        build_pipeline(config)
    with pytest.raises(ConfigError, match=r"unknown step\(s\) \['gopher'\]"):
        build_pipeline(DataPrepConfig(output_dir=str(tmp_path), filter_params={"gopher": {}}))
    with pytest.raises(ConfigError, match="filters must name each of"):
        DataPrepConfig(output_dir=str(tmp_path), filters=["c4"])


def test_pipeline_order_and_first_drop_wins(tmp_path):
    steps = build_pipeline(DataPrepConfig(output_dir=str(tmp_path), blocklist=["harbor"]))
    assert [s.name for s in steps] == ["binary", "normalize", "min_chars", "gopher_repetition",
                                       "gopher_quality", "c4_quality", "fineweb_quality", "blocklist", "pii"]
    doc = Doc("d", "\n".join(sentences(8) + ["A boat came with the tide to the Harbor of the town."]))
    assert run_steps(steps, doc) == ("blocklist", "blocklisted_word")
    assert run_steps(steps, Doc("j", "\x00\x01\x02 binary \x03\x04")) == ("binary", "binary_junk")


# --------------------------------------------------------------------------------------------
# Deduplication


def random_word(rng: random.Random) -> str:
    # Letters only: shingles fold digits, so "w1" and "w2" would be the same word.
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))


def _corpus_with_planted_duplicates(seed: int = 0):
    """150 distinct documents (random words from a 3000-word vocabulary), then planted exact
    copies, near copies (3 of ~200 words changed: Jaccard ~0.9), and loosely related documents
    (the second half rewritten: Jaccard ~0.3) that must NOT be merged."""
    rng = random.Random(seed)
    vocab = [random_word(rng) for _ in range(3000)]
    originals = [" ".join(rng.choice(vocab) for _ in range(200)) for _ in range(150)]
    texts, truth = list(originals), {}
    for i in range(15):
        truth[len(texts)] = (i, EXACT)
        texts.append(originals[i])
    for i in range(15, 45):
        words = originals[i].split()
        for pos in rng.sample(range(len(words)), 3):
            words[pos] = rng.choice(vocab)
        truth[len(texts)] = (i, NEAR)
        texts.append(" ".join(words))
    for i in range(45, 60):
        words = originals[i].split()
        texts.append(" ".join(words[:100] + [rng.choice(vocab) for _ in range(100)]))
    return texts, truth


def test_near_dedup_recall_and_precision_on_planted_duplicates():
    texts, truth = _corpus_with_planted_duplicates()
    hasher = MinHasher()  # 5-grams, 14 bands x 8 rows
    duplicate_of, kind, stats = find_duplicates(
        hashes_to_array([content_hash(t) for t in texts]), np.stack([hasher.band_keys(t) for t in texts]))
    flagged = {i for i in range(len(texts)) if kind[i]}
    true_positives = {i for i in flagged if i in truth and truth[i] == (duplicate_of[i], kind[i])}
    recall, precision = len(true_positives) / len(truth), len(true_positives) / max(1, len(flagged))
    assert recall >= 0.95 and precision == 1.0, (recall, precision)
    assert stats["exact_duplicates"] == 15
    # Exact copies are always found, whatever the LSH draws.
    assert all(kind[i] == EXACT for i, (_, k) in truth.items() if k == EXACT)


def test_near_dedup_keeps_the_earliest_of_a_chain():
    """A ~ B and B ~ C (but A and C less alike): union-find puts all three in one cluster, and
    the earliest document stands for it."""
    rng = random.Random(1)
    base = [random_word(rng) for _ in range(300)]
    b = base[:]
    for pos in range(0, 300, 50):
        b[pos] = "changed"
    c = b[:]
    for pos in range(25, 300, 50):
        c[pos] = "altered"
    texts = [" ".join(words) for words in (["u"] * 10, base, b, c)]
    hasher = MinHasher(bands=20, rows=5)
    duplicate_of, kind, _ = find_duplicates(hashes_to_array([content_hash(t) for t in texts]),
                                            np.stack([hasher.band_keys(t) for t in texts]))
    assert kind.tolist() == [0, 0, NEAR, NEAR] and duplicate_of.tolist() == [-1, -1, 1, 1]


def test_minhash_is_deterministic_and_ignores_case_digits_and_punctuation():
    a, b = MinHasher(seed=3), MinHasher(seed=3)
    text = "The Quick brown fox, born in 1999, jumps over the lazy dog near the river bank."
    assert (a.band_keys(text) == b.band_keys(text)).all()
    assert (a.band_keys(text) == a.band_keys(text.lower().replace(",", "").replace("1999", "2001"))).all()
    assert (a.band_keys("too short to shingle") == 0).all()
    sets = UnionFind(5)
    sets.union(3, 4)
    sets.union(4, 1)
    assert sets.roots().tolist() == [0, 1, 2, 1, 1]


def test_minhash_of_new_words_while_the_word_table_grows():
    """Shingling words the process's word table has never seen makes it grow its arrays: the
    hashes are read from the grown ones (a 48 MB benchmark run failed with an IndexError when
    the growth fell inside a shingling call)."""
    from tasks.data.text import TABLE

    known = len(TABLE.ids)
    TABLE.kind, TABLE.length, TABLE.hash = (a[:known].copy() for a in (TABLE.kind, TABLE.length, TABLE.hash))
    text = " ".join(f"neverseen{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(60))
    keys = MinHasher(seed=3).band_keys(text)
    assert len(TABLE.hash) > known and (keys == MinHasher(seed=3).band_keys(text)).all()


def test_split_words_approximates_a_word_tokenizer():
    assert split_words("Don't stop: U.S. costs $3.14 (or 1,000 yen)... well-known, isn't it?") == [
        "Do", "n't", "stop", ":", "U.S.", "costs", "$", "3.14", "(", "or", "1,000", "yen", ")", "...",
        "well", "-", "known", ",", "is", "n't", "it", "?"]
    assert split_words("See https://example.com/a?b=1. It's Jane's.") == [
        "See", "https://example.com/a?b=1", ".", "It", "'s", "Jane", "'s", "."]


def test_names_from_code_stay_one_word_but_a_unit_after_a_digit_splits():
    # as spaCy's English tokenizer splits them (the fast path for names must not swallow "5km")
    assert split_words("run_id: float64 x5km x_5km a5_b (index_array), _private ``task_id``. S3. 5MB") == [
        "run_id", ":", "float64", "x5", "km", "x_5", "km", "a5_b", "(", "index_array", ")", ",", "_", "private",
        "`", "`", "task_id", "`", "`", ".", "S3", ".", "5", "MB"]


def test_the_suffix_guard_never_hides_a_suffix_the_rules_would_split_off():
    """_split_chunk asks its suffix rules (a long alternation, searched at the chunk's last 12
    positions) only of chunks whose last character can end a suffix; a chunk the guard passes
    over must have no suffix match at all. Every listed mark, quote, currency, unit and icon,
    after every kind of character the rules look behind at."""
    from tasks.data import text

    ends = [*text._PUNCT, *text._QUOTES, *(c.replace("\\", "") for c in text._CURRENCY), *text._UNITS,
            "'s", "’S", "...", "……", "—", "–", "+", ".", "¦", "©", "°", "→", "⌘", "■", "⭐", "🙂", "x", "Z", "é"]
    before = ["", "a", "Z", "ab", "AB", "5", "x5", "°F", "°c", "%", "²", "-", ")", "'", "”"]
    checked = 0
    for end in ends:
        for lead in before:
            chunk = f"w{lead}{end}"
            if text._SUFFIX.search(chunk, max(0, len(chunk) - 12)) is not None:
                assert text._may_end_in_suffix(chunk), chunk
                checked += 1
    assert checked > 500  # the rules matched (the guard was asked) in most of these
    assert not text._may_end_in_suffix("pip._vendor.rich.panel")  # and it spares the plain ones


def test_symbols_are_punctuation_of_any_script_and_menu_marks():
    from tasks.data.text import is_symbol

    assert all(map(is_symbol, ["...", "»", "¿", "。", "、", "•", "→", "—", "#", "\x07"]))
    assert not any(map(is_symbol, ["a", "5", "€5", "…a", "a.", "😀", "中"]))


def test_word_ids_of_a_batch_are_each_texts_words_even_when_the_tables_start_over(monkeypatch):
    """encode_texts gives each text the ids of split_words(text), in one batch: texts with no
    words, new and known chunks, and the chunk and token tables starting over in mid-stream (made
    tiny here) while earlier texts' ids were handed out."""
    import tasks.data.text as text

    rng = random.Random(1)
    pieces = [*WORDS, "(x)", "well-known,", "U.S.", "$3.14", "isn't", "run_id:", "a.b", "``x``.", "…"]
    texts = ["", "   \n "] + [" ".join(rng.choice(pieces) + rng.choice(["", "", str(rng.randint(0, 99))])
                                   for _ in range(rng.randint(1, 60))) for _ in range(300)]
    for max_chunks, max_tokens in [(1 << 18, 4_000_000), (40, 4_000_000), (1 << 18, 30), (25, 30)]:
        monkeypatch.setattr(text, "MAX_MEMO_CHUNKS", max_chunks)
        table = text.WordTable()
        table.MAX_TOKENS = max_tokens
        for start in range(0, len(texts), 37):
            batch = texts[start:start + 37]
            generation = table.generation
            ids = table.encode_texts(batch)
            names = {i: w for w, i in table.ids.items()}
            assert len(ids) == len(batch)
            for one, ids_of_one in zip(batch, ids):
                assert [names[i] for i in ids_of_one.tolist()] == split_words(one), (max_chunks, max_tokens)
            if max_tokens == 30:
                assert table.generation > generation or start == 0
        assert table.encode_texts([]) == []
        assert table.encode_texts(["a (b) a"])[0].tolist() == table.encode(["a", "(", "b", ")", "a"]).tolist()


def test_a_batch_of_documents_gets_ids_of_one_table_when_it_starts_over(monkeypatch):
    """A document encoded before the process's word table started over is encoded again with
    the rest of its batch: the filters read every document's ids against the same table."""
    from tasks.data.steps import word_ids_of
    from tasks.data.text import TABLE

    early = Doc(id="a", text="alpha beta (gamma)")
    early.word_ids  # ids of the table as it is now
    monkeypatch.setattr(TABLE, "MAX_TOKENS", len(TABLE.ids) + 20)
    late = Doc(id="b", text=" ".join(f"new{i}word" for i in range(40)))
    generation = TABLE.generation
    ids = word_ids_of([early, late])
    assert TABLE.generation > generation
    names = {i: w for w, i in TABLE.ids.items()}
    assert [[names[i] for i in x.tolist()] for x in ids] == [split_words(early.text), split_words(late.text)]
