"""Finding the NVIDIA device nodes on the host: the scan of DRIVER_ROOT/dev and the fresh look at
one name, both through directory fds opened confined to the root. What a node is (names, kinds,
the majors each must carry) is decided in host/nodes.py, which stays pure.
"""

from __future__ import annotations

import os
from itertools import chain
from stat import S_ISCHR
from sys import intern

from nvsymlinkd.host import procdevices
from nvsymlinkd.host.listings import Listings, listed
from nvsymlinkd.host.nodes import (
    CAPS_DIR,
    SUBDIRS,
    TMP_PREFIX,
    NvidiaNode,
    classify,
    dev_dir,
    is_cap_name,
    names_by_major,
    node_from_rdev,
    node_from_stat,
)
from nvsymlinkd.host.root import DIR_FLAGS, HostRoot

_new = tuple.__new__  # a NamedTuple without its keyword-handling __new__: thousands per pass
os_major, os_minor = os.major, os.minor


def scan_nodes(root: HostRoot, driver_root: str, majors: procdevices.Majors, temps: list | None = None,
               listings: Listings | None = None):
    """NVIDIA char nodes under DRIVER_ROOT/dev -> (nodes, ignored), both sorted by path.

    DRIVER_ROOT/dev is opened confined to the root and read through its fd, so
    a symlinked dev/ (or driver root) is followed as if the root were `/`,
    never out of it. Inside paths of applier temporaries are added to `temps`.
    With `listings` (the daemon's), a directory unchanged since it was last read is not read
    again (host/listings.py); what its entries are is decided again from `majors`.
    """
    base = dev_dir(driver_root)
    prefix = base if base != "/" else ""
    by_major = names_by_major(majors)
    nodes: list = []
    ignored: list = []
    # (kind, major) -> whether node_from_rdev takes a char device of that kind and major: asked
    # once per pair, not per node (a MIG host has ~2,000 caps on one major)
    accepted: dict = {}
    append = nodes.append
    for rows in _candidates(root, base, prefix, listings):
        it = iter(rows)
        for path, kind, rdev in zip(it, it, it):  # flat rows: path, kind, rdev, path, ...
            if kind is None:  # an applier temporary
                if temps is not None:
                    temps.append(path)
                continue
            if rdev is not None:
                major = os_major(rdev)
                ok = accepted.get((kind, major))
                if ok is None:
                    ok = accepted[kind, major] = type(node_from_rdev("", kind, rdev, by_major)) is NvidiaNode
                if ok:
                    append(_new(NvidiaNode, (path, kind, major, os_minor(rdev))))
                    continue
            found = node_from_rdev(path, kind, rdev, by_major)
            (nodes if type(found) is NvidiaNode else ignored).append(found)
    nodes.sort()  # by path: a node's first field, and no two nodes share a path
    ignored.sort(key=lambda n: n.path)
    return nodes, ignored


def observe_node(root: HostRoot, driver_root: str, rel: str, by_major: dict):
    """A fresh lstat of one name under DRIVER_ROOT/dev (`nvidia0`, `nvidia-caps/nvidia-cap5`)
    -> NvidiaNode, IgnoredNode, or None (absent, or not an NVIDIA node name).

    Through the same confined directory fds as scan_nodes (a subdirectory never through a
    symlink), and never from anything cached about the inode: a name can be reused by
    another node at any time.
    """
    kind = classify(rel)
    if kind is None:
        return None
    base = dev_dir(driver_root)
    sub, _, name = rel.rpartition("/")
    try:
        fd = root.open_dir(base)
    except OSError:
        return None
    try:
        if sub:
            subfd = os.open(sub, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = subfd
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)
    return node_from_stat(f"{base if base != '/' else ''}/{rel}", kind, st, by_major)


def observe_nodes(root: HostRoot, driver_root: str, rels, by_major: dict) -> list:
    """observe_node for each name -> [(rel, NvidiaNode, IgnoredNode or None)], in order: DRIVER_ROOT/dev
    opened (confined to the root) once, each subdirectory (never through a symlink) once, for all of
    them: a burst's names cost their own lstat, not a directory walk each (issue 38)."""
    base = dev_dir(driver_root)
    prefix = base if base != "/" else ""
    out: list = []
    fds: dict = {}
    try:
        try:
            fds[""] = root.open_dir(base)
        except OSError:
            return [(rel, None) for rel in rels]
        for rel in rels:
            kind = classify(rel)
            sub, _, name = rel.rpartition("/")
            if kind is None:
                out.append((rel, None))
                continue
            try:
                fd = fds.get(sub)
                if fd is None:
                    fd = fds[sub] = os.open(sub, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fds[""])
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                out.append((rel, None))
                continue
            out.append((rel, node_from_stat(f"{prefix}/{rel}", kind, st, by_major)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _reader(prefix: str, sub: str):
    """The reader of DRIVER_ROOT/dev (sub "") or of one NVIDIA subdirectory ("NAME/") for listings.listed:
    (rows, subdirs). The rows are one flat tuple, three items per candidate (a tuple each would be 64 bytes
    more a node, kept between passes): its inside path (interned: the same str as the daemon's picture
    keeps), its kind (None: an applier temporary) and its rdev (None: not a character device), lstat'ed
    through the directory's fd; subdirs: the NVIDIA subdirectories' names (of the top only)."""
    caps = sub == CAPS_DIR
    head = f"{prefix}/{sub}"

    def read(fd: int):
        rows: list = []
        subdirs: list = []
        add = rows.append
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    name = entry.name
                    if name.startswith(TMP_PREFIX):
                        add((head + name, None, None))
                        continue
                    # classify()'s answer in nvidia-caps/ without its path join: a cap or nothing
                    if caps:
                        kind = "cap" if is_cap_name(name) else None
                    elif sub:
                        kind = classify(sub + name)
                    elif not name.startswith("nvidia"):
                        continue
                    elif name in SUBDIRS:
                        subdirs.append(name)
                        continue
                    else:
                        kind = classify(name)
                    if kind is None:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone since the listing: the directory's next stat differs
                    add((intern(head + name), kind, st.st_rdev if S_ISCHR(st.st_mode) else None))
        except OSError:
            return ((), ()), False
        return (tuple(chain.from_iterable(rows)), tuple(subdirs)), True

    return read


def _candidates(root: HostRoot, base: str, prefix: str, listings: Listings | None) -> list:
    """[the flat rows of a directory]: of the nvidia* entries (and applier temporaries) of base, and of
    every entry of the NVIDIA subdirs, one level in (never through a symlink)."""
    try:
        fd = root.open_dir(base)
    except OSError:
        return []
    try:
        top, subdirs = listed(listings, base, fd, _reader(prefix, ""))
        out = [top]
        for name in subdirs:
            try:
                # never descend through a symlinked directory (O_NOFOLLOW)
                sub = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            try:
                out.append(listed(listings, f"{prefix}/{name}", sub, _reader(prefix, f"{name}/"))[0])
            finally:
                os.close(sub)
        return out
    finally:
        os.close(fd)
