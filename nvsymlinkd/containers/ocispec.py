"""Reading OCI specs and runtime state files safely, and what they say about devices.

Bundles and state directories live on the host, but sizes are still bounded
and the last path component is opened with O_NOFOLLOW: a file swapped for a
symlink is refused, never followed. Everything is parsed defensively: a field
the verdict depends on that has the wrong type makes the whole file unreadable
(ValueError: the container is `unknown`, never judged on a guess); a malformed
entry of a list is skipped and noted in `problems` (the caller treats those as
unreadable too). No input raises anything but OSError or ValueError.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field

from nvsymlinkd.containers.model import CDI_ANNOTATION
from nvsymlinkd.host.devices import RWM, Access, Device, Rule
from nvsymlinkd.host.root import file_kind, read_at_most, unsafe
from nvsymlinkd.text import bounded

MAX_JSON_BYTES = 16 << 20  # runc's state.json embeds the seccomp profile: tens of KiB, rarely MiBs
MAX_SMALL_BYTES = 64 << 10  # /proc/<pid>/cgroup, pid files, unit files
FRONTEND_MAJOR = 195  # /dev/nvidia0..N, nvidiactl, nvidia-modeset on every driver branch
NVIDIA_HOOK = "nvidia-container-runtime-hook"
# besides cdi.k8s.io/*: Podman's marker, and the names containers.py shows (CRI, then dockershim labels)
KEPT_ANNOTATIONS = frozenset({
    "io.container.manager",
    "io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name",
    "io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name",
})
RUNE_TYPES = {97: "a", 98: "b", 99: "c", 112: "p", 117: "u"}  # runc writes rule types as Go runes
# the toolkit's device-list-as-volume-mounts root (internal/config/image/cuda_image.go)
DEVICE_LIST_MOUNTS = "/var/run/nvidia-container-devices"


def read_bounded(real_path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """Read a regular file without following a final symlink, at most `limit` bytes."""
    fd = open_regular(real_path)
    try:
        return read_fd(fd, real_path, limit)
    finally:
        os.close(fd)


def open_regular(real_path: str) -> int:
    """An fd on a file, never through a final symlink (ELOOP), never blocking on a fifo."""
    return os.open(real_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)


def read_fd(fd: int, real_path: str, limit: int = MAX_JSON_BYTES, st: os.stat_result | None = None) -> bytes:
    """The content of an open regular file, at most `limit` bytes (st: its fstat, when already taken)."""
    st = st or os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise unsafe(real_path, f"not a regular file (a {file_kind(st.st_mode)})")
    return read_at_most(fd, real_path, limit)


def read_json(real_path: str, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a bounded, non-symlink file; ValueError if it is not one."""
    return loads_object(read_bounded(real_path, limit).decode("utf-8", errors="replace"))


def load_json(real_path: str, parse=None, limit: int = MAX_JSON_BYTES):
    """parse(read_json(real_path)) (the object itself without parse), read afresh.

    verify.cache.FileCache.load has the same signature and answers from memory while the file is unchanged.
    """
    doc = read_json(real_path, limit)
    return parse(doc) if parse is not None else doc


def loads_object(text: str) -> dict:
    """A JSON object, or ValueError with a one-line reason (nesting too deep, huge numbers, not an object)."""
    try:
        doc = json.loads(text)
    except RecursionError:
        # the C decoder recurses per nesting level and stops at Python's recursion limit; real
        # runtime files nest a dozen levels
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not a JSON object (a JSON {_json_type(doc)})")
    return doc


