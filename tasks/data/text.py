"""Text primitives the filters share: word splitting, sentence counting, punctuation classes.

The published filters (Gopher, C4, FineWeb) are defined over *words* and *sentences* as a
tokenizer sees them; datatrove uses spaCy's English tokenizer and sentencizer. split_words and
count_sentences apply the same rules (below), without spaCy: on the benchmark corpus 99% of
documents split into exactly the same tokens, several times faster. Every filter reads the same
cached word list of a document (`Doc.words`), so a document is split once, not once per filter.
"""

from __future__ import annotations

import hashlib
import re
from itertools import chain
import string
import unicodedata

import numpy as np

# spaCy's English tokenizer, the one datatrove's filters count words with, works per whitespace-
# separated chunk: special cases (contractions, abbreviations, emoticons) stay as listed; else
# punctuation, quotes and currency signs are peeled off the front, punctuation, quotes and a few
# conditional marks off the back, and what is left is split only at a few infixes (a hyphen or
# comma between letters, "/" or ":" before a letter, a period between lower and upper case).
# These are the same rules, written from its documented character classes.
_PUNCT = "… , : ; ! ? ¿ ؟ ¡ ( ) [ ] { } < > _ # * & 。 ？ ！ ， 、 ； ： ～ · । ، ۔ ؛ ٪".split()
_QUOTES = "' \" ” “ ` ‘ ´ ’ ‚ , „ » « 「 」 『 』 （ ） 〔 〕 【 】 《 》 〈 〉 ⟦ ⟧".split()
_CURRENCY = r"\$ £ € ¥ ฿ US\$ C\$ A\$ ₽ ﷼ ₴ ₡ ₢ ₣ ₤ ₥ ₦ ₧ ₨ ₩ ₪ ₫ ₭ ₮ ₯ ₰ ₱ ₲ ₳ ₵ ₶ ₷ ₸ ₹ ₺ ₻ ₼ ₾ ₿".split()
_UNITS = ("km km² km³ m m² m³ dm cm cm² mm ha µm nm yd in ft kg g mg µg t lb oz m/s km/h kmh mph "
          "hPa Pa mbar mb MB kb KB gb GB tb TB T G M K %").split()
_ICONS = "\u00a6\u00a9\u00ae\u00b0\u2100-\u214f\u2190-\u21ff\u2300-\u23ff\u2500-\u27bf\u2b00-\u2bff\U0001f300-\U0001faff"
_LOWER, _UPPER = "a-zß-öø-ÿ", "A-ZÀ-ÖØ-Þ"
_ALPHA = _LOWER + _UPPER
_Q = "'\"”“`‘´’‚,„»«"  # quotes, as the period rules use them
_PUNCT_CLASS = "".join(re.escape(c) for c in "".join(_PUNCT))
_alts = lambda items: "|".join(items)  # noqa: E731

_PREFIX = re.compile("^(?:" + _alts(["§", "%", "=", "—", "–", r"\+(?![0-9])", r"\.\.+", "……",
                                     *map(re.escape, _PUNCT + _QUOTES), *_CURRENCY, f"[{_ICONS}]"]) + ")")
_SUFFIX = re.compile(_alts([f"(?:{x})$" for x in [
    r"\.\.+", "……", *map(re.escape, _PUNCT + _QUOTES), f"[{_ICONS}]", "'s", "'S", "’s", "’S", "—", "–",
    r"(?<=[0-9])\+", r"(?<=°[FfCcKk])\.", rf"(?<=[0-9])(?:{_alts(_CURRENCY)})",
    rf"(?<=[0-9])(?:{_alts(map(re.escape, _UNITS))})",
    rf"(?<=[0-9{_LOWER}%²\-+{_PUNCT_CLASS}{re.escape(_Q)}])\.", rf"(?<=[{_UPPER}][{_UPPER}])\."]]))
_INFIX = re.compile(_alts([r"\.\.+", "…", f"[{_ICONS}]", r"(?<=[0-9])[+\-*^](?=[0-9-])",
                           rf"(?<=[{_LOWER}{re.escape(_Q)}])\.(?=[{_UPPER}{re.escape(_Q)}])",
                           rf"(?<=[{_ALPHA}]),(?=[{_ALPHA}])",
                           rf"(?<=[{_ALPHA}0-9])(?:-|–|—|--|---|——|~)(?=[{_ALPHA}])",
                           rf"(?<=[{_ALPHA}0-9])[:<>=/](?=[{_ALPHA}])"]))
