"""Scenario 2: failure 1 prevented. the .deb is installed and nvsymlinkd running before the driver
loads; the fake driver is inserted afterwards (module uevent) and the nodes made by mknod.
The links appear, and a container started afterwards keeps its GPU through three
daemon-reloads and one daemon-reexec.
"""
# vm: nvsymlinkd=deb timeout=300
import os

from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reexec,
    daemon_reload,
    expect_nvsymlinkd,
    load_fake_driver,
    mknod,
    nvsymlinkd_unit_active,
    start_gpu_container,
    status_in_systemctl_status,
    wait_for,
)

with Scenario() as sc:
    # Installed (dpkg -i, postinst enables and starts it) before the driver loads.
    expect_nvsymlinkd(sc)
    majors = load_fake_driver(uvm=True)
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255),
             mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)]
    for node in nodes:
        ok, waited = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path, timeout=15)
        sc.check(f"{node.char_link} -> {node.path} appeared", bool(ok), f"after {waited:.2f} s")
        sc.timing(f"link_{os.path.basename(node.path)}_s", waited)
    ctr = start_gpu_container("gpu-s02", nodes)
    sc.check("runc skipped no NVIDIA device", "skipping device /dev/char/195:" not in ctr.runc_log()
             and f"/dev/char/{majors['nvidia-uvm']}:0 for systemd" not in ctr.runc_log())
    for node in nodes:
        sc.expect_open(ctr, node.path, "OK", "at start")
    for i in range(1, 4):
        sc.timing(f"daemon_reload_{i}_s", daemon_reload())
        sc.expect_open(ctr, "/dev/nvidia0", "OK", f"after daemon-reload {i}")
    sc.timing("daemon_reexec_s", daemon_reexec())
    for node in nodes:
        sc.expect_open(ctr, node.path, "OK", "after daemon-reexec")
    status, shown = status_in_systemctl_status()
    sc.check("systemctl status nvsymlinkd shows the STATUS line", bool(status) and shown == f'Status: "{status}"',
             f"StatusText {status!r}; shown {shown!r}")
    sc.check("nvsymlinkd.service still active", nvsymlinkd_unit_active())
