"""nvsymlinkd/containers/model.py (pure) as tables: the name a container is shown by, and where its
runtime's exec.fifo sits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nvsymlinkd.containers.model import CDI_ANNOTATION, display_name, exec_fifo_path

# (pod_namespace, pod_name, container_name) -> the name shown
NAMES = [
    (("gpu-jobs", "train-0", "worker"), "gpu-jobs/train-0/worker"),
    (("gpu-jobs", "train-0", None), "gpu-jobs/train-0/?"),  # a pod whose container name is unknown
    (("gpu-jobs", "train-0", ""), "gpu-jobs/train-0/?"),
    ((None, None, "web"), "web"),  # Docker, Podman
    ((None, "train-0", "worker"), "worker"),  # no namespace: not a pod's name
    (("gpu-jobs", None, "worker"), "worker"),
    (("", "train-0", "worker"), "worker"),
    ((None, None, None), None),
]


@pytest.mark.parametrize(("names", "shown"), NAMES)
def test_display_name(names, shown):
    ns, pod, name = names
    assert display_name(SimpleNamespace(pod_namespace=ns, pod_name=pod, container_name=name)) == shown


def test_display_name_of_something_without_names_is_none():
    assert display_name(object()) is None


@pytest.mark.parametrize(("state_path", "fifo"), [
    ("/run/runc/abc/state.json", "/run/runc/abc/exec.fifo"),
    ("/run/crun/k8s.io/abc/status", "/run/crun/k8s.io/abc/exec.fifo"),
    (None, None),
    ("", None),
])
def test_exec_fifo_path(state_path, fifo):
    assert exec_fifo_path(SimpleNamespace(state_path=state_path)) == fifo


def test_cdi_annotation_prefix():
    assert CDI_ANNOTATION == "cdi.k8s.io/"