# What every _SUFFIX match ends in (the guard that spares most chunks its search): the last
# character of a mark, a quote, "'s", a dash, "+", "." or an icon; or of a unit or a currency sign,
# which the rules split off only after a digit.
_SUFFIX_LAST = frozenset(".…+sS—–" + "".join(x[-1] for x in _PUNCT + _QUOTES))
_AFTER_DIGIT_LAST = frozenset(x.replace("\\", "")[-1] for x in _CURRENCY + _UNITS)
_ICON = re.compile(f"[{_ICONS}]")
_DIGIT = re.compile("[0-9]")


def _may_end_in_suffix(chunk: str) -> bool:
    last = chunk[-1]
    return last in _SUFFIX_LAST or (last in _AFTER_DIGIT_LAST and _DIGIT.search(chunk) is not None) \
        or _ICON.match(last) is not None


_URL = re.compile(r"^(?:[a-zA-Z][a-zA-Z+.-]*://|www\.)\S+$")
_NOT = re.compile(r"^(\w+)([nN]['’][tT])$")
_CLITIC = re.compile(r"^(\w+)(['’](?:[mMdD]|re|RE|ve|VE|ll|LL))$")


def _special_cases() -> dict[str, list[str]]:
    special: dict[str, list[str]] = {
        "cannot": ["can", "not"], "Cannot": ["Can", "not"], "and/or": ["and/or"],
        "gonna": ["gon", "na"], "gotta": ["got", "ta"], "'cause": ["'cause"],
    }
    for word in ("dont doesnt didnt isnt arent wasnt werent hasnt havent hadnt couldnt wouldnt "
                 "shouldnt mustnt neednt aint wont cant").split():
        for orth in (word, word.capitalize()):
            special[orth] = [orth[:-2] if not orth.lower() in ("wont", "cant") else orth[:2], "nt"]
    for abbreviation in ("Mr. Mrs. Ms. Dr. Jr. Sr. St. Mt. vs. Inc. Ltd. Co. Corp. Bros. e.g. i.e. "
                         "a.m. p.m. U.S. U.K. Jan. Feb. Mar. Apr. Jun. Jul. Aug. Sep. Sept. Oct. "
                         "Nov. Dec. Gov. Sen. Rep. Rev. Gen. Prof. Ph.D. vs. v. Mich. Calif. "
                         "E.g. I.e.").split():
        special[abbreviation] = [abbreviation]
    # Pronoun contractions written without the apostrophe; the ones that are also words
    # ("its", "well", "shell", "ill", "wed") are left alone.
    for word in ("im:i,m id:i,d ive:i,ve youre:you,re youd:you,d youll:you,ll youve:you,ve hes:he,s "
                 "hed:he,d shes:she,s theyre:they,re theyd:they,d theyll:they,ll theyve:they,ve "
                 "weve:we,ve whats:what,s").split():
        orth, parts = word.split(":")
        special[orth] = parts.split(",")
        special[orth.capitalize()] = [parts.split(",")[0].capitalize(), *parts.split(",")[1:]]
    special["Im"] = ["I", "m"]
    special["Id"] = ["I", "d"]
    for letter in "abcdefghijklmnopqrstuvwxyz":
        special[letter + "."] = [letter + "."]
        special[letter.upper() + "."] = [letter.upper() + "."]
    for emoticon in (":) :-) :)) (: (-: =) (= :] :-] [: =] :( :-( ): )-: :[ :-[ ]: :/ :-/ :| :-| "
                     ":P :-P :p :-p :D :-D ;) ;-) :* :-* :o :O <3 </3 :'( :') ^_^ -_- o.O O.o "
                     "xD XD ;( :/ =( =/").split():
        special[emoticon] = [emoticon]
    return special


_SPECIAL = _special_cases()


