"""observe() and plan_sync() in one loop, for the common case of a link that is already exact.

A no-op pass over a MIG host (~2,000 links) was 4x the syscall floor: the work per name, not the
syscalls (an entry resolved from its text, the wanted text computed, the planner's comparisons,
four tuples built through NamedTuple's keyword-handling constructors). Here the wanted text of
every link is computed once per node directory, and a desired name whose readlink(2) text is
exactly that text is settled on the spot: it is exact by construction (the text names the node's
real path, which this pass just lstat'ed with that rdev), so the planner would keep it. Every
other name (a missing link, another text, a foreign entry, a name no node wants) is observed by
snapshot.py's own functions and decided by plan.py's own functions, in the same order: the
result is the same HostSnapshot and Plan as `plan_sync(observe(...))`
(tests/test_sync_quick.py holds them equal over random trees).

Nodes the driver should have (create_nodes) need the whole-host plan_nodes: not done here.
"""

from __future__ import annotations

import os
from itertools import chain
from sys import intern

from nvsymlinkd.devchar.model import DevCharEntry, HostSnapshot, is_dev_char_name, rebase
from nvsymlinkd.devchar.plan import (
    CREATE,
    KEEP,
    Action,
    Plan,
    desired_links,
    link_action,
    plan_links,
    snapshot_notes,
    stale_links,
)
from nvsymlinkd.devchar.snapshot import (
    entry_kind,
    is_dangling,
    link_entry,
    read_majors,
    removable_temporary,
    stale_temporaries,
)
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.driverinfo import DriverInfo
from nvsymlinkd.host.listings import Listings, listed
from nvsymlinkd.host.nodes import TMP_PREFIX, dev_dir
from nvsymlinkd.host.nodescan import scan_nodes
from nvsymlinkd.host.paths import link_target, normalize, target_of
from nvsymlinkd.host.root import HostRoot

_new = tuple.__new__  # a NamedTuple built without its keyword-handling __new__ (same tuple, ~2x cheaper)
EXACT = "link is exact"


def observe_and_plan(root: HostRoot, driver_root: str = "/", dev_char_path: str = "/dev/char",
                     listings: Listings | None = None) -> tuple:
    """-> (HostSnapshot, Plan), equal to (observe(...), plan_sync(that snapshot)) without driver info.
    `listings`: the daemon's directories as last read, reused where unchanged (host/listings.py)."""
    driver_root = normalize(driver_root)
    dev_char_path = normalize(dev_char_path)
    majors = read_majors(root)
    temps: list = []
    nodes, ignored = scan_nodes(root, driver_root, majors, temps, listings)
    base = dev_dir(driver_root)
    dev_real = root.resolve_prefix(base)
    char_real = root.resolve_prefix(dev_char_path)
    rebased = dev_real and dev_real != base  # else a node's real path is its path (rebase)
    by_path: dict = {}

    def real_paths() -> dict:  # the observer's by_path, built for the first name not settled on the spot
        if nodes and not by_path:
            by_path.update({rebase(n.path, base, dev_real) if rebased else n.path: (n.major, n.minor)
                            for n in nodes})
        return by_path

    desired = desired_links(nodes)
    # name -> (wanted text, the node's real path, its rdev): only where the text provably names
    # that path (the planner's link_target read back by the observer's target_of)
    wanted: dict = {}
    dirs: dict = {}
    for name, (path, _, major, minor) in desired.items():  # NvidiaNode: path, kind, major, minor
        real = rebase(path, base, dev_real) if rebased else path
        parent, _, leaf = real.rpartition("/")
        prefix = dirs.get(parent, False)
        if prefix is False:
            prefix = dirs[parent] = _text_prefix(char_real or dev_char_path, char_real, parent)
        if prefix is not None:
            wanted[name] = (prefix + leaf, real, (major, minor))
    state, entries, exact = _observe_dev_char(root, dev_char_path, char_real, real_paths, temps, wanted, listings)
    snap = HostSnapshot(
        majors=majors, nodes=tuple(nodes), ignored=tuple(ignored), driver=DriverInfo(),
        driver_root=driver_root, dev_char_path=dev_char_path, dev_char_state=state, entries=entries,
        existing_paths=frozenset([n[0] for n in nodes] + [i.path for i in ignored]),  # n[0]: n.path
        dev_dir_real=dev_real, dev_char_real=char_real, stale_temps=tuple(stale_temporaries(temps)),
    )
    notes = snapshot_notes(snap)
    if state != "dir":
        actions = plan_links(snap, list(nodes))
    else:
        head = dev_char_path + "/"
        actions = []
        append, exact_text, new = actions.append, exact.get, _new  # thousands of exact links: locals
        for name, node in desired.items():
            text = exact_text(name)
            if text is not None:
                append(new(Action, (KEEP, head + name, text, new(Device, ("c", node[2], node[3])),  # major, minor
                                    EXACT, None, None, None, None)))
            elif name not in entries and name in wanted:  # link_action's create, its text as wanted
                actions.append(_new(Action, (CREATE, head + name, wanted[name][0],
                                             _new(Device, ("c", node.major, node.minor)), f"no link for {node.path}",
                                             None, None, None, None)))
            else:
                actions.append(link_action(snap, name, node))
        actions += stale_links(snap, desired)
    return snap, Plan(tuple(actions), tuple(notes), tuple(path for path, _ in snap.stale_temps))


