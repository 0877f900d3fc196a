# vm: nvsymlinkd=off pod=yes timeout=1500 hierarchies=v2,v1 matrix=full
"""Scenario 21: the DaemonSet's pod rolled, and each overlay's pod (issue 14), in one boot: three
proofs in sequence, each from a clean slate (the last pod gone with its host state and textfile;
kubepod.clean_slate), so one image load serves all three. Each check names its proof; a proof
that fails does not stop the next. As a cell of its own only in the full matrix (v2 and @v1): the
default run has them in s20's boot, after s20's proof (run_proofs; one image build or load, one
boot, for CI time).

driver-container: the rendered overlays/driver-container pod (driver_root /run/nvidia/driver)
    is READY before the driver root exists; then a tmpfs is mounted at /run/nvidia/driver on the
    host with the driver's nodes in its dev/ (the GPU Operator's driver container does this once
    it runs): the HostToContainer mount carries it into the pod and the pod points the host's
    /dev/char links at those nodes.
rolling: the base pod sees a Docker GPU container, persists its baseline on the host
    (/run/nvsymlinkd, a hostPath) and prevents its loss (DeviceAllow, a transient drop-in). The
    pod stops (`podman pod stop -t <grace>`, the rolling update's delete); while it is away the
    container is put at risk again (its drop-in removed, as s03 does to the host package) and a
    daemon-reload takes its GPU (gpupoll sees EPERM). The pod starts again: from the persisted
    baseline it finds the loss and repairs it (journal repair-done, the container opens its GPU,
    check ok). (A `docker restart` instead would start a new init process: a baseline is tied to
    the init's start time, so no daemon, host package or pod, may carry it over.)
report-only: the rendered overlays/report-only pod journals a Docker GPU container at risk but
    adds nothing to its scope; a reload takes the GPU and the pod reports the loss
    (container-lost, repair-reported, check says lost) while the container stays denied: no
    cgroup, no unit touched (no repair-done or repair-prevented entry).
"""
import glob
import os
import traceback
from typing import Optional

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest.kubepod import (
    cgroup_v1,
    clean_slate,
    image_ready,
    install_pause,
    journal_since,
    load_rendered,
    now_us,
    play_ready,
    translate,
)
from tests.vm.guest.stacks import Docker, install_nvidia_toolkit, wait_prevented
from tests.vm.guest.vmguest import (
    MODULES,
    Scenario,
    daemon_reload,
    load_fake_driver,
    mknod,
    sh,
    unit_property,
    wait_for,
)

DRIVER_ROOT = "/run/nvidia/driver"
# the pod picks a driver root mounted late up at its next full pass: the periodic resync
# (resync_interval 60 s in the overlay's config) at the latest
DRIVER_PICKUP_S = 90


def device_allow(scope: str) -> set:
    """The scope's DeviceAllow entries (systemd may list them in another order after a reload)."""
    return set(unit_property(scope, "DeviceAllow").splitlines())


def entries(since: int, kind: str, ctr) -> list:
    return [e for e in journal_since(since) if e.get("MESSAGE_ID") == MESSAGE_IDS[kind]
            and e.get("CONTAINER_ID") == ctr.id]


def driver_container(sc, label: str):
    pod = play_ready(sc, translate(load_rendered("driver-container")), label)
    try:
        sh("mount", "-t", "tmpfs", "-o", "mode=755", "nvidia-driver", DRIVER_ROOT)
        os.makedirs(f"{DRIVER_ROOT}/dev", exist_ok=True)
        nodes = [mknod(f"{DRIVER_ROOT}/dev/nvidia0", 195, 0), mknod(f"{DRIVER_ROOT}/dev/nvidiactl", 195, 255)]
        pid = pod.pid()
        seen, _ = wait_for(lambda: os.path.exists(f"/proc/{pid}/root/host{DRIVER_ROOT}/dev/nvidia0"), timeout=10)
        sc.check(f"{label}the driver root mounted after the pod started is visible in it (HostToContainer)",
                 bool(seen))
        for node in nodes:
            ok, t = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path,
                             timeout=DRIVER_PICKUP_S, interval=0.5)
            sc.check(f"{label}pod made {node.char_link} -> {node.path}", bool(ok),
                     os.readlink(node.char_link) if os.path.lexists(node.char_link) else "no link")
            sc.timing(f"{label}{os.path.basename(node.path)}_link_after_mount_s", t)
    finally:
        clean_slate(pod)
        sh("umount", DRIVER_ROOT, check=False)
        for name in os.listdir("/dev/char"):
            if name.startswith("195:"):
                os.unlink(f"/dev/char/{name}")