def _split_chunk(chunk: str) -> list[str]:
    """One whitespace chunk that is neither a special case nor a plain word."""
    special = _SPECIAL
    prefixes: list[str] = []
    suffixes: list[str] = []
    last = -1
    while chunk and len(chunk) != last and chunk not in special:
        last = len(chunk)
        pre = _PREFIX.match(chunk)
        pre_len = pre.end() if pre else 0
        if pre_len and chunk[pre_len:] in special:
            prefixes.append(chunk[:pre_len])
            chunk = chunk[pre_len:]
            break
        # Suffixes are short: search only the tail (lookbehinds still see the whole chunk).
        suf = _SUFFIX.search(chunk, max(pre_len, len(chunk) - 12)) if _may_end_in_suffix(chunk) else None
        suf_len = len(suf.group()) if suf else 0
        if suf_len and chunk[:-suf_len] in special:
            suffixes.append(chunk[-suf_len:])
            chunk = chunk[:-suf_len]
            break
        if pre_len and suf_len and pre_len + suf_len <= len(chunk):
            prefixes.append(chunk[:pre_len])
            suffixes.append(chunk[-suf_len:])
            chunk = chunk[pre_len:-suf_len]
        elif pre_len:
            prefixes.append(chunk[:pre_len])
            chunk = chunk[pre_len:]
        elif suf_len:
            suffixes.append(chunk[-suf_len:])
            chunk = chunk[:-suf_len]
    tokens = prefixes
    if chunk in special:
        tokens.extend(special[chunk])
    elif _URL.match(chunk):
        tokens.append(chunk)
    elif (m := _NOT.match(chunk) or _CLITIC.match(chunk)) is not None:
        tokens.extend(m.groups())
    elif chunk:
        start = 0
        for m in _INFIX.finditer(chunk):
            if m.start() > start:
                tokens.append(chunk[start:m.start()])
            tokens.append(m.group())
            start = m.end()
        if start < len(chunk):
            tokens.append(chunk[start:])
    tokens.extend(reversed(suffixes))
    return tokens


# Punctuation-only special cases that spaCy re-forms from pieces after splitting ("):", "''").
_MERGE = {e for e in _SPECIAL if not any(c.isalnum() for c in e)} | {"''"}
_MERGE_RE = re.compile("|".join(map(re.escape, sorted(_MERGE, key=len, reverse=True))))
_ALWAYS_SUFFIX = frozenset(c for c in _PUNCT + _QUOTES if len(c) == 1)
_ALWAYS_PREFIX = _ALWAYS_SUFFIX | frozenset("§%=—–$£€¥")


def _merge_specials(tokens: list[str]) -> list[str]:
    i, out = 0, []
    while i < len(tokens):
        for width in (3, 2):
            if i + width <= len(tokens) and "".join(tokens[i:i + width]) in _MERGE:
                out.append("".join(tokens[i:i + width]))
                i += width
                break
        else:
            out.append(tokens[i])
            i += 1
    return out


_CHUNK_TOKENS: dict[str, tuple[str, ...]] = {}  # chunk -> its tokens, memoized per process
MAX_MEMO_CHUNKS = 1 << 18  # per memo, ~40 MB; then start over


def split_words(text: str) -> list[str]:
    """Words and punctuation tokens, in order, as spaCy's English tokenizer splits them.

    spaCy splits each whitespace-separated chunk on its own, so a chunk's tokens are memoized:
    word frequencies are Zipfian, and after the first documents nearly every chunk is known and
    splitting a text is a dictionary lookup per chunk."""
    memo = _CHUNK_TOKENS
    chunks = text.split()
    try:
        parts = list(map(memo.__getitem__, chunks))
    except KeyError:
        parts = _memo_tokens(chunks)
    return list(chain.from_iterable(parts))


def _memo_tokens(chunks: list[str]) -> list[tuple[str, ...]]:
    """Each chunk's tokens, through split_words's memo: the per-line filters split the lines of a
    text whose chunks WordTable.encode_texts has just split, so each chunk is split once."""
    memo = _CHUNK_TOKENS
    if len(memo) + len(chunks) > MAX_MEMO_CHUNKS:
        memo.clear()
    out = []
    for chunk in chunks:
        tokens = memo.get(chunk)
        if tokens is None:
            tokens = memo[chunk] = tuple(_chunk_tokens(chunk))
        out.append(tokens)
    return out


