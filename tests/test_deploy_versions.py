"""The DaemonSet on the Kubernetes versions GPU fleets run (issue 29, item 4): the base needs 1.30+
(volumeMounts[].recursiveReadOnly), the before-1.30 component makes it valid from 1.25; the operator's
overlay (overlays/site) sets the image with kustomize's `images:` and picks the node label.

Validated offline against every API schema version kubernetes-validate ships from 1.25 on (strict:
an unknown field fails, as the API server's strict field validation does), rendered by kubectl's
kustomize from overlays written the way the docs tell an operator to write them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.test_deploy import KUBE, by_kind, daemonset, render

# every minor version from 1.25 to the newest schema the validator has
LATEST = tuple(int(x) for x in kubernetes_validate.latest_version().split(".")[:2])
ALL = [f"1.{m}.0" for m in range(25, LATEST[1] + 1)]
BEFORE_130 = [v for v in ALL if int(v.split(".")[1]) < 30]
FROM_130 = [v for v in ALL if int(v.split(".")[1]) >= 30]


def problems(doc: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{exc.message} at {'/'.join(map(str, exc.path))}"
    return None


def overlay(tmp_path: Path, text: str) -> list:
    """An overlay of the operator's own, next to deploy/kubernetes (kustomize wants relative paths)."""
    site = KUBE / "overlays" / f"test-{tmp_path.name}"
    site.mkdir()
    try:
        (site / "kustomization.yaml").write_text(text)
        return render(site)
    finally:
        shutil.rmtree(site)


def site_with(tmp_path: Path, *components: str, image: str = "registry.internal:5000/gpu/nvsymlinkd") -> list:
    doc = yaml.safe_load((KUBE / "overlays/site/kustomization.yaml").read_text())
    doc["images"][0]["newName"] = image  # step 2 of the README: set newName
    doc["components"] = [f"../../components/{c}" for c in components]
    return overlay(tmp_path, yaml.safe_dump(doc))


def test_the_base_needs_1_30_and_says_why():
    docs = render(KUBE / "base")
    for d in docs:
        for v in FROM_130:
            assert problems(d, v) is None, (d["kind"], v, problems(d, v))
    why = problems(daemonset(docs), BEFORE_130[-1])
    assert why is not None and "recursiveReadOnly" in why, why


def test_before_1_30_component_validates_on_every_version(tmp_path):
    docs = site_with(tmp_path, "before-1.30")
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "DaemonSet", "Namespace", "ServiceAccount"]
    for d in docs:
        for v in ALL:
            assert problems(d, v) is None, (d["kind"], v, problems(d, v))
    mounts = {m["mountPath"]: m for m in daemonset(docs)["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/host"] == {"name": "host-root", "mountPath": "/host", "readOnly": True}  # still read-only
    assert len(mounts) == len(daemonset(render(KUBE / "base"))["spec"]["template"]["spec"]["containers"][0]
                              ["volumeMounts"])


def test_site_overlay_sets_the_pushed_image(tmp_path):
    (ds,) = by_kind(site_with(tmp_path, image="registry.internal:5000/gpu/nvsymlinkd"))["DaemonSet"]
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.internal:5000/gpu/nvsymlinkd:0.1.0"
    # the shipped overlay renders as it stands (its placeholder registry), with no component
    (ds,) = by_kind(render(KUBE / "overlays/site"))["DaemonSet"]
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_node_label_component(tmp_path):
    docs = site_with(tmp_path, "nfd-node-label", "before-1.30")
    pod = daemonset(docs)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"feature.node.kubernetes.io/pci-10de.present": "true"}
    for v in (ALL[0], ALL[-1]):
        assert problems(daemonset(docs), v) is None


@pytest.mark.parametrize("name", ["driver-container", "report-only"])
def test_overlays_combine_with_the_component(tmp_path, name):
    doc = yaml.safe_load((KUBE / "overlays/site/kustomization.yaml").read_text())
    doc["resources"] = [f"../{name}"]
    doc["components"] = ["../../components/before-1.30"]
    docs = overlay(tmp_path, yaml.safe_dump(doc))
    for d in docs:
        assert problems(d, ALL[0]) is None, (d["kind"], problems(d, ALL[0]))


def test_the_docs_name_the_versions_validated():
    text = (KUBE.parent.parent / "docs/operations.md").read_text()
    assert "Kubernetes 1.25 to 1.29" in text and "1.30" in text
    assert os.path.isdir(KUBE / "components/before-1.30")
