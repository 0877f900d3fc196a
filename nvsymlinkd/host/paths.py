"""Inside-path arithmetic, lexical only (no filesystem): normalize a path, the relative text of a
symlink, the path a link's text names. Pure, so planners use it without reaching HostRoot or ctypes.
"""

from __future__ import annotations

import functools
import posixpath


def normalize(path: str) -> str:
    """Absolute, normalized inside path ('//a/./b/' -> '/a/b')."""
    if path[:1] == "/" and "//" not in path and "/." not in path and (path[-1] != "/" or path == "/"):
        return path  # already normal (the common case: paths this package built); normpath is the slow part
    if not path.startswith("/"):
        path = "/" + path
    path = posixpath.normpath(path)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path


def link_target(link_inside: str, target_inside: str) -> str:
    """Relative symlink text that makes `link_inside` point at `target_inside`."""
    link_dir = link_inside.rpartition("/")[0] or "/"
    target_dir, _, base = target_inside.rpartition("/")
    return _relative_dir(target_dir or "/", link_dir) + base


def target_of(link_inside: str, link_text: str) -> str:
    """Inside path a symlink's text names (lexically, no resolution)."""
    return _target_of(link_inside.rpartition("/")[0] or "/", link_text)


# Not memoized per text: a no-op pass settles its exact links without it (devchar/quick.py asks once
# per node directory), and a cache of every link's text held ~300 bytes per link for the daemon's
# whole life (its key, its text, its answer: 0.6 MiB at 2,000 links; issue 38). The directory part,
# shared by thousands of links, is memoized below.
def _target_of(link_dir: str, link_text: str) -> str:
    if link_text.startswith("/"):
        return normalize(link_text)
    text_dir, _, base = link_text.rpartition("/")
    if base in ("", ".", ".."):
        return normalize(posixpath.join(link_dir, link_text))
    joined = _joined_dir(link_dir, text_dir)
    return joined + base if joined.endswith("/") else joined + "/" + base


# Thousands of links share a handful of directories: memoize the path arithmetic
# (a no-op sync of 2,000 MIG nodes spends most of its time here otherwise).
@functools.lru_cache(maxsize=256)
def _relative_dir(target_dir: str, link_dir: str) -> str:
    rel = posixpath.relpath(target_dir, link_dir)
    return "" if rel == "." else rel + "/"


@functools.lru_cache(maxsize=256)
def _joined_dir(link_dir: str, text_dir: str) -> str:
    return normalize(posixpath.join(link_dir, text_dir)) if text_dir else normalize(link_dir)


def unescape_mount_field(text: str) -> str:
    """A /proc/PID/mountinfo field as the kernel wrote it (space, tab, newline and backslash as \\ooo) -> the path."""
    out, i = [], 0
    while i < len(text):
        octal = text[i + 1:i + 4]
        if text[i] == "\\" and len(octal) == 3 and all(c in "01234567" for c in octal):
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
