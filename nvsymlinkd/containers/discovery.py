"""Discovery of running containers from the runtimes' own state on disk.

Sources, all under --root, as the runtime table (containers.runtimes, docs/runtimes.md) lists them:
the OCI runtimes' state roots (<root>[/<namespace>]/<id>/, with runc's state.json or crun's status),
the bundle roots (<root>[/<namespace>]/<id>[/userdata]/config.json and a pid file), and plain runc's
bundle from its state's label. One container may show in several; they are merged by id (and namespace).

Names, for people (display, the CONTAINER argument, journal fields, metric labels; never for a
decision): Kubernetes pod namespace/name and container name from the spec's CRI annotations
(dockershim's labels for Docker), Docker's name from <data-root>/containers/<id>/config.v2.json,
Podman's from containers/storage's containers.json. Untrusted input: bounded reads, only names
that look like names are kept, anything else means no name.

Only files the runtimes write as root are read; the container's rootfs is
never read here (see devnodes for its /dev, read without following links).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass, field

from nvsymlinkd.containers.early import scope_of_cgroups_path
from nvsymlinkd.containers.model import CgroupDriver, cgroup_driver, display_name, exec_fifo_path
from nvsymlinkd.containers.ocispec import (
    MAX_SMALL_BYTES,
    STATE_PARSERS,
    RuntimeState,
    SpecFacts,
    load_json,
    parse_spec,
    read_bounded,
)
from nvsymlinkd.containers.runtimes import (
    BUNDLE_ROOTS,
    BY_NAME,
    RUNC_BINARIES,
    RUNTIMES,
    STATE_ROOTS,
    managed_by,
    namespace_owner,
)
from nvsymlinkd.errors import UnsafeFile, UsageError
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.hostview import host_view
from nvsymlinkd.host.paths import normalize
from nvsymlinkd.host.root import HostRoot

MAX_ENTRIES = 100_000  # per directory: a safety bound, far above any real node
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,255}")
LIVE = ("created", "running")
MANAGER_ANNOTATION = "io.container.manager"  # whose value names a manager (containers.runtimes.Runtime.manager)
# (pod namespace, pod name, container name) annotations: CRI (containerd, CRI-O), then dockershim's labels
# (Docker copies labels into the spec's annotations; CRI-O sets both).
K8S_NAME_ANNOTATIONS = (
    ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name"),
    ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name"),
)
DOCKER_DATA_ROOT = "/var/lib/docker"
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"
PODMAN_STORAGE_FILES = ("/var/lib/containers/storage/overlay-containers/containers.json",
                        "/run/containers/storage/overlay-containers/volatile-containers.json")
# Docker's and Kubernetes' own name rules (DNS labels, [a-zA-Z0-9][a-zA-Z0-9_.-]*), bounded: a name that
# does not fit is not shown, so no escape sequence, newline or label-breaking byte reaches an output.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}")
# the runtimes' scope name prefixes (docker-ID.scope, ...): a container's scope is one of them and its id
SCOPE_PREFIXES = tuple(p for r in RUNTIMES for p in r.scope_prefixes)


@dataclass
class Container:
    id: str
    runtime: str  # a containers.runtimes name: docker, containerd, cri-o, podman, runc, crun
    namespace: str | None = None
    status: str = "unknown"  # created, running, paused, stopped, unknown
    init_pid: int | None = None
    init_start: int | None = None
    state_path: str | None = None  # inside path of state.json / status
    bundle: str | None = None  # inside path
    spec: SpecFacts | None = None
    state: RuntimeState | None = None
    cgroup_v1_devices: str | None = None  # from /proc/<pid>/cgroup
    cgroup_v2: str | None = None
    cgroup_systemd: str | None = None  # name=systemd (v1/hybrid)
    cgroup_v1_freezer: str | None = None  # repair freezes around systemd's v1 re-apply
    scope: str | None = None
    cgroup_driver: CgroupDriver | None = None  # the runtime's record, else the spec's form, else inferred
    problems: list = field(default_factory=list)
    # The runtime's files that exist but cannot be read or trusted as a whole ("cannot read X: why"):
    # what they would say is unknown, so the container can never be judged ok (nor "not a GPU container").
    unreadable: list = field(default_factory=list)
    pod_namespace: str | None = None  # Kubernetes only
    pod_name: str | None = None
    container_name: str | None = None  # Kubernetes container name, or Docker's / Podman's name

    @property
    def live(self) -> bool:
        return self.status in LIVE

    @property
    def display_name(self) -> str | None:
        return display_name(self)

    @property
    def short_id(self) -> str:
        return self.id[:12] if re.fullmatch(r"[0-9a-f]{64}", self.id) else self.id


def _subdirs(root: HostRoot, inside: str):
    """Names of real (non-symlink) subdirectories that look like ids."""
    try:
        it = os.scandir(root.real_resolved(inside, follow_last=True))
    except OSError:
        return []
    out = []
    with it:
        for n, de in enumerate(it):
            if n >= MAX_ENTRIES:
                break
            try:
                if ID_RE.fullmatch(de.name) and de.is_dir(follow_symlinks=False):
                    out.append(de.name)
            except OSError:
                continue
    return sorted(out)


def _exists(root: HostRoot, inside: str) -> bool:
    try:
        os.lstat(root.real_resolved(inside))
        return True
    except OSError:
        return False


def discover(root: HostRoot, files=None) -> list:
    """Every container the runtimes know about, merged, sorted by (runtime, id).

    files: a verify.cache.FileCache, to parse again only the runtime files that changed.
    """
    found: dict = {}  # (namespace, id) -> Container
    load = files.load if files is not None else load_json

    def get(ns, cid, runtime) -> Container:
        key = (ns, cid)
        c = found.get(key)
        if c is None:
            c = found[key] = Container(cid, runtime, ns)
        return c

    # 1. the OCI runtimes' state (pid, cgroups, the rules runc programmed), in the table's order
    for runtime, state in STATE_ROOTS:
        for ns, base in _namespaces(root, state.path, state.namespaced, state.namespace):
            owner = namespace_owner(ns, runtime).name
            for cid in _subdirs(root, base):
                c = get(ns, cid, owner)
                c.state_path = f"{base}/{cid}/{state.format.file}"
                _load_state(root, c, c.state_path, STATE_PARSERS[state.format.parser], load)
                if state.format.spec_copy and c.spec is None:  # crun keeps its own copy of the spec beside it
                    _load_spec(root, c, f"{base}/{cid}/{state.format.spec_copy}", load)

    # 2. bundles (the OCI spec and the shim's pid file): the bundle's runtime decides, or the manager its
    # spec names (CRI-O's and Podman's runroot)
    claimed: set = set()
    for runtime, bundles in BUNDLE_ROOTS:
        for ns, base in _namespaces(root, bundles.path, bundles.namespaced, None):
            owner = namespace_owner(ns, runtime).name
            for cid in _subdirs(root, base):
                bundle = f"{base}/{cid}/{bundles.subdir}" if bundles.subdir else f"{base}/{cid}"
                if bundles.needs_spec and not _exists(root, f"{bundle}/config.json"):
                    continue
                c = get(ns, cid, owner)
                _attach_bundle(root, c, bundle, bundles.pid_file, load)
                c.runtime = managed_by(owner, _manager(c))
                claimed.add((ns, cid))

    # 3. plain runc: the bundle from state.json's label, read as the host sees it (host.hostview: a
    # bundle under /tmp or /home is what the runtime read, whatever this process's mount namespace hides)
    view = host_view(root)
    for c in found.values():
        if c.spec is None and c.state is not None and c.state.bundle:
            bundle = _label_to_inside(root, c.state.bundle)
            _attach_bundle(view, c, bundle, None, load)

    # 4. plain runc still creating (exec.fifo, no state.json yet: its hooks are running): the bundle the
    # runc process running `create`/`run` names (containers.runtimeproc), trusted processes only
    creating = [c for c in found.values() if c.spec is None and c.state is None and c.state_path
                and c.state_path.endswith("/state.json") and not c.unreadable and _exists(root, exec_fifo_path(c) or "")]
    if creating:
        from nvsymlinkd.containers.runtimeproc import creating_bundles

        named = {(_label_to_inside(root, r), cid): b for (r, cid), b in creating_bundles(root, RUNC_BINARIES).items()}
        for c in creating:
            state_root = str(c.state_path).rsplit("/", 2)[0]
            named_bundle = named.get((state_root, c.id))
            if named_bundle is not None:
                _attach_bundle(view, c, _label_to_inside(root, named_bundle), None, load)

    for key, c in found.items():
        # Podman keeps its bundle in the graphroot (/var/lib/containers/...), not in a bundle root:
        # found through crun's or runc's state, its spec still names it
        if key not in claimed:
            c.runtime = managed_by(c.runtime, _manager(c))
        _finish(root, c)
    _attach_names(root, found.values(), load)
    return sorted(found.values(), key=lambda c: (c.runtime, c.namespace or "", c.id))


def _namespaces(root: HostRoot, path: str, namespaced: bool, namespace: str | None) -> list:
    """[(namespace, directory)] of a state or bundle root: itself, or one per namespace directory in it."""
    if not namespaced:
        return [(namespace, path)]
    return [(ns, f"{path}/{ns}") for ns in _subdirs(root, path)]


def _manager(c: Container) -> str | None:
    return c.spec.annotations.get(MANAGER_ANNOTATION) if c.spec is not None else None


def _label_to_inside(root: HostRoot, path: str) -> str:
    """runc records the real bundle path; under --root, a path into the root maps back inside."""
    path = normalize(path)
    if not root.is_real_root and (path == root.root or path.startswith(root.root + "/")):
        return root.inside(path)
    return path


def _unreadable(c: Container, inside: str, why) -> None:
    problem = f"cannot read {inside}: {why}"
    c.problems.append(problem)
    c.unreadable.append(problem)


def _load_state(root: HostRoot, c: Container, state_path: str, parser, load=load_json) -> None:
    try:
        c.state = load(root.real_resolved(state_path), parser)
    except FileNotFoundError:
        return  # still being created (hooks running) or being deleted
    except (OSError, ValueError) as exc:
        _unreadable(c, state_path, _why(exc))
        return
    c.problems.extend(c.state.problems)
    for problem in c.state.problems:  # a skipped rule may be the very NVIDIA rule: not a whole file
        c.unreadable.append(f"cannot read {c.state_path}: {problem}")


def _load_spec(root: HostRoot, c: Container, inside: str, load=load_json) -> None:
    try:
        c.spec = load(root.real_resolved(inside), parse_spec)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        _unreadable(c, inside, _why(exc))
        return
    c.problems.extend(c.spec.problems)
    for problem in c.spec.problems:
        c.unreadable.append(f"cannot read {inside}: {problem}")


def _why(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "a symlink (runtime files are never followed through links)"
    if isinstance(exc, UnsafeFile):
        return str(exc).rpartition(": ")[2]  # without the real path under --root
    return getattr(exc, "strerror", None) or str(exc)


def _attach_bundle(root: HostRoot, c: Container, bundle: str, pid_file: str | None, load=load_json) -> None:
    c.bundle = bundle
    _load_spec(root, c, f"{bundle}/config.json", load)
    if pid_file and (c.state is None or c.state.init_pid is None):
        inside = f"{bundle}/{pid_file}"
        try:
            text = read_bounded(root.real_resolved(inside), MAX_SMALL_BYTES).decode("ascii", "replace").strip()
        except FileNotFoundError:
            return  # not written yet
        except OSError as exc:
            _unreadable(c, inside, _why(exc))
            return
        # at most 10 digits: int() of thousands of digits is slow, and refused by Python >= 3.11
        if not (text.isascii() and text.isdigit() and len(text) <= 10 and 0 < int(text) < (1 << 31)):
            _unreadable(c, inside, f"not a pid: {text[:20]!r}")
            return
        c.init_pid = int(text)


def proc_start_time(root: HostRoot, pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (after the parenthesised comm, which may hold spaces)."""
    try:
        data = read_bounded(root.path(f"/proc/{pid}/stat"), MAX_SMALL_BYTES).decode("ascii", "replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def still_creating(root: HostRoot, c: Container) -> bool:
    """Whether the runtime is still creating the container now: its exec.fifo there, its state file not
    yet (what _status calls "creating", asked again of the files)."""
    fifo = exec_fifo_path(c)
    return bool(c.state_path and fifo) and not _exists(root, str(c.state_path)) and _exists(root, str(fifo))


def _status(root: HostRoot, c: Container) -> str:
    fifo = exec_fifo_path(c)
    if c.state is None and fifo and _exists(root, fifo):
        return "creating"  # runc writes state.json only after the prestart/createRuntime hooks (verified)
    if c.init_pid is None:
        return "unknown"
    start = proc_start_time(root, c.init_pid)
    if start is None or (c.init_start is not None and start != c.init_start):
        return "stopped"  # gone, or the pid now belongs to another process
    if fifo and _exists(root, fifo):
        return "created"  # runc and crun remove exec.fifo at start
    return "running"  # (with only a shim's pid file: it is written once the container was created)


def parse_proc_cgroup(text: str) -> tuple:
    """(v1 devices path, v2 path, name=systemd path, v1 freezer path) from /proc/<pid>/cgroup."""
    devices = v2 = systemd = freezer = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "devices" in controllers.split(","):
            devices = path
        elif "name=systemd" in controllers.split(","):
            systemd = path
        if "freezer" in controllers.split(","):
            freezer = path
    return devices, v2, systemd, freezer


def scope_of(cid: str, paths, recorded: str | None = None) -> str | None:
    """The container's systemd scope among the components of its cgroup paths (v2, name=systemd, v1
    devices): the one its runtime recorded (runc's state.json: scope_prefix-name.scope), else the
    outermost that is a runtime's scope for this id (containers.runtimes: docker-ID.scope,
    cri-containerd-ID.scope, crio-ID.scope, libpod-ID.scope, runc-ID.scope).

    Never the innermost `*.scope`: below its scope a container with a writable cgroup tree names what it
    likes. systemd running in a container moves its init to `<scope>/init.scope` (src/core/cgroup.c,
    manager_setup_cgroup: "the root cgroup ... move ourselves to init.scope"), the name of the host's own
    PID 1 scope; a process may name a cgroup `$(cmd).scope` as well (issue 39, items 1 and 2)."""
    comps = [comp for path in paths if path for comp in path.split("/") if comp]
    if recorded is not None and recorded in comps:
        return recorded
    own = {f"{prefix}-{cid}.scope" for prefix in SCOPE_PREFIXES}
    for comp in comps:  # outermost first, in each path
        if comp in own:
            return comp
    return None


def _finish(root: HostRoot, c: Container) -> None:
    if c.state is not None and c.state.config_missing and c.spec is None:
        # runc's state.json names neither the rules runc programmed nor (in its labels) the bundle: the
        # container may well be a GPU container; it stays in the report as unknown, never dropped
        _unreadable(c, c.state_path or "state.json",
                    f"{c.state.config_missing}: the device rules runc programmed and the bundle's spec are unknown")
    if c.state is not None:
        c.init_pid = c.state.init_pid or c.init_pid
        c.init_start = c.state.init_start
    c.status = _status(root, c)
    if c.status not in ("stopped", "unknown") and c.init_pid is not None:
        try:
            text = read_bounded(root.path(f"/proc/{c.init_pid}/cgroup"), MAX_SMALL_BYTES).decode("utf-8", "replace")
        except OSError as exc:
            c.problems.append(f"cannot read /proc/{c.init_pid}/cgroup: {exc.strerror}")
        else:
            c.cgroup_v1_devices, c.cgroup_v2, c.cgroup_systemd, c.cgroup_v1_freezer = parse_proc_cgroup(text)
    recorded = c.state.scope if c.state is not None else None
    c.scope = scope_of(c.id, (c.cgroup_v2, c.cgroup_systemd, c.cgroup_v1_devices), recorded)
    if c.scope is None and c.state is not None and c.state.scope and c.status in LIVE:
        c.scope = c.state.scope
    cgroups_path = c.spec.cgroups_path if c.spec is not None else None
    c.cgroup_driver = cgroup_driver(c.state.systemd_cgroup if c.state is not None else None, cgroups_path,
                                    scope_of_cgroups_path(cgroups_path), c.scope)


def clean_name(value) -> str | None:
    """A name as shown to people, or None when it is not a plausible name (untrusted input)."""
    if isinstance(value, str) and NAME_RE.fullmatch(value):
        return value
    return None


def _names_from_annotations(c: Container) -> None:
    ann = c.spec.annotations if c.spec is not None else {}
    for ns_key, pod_key, name_key in K8S_NAME_ANNOTATIONS:
        ns, pod = clean_name(ann.get(ns_key)), clean_name(ann.get(pod_key))
        if ns and pod:
            c.pod_namespace, c.pod_name, c.container_name = ns, pod, clean_name(ann.get(name_key))
            return


def _read_small_json(root: HostRoot, inside: str, load=load_json):
    try:
        return load(root.real_resolved(inside))
    except (OSError, ValueError):
        return None  # absent, unreadable, too large, not JSON: no name, never an error


def _docker_data_root(root: HostRoot, load=load_json) -> str:
    doc = _read_small_json(root, DOCKER_DAEMON_JSON, load)
    value = doc.get("data-root") if doc else None
    if isinstance(value, str) and value.startswith("/") and len(value) < 4096 and "\0" not in value:
        return normalize(value)
    return DOCKER_DATA_ROOT


def _docker_names(root: HostRoot, load=load_json):
    """id -> Docker's name, from <data-root>/containers/<id>/config.v2.json ("Name": "/name")."""
    data_root = _docker_data_root(root, load)

    def name_of(cid: str) -> str | None:
        if not ID_RE.fullmatch(cid):
            return None
        doc = _read_small_json(root, f"{data_root}/containers/{cid}/config.v2.json", load)
        name = doc.get("Name") if doc else None
        return clean_name(name[1:] if name.startswith("/") else name) if isinstance(name, str) else None

    return name_of


def _podman_names(root: HostRoot, load=load_json):
    """id -> first name, from containers/storage's containers.json ([{"id": ..., "names": [...]}, ...])."""
    out: dict = {}
    for inside in PODMAN_STORAGE_FILES:
        try:
            doc = json.loads(read_bounded(root.real_resolved(inside)).decode("utf-8", "replace"))
        except (OSError, ValueError, RecursionError):  # deep nesting: no names, never a failed pass
            continue
        for entry in doc[:MAX_ENTRIES] if isinstance(doc, list) else ():
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            names = entry.get("names")
            name = clean_name(names[0]) if isinstance(names, list) and names else None
            if name:
                out.setdefault(entry["id"], name)
    return out.get


# containers.runtimes.Runtime.names -> (root, load) -> (id -> name or None), made once a pass when needed
NAME_SOURCES = {"docker": _docker_names, "containers-storage": _podman_names}


def _attach_names(root: HostRoot, containers, load=load_json) -> None:
    lookups: dict = {}
    for c in containers:
        _names_from_annotations(c)
        source = BY_NAME[c.runtime].names
        if c.pod_name or source is None:
            continue
        if source not in lookups:
            lookups[source] = NAME_SOURCES[source](root, load)
        c.container_name = lookups[source](c.id)


def names_of(c) -> set:
    out = {x for x in (getattr(c, "container_name", None), getattr(c, "scope", None)) if x}
    ns, pod = getattr(c, "pod_namespace", None), getattr(c, "pod_name", None)
    if ns and pod:
        out.add(f"{ns}/{pod}")  # the pod: unique when it has one GPU container
        if c.container_name:
            out.add(f"{ns}/{pod}/{c.container_name}")
    return out


def no_such_container(wanted: str) -> UsageError:
    """The one wording `check` and `repair` use for a CONTAINER argument that matches nothing."""
    return UsageError(f"no container matches {wanted!r} (give an id, a unique id prefix of 4+ characters, a scope "
                      "name, a Docker or Podman name, or namespace/pod/container; `nvsymlinkd check` lists them)")


def find(containers: list, wanted: str):
    """A container (or ContainerReport) by full id, name (see names_of), scope, or unique id prefix (>= 4 chars).

    None when nothing matches; UsageError listing the candidates when several do.
    """
    hits = [c for c in containers if c.id == wanted]
    if not hits:
        hits = [c for c in containers if wanted in names_of(c)]
    if not hits and len(wanted) >= 4:
        hits = [c for c in containers if c.id.startswith(wanted)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        listed = ", ".join(f"{c.id[:12]}" + (f" ({display_name(c)})" if display_name(c) else "")
                           for c in hits[:10])
        more = f" and {len(hits) - 10} more" if len(hits) > 10 else ""
        raise UsageError(f"{wanted!r} matches {len(hits)} containers: {listed}{more}; give more of the id, "
                         "or namespace/pod/container")
    return None


def container_dev_nodes(root: HostRoot, pid: int, limit: int = 4096) -> list:
    """Char nodes in the container's own /dev as (path, Device), read via /proc/<pid>/root.

    Untrusted: reported only. Never follows a symlink inside the container:
    /dev and nvidia-caps are opened with O_NOFOLLOW and entries are lstat'ed.
    """
    out: list = []
    try:
        rootfd = os.open(root.path(f"/proc/{pid}/root"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        _scan_dev(rootfd, "dev", "/dev", out, limit, depth=0)
    finally:
        os.close(rootfd)
    return out


def _scan_dev(parent_fd: int, name: str, shown: str, out: list, limit: int, depth: int) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return
    try:
        names = []
        with os.scandir(fd) as it:  # bounded: a container can fill its /dev with entries
            for n, de in enumerate(it):
                if n >= limit:
                    break
                if de.name.startswith("nvidia"):
                    names.append(de.name)
        for entry in sorted(names):
            try:
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode):
                out.append((f"{shown}/{entry}", Device.char(os.major(st.st_rdev), os.minor(st.st_rdev))))
            elif stat.S_ISDIR(st.st_mode) and depth == 0:
                _scan_dev(fd, entry, f"{shown}/{entry}", out, limit, depth + 1)
    except OSError:
        pass
    finally:
        os.close(fd)
