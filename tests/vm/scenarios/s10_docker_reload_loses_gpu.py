"""Scenario 10: the seeds' loss with Docker 20.10 as users run it, no nvsymlinkd (control).

dockerd with native.cgroupdriver=systemd; `docker run --gpus all` (dockerd adds
/usr/bin/nvidia-container-runtime-hook as a prestart hook) and `docker run --runtime=nvidia`
(the nvidia-container-runtime wrapper adds the same hook). The hook grants the GPU behind
systemd's back (cgroup v2: allow blocks prepended to the BPF program), so `systemctl
daemon-reload` takes it: gpupoll inside each container (open /dev/nvidia0 every 10 ms) records
EPERM. A control that cannot fail proves nothing: this one fails if the loss stops happening.
"""
# vm: nvsymlinkd=off timeout=420 full=v1
import os
import time

from tests.vm.guest.stacks import Docker, install_nvidia_toolkit
from tests.vm.guest.vmguest import Scenario, daemon_reload, load_fake_driver, mknod, sh

with Scenario() as sc:
    majors = load_fake_driver(uvm=True)
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255),
             mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)]
    install_nvidia_toolkit()
    docker = Docker()
    sc.timing("dockerd_start_and_import_s", docker.start())
    try:
        t0 = time.monotonic()
        gpus = docker.run_gpu("gpu-gpus")
        sc.timing("docker_run_gpus_s", time.monotonic() - t0)
        legacy = docker.run_gpu("gpu-legacy", gpus=False, runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=all"])
        for ctr in (gpus, legacy):
            log = ctr.wait_polling()
            sc.check(f"{ctr.name}: gpupoll opens /dev/nvidia0 at start", bool(log.last_alive) and not log.denied,
                     log.summary())
            sc.fact(f"{ctr.name}_id", ctr.id)
            sc.fact(f"{ctr.name}_scope", ctr.scope())
            sc.fact(f"{ctr.name}_cgroup", ctr.cgroup().strip())
            found = sh("find", "/run", "-maxdepth", "6", "-name", f"{ctr.id}*", check=False).stdout.split()
            sc.fact(f"{ctr.name}_run_paths", found)
        sc.check("--gpus container is in docker-<id>.scope", gpus.scope() == f"docker-{gpus.id}.scope", gpus.scope())
        try:
            with open("/run/vmtest/nvidia-hook.log") as f:
                sc.fact("hook_log", f.read()[-1500:])
        except OSError as e:
            sc.fact("hook_log", str(e))
        sc.timing("daemon_reload_s", daemon_reload())
        time.sleep(1.0)     # longer than any v1 re-apply window (stacks.V1_WINDOW_BOUND_S)
        for ctr in (gpus, legacy):
            log = ctr.poll_log()
            sc.check(f"{ctr.name}: gpupoll saw EPERM after daemon-reload and access never came back (the loss "
                              "reproduces)", log.lost and any(e == "EPERM" for _, e in log.denied), log.summary())
        sc.fact("docker_version", sh("docker", "version", "-f", "{{.Server.Version}}", check=False).stdout.strip())
        sc.fact("runc_state_dirs", sorted(os.listdir("/run/docker")) if os.path.isdir("/run/docker") else [])
    finally:
        docker.remove_all()
