"""The container runtimes, as one table: where each keeps its state, its bundles, its scopes, its config.

Pure (data and name tests, no I/O). Every place that knows a runtime reads it from here:
  - containers.discovery: the state roots and bundle roots it lists, which runtime a container is
    (the `runtime` of reports and the journal), where its display names come from;
  - daemon.inotify.RuntimeWatch: the state roots it watches and the state files whose arrival says a
    container was created;
  - systemd.bus: which new scopes are containers' (is_container_scope);
  - verify.hostcheck: where each runtime's cgroup driver is configured, which packages it reports.
Adding a runtime is one entry in RUNTIMES (and a line in docs/runtimes.md, which says how).

A runtime here is what reports call one: the high-level managers (Docker, containerd, CRI-O, Podman)
and the OCI runtimes run directly (runc, crun). A manager's containers are found through the state of
the OCI runtime it runs (a state root of the manager's own, or the OCI runtime's, then claimed by the
manager: a containerd namespace, the spec's io.container.manager annotation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StateFormat:
    """An OCI runtime's per-container state directory, <state root>/<id>/."""

    parser: str  # the containers.ocispec.STATE_PARSERS key that reads the state file
    file: str  # the state file: written once the container is created (its hooks have run)
    spec_copy: str | None = None  # the runtime's own copy of the spec beside it, read when no bundle is found


# runc writes state.json only after its prestart and createRuntime hooks have run (REFERENCE.md)
RUNC_STATE = StateFormat("runc", "state.json")
CRUN_STATE = StateFormat("crun", "status", spec_copy="config.json")


@dataclass(frozen=True)
class StateRoot:
    """Where an OCI runtime keeps its containers' state: <path>/<id>/<format.file>, or with `namespaced`
    <path>/<namespace>/<id>/... (containerd gives runc one root per namespace). Under /run: the daemon
    waits for a missing root from its nearest existing ancestor, up to /run."""

    path: str
    format: StateFormat = RUNC_STATE
    namespaced: bool = False
    namespace: str | None = None  # the namespace all its containers are in (Docker's runc root: moby)


@dataclass(frozen=True)
class BundleRoot:
    """Where a runtime's caller writes bundles: <path>[/<namespace>]/<id>[/<subdir>]/config.json, with the
    pid of the container's init in <bundle>/<pid_file> (a shim's or conmon's pid file)."""

    path: str
    pid_file: str
    namespaced: bool = False
    subdir: str = ""
    needs_spec: bool = False  # only ids whose bundle has a config.json are containers (the rest: images, pods)


@dataclass(frozen=True)
class DriverConfig:
    """Where hostcheck reads which cgroup driver (systemd or cgroupfs) a runtime uses."""

    reader: str  # the verify.hostcheck.DRIVER_READERS key for the file's format
    config: str  # the config file (CRI-O: also its <config>.d/*.conf drop-ins)
    installed: tuple[str, ...] = ()  # paths that say it is installed without a config file (its defaults
    # apply then); one ending in "/" counts as a directory only


@dataclass(frozen=True)
class Runtime:
    name: str  # as reports and the journal (NVSYMLINKD_RUNTIME=) name it
    state_roots: tuple[StateRoot, ...] = ()
    bundle_roots: tuple[BundleRoot, ...] = ()
    namespaces: tuple[str, ...] = ()  # containerd namespaces whose containers are this runtime's
    manager: str | None = None  # the spec's io.container.manager value that makes a container this runtime's
    yields_to_manager: bool = False  # a container found as this runtime's is the manager's its spec names
    scope_prefixes: tuple[str, ...] = ()  # its containers' systemd scopes: <prefix>-<id>.scope
    other_scopes: tuple[str, ...] = ()  # <prefix>-... scopes of its that hold no container
    names: str | None = None  # where display names are read (containers.discovery.NAME_SOURCES key)
    driver: DriverConfig | None = None
    packages: tuple[str, ...] = ()  # the dpkg packages whose versions `check` reports
    binaries: tuple[str, ...] = ()  # where its binary is installed: a process running one of these files
    # may name a bundle before the state file does (containers.runtimeproc)


