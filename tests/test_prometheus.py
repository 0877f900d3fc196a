"""deploy/prometheus: the alerting rules checked and fired by Prometheus's own promtool on the daemon's real
textfile in each state, the exposition linted by promtool, and the textfile read by a real node-exporter.

Each state is a story told minute by minute to nvsymlinkd's metrics writer (real reconcile passes on a fixture
host, the verifier's reports, repairs and reloads as the daemon feeds them) with a clock that starts at Prometheus's
time 0; the textfile it writes each minute becomes promtool's input series, as node-exporter would serve it (a
stopped daemon's last file stays and is served unchanged; a removed file's series are gone).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import prometheus_client.parser as parser  # test-only: python3-prometheus-client (.ci/apt.d/cluster.txt)
import pytest
import yaml

from nvsymlinkd import metrics as m
from nvsymlinkd.config import Config, parse_listen
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.verify.evaluate import ContainerReport, Finding, Report
from tests.conftest import need_tool
from tests.fakehost import standard_host

REPO = Path(__file__).parent.parent
RULES = REPO / "deploy/prometheus/nvsymlinkd.rules.yml"
OPERATOR = REPO / "deploy/prometheus/operator"
TEXTFILE = "/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"
TARGET = {"job": "node", "instance": "gpu-node-1:9100"}  # what the scrape adds
MINUTES = 30  # each story; evaluated at EVAL
EVAL = 25
GPU_POD = {"container_id": "0123456789ab", "namespace": "ml-team", "pod": "trainer-0", "container": "cuda"}
ALERTS = ("NvsymlinkdGPUContainerLostDevices", "NvsymlinkdRepairsFailing", "NvsymlinkdNotSyncing",
          "NvsymlinkdVerifierStuck", "NvsymlinkdTextfileStale", "NvsymlinkdAbsent", "NvsymlinkdDevCharLinksMissing",
          "NvsymlinkdReloadWithGPUContainersAtRisk")


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def promtool() -> str:
    return need_tool("promtool")  # Debian's prometheus package (.ci/apt.d/cluster.txt)


def container(verdict: str) -> ContainerReport:
    kind = {"lost": "lost", "denied": "denied", "at-risk": "at-risk-scope"}[verdict]
    return ContainerReport("0123456789ab" + "c" * 52, "runc", "k8s.io", "running", verdict,
                           findings=[Finding(kind, (), "test", "test")], pod_namespace=GPU_POD["namespace"],
                           pod_name=GPU_POD["pod"], container_name=GPU_POD["container"])


def healthy() -> ContainerReport:
    return ContainerReport("f" * 64, "runc", "k8s.io", "running", "ok")


class Story:
    """nvsymlinkd's metrics writer on a fixture host, one textfile a minute (what node-exporter serves)."""

    def __init__(self, tmp_path: Path, host=None, resync_interval: int = 60):
        self.host = host or standard_host(tmp_path / "root")
        self.host.path(os.path.dirname(TEXTFILE)).mkdir(parents=True)
        self.root = HostRoot(str(self.host.root))
        self.now = 0.0
        config = Config(metrics_textfile=TEXTFILE, resync_interval=resync_interval)
        self.metrics = m.Metrics(self.root, config, clock=lambda: self.now)
        self.files: list = []  # per minute: the textfile's text and mtime, or None (no file)
        self.running = True
        self.verifying = True  # False: the verifier hangs; the syncs and the 30 s heartbeat go on

    def sync(self) -> None:
        from nvsymlinkd.devchar.reconcile import reconcile

        self.metrics.on_reconcile(reconcile(self.root, Config()))

    def minute(self, containers=(), repairs_failed=0, reload=False, report=None) -> None:
        if self.running:
            self.sync()  # the resync every resync_interval
            if self.verifying:
                self.metrics.on_containers(report or Report([healthy(), *containers], []))
            for _ in range(repairs_failed):
                self.metrics.on_repair(ok=False)
            if reload:
                self.metrics.on_reload()
            assert self.metrics.flush()
            os.utime(self.host.path(TEXTFILE), (self.now, self.now))
        path = self.host.path(TEXTFILE)
        self.files.append((path.read_text(), path.stat().st_mtime) if path.exists() else None)
        self.now += 60

    def series(self) -> list:
        """promtool input_series: one per sample, its value each minute ('_' where absent)."""
        values: dict = {}
        for i, got in enumerate(self.files):
            if got is None:
                continue
            text, mtime = got
            samples = [(s.name, s.labels, s.value) for f in parser.text_string_to_metric_families(text)
                       for s in f.samples]
            # node-exporter's own series for the file (its `file` label: the base name in 1.5)
            samples.append(("node_textfile_mtime_seconds", {"file": "nvsymlinkd.prom"}, mtime))
            for name, labels, value in samples:
                key = series_name(name, {**labels, **TARGET})
                values.setdefault(key, ["_"] * len(self.files))[i] = repr(float(value))
        return [{"series": k, "values": " ".join(v)} for k, v in values.items()]


