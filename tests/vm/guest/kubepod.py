"""The DaemonSet's pod, run with `podman kube play` (issue 14): a stand-in for the kubelet.

The host renders deploy/kubernetes with `kubectl kustomize` (vmhost.render_kube) into the run dir;
translate() takes the rendered documents as they are and wraps the DaemonSet's pod template in a
Pod document for Podman. Every field the rendered DaemonSet sets is in FIELDS, honoured one of
three ways, and a field not listed (or a value not honoured) raises Unhonoured, so a manifest
change the harness cannot run fails the test instead of being silently dropped:

    podman   in the Pod document, applied by `podman kube play` (the scenario checks the ones
             the daemon relies on: host PID namespace, privileged, mounts)
    harness  done by this module: the probes run with `podman exec` as the kubelet runs them,
             the grace period on `podman pod stop`, the image loaded locally
    cluster  means something only to the API server or the scheduler (one pod, one node here)

Pure translation (no guest needed) at the top; the guest side (play, probes) below.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

RUN = os.environ.get("VM_RUN", "/mnt/run")
WORK = "/run/vmtest"
# qemu TCG runs the guest about ten times slower than hardware: probe timeouts are stretched by
# this much (periods and thresholds are kept); what a probe took is recorded
TCG_SLOWDOWN = 10


class Unhonoured(Exception):
    """A field of the rendered manifests the harness cannot honour: the message names it."""


def _one_of(*allowed) -> Callable[[object], Optional[str]]:
    def check(value):
        return None if value in allowed else f"only {', '.join(map(str, allowed))} can be honoured"
    return check


def _is(want) -> Callable[[object], Optional[str]]:
    def check(value):
        return None if value == want else f"only {want!r} can be honoured"
    return check


_C = "spec/template/spec/containers/[]/"
_PROBE = "(runs `podman exec` of exec.command as the kubelet would)"

# path pattern (segments joined by '/', '[]' a list item, '*' any map key) ->
# (how, why, optional value check returning the reason it cannot be honoured)
FIELDS: Dict[str, Tuple[str, str, Optional[Callable]]] = {
    "apiVersion": ("cluster", "apps/v1 DaemonSet", _is("apps/v1")),
    "kind": ("cluster", "the DaemonSet is translated to one Pod", _is("DaemonSet")),
    "metadata/name": ("podman", "the pod's name", None),
    "metadata/namespace": ("cluster", "Podman has no namespaces; one pod on one node", None),
    "metadata/labels/*": ("cluster", "labels of the DaemonSet object", None),
    "spec/selector/matchLabels/*": ("cluster", "the DaemonSet controller's selector", None),
    "spec/updateStrategy/type": ("harness", "rolling: scenario s21 stops the pod and plays it again",
                                 _one_of("RollingUpdate")),
    "spec/updateStrategy/rollingUpdate/maxUnavailable": ("cluster", "how many nodes roll at once", None),
    "spec/template/metadata/labels/*": ("podman", "pod labels", None),
    "spec/template/spec/serviceAccountName": ("cluster", "no API server; the daemon never calls it", None),
    "spec/template/spec/automountServiceAccountToken": ("podman", "no token mounted (none exists)", _is(False)),
    # Podman 4.3's kube play drops hostPID: Pod.play sets containers.conf's pidns for the play
    "spec/template/spec/hostPID": ("harness", "the pod in the host PID namespace (checked)", _is(True)),
    "spec/template/spec/hostNetwork": ("podman", "the host's network namespace (checked: udev events reach it)",
                                       _is(True)),
    "spec/template/spec/priorityClassName": ("cluster", "scheduling and eviction priority", None),
    "spec/template/spec/nodeSelector/*": ("cluster", "the guest is the GPU node", None),
    "spec/template/spec/tolerations/[]/key": ("cluster", "taints: scheduling", None),
    "spec/template/spec/tolerations/[]/operator": ("cluster", "taints: scheduling", None),
    "spec/template/spec/terminationGracePeriodSeconds": ("harness", "`podman pod stop -t` on a stop", None),
    _C + "name": ("podman", "the container's name (Podman: <pod>-<name>)", None),
    _C + "image": ("harness", "built from deploy/kubernetes/Dockerfile and tagged as rendered", None),
    _C + "imagePullPolicy": ("harness", "the image is present: never pulled", _one_of("IfNotPresent", "Never")),
    _C + "command/[]": ("podman", "the container's command", None),
    _C + "env/[]/name": ("podman", "environment", None),
    _C + "env/[]/value": ("podman", "environment", None),
    _C + "securityContext/privileged": ("podman", "privileged (checked: all capabilities)", _is(True)),
    _C + "securityContext/readOnlyRootFilesystem": ("podman", "read-only root filesystem (--read-only)", None),
    _C + "resources/limits/memory": ("podman", "memory limit on the container's cgroup", None),
    _C + "resources/requests/*": ("cluster", "requests only schedule", None),
    _C + "startupProbe/exec/command/[]": ("harness", _PROBE, None),
    _C + "startupProbe/periodSeconds": ("harness", _PROBE, None),
    _C + "startupProbe/failureThreshold": ("harness", _PROBE, None),
    _C + "startupProbe/timeoutSeconds": ("harness", _PROBE, None),
    _C + "livenessProbe/exec/command/[]": ("harness", _PROBE + "; Podman also makes it a healthcheck", None),
    _C + "livenessProbe/periodSeconds": ("harness", _PROBE, None),
    _C + "livenessProbe/failureThreshold": ("harness", _PROBE, None),
    _C + "livenessProbe/timeoutSeconds": ("harness", _PROBE, None),
    _C + "readinessProbe/exec/command/[]": ("harness", _PROBE, None),
    _C + "readinessProbe/periodSeconds": ("harness", _PROBE, None),
    _C + "readinessProbe/failureThreshold": ("harness", _PROBE, None),
    _C + "readinessProbe/timeoutSeconds": ("harness", _PROBE, None),
    _C + "volumeMounts/[]/name": ("podman", "bind mounts", None),
    _C + "volumeMounts/[]/mountPath": ("podman", "bind mounts", None),
    _C + "volumeMounts/[]/readOnly": ("podman", "read-only bind (checked)", None),
    # IfPossible: recursive where the runtime can, plain read-only where it cannot (Podman 4.3)
    _C + "volumeMounts/[]/recursiveReadOnly": ("podman", "read-only bind, recursive where possible",
                                               _one_of("IfPossible", "Disabled")),
    _C + "volumeMounts/[]/mountPropagation": ("podman", "rslave bind: host mounts propagate in (checked)",
                                              _one_of("HostToContainer", "None")),
    "spec/template/spec/volumes/[]/name": ("podman", "volumes", None),
    "spec/template/spec/volumes/[]/hostPath/path": ("podman", "hostPath bind", None),
    "spec/template/spec/volumes/[]/hostPath/type": ("podman", "hostPath type (Podman checks or creates)",
                                                    _one_of("Directory", "DirectoryOrCreate", "Socket",
                                                            "File", "FileOrCreate")),
    "spec/template/spec/volumes/[]/configMap/name": ("podman", "the rendered ConfigMap's files", None),
}

# the other kinds kustomize renders
KINDS = {"Namespace": "cluster", "ServiceAccount": "cluster", "ConfigMap": "podman", "DaemonSet": "translated"}


def leaves(obj, path: str = ""):
    """(path, value) of every scalar: map keys joined by '/', list items as '[]'."""
    if isinstance(obj, dict):
        if not obj and path:
            yield path, obj
        for key, value in obj.items():
            yield from leaves(value, f"{path}/{key}" if path else str(key))
    elif isinstance(obj, list):
        for value in obj:
            yield from leaves(value, f"{path}/[]")
    else:
        yield path, obj


def classify(path: str) -> Optional[Tuple[str, str, Optional[Callable]]]:
    if path in FIELDS:
        return FIELDS[path]
    for pattern, rule in FIELDS.items():
        # '*' stands for one map key, which may itself hold dots and slashes (label keys)
        if "*" in pattern and fnmatch.fnmatchcase(path, pattern):
            return rule
    return None


@dataclass
class PodPlan:
    """What translate() made of the rendered manifests."""
    pod: dict                       # the Pod document for `podman kube play`
    configmaps: List[dict]          # the ConfigMaps its volumes name
    container: dict                 # the (one) container of the template, as rendered
    how: Dict[str, str] = field(default_factory=dict)       # field path -> podman|harness|cluster

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def container_name(self) -> str:
        return f"{self.name}-{self.container['name']}"

    @property
    def image(self) -> str:
        return self.container["image"]

    def probe(self, kind: str) -> Optional[dict]:
        return self.container.get(f"{kind}Probe")

    def grace_s(self) -> int:
        return int(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def play_text(self) -> str:
        """The documents for `podman kube play`: JSON is YAML, one per '---' section."""
        return "\n---\n".join(json.dumps(d, indent=1) for d in self.configmaps + [self.pod]) + "\n"


def translate(docs: List[dict]) -> PodPlan:
    """The rendered documents (kubectl kustomize) -> PodPlan; Unhonoured names the first field or
    kind the harness cannot honour."""
    for doc in docs:
        if doc.get("kind") not in KINDS:
            raise Unhonoured(f"kind {doc.get('kind')!r} ({doc.get('metadata', {}).get('name')}): not known to "
                             "tests/vm/guest/kubepod.py; say how a one-node pod run honours it")
    daemonsets = [d for d in docs if d["kind"] == "DaemonSet"]
    if len(daemonsets) != 1:
        raise Unhonoured(f"{len(daemonsets)} DaemonSets rendered; the harness runs exactly one")
    ds = daemonsets[0]
    how = {}
    for path, value in leaves(ds):
        rule = classify(path)
        if rule is None:
            raise Unhonoured(f"DaemonSet field {path} = {value!r}: not known to tests/vm/guest/kubepod.py; "
                             "honour it (Pod document, harness) or say why it means nothing on one node")
        kind, _, check = rule
        problem = check(value) if check else None
        if problem:
            raise Unhonoured(f"DaemonSet field {path} = {value!r}: {problem}")
        how[path] = kind
    template = ds["spec"]["template"]
    if len(template["spec"]["containers"]) != 1:
        raise Unhonoured("the harness runs a pod template with exactly one container")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": ds["metadata"]["name"], "labels": dict(template["metadata"].get("labels", {}))},
           "spec": copy.deepcopy(template["spec"])}
    wanted = {v["configMap"]["name"] for v in pod["spec"].get("volumes", []) if "configMap" in v}
    configmaps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] in wanted]
    missing = wanted - {c["metadata"]["name"] for c in configmaps}
    if missing:
        raise Unhonoured(f"the pod's configMap volumes name {sorted(missing)}, which kustomize did not render")
    return PodPlan(pod, configmaps, template["spec"]["containers"][0], how)


# ---------------------------------------------------------------- guest side

def load_rendered(overlay: str = "base") -> List[dict]:
    with open(os.path.join(RUN, "kube", f"{overlay}.json")) as f:
        return json.load(f)


def pod_info() -> dict:
    with open(os.path.join(RUN, "pod.json")) as f:
        return json.load(f)


def _sh(*argv, timeout=120, check=True, env=None):
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def install_pause(modules: str) -> None:
    """Podman builds its local infra (pause) image from catatonit, which Debian's podman only
    recommends and the guest lacks: the static tests/vm/poller/pause.c stands in for it."""
    dest = "/usr/local/libexec/podman/catatonit"
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(os.path.join(modules, "pause"), "rb") as src, open(dest, "wb") as out:
        out.write(src.read())
    os.chmod(dest, 0o755)


def image_ready(sc) -> str:
    """The DaemonSet's image in Podman's store: loaded from the host's cache, or built here from
    deploy/kubernetes/Dockerfile offline (BASE imported from the host's minbase tarball) and saved
    to the run dir for the host to cache (unless pod.json says no). Returns the image reference."""
    info = pod_info()
    image = info["image"]
    start = time.monotonic()
    cached = os.path.join(RUN, "podimage.tar")
    if os.path.exists(cached):
        _sh("podman", "load", "-i", cached, timeout=600)
        sc.timing("pod_image_load_s", time.monotonic() - start)
        sc.fact("pod_image", "cached build loaded")
    else:
        _sh("podman", "import", os.path.join(RUN, "podbase.tar"), info["base_tag"], timeout=600)
        sc.timing("pod_base_import_s", time.monotonic() - start)
        start = time.monotonic()
        proc = _sh("podman", "build", "--pull=never", "--network", "none", "--build-arg",
                   f"BASE={info['base_tag']}", "-f", "/mnt/src/deploy/kubernetes/Dockerfile", "-t", image,
                   "/mnt/src", timeout=1500, check=False)
        with open(os.path.join(os.environ.get("VM_RESULTS", "/mnt/run/results"), "podman-build.log"), "w") as f:
            f.write(proc.stdout + proc.stderr)
        sc.check("podman build --pull=never of deploy/kubernetes/Dockerfile (offline)", proc.returncode == 0,
                 (proc.stderr or proc.stdout).strip()[-600:] if proc.returncode else "")
        if proc.returncode:
            raise RuntimeError("the image did not build")
        sc.timing("pod_image_build_s", time.monotonic() - start)
        if info.get("save", True):
            start = time.monotonic()
            out = os.path.join(RUN, "podimage-built")
            os.makedirs(out, exist_ok=True)
            _sh("podman", "save", "-o", os.path.join(out, "image.tar.tmp"), image, timeout=600)
            os.rename(os.path.join(out, "image.tar.tmp"), os.path.join(out, "image.tar"))
            sc.timing("pod_image_save_s", time.monotonic() - start)
        # not saved in a CI default run: nothing after it would load it (vmhost.pod_image_kept)
        sc.fact("pod_image", "built in the guest" + ("" if info.get("save", True) else ", not saved"))
    size = int(_sh("podman", "image", "inspect", "-f", "{{.Size}}", image).stdout.strip())
    base = _sh("podman", "image", "inspect", "-f", "{{.Size}}", info["base_tag"], check=False).stdout.strip()
    sc.fact("pod_image_size_mib", round(size / 2**20, 1))
    if base.isdigit():
        sc.fact("pod_image_base_size_mib", round(int(base) / 2**20, 1))
    return image


class Pod:
    """One `podman kube play` of a PodPlan."""

    def __init__(self, plan: PodPlan):
        self.plan = plan
        self.path = os.path.join(WORK, f"pod-{plan.name}.yaml")
        self.played_at: Optional[float] = None

    def play(self) -> float:
        os.makedirs(WORK, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(self.plan.play_text())
        argv = ["podman", "kube", "play"]
        env = None
        if self.plan.pod["spec"].get("hostPID"):
            env = dict(os.environ, CONTAINERS_CONF=self._hostpid_conf())
        self.played_at = time.monotonic()
        _sh(*argv, self.path, timeout=300, env=env)
        return time.monotonic() - self.played_at

    def _hostpid_conf(self) -> str:
        """containers.conf as Podman reads it, with pidns = "host" (Podman 4.3's kube play ignores
        hostPID): CONTAINERS_CONF points only this play at it, other containers keep their own."""
        text = ""
        for path in ("/usr/share/containers/containers.conf", "/etc/containers/containers.conf"):
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read()
        if re.search(r"^\[containers\]", text, re.M):
            text = re.sub(r"^\[containers\]", '[containers]\npidns = "host"', text, count=1, flags=re.M)
        else:
            text += '\n[containers]\npidns = "host"\n'
        path = os.path.join(WORK, "containers-hostpid.conf")
        with open(path, "w") as f:
            f.write(text)
        return path

    def stop(self) -> float:
        start = time.monotonic()
        _sh("podman", "pod", "stop", "-t", str(self.plan.grace_s()), self.plan.name, timeout=300)
        return time.monotonic() - start

    def start(self) -> float:
        start = time.monotonic()
        _sh("podman", "pod", "start", self.plan.name, timeout=300)
        self.played_at = start
        return time.monotonic() - start

    def down(self) -> None:
        _sh("podman", "kube", "down", self.path, timeout=300, check=False)

    def exec(self, *argv, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", "exec", self.plan.container_name, *argv], capture_output=True,
                              text=True, timeout=timeout)

    def inspect(self) -> dict:
        return json.loads(_sh("podman", "container", "inspect", self.plan.container_name).stdout)[0]

    def pid(self) -> int:
        return int(self.inspect()["State"]["Pid"])

    def logs(self) -> str:
        proc = _sh("podman", "logs", self.plan.container_name, check=False)
        return proc.stdout + proc.stderr

    def check_json(self, *names: str) -> dict:
        """`nvsymlinkd check --json` in the pod, with the rendered command's global options."""
        proc = self.exec(*[w for w in self.plan.container["command"] if w != "run"], "check", "--json", *names)
        try:
            return json.loads(proc.stdout)
        except ValueError:
            return {"error": f"exit {proc.returncode}: {proc.stdout[-400:]} {proc.stderr[-400:]}"}

    def rss_mib(self) -> float:
        with open(f"/proc/{self.pid()}/status") as f:
            rss = next(ln for ln in f if ln.startswith("VmRSS:")).split()[1]
        return round(int(rss) / 1024, 1)

    def run_probe(self, kind: str) -> Tuple[bool, float, str]:
        """The probe's exec command in the container as the kubelet runs it: (passed, seconds, output)."""
        probe = self.plan.probe(kind)
        timeout = probe.get("timeoutSeconds", 1) * TCG_SLOWDOWN
        start = time.monotonic()
        try:
            proc = self.exec(*probe["exec"]["command"], timeout=timeout)
            ok, out = proc.returncode == 0, (proc.stdout + proc.stderr).strip()
        except subprocess.TimeoutExpired:
            ok, out = False, f"timed out after {timeout} s"
        return ok, time.monotonic() - start, out

    def wait_ready(self) -> Tuple[bool, float, str]:
        """startupProbe every periodSeconds until it passes (failureThreshold tries), then the
        readinessProbe: (ready, seconds since play/start, last probe output)."""
        out = ""
        for kind in ("startup", "readiness"):
            probe = self.plan.probe(kind)
            if not probe:
                continue
            tries = probe.get("failureThreshold", 3) if kind == "startup" else 3
            for _ in range(tries):
                ok, _, out = self.run_probe(kind)
                if ok:
                    break
                time.sleep(probe.get("periodSeconds", 10))
            else:
                return False, time.monotonic() - self.played_at, f"{kind}Probe: {out}"
        return True, time.monotonic() - self.played_at, out


# ---------------------------------------------------------------- what the pod scenarios share

STATE_DIR = "/run/nvsymlinkd"       # the DaemonSet's host-state hostPath (state_dir)
TEXTFILE = "/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"
# cgroup v1 with the systemd driver: every reload rewrites each scope's devices.list as deny-all
# then allow, a window of 16-27 ms no host-side tool can close (docs/vm.md, s11@v1); a lost
# device stays lost until repaired, which takes the daemon far longer than this
V1_WINDOW_S = 0.2


def cgroup_v1() -> bool:
    return not os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def play_ready(sc, plan: PodPlan, label: str) -> Pod:
    """kube play the plan and wait for READY as the kubelet would; timings under `label`."""
    pod = Pod(plan)
    sc.timing(f"{label}kube_play_s", pod.play())
    ready, seconds, out = pod.wait_ready()
    sc.check(f"{label}pod READY (startupProbe, then readinessProbe, from the rendered YAML)", ready, out[-300:])
    sc.timing(f"{label}pod_start_to_ready_s", seconds)
    return pod


def clean_slate(pod: Optional[Pod]) -> None:
    """Between two proofs in one boot: the pod gone, its host state and textfile gone (a pod
    scheduled on a fresh node), so the next proof starts from nothing the last one left."""
    if pod is not None:
        pod.down()
    if os.path.isdir(STATE_DIR):
        for name in os.listdir(STATE_DIR):
            path = os.path.join(STATE_DIR, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    if os.path.exists(TEXTFILE):
        os.unlink(TEXTFILE)


def journal_since(since_us: int) -> List[dict]:
    """nvsymlinkd's entries in the host's journal (any unit: in a pod it is the container's
    scope) written at or after since_us (realtime microseconds)."""
    out = _sh("journalctl", "-b", "--no-pager", "-o", "json", "SYSLOG_IDENTIFIER=nvsymlinkd", check=False).stdout
    return [e for e in (json.loads(ln) for ln in out.splitlines() if ln.strip())
            if int(e.get("__REALTIME_TIMESTAMP", 0)) >= since_us]


def now_us() -> int:
    return int(time.time() * 1e6)


def reloads_keep_gpus(sc, pod: Pod, ctrs, reloads: int, v1: bool) -> dict:
    """`reloads` host daemon-reloads with every container of `ctrs` polling its GPU (gpupoll):
    on v2 not one denied open; on v1 only systemd's re-apply windows (each closed by itself
    within V1_WINDOW_S) and no repair after a loss. Returns the pod's `check --json` after."""
    from nvsymlinkd.messageids import MESSAGE_IDS
    since = now_us()
    times = []
    for _ in range(reloads):
        start = time.monotonic()
        _sh("systemctl", "daemon-reload", timeout=120)
        times.append(time.monotonic() - start)
    sc.timing("reload_mean_s", sum(times) / max(1, len(times)))
    time.sleep(0.5)     # gpupoll opens every 10 ms: a window still open now shows as one
    repaired = {e.get("CONTAINER_ID") for e in journal_since(since) if e.get("MESSAGE_ID") == MESSAGE_IDS["repair-done"]}
    for ctr in ctrs:
        log = ctr.poll_log()
        sc.timing(f"{ctr.name}_worst_denial_window_s", log.worst_window_s)
        sc.fact(f"{ctr.name}_opens_denied", [log.opens, len(log.denied)])
        if v1:
            ok = (bool(log.last_alive) and log.open_window is None and log.worst_window_s <= V1_WINDOW_S
                  and ctr.id not in repaired)
            sc.check(f"{ctr.name}: through {reloads} reloads only systemd's v1 re-apply windows (each closed by "
                     f"itself within {V1_WINDOW_S} s), never lost and repaired", ok,
                     log.summary() + ("; repaired after a loss" if ctr.id in repaired else ""))
        else:
            sc.check(f"{ctr.name}: zero denied opens through {reloads} reloads", bool(log.last_alive)
                     and not log.denied, log.summary())
    report = pod.check_json()
    verdicts = {c.get("id"): c.get("verdict") for c in report.get("containers", [])}
    sc.check(f"check --json in the pod after {reloads} reloads: every GPU container ok",
             all(verdicts.get(c.id) == "ok" for c in ctrs), str(verdicts or report.get("error")))
    return report