def _unsplit(word: str) -> bool:
    """True for a word no rule splits: letters only; or, in ASCII, a name from code ("run_id",
    "float64") of letters, digits and underscores, starting with a letter and ending in a letter
    or digit. A digit before a final letter is left to the rules: "5km" splits as a unit."""
    if word.isalpha():
        return True
    return (word.isascii() and word[:1].isalpha() and word[-1] != "_" and word.replace("_", "").isalnum()
            and (word[-1].isdigit() or not any(c.isdigit() for c in word)))


def _chunk_tokens(chunk: str) -> list[str]:
    """The tokens of one whitespace-separated chunk."""
    special = _SPECIAL
    if chunk in special:
        return special[chunk]
    if chunk.isdigit() or _unsplit(chunk):  # most chunks: one plain word, or a plain number
        return [chunk]
    last = chunk[-1]
    if last in _ALWAYS_SUFFIX:  # "word," "word)": the next most common shape
        word = chunk[:-1]
        if _unsplit(word):
            return [*special.get(word, (word,)), last]
    # Next most common: a word inside marks that always split off ("(word", "word)," '"word".'),
    # maybe hyphenated; settled here by the same rules, without the regular expressions.
    i, j = 0, len(chunk)
    while i < j and chunk[i] in _ALWAYS_PREFIX:
        i += 1
    while j > i:
        last = chunk[j - 1]
        if last in _ALWAYS_SUFFIX:
            j -= 1
        elif last == "." and j - 1 > i and (chunk[j - 2] in _ALWAYS_SUFFIX or chunk[j - 2].islower() or (
                j - 2 > i and chunk[j - 2].isupper() and chunk[j - 3].isupper())):
            j -= 1
        else:
            break
    core = chunk[i:j]
    # (Unless a special case hides inside: "(Mr." keeps "Mr.", "(:)" is a smiley.)
    if core and _MERGE_RE.search(chunk) is None and not (chunk[j:j + 1] == "." and core + "." in special):
        if _unsplit(core):
            return [*chunk[:i], *special.get(core, (core,)), *chunk[j:]]
        if "-" in core and core[0] != "-" and core[-1] != "-" and "--" not in core \
                and core.replace("-", "").isalpha():  # well-known: a hyphen between letters splits
            out = list(chunk[:i])
            for k, part in enumerate(core.split("-")):
                out.extend(("-", part) if k else (part,))
            out.extend(chunk[j:])
            return out
    tokens = _split_chunk(chunk)
    return _merge_specials(tokens) if len(tokens) > 1 and _MERGE_RE.search(chunk) else tokens


# Symbols besides Unicode punctuation (category P*): ASCII punctuation and symbols, control
# characters, and the arrows and box-drawing marks that menus and bullet lists are made of.
_SYMBOL_CHARS = frozenset(string.punctuation) | {chr(c) for c in [*range(0, 32), *range(127, 160)]} \
    | frozenset("►▶◄◀•·━─│※→←↑↓")


def is_symbol_char(ch: str) -> bool:
    """What counts as a symbol, not a word: _SYMBOL_CHARS, and every Unicode punctuation character
    of the BMP and plane 1 (they hold every punctuation mark in use). Asked per character: a set of
    them all costs each process a pass over 131,072 code points (~40 ms), and only the few tokens
    that do not start with a letter or digit ask."""
    return ch in _SYMBOL_CHARS or (ord(ch) < 0x20000 and unicodedata.category(ch)[0] == "P")


# Characters that end a sentence in the scripts the filters are meant for (Unicode's
# Sentence_Terminal property, common subset): what FineWeb's "line ends in punctuation" checks.
TERMINAL_PUNCTUATION = tuple(
    ".!?։؟۔܀܁܂।॥။።፧፨᙮᠃᠉‼‽⁇⁈⁉⸮⸼。꓿꘎꘏꛳꛷﹒﹖﹗！．？｡")

_SENTENCE_END_TOKENS = frozenset(TERMINAL_PUNCTUATION)


def _is_punct(token: str) -> bool:
    return not token[0].isalnum() and all(unicodedata.category(c)[0] == "P" for c in token)


