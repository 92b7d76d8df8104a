"""PII redaction: email addresses, public IPv4 and IPv6 addresses and phone numbers.

Each is replaced by a value reserved for documentation (example.com, RFC 5737 and RFC 3849
addresses, the fictional 555-01xx phone range), so the text still reads naturally and a model
trained on it learns the format but no one's data. Private and loopback addresses (192.168.x.x,
10.x, ::1) are not personal and are kept, as in FineWeb. Counts per kind go to the step's stats.

Phone numbers are found by Google's libphonenumber (the `phonenumbers` port), in national notation
for each of `regions` and in international notation (+CC or 00CC) from anywhere, with spaces,
dots, dashes and parentheses. It is slow next to a regex, so a cheap pattern first finds the spans
that could hold one (a digit run with enough digits, phone punctuation allowed), and only those are
parsed. `STRICT_GROUPING` accepts a number only when its digits are grouped the way the region
writes them: that keeps ISBNs, dates and other grouped digit runs that happen to be valid numbers.
An unbroken run of digits without a + is left alone: as likely an order number or an id.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from tasks.configs import ConfigError
from tasks.data.steps import Doc, Formatter

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+"
                   r"[A-Za-z]{2,}(?![\w-])")
IPV4 = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}"
                  r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)(?!\w)")
# Candidates only; ipaddress decides what is a real address.
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?"
                  r"(?![\w:])")
# Where a phone number could be: a digit run with phone punctuation inside, not part of a word or
# a longer number. Digits are counted per span before the (slow) matcher sees it.
PHONE_CANDIDATE = re.compile(r"(?<![\w+.\-/])[+(]?\d[\d ().\-/]*\d\)?(?![\w\-/])")
# 0.123456789 parses as a French number; no one writes a phone number with one decimal point.
DECIMAL = re.compile(r"\d+[.,]\d+")

EMAIL_REPLACEMENT = "email@example.com"
IPV4_REPLACEMENT = "192.0.2.1"
IPV6_REPLACEMENT = "2001:db8::1"
PHONE_REPLACEMENT = "555-0100"


def _is_public_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_global
    except ValueError:
        return False


@dataclass(kw_only=True)
class PIIParams:
    emails: bool = True
    ip_addresses: bool = True
    phone_numbers: bool = True
    min_phone_digits: int = 9  # fewer digits is more likely a date range or an identifier
    max_phone_digits: int = 17  # E.164's 15 plus a written trunk prefix: +49 (0)30 ...
    # Regions whose national notation counts (ISO 3166 codes); +CC numbers count from anywhere.
    phone_regions: list = field(default_factory=lambda: ["US", "GB", "DE", "FR", "IN"])

    def __post_init__(self) -> None:
        import phonenumbers

        unknown = sorted(set(self.phone_regions) - phonenumbers.SUPPORTED_REGIONS)
        if unknown:
            raise ConfigError(f"DataPrepConfig.filter_params['pii'].phone_regions: unknown region "
                              f"code(s) {unknown}; use ISO 3166 two-letter codes such as 'US', 'GB', "
                              "'DE', 'FR', 'IN'.")


class RedactPII(Formatter):
    name = "pii"
    Params = PIIParams

    def format(self, doc: Doc) -> str:
        p, text = self.params, doc.text
        if p.emails and "@" in text:
            text, n = EMAIL.subn(EMAIL_REPLACEMENT, text)
            self.stats["redacted.email"] += n
        if p.ip_addresses and "." in text:
            text = IPV4.sub(lambda m: self._replace(m, "ipv4", IPV4_REPLACEMENT), text)
        if p.ip_addresses and ("::" in text or text.count(":") >= 7):
            text = IPV6.sub(lambda m: self._replace(m, "ipv6", IPV6_REPLACEMENT), text)
        if p.phone_numbers:
            text = self._redact_phones(text)
        return text

    def _replace(self, match: re.Match, kind: str, replacement: str) -> str:
        if not _is_public_ip(match.group(0)):
            return match.group(0)
        self.stats[f"redacted.{kind}"] += 1
        return replacement

    def _redact_phones(self, text: str) -> str:
        spans = [(m.start(), m.group(0)) for m in PHONE_CANDIDATE.finditer(text)
                 if self.params.min_phone_digits <= _digits(m.group(0))]
        if not spans:
            return text
        found = [(start + a, start + b) for start, span in spans for a, b in self._phones_in(span)]
        if not found:
            return text
        out, end = [], 0
        for a, b in sorted(found):
            if a < end:  # one number matched in two regions, or overlapping readings
                continue
            out += [text[end:a], PHONE_REPLACEMENT]
            end = b
            self.stats["redacted.phone"] += 1
        return "".join(out) + text[end:]

    def _phones_in(self, span: str) -> list[tuple[int, int]]:
        """(start, end) of each phone number in `span`, in any of the regions' notations."""
        from phonenumbers import Leniency, PhoneNumberMatcher

        p = self.params
        # An international number reads the same from every region: one pass is enough.
        regions = p.phone_regions[:1] if span.startswith("+") else p.phone_regions
        found = set()
        for region in regions:
            for match in PhoneNumberMatcher(span, region, leniency=Leniency.STRICT_GROUPING):
                raw = match.raw_string
                if (raw.isdigit() or DECIMAL.fullmatch(raw)
                        or not p.min_phone_digits <= _digits(raw) <= p.max_phone_digits):
                    continue
                found.add((match.start, match.end))
        return sorted(found)


def _digits(text: str) -> int:
    return sum(ch.isdigit() for ch in text)
