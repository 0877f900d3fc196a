"""Scenario 21: rolling the DaemonSet's pod (issue 14): a restart of the pod loses nothing the host
package would keep.

The pod (rendered base, kube play) sees a Docker GPU container and persists its baseline on the
host (/run/nvsymlinkd, a hostPath). Then the pod stops (`podman pod stop -t <grace>`, the
rolling update's delete), the container restarts (`docker restart`: same id, a new scope the
NVIDIA hook grants behind systemd's back, so it is at risk) and a daemon-reload takes its GPU
while no nvsymlinkd runs (gpupoll sees EPERM). The pod starts again: from the persisted baseline
it finds the loss and repairs it (journal repaired, gpupoll opens again, check ok).
"""
# vm: nvsymlinkd=off pod=yes timeout=1500 matrix=full
import json
import os
import time

from kubepod import Pod, image_ready, install_pause, load_rendered, translate
from stacks import Docker, install_nvidia_toolkit, journal_since, wait_prevented
from vmguest import MODULES, Scenario, daemon_reload, load_fake_driver, mknod, sh, wait_for

from nvsymlinkd.journal import MESSAGE_IDS

with Scenario() as sc:
    install_pause(MODULES)
    image_ready(sc)
    plan = translate(load_rendered("base"))
    load_fake_driver(uvm=True)
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255)]
    pod = Pod(plan, network="none")
    sc.timing("kube_play_s", pod.play())
    base_cmd = [w for w in plan.container["command"] if w != "run"]

    def check_in_pod() -> dict:
        proc = pod.exec(*base_cmd, "check", "--json")
        try:
            return json.loads(proc.stdout)
        except ValueError:
            return {"error": f"exit {proc.returncode}: {proc.stdout[-300:]} {proc.stderr[-300:]}"}

    try:
        ready, seconds, out = pod.wait_ready()
        sc.check("pod READY", ready, out[-300:])
        install_nvidia_toolkit()
        docker = Docker()
        docker.start()
        try:
            ctr = docker.run_gpu("gpu-roll")
            log = ctr.wait_polling()
            sc.check("gpupoll opens /dev/nvidia0 at start", bool(log.last_alive) and not log.denied, log.summary())
            sc.check("the pod prevented it", wait_prevented(ctr, unit=None) is not None)
            state = os.listdir("/run/nvsymlinkd") if os.path.isdir("/run/nvsymlinkd") else []
            sc.fact("host_state_dir", state)
            sc.timing("pod_stop_s", pod.stop())
            sh("docker", "restart", "-t", "1", ctr.id, timeout=120)
            ctr.wait_polling()
            daemon_reload()
            lost, t = wait_for(lambda: ctr.poll_log().denied, timeout=20, interval=0.5)
            sc.check("with the pod stopped, a reload takes the restarted container's GPU (EPERM)", bool(lost),
                     ctr.poll_log().summary())
            since = int(time.time() * 1e6)
            sc.timing("pod_start_s", pod.start())
            ready, seconds, out = pod.wait_ready()
            sc.check("pod READY again", ready, out[-300:])

            def repaired():
                return [e for e in journal_since(since, None)
                        if e.get("MESSAGE_ID") == MESSAGE_IDS["repair-done"] and ctr.short_id in str(e.get("MESSAGE"))]
            found, t = wait_for(repaired, timeout=120, interval=1)
            sc.check("the restarted pod found the loss and journaled repair-done", bool(found),
                     str((found or [{}])[0].get("MESSAGE", ""))[:300])
            sc.timing("repaired_after_pod_start_s", t)
            opened, _ = wait_for(lambda: ctr.exec("/bin/sh", "-c", "exec 3<>/dev/nvidia0 && echo OK").stdout.strip()
                                 == "OK", timeout=30, interval=0.5)
            sc.check("the container opens /dev/nvidia0 again", bool(opened))
            verdicts = {c.get("id"): c.get("verdict") for c in check_in_pod().get("containers", [])}
            sc.check("check --json in the pod: ok", verdicts.get(ctr.id) == "ok", str(verdicts))
        finally:
            docker.remove_all()
    finally:
        pod.down()
