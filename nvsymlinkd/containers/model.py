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