# In this order discovery reads the state roots (a later root's state file wins for the same container),
# and hostcheck reports the cgroup drivers.
RUNTIMES: tuple[Runtime, ...] = (
    Runtime("runc", state_roots=(StateRoot("/run/runc"),), yields_to_manager=True,
            scope_prefixes=("runc",), packages=("runc",),
            binaries=("/usr/bin/runc", "/usr/sbin/runc", "/usr/local/bin/runc", "/usr/local/sbin/runc")),
    Runtime("docker", state_roots=(StateRoot("/run/docker/runtime-runc/moby", namespace="moby"),),
            namespaces=("moby",), scope_prefixes=("docker",), names="docker",
            driver=DriverConfig("docker-json", "/etc/docker/daemon.json", ("/run/docker/", "/usr/bin/dockerd")),
            packages=("docker-ce",)),
    Runtime("containerd", state_roots=(StateRoot("/run/containerd/runc", namespaced=True),),
            bundle_roots=(BundleRoot("/run/containerd/io.containerd.runtime.v2.task", "init.pid", namespaced=True),),
            scope_prefixes=("cri-containerd",),
            driver=DriverConfig("containerd-toml", "/etc/containerd/config.toml"),
            packages=("containerd", "containerd.io")),
    # crun run directly with the systemd cgroup manager and no cgroupsPath names its scope crun-<id>.scope
    # (crun src/libcrun/cgroup-systemd.c get_systemd_scope_and_slice: 1.8.1 line 48, Debian 12's; 1.29.1
    # line 122); under a manager (Podman's libpod-<id>.scope) the scope is the manager's
    Runtime("crun", state_roots=(StateRoot("/run/crun", CRUN_STATE),), yields_to_manager=True,
            scope_prefixes=("crun",), packages=("crun",)),
    Runtime("cri-o", bundle_roots=(BundleRoot("/run/containers/storage/overlay-containers", "pidfile",
                                              subdir="userdata", needs_spec=True),),
            yields_to_manager=True, scope_prefixes=("crio",), other_scopes=("crio-conmon",),
            driver=DriverConfig("crio-conf", "/etc/crio/crio.conf"), packages=("cri-o",)),
    # Podman as root keeps its bundles in the graphroot (/var/lib/containers/storage/overlay-containers),
    # found through crun's or runc's state, whose spec names libpod; its runroot's are CRI-O's above
    Runtime("podman", manager="libpod", scope_prefixes=("libpod",), names="containers-storage",
            packages=("podman",)),
)

BY_NAME = {r.name: r for r in RUNTIMES}
MANAGERS = {r.manager: r for r in RUNTIMES if r.manager}
NAMESPACE_OWNERS = {ns: r for r in RUNTIMES for ns in r.namespaces}
# (runtime, root) in table order
STATE_ROOTS = tuple((r, s) for r in RUNTIMES for s in r.state_roots)
BUNDLE_ROOTS = tuple((r, b) for r in RUNTIMES for b in r.bundle_roots)
STATE_FILES = frozenset(s.format.file for _, s in STATE_ROOTS)
PACKAGES = tuple(p for r in RUNTIMES for p in r.packages)
RUNC_BINARIES = BY_NAME["runc"].binaries

# systemd's unit names of container scopes: a runtime's prefix, a dash, a name (bounded, no slash)
CONTAINER_SCOPE = re.compile("(" + "|".join(re.escape(p) for r in RUNTIMES for p in r.scope_prefixes)
                             + r")-[A-Za-z0-9][A-Za-z0-9_.:@-]{0,250}\.scope")
NOT_CONTAINER_SCOPES = tuple(f"{p}-" for r in RUNTIMES for p in r.other_scopes)


def is_container_scope(unit: str) -> bool:
    """Whether a systemd unit is a container's scope (crio-conmon-<id>.scope holds CRI-O's monitor)."""
    return bool(CONTAINER_SCOPE.fullmatch(unit)) and not unit.startswith(NOT_CONTAINER_SCOPES)


def namespace_owner(namespace: str | None, default: Runtime) -> Runtime:
    """The runtime a container in a containerd namespace belongs to: the one that claims the namespace
    (Docker: moby), else the root's own."""
    return NAMESPACE_OWNERS.get(namespace, default) if namespace is not None else default


def managed_by(runtime: str, manager: object) -> str:
    """The runtime a container is, given the one whose files it was found in and its spec's
    io.container.manager annotation (Podman's libpod through runc's, crun's or the runroot's files)."""
    found = BY_NAME[runtime]
    owner = MANAGERS.get(manager) if found.yields_to_manager and isinstance(manager, str) else None
    return owner.name if owner is not None else runtime
