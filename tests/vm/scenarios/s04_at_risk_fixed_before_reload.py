"""Scenario 4: the at-risk path. A container started while /dev/char/195:0 was missing (runc
skipped the rule for systemd) is fixed by nvsymlinkd before any reload: its scope's
DeviceAllow gains the device, so the first reload loses nothing.
"""
# vm: nvsymlinkd=deb timeout=300
from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    expect_nvsymlinkd,
    journal,
    load_fake_driver,
    mknod,
    sh,
    start_gpu_container,
    unit_property,
    wait_for,
)

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    # The daemon is down while the container starts: nothing makes the link in time.
    sh("systemctl", "stop", "nvsymlinkd.service", timeout=120)
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ctr = start_gpu_container("gpu-s04", [gpu0])
    sc.check("runc skipped /dev/char/195:0 (the container is at risk)",
             "skipping device /dev/char/195:0 for systemd" in ctr.runc_log())
    sc.check(f"{ctr.scope} DeviceAllow lacks /dev/char/195:0 before nvsymlinkd starts",
             "/dev/char/195:0" not in unit_property(ctr.scope, "DeviceAllow"))
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start")
    sh("systemctl", "start", "nvsymlinkd.service", timeout=120)
    ok, waited = wait_for(lambda: "/dev/char/195:0 rw" in unit_property(ctr.scope, "DeviceAllow"),
                          timeout=60, interval=0.1)
    sc.check(f"nvsymlinkd added /dev/char/195:0 rw to {ctr.scope} before any reload", bool(ok),
             f"after {waited:.2f} s")
    sc.timing("at_risk_fixed_after_start_s", waited)
    sc.timing("daemon_reload_s", daemon_reload())
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after the first daemon-reload")
    entries = [e for e in journal(unit="nvsymlinkd.service") if "gpu-s04" in str(e.get("MESSAGE"))]
    lines = [f"{e.get('MESSAGE_ID', '-')}: {e.get('MESSAGE')}" for e in entries]
    sc.check("journal of nvsymlinkd names the container, each line with a MESSAGE_ID",
             bool(entries) and all(len(e.get("MESSAGE_ID", "")) == 32 for e in entries),
             " | ".join(lines[-4:]))
    sc.fact("journal", lines)
