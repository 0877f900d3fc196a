"""Scenario 20: the DaemonSet's pod on the node it guards (issue 14), no host package installed.

The image is built offline from deploy/kubernetes/Dockerfile (podman build --pull=never, BASE a
bookworm minbase made on the host; cached on the host after the first build), the pod is the
rendered base DaemonSet's template run with `podman kube play` (tests/vm/guest/kubepod.py: every
field honoured or the run fails). On cgroup v2 Podman gives it a private cgroup namespace, as
containerd gives pods; on v1 (@v1) the host's. Judged on the host: the pod keeps /dev/char links
(also for a late nvidia-uvm, whose udev event it hears), sees Docker's and Podman's GPU containers
ok (not unknown), prevents their loss through one set of 10 daemon-reloads for both (v2: zero
denied opens; v1: only systemd's re-apply windows), writes the metrics textfile on the host,
its probes pass, and its journal entries reach the host's journal with MESSAGE_IDs that the
node-problem-detector config's patterns match.

In the default run (not NVSYMLINKD_VM_MATRIX=full) the same boot then runs s21's three proofs
(driver-container overlay, rolling, report-only; s21_pod_rolling_and_overlays.run_proofs) from a
clean slate: one image build or load and one boot serve every pod proof (CI time, issue 27), and
the reloads are 5, not 10. The full matrix runs s21 as its own cells on both hierarchies instead.
"""
# vm: nvsymlinkd=off pod=yes timeout=3600 full=v1
import glob
import json
import os
import re

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest.kubepod import (
    TEXTFILE,
    Pod,
    cgroup_v1,
    clean_slate,
    image_ready,
    install_pause,
    journal_since,
    load_rendered,
    reloads_keep_gpus,
    translate,
)
from tests.vm.guest.stacks import Docker, Podman, install_nvidia_toolkit, prove_prevention
from tests.vm.guest.vmguest import (
    MODULES,
    SRC,
    Scenario,
    full_matrix,
    load_fake_driver,
    load_fake_uvm,
    mknod,
    proc_devices_majors,
    sh,
    wait_for,
)

NPD = os.path.join(SRC, "deploy", "node-problem-detector", "nvsymlinkd-monitor.json")
RELOADS = 10            # the full matrix's; the default run's: 5
DEFAULT_RELOADS = 5


def link_ok(node) -> bool:
    return os.path.realpath(node.char_link) == node.path