def rolling(sc, label: str, docker: Docker):
    pod = play_ready(sc, translate(load_rendered("base")), label)
    try:
        ctr = docker.run_gpu("gpu-roll")
        log = ctr.wait_polling()
        sc.check(f"{label}gpupoll opens /dev/nvidia0 at start", bool(log.last_alive) and not log.denied, log.summary())
        sc.check(f"{label}the pod prevented it", wait_prevented(ctr, unit=None) is not None)
        sc.fact(f"{label}host_state_dir", sorted(os.listdir("/run/nvsymlinkd")) if os.path.isdir("/run/nvsymlinkd")
                else [])
        sc.timing(f"{label}pod_stop_s", pod.stop())
        scope = ctr.scope()
        dropins = [p for p in glob.glob(f"/run/systemd/transient/{scope}.d/*.conf")
                   + glob.glob(f"/run/systemd/system.control/{scope}.d/*.conf") if "DeviceAllow=/dev/char/195:0" in
                   open(p).read()]
        sc.check(f"{label}the pod's prevention is a runtime drop-in of the scope", bool(dropins), scope)
        for path in dropins:
            os.unlink(path)
        daemon_reload()
        lost, _ = wait_for(lambda: ctr.poll_log().open_window is not None, timeout=20, interval=0.5)
        sc.check(f"{label}with the pod stopped and the drop-in gone, a reload takes the GPU (EPERM)", bool(lost),
                 ctr.poll_log().summary())
        since = now_us()
        sc.timing(f"{label}pod_start_s", pod.start())
        ready, seconds, out = pod.wait_ready()
        sc.check(f"{label}pod READY again", ready, out[-300:])
        sc.timing(f"{label}pod_restart_to_ready_s", seconds)
        found, t = wait_for(lambda: entries(since, "repair-done", ctr), timeout=120, interval=1)
        sc.check(f"{label}the restarted pod found the loss from its baseline and journaled repair-done", bool(found),
                 str((found or [{}])[0].get("MESSAGE", ""))[:300])
        sc.timing(f"{label}repaired_after_pod_start_s", t + seconds)
        opened, _ = wait_for(lambda: ctr.poll_log().open_window is None, timeout=30, interval=0.5)
        sc.check(f"{label}the container opens /dev/nvidia0 again (gpupoll)", bool(opened), ctr.poll_log().summary())
        verdicts = {c.get("id"): c.get("verdict") for c in pod.check_json().get("containers", [])}
        sc.check(f"{label}check --json in the pod: ok", verdicts.get(ctr.id) == "ok", str(verdicts))
    finally:
        docker.remove_all()
        clean_slate(pod)


def report_only(sc, label: str, docker: Docker):
    since = now_us()
    pod = play_ready(sc, translate(load_rendered("report-only")), label)
    try:
        ctr = docker.run_gpu("gpu-report")
        ctr.wait_polling()
        scope = ctr.scope()
        before = device_allow(scope)
        # the pass that saw it at risk has ended once it reported what it would do
        said, _ = wait_for(lambda: entries(since, "repair-reported", ctr), timeout=60, interval=0.5)
        sc.check(f"{label}the pod journaled the at-risk container as repair-reported", bool(said),
                 str((said or [{}])[0].get("MESSAGE", ""))[:300])
        after = device_allow(scope)
        sc.check(f"{label}report-only: nothing added to the scope's DeviceAllow", after == before,
                 str(sorted(after ^ before)))
        reload_at = now_us()
        daemon_reload()
        lost, _ = wait_for(lambda: ctr.poll_log().open_window is not None, timeout=20, interval=0.5)
        sc.check(f"{label}a reload takes the GPU (EPERM): report-only prevents nothing", bool(lost))
        found, t = wait_for(lambda: entries(reload_at, "container-lost", ctr)
                            and entries(reload_at, "repair-reported", ctr), timeout=120, interval=1)
        sc.check(f"{label}the pod journaled container-lost and repair-reported after the reload", bool(found),
                 str([e.get("MESSAGE", "")[:200] for e in journal_since(reload_at)
                      if e.get("CONTAINER_ID") == ctr.id]))
        changed = [e for e in journal_since(since) if e.get("MESSAGE_ID") in
                   (MESSAGE_IDS["repair-done"], MESSAGE_IDS["repair-prevented"])]
        sc.check(f"{label}no repair-done or repair-prevented entry", not changed,
                 str([e.get("MESSAGE", "")[:200] for e in changed]))
        verdicts = {c.get("id"): c.get("verdict") for c in pod.check_json().get("containers", [])}
        sc.check(f"{label}check --json in the pod lists it lost", verdicts.get(ctr.id) == "lost", str(verdicts))
        log = ctr.poll_log()
        sc.check(f"{label}the container is still denied (nothing repaired)", log.open_window is not None,
                 log.summary())
        sc.check(f"{label}the scope's DeviceAllow is still as runc left it", device_allow(scope) == before,
                 str(sorted(device_allow(scope) ^ before)))
    finally:
        docker.remove_all()
        clean_slate(pod)


def proof(sc, name: str, fn, *args) -> None:
    try:
        fn(sc, f"{name}: ", *args)
    except Exception:  # noqa: BLE001 - the next proof still runs; the verdict carries this one's failure
        sc.check(f"{name}: ran to the end", False, traceback.format_exc()[-1500:])


def run_proofs(sc, docker: Optional[Docker] = None) -> None:
    """The three proofs, in order, on a guest with the pod image in Podman's store, the fake
    driver loaded without nvidia-uvm and no NVIDIA node yet. docker: dockerd already started with
    the toolkit installed (s20's boot in the default run, which runs these after its own proof)."""
    os.makedirs(DRIVER_ROOT, exist_ok=True)
    proof(sc, "driver-container", driver_container)
    mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    if docker is None:
        install_nvidia_toolkit()
        docker = Docker()
        sc.timing("dockerd_start_and_import_s", docker.start())
    proof(sc, "rolling", rolling, docker)
    proof(sc, "report-only", report_only, docker)


if __name__ == "__main__":
    with Scenario() as sc:
        sc.fact("cgroup", "v1" if cgroup_v1() else "v2")
        install_pause(MODULES)
        image_ready(sc)
        load_fake_driver(uvm=False)
        run_proofs(sc)
