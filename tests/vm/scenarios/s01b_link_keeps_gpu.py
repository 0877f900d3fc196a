"""Scenario 1b: with /dev/char/195:0 -> ../nvidia0 present before the container starts, runc
passes DeviceAllow=/dev/char/195:0 rw to systemd and access survives reloads and a reexec.
"""
# vm: nvsymlinkd=off timeout=300
from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reexec,
    daemon_reload,
    load_fake_driver,
    make_char_link,
    mknod,
    start_gpu_container,
    unit_property,
)

with Scenario() as sc:
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    make_char_link(gpu0)
    ctr = start_gpu_container("gpu-s01b", [gpu0])
    log = ctr.runc_log()
    sc.check("runc did not skip /dev/char/195:0", "skipping device /dev/char/195:0" not in log)
    allow = unit_property(ctr.scope, "DeviceAllow")
    sc.check(f"{ctr.scope} DeviceAllow has /dev/char/195:0 rw", "/dev/char/195:0 rw" in allow,
             ", ".join(allow.splitlines()))
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start")
    for i in range(1, 4):
        sc.timing(f"daemon_reload_{i}_s", daemon_reload())
        sc.expect_open(ctr, "/dev/nvidia0", "OK", f"after daemon-reload {i}")
    sc.timing("daemon_reexec_s", daemon_reexec())
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after daemon-reexec")
