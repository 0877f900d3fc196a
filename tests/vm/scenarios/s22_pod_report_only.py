"""Scenario 22: the report-only overlay's pod finds and reports, never changes (issue 14).

The pod runs the rendered overlays/report-only DaemonSet. A Docker GPU container (NVIDIA hook,
at risk) is started; the pod journals it at risk but adds nothing to its scope (DeviceAllow
unchanged); a daemon-reload takes the GPU (gpupoll sees EPERM) and the pod reports the loss
(repair-reported, check lists it lost) while the container stays denied: no cgroup, no unit
touched.
"""
# vm: nvsymlinkd=off pod=yes timeout=1500 matrix=full
import json
import time

from kubepod import Pod, image_ready, install_pause, load_rendered, translate
from stacks import Docker, install_nvidia_toolkit, journal_since
from vmguest import (
    MODULES,
    Scenario,
    daemon_reload,
    load_fake_driver,
    mknod,
    unit_property,
    wait_for,
)

from nvsymlinkd.journal import MESSAGE_IDS

with Scenario() as sc:
    install_pause(MODULES)
    image_ready(sc)
    plan = translate(load_rendered("report-only"))
    load_fake_driver(uvm=True)
    mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    pod = Pod(plan, network="none")
    sc.timing("kube_play_s", pod.play())
    base_cmd = [w for w in plan.container["command"] if w != "run"]
    try:
        ready, seconds, out = pod.wait_ready()
        sc.check("report-only pod READY", ready, out[-300:])
        install_nvidia_toolkit()
        docker = Docker()
        docker.start()
        try:
            ctr = docker.run_gpu("gpu-report")
            ctr.wait_polling()
            scope = ctr.scope()
            before = unit_property(scope, "DeviceAllow")
            time.sleep(10)   # the pod has seen it (inotify on the runtime state, a resync at the latest)
            sc.check("report-only: nothing added to the scope's DeviceAllow", unit_property(scope, "DeviceAllow")
                     == before, f"{before!r} -> {unit_property(scope, 'DeviceAllow')!r}")
            daemon_reload()
            lost, _ = wait_for(lambda: ctr.poll_log().denied, timeout=20, interval=0.5)
            sc.check("a reload takes the GPU (EPERM): report-only prevents nothing", bool(lost))

            def reported():
                return [e for e in journal_since(0, None) if e.get("MESSAGE_ID") == MESSAGE_IDS["repair-reported"]
                        and ctr.short_id in str(e.get("MESSAGE"))]
            found, t = wait_for(reported, timeout=120, interval=1)
            sc.check("the pod journaled repair-reported for it", bool(found),
                     str((found or [{}])[0].get("MESSAGE", ""))[:300])
            changed = [e for e in journal_since(0, None) if e.get("MESSAGE_ID") in
                       (MESSAGE_IDS["repair-done"], MESSAGE_IDS["repair-prevented"])]
            sc.check("no repair-done or repair-prevented entry", not changed, str(len(changed)))
            time.sleep(5)
            log = ctr.poll_log()
            sc.check("the container is still denied (nothing repaired)", log.open_window is not None, log.summary())
            proc = pod.exec(*base_cmd, "check", "--json")
            try:
                verdicts = {c.get("id"): c.get("verdict") for c in json.loads(proc.stdout).get("containers", [])}
            except ValueError:
                verdicts = {"error": proc.stdout[-200:] + proc.stderr[-200:]}
            sc.check("check --json in the pod lists it lost", verdicts.get(ctr.id) == "lost", str(verdicts))
        finally:
            docker.remove_all()
    finally:
        pod.down()
