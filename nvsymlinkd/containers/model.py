"""What is said of a container without reading anything (pure): the words the verifier's evaluation
shares with discovery and the OCI spec reader, so that it imports neither, and the Grant it hands to
the repair planner (one record from verify to repair)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nvsymlinkd.host.devices import Access, Device, Rule

CDI_ANNOTATION = "cdi.k8s.io/"  # the prefix of the CDI device annotations: a GPU sign
UNEXPECTED = "unexpected"  # a Grant's source: allowed or wanted now, expected by no trusted source (never granted)


def display_name(c: Any) -> str | None:
    """`namespace/pod/container` for Kubernetes, the Docker/Podman name otherwise, None when unknown.

    c: anything with pod_namespace, pod_name and container_name (a Container, a ContainerReport)."""
    ns, pod, name = (getattr(c, "pod_namespace", None), getattr(c, "pod_name", None),
                     getattr(c, "container_name", None))
    if ns and pod:
        return f"{ns}/{pod}/{name or '?'}"
    return name


@dataclass(frozen=True)
class CgroupDriver:
    """How the runtime manages a container's cgroup, and what says so.

    `name`: "systemd" (the runtime asked systemd for a scope and handed it the device rules as
    DeviceAllow=) or "cgroupfs" (the runtime writes the cgroup itself). `source`: "runtime state" (runc's
    state.json, crun's status file), "spec" (the form of linux.cgroupsPath) or "inferred" (neither says:
    whether the cgroup path has the container's scope, as before the runtime's record was read)."""

    name: str
    source: str


def cgroup_driver(recorded: bool | None, cgroups_path: str | None, spec_scope: str | None,
                  scope: str | None) -> CgroupDriver:
    """The runtime's own record first, the spec's form next, the scope last.

    recorded: runc's state.json `config.cgroups.Systemd` (libcontainer/configs/cgroup_linux.go:34-35 at
    v1.1.5 and v1.1.12, a bool with no json tag, set from --systemd-cgroup in specconv/spec_linux.go
    CreateCgroupConfig: `Systemd: useSystemdCgroup`) or crun's status `systemd-cgroup` (src/libcrun/status.c).
    Docker, containerd, CRI-O and Podman run runc or crun under their own state roots (containers.runtimes),
    so their containers carry the same record. A container whose cgroup path holds a `<prefix>-<id>.scope` that
    its runtime made with cgroupfs (a nested systemd, a directory named so) is cgroupfs: systemd does not
    apply device rules there, and a DeviceAllow= on some unit of that name would grant nothing.

    cgroups_path: with no record, "slice:prefix:name" (spec_scope: the scope it names,
    containers.early.scope_of_cgroups_path) is the systemd driver's form (runc refuses any
    other under --systemd-cgroup: specconv/spec_linux.go CreateCgroupConfig, v1.1.5:653-657) and an
    absolute path without a colon cgroupfs's; anything else decides nothing. A form is a convention, not
    proof (cgroupfs takes "a:b:c" as a directory name), which is why the record comes first."""
    if recorded is not None:
        return CgroupDriver("systemd" if recorded else "cgroupfs", "runtime state")
    if spec_scope is not None:
        return CgroupDriver("systemd", "spec")
    if cgroups_path is not None and cgroups_path.startswith("/") and ":" not in cgroups_path:
        return CgroupDriver("cgroupfs", "spec")
    return CgroupDriver("systemd" if scope else "cgroupfs", "inferred")


def exec_fifo_path(c: Any) -> str | None:
    """runc's and crun's exec.fifo beside the state file: present from create until start."""
    state_path = c.state_path
    return os.path.dirname(state_path) + "/exec.fifo" if state_path else None


@dataclass(frozen=True)
class Grant:
    """One device a container should be able to open, and where that expectation comes from: the verifier's
    report holds one per expected device, the repair planner decides over the same record.

    `access` is the original rule's letters (canonical order; a repeated or unknown letter is a
    ValueError here, so a malformed access never reaches the planner).
    """

    device: Device  # a wildcard number (None) or a non-char type is refused by the planner
    access: Access  # e.g. "rw" or "rwm"
    source: str  # the one a repair names: the first of `sources`, else repair.model's UNTRUSTED_SOURCES/UNEXPECTED
    path: str | None = None  # the node path in the container, for messages
    sources: tuple[str, ...] = ()  # every source that expects it (containers.expected's SPEC, ..., BASELINE)

    def __post_init__(self) -> None:
        if not isinstance(self.access, str) or len(set(self.access)) != len(self.access):
            raise ValueError(f"access {self.access!r} is not a subset of rwm")
        object.__setattr__(self, "access", Access(self.access))

    @property
    def rule(self) -> Rule:
        """The cgroup v1 rule: str() is the devices.allow line `c 195:0 rw`."""
        return Rule.exact(self.device, self.access)

    def to_json(self) -> dict[str, Any]:
        """As a repair's JSON names it."""
        d = self.device
        return {"type": d.type, "major": d.major, "minor": d.minor, "access": str(self.access),
                "source": self.source, "path": self.path}

    def expected_json(self) -> dict[str, Any]:
        """As `check --json` lists it under a container's `expected`."""
        return {"access": self.access, "sources": list(self.sources)}
