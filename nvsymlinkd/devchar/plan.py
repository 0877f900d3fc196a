"""Deciding: from a HostSnapshot to the actions that make /dev/char exact.

Pure functions only; nvsymlinkd.devchar.apply does the syscalls.

Ownership rule: an `M:m` symlink whose target has a component starting with
`nvidia` is ours to manage. Everything else at a desired path (a foreign
symlink, a file, a directory, a node) is a conflict: reported, never touched.
Links to non-NVIDIA devices (`1:3 -> ../null`) are not looked at.

A symlink that resolves to the right character device is kept whatever its
text: nvidia-ctk's absolute `/dev/char/195:0 -> /dev/nvidia0`, a link to the
same node under the driver root, or to any other node with that rdev. systemd
and runc only stat() the link, so it is exact for them, and rewriting it would
flap against the tool that wrote it. Only an NVIDIA-named link that resolves
to another device or to nothing is replaced or removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nvsymlinkd.devchar.model import HostSnapshot, is_nvidia_path
from nvsymlinkd.host import nodes as nodemod
from nvsymlinkd.host.paths import link_target

CREATE = "create"
REPLACE = "replace"
REMOVE = "remove"
KEEP = "keep"
CONFLICT = "conflict"
CREATE_NODE = "create-node"
ACTIONS = (CREATE_NODE, CREATE, REPLACE, REMOVE, KEEP, CONFLICT)
CHANGES = frozenset({CREATE_NODE, CREATE, REPLACE, REMOVE})


class Action(NamedTuple):  # a tuple: thousands are built per sync
    action: str
    link: str | None  # the /dev/char path (None for create-node)
    target: str | None  # link text to write, or the node path for create-node
    device: str  # "c M:m"
    reason: str
    previous: str | None = None  # link text seen when planning (replace/remove)
    # create-node only:
    node_mode: int | None = None
    node_uid: int | None = None
    node_gid: int | None = None

    @property
    def changes(self) -> bool:
        return self.action in CHANGES

    def to_json(self) -> dict:
        out = {
            "action": self.action,
            "link": self.link,
            "target": self.target,
            "device": self.device,
            "reason": self.reason,
        }
        if self.previous is not None:
            out["previous"] = self.previous
        if self.action == CREATE_NODE:
            out["mode"] = f"{self.node_mode:04o}"
            out["owner"] = f"{self.node_uid}:{self.node_gid}"
        return out


@dataclass(frozen=True)
class Plan:
    actions: tuple
    notes: tuple = ()  # human hints (missing modules, stale nodes)
    stale_temps: tuple = ()  # inside paths of dead syncs' temporaries, removed when applying

    @property
    def changes(self) -> list:
        return [a for a in self.actions if a.changes]

    @property
    def conflicts(self) -> list:
        return [a for a in self.actions if a.action == CONFLICT]

    def summary(self) -> dict:
        counts = {name: 0 for name in ACTIONS}
        for a in self.actions:
            counts[a.action] += 1
        return counts


def plan_sync(snap: HostSnapshot, create_nodes: bool = False) -> Plan:
    notes = [f"ignored {i.path}: {i.reason}" for i in snap.ignored]
    notes += [f"stale temporary {path} of exited pid {pid}: sync removes it" for path, pid in snap.stale_temps]
    node_actions: list = []
    planned_nodes: list = []
    if create_nodes:
        node_actions, planned_nodes, node_notes = plan_nodes(snap)
        notes.extend(node_notes)
    link_actions = plan_links(snap, list(snap.nodes) + planned_nodes)
    return Plan(tuple(node_actions + link_actions), tuple(notes), tuple(path for path, _ in snap.stale_temps))


def plan_links(snap: HostSnapshot, nodes: list) -> list:
    dev_char = snap.dev_char_path
    # link text is computed between where things really are (dev-char dir and nodes
    # resolved confined to the root), so a symlinked /dev/char still gets links that resolve
    real_char = snap.dev_char_real or dev_char
    by_rdev: dict = {}
    for node in nodes:
        have = by_rdev.setdefault((node.major, node.minor), node)
        if have is not node and _preference(node) < _preference(have):
            by_rdev[(node.major, node.minor)] = node
    # "M:m" -> node, in device-number order
    desired = {f"{major}:{minor}": by_rdev[major, minor] for major, minor in sorted(by_rdev)}

    if snap.dev_char_state == "not-dir":
        return [
            Action(CONFLICT, f"{dev_char}/{name}", link_target(f"{real_char}/{name}", snap.real_path(n.path)), n.device,
                   f"{dev_char} exists and is not a directory")
            for name, n in desired.items()
        ]

    actions = []
    for name, node in desired.items():
        link = f"{dev_char}/{name}"
        want = link_target(f"{real_char}/{name}", snap.real_path(node.path))
        entry = snap.entries.get(name)
        rdev = (node.major, node.minor)
        if entry is None:
            actions.append(Action(CREATE, link, want, node.device, f"no link for {node.path}"))
        elif entry.kind != "symlink":
            actions.append(Action(CONFLICT, link, want, node.device,
                                  f"a {entry.kind} is in the way (not ours, left alone)"))
        elif entry.resolved == rdev:
            why = "link is exact" if entry.link_text == want else f"link resolves to {node.device} (target {entry.link_text})"
            actions.append(Action(KEEP, link, entry.link_text, node.device, why))
        elif is_nvidia_path(entry.target):
            actions.append(Action(REPLACE, link, want, node.device, _broken(entry), previous=entry.link_text))
        else:
            actions.append(Action(CONFLICT, link, want, node.device,
                                  f"foreign symlink to {entry.link_text} (not ours, left alone)"))

    majors = snap.majors.nvidia_majors
    others = [(name, entry) for name, entry in snap.entries.items() if name not in desired]
    for name, entry in sorted(others, key=_by_rdev):
        if entry.kind != "symlink" or not is_nvidia_path(entry.target):
            continue
        major = entry.rdev_name[0]
        broken = entry.resolved != entry.rdev_name
        if broken or major not in majors:
            why = _broken(entry) if broken else f"major {major} is no longer an NVIDIA major"
            actions.append(Action(REMOVE, f"{dev_char}/{name}", None, f"c {name}", why,
                                  previous=entry.link_text))
    return actions


def foreign_links(dev_char_state: str, entries: dict, conflicts) -> list:
    """Conflicts where someone else's symlink holds a desired path -> [(Action, DevCharEntry)].

    From a snapshot's dev_char_state and entries and a plan's conflicts. systemd resolves
    DeviceAllow=/dev/char/M:m through that link, so a scope gets the device it points at
    (or none), not M:m.
    """
    out = []
    if dev_char_state != "dir":
        return out
    for a in conflicts:
        entry = entries.get(a.link.rpartition("/")[2]) if a.link else None
        if entry is not None and entry.kind == "symlink":
            out.append((a, entry))
    return out


def plan_nodes(snap: HostSnapshot):
    """Nodes the driver says should exist but do not -> (actions, nodes, notes)."""
    majors = snap.majors
    driver = snap.driver
    base = nodemod.dev_dir(snap.driver_root)
    own = driver.ownership
    wanted: list = []  # (NvidiaNode, ownership, reason)
    notes: list = []

    frontend = majors.frontend()
    if frontend is None:
        if driver.gpus or driver.loaded_modules:
            notes.append("no 'nvidia' character major in /proc/devices: load the driver (modprobe nvidia)")
        else:
            notes.append("NVIDIA driver not loaded (no 'nvidia' major in /proc/devices): no nodes to create")
    else:
        wanted.append((nodemod.NvidiaNode(f"{base}/nvidiactl", "ctl", frontend, 255), own,
                       "control node of the loaded nvidia driver"))
        if "nvidia-modeset" in majors.by_name or driver.module_loaded("nvidia_modeset"):
            wanted.append((nodemod.NvidiaNode(f"{base}/nvidia-modeset", "modeset", frontend, 254), own,
                           "nvidia_modeset module is loaded"))
        for gpu in driver.gpus:
            wanted.append((nodemod.NvidiaNode(f"{base}/nvidia{gpu.minor}", "gpu", frontend, gpu.minor), own,
                           f"driver reports GPU {gpu.pci} with minor {gpu.minor}"))
    uvm = majors.major("nvidia-uvm")
    if uvm is not None:
        wanted.append((nodemod.NvidiaNode(f"{base}/nvidia-uvm", "uvm", uvm, 0), own, "nvidia-uvm major is registered"))
        wanted.append((nodemod.NvidiaNode(f"{base}/nvidia-uvm-tools", "uvm-tools", uvm, 1), own,
                       "nvidia-uvm major is registered"))
    elif frontend is not None:
        notes.append("nvidia-uvm is not loaded (modprobe nvidia-uvm): /dev/nvidia-uvm not created; CUDA needs it")
    caps = majors.major("nvidia-caps")
    if driver.mig_minors:
        if caps is None:
            notes.append("mig-minors lists capabilities but no 'nvidia-caps' major: load nvidia with MIG support")
        else:
            for cap, minor in sorted(driver.mig_minors.items(), key=lambda kv: kv[1]):
                wanted.append((nodemod.NvidiaNode(f"{base}/nvidia-caps/nvidia-cap{minor}", "cap", caps, minor),
                               driver.cap_ownership.get(cap, own),
                               f"MIG capability {cap}"))

    existing = {n.path: n for n in snap.nodes}
    actions, planned = [], []
    for node, ownership, reason in wanted:
        if node.path in existing:
            continue
        if node.path in snap.existing_paths:
            actions.append(Action(CONFLICT, None, node.path, node.device,
                                  "something else is at this path (not a matching node; left alone)"))
            continue
        actions.append(Action(CREATE_NODE, None, node.path, node.device, reason,
                              node_mode=ownership.mode, node_uid=ownership.uid, node_gid=ownership.gid))
        planned.append(node)
    return actions, planned, notes


def _preference(node) -> tuple:
    # When two nodes share a device number, link the canonical one (shortest path, then name).
    return (len(node.path), node.path)


def _by_rdev(item) -> tuple:
    name = item[0]
    major, _, minor = name.partition(":")
    return (int(major), int(minor))


def _broken(entry) -> str:
    if entry.resolved_kind == "missing":
        return f"dangling link to {entry.link_text}"
    if entry.resolved_kind == "char" and entry.resolved is not None:
        return f"link to {entry.link_text} resolves to c {entry.resolved[0]}:{entry.resolved[1]}, not c {entry.name}"
    return f"link to {entry.link_text} does not resolve to a character device"
