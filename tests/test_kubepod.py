"""The VM's stand-in kubelet (tests/vm/guest/kubepod.py) runs the DaemonSet as rendered: every field
of every rendered tree is honoured (by Podman, by the harness, or said to mean nothing on one node),
and a field it does not know, or a value it cannot honour, fails instead of being dropped."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import need_tool
from tests.vm.guest import kubepod

REPO = Path(__file__).parent.parent

KUBE = REPO / "deploy/kubernetes"
TREES = {"base": KUBE / "base", "driver-container": KUBE / "overlays/driver-container",
         "report-only": KUBE / "overlays/report-only"}


def render(tree: Path) -> list:
    out = subprocess.run([need_tool("kubectl"), "kustomize", str(tree)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict:
    return {name: render(tree) for name, tree in TREES.items()}


def template(docs: list) -> dict:
    return next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]


@pytest.mark.parametrize("name", sorted(TREES))
def test_every_rendered_field_is_honoured(rendered, name):
    docs = rendered[name]
    plan = kubepod.translate(docs)
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    assert set(plan.how) == {path for path, _ in kubepod.leaves(ds)}
    # the Pod document is the template as rendered, not a copy kept in the harness
    assert plan.pod["spec"] == template(docs)["spec"]
    assert plan.pod["metadata"]["labels"] == template(docs)["metadata"]["labels"]
    assert plan.image == template(docs)["spec"]["containers"][0]["image"]
    (cm,) = plan.configmaps
    assert cm["metadata"]["name"] in {v.get("configMap", {}).get("name") for v in plan.pod["spec"]["volumes"]}
    # what `podman kube play` reads is exactly those documents
    played = [json.loads(part) for part in plan.play_text().split("\n---\n")]
    assert played == [cm, plan.pod]
    assert plan.how["spec/template/spec/hostPID"] == "harness"  # Podman 4.3 drops it: Pod.play sets pidns
    assert plan.how["spec/template/spec/containers/[]/startupProbe/exec/command/[]"] == "harness"


def test_driver_container_mount_propagation_is_classified(rendered):
    plan = kubepod.translate(rendered["driver-container"])
    assert plan.how["spec/template/spec/containers/[]/volumeMounts/[]/mountPropagation"] == "podman"


@pytest.mark.parametrize("edit, names", [
    (lambda t: t["spec"].__setitem__("hostIPC", True), "spec/template/spec/hostIPC"),
    (lambda t: t["spec"].__setitem__("hostNetwork", False), "hostNetwork"),
    (lambda t: t["spec"]["containers"][0].__setitem__("workingDir", "/"), "containers/[]/workingDir"),
    (lambda t: t["spec"]["containers"][0].__setitem__("args", ["--verbose"]), "containers/[]/args/[]"),
    (lambda t: t["spec"]["volumes"].append({"name": "gpu", "hostPath": {"path": "/dev/nvidia0",
                                                                         "type": "CharDevice"}}), "CharDevice"),
    (lambda t: t["spec"]["containers"][0]["securityContext"].__setitem__("privileged", False), "privileged"),
    (lambda t: t["spec"]["containers"][0].__setitem__("imagePullPolicy", "Always"), "imagePullPolicy"),
    (lambda t: t["spec"].__setitem__("hostPID", False), "hostPID"),
    (lambda t: t["spec"]["containers"][0]["volumeMounts"][0].__setitem__("mountPropagation", "Bidirectional"),
     "Bidirectional"),
])
def test_a_field_the_harness_cannot_honour_fails(rendered, edit, names):
    docs = copy.deepcopy(rendered["base"])
    edit(template(docs))
    with pytest.raises(kubepod.Unhonoured, match=names.replace("[]", r"\[\]")):
        kubepod.translate(docs)


def test_an_unknown_kind_or_a_missing_configmap_fails(rendered):
    docs = copy.deepcopy(rendered["base"]) + [{"kind": "Service", "metadata": {"name": "nvsymlinkd"}}]
    with pytest.raises(kubepod.Unhonoured, match="Service"):
        kubepod.translate(docs)
    docs = [d for d in rendered["base"] if d["kind"] != "ConfigMap"]
    with pytest.raises(kubepod.Unhonoured, match="nvsymlinkd-config"):
        kubepod.translate(docs)
