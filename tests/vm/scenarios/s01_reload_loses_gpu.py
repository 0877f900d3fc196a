"""Scenario 1: failure 1 reproduced, no nvsymlinkd.

The fake nvidia module is loaded and /dev/nvidia0 made by mknod, so /dev/char/195:0 does not
exist. runc --systemd-cgroup skips the device rule for systemd; the container can open the GPU
at start (runc's own BPF program allows it) and gets EPERM after systemctl daemon-reload.
"""
# vm: nvsymlinkd=off timeout=240
import os

from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    load_fake_driver,
    mknod,
    start_gpu_container,
)

with Scenario() as sc:
    majors = load_fake_driver()
    sc.check("fake driver registered major 195 'nvidia-frontend'",
             majors.get("nvidia-frontend") == 195, str(majors))
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    sc.check("no /dev/char/195:0 and no /sys/dev/char/195:0 (like the real driver)",
             not os.path.lexists("/dev/char/195:0") and not os.path.exists("/sys/dev/char/195:0"))
    ctr = start_gpu_container("gpu-s01", [gpu0])
    log = ctr.runc_log()
    sc.check("runc logged 'skipping device /dev/char/195:0 for systemd'",
             "skipping device /dev/char/195:0 for systemd" in log,
             next((line for line in log.splitlines() if "195:0" in line), log[-300:]))
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start")
    sc.timing("daemon_reload_s", daemon_reload())
    sc.expect_open(ctr, "/dev/nvidia0", "EPERM", "after daemon-reload")
