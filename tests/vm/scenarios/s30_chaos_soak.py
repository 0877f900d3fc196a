"""Scenario 30: the chaos soak (issue 17), CI's share: one guest, the .deb's daemon, five GPU
containers alive at all times (Docker --gpus, containerd through the NVIDIA runtime wrapper,
Podman with the OCI hook on runc, Podman with CDI on crun, plain runc with the devices in its
spec), each polling /dev/nvidia0 every 10 ms; two non-GPU containers; one container that mknods
its own NVIDIA nodes. Then seeded sequences of 20 steps (tests/vm/guest/chaos.py: reloads,
re-execs, nvidia-uvm reloaded (maybe on a new major), new GPU nodes, /dev/char links removed by
hand, resource updates, containers recreated, runtime daemons, nvsymlinkd restarted / SIGKILLed /
SIGHUPed with a changed config, /run full, the system bus restarted), invariants (a)-(e) judged
after every step by the kernel (the pollers; open() from each container's cgroup) beside
nvsymlinkd's access engine. See docs/vm.md, "Chaos soak".

Seeds: chaos.CI_SEEDS here, the rest of chaos.FULL_SEEDS in s31 (NVSYMLINKD_VM_MATRIX=full).
NVSYMLINKD_CHAOS_SEEDS=7 (or 3,9 / 11-20) and NVSYMLINKD_CHAOS_STEPS=<a printed sequence> on the
host re-run exactly what failed (kernel command line nvsymlinkd.chaos_seeds / chaos_steps).
"""
# vm: nvsymlinkd=deb timeout=3600
from tests.vm.guest.chaosrun import run_soak

run_soak("ci")