def _json_type(value) -> str:
    for kind, name in ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def _field(obj: dict, key: str, kind: type, where: str):
    """obj[key] if it has the JSON type `kind`; None when absent or null; ValueError otherwise."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        want = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer"}[kind]
        raise ValueError(f"{where}{key} is {_article(_json_type(value))}, not {want}")
    return value


def _article(json_type: str) -> str:
    return f"an {json_type}" if json_type in ("array", "object") else f"a {json_type}"


def _brief(item) -> str:
    """A short, non-recursive rendering of an entry for messages (str() of a deep list recurses)."""
    if isinstance(item, dict):
        return "{" + ", ".join(f"{k[:20]!r}: {_brief_scalar(v)}" for k, v in list(item.items())[:6]) + "}"
    return _brief_scalar(item)


def _brief_scalar(value) -> str:
    if isinstance(value, (dict, list)):
        return f"<{_json_type(value)}>"
    if isinstance(value, int) and not isinstance(value, bool) and not -(10 ** 30) < value < 10 ** 30:
        return "<huge number>"  # str() of a 5,000-digit int raises ValueError on Python >= 3.11
    text = repr(value[:41] if isinstance(value, str) else value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class DeviceNode:
    """A node the runtime creates inside the container (linux.devices)."""

    path: str
    type: str
    major: int
    minor: int

    @property
    def device(self) -> Device:
        return Device(self.type, self.major, self.minor)


@dataclass(frozen=True)
class SpecFacts:
    """What an OCI config.json says about devices and GPUs (only what we need)."""

    rules: tuple = ()  # Rule, linux.resources.devices in order
    nodes: tuple = ()  # DeviceNode, linux.devices
    visible_devices: str | None = None  # NVIDIA_VISIBLE_DEVICES from process.env
    hooks: tuple = ()  # hook paths (every hook kind)
    annotations: dict = field(default_factory=dict)  # cdi.k8s.io/* and KEPT_ANNOTATIONS only
    cgroups_path: str | None = None
    root_path: str | None = None
    problems: tuple = ()
    # what the NVIDIA hook reads (containers.hookgrant): every hook as (kind, path, args, env), process.env
    # whole and uncut (the last of each name wins, as in the hook's map; the config's swarm-resource can
    # name any variable), the destinations of /dev/null mounts under DEVICE_LIST_MOUNTS as Go's
    # filepath.Clean makes them, and whether the bounding set holds CAP_SYS_ADMIN (privileged)
    hook_entries: tuple = ()
    env: dict = field(default_factory=dict)
    device_list_mounts: tuple = ()
    privileged: bool = False


@dataclass(frozen=True)
class RuntimeState:
    """runc's state.json or crun's status file: pid, cgroups, the rules runc programmed."""

    init_pid: int | None
    init_start: int | None  # /proc/<pid>/stat field 22, to tell a reused pid
    cgroup_paths: dict = field(default_factory=dict)  # controller -> real path ("" for v2)
    rules: tuple | None = None  # Rule from config.cgroups.devices (None: crun, not recorded)
    nodes: tuple = ()
    bundle: str | None = None
    hooks: tuple = ()
    systemd_cgroup: bool | None = None
    scope: str | None = None
    problems: tuple = ()
    # runc's state.json without a `config` (null or absent) or with `config.cgroups.devices` null: what
    # runc programmed and the bundle are unknown (the rules are then None, as for crun)
    config_missing: str | None = None


def _int(value, lo: int = 0, hi: int = (1 << 32) - 1) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return None
    return value


def _access(value) -> Access | None:
    if value is None:
        return RWM
    if not isinstance(value, str) or len(value) > 3 or not Access.valid(value):
        return None
    return Access(value)


def parse_spec_rule(item) -> Rule | None:
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
    return Rule(item["allow"], dev_type, major, minor, access)


def parse_state_rule(item) -> Rule | None:
    """One libcontainer cgroups.devices entry: type as a rune, -1 for wildcard."""
    if not isinstance(item, dict) or not isinstance(item.get("allow"), bool):
        return None
    dev_type = _rune(item.get("type"))
    if dev_type not in ("a", "c", "b"):
        return None
    major, minor = _int(item.get("major"), -1), _int(item.get("minor"), -1)
    if major is None or minor is None:
        return None
    access = _access(item.get("permissions") or "")
    if access is None:
        return None
    return Rule(item["allow"], dev_type, None if major == -1 else major, None if minor == -1 else minor, access)


def _rune(value) -> str | None:
    """A Go rune (int) as its letter; None for anything else (a list is unhashable: never a dict key)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return RUNE_TYPES.get(value)


def _node(item, type_key, rune: bool):
    """A DeviceNode; None for a node kind we do not track (fifo, unbuffered); False when malformed."""
    if not isinstance(item, dict) or not isinstance(item.get("path"), str):
        return False
    raw_type = item.get(type_key)
    dev_type = _rune(raw_type) if rune else (raw_type if isinstance(raw_type, str) else None)
    if dev_type in ("p", "u"):
        return None  # fifos and unbuffered char devices carry no device number we care about
    major, minor = _int(item.get("major")), _int(item.get("minor"))
    if dev_type not in ("c", "b") or major is None or minor is None:
        return False
    return DeviceNode(item["path"][:4096], dev_type, major, minor)


def _nodes(raw, rune: bool, where: str, problems: list) -> tuple:
    out = []
    for item in raw or ():
        node = _node(item, "type", rune)
        if node is False:
            problems.append(f"skipped malformed {where} entry {_brief(item)}")
        elif node is not None:
            out.append(node)
    return tuple(out)