def ns(pid, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


with Scenario() as sc:
    v1 = cgroup_v1()
    sc.fact("cgroup", "v1" if v1 else "v2")
    install_pause(MODULES)
    image_ready(sc)
    plan = translate(load_rendered("base"))
    counts = {}
    for how in plan.how.values():
        counts[how] = counts.get(how, 0) + 1
    sc.fact("daemonset_fields", counts)
    majors = load_fake_driver()
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255)]
    pod = Pod(plan)
    sc.timing("kube_play_s", pod.play())
    try:
        ready, seconds, out = pod.wait_ready()
        sc.check("pod READY (startupProbe, then readinessProbe, from the rendered YAML)", ready, out[-300:])
        sc.timing("pod_start_to_ready_s", seconds)
        pid = pod.pid()
        sc.check("pod runs in the host PID namespace (hostPID)", ns(pid, "pid") == ns(1, "pid"))
        sc.check("pod runs in the host network namespace (hostNetwork)", ns(pid, "net") == ns(1, "net"))
        private = ns(pid, "cgroup") != ns(1, "cgroup")
        sc.fact("pod_cgroupns", "private" if private else "host")
        if not v1:
            sc.check("pod has a private cgroup namespace (Podman's default on v2, as containerd's pods)",
                     private, ns(pid, "cgroup"))
        caps = next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("CapEff:")).split()[1]
        sc.check("pod is privileged (all capabilities)", int(caps, 16) >= 0x1ffffffffff, caps)
        for node in nodes:
            ok, t = wait_for(lambda node=node: link_ok(node), timeout=30)
            sc.check(f"pod made {node.char_link} -> {node.path} on the host", bool(ok), f"{t:.1f} s")
        uvm = mknod("/dev/nvidia-uvm", load_fake_uvm(), 0)
        ok, t = wait_for(lambda: link_ok(uvm), timeout=90)
        sc.check(f"late nvidia-uvm: pod made {uvm.char_link} -> {uvm.path}", bool(ok), f"{t:.1f} s")
        sc.timing("late_uvm_link_s", t)
        udev, _ = wait_for(lambda: [e for e in journal_since(0) if "udev: module nvidia_uvm add" in str(e.get("MESSAGE"))],
                           timeout=30, interval=0.5)
        sc.check("the pod heard udevd's event for the nvidia-uvm load", bool(udev))

        install_nvidia_toolkit()
        docker = Docker()
        sc.timing("dockerd_start_and_import_s", docker.start())
        podman = Podman(runtime="runc")
        podman.import_image()
        try:
            # both runtimes' GPU containers prevented, then one set of reloads for both
            dctrs = [docker.run_gpu("gpu-docker")]
            prove_prevention(sc, docker, dctrs, "docker", reloads=0, reexecs=0, updates=0, restart=False,
                             unit=None, check_json=pod.check_json)
            pctrs = [podman.run_gpu("gpu-podman", "hook")]
            prove_prevention(sc, podman, pctrs, "podman", reloads=0, reexecs=0, updates=0, restart=False,
                             unit=None, check_json=pod.check_json)
            report = reloads_keep_gpus(sc, pod, dctrs + pctrs, RELOADS if full_matrix() else DEFAULT_RELOADS, v1)
            unknown = [c.get("id", "")[:12] for c in report.get("containers", []) if c.get("verdict") == "unknown"]
            sc.check("check --json in the pod: no container unknown", not unknown and "error" not in report,
                     str(unknown or report.get("error", "")))
        finally:
            docker.remove_all()
            sh("podman", "rm", "-f", "-t", "0", "gpu-podman", check=False, timeout=120)

        sc.check(f"metrics textfile on the host: {TEXTFILE}", os.path.exists(TEXTFILE))
        for kind in ("startup", "liveness", "readiness"):
            ok, secs, out = pod.run_probe(kind)
            sc.check(f"{kind}Probe passes", ok, out[-200:])
            sc.timing(f"{kind}_probe_s", secs)
        entries = [json.loads(ln) for ln in sh("journalctl", "-b", "--no-pager", "-o", "json",
                                                "SYSLOG_IDENTIFIER=nvsymlinkd", check=False).stdout.splitlines()
                   if ln.strip()]
        ids = {v: k for k, v in MESSAGE_IDS.items()}
        named = sorted({ids[e["MESSAGE_ID"]] for e in entries if e.get("MESSAGE_ID") in ids})
        sc.check("the host's journal has the pod's entries with MESSAGE_IDs", "repair-prevented" in named,
                 ", ".join(named))
        from_pod = [e for e in entries if e.get("_PID") == str(pid)]
        sc.check("entries come from the pod's process (host PID)", bool(from_pod),
                 f"units {sorted({e.get('_SYSTEMD_UNIT', '?') for e in entries})}")
        with open(NPD) as f:
            rules = json.load(f)["rules"]
        prevented = [str(e.get("MESSAGE")) for e in entries if e.get("MESSAGE_ID") == MESSAGE_IDS["repair-prevented"]]
        matched = [r["reason"] for r in rules for m in prevented[:1] if re.match(r["pattern"], m)]
        sc.check("node-problem-detector's pattern matches the real repair-prevented line",
                 "GPUDeviceAccessLossPrevented" in matched, (prevented or ["none"])[0][:200])
        sc.fact("pod_rss_mib", pod.rss_mib())
    finally:
        logs = pod.logs()
        with open(os.path.join(os.environ.get("VM_RESULTS", "/mnt/run/results"), "pod.log"), "w") as f:
            f.write(logs)
        pod.down()

    if not full_matrix():
        # s21's proofs in this boot, from where s21 starts: no pod, no host state, the fake driver
        # without nvidia-uvm, no NVIDIA node or /dev/char link (the pod made them for s20's proof)
        from tests.vm.scenarios import s21_pod_rolling_and_overlays as s21

        clean_slate(None)
        nvidia = {m for name, m in proc_devices_majors().items() if name.startswith("nvidia")}
        for path in glob.glob("/dev/nvidia*"):
            if not os.path.isdir(path):
                os.unlink(path)
        for name in os.listdir("/dev/char"):
            if int(name.split(":")[0]) in nvidia:
                os.unlink(f"/dev/char/{name}")
        sh("rmmod", "nvidia_uvm", timeout=60)
        s21.run_proofs(sc, Docker())