def series_name(name: str, labels: dict) -> str:
    return name + "{" + ",".join(f'{k}="{m.escape_label_value(v)}"' for k, v in sorted(labels.items())) + "}"


def tell(tmp_path: Path, state: str) -> Story:
    """The daemon's textfile, minute by minute, in `state`."""
    story = Story(tmp_path, resync_interval=0 if state == "events-only" else 60)
    for t in range(MINUTES + 1):
        if state == "healthy":
            story.minute()
        elif state == "verifier-stuck":  # the verification begun at minute 10 never returns
            story.verifying = t < 10
            story.minute()
        elif state == "verifier-never":  # the first verification never returns
            story.verifying = False
            story.minute()
        elif state == "events-only":  # resync_interval = 0: verified at start, then only on events
            story.verifying = t == 0
            story.minute()
        elif state in ("lost", "denied"):
            story.minute([container(state)])
        elif state == "repair-failing":  # lost, and the repairs fail from minute 20
            story.minute([container("lost")], repairs_failed=1 if t >= 20 else 0)
        elif state == "links-missing":
            if t == 1:  # a foreign file where a GPU's link must go
                story.host.node("/dev/nvidia5", 195, 5)
                story.host.path("/dev/char/195:5").write_text("not ours")
            story.minute()
        elif state == "reload-at-risk":
            story.minute([container("at-risk")], reload=t == 20)
        elif state == "stopped":  # the daemon stops at minute 10: its last file stays
            story.running = story.running and t < 10
            story.minute()
        else:
            raise AssertionError(state)
    return story


def tell_absent(tmp_path: Path) -> Story:
    """The daemon runs for 30 minutes, then its textfile is gone (the unit purged, the pod deleted)."""
    story = Story(tmp_path)
    for t in range(91):
        if t == 31:
            story.running = False
            story.host.path(TEXTFILE).unlink()
        story.minute()
    return story


def expected(state: str) -> dict:
    """alertname -> the labels of each alert firing at EVAL in `state` (every other alert: none)."""
    target = dict(TARGET)
    warn, crit = {"severity": "warning"}, {"severity": "critical"}
    lost = lambda status: {**GPU_POD, "status": status, **target, **crit}  # noqa: E731
    return {
        "healthy": {},
        "events-only": {},
        "verifier-stuck": {"NvsymlinkdVerifierStuck": [{**target, **warn}]},
        "verifier-never": {"NvsymlinkdVerifierStuck": [{**target, **warn}]},
        "lost": {"NvsymlinkdGPUContainerLostDevices": [lost("lost")]},
        "denied": {"NvsymlinkdGPUContainerLostDevices": [lost("denied")]},
        "repair-failing": {"NvsymlinkdGPUContainerLostDevices": [lost("lost")],
                           "NvsymlinkdRepairsFailing": [{"result": "failed", **target, **warn}]},
        "links-missing": {"NvsymlinkdDevCharLinksMissing": [{**target, **warn}]},
        "reload-at-risk": {"NvsymlinkdReloadWithGPUContainersAtRisk": [{**target, **warn}]},
        "stopped": {"NvsymlinkdNotSyncing": [{**target, **warn}],
                    "NvsymlinkdTextfileStale": [{"file": "nvsymlinkd.prom", **target, **warn}]},
        "absent": {"NvsymlinkdAbsent": [{**target, **warn}]},
    }[state]


def rules_without_annotations(tmp_path: Path) -> Path:
    """The rules as shipped, annotations dropped: promtool compares an alert's annotations whole, and what
    fires is expr, for and labels (the summary naming the pod has its own test)."""
    doc = rules()
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_promtool_test(tmp_path: Path, rule_file: Path, tests: list) -> subprocess.CompletedProcess:
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m",
                                    "tests": tests}, sort_keys=False, width=1 << 20))
    return subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


