"""The daemon's picture of the host, kept exact one name at a time.

A full pass (reconcile) observes everything; at MIG scale that is ~2,000
lstat+readlink per pass, far too much to repeat for every inotify event. After
a full pass, LinkState holds what it saw (nodes, ignored names, /dev/char
entries, the plan per link name) and `update()` answers an event for a few
names with work for those names only:

- each node name is looked at afresh (one lstat through the confined directory
  fds, host.nodescan.observe_nodes): never decided from anything cached about its
  inode, so a name reused by another node (rm + mknod with another rdev) is
  seen for what it is now;
- the link names that can depend on it (its old and new `M:m`, any link whose
  text names it) and the link names the /dev/char watch reported are looked at
  afresh too (devchar.snapshot.observe_entries);
- those names go through the same planner (devchar.plan.plan_links on a
  snapshot restricted to them: its decisions are per `M:m` name) and the same
  applier.

What this cannot decide alone it hands back to a full pass (`update()` returns
None): a node whose major is not a known NVIDIA major (a module was loaded and
/proc/devices changed), a dev-char directory that is not a plain directory, a
removed node when nodes are created by us (plan_nodes decides on the whole
host). The full pass also stays the safety net for everything else: resyncs,
inotify overflow, udev, D-Bus reloads, watched directories replaced.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from nvsymlinkd import record
from nvsymlinkd.devchar.apply import Outcome, apply_plan
from nvsymlinkd.devchar.model import HostSnapshot
from nvsymlinkd.devchar.plan import ACTIONS, CONFLICT, KEEP, Action, Plan, foreign_links, plan_links
from nvsymlinkd.devchar.reconcile import SyncResult
from nvsymlinkd.devchar.snapshot import observe_entries
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.nodes import IgnoredNode, NvidiaNode, dev_dir, names_by_major
from nvsymlinkd.host.nodescan import observe_nodes

LINKED = ("create", "replace", KEEP)


def _name(major: int, minor: int) -> str:
    # one str per name, whichever dict holds it (thousands of names on a MIG host: the daemon's RSS)
    return sys.intern(f"{major}:{minor}")


_intern = sys.intern


def _one_text(s: str | None) -> str | None:
    """One str object for equal paths and texts whichever record holds them: a node's path is also the
    target of its link's entry, and a link's text is both what was planned (the Action) and what
    readlink(2) read back (the entry): separate objects per link otherwise (~150 bytes a link at 2,000
    links; issue 38)."""
    return s if s is None else _intern(s)


class LinkState:
    """The last full pass's picture, updated per name. Built from an applied (not dry-run) SyncResult."""

    def __init__(self, root, result: SyncResult):
        snap = result.snapshot
        self.root = root
        # majors, driver, paths: what only a full pass re-reads (its node and entry lists are
        # in the dicts below: not kept twice)
        self.base = record.replace(snap, nodes=(), ignored=(), entries={}, existing_paths=frozenset())
        self.by_major = names_by_major(snap.majors)
        self.nvidia_majors = snap.majors.nvidia_majors
        self.dev_base = dev_dir(snap.driver_root)
        self.prefix = self.dev_base if self.dev_base != "/" else ""
        self.nodes: dict = {}  # inside path -> NvidiaNode
        self.ignored: dict = {i.path: i for i in snap.ignored}
        # "M:m" -> (NvidiaNode, ...) in the order added, one per path (a tuple: almost always one node;
        # a dict or set per name costs ~200 bytes each, issue 16 item 5)
        self.by_rdev: dict = {}
        for n in snap.nodes:
            self._add_node(n)
        self.entries: dict = {}  # "M:m" -> DevCharEntry
        self.linked_from: dict = {}  # real inside path a link text names -> ("M:m", ...) (a tuple, as above)
        for entry in snap.entries.values():
            self._set_entry(entry.name, entry)
        self.actions: dict = {}  # "M:m" -> the link Action its latest planning gave
        self.counts = dict.fromkeys(ACTIONS, 0)  # of `actions`
        self.failed: set = set()  # "M:m" whose create/replace failed
        self.conflicts: dict = {}  # where -> Action, of the current conflicts
        self.node_conflicts = 0  # node paths in the way (create_nodes), until the next full pass
        failed = {id(o.action) for o in result.outcomes if o.error is not None}
        for a in result.plan.actions:
            if a.link is None:  # create-node, or a node path in the way
                if a.action == CONFLICT:
                    self.conflicts[a.target] = a
                    self.node_conflicts += 1
                continue
            self._set_action(a.link.rpartition("/")[2], a, id(a) in failed)
        ignored_notes = {f"ignored {i.path}: {i.reason}" for i in snap.ignored}
        node_notes = [n for n in result.plan.notes if n not in ignored_notes]
        self.other_notes = tuple(node_notes)  # stale temporaries, missing modules: until the next full pass
        # the full pass's own writes: look at what they left (its events may already be read)
        changed = {a.link.rpartition("/")[2] for a in result.plan.changes if a.link is not None}
        self._refresh_entries(changed, {snap.real_path(n.path): (n.major, n.minor) for n in snap.nodes}
                              if changed else None)
        self.nodes_changed = False

    # -- the model ----------------------------------------------------------

    def _add_node(self, node: NvidiaNode) -> None:
        path = _intern(node.path)
        if path is not node.path:
            node = node._replace(path=path)
        self.nodes[path] = node
        name = _name(node.major, node.minor)
        have = self.by_rdev.get(name, ())
        if any(n.path == node.path for n in have):  # in its place, like a dict's update
            self.by_rdev[name] = tuple(node if n.path == node.path else n for n in have)
        else:
            self.by_rdev[name] = have + (node,)

    def _drop_node(self, path: str) -> NvidiaNode | None:
        node = self.nodes.pop(path, None)
        if node is not None:
            name = _name(node.major, node.minor)
            rest = tuple(n for n in self.by_rdev.get(name, ()) if n.path != path)
            if rest:
                self.by_rdev[name] = rest
            else:
                self.by_rdev.pop(name, None)
        return node

    def _set_entry(self, name: str, entry) -> None:
        name = sys.intern(name)
        old = self.entries.pop(name, None)
        if old is not None and old.target is not None:
            rest = tuple(n for n in self.linked_from.get(old.target, ()) if n != name)
            if rest:
                self.linked_from[old.target] = rest
            else:
                self.linked_from.pop(old.target, None)
        if entry is not None:
            if entry.link_text is not None:
                entry = entry._replace(link_text=_intern(entry.link_text), target=_one_text(entry.target))
            self.entries[name] = entry
            if entry.target is not None:
                names = self.linked_from.get(entry.target, ())
                if name not in names:
                    self.linked_from[entry.target] = names + (name,)

    def _set_action(self, name: str, a, failed: bool = False) -> None:
        name = sys.intern(name)
        old = self.actions.pop(name, None)
        if old is not None:
            self.conflicts.pop(old.link, None)
            self.counts[old.action] -= 1
        self.failed.discard(name)
        if a is None:
            return
        if a.target is not None:
            a = a._replace(target=_intern(a.target), previous=_one_text(a.previous))
        self.actions[name] = a
        self.counts[a.action] += 1
        if a.action == CONFLICT:
            self.conflicts[a.link] = a
        elif failed and a.action in LINKED:
            self.failed.add(name)

    @property
    def managed(self) -> int:
        """Links in place: planned create/replace/keep, not failed."""
        return sum(self.counts[a] for a in LINKED) - len(self.failed)

    def _refresh_entries(self, names, by_path: dict | None = None) -> None:
        """Look again at these `M:m` names. by_path: real path -> (major, minor) of nodes lstat'ed in this
        very pass (the full observer's map, snapshot._observe_link's fast path): a link naming one of them
        resolves to it without another confined walk; any other target is resolved afresh."""
        if not names:
            return
        snap = self.base
        for name, entry in observe_entries(self.root, snap.dev_char_path, snap.dev_char_real, names,
                                           by_path or {}).items():
            self._set_entry(name, entry)

    def snapshot(self) -> HostSnapshot:
        """The picture as a HostSnapshot (what a full observe would see, if no event is unread)."""
        return record.replace(
            self.base,
            nodes=tuple(sorted(self.nodes.values(), key=lambda n: n.path)),
            ignored=tuple(sorted(self.ignored.values(), key=lambda i: i.path)),
            entries=dict(self.entries),
            existing_paths=frozenset(self.nodes) | frozenset(self.ignored),
            stale_temps=(),
        )

    def plan(self) -> Plan:
        """The plan of every link name, as last decided (creates and replaces already applied)."""
        actions = [a for a in self.conflicts.values() if a.link is None]
        actions += sorted(self.actions.values(), key=lambda a: a.device)  # the link's name is its device's numbers
        return Plan(tuple(actions), self.notes())

    def notes(self) -> tuple:
        return tuple(f"ignored {i.path}: {i.reason}" for i in sorted(self.ignored.values(), key=lambda i: i.path)) \
            + self.other_notes

    def summary(self) -> dict:
        """Plan.summary() of plan(), kept as names change."""
        counts = dict(self.counts)
        counts[CONFLICT] += self.node_conflicts
        return counts

    def foreign(self) -> dict:
        """where -> DevCharEntry of the conflicts that are someone else's symlink (devchar.plan.foreign_links)."""
        return {a.link: entry for a, entry in foreign_links(self.base.dev_char_state, self.entries,
                                                            self.conflicts.values())}

    def result(self, outcomes: tuple) -> Picture:
        return Picture(self, outcomes)

    # -- one event's worth --------------------------------------------------

    def update(self, node_names, link_names, create_nodes: bool = False):
        """Look again at these names and make their links exact -> Delta, or None for "needs a full pass".

        node_names: paths relative to DRIVER_ROOT/dev (`nvidia3`, `nvidia-caps/nvidia-cap7`);
        link_names: `M:m` names in DEV_CHAR_PATH.
        """
        start = time.perf_counter()
        snap = self.base
        if snap.dev_char_state != "dir":
            return None
        affected = set(link_names)
        fresh = []
        for rel, found in observe_nodes(self.root, snap.driver_root, node_names, self.by_major):
            path = f"{self.prefix}/{rel}"
            if isinstance(found, IgnoredNode) and found.reason != "not a character device":
                return None  # a major /proc/devices did not have at the last full pass: re-read it
            if found is None and create_nodes and (path in self.nodes or path in self.ignored):
                return None  # a node we may have to create again: plan_nodes looks at the whole host
            fresh.append((path, found))
        for path, found in fresh:
            old = self.nodes.get(path)
            new = found if isinstance(found, NvidiaNode) else None
            if old != new:
                self.nodes_changed = True
                if old is not None:
                    self._drop_node(path)
                    affected.add(_name(old.major, old.minor))
                if new is not None:
                    self._add_node(new)
                    affected.add(_name(new.major, new.minor))
                # links whose text names this path resolve to whatever is there now
                affected.update(self.linked_from.get(snap.real_path(path), ()))
            if isinstance(found, IgnoredNode):
                self.ignored[path] = found
            else:
                self.ignored.pop(path, None)
        if not affected:
            return Delta(self, (), (), time.perf_counter() - start)
        # the nodes lstat'ed just now: what a link naming one resolves to (as the full observer's map)
        seen = {snap.real_path(path): (n.major, n.minor) for path, n in fresh if isinstance(n, NvidiaNode)}
        self._refresh_entries(affected, seen)
        nodes = [n for name in affected for n in self.by_rdev.get(name, ())]
        sub = record.replace(snap, nodes=tuple(nodes),
                                  entries={name: self.entries[name] for name in affected if name in self.entries})
        actions = plan_links(sub, nodes)
        outcomes = apply_plan(self.root, Plan(tuple(actions)))
        planned = {_name(a.device.major, a.device.minor): a for a in actions}  # a link's name: its device's numbers
        failed = {id(o.action) for o in outcomes if o.error is not None}
        for name in affected:
            a = planned.get(name)
            self._set_action(name, a, a is not None and id(a) in failed)
        self._refresh_entries({_name(a.device.major, a.device.minor) for a in actions if a.changes}, seen)
        return Delta(self, tuple(actions), tuple(outcomes), time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Delta:
    """One incremental pass: what was planned and done for the names it looked at."""

    state: LinkState
    actions: tuple  # Action, for the affected link names only
    outcomes: tuple  # Outcome, one per action
    seconds: float
    dry_run: bool = False

    @property
    def changes(self) -> list:
        return [a for a in self.actions if a.changes]

    @property
    def errors(self) -> list:
        return [o for o in self.outcomes if o.error is not None]


# a stand-in for each link in place that this pass did not touch: counted, never shown
_KEPT = Outcome(Action(KEEP, None, None, Device.char(0, 0), "in place"))


class Picture:
    """What the daemon reports after a pass, full or incremental, read from the LinkState.

    Quacks like a SyncResult for the reporting side (metrics, status, hooks) without building
    the whole plan per event: `outcomes` are this pass's, followed by one stand-in per other
    link in place (what Metrics counts as managed links).
    """

    dry_run = False
    full = True  # a full pass's, or False for an incremental one

    def __init__(self, state: LinkState, outcomes: tuple):
        self.state = state
        self.pass_outcomes = outcomes
        self.plan = _PlanView(state)

    @property
    def snapshot(self):
        return _SnapshotView(self.state)

    @property
    def outcomes(self):
        return list(self.pass_outcomes) + [_KEPT] * max(0, self.state.managed - self._done())

    def counts(self) -> tuple:
        """(nodes, links in place) without building `snapshot` or `outcomes` (what Metrics counts)."""
        done = self._done()
        return len(self.state.nodes), done + max(0, self.state.managed - done)

    def _done(self) -> int:
        return sum(1 for o in self.pass_outcomes if o.action.action in LINKED and o.error is None)


class _PlanView:
    def __init__(self, state: LinkState):
        self._state = state

    def summary(self) -> dict:
        return self._state.summary()

    @property
    def conflicts(self) -> list:
        return list(self._state.conflicts.values())

    @property
    def notes(self) -> tuple:
        return self._state.notes()


class _SnapshotView:
    def __init__(self, state: LinkState):
        self.nodes = tuple(state.nodes.values())
        self.majors = state.base.majors


__all__ = ["Delta", "LinkState", "Outcome"]
