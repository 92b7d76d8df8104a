"""PII redaction: email addresses, public IPv4 and IPv6 addresses and phone numbers.

Each is replaced by a value reserved for documentation (example.com, RFC 5737 and RFC 3849
addresses, the fictional 555-01xx phone range), so the text still reads naturally and a model
trained on it learns the format but no one's data. Private and loopback addresses (192.168.x.x,
10.x, ::1) are not personal and are kept, as in FineWeb. Counts per kind go to the step's stats.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from tasks.data.steps import Doc, Formatter

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+"
                   r"[A-Za-z]{2,}(?![\w-])")
IPV4 = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}"
                  r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)(?!\w)")
# Candidates only; ipaddress decides what is a real address.
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?"
                  r"(?![\w:])")
PHONE = re.compile(
    r"(?<![\w+])(?:"
    # international: +CC then groups, e.g. +44 20 7946 0958, +1-202-555-0143, +33 (0)1 23 45 67 89
    r"\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,4}){2,5}"
    # North American: (202) 555-0143, 202-555-0143, 202.555.0143
    r"|(?:\(\d{3}\)\s?|\d{3}[.-])\d{3}[.-]\d{4}"
    r")(?![\w-])")

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
    max_phone_digits: int = 15  # the longest number E.164 allows


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
            text = PHONE.sub(self._replace_phone, text)
        return text

    def _replace(self, match: re.Match, kind: str, replacement: str) -> str:
        if not _is_public_ip(match.group(0)):
            return match.group(0)
        self.stats[f"redacted.{kind}"] += 1
        return replacement

    def _replace_phone(self, match: re.Match) -> str:
        digits = sum(ch.isdigit() for ch in match.group(0))
        if not self.params.min_phone_digits <= digits <= self.params.max_phone_digits:
            return match.group(0)
        self.stats["redacted.phone"] += 1
        return PHONE_REPLACEMENT