# -- the rules ----------------------------------------------------------------------------------


def test_promtool_checks_the_rules():
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout
    assert [r["alert"] for g in rules()["groups"] for r in g["rules"]] == list(ALERTS)


STATES = ("healthy", "lost", "denied", "repair-failing", "links-missing", "reload-at-risk", "stopped", "absent",
          "verifier-stuck", "verifier-never", "events-only")


@pytest.mark.parametrize("state", STATES)
def test_each_alert_fires_in_its_state_and_nothing_else(state, tmp_path, need_root):
    story = tell_absent(tmp_path) if state == "absent" else tell(tmp_path, state)
    at = 75 if state == "absent" else EVAL
    want = expected(state)
    checks = [{"eval_time": f"{at}m", "alertname": name,
               "exp_alerts": [{"exp_labels": labels} for labels in want.get(name, [])]} for name in ALERTS]
    if state not in ("healthy", "events-only"):  # before the state began (or for elapsed) nothing fires
        checks += [{"eval_time": "0m", "alertname": name, "exp_alerts": []} for name in ALERTS]
    out = run_promtool_test(tmp_path, rules_without_annotations(tmp_path),
                            [{"interval": "1m", "input_series": story.series(), "alert_rule_test": checks}])
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_verifier_alert_waits_for_two_resyncs_a_minute_and_its_for(tmp_path, need_root):
    """The last verification began at minute 9: silent while it is younger than 2 x 60 s + 60 s, pending 5
    minutes after (a slow verification that finishes is no alert), firing from then; the textfile stays
    fresh all along (the heartbeat), so only the verification's own timestamp tells."""
    story = tell(tmp_path, "verifier-stuck")
    name = "NvsymlinkdVerifierStuck"
    firing = [{"exp_labels": {**TARGET, "severity": "warning"}}]
    checks = [{"eval_time": "12m", "alertname": name, "exp_alerts": []},
              {"eval_time": "17m", "alertname": name, "exp_alerts": []},   # pending since 13m
              {"eval_time": "18m", "alertname": name, "exp_alerts": firing},
              {"eval_time": "18m", "alertname": "NvsymlinkdTextfileStale", "exp_alerts": []}]
    out = run_promtool_test(tmp_path, rules_without_annotations(tmp_path),
                            [{"interval": "1m", "input_series": story.series(), "alert_rule_test": checks}])
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lost_alert_names_the_pod_also_behind_a_scrape_that_renames_its_labels(tmp_path, need_root):
    story = tell(tmp_path, "lost")
    series = story.series()
    # the Prometheus Operator's node-exporter ServiceMonitor adds the exporter's own namespace/pod/container
    renamed = []
    for s in series:
        if s["series"].startswith("nvsymlinkd_gpu_container_findings{"):
            text = re.sub(r'\b(namespace|pod|container)="', r'exported_\1="', s["series"])
            text = text.replace("}", ',container="node-exporter",namespace="monitoring",pod="node-exporter-x"}')
            renamed.append({**s, "series": text})
    doc = rules()
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == "NvsymlinkdGPUContainerLostDevices":
            rule["annotations"] = {"summary": rule["annotations"]["summary"]}
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    summary = "GPU container ml-team/trainer-0/cuda (0123456789ab) on gpu-node-1:9100 is lost its NVIDIA devices"
    plain = {"exp_labels": {**GPU_POD, "status": "lost", **TARGET, "severity": "critical"},
             "exp_annotations": {"summary": summary}}
    behind = {"exp_labels": {**{f"exported_{k}" if k != "container_id" else k: v for k, v in GPU_POD.items()},
                             "container": "node-exporter", "namespace": "monitoring", "pod": "node-exporter-x",
                             "status": "lost", **TARGET, "severity": "critical"},
              "exp_annotations": {"summary": summary}}
    name = "NvsymlinkdGPUContainerLostDevices"
    out = run_promtool_test(tmp_path, rule_file, [
        {"interval": "1m", "input_series": series,
         "alert_rule_test": [{"eval_time": f"{EVAL}m", "alertname": name, "exp_alerts": [plain]}]},
        {"interval": "1m", "input_series": renamed,
         "alert_rule_test": [{"eval_time": f"{EVAL}m", "alertname": name, "exp_alerts": [behind]}]}])
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lost_alert_fires_on_the_textfile_of_a_real_runc_container_that_lost_its_gpu(runc_host, tmp_path):
    """The verifier judges a real runc container (cgroup v1, the kernel's devices.list) and the metrics
    writer writes what the daemon would: the lost alert names its pod from the runtime's annotations."""
    from nvsymlinkd.verify.verifier import verify_all
    from tests.runcfixture import device_node, device_rule

    annotations = {"io.kubernetes.cri.sandbox-namespace": GPU_POD["namespace"],
                   "io.kubernetes.cri.sandbox-name": GPU_POD["pod"],
                   "io.kubernetes.cri.container-name": GPU_POD["container"]}
    cid = "prom" + uuid.uuid4().hex[:8]
    c = runc_host.run(cid, rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"], annotations=annotations)
    story = Story(tmp_path, host=runc_host.fake)
    for t in range(MINUTES + 1):
        if t == 5:
            c.deny("c 195:0 rw")
            assert c.open_error("/dev/nvidia0") == "EPERM"  # the kernel says so
        story.minute(report=verify_all(story.root, Config(), use_bus=False))
    name = "NvsymlinkdGPUContainerLostDevices"
    labels = {**GPU_POD, "container_id": cid, "status": "lost", **TARGET, "severity": "critical"}
    out = run_promtool_test(tmp_path, rules_without_annotations(tmp_path), [
        {"interval": "1m", "input_series": story.series(), "alert_rule_test": [
            {"eval_time": "4m", "alertname": name, "exp_alerts": []},
            {"eval_time": "6m", "alertname": name, "exp_alerts": []},  # pending: repaired within 2 minutes is no alert
            {"eval_time": f"{EVAL}m", "alertname": name, "exp_alerts": [{"exp_labels": labels}]}]}])
    assert out.returncode == 0, out.stdout + out.stderr


def tell_mig(runc_host, tmp_path: Path, monkeypatch) -> tuple:
    """The story with a MIG container (issue 35): on tests/migfixture.py's H100 (GPU 0's instances gi1 and gi2,
    NVML's UUIDs from its stand-in pynvml), a real runc container the NVIDIA hook gave MIG device MIG_A
    (gpu0/gi1/ci0: its GPU, GI and CI access caps) and IMEX channel 0 (NVIDIA_IMEX_CHANNELS=0), named as a pod;
    its GI and CI caps denied at minute 5 (the kernel says EPERM), the verifier's reports fed to the writer
    each minute as the daemon does. Returns (story, container id)."""
    import importlib.util

    from nvsymlinkd.verify.verifier import verify_all
    from tests.migfixture import CAPS_MAJOR, IMEX_MAJOR
    from tests.runcfixture import device_node
    from tests.test_hook_trust_runc import fake_hook
    from tests.test_mig_runc import A_CI, A_GI, MIG_A, MIG_B, mig_host

    mig_host(runc_host, monkeypatch, [(MIG_A, 0, 1, 0), (MIG_B, 0, 2, 0)])
    # the verifier runs in this process: the stand-in pynvml mig_host wrote, put back out of sys.modules after
    spec = importlib.util.spec_from_file_location("pynvml", runc_host.base / "pynvml-mig" / "pynvml.py")
    nvml = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nvml)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    runc_host.fake.node("/dev/nvidia-caps-imex-channels/channel0", IMEX_MAJOR, 0)
    cid = "prommig" + uuid.uuid4().hex[:8]
    allow = ("c 195:255 rw", "c 195:0 rw", f"c {CAPS_MAJOR}:{A_GI} rw", f"c {CAPS_MAJOR}:{A_CI} rw",
             f"c {IMEX_MAJOR}:0 rw")
    hooks = {"prestart": [{"path": str(fake_hook(runc_host)), "args": ["nvidia-container-runtime-hook", "prestart"],
                           "env": [f"TEST_DEVICES_DIR=/sys/fs/cgroup/devices{runc_host.parent}/{cid}",
                                   "TEST_ALLOW=" + ";".join(allow)]}]}
    annotations = {"io.kubernetes.cri.sandbox-namespace": GPU_POD["namespace"],
                   "io.kubernetes.cri.sandbox-name": GPU_POD["pod"],
                   "io.kubernetes.cri.container-name": GPU_POD["container"]}
    c = runc_host.run(cid, nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidiactl", 195, 255)],
                      env=[f"NVIDIA_VISIBLE_DEVICES={MIG_A}", "NVIDIA_IMEX_CHANNELS=0"], hooks=hooks,
                      annotations=annotations)
    c.exec("mknod", f"/dev/nvidia-cap{A_GI}", "c", str(CAPS_MAJOR), str(A_GI))
    story = Story(tmp_path, host=runc_host.fake)
    for t in range(MINUTES + 1):
        if t == 5:
            for m in (A_GI, A_CI):
                c.deny(f"c {CAPS_MAJOR}:{m} rw")
            assert c.open_error(f"/dev/nvidia-cap{A_GI}") == "EPERM"  # the kernel says so
        story.minute(report=verify_all(story.root, Config(), use_bus=False))
    return story, cid


