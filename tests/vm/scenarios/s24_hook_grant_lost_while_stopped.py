"""Scenario 24: hook-granted GPUs lost while nvsymlinkd was stopped, given back by its first pass.

Docker `--gpus all` (dockerd adds the legacy NVIDIA prestart hook) and containerd driven with ctr
through the nvidia-container-runtime wrapper (legacy mode: the wrapper adds the same hook) start
while nvsymlinkd.service is stopped, so nothing prevents them and no baseline exists. A
daemon-reload takes the hook's grant (gpupoll: EPERM). `nvsymlinkd check` then says `lost`, the
devices expected from the reconstructed hook grant (source nvidia-hook: the spec's hook and
NVIDIA_VISIBLE_DEVICES, the toolkit's defaults, the driver's GPU list), exit 1. Starting
nvsymlinkd.service, its first pass repairs both (journal repair-done), gpupoll opens
/dev/nvidia0 again, and a further daemon-reload takes nothing.

The fake driver has no /proc/driver/nvidia: the GPU list the hook's grant is reconstructed from
(/proc/driver/nvidia/gpus/<pci>/information, `Device Minor`, `GPU UUID`) is a directory bound over
/proc/driver, as the real driver would publish it for one GPU at minor 0, on the host and (a
drop-in's BindReadOnlyPaths=: the unit mounts its own /proc) in nvsymlinkd.service.
"""
# vm: nvsymlinkd=deb timeout=900 matrix=full hierarchies=v2,v1
import os
import time

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest.stacks import (
    Containerd,
    Docker,
    check_json,
    install_nvidia_toolkit,
    journal_since,
)
from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    expect_nvsymlinkd,
    gpu_nodes_linked,
    nvsymlinkd,
    sh,
    wait_for,
)

UNIT = "nvsymlinkd.service"


FAKE_PROC_DRIVER = "/run/vmtest/proc-driver"
DROP_IN = "/run/systemd/system/nvsymlinkd.service.d/50-proc-driver.conf"


def fake_proc_driver() -> bool:
    """Before any container exists: the daemon-reload that loads the drop-in takes nothing."""
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
    expect_nvsymlinkd(sc)
    gpu_nodes_linked(sc)
    sh("systemctl", "stop", UNIT, timeout=120)
    sc.check("the driver's GPU list is published under /proc/driver/nvidia/gpus", fake_proc_driver())
    install_nvidia_toolkit()
    sc.check("nvsymlinkd.service is stopped", sh("systemctl", "is-active", UNIT, check=False).stdout.strip()
             in ("inactive", "failed"))
    docker, containerd = Docker(), Containerd()
    sc.timing("dockerd_start_and_import_s", docker.start())
    sc.timing("containerd_start_and_import_s", containerd.start())
    try:
        ctrs = [docker.run_gpu("gpu-gpus"), containerd.run_gpu("gpu-ctr")]
        for ctr in ctrs:
            log = ctr.wait_polling()
            sc.check(f"{ctr.name}: gpupoll opens /dev/nvidia0 at start", bool(log.last_alive) and not log.denied,
                     log.summary())
        sc.timing("daemon_reload_s", daemon_reload())
        time.sleep(1.0)     # longer than any v1 re-apply window
        for ctr in ctrs:
            log = ctr.poll_log()
            sc.check(f"{ctr.name}: the reload took the hook's grant while nvsymlinkd was stopped (EPERM)",
                     log.lost and any(e == "EPERM" for _, e in log.denied), log.summary())
        report = check_json()
        listed = {c.get("id"): c for c in report.get("containers", [])}
        for ctr in ctrs:
            got = listed.get(ctr.id, {})
            sources = (got.get("expected") or {}).get("c 195:0", {}).get("sources")
            sc.check(f"{ctr.name}: check says lost, c 195:0 expected from the nvidia-hook source, no baseline",
                     got.get("verdict") == "lost" and sources == ["nvidia-hook"] and got.get("baseline") is None,
                     f"verdict {got.get('verdict')}, sources {sources}, hook {got.get('nvidia_hook')}, "
                     f"findings {[(f['kind'], f['devices']) for f in got.get('findings', [])]}")
        sc.check("check exits 1", nvsymlinkd("check", "--no-host").returncode == 1)
        since = int(time.time() * 1e6)
        started = time.monotonic()
        sh("systemctl", "start", UNIT, timeout=120)
        for ctr in ctrs:
            def repaired(ctr=ctr):
                for e in journal_since(since, UNIT, [f"MESSAGE_ID={MESSAGE_IDS['repair-done']}"]):
                    if ctr.short_id in str(e.get("MESSAGE", "")) or ctr.id in str(e.get("MESSAGE", "")):
                        return e
                return None
            entry, _ = wait_for(repaired, timeout=120, interval=0.5)
            sc.check(f"{ctr.name}: the daemon's first pass journaled repair-done", entry is not None)
            if entry:
                sc.timing(f"{ctr.name}_repaired_after_start_s", int(entry["__REALTIME_TIMESTAMP"]) / 1e6
                          - (time.time() - (time.monotonic() - started)))
            back, _ = wait_for(lambda ctr=ctr: ctr.poll_log().open_window is None or None, timeout=30, interval=0.5)
            sc.check(f"{ctr.name}: gpupoll opens /dev/nvidia0 again", bool(back), ctr.poll_log().summary())
        daemon_reload()
        time.sleep(1.0)
        for ctr in ctrs:
            log = ctr.poll_log()
            sc.check(f"{ctr.name}: a further daemon-reload takes nothing", not log.lost, log.summary())
        sc.fact("check_summary", check_json().get("summary"))
    finally:
        docker.remove_all()
        containerd.remove_all()
