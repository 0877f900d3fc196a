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

from typing import TYPE_CHECKING, Iterable, NamedTuple

from nvsymlinkd.devchar.model import DevCharEntry, HostSnapshot, is_nvidia_path
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.nodes import NvidiaNode, dev_dir
from nvsymlinkd.host.paths import link_target
from nvsymlinkd.record import dataclass

if TYPE_CHECKING:  # an annotation only: driverinfo reads /proc through HostRoot
    from nvsymlinkd.host.driverinfo import NodeOwnership

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
    device: Device  # str() is "c M:m" (the JSON's and the journal's text)
    reason: str
    previous: str | None = None  # link text seen when planning (replace/remove)
    # create-node only:
    node_mode: int | None = None
    node_uid: int | None = None
    node_gid: int | None = None

    @property
    def changes(self) -> bool:
        return self.action in CHANGES

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "action": self.action,
            "link": self.link,
            "target": self.target,
            "device": str(self.device),
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
    actions: tuple[Action, ...]
    notes: tuple[str, ...] = ()  # human hints (missing modules, stale nodes)
    stale_temps: tuple[str, ...] = ()  # inside paths of dead syncs' temporaries, removed when applying

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.changes]

    @property
    def conflicts(self) -> list[Action]:
        return [a for a in self.actions if a.action == CONFLICT]

    def summary(self) -> dict[str, int]:
        counts = {name: 0 for name in ACTIONS}
        for a in self.actions:
            counts[a.action] += 1
        return counts


def plan_sync(snap: HostSnapshot, create_nodes: bool = False) -> Plan:
    notes = snapshot_notes(snap)
    node_actions: list[Action] = []
    planned_nodes: list[NvidiaNode] = []
    if create_nodes:
        node_actions, planned_nodes, node_notes = plan_nodes(snap)
        notes.extend(node_notes)
    link_actions = plan_links(snap, list(snap.nodes) + planned_nodes)
    return Plan(tuple(node_actions + link_actions), tuple(notes), tuple(path for path, _ in snap.stale_temps))


def snapshot_notes(snap: HostSnapshot) -> list[str]:
    """The plan's notes on what the snapshot saw: ignored nodes, dead syncs' temporaries."""
    notes = [f"ignored {i.path}: {i.reason}" for i in snap.ignored]
    notes += [f"stale temporary {path} of exited pid {pid}: sync removes it" for path, pid in snap.stale_temps]
    return notes


def plan_links(snap: HostSnapshot, nodes: list[NvidiaNode]) -> list[Action]:
    """The link actions for `nodes` (one per device number), then the removals of our stale links."""
    desired = desired_links(nodes)
    if snap.dev_char_state == "not-dir":
        dev_char, real_char = snap.dev_char_path, _real_char(snap)
        return [
            Action(CONFLICT, f"{dev_char}/{name}", link_target(f"{real_char}/{name}", snap.real_path(n.path)), n.device,
                   f"{dev_char} exists and is not a directory")
            for name, n in desired.items()
        ]
    return [link_action(snap, name, node) for name, node in desired.items()] + stale_links(snap, desired)


def _real_char(snap: HostSnapshot) -> str:
    # link text is computed between where things really are (dev-char dir and nodes
    # resolved confined to the root), so a symlinked /dev/char still gets links that resolve
    return snap.dev_char_real or snap.dev_char_path


def desired_links(nodes: list[NvidiaNode]) -> dict[str, NvidiaNode]:
    """"M:m" -> the node its link should name, in device-number order (the canonical node of a shared rdev)."""
    by_rdev: dict[tuple[int, int], NvidiaNode] = {}
    get = by_rdev.get
    for node in nodes:
        key = node[2:]  # (node.major, node.minor): thousands per pass
        have = get(key)
        if have is None or _preference(node) < _preference(have):
            by_rdev[key] = node
    return {f"{major}:{minor}": node for (major, minor), node in sorted(by_rdev.items())}  # keys unique