def _hook_paths(hooks, where: str) -> tuple:
    """Every hook's path; ValueError when the hooks are not the object of arrays of objects runc reads."""
    out: list = []
    for kind, items in (hooks or {}).items():
        if items is None:
            continue
        if not isinstance(items, list):
            raise ValueError(f"{where}.{kind[:40]} is {_article(_json_type(items))}, not an array")
        for h in items:
            path = _field(h, "path", str, f"{where}.{kind[:40]}[].") if isinstance(h, dict) else None
            if path is None:
                raise ValueError(f"{where}.{kind[:40]} has an entry without a path: {_brief(h)}")
            if len(out) < 256:
                out.append(path[:4096])
    return tuple(out)


def _hook_entries(hooks) -> tuple:
    """(kind, path, args, env) of every hook, for the NVIDIA hook's reconstruction; _hook_paths checked the
    shape. env absent or null stays None (runc and crun then run the hook with their own environment), apart
    from `[]` (an empty one). args, or env present and not an array of strings: args None, so no NVIDIA hook
    entry is read from it (runc would have refused such a spec: encoding/json fails on it)."""
    out: list = []
    for kind, items in (hooks or {}).items():
        for h in items or ():
            if len(out) >= 256:
                return tuple(out)
            args, env = h.get("args"), h.get("env")
            env_ok = env is None or (isinstance(env, list) and len(env) <= 256 and all(isinstance(e, str) for e in env))
            ok = env_ok and isinstance(args, list) and len(args) <= 64 and all(isinstance(a, str) for a in args)
            out.append((str(kind)[:40], h["path"][:4096], tuple(a[:4096] for a in args) if ok else None,
                        tuple(e[:4096] for e in env) if isinstance(env, list) and env_ok else None))
    return tuple(out)


def _device_list_mounts(mounts) -> tuple:
    """Destinations of /dev/null bind mounts under DEVICE_LIST_MOUNTS (the toolkit's DevicesFromMounts,
    internal/config/image/cuda_image.go: source and destination through Go's filepath.Clean, which makes
    "//dev/null" "/dev/null" where os.path.normpath keeps the two slashes)."""
    from nvsymlinkd.containers.hookgrant import go_clean

    out: list = []
    for m in mounts if isinstance(mounts, list) else ():
        if not isinstance(m, dict) or not isinstance(m.get("source"), str) or not isinstance(m.get("destination"), str):
            continue
        if go_clean(m["source"]) != "/dev/null":
            continue
        dest = go_clean(m["destination"])
        if dest.startswith(DEVICE_LIST_MOUNTS) and dest not in out and len(out) < 256:
            out.append(dest[:4096])
    return tuple(out)


def _privileged(process: dict) -> bool:
    """CAP_SYS_ADMIN in the bounding set: the toolkit's IsPrivileged (internal/config/image/privileged.go)."""
    caps = process.get("capabilities")
    bounding = caps.get("bounding") if isinstance(caps, dict) else None
    return isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding


def _rules(items, parse, where: str, problems: list) -> list:
    """The device rules of a list (None: absent); each malformed entry skipped and noted in `problems`."""
    rules = []
    for item in items or ():
        rule = parse(item)
        if rule is None:
            problems.append(f"skipped malformed {where} entry {_brief(item)}")
        else:
            rules.append(rule)
    return rules


def parse_spec(doc: dict) -> SpecFacts:
    """What a config.json says; ValueError when a field the verdict reads has the wrong JSON type
    (runc would have refused such a spec: the file is not what the container was made from)."""
    problems: list[str] = []
    linux = _field(doc, "linux", dict, "") or {}
    resources = _field(linux, "resources", dict, "linux.") or {}
    rules = _rules(_field(resources, "devices", list, "linux.resources."), parse_spec_rule,
                   "linux.resources.devices", problems)
    nodes = _nodes(_field(linux, "devices", list, "linux."), False, "linux.devices", problems)
    visible = None
    env: dict = {}
    process = _field(doc, "process", dict, "") or {}
    for entry in _field(process, "env", list, "process.") or ():
        if not isinstance(entry, str):
            raise ValueError(f"process.env has an entry that is {_article(_json_type(entry))}, not a string")
        name, sep, value = entry.partition("=")
        if sep:
            env[name] = value  # the last one wins, as in the hook's map; never cut (a `void` may come last)
        if entry.startswith("NVIDIA_VISIBLE_DEVICES="):
            visible = entry.split("=", 1)[1]
    annotations = {}
    for key, value in (_field(doc, "annotations", dict, "") or {}).items():
        if not isinstance(value, str):
            raise ValueError(f"annotations.{key[:40]} is {_article(_json_type(value))}, not a string")
        if key.startswith(CDI_ANNOTATION) or key in KEPT_ANNOTATIONS:
            annotations[key[:256]] = value[:1024]
    cgroups_path = _field(linux, "cgroupsPath", str, "linux.")
    root_path = _field(_field(doc, "root", dict, "") or {}, "path", str, "root.")
    hooks = _field(doc, "hooks", dict, "")
    return SpecFacts(tuple(rules), nodes, visible, _hook_paths(hooks, "hooks"),
                     annotations, cgroups_path, root_path, tuple(problems), _hook_entries(hooks), env,
                     _device_list_mounts(doc.get("mounts")), _privileged(process))


