# vm: nvsymlinkd=deb timeout=900 matrix=full hierarchies=v2,v1
"""Scenario 29: a storm of daemon-reloads while each runtime creates a hook-granted GPU container
(issue 34: "0 denied opens in each, plain runc, Podman with runc, Docker, containerd").

The .deb's daemon runs (repair = "auto"), the driver's GPU list is published (the NVIDIA hook's
grant is reconstructed trusted only with it: stacks.publish_gpu_list), the toolkit stand-in is
installed (stacks.install_nvidia_toolkit). For each runtime in turn: `systemctl daemon-reload` in a
loop, GAP_S between one's return and the next (a reload itself took ~8 s under TCG; back to back,
dockerd's StartTransientUnit waited past `docker run`'s 120 s), from before the container's `runc run` / `podman run` / `docker run` / `ctr run` until 10 s
after it returned; the container's PID 1 is gpupoll, which opens /dev/nvidia0 (and /dev/null, the
control every runtime grants) every 10 ms from its first instruction; its GPU is granted only by the
legacy NVIDIA prestart hook (NVIDIA_VISIBLE_DEVICES=all: Docker --gpus all, containerd through
nvidia-container-runtime, Podman's OCI hook on runc, plain runc with the hook in its spec as a
runtime wrapper adds it). Each reload re-applies the scope's DeviceAllow, which never had the hook's
devices: only the daemon's creation-time drop-in (docs/daemon.md, "A container still being created")
keeps them. The kernel judges: gpupoll's denied opens of /dev/nvidia0 over the storm, 0 for each.
Podman's and plain runc's bundles are found from the runc process creating them
(containers/runtimeproc.py), Docker's and containerd's from their runtime state: the journal's
"being created: wrote" entry names the container (a fact: the drop-in was written before the storm
could take the grant, not a repair after it).

cgroup v1 ("only systemd's own windows"): systemd 252 re-applies a scope's list at every reload as
`a` to devices.deny, then one devices.allow per DeviceAllow= entry (src/core/cgroup.c at v252.39,
cgroup_apply_devices, 1261-1316, the deny-all write at 1283; REFERENCE.md): a deny-all window of each
re-apply that no daemon can prevent, which denies the control device too. So on v1 every closed denial
window of /dev/nvidia0 must be one of those: at most stacks.V1_WINDOW_BOUND_S long and overlapping a
denial window of the control device (a window of the GPU node alone is a lost grant), and none still
open at the end. No file of ours helps inside such a window, nor against a reload that began before
runc's Set: that one holds the Set until it ends (systemd answers no call while it reloads) and
re-applies a scope with no device policy yet, taking nothing. A reload that began after the Set loads
the scope after its generators (src/core/manager.c at v252.39, manager_reload 3404-3435), by when the
daemon, reading the Set from systemd's transient drop-ins and not the bus, has written its drop-in; one
that loaded the scope first is given back after Reloading(false) (docs/daemon.md), and that window
counts here as a loss (@v1 before: Podman+runc 4.66 s, the drop-in written 5.5 s into a reload).
"""
import threading
import time

from tests.vm.guest.pkgsteps import Polled
from tests.vm.guest.stacks import (
    V1_WINDOW_BOUND_S,
    Containerd,
    Docker,
    Podman,
    hierarchy,
    install_nvidia_toolkit,
    publish_gpu_list,
)
from tests.vm.guest.vmguest import (
    Scenario,
    expect_nvsymlinkd,
    gpu_nodes_linked,
    journal,
    sh,
    wait_for,
)

UNIT = "nvsymlinkd.service"
AFTER_S = 10.0      # the "until 10 s after" the run returned
GAP_S = 1.0         # between two reloads: systemd answers the runtimes' calls queued meanwhile


class Storm:
    """`systemctl daemon-reload` on a thread, GAP_S apart, until stopped; counts them."""

    def __init__(self):
        self.count, self.failed = 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        while not self.stop.is_set():
            ok = sh("systemctl", "daemon-reload", check=False, timeout=120).returncode == 0
            self.count, self.failed = self.count + ok, self.failed + (not ok)
            self.stop.wait(GAP_S)

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.count, timeout=60, interval=0.05)   # under way before the run
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=180)


def systemd_window(window: tuple, control_windows: list) -> bool:
    """A GPU node's closed denial window (start, seconds, opens) that is systemd's v1 re-apply: short,
    and the control device denied within it too (gpupoll opens both in one round)."""
    start, seconds, _ = window
    return seconds <= V1_WINDOW_BOUND_S and any(
        c0 <= start + seconds + 0.02 and start <= c0 + cs + 0.02 for c0, cs, _ in control_windows)


def being_created(cid: str) -> bool:
    return any("being created: wrote" in str(e.get("MESSAGE")) for e in journal(unit=UNIT, container_id=cid))


with Scenario() as sc:
    expect_nvsymlinkd(sc)
    _, nodes = gpu_nodes_linked(sc)
    sc.check("the driver's GPU list is published under /proc/driver/nvidia/gpus", publish_gpu_list())
    sh("systemctl", "restart", UNIT, timeout=120)
    install_nvidia_toolkit()
    docker, containerd, podman = Docker(), Containerd(), Podman("runc")
    sc.timing("docker_start_s", docker.start())
    sc.timing("containerd_start_s", containerd.start())
    sc.timing("podman_import_s", podman.start())
    runs = (("runc", lambda: Polled("storm-runc", hook_grants=nodes)),
            ("podman-runc", lambda: podman.run_gpu("storm-podman", "hook")),
            ("docker", lambda: docker.run_gpu("storm-docker")),
            ("containerd", lambda: containerd.run_gpu("storm-ctr")))
    try:
        for runtime, run in runs:
            with Storm() as storm:
                t0 = time.monotonic()
                ctr = run()
                sc.timing(f"{runtime}_run_s", time.monotonic() - t0)
                time.sleep(AFTER_S)
            if isinstance(ctr, Polled):
                cid, log = ctr.name, ctr.poll()
            else:
                cid, log = ctr.id, ctr.wait_polling()
            sc.fact(f"{runtime}_reloads", storm.count)
            sc.check(f"{runtime}: {storm.count} daemon-reloads during the run and the 10 s after it, none failed",
                     storm.count >= 3 and not storm.failed, f"{storm.failed} failed")
            sc.check(f"{runtime}: gpupoll opened /dev/nvidia0 through the storm", log.opens > 0 and
                     log.last_alive is not None, log.summary())
            if hierarchy() == "v2":
                sc.check(f"{runtime}: 0 denied opens of /dev/nvidia0 under the reload storm",
                         not log.denied and log.open_window is None, log.summary())
                sc.check(f"{runtime}: 0 denied opens of the control device", not log.control_denied, log.summary())
            else:
                stray = [w for w in log.windows if not systemd_window(w, log.control_windows)]
                sc.fact(f"{runtime}_v1_windows", len(log.windows))
                sc.check(f"{runtime}: every denial of /dev/nvidia0 under the reload storm is systemd's re-apply "
                         "window (control denied too, short)", not stray and log.open_window is None,
                         f"{log.summary()}; not systemd's: {stray[:5]}")
            sc.fact(f"{runtime}_drop_in_at_creation", being_created(cid))
    finally:
        docker.remove_all()
        containerd.remove_all()
        podman.remove_all()
        sh("runc", "delete", "--force", "storm-runc", check=False)