def test_the_lost_alert_names_the_mig_device_and_imex_channel_of_a_real_runc_container(runc_host, tmp_path,
                                                                                       monkeypatch):
    """nvsymlinkd_gpu_container_devices names the MIG device (UUID, instance, g:m index) and the IMEX channel the
    hook granted, from the textfile as promtool reads it; the lost alert's description lists them (a query on
    that family by container_id and instance); the exposition passes promtool's lint."""
    from tests.test_mig_runc import MIG_A

    story, cid = tell_mig(runc_host, tmp_path, monkeypatch)
    text = story.files[-1][0]
    devices = [s for f in parser.text_string_to_metric_families(text) for s in f.samples
               if s.name == "nvsymlinkd_gpu_container_devices"]
    pod = {**GPU_POD, "container_id": cid}
    assert sorted((s.labels for s in devices), key=lambda d: d["kind"]) == [
        {**pod, "kind": "imex", "device": "/dev/nvidia-caps-imex-channels/channel0", "index": "0", "mig_instance": ""},
        {**pod, "kind": "mig", "device": MIG_A, "index": "0:0", "mig_instance": "gpu0/gi1/ci0"}], text
    out = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr

    doc = rules()
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == "NvsymlinkdGPUContainerLostDevices":
            rule["annotations"] = {"description": rule["annotations"]["description"]}
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    description = (
        "nvsymlinkd found the container's device access lost for 2 minutes and did not repair it (repair failed "
        f"or refused, or repair is not \"auto\"). `nvsymlinkd check {cid}` on the node says why; `nvsymlinkd "
        f"repair {cid}` or recreating the pod restores it. Its MIG devices and IMEX channels: "
        f"/dev/nvidia-caps-imex-channels/channel0, {MIG_A} (gpu0/gi1/ci0, index 0:0).")
    name = "NvsymlinkdGPUContainerLostDevices"
    out = run_promtool_test(tmp_path, rule_file, [{"interval": "1m", "input_series": story.series(), "alert_rule_test": [
        {"eval_time": f"{EVAL}m", "alertname": name, "exp_alerts": [
            {"exp_labels": {**pod, "status": "lost", **TARGET, "severity": "critical"},
             "exp_annotations": {"description": description}}]}]}])
    assert out.returncode == 0, out.stdout + out.stderr


