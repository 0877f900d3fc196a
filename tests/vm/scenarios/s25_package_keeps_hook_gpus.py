# vm: nvsymlinkd=off packages=upgrade timeout=2400 hierarchies=v2,v1 matrix=full
"""Scenario 25: s23's package life cycle (install, upgrade, reinstall, remove, purge, install again)
with GPU containers whose devices the NVIDIA hook granted, outside their spec (issue 25):
  runc+hook   runc with the legacy NVIDIA prestart hook (NVIDIA_VISIBLE_DEVICES=all)
  docker      Docker 20.10 `--gpus all` (the prestart hook), systemd cgroup driver
  ctr         containerd 1.6, ctr with the NVIDIA runtime wrapper as runc (legacy mode)
  podman      Podman 4.3 with runc and the NVIDIA OCI hook
One container of each shape is started on a node without nvsymlinkd before `dpkg -i` (install) and
before the install after the purge (again): no daemon has seen them, no baseline records their grant,
so only the maintainer scripts' prevention, with nvsymlinkd's reconstruction of the hook's grant
(the spec's hook and NVIDIA_VISIBLE_DEVICES, the driver's GPU list: published under
/proc/driver/nvidia/gpus as in s24), keeps them through the package's daemon-reload; all keep polling
through every step. Verdicts as in s23 (pkgsteps). No control here: s23's control shows the package's
reload taking a GPU, s24 that a reload takes hook grants nothing prevented.
"""
import os
import time

from tests.vm.guest.pkgsteps import PackageSteps, Polled, StackPolled, operator, the_debs
from tests.vm.guest.stacks import (
    Containerd,
    Docker,
    Events,
    Podman,
    hierarchy,
    install_nvidia_toolkit,
)
from tests.vm.guest.vmguest import Scenario, daemon_reload, load_fake_driver, mknod, sh

FAKE_PROC_DRIVER = "/run/vmtest/proc-driver"
DROP_IN = "/run/systemd/system/nvsymlinkd.service.d/50-proc-driver.conf"


def fake_proc_driver() -> bool:
    """s24's: one GPU at minor 0 under /proc/driver/nvidia/gpus, on the host (the scripts' nvsymlinkd) and
    in nvsymlinkd.service (its own /proc: BindReadOnlyPaths=), before any container exists."""
    if not os.path.isdir("/proc/driver"):
        return False
    os.makedirs(f"{FAKE_PROC_DRIVER}/nvidia/gpus/0000:00:05.0", exist_ok=True)
    with open(f"{FAKE_PROC_DRIVER}/nvidia/gpus/0000:00:05.0/information", "w") as f:
        f.write("Model: \t\t Fake GPU\nGPU UUID: \t GPU-00000000-vm00-0000-0000-000000000000\nDevice Minor: \t 0\n")
    sh("mount", "--bind", FAKE_PROC_DRIVER, "/proc/driver")
    os.makedirs(os.path.dirname(DROP_IN), exist_ok=True)
    with open(DROP_IN, "w") as f:
        f.write(f"[Service]\nBindReadOnlyPaths={FAKE_PROC_DRIVER}:/proc/driver\n")
    daemon_reload()
    return True


with Scenario() as sc:
    wall = time.monotonic()
    old_deb, new_deb = the_debs()
    sc.fact("hierarchy", hierarchy())
    majors = load_fake_driver(uvm=True)
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)
    sc.check("the driver's GPU list is published under /proc/driver/nvidia/gpus", fake_proc_driver())
    install_nvidia_toolkit()
    docker, containerd, podman = Docker(), Containerd(), Podman(runtime="runc")
    t0 = time.monotonic()
    docker.start()
    containerd.start()
    podman.start()
    sc.timing("stacks_started_s", time.monotonic() - t0)

    def make(phase, step):
        if step not in ("install", "again"):
            return []
        tag = f"{phase[0]}{step[:3]}"
        return [Polled(f"{tag}-runc", hook_grants=[gpu0]),
                StackPolled(docker.run_gpu(f"{tag}-docker"), "docker --gpus"),
                StackPolled(containerd.run_gpu(f"{tag}-ctr"), "ctr + nvidia runtime"),
                StackPolled(podman.run_gpu(f"{tag}-podman", how="hook"), "podman + runc + OCI hook")]

    events = Events()
    steps = PackageSteps(sc, events)
    try:
        t0 = time.monotonic()
        proof = steps.run("proof", {"install": old_deb, "upgrade": new_deb, "reinstall": new_deb, "again": new_deb},
                          make, control=False)
        sc.timing("proof_sequence_s", time.monotonic() - t0)
        for c in proof:
            sc.fact(f"{c.name}_poll", c.poll().summary())
        operator("apt", "-y", "purge", "nvsymlinkd")
        for c in proof:
            if isinstance(c, Polled):
                c.remove()
    finally:
        docker.remove_all()
        containerd.remove_all()
        podman.remove_all()
    sc.timing("scenario_wall_s", time.monotonic() - wall)
