"""Reading OCI specs and runtime state files safely, and what they say about devices.

Bundles and state directories live on the host, but sizes are still bounded
and the last path component is opened with O_NOFOLLOW: a file swapped for a
symlink is refused, never followed. Everything is parsed defensively: a
malformed entry is skipped and noted, never fatal for the whole container.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field

MAX_JSON_BYTES = 16 << 20  # runc's state.json embeds the seccomp profile: tens of KiB, rarely MiBs
MAX_SMALL_BYTES = 64 << 10  # /proc/<pid>/cgroup, pid files, unit files
FRONTEND_MAJOR = 195  # /dev/nvidia0..N, nvidiactl, nvidia-modeset on every driver branch
NVIDIA_HOOK = "nvidia-container-runtime-hook"
CDI_ANNOTATION = "cdi.k8s.io/"
# besides cdi.k8s.io/*: Podman's marker, and the names containers.py shows (CRI, then dockershim labels)
KEPT_ANNOTATIONS = frozenset({
    "io.container.manager",
    "io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name",
    "io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name",
})
RUNE_TYPES = {97: "a", 98: "b", 99: "c", 112: "p", 117: "u"}  # runc writes rule types as Go runes


class UnsafeFile(OSError):
    """A file that is not a plain file, or too large: not read."""


def read_bounded(real_path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """Read a regular file without following a final symlink, at most `limit` bytes."""
    fd = os.open(real_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{real_path}: not a regular file")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafeFile(f"{real_path}: larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def read_json(real_path: str, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a bounded, non-symlink file; ValueError if it is not one."""
    doc = json.loads(read_bounded(real_path, limit).decode("utf-8", errors="replace"))
    if not isinstance(doc, dict):
        raise ValueError(f"{real_path}: not a JSON object")
    return doc


@dataclass(frozen=True)
class DeviceRule:
    """One device cgroup rule; major/minor None means the wildcard `*`."""

    allow: bool
    type: str  # a, c, b
    major: int | None
    minor: int | None
    access: str  # subset of "rwm"

    def matches(self, dev_type: str, major: int, minor: int) -> bool:
        if self.type != "a" and self.type != dev_type:
            return False
        if self.major is not None and self.major != major:
            return False
        return self.minor is None or self.minor == minor

    def __str__(self) -> str:
        def num(n):
            return "*" if n is None else str(n)
        verb = "allow" if self.allow else "deny"
        return f"{verb} {self.type} {num(self.major)}:{num(self.minor)} {self.access}"


@dataclass(frozen=True)
class DeviceNode:
    """A node the runtime creates inside the container (linux.devices)."""

    path: str
    type: str
    major: int
    minor: int


@dataclass(frozen=True)
class SpecFacts:
    """What an OCI config.json says about devices and GPUs (only what we need)."""

    rules: tuple = ()  # DeviceRule, linux.resources.devices in order
    nodes: tuple = ()  # DeviceNode, linux.devices
    visible_devices: str | None = None  # NVIDIA_VISIBLE_DEVICES from process.env
    hooks: tuple = ()  # hook paths (every hook kind)
    annotations: dict = field(default_factory=dict)  # cdi.k8s.io/* and KEPT_ANNOTATIONS only
    cgroups_path: str | None = None
    root_path: str | None = None
    problems: tuple = ()


@dataclass(frozen=True)
class RuntimeState:
    """runc's state.json or crun's status file: pid, cgroups, the rules runc programmed."""

    init_pid: int | None
    init_start: int | None  # /proc/<pid>/stat field 22, to tell a reused pid
    cgroup_paths: dict = field(default_factory=dict)  # controller -> real path ("" for v2)
    rules: tuple | None = None  # DeviceRule from config.cgroups.devices (None: crun, not recorded)
    nodes: tuple = ()
    bundle: str | None = None
    hooks: tuple = ()
    systemd_cgroup: bool | None = None
    scope: str | None = None
    problems: tuple = ()


def _int(value, lo: int = 0, hi: int = (1 << 32) - 1) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return None
    return value


def _access(value) -> str | None:
    if value is None:
        return "rwm"
    if not isinstance(value, str) or len(value) > 3 or set(value) - set("rwm"):
        return None
    return "".join(c for c in "rwm" if c in value)