def test_repairs_failing_fires_on_the_textfile_of_real_repairs_the_rate_limit_refuses(runc_host, tmp_path):
    """Real repairs of a real runc container (cgroup v1): the first loss repaired, the next ones within the
    rate limit's window refused (counted as failed), as the daemon feeds its writer."""
    from nvsymlinkd.repair.apply import SUCCESS, repair_all
    from nvsymlinkd.repair.plan import RepairHistory
    from nvsymlinkd.verify.verifier import verify_all
    from tests.runcfixture import device_node, device_rule

    cid = "prom" + uuid.uuid4().hex[:8]
    c = runc_host.run(cid, rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"])
    story = Story(tmp_path, host=runc_host.fake)
    history = RepairHistory()
    results = []
    for t in range(MINUTES + 1):
        if t in (12, 20):  # lost, repaired; lost again: refused within the rate limit's window
            c.deny("c 195:0 rw")
        for r in repair_all(story.root, Config(), history=history, clock=lambda: story.now) if t >= 12 else ():
            story.metrics.on_repair(r, ok=r.status in SUCCESS)
            results.append((t, r.status in SUCCESS))
        story.minute(report=verify_all(story.root, Config(), use_bus=False))
    # refused while within 600 s of the last repair (minutes 20 and 21), repaired after
    assert results == [(12, True), (20, False), (21, False), (22, True)], results
    assert c.open_error("/dev/nvidia0") == "ENXIO"  # repaired: the kernel says so
    name = "NvsymlinkdRepairsFailing"
    out = run_promtool_test(tmp_path, rules_without_annotations(tmp_path), [
        {"interval": "1m", "input_series": story.series(), "alert_rule_test": [
            {"eval_time": "15m", "alertname": name, "exp_alerts": []},  # the repair that worked is no alert
            {"eval_time": f"{EVAL}m", "alertname": name,
             "exp_alerts": [{"exp_labels": {"result": "failed", **TARGET, "severity": "warning"}}]}]}])
    assert out.returncode == 0, out.stdout + out.stderr


# -- the exposition -----------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["healthy", "lost", "repair-failing"])
def test_promtool_check_metrics_on_the_exposition(state, tmp_path, need_root):
    text = tell(tmp_path, state).files[-1][0]
    out = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def documented_families() -> list:
    """The metric names of docs/operations.md's table (`nvsymlinkd_...{labels}` or `a` / `b`)."""
    doc = (REPO / "docs/operations.md").read_text()
    names = []
    for line in doc.splitlines():
        if line.startswith("| `nvsymlinkd_"):
            names += re.findall(r"`(nvsymlinkd_[a-z_]+)", line.split("|")[1])
    assert len(names) >= 15, names
    return names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_node_exporter_serves_every_documented_family_from_the_textfile(runc_host, tmp_path, monkeypatch):
    exporter = need_tool("prometheus-node-exporter")  # Debian's prometheus-node-exporter (.ci/apt.d/cluster.txt)
    # every family, the histogram, the findings and the MIG device and IMEX channel included
    story, cid = tell_mig(runc_host, tmp_path, monkeypatch)
    story.metrics.on_repair(ok=False)
    story.metrics.on_event_latency(0.004)
    assert story.metrics.flush()
    directory = story.host.path(os.path.dirname(TEXTFILE))
    port = free_port()
    proc = subprocess.Popen([exporter, "--collector.disable-defaults", "--collector.textfile",
                             f"--collector.textfile.directory={directory}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "node-exporter did not answer"
                time.sleep(0.1)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    scraped = {s.name for f in fams.values() for s in f.samples}
    for name in documented_families():
        assert name in scraped or name + "_bucket" in scraped, f"{name} not served by node-exporter"
    errors = [s.value for s in fams["node_textfile_scrape_error"].samples]
    assert errors == [0.0], text
    (finding,) = fams["nvsymlinkd_gpu_container_findings"].samples
    assert finding.labels == {**GPU_POD, "container_id": cid, "status": "lost"}
    assert len(fams["nvsymlinkd_gpu_container_devices"].samples) == 2


# -- the Prometheus Operator's objects ----------------------------------------------------------


def test_the_prometheusrule_is_the_plain_rules_file():
    docs = [d for p in sorted(OPERATOR.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == rules()  # one source of truth: the groups, rule for rule
    # and the file is what the generator writes from it
    import runpy

    generator = runpy.run_path(str(REPO / "scripts/prometheusrule"), run_name="prometheusrule")
    assert (OPERATOR / "prometheusrule.yaml").read_text() == generator["render"](RULES.read_text()), \
        "deploy/prometheus/operator/prometheusrule.yaml is stale: run scripts/prometheusrule"


def test_the_operator_component_scrapes_the_daemonsets_pods_on_a_port_they_declare(tmp_path):
    from tests.test_deploy import by_kind, daemonset, render

    overlay = tmp_path / "site"
    overlay.mkdir()
    base = os.path.relpath(REPO / "deploy/kubernetes/base", overlay)
    component = os.path.relpath(OPERATOR, overlay)
    (overlay / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{component}]\n")
    docs = render(overlay)
    kinds = by_kind(docs)
    (monitor,) = kinds["PodMonitor"]
    (rule,) = kinds["PrometheusRule"]
    assert rule["spec"] == rules()
    ds = daemonset(docs)
    pod = ds["spec"]["template"]
    assert monitor["metadata"]["namespace"] == ds["metadata"]["namespace"] == rule["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True  # the findings' namespace/pod/container name the GPU workload
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert parse_listen(":9402")[1] == ports[endpoint["port"]]  # the metrics_listen the docs tell to set
