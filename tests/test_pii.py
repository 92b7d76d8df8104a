"""Phone numbers found by libphonenumber (issue 14, part 5): US, UK, German, French and Indian
numbers in national and international notation, with spaces, dots, dashes, slashes and
parentheses, are all redacted; the prose around them, and digit runs that are not phone numbers
(years, prices, dates, times, versions, ISBNs, ids, coordinates), stay byte for byte."""

from __future__ import annotations

import pytest

from tasks.configs import ConfigError
from tasks.data.pii import PHONE_REPLACEMENT, PIIParams, RedactPII
from tasks.data.steps import Doc

PHONES = {
    "US": ["(212) 555 0188", "415 555 0123", "(202) 555-0143", "202.555.0143", "415-555-0123",
           "1-800-555-0199", "+1 (415) 555-0123", "+1 202 555 0143", "+1.415.555.0123",
           "+1-202-555-0143", "+14155550123"],
    "GB": ["020 7946 0958", "+44 20 7946 0958", "07911 123456", "+44 7911 123456",
           "+44 (0)20 7946 0958", "0044 20 7946 0958", "(020) 7946 0958", "020-7946-0958",
           "0161 496 0000", "+44.20.7946.0958"],
    "DE": ["030 12345678", "+49 30 12345678", "+49 (0)30 1234 5678", "0151 23456789",
           "+49 151 23456789", "030/12345678", "089 1234567", "(089) 1234567", "030-1234-5678",
           "0049 30 12345678", "+49.30.12345678"],
    "FR": ["01 23 45 67 89", "01.23.45.67.89", "06-12-34-56-78", "+33 1 23 45 67 89",
           "+33 (0)1 23 45 67 89", "+33 6 12 34 56 78", "0033 1 23 45 67 89", "(01) 23 45 67 89",
           "+33.1.23.45.67.89"],
    "IN": ["098765 43210", "+91 98765 43210", "+91-22-2345-6789", "022 2345 6789", "98765-43210",
           "022-2345-6789", "+91 (22) 2345 6789", "(022) 2345 6789", "+91.98765.43210",
           "0091 98765 43210", "98765 43210"],
}

NOT_PHONES = [
    "in 1999", "$1,299.99", "2.499,00 EUR", "2023-02-08", "08.02.2023", "12:30:45",
    "2023-02-08 12:30", "Python 3.11.2", "v10.4.12", "ISBN 978-3-16-148410-0", "ISBN 0-306-40615-2",
    "ISBN 9783161484100", "order 12345678", "invoice 1234567890", "pages 1999-2001",
    "1 234 567 890", "12 345 678 901 234", "1,000,000", "1.000.000.000", "100 200 300 400",
    "the years 2021 2022 2023", "1999 - 2001 - 2005", "(1999) 2001 2005", "2023-2024-2025",
    "48.8566, 2.3522", "3.14159265358979", "0.123456789", "ZIP 94103-1234", "doi 10.1000/182",
    "4-8-15-16-23-42", "1.5.2.3.4.6.7.8.9", "2024/02/08", "02/08/2024 10:15", "ver 2.10.300.4000",
    "issue #123456789", "5551234", "CVE-2023-12345", "UUID 123e4567-e89b-12d3-a456-426614174000",
    "192.168.1.10", "10.0.0.1",
]

# Each number inside prose, with the punctuation prose puts around one.
CONTEXTS = ["Call {} today.", "Reach us at {}, or by mail.", "Tel.: {}", "(office: {})", "{} is the desk.",
            "Line one\n{}\nline three", "Numbers like «{}» are printed on the card."]


def redact(text: str) -> tuple[str, int]:
    step = RedactPII()
    doc = Doc("d", text)
    step(doc)
    return doc.text, step.stats.get("redacted.phone", 0)


@pytest.mark.parametrize("region", sorted(PHONES))
def test_every_notation_of_a_regions_numbers_is_redacted_and_the_prose_kept(region):
    for number in PHONES[region]:
        for context in CONTEXTS:
            text, count = redact(context.format(number))
            assert (text, count) == (context.format(PHONE_REPLACEMENT), 1), (region, number, context)


def test_digit_runs_that_are_not_phone_numbers_stay_byte_for_byte():
    for example in NOT_PHONES:
        for context in CONTEXTS:
            text = context.format(example)
            assert redact(text) == (text, 0), example


def test_a_document_mixing_numbers_and_other_digits_changes_only_the_numbers():
    numbers = [PHONES[r][i] for r in sorted(PHONES) for i in (0, 1, 3)]
    plain = [NOT_PHONES[i % len(NOT_PHONES)] for i in range(len(numbers))]
    parts = [f"Item {i}: {p} and then {n}." for i, (p, n) in enumerate(zip(plain, numbers))]
    expected = [f"Item {i}: {p} and then {PHONE_REPLACEMENT}." for i, p in enumerate(plain)]
    assert redact("\n".join(parts)) == ("\n".join(expected), len(numbers))


def test_redacted_text_is_left_as_it_is_on_a_second_pass():
    text, _ = redact("Call (212) 555 0188 or +44 20 7946 0958.")
    assert redact(text) == (text, 0)


def test_national_notation_counts_for_the_listed_regions_international_from_anywhere():
    us_only = RedactPII(PIIParams(phone_regions=["US"]))
    doc = Doc("d", "Paris 01 23 45 67 89, or +33 1 23 45 67 89, or Tokyo +81 3-1234-5678.")
    us_only(doc)
    assert doc.text == f"Paris 01 23 45 67 89, or {PHONE_REPLACEMENT}, or Tokyo {PHONE_REPLACEMENT}."
    assert "FR" in PIIParams().phone_regions


def test_an_unknown_region_is_refused_with_the_field_named():
    with pytest.raises(ConfigError, match=r"phone_regions: unknown region code\(s\) \['UK'\].*'GB'"):
        PIIParams(phone_regions=["US", "UK"])