def parse_spec_rule(item) -> DeviceRule | None:
    """One linux.resources.devices entry (absent type/major/minor mean wildcard)."""
    if not isinstance(item, dict) or not isinstance(item.get("allow"), bool):
        return None
    dev_type = item.get("type", "a")
    if dev_type not in ("a", "c", "b"):
        return None
    major, minor = item.get("major"), item.get("minor")
    major = None if major is None or major == -1 else _int(major)
    minor = None if minor is None or minor == -1 else _int(minor)
    if (item.get("major") not in (None, -1) and major is None) or (item.get("minor") not in (None, -1) and minor is None):
        return None
    access = _access(item.get("access"))
    if access is None:
        return None
    return DeviceRule(item["allow"], dev_type, major, minor, access)


def parse_state_rule(item) -> DeviceRule | None:
    """One libcontainer cgroups.devices entry: type as a rune, -1 for wildcard."""
    if not isinstance(item, dict) or not isinstance(item.get("allow"), bool):
        return None
    dev_type = RUNE_TYPES.get(item.get("type"))
    if dev_type not in ("a", "c", "b"):
        return None
    major, minor = _int(item.get("major"), -1), _int(item.get("minor"), -1)
    if major is None or minor is None:
        return None
    access = _access(item.get("permissions") or "")
    if access is None:
        return None
    return DeviceRule(item["allow"], dev_type, None if major == -1 else major, None if minor == -1 else minor, access)


def _node(item, type_key, rune: bool) -> DeviceNode | None:
    if not isinstance(item, dict) or not isinstance(item.get("path"), str):
        return None
    dev_type = RUNE_TYPES.get(item.get(type_key)) if rune else item.get(type_key)
    major, minor = _int(item.get("major")), _int(item.get("minor"))
    if dev_type not in ("c", "b") or major is None or minor is None:
        return None
    return DeviceNode(item["path"][:4096], dev_type, major, minor)


def _hook_paths(hooks) -> tuple:
    out = []
    if isinstance(hooks, dict):
        for items in hooks.values():
            if not isinstance(items, list):
                continue
            for h in items[:256]:
                if isinstance(h, dict) and isinstance(h.get("path"), str):
                    out.append(h["path"][:4096])
    return tuple(out)


def parse_spec(doc: dict) -> SpecFacts:
    problems = []
    linux = doc.get("linux") if isinstance(doc.get("linux"), dict) else {}
    resources = linux.get("resources") if isinstance(linux.get("resources"), dict) else {}
    rules = []
    raw_rules = resources.get("devices") or []
    for item in raw_rules if isinstance(raw_rules, list) else []:
        rule = parse_spec_rule(item)
        if rule is None:
            problems.append(f"skipped malformed linux.resources.devices entry {str(item)[:80]}")
        else:
            rules.append(rule)
    nodes = []
    raw_nodes = linux.get("devices") or []
    for item in raw_nodes if isinstance(raw_nodes, list) else []:
        node = _node(item, "type", rune=False)
        if node is not None:
            nodes.append(node)
    visible = None
    process = doc.get("process") if isinstance(doc.get("process"), dict) else {}
    env = process.get("env") if isinstance(process.get("env"), list) else []
    for entry in env:
        if isinstance(entry, str) and entry.startswith("NVIDIA_VISIBLE_DEVICES="):
            visible = entry.split("=", 1)[1][:1024]  # the last one wins, as in execve's environment
    annotations = {}
    raw_ann = doc.get("annotations") if isinstance(doc.get("annotations"), dict) else {}
    for key, value in raw_ann.items():
        if isinstance(key, str) and isinstance(value, str) and (
                key.startswith(CDI_ANNOTATION) or key in KEPT_ANNOTATIONS):
            annotations[key[:256]] = value[:1024]
    cgroups_path = linux.get("cgroupsPath") if isinstance(linux.get("cgroupsPath"), str) else None
    root = doc.get("root") if isinstance(doc.get("root"), dict) else {}
    root_path = root.get("path") if isinstance(root.get("path"), str) else None
    return SpecFacts(tuple(rules), tuple(nodes), visible, _hook_paths(doc.get("hooks")), annotations,
                     cgroups_path, root_path, tuple(problems))