def link_action(snap: HostSnapshot, name: str, node: NvidiaNode) -> Action:
    """What to do at one desired link: create, keep, replace ours, or leave someone else's alone."""
    link = f"{snap.dev_char_path}/{name}"
    want = link_target(f"{_real_char(snap)}/{name}", snap.real_path(node.path))
    entry = snap.entries.get(name)
    if entry is None:
        return Action(CREATE, link, want, node.device, f"no link for {node.path}")
    if entry.kind != "symlink":
        return Action(CONFLICT, link, want, node.device, f"a {entry.kind} is in the way (not ours, left alone)")
    if entry.resolved == (node.major, node.minor):
        why = "link is exact" if entry.link_text == want else f"link resolves to {node.device} (target {entry.link_text})"
        return Action(KEEP, link, entry.link_text, node.device, why)
    if entry.target is not None and is_nvidia_path(entry.target):  # a symlink's target is always known
        return Action(REPLACE, link, want, node.device, _broken(entry), previous=entry.link_text)
    return Action(CONFLICT, link, want, node.device, f"foreign symlink to {entry.link_text} (not ours, left alone)")


def stale_links(snap: HostSnapshot, desired: dict[str, NvidiaNode]) -> list[Action]:
    """Our links at names no node wants: removed when broken or when their major is no NVIDIA one any more."""
    majors = snap.majors.nvidia_majors
    others = [(name, entry) for name, entry in snap.entries.items() if name not in desired]
    actions = []
    for name, entry in sorted(others, key=lambda item: item[1].rdev_name):
        if entry.kind != "symlink" or entry.target is None or not is_nvidia_path(entry.target):
            continue
        major = entry.rdev_name[0]
        broken = entry.resolved != entry.rdev_name
        if broken or major not in majors:
            why = _broken(entry) if broken else f"major {major} is no longer an NVIDIA major"
            actions.append(Action(REMOVE, f"{snap.dev_char_path}/{name}", None, Device.char(*entry.rdev_name), why,
                                  previous=entry.link_text))
    return actions


def foreign_links(dev_char_state: str, entries: dict[str, DevCharEntry],
                  conflicts: Iterable[Action]) -> list[tuple[Action, DevCharEntry]]:
    """Conflicts where someone else's symlink holds a desired path -> [(Action, DevCharEntry)].

    From a snapshot's dev_char_state and entries and a plan's conflicts. systemd resolves
    DeviceAllow=/dev/char/M:m through that link, so a scope gets the device it points at
    (or none), not M:m.
    """
    out: list[tuple[Action, DevCharEntry]] = []
    if dev_char_state != "dir":
        return out
    for a in conflicts:
        entry = entries.get(a.link.rpartition("/")[2]) if a.link else None
        if entry is not None and entry.kind == "symlink":
            out.append((a, entry))
    return out


class WantedNode(NamedTuple):
    node: NvidiaNode
    ownership: NodeOwnership
    reason: str


def plan_nodes(snap: HostSnapshot) -> tuple[list[Action], list[NvidiaNode], list[str]]:
    """Nodes the driver says should exist but do not -> (actions, nodes, notes)."""
    base = dev_dir(snap.driver_root)
    frontend, frontend_notes = _frontend_nodes(snap, base)
    uvm, uvm_notes = _uvm_nodes(snap, base)
    caps, caps_notes = _cap_nodes(snap, base)
    actions, planned = _node_actions(snap, frontend + uvm + caps)
    return actions, planned, frontend_notes + uvm_notes + caps_notes


