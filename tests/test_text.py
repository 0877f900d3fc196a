"""nvsymlinkd/text.py (pure) as tables: what a terminal would act on is escaped, and long text is cut
for display only."""

from __future__ import annotations

import pytest

from nvsymlinkd.text import bounded, printable

# text a container can write -> what a person is shown
PRINTABLE = [
    ("docker-abc.scope", "docker-abc.scope"),
    ("", ""),
    ("gpu-ü-é-名前", "gpu-ü-é-名前"),  # letters of any script stay
    ("a\u00a0b", "a\u00a0b"),  # a no-break space is no control
    ("x\x1b[2J\x1b[31mPWNED", "x\\x1b[2J\\x1b[31mPWNED"),  # ESC: CSI sequences shown, not run
    ("a\nforged line", "a\\x0aforged line"),  # a newline would forge a log line
    ("a\rb\tc\x00d", "a\\x0db\\x09c\\x00d"),
    ("\x7f", "\\x7f"),  # DEL
    ("\x80\x9b\x9f", "\\x80\\x9b\\x9f"),  # C1 (0x9b is a one-byte CSI)
    ("a\u200bb", "a\\u200bb"),  # zero-width space
    ("\u200e\u200f", "\\u200e\\u200f"),  # LRM, RLM
    ("a\u2028b\u2029c", "a\\u2028b\\u2029c"),  # line and paragraph separators
    ("evil\u202egpj.exe", "evil\\u202egpj.exe"),  # bidi override
    ("\u2066x\u2069", "\\u2066x\\u2069"),  # bidi isolates
    ("\udcff\udc80", "\\xff\\x80"),  # bytes os.fsdecode could not decode: shown as the bytes
    ("\ud800", "\\ud800"),  # a lone surrogate cannot be encoded
]


@pytest.mark.parametrize(("text", "shown"), PRINTABLE)
def test_printable(text, shown):
    assert printable(text) == shown
    assert printable(shown) == shown  # idempotent: the result is printable
    shown.encode("utf-8")  # and can be written anywhere


# (text, limit) -> what is displayed
BOUNDED = [
    ("short", 200, "short"),
    ("x" * 200, 200, "x" * 200),  # at the limit: whole
    ("x" * 201, 200, "x" * 197 + "... (201 characters)"),
    ("abcdefghij", 8, "abcde... (10 characters)"),
    ("abcdefgh", 8, "abcdefgh"),
]


@pytest.mark.parametrize(("text", "limit", "shown"), BOUNDED)
def test_bounded(text, limit, shown):
    assert bounded(text, limit) == shown


def test_bounded_default_limit_is_200():
    assert bounded("y" * 200) == "y" * 200
    assert bounded("y" * 1000) == "y" * 197 + "... (1000 characters)"
