"""Scenario 23: the driver-container overlay's pod picks up a driver root mounted after it started
(issue 14): the GPU Operator's driver container mounts its root at /run/nvidia/driver on the host
once it runs, and the DaemonSet's HostToContainer mount must carry that mount into the pod.

The pod runs the rendered overlays/driver-container DaemonSet (driver_root /run/nvidia/driver).
After it is READY a tmpfs is mounted at /run/nvidia/driver on the host with the driver's nodes in
its dev/: the mount shows up inside the pod, and the pod makes the host's /dev/char links point at
those nodes.
"""
# vm: nvsymlinkd=off pod=yes timeout=1200 matrix=full
import os

from kubepod import Pod, image_ready, install_pause, load_rendered, translate
from vmguest import MODULES, Scenario, load_fake_driver, mknod, sh, wait_for

DRIVER_ROOT = "/run/nvidia/driver"

with Scenario() as sc:
    install_pause(MODULES)
    image_ready(sc)
    plan = translate(load_rendered("driver-container"))
    load_fake_driver(uvm=False)
    os.makedirs(DRIVER_ROOT, exist_ok=True)
    pod = Pod(plan, network="none")
    sc.timing("kube_play_s", pod.play())
    try:
        ready, seconds, out = pod.wait_ready()
        sc.check("driver-container pod READY", ready, out[-300:])
        sh("mount", "-t", "tmpfs", "-o", "mode=755", "driver", DRIVER_ROOT)
        os.makedirs(f"{DRIVER_ROOT}/dev", exist_ok=True)
        nodes = [mknod(f"{DRIVER_ROOT}/dev/nvidia0", 195, 0), mknod(f"{DRIVER_ROOT}/dev/nvidiactl", 195, 255)]
        pid = pod.pid()
        seen, t = wait_for(lambda: os.path.exists(f"/proc/{pid}/root/host{DRIVER_ROOT}/dev/nvidia0"), timeout=10)
        sc.check("the driver root mounted after the pod started is visible in it (HostToContainer)", bool(seen))
        for node in nodes:
            ok, t = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path, timeout=90)
            sc.check(f"pod made {node.char_link} -> {node.path}", bool(ok),
                     os.readlink(node.char_link) if os.path.lexists(node.char_link) else "no link")
            sc.timing(f"{os.path.basename(node.path)}_link_s", t)
    finally:
        pod.down()
