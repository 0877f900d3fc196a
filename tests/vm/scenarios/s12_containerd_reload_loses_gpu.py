"""Scenario 12: the seeds' loss with containerd 1.6 as the CRI plugin drives it, no nvsymlinkd
(control). ctr in namespace k8s.io, runc shim v2 with the systemd cgroup driver, cgroupsPath
system.slice:cri-containerd:<id>, nvidia-container-runtime as the runc binary (legacy mode: the
prestart hook grants the GPU behind systemd's back). `systemctl daemon-reload` -> EPERM in gpupoll.
"""
# vm: nvsymlinkd=off timeout=420 matrix=full hierarchies=v2,v1
import time

from tests.vm.guest.stacks import Containerd, install_nvidia_toolkit
from tests.vm.guest.vmguest import Scenario, daemon_reload, load_fake_driver, mknod, sh

with Scenario() as sc:
    majors = load_fake_driver(uvm=True)
    mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255)
    mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)
    install_nvidia_toolkit()
    stack = Containerd()
    sc.timing("containerd_start_and_import_s", stack.start())
    try:
        ctr = stack.run_gpu("gpu-ctr")
        log = ctr.wait_polling()
        sc.check(f"{ctr.name}: gpupoll opens /dev/nvidia0 at start", bool(log.last_alive) and not log.denied,
                 log.summary())
        sc.check("the container is in cri-containerd-<id>.scope", ctr.scope() == f"cri-containerd-{ctr.id}.scope",
                 ctr.scope())
        sc.fact("cgroup", ctr.cgroup().strip())
        sc.fact("run_paths", sh("find", "/run", "-maxdepth", "6", "-name", f"{ctr.id}*", check=False).stdout.split())
        sc.timing("daemon_reload_s", daemon_reload())
        time.sleep(1.0)     # longer than any v1 re-apply window (stacks.V1_WINDOW_BOUND_S)
        log = ctr.poll_log()
        sc.check(f"{ctr.name}: gpupoll saw EPERM after daemon-reload and access never came back (the loss "
                          "reproduces)", log.lost and any(e == "EPERM" for _, e in log.denied), log.summary())
    finally:
        stack.remove_all()
