"""Text for people from what a container can write: escaped, so a terminal or a log line shows it
and never acts on it (pure; the CLI, the config's errors and the journal's stderr lines use it)."""

from __future__ import annotations

import re

# C0, DEL, C1, line and paragraph separators, bidi and zero-width controls, lone surrogates: what a
# terminal acts on, or what cannot be encoded. In what a container can write (scope names, cgroup paths,
# names), human output shows them as \xNN / \uNNNN, as journalctl shows such bytes escaped.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` with every character a terminal would act on escaped (idempotent: the result is printable)."""
    if _UNPRINTABLE.search(text) is None:
        return text
    return _UNPRINTABLE.sub(_escape_char, text)


def _escape_char(m: re.Match[str]) -> str:
    code = ord(m.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte os.fsdecode could not decode (surrogateescape): show the byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def bounded(text: str, limit: int = 200) -> str:
    """`text` for display, at most about `limit` characters: cut ones end with '...' and say how long the
    whole is (only ever shown: what it decides is read from the whole value)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit - 3]}... ({len(text)} characters)"


def plural(n: int, noun: str, many: str | None = None) -> str:
    """'1 container', '2 containers' ('1 sync pass', '2 sync passes' with many=)."""
    return f"{n} {noun if n == 1 else (many or noun + 's')}"
