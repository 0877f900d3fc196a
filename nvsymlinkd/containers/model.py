"""What is said of a container without reading anything (pure): the words the verifier's evaluation
shares with discovery and the OCI spec reader, so that it imports neither."""

from __future__ import annotations

import os
from typing import Any

CDI_ANNOTATION = "cdi.k8s.io/"  # the prefix of the CDI device annotations: a GPU sign


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
