"""Scenario 3: a hook-injected device. The container's spec grants nothing NVIDIA; a
createRuntime hook grants c 195:0 by rewriting the cgroup's BPF program, as the legacy NVIDIA
hook does. systemd does not know the grant, so a daemon-reload takes it.

Each round (three in the full matrix, one in the default run: CI time), with the kernel as judge
(open() inside the container):
1. prevented: nvsymlinkd records the container's baseline when its scope appears and at once
   adds the device to the scope's DeviceAllow ("verified: prevented"), so the first reload
   loses nothing (the first open() after it succeeds, no polling);
2. repaired: the scenario deletes that runtime DeviceAllow drop-in (as if the prevention had
   never happened) and restarts nvsymlinkd (so the loss is met by a daemon that has to find it
   from its persisted baseline, as after an upgrade), so the next
   daemon-reload takes the device exactly as in the failure; nvsymlinkd notices the reload and
   repairs it ("container-lost", then "verified: repaired"); the open() is polled from the
   moment `systemctl daemon-reload` returned (just after systemd's Reloading(false)): that
   latency is printed over the rounds;
3. the repair survives the next reload.
"""
# vm: nvsymlinkd=deb timeout=400
import glob
import os
import time

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    expect_nvsymlinkd,
    full_matrix,
    journal,
    journal_cursor,
    load_fake_driver,
    mknod,
    nvsymlinkd_unit_active,
    sh,
    start_gpu_container,
    wait_for,
)

ROUNDS = 3 if full_matrix() else 1     # the default run: one round (CI time); the full matrix: three


def daemon_lines(ctr, since, kind=None):
    """MESSAGE of nvsymlinkd.service entries since the cursor that name the container."""
    return [str(e.get("MESSAGE")) for e in journal(unit="nvsymlinkd.service", after_cursor=since)
            if ctr.name in str(e.get("MESSAGE")) and e.get("MESSAGE_ID")
            and (kind is None or e.get("MESSAGE_ID") == MESSAGE_IDS[kind])]


def runtime_device_allow_dropins(scope):
    """The runtime drop-ins systemd wrote for SetUnitProperties(runtime=true, DeviceAllow=...)."""
    found = []
    for path in glob.glob(f"/run/systemd/system.control/{scope}.d/*.conf") + \
            glob.glob(f"/run/systemd/transient/{scope}.d/*.conf"):
        with open(path) as f:
            if "DeviceAllow=/dev/char/195:0" in f.read():
                found.append(path)
    return found


with Scenario() as sc:
    expect_nvsymlinkd(sc)
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ok, _ = wait_for(lambda: os.path.exists("/dev/char/195:0"), timeout=15)
    sc.check("nvsymlinkd made /dev/char/195:0", bool(ok))
    latencies, prevent_s = [], []
    for i in range(ROUNDS):
        started = journal_cursor()
        ctr = start_gpu_container(f"gpu-s03-{i}", [], hook_grants=[gpu0])
        t_start = time.monotonic()
        sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start (granted by the hook only)")

        # 1. prevented before any reload
        prevented, _ = wait_for(lambda c=ctr, s=started: daemon_lines(c, s, "repair-prevented"), timeout=20,
                                interval=0.2)
        prevent_s.append(round(time.monotonic() - t_start, 2))
        sc.check(f"round {i}: nvsymlinkd journaled repair-prevented for {ctr.name}",
                 bool(prevented) and "verified: prevented" in prevented[0],
                 (prevented or [""])[0][:300])
        daemon_reload()
        sc.expect_open(ctr, "/dev/nvidia0", "OK", f"round {i}: first open after the first daemon-reload")

        # 2. a reload that takes the device, repaired
        dropins = runtime_device_allow_dropins(ctr.scope)
        sc.check(f"round {i}: the prevention is a runtime DeviceAllow drop-in of {ctr.scope}", bool(dropins),
                 ", ".join(dropins) or str(glob.glob(f"/run/systemd/*/{ctr.scope}*")))
        for path in dropins:
            os.unlink(path)
        sh("systemctl", "restart", "nvsymlinkd.service", timeout=120)
        sc.check(f"round {i}: nvsymlinkd restarted", nvsymlinkd_unit_active())
        before_loss = journal_cursor()
        t0 = time.monotonic()
        daemon_reload()
        reload_done = time.monotonic()
        first = ctr.open_errno("/dev/nvidia0")
        ok, _ = (True, 0) if first == "OK" else wait_for(
            lambda c=ctr: c.open_errno("/dev/nvidia0") == "OK", timeout=30, interval=0.05)
        latency = time.monotonic() - reload_done
        sc.check(f"round {i}: access works again after the reload that took it", bool(ok),
                 f"first open {first}; OK {latency:.2f} s after systemctl daemon-reload returned")
        latencies.append(round(latency, 3))
        sc.fact(f"round_{i}_first_open_after_loss", first)
        # The daemon journals after it has verified the fix: that line may trail the open().
        repaired, _ = wait_for(lambda c=ctr, s=before_loss: daemon_lines(c, s, "repair-done"), timeout=15,
                               interval=0.2)
        lost = daemon_lines(ctr, before_loss, "container-lost")
        sc.check(f"round {i}: nvsymlinkd journaled container-lost, then repair-done 'verified: repaired'",
                 bool(lost) and bool(repaired) and "verified: repaired" in repaired[0],
                 " | ".join(m[:160] for m in (lost[:1] + (repaired or [])[:1])))

        # 3. the repair sticks
        daemon_reload()
        sc.expect_open(ctr, "/dev/nvidia0", "OK", f"round {i}: after the next daemon-reload")
        sc.timing(f"round_{i}_reload_s", reload_done - t0)
        ctr.delete()
    sc.timing("repair_open_ok_after_reload_max_s", max(latencies))
    sc.fact("repair_open_ok_after_reload_s", latencies)
    sc.fact("prevented_after_start_s", prevent_s)
    print(f"repair latency (open OK after daemon-reload returned), {ROUNDS} rounds: {latencies}; "
          f"prevented {prevent_s} s after container start", flush=True)