def _text_prefix(plan_char: str, char_real: str, node_dir: str) -> str | None:
    """The link text up to the node's name for nodes in `node_dir` ('../nvidia-caps/'), or None where
    the observer would not read that text back as exactly `node_dir`/NAME.

    The planner's text is a function of the directories plus the name appended (host.paths.link_target),
    and so is the path the observer reads a text as (target_of, for a name that is not '.' or '..':
    node names never are): one probe per directory answers for every node in it."""
    probe = f"{node_dir}/nvidia"
    text = link_target(f"{plan_char}/0:0", probe)
    if not text.endswith("/nvidia") and text != "nvidia":
        return None
    return text[: -len("nvidia")] if target_of(f"{char_real}/0:0", text) == probe else None


def _observe_dev_char(root: HostRoot, dev_char_path: str, char_real: str, real_paths, temps: list,
                      wanted: dict, listings: Listings | None = None):
    """snapshot._observe_dev_char, plus {name: text} of the desired links found exact (real_paths():
    the observer's by_path, asked for only where a name is not settled here). With `listings`, the
    directory's entries and link texts as last read while it is unchanged (host/listings.py)."""
    try:
        fd = root.open_dir(dev_char_path)
    except FileNotFoundError:
        return ("not-dir" if is_dangling(root, dev_char_path) else "missing"), {}, {}
    except OSError:
        return "not-dir", {}, {}
    try:
        rows = listed(listings, dev_char_path, fd, _read_dev_char)
    finally:
        os.close(fd)
    if rows is None:
        return "missing", {}, {}
    entries: dict = {}
    exact: dict = {}
    want_of = wanted.get
    it = iter(rows)
    for name, text, kind in zip(it, it, it):  # flat rows: name, text, kind, name, ...
        if text is not None:
            want = want_of(name)
            if want is not None and text == want[0]:
                # what snapshot._observe_link builds for a text naming a scanned node
                entries[name] = _new(DevCharEntry, (name, "symlink", text, want[1], want[2], "char"))
                exact[name] = text
            else:
                entries[name] = link_entry(root, char_real, name, text, real_paths())
        elif kind is None:
            temps.append(f"{dev_char_path}/{name}")
        else:
            entries[name] = DevCharEntry(name, kind)
    return "dir", entries, exact


def _read_dev_char(fd: int):
    """The dev-char directory's rows for listings.listed, one flat tuple, three items an entry (a tuple
    each would be 64 bytes more a link, kept between passes): name, link text, None of each M:m link
    (both interned: the same str as the daemon's picture keeps), name, None, kind of each other M:m
    entry (as snapshot._observe_entry sees it), name, None, None of each dead sync's temporary the sync
    may remove; None where the directory cannot be read. A listing with a temporary is not kept:
    whether one is removable depends on what is inside it."""
    rows: list = []
    add = rows.append
    readlink = os.readlink
    keep = True
    try:
        with os.scandir(fd) as it:
            for de in it:
                name = de.name
                if is_dev_char_name(name):
                    try:
                        if de.is_symlink():
                            add((intern(name), intern(readlink(name, dir_fd=fd)), None))
                        else:
                            add((name, None, entry_kind(de.stat(follow_symlinks=False).st_mode)))
                    except FileNotFoundError:
                        continue  # removed since the directory was read: absent (its event follows)
                    except OSError:
                        add((name, None, "other"))
                elif name.startswith(TMP_PREFIX):
                    keep = False
                    if removable_temporary(fd, de):
                        add((name, None, None))
    except OSError:
        return None, False
    return tuple(chain.from_iterable(rows)), keep


__all__ = ["observe_and_plan"]
