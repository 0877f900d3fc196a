# vm: nvsymlinkd=off packages=upgrade timeout=2400 hierarchies=v2,v1 matrix=full
"""Scenario 25: s23's package life cycle (install, upgrade, reinstall, remove, purge, install again)
with GPU containers whose devices the NVIDIA hook granted, outside their spec (issue 25):
  runc+hook   runc with a createRuntime hook that grants c 195:0 like libnvidia-container
  docker      Docker 20.10 `--gpus all` (the prestart hook), systemd cgroup driver
  ctr         containerd 1.6, ctr with the NVIDIA runtime wrapper as runc (legacy mode)
  podman      Podman 4.3 with runc and the NVIDIA OCI hook
Before each step (but purge) one new container of each shape is started with the daemon stopped
(or not installed): no baseline records its grant, so only the maintainer scripts' prevention,
with nvsymlinkd's trusted reconstruction of the hook's grant, can keep it through the package's
daemon-reload. gpupoll in every container; the verdicts as in s23 (pkgsteps). The control runs the
same steps with the packages repacked without the prevention step.
"""
import time

from pkgsteps import PackageSteps, Polled, StackPolled, operator, the_debs, without_prevention
from stacks import Containerd, Docker, Events, Podman, hierarchy, install_nvidia_toolkit
from vmguest import Scenario, load_fake_driver, mknod

with Scenario() as sc:
    wall = time.monotonic()
    old_deb, new_deb = the_debs()
    sc.fact("hierarchy", hierarchy())
    majors = load_fake_driver(uvm=True)
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)
    install_nvidia_toolkit()
    docker, containerd, podman = Docker(), Containerd(), Podman(runtime="runc")
    t0 = time.monotonic()
    docker.start()
    containerd.start()
    podman.start()
    sc.timing("stacks_started_s", time.monotonic() - t0)

    def make(phase, step):
        tag = f"{phase[0]}{step[:3]}"
        return [Polled(f"{tag}-runc", hook_grants=[gpu0]),
                StackPolled(docker.run_gpu(f"{tag}-docker"), "docker --gpus"),
                StackPolled(containerd.run_gpu(f"{tag}-ctr"), "ctr + nvidia runtime"),
                StackPolled(podman.run_gpu(f"{tag}-podman", how="hook"), "podman + runc + OCI hook")]

    events = Events()
    steps = PackageSteps(sc, events)
    try:
        t0 = time.monotonic()
        control = steps.run("control", {"install": without_prevention(old_deb), "upgrade": without_prevention(new_deb),
                                        "reinstall": without_prevention(new_deb),
                                        "again": without_prevention(new_deb)}, make, control=True)
        sc.timing("control_sequence_s", time.monotonic() - t0)
        operator("apt", "-y", "purge", "nvsymlinkd")
        for c in control:
            if isinstance(c, Polled):
                c.remove()
        docker.remove_all()
        containerd.remove_all()
        podman.remove_all()

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