def _pid_field(doc: dict, key: str) -> int:
    """The init pid: required, a positive integer that fits a pid_t."""
    value = doc.get(key)
    pid = _int(value, 1, (1 << 31) - 1)
    if pid is None:
        shown = "missing" if key not in doc else f"{_brief_scalar(value)}, not a pid"
        raise ValueError(f"{key} is {shown}")
    return pid


def _start_field(doc: dict, key: str) -> int | None:
    if doc.get(key) is None:
        return None
    start = _int(doc.get(key), 0, (1 << 63) - 1)
    if start is None:
        raise ValueError(f"{key} is {_brief_scalar(doc.get(key))}, not a start time in clock ticks")
    return start


def parse_runc_state(doc: dict) -> RuntimeState:
    """runc's state.json (also used by Docker's and containerd's runc roots)."""
    problems: list[str] = []
    config = _field(doc, "config", dict, "")
    missing = None
    if config is None:
        missing = f"`config` is {'null' if 'config' in doc else 'missing'}"
        config = {}
    cgroups = _field(config, "cgroups", dict, "config.") or {}
    raw_rules = _field(cgroups, "devices", list, "config.cgroups.")
    if raw_rules is None and missing is None:
        missing = "`config.cgroups.devices` is null"
    rules = _rules(raw_rules, parse_state_rule, "cgroups.devices", problems)
    nodes = _nodes(_field(config, "devices", list, "config."), True, "config.devices", problems)
    paths = _field(doc, "cgroup_paths", dict, "") or {}
    bundle = None
    for label in _field(config, "labels", list, "config.") or ():
        if isinstance(label, str) and label.startswith("bundle="):
            bundle = label[len("bundle="):]
    systemd = _field(cgroups, "Systemd", bool, "config.cgroups.")
    scope = None
    if systemd is True and isinstance(cgroups.get("name"), str) and isinstance(cgroups.get("scope_prefix"), str):
        scope = f"{cgroups['scope_prefix']}-{cgroups['name']}.scope"
    return RuntimeState(
        init_pid=_pid_field(doc, "init_process_pid"),
        init_start=_start_field(doc, "init_process_start"),
        cgroup_paths={k: v for k, v in paths.items() if isinstance(v, str)},
        rules=tuple(rules) if missing is None else None,
        nodes=nodes,
        bundle=bundle,
        hooks=_hook_paths(_field(config, "Hooks", dict, "config."), "config.Hooks"),
        systemd_cgroup=systemd,
        scope=scope,
        problems=tuple(problems),
        config_missing=missing,
    )


def parse_crun_status(doc: dict) -> RuntimeState:
    """crun's `status` file: no device rules (crun keeps the spec in config.json beside it)."""
    scope = doc.get("scope") if isinstance(doc.get("scope"), str) and doc.get("scope") else None
    cgroup = doc.get("cgroup-path") if isinstance(doc.get("cgroup-path"), str) else None
    return RuntimeState(
        init_pid=_pid_field(doc, "pid"),
        init_start=_start_field(doc, "process-start-time"),
        cgroup_paths={"": cgroup} if cgroup else {},
        rules=None,
        bundle=doc.get("bundle") if isinstance(doc.get("bundle"), str) else None,
        systemd_cgroup=doc.get("systemd-cgroup") if isinstance(doc.get("systemd-cgroup"), bool) else None,
        scope=scope,
    )


# containers.runtimes.StateFormat.parser -> the reader of that runtime's state file
STATE_PARSERS = {"runc": parse_runc_state, "crun": parse_crun_status}


def is_void(visible: str | None) -> bool:
    return visible is None or visible.strip().lower() in ("", "void", "none")


def gpu_signs(spec: SpecFacts | None, state: RuntimeState | None, nvidia_majors: frozenset) -> list:
    """Why this container counts as a GPU container (empty: it does not)."""
    signs = []
    majors = nvidia_majors | {FRONTEND_MAJOR}
    if spec is not None:
        if not is_void(spec.visible_devices):
            signs.append(f"NVIDIA_VISIBLE_DEVICES={bounded(spec.visible_devices or '')}")  # shown: decided whole
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
            signs.append(f"device {node.path} ({node.device})")
            break
    rules = (spec.rules if spec else ()) + ((state.rules or ()) if state else ())
    for rule in rules:
        if rule.allow and rule.type == "c" and rule.major in majors:
            signs.append(f"device rule {rule.describe()}")
            break
    return signs