def parse_runc_state(doc: dict) -> RuntimeState:
    """runc's state.json (also used by Docker's and containerd's runc roots)."""
    problems = []
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    cgroups = config.get("cgroups") if isinstance(config.get("cgroups"), dict) else {}
    rules = []
    raw = cgroups.get("devices") or []
    for item in raw if isinstance(raw, list) else []:
        rule = parse_state_rule(item)
        if rule is None:
            problems.append(f"skipped malformed cgroups.devices entry {str(item)[:80]}")
        else:
            rules.append(rule)
    nodes = tuple(n for n in (_node(i, "type", rune=True) for i in (config.get("devices") or [])
                              if isinstance(config.get("devices"), list)) if n is not None)
    paths = doc.get("cgroup_paths") if isinstance(doc.get("cgroup_paths"), dict) else {}
    bundle = None
    for label in config.get("labels") or []:
        if isinstance(label, str) and label.startswith("bundle="):
            bundle = label[len("bundle="):]
    systemd = cgroups.get("Systemd")
    scope = None
    if systemd is True and isinstance(cgroups.get("name"), str) and isinstance(cgroups.get("scope_prefix"), str):
        scope = f"{cgroups['scope_prefix']}-{cgroups['name']}.scope"
    return RuntimeState(
        init_pid=_int(doc.get("init_process_pid"), 1),
        init_start=_int(doc.get("init_process_start"), 0, (1 << 63) - 1),
        cgroup_paths={k: v for k, v in paths.items() if isinstance(k, str) and isinstance(v, str)},
        rules=tuple(rules),
        nodes=nodes,
        bundle=bundle,
        hooks=_hook_paths(config.get("Hooks")),
        systemd_cgroup=systemd if isinstance(systemd, bool) else None,
        scope=scope,
        problems=tuple(problems),
    )


def parse_crun_status(doc: dict) -> RuntimeState:
    """crun's `status` file: no device rules (crun keeps the spec in config.json beside it)."""
    scope = doc.get("scope") if isinstance(doc.get("scope"), str) and doc.get("scope") else None
    cgroup = doc.get("cgroup-path") if isinstance(doc.get("cgroup-path"), str) else None
    return RuntimeState(
        init_pid=_int(doc.get("pid"), 1),
        init_start=_int(doc.get("process-start-time"), 0, (1 << 63) - 1),
        cgroup_paths={"": cgroup} if cgroup else {},
        rules=None,
        bundle=doc.get("bundle") if isinstance(doc.get("bundle"), str) else None,
        systemd_cgroup=doc.get("systemd-cgroup") if isinstance(doc.get("systemd-cgroup"), bool) else None,
        scope=scope,
    )


def is_void(visible: str | None) -> bool:
    return visible is None or visible.strip().lower() in ("", "void", "none")


def gpu_signs(spec: SpecFacts | None, state: RuntimeState | None, nvidia_majors: frozenset) -> list:
    """Why this container counts as a GPU container (empty: it does not)."""
    signs = []
    majors = nvidia_majors | {FRONTEND_MAJOR}
    if spec is not None:
        if not is_void(spec.visible_devices):
            signs.append(f"NVIDIA_VISIBLE_DEVICES={spec.visible_devices}")
        for key in sorted(spec.annotations):
            if key.startswith(CDI_ANNOTATION):
                signs.append(f"annotation {key}")
                break
    hooks = (spec.hooks if spec else ()) + (state.hooks if state else ())
    if any(os.path.basename(h) == NVIDIA_HOOK or NVIDIA_HOOK in h for h in hooks):
        signs.append(f"{NVIDIA_HOOK} hook")
    nodes = (spec.nodes if spec else ()) + (state.nodes if state else ())
    for node in nodes:
        if node.type == "c" and node.major in majors:
            signs.append(f"device {node.path} (c {node.major}:{node.minor})")
            break
    rules = (spec.rules if spec else ()) + ((state.rules or ()) if state else ())
    for rule in rules:
        if rule.allow and rule.type == "c" and rule.major in majors:
            signs.append(f"device rule {rule}")
            break
    return signs