def _frontend_nodes(snap: HostSnapshot, base: str) -> tuple[list[WantedNode], list[str]]:
    """nvidiactl, nvidia-modeset and one node per GPU, on the nvidia major -> (wanted, notes)."""
    majors, driver, own = snap.majors, snap.driver, snap.driver.ownership
    frontend = majors.frontend()
    if frontend is None:
        if driver.gpus or driver.loaded_modules:
            return [], ["no 'nvidia' character major in /proc/devices: load the driver (modprobe nvidia)"]
        return [], ["NVIDIA driver not loaded (no 'nvidia' major in /proc/devices): no nodes to create"]
    wanted = [WantedNode(NvidiaNode(f"{base}/nvidiactl", "ctl", frontend, 255), own,
                         "control node of the loaded nvidia driver")]
    if "nvidia-modeset" in majors.by_name or driver.module_loaded("nvidia_modeset"):
        wanted.append(WantedNode(NvidiaNode(f"{base}/nvidia-modeset", "modeset", frontend, 254), own,
                                 "nvidia_modeset module is loaded"))
    for gpu in driver.gpus:
        wanted.append(WantedNode(NvidiaNode(f"{base}/nvidia{gpu.minor}", "gpu", frontend, gpu.minor), own,
                                 f"driver reports GPU {gpu.pci} with minor {gpu.minor}"))
    return wanted, []


def _uvm_nodes(snap: HostSnapshot, base: str) -> tuple[list[WantedNode], list[str]]:
    """nvidia-uvm and nvidia-uvm-tools once the nvidia-uvm major is registered -> (wanted, notes)."""
    uvm, own = snap.majors.major("nvidia-uvm"), snap.driver.ownership
    if uvm is not None:
        return [WantedNode(NvidiaNode(f"{base}/nvidia-uvm", "uvm", uvm, 0), own, "nvidia-uvm major is registered"),
                WantedNode(NvidiaNode(f"{base}/nvidia-uvm-tools", "uvm-tools", uvm, 1), own,
                           "nvidia-uvm major is registered")], []
    if snap.majors.frontend() is not None:
        return [], ["nvidia-uvm is not loaded (modprobe nvidia-uvm): /dev/nvidia-uvm not created; CUDA needs it"]
    return [], []


def _cap_nodes(snap: HostSnapshot, base: str) -> tuple[list[WantedNode], list[str]]:
    """One node per MIG capability the driver lists, on the nvidia-caps major -> (wanted, notes)."""
    driver, caps = snap.driver, snap.majors.major("nvidia-caps")
    if not driver.mig_minors:
        return [], []
    if caps is None:
        return [], ["mig-minors lists capabilities but no 'nvidia-caps' major: load nvidia with MIG support"]
    wanted, notes = [], []
    for cap, minor in sorted(driver.mig_minors.items(), key=lambda kv: kv[1]):
        path = f"{base}/nvidia-caps/nvidia-cap{minor}"
        ownership = driver.cap_ownership.get(cap)
        if ownership is None:
            # its mode is the capability's access control: never guessed (the driver-wide 0666 would open it)
            if path not in snap.existing_paths:
                notes.append(f"MIG capability {cap}: its mode cannot be read under /proc/driver/nvidia/capabilities: "
                             f"{path} not created (the mode is its access control; nvidia-modprobe makes it)")
            continue
        wanted.append(WantedNode(NvidiaNode(path, "cap", caps, minor), ownership, f"MIG capability {cap}"))
    return wanted, notes


def _node_actions(snap: HostSnapshot, wanted: list[WantedNode]) -> tuple[list[Action], list[NvidiaNode]]:
    """create-node for each wanted node missing from the host; a conflict where something else holds its path."""
    existing = {n.path for n in snap.nodes}
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
    return actions, planned


def _preference(node: NvidiaNode) -> tuple[int, str]:
    # When two nodes share a device number, link the canonical one (shortest path, then name).
    return (len(node.path), node.path)


def _broken(entry: DevCharEntry) -> str:
    if entry.resolved_kind == "missing":
        return f"dangling link to {entry.link_text}"
    if entry.resolved_kind == "char" and entry.resolved is not None:
        return f"link to {entry.link_text} resolves to {Device.char(*entry.resolved)}, not {Device.char(*entry.rdev_name)}"
    return f"link to {entry.link_text} does not resolve to a character device"