def count_sentences(line: str, tokens: list[str] | None = None) -> int:
    """Sentences in one line of text, as spaCy's rule-based sentencizer finds them: a sentence
    ends after a token that is a sentence-final mark, once a token that is not punctuation
    follows. So "e.g." (one token) and "..." (not a final mark) end nothing. 0 for a blank line.
    `tokens`, when given, are split_words(line), already computed."""
    tokens = split_words(line) if tokens is None else tokens
    if not tokens:
        return 0
    sentences, seen_end = 1, False
    for token in tokens:
        if token in _SENTENCE_END_TOKENS:
            seen_end = True
        elif seen_end and not _is_punct(token):
            sentences += 1
            seen_end = False
    return sentences


# Line breaks other than "\n" that str.splitlines() honours; normalized text has none of them.
_OTHER_LINE_BREAKS = re.compile("[\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")


def split_lines(text: str) -> list[str]:
    """text.splitlines(), faster when the only line break is "\n"."""
    if _OTHER_LINE_BREAKS.search(text):
        return text.splitlines()
    lines = text.split("\n")
    if lines[-1] == "":  # splitlines() drops the empty string after a final newline
        lines.pop()
    return lines


_HAS_ALPHA = re.compile(r"[^\W\d_]")


class WordTable:
    """Interned tokens of this process: an id per distinct token, and per id its length, its
    class (symbol, word without a letter, word with a letter) and a stable 64-bit hash. Filters
    then work on numpy arrays of ids instead of calling Python functions per word; word
    frequencies are Zipfian, so after the first documents nearly every token is already known."""

    SYMBOL, NO_ALPHA, ALPHA = 0, 1, 2
    MAX_TOKENS = 4_000_000  # then start over: ids only need to be consistent within a document

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.generation = getattr(self, "generation", -1) + 1  # ids of an older one mean nothing
        self.ids: dict[str, int] = {}
        self.kind = np.zeros(1 << 16, dtype=np.int8)
        self.length = np.zeros(1 << 16, dtype=np.int64)
        self.hash = np.zeros(1 << 16, dtype=np.uint64)
        self._reset_chunks()

    def _reset_chunks(self) -> None:
        # The chunk table: each whitespace chunk seen gets a row, the row its tokens' ids (a run
        # of chunk_tokens), so a batch of texts becomes ids with one dictionary lookup per chunk
        # and a few numpy operations for the whole batch.
        self.chunk_rows: dict[str, int] = {}
        self.chunk_start = np.zeros(1 << 16, dtype=np.int64)
        self.chunk_size = np.zeros(1 << 16, dtype=np.int64)
        self.chunk_tokens = np.zeros(1 << 16, dtype=np.int64)
        self._chunk_tokens_used = 0

    def encode(self, words: list[str]) -> np.ndarray:
        ids = self.ids
        missing = set(words).difference(ids)
        if missing:
            if len(ids) + len(missing) > self.MAX_TOKENS:
                self._reset()
                ids, missing = self.ids, set(words)
            start, end, new = len(ids), len(ids) + len(missing), list(missing)
            self.kind, self.length, self.hash = (_with_room(a, end, start)
                                                 for a in (self.kind, self.length, self.hash))
            ids.update(zip(new, range(start, end)))
            self.length[start:end] = np.fromiter(map(len, new), dtype=np.int64, count=len(new))
            self.kind[start:end] = [self.SYMBOL if is_symbol(word) else self.ALPHA if has_alpha(word)
                                    else self.NO_ALPHA for word in new]
            # Each word's 8-byte BLAKE2b digest, read as a little-endian integer (as before).
            self.hash[start:end] = np.frombuffer(b"".join(
                [hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest() for word in new]), dtype="<u8")
        return np.fromiter(map(ids.__getitem__, words), dtype=np.int64, count=len(words))

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """[encode(split_words(text)) for text in texts], without any list of words: each
        whitespace chunk of the batch is looked up in the chunk table (the chunks never seen
        before are split first, all of the batch's at once), and the table's runs of token ids
        are gathered for the whole batch in one go."""
        if not texts:
            return []
        splits = [text.split() for text in texts]
        chunks = list(chain.from_iterable(splits))
        try:
            rows = np.fromiter(map(self.chunk_rows.__getitem__, chunks), dtype=np.int64, count=len(chunks))
        except KeyError:
            self._add_chunks(chunks)
            rows = np.fromiter(map(self.chunk_rows.__getitem__, chunks), dtype=np.int64, count=len(chunks))
        sizes = self.chunk_size[rows]
        ends = np.cumsum(sizes)  # where each chunk's tokens end in the batch's ids
        at = np.repeat(self.chunk_start[rows] - (ends - sizes), sizes) + np.arange(ends[-1] if len(ends) else 0)
        text_ends = np.concatenate(([0], ends))[np.cumsum([len(split) for split in splits])]
        return np.split(self.chunk_tokens[at], text_ends[:-1])

    def _add_chunks(self, chunks: list[str]) -> None:
        """Rows for the chunks not in the table yet (split through split_words's memo)."""
        while True:
            generation, rows = self.generation, self.chunk_rows
            missing = list(set(chunks).difference(rows))
            if len(rows) + len(missing) > MAX_MEMO_CHUNKS:  # start over, with this batch's
                self._reset_chunks()
                rows, missing = self.chunk_rows, list(set(chunks))
            fresh = not rows
            tokens = _memo_tokens(missing)
            ids = self.encode(list(chain.from_iterable(tokens)))
            if self.generation == generation or fresh:
                break
            # The token table started over (and with it the chunk table) while the rows already
            # there were left out of `missing`: the batch again, into the empty chunk table.
        rows = self.chunk_rows  # (a new one if the token table started over in encode)
        first, used = len(rows), self._chunk_tokens_used
        sizes = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        self.chunk_start, self.chunk_size = (_with_room(a, first + len(missing), first)
                                             for a in (self.chunk_start, self.chunk_size))
        self.chunk_tokens = _with_room(self.chunk_tokens, used + len(ids), used)
        self.chunk_start[first:first + len(missing)] = used + np.cumsum(sizes) - sizes
        self.chunk_size[first:first + len(missing)] = sizes
        self.chunk_tokens[used:used + len(ids)] = ids
        self._chunk_tokens_used = used + len(ids)
        rows.update(zip(missing, range(first, first + len(missing))))


