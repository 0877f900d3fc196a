"""`check` and `repair` name the workload: pod namespace/name/container from the CRI annotations
(dockershim's labels), Docker's and Podman's container names; names select a container
(issue 15 item 7, issue 13). Containers are the runtimes' real on-disk layouts
(tests/fixtures/runtimes) whose cgroups do not exist here: verdict unknown, a finding to show."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvsymlinkd import journal as journalmod
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.metrics import Metrics
from nvsymlinkd.verify.journaldiff import journal_entries
from nvsymlinkd.verify.verifier import verify_all
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_rule

K8S = "a" * 64
DOCKER = "b" * 64
PODMAN = "c" * 64
SHIM = "d" * 64
CRI = {"io.kubernetes.cri.sandbox-namespace": "gpu-team", "io.kubernetes.cri.sandbox-name": "trainer-0",
       "io.kubernetes.cri.container-name": "cuda", "io.kubernetes.cri.container-type": "container"}
SHIM_LABELS = {"io.kubernetes.pod.namespace": "infer", "io.kubernetes.pod.name": "server-7f9c",
               "io.kubernetes.container.name": "triton"}


def cli(*argv, check=None):
    proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", *map(str, argv)],
                          capture_output=True, text=True, timeout=120)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"exit {proc.returncode} != {check}\nstdout:{proc.stdout}\nstderr:{proc.stderr}")
    return proc


def gpu_spec(annotations=None):
    return oci_spec(rules=[spec_rule(195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"], annotations=annotations)


@pytest.fixture
def named(fakehost):
    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    lay = Layouts(fakehost)
    lay.containerd(K8S, gpu_spec(CRI), cgroup="/kubepods/nosuch-k8s")
    lay.docker(DOCKER, gpu_spec(), cgroup="/docker/nosuch-docker")
    fakehost.write(f"/var/lib/docker/containers/{DOCKER}/config.v2.json",
                   json.dumps({"ID": DOCKER, "Name": "/llm-train", "State": {"Running": True}}))
    lay.podman(PODMAN, gpu_spec(), cgroup="/machine.slice/nosuch-podman.scope")
    fakehost.write("/var/lib/containers/storage/overlay-containers/containers.json",
                   json.dumps([{"id": "e" * 64, "names": ["other"]}, {"id": PODMAN, "names": ["jupyter"]}]))
    lay.docker(SHIM, gpu_spec(SHIM_LABELS), cgroup="/docker/nosuch-shim")
    return fakehost


def test_check_shows_names_in_table_and_json(named):
    out = cli("--root", named.root, "check", "--no-bus", "--no-host", check=1).stdout.splitlines()
    assert out[0].split() == ["CONTAINER", "NAME", "RUNTIME", "STATUS", "MISSING", "FIX"]
    table = out[1:out.index("")]
    rows = {line.split()[0]: line.split()[1] for line in table if not line.startswith(" ")}
    assert rows[K8S[:12]] == "gpu-team/trainer-0/cuda"
    assert rows[DOCKER[:12]] == "llm-train"
    assert rows[PODMAN[:12]] == "jupyter"
    assert rows[SHIM[:12]] == "infer/server-7f9c/triton"
    doc = json.loads(cli("--root", named.root, "check", "--no-bus", "--no-host", "--json", check=1).stdout)
    by_id = {c["id"]: c for c in doc["containers"]}
    assert (by_id[K8S]["pod_namespace"], by_id[K8S]["pod_name"], by_id[K8S]["container_name"]) == \
        ("gpu-team", "trainer-0", "cuda")
    assert (by_id[DOCKER]["pod_name"], by_id[DOCKER]["container_name"]) == (None, "llm-train")
    assert by_id[K8S]["verdict"] == "unknown" and by_id[K8S]["runtime"] == "containerd"  # existing keys unchanged


@pytest.mark.parametrize("wanted, cid", [
    ("gpu-team/trainer-0/cuda", K8S), ("gpu-team/trainer-0", K8S), ("llm-train", DOCKER), ("jupyter", PODMAN),
    ("infer/server-7f9c/triton", SHIM), (DOCKER[:6], DOCKER),
])
def test_names_select_the_container(named, wanted, cid):
    doc = json.loads(cli("--root", named.root, "check", "--no-bus", "--no-host", "--json", wanted, check=1).stdout)
    assert [c["id"] for c in doc["containers"]] == [cid]


def test_ambiguous_prefix_lists_the_candidates(named):
    lay = Layouts(named)
    lay.docker("b" * 12 + "f" * 52, gpu_spec(), cgroup="/docker/nosuch-2")
    for command in ("check", "repair"):
        proc = cli("--root", named.root, command, "bbbbbb", check=2)
        assert f"'bbbbbb' matches 2 containers: {DOCKER[:12]} (llm-train), {'b' * 12}" in proc.stderr
        assert "give more of the id" in proc.stderr


def test_hostile_name_files_mean_no_name(named):
    named.write(f"/var/lib/docker/containers/{DOCKER}/config.v2.json",
                json.dumps({"Name": "/evil\x1b[31m\nname"}))
    named.write("/var/lib/containers/storage/overlay-containers/containers.json", json.dumps({"not": "a list"}))
    lay = Layouts(named)
    link = "9" * 64
    lay.docker(link, gpu_spec(), cgroup="/docker/nosuch-link")
    named.path(f"/var/lib/docker/containers/{link}").mkdir(parents=True)
    os.symlink("/etc/passwd", named.path(f"/var/lib/docker/containers/{link}/config.v2.json"))
    doc = json.loads(cli("--root", named.root, "check", "--no-bus", "--no-host", "--json", check=1).stdout)
    by_id = {c["id"]: c for c in doc["containers"]}
    assert by_id[DOCKER]["container_name"] is None
    assert by_id[PODMAN]["container_name"] is None
    assert by_id[link]["container_name"] is None


def test_journal_fields_and_metric_labels_name_the_pod(named, tmp_path):
    report = verify_all(HostRoot(str(named.root)), Config(), use_bus=False, with_host=False)
    k8s = next(c for c in report.containers if c.id == K8S)
    sent = []
    journal = journalmod.Journal(target="stderr")
    journal._send = lambda message, **fields: sent.append((message, fields))  # the journald wire, recorded
    for kind, priority, message, fields in journal_entries(k8s):
        journal.event(kind, priority, message, **fields)
    message, fields = sent[0]
    assert (fields["POD_NAMESPACE"], fields["POD_NAME"], fields["CONTAINER_NAME"]) == ("gpu-team", "trainer-0", "cuda")
    # node-problem-detector's rules take the word in parentheses: now the pod, not only the scope
    assert message.startswith(f"container {K8S[:12]} (gpu-team/trainer-0/cuda): GPU device access unknown")
    metrics = Metrics()
    metrics.on_containers(report)
    text = metrics.render()
    assert ('nvsymlinkd_gpu_container_findings{container_id="' + K8S[:12] + '",namespace="gpu-team",'
            'pod="trainer-0",container="cuda",status="unknown"} 1') in text
    assert 'container="llm-train"' in text


def test_repair_accepts_the_names(named):
    for wanted in ("llm-train", "gpu-team/trainer-0/cuda", "jupyter"):
        proc = cli("--root", named.root, "repair", "--dry-run", "--json", wanted)
        assert proc.returncode != 2, proc.stderr  # found (unknown access is reported by check, not repaired)
        assert json.loads(proc.stdout)["dry_run"] is True


def test_deeply_nested_podman_storage_file_means_no_name(named):
    # containers.json is written by Podman, but anyone who can write /var/lib/containers can make it hostile:
    # a 200,000-deep array must cost only the name, never the check (RecursionError out of json.loads)
    named.write("/var/lib/containers/storage/overlay-containers/containers.json", "[" * 200_000 + "]" * 200_000)
    doc = json.loads(cli("--root", named.root, "check", "--no-bus", "--no-host", "--json", check=1).stdout)
    assert {c["id"]: c for c in doc["containers"]}[PODMAN]["container_name"] is None
