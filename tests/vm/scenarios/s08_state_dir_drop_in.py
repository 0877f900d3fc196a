"""Scenario 8: a non-default state_dir through `render --drop-ins` (issues 12.13 and 15.4).

The .deb is installed; the operator sets state_dir = "/var/lib/nvsymlinkd-test" in the packaged
config file and follows its advice: `nvsymlinkd render --drop-ins /etc/systemd/system`,
daemon-reload, restart. The packaged unit stays the fragment (package updates still apply), the
drop-in adds StateDirectory=, and under the real unit's ProtectSystem=strict the daemon writes a
GPU container's baseline into the new directory.
"""
# vm: nvsymlinkd=deb timeout=300
import glob
import os

from tests.vm.guest.vmguest import (
    DEB_UNIT,
    Scenario,
    daemon_reload,
    expect_nvsymlinkd,
    journal,
    load_fake_driver,
    mknod,
    nvsymlinkd,
    nvsymlinkd_unit_active,
    sh,
    start_gpu_container,
    unit_property,
    wait_for,
)

STATE_DIR = "/var/lib/nvsymlinkd-test"
CONFIG = "/etc/nvsymlinkd/nvsymlinkd.toml"
DROP_IN = "/etc/systemd/system/nvsymlinkd.service.d/50-nvsymlinkd-config.conf"

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    with open(CONFIG, "a") as f:
        f.write(f'\nstate_dir = "{STATE_DIR}"\n')
    proc = nvsymlinkd("render", "--drop-ins", "/etc/systemd/system")
    sc.check("nvsymlinkd render --drop-ins /etc/systemd/system exits 0", proc.returncode == 0, proc.stderr[-500:])
    sc.check("the drop-in says StateDirectory=nvsymlinkd-test",
             os.path.exists(DROP_IN) and "\nStateDirectory=nvsymlinkd-test\n" in open(DROP_IN).read())
    sc.check("no whole unit copied into /etc/systemd/system",
             not os.path.exists("/etc/systemd/system/nvsymlinkd.service"))
    daemon_reload()
    sh("systemctl", "restart", "nvsymlinkd.service", timeout=120)
    sc.check("the packaged unit is still the fragment, the drop-in on top",
             unit_property("nvsymlinkd.service", "FragmentPath") == DEB_UNIT
             and DROP_IN in unit_property("nvsymlinkd.service", "DropInPaths"),
             unit_property("nvsymlinkd.service", "DropInPaths"))
    sc.check("StateDirectory=nvsymlinkd-test in force",
             unit_property("nvsymlinkd.service", "StateDirectory") == "nvsymlinkd-test",
             unit_property("nvsymlinkd.service", "StateDirectory"))
    sc.check("ProtectSystem=strict still in force", unit_property("nvsymlinkd.service", "ProtectSystem") == "strict")

    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ctl = mknod("/dev/nvidiactl", 195, 255)
    ok, _ = wait_for(lambda: os.path.exists("/dev/char/195:0"), timeout=15)
    sc.check("nvsymlinkd made /dev/char/195:0", bool(ok))
    ctr = start_gpu_container("gpu-s08", [gpu0, ctl])
    found, waited = wait_for(lambda: glob.glob(f"{STATE_DIR}/baselines/*.json"), timeout=30, interval=0.2)
    sc.check(f"a baseline was written under {STATE_DIR}/baselines", bool(found), f"{found} after {waited:.1f} s")
    sc.timing("baseline_written_s", waited)
    sc.check("nothing written to the default /run/nvsymlinkd/baselines",
             not glob.glob("/run/nvsymlinkd/baselines/*.json"))
    errors = [str(e.get("MESSAGE")) for e in journal(unit="nvsymlinkd.service")
              if "Read-only file system" in str(e.get("MESSAGE")) or "cannot write" in str(e.get("MESSAGE"))]
    sc.check("no write errors in the daemon's journal", not errors, "; ".join(errors)[:500])
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "with the moved state_dir")
    sc.check("nvsymlinkd.service still active", nvsymlinkd_unit_active())
