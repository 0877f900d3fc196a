"""Scenario 11: Docker 20.10 as users run it, with the .deb installed and nvsymlinkd running.

Same stack as s10 (systemd cgroup driver, `--gpus all` and `--runtime=nvidia`, the GPU granted by
the prestart hook behind systemd's back). nvsymlinkd sees each container, journals
repair-prevented, and `check --json` lists it ok as runtime docker with its docker-<id>.scope.
Then 20 daemon-reloads, 2 daemon-reexecs, 10 `docker update --cpuset-cpus` (the full matrix's
counts; the default run 3, 2 and 2: stacks.event_counts), a restart of dockerd (live-restore) and of
containerd: gpupoll in each container (open every 10 ms) sees zero
denied opens. A plain (non-GPU) container beside them is not listed as a GPU one; `repair` and
`check` take the Docker name, an id prefix and the scope; the journal says at risk, prevented,
ok once per hook-granted container, naming it (CONTAINER_NAME). A third GPU container started
right after the re-execs is seen through D-Bus (systemd keeps the daemon's Subscribe() across a
re-exec: the daemon runs with NVSYMLINKD_DEBUG=1 here to show the scope signal) and prevented.
A fourth (issue 24) has its NVIDIA hook run `systemctl daemon-reload` right after the grant, inside
runc create: the reload finds nvsymlinkd's drop-in of the scope (the hook's grant reconstructed from
the spec and the driver's GPU list, published as s24 does; written while runc created the container,
nothing live changed) and keeps the grant; gpupoll never sees a denied open.
On cgroup v1 the verdict allows systemd's own short re-apply windows (stacks.judge_poll).
"""
# vm: nvsymlinkd=deb timeout=900 full=v1
import os

from tests.vm.guest.nvidia_hook import LOG as HOOK_LOG
from tests.vm.guest.nvidia_hook import RELOAD_AFTER_GRANT
from tests.vm.guest.stacks import Docker, install_nvidia_toolkit, prove_prevention, publish_gpu_list
from tests.vm.guest.vmguest import (
    Scenario,
    expect_nvsymlinkd,
    gpu_nodes_linked,
    sh,
)

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    # debug lines name each container scope the daemon hears of over D-Bus
    os.makedirs("/run/systemd/system/nvsymlinkd.service.d", exist_ok=True)
    with open("/run/systemd/system/nvsymlinkd.service.d/debug.conf", "w") as f:
        f.write("[Service]\nEnvironment=NVSYMLINKD_DEBUG=1\n")
    # the NVIDIA hook's grant is reconstructed (trusted) only with the driver's GPU list (as s24, s30);
    # publishing it reloads systemd, the restart brings the unit into its /proc/driver
    sc.check("the driver's GPU list is published under /proc/driver/nvidia/gpus", publish_gpu_list())
    sh("systemctl", "restart", "nvsymlinkd.service", timeout=120)
    gpu_nodes_linked(sc)
    install_nvidia_toolkit()
    docker = Docker()
    sc.timing("dockerd_start_and_import_s", docker.start())
    try:
        # the plain container first: its new scope must not be what triggers the GPU ones' check
        plain = [docker.run_plain("web")]
        ctrs = [docker.run_gpu("gpu-gpus"),
                docker.run_gpu("gpu-legacy", gpus=False, runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=all"])]
        # a reload between the hook's grant and state.json: kept by the drop-in, so never at risk
        race = docker.run_gpu("gpu-race", env=[RELOAD_AFTER_GRANT])
        race.needs_prevention = False
        ctrs.append(race)
        with open(HOOK_LOG) as f:
            said = [line.strip() for line in f if race.id in line and "daemon-reload after the grant" in line]
        sc.check("gpu-race: its hook reloaded systemd after the grant, the drop-in already there",
                 len(said) == 1 and "was there" in said[0], " | ".join(said) or "no such line in the hook's log")
        if said:
            sc.fact("gpu_race_dropin_wait", said[0].rsplit(" after ", 1)[1])
        wrote = sh("journalctl", "-u", "nvsymlinkd.service", "-o", "cat", "--no-pager", check=False).stdout
        sc.check("gpu-race: nvsymlinkd journaled the drop-in it wrote while runc created it",
                 any(race.id in line and "being created: wrote" in line for line in wrote.splitlines()))
        prove_prevention(sc, docker, ctrs, "docker", plain=plain,
                         after_reexec=lambda: docker.run_gpu("gpu-late"))
    finally:
        docker.remove_all()