def _with_room(array: np.ndarray, need: int, keep: int) -> np.ndarray:
    """`array` if it holds `need` items, else a zeroed one of twice its size (at least `need`)
    holding its first `keep` items."""
    if need <= len(array):
        return array
    grown = np.zeros(max(2 * len(array), need), dtype=array.dtype)
    grown[:keep] = array[:keep]
    return grown


TABLE = WordTable()  # one per process (each Ray worker has its own)


def has_alpha(word: str) -> bool:
    return word.isalpha() or _HAS_ALPHA.search(word) is not None


def is_symbol(word: str) -> bool:
    """True when every character of the token is punctuation (a "symbol", not a word)."""
    if word[:1].isalnum():  # words from split_words start with a letter or digit
        return False
    return all(map(is_symbol_char, word))


# For near-duplicate shingles: lowercase, numbers folded, punctuation dropped, accents stripped,
# so trivial edits (a changed date, a comma, an accent) do not hide a copy.
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NOT_WORD = re.compile(r"[^\w\s]|_")
_COMBINING = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")


# The same two rules for ASCII text as one byte translation: lowercase, and every character
# _NOT_WORD matches (not a letter, digit or space; or "_") becomes a space.
_ASCII_SIMPLE = bytes(ord(" ") if c == "_" or not (c.isalnum() or c.isspace()) else ord(c.lower())
                      for c in map(chr, range(128))) + bytes(range(128, 256))


def simplify_for_shingles(text: str) -> list[str]:
    """The words near-duplicate detection compares."""
    if text.isascii():  # numbers first: "3.14" folds to "0" before its "." would split it
        return _NUMBER.sub("0", text).encode("ascii").translate(_ASCII_SIMPLE).decode("ascii").split()
    text = _NOT_WORD.sub(" ", _NUMBER.sub("0", text.lower()))
    if not text.isascii():
        text = _COMBINING.sub("", unicodedata.normalize("NFD", text))
    return text.split()
