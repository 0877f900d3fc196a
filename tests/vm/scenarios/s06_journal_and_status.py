"""Scenario 6: what an operator sees. With the .deb installed, a link creation, a hook-injected
device the daemon protects (prevented before a reload, or repaired after one) and a
daemon-reload each show in `journalctl -u nvsymlinkd -o json` as one clear line with its
MESSAGE_ID; `journalctl -x` shows the packaged catalog text for them; `systemctl status
nvsymlinkd` shows the daemon's STATUS= line.
"""
# vm: nvsymlinkd=deb timeout=300
import os
import time

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    expect_nvsymlinkd,
    journal,
    load_fake_driver,
    mknod,
    sh,
    start_gpu_container,
    status_in_systemctl_status,
    wait_for,
)

UNIT = "nvsymlinkd.service"
KIND_OF = {v: k for k, v in MESSAGE_IDS.items()}


def entries():
    """journalctl -b -u nvsymlinkd -o json, as dicts."""
    return journal(unit=UNIT)


def first(kind_prefix, needle, found):
    """The first entry whose MESSAGE_ID is of kind kind_prefix* and whose MESSAGE names needle."""
    for e in found:
        kind = KIND_OF.get(e.get("MESSAGE_ID", ""), "")
        if kind.startswith(kind_prefix) and needle in str(e.get("MESSAGE", "")):
            return kind, e
    return None, None


with Scenario() as sc:
    expect_nvsymlinkd(sc)
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ok, _ = wait_for(lambda: os.path.realpath("/dev/char/195:0") == gpu0.path, timeout=15)
    sc.check("nvsymlinkd made /dev/char/195:0 -> ../nvidia0", bool(ok))
    ctr = start_gpu_container("gpu-s06", [], hook_grants=[gpu0])
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start (granted by the hook only)")
    # The daemon verifies the new scope after its hooks ran; with the device granted but in no
    # DeviceAllow it adds it before a reload takes it (prevented), or repairs it after (repaired).
    time.sleep(6)
    daemon_reload()
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after daemon-reload (kept or repaired)")

    wanted = [("link-created", "/dev/char/195:0"), ("reload-seen", ""),
              ("container-", ctr.name), ("repair-", ctr.name)]
    found, waited = wait_for(lambda: all(first(k, n, entries())[0] for k, n in wanted), timeout=20,
                             interval=0.5)
    sc.timing("journal_complete_after_reload_s", waited)
    log = entries()
    lines = []
    for kind_prefix, needle in wanted:
        kind, e = first(kind_prefix, needle, log)
        if kind_prefix == "repair-":
            ok = kind in ("repair-done", "repair-prevented")
        else:
            ok = kind is not None
        message = str(e.get("MESSAGE", "")) if e else ""
        head = message.splitlines()[0] if message else ""
        line = f"{e.get('MESSAGE_ID')} {kind}: {head}" if e else "(none)"
        lines.append(line)
        sc.check(f"journalctl -u nvsymlinkd -o json: a {kind_prefix}* line naming {needle or 'the reload'} "
                 "with its MESSAGE_ID, from the unit",
                 ok and len(e.get("MESSAGE_ID", "")) == 32 and bool(head.strip())
                 and e.get("_SYSTEMD_UNIT") == UNIT, line)
    sc.fact("journal_lines", lines)
    # Every entry the daemon wrote through the journal API carries an ID: say which do not.
    untagged = [str(e.get("MESSAGE"))[:120] for e in log
                if e.get("SYSLOG_IDENTIFIER") == "nvsymlinkd" and not e.get("MESSAGE_ID")]
    sc.fact("lines_without_message_id", untagged)

    # The catalog ships in the .deb; systemd's dpkg trigger should have indexed it at install.
    listed = sh("journalctl", "--list-catalog", "--no-pager", check=False).stdout
    indexed_at_install = MESSAGE_IDS["link-created"] in listed
    sc.fact("catalog_indexed_by_dpkg_install", indexed_at_install)
    if not indexed_at_install:
        sh("journalctl", "--update-catalog")
        listed = sh("journalctl", "--list-catalog", "--no-pager", check=False).stdout
    sc.check("journalctl --list-catalog lists nvsymlinkd's MESSAGE_IDs",
             all(MESSAGE_IDS[k] in listed for k in ("link-created", "reload-seen", "repair-done")),
             "indexed by the dpkg trigger" if indexed_at_install else "needed journalctl --update-catalog")
    explained = sh("journalctl", "-b", "-x", "--no-pager", "-u", UNIT,
                   f"MESSAGE_ID={MESSAGE_IDS['link-created']}", check=False).stdout
    sc.check("journalctl -x -u nvsymlinkd shows the catalog text for link-created",
             "Subject: /dev/char link created for" in explained and "Defined-By: nvsymlinkd" in explained,
             " / ".join(ln.strip() for ln in explained.splitlines() if "Subject:" in ln)[:300])

    status, shown = status_in_systemctl_status(UNIT)
    sc.check("systemctl status nvsymlinkd shows the STATUS= line", bool(status) and shown == f'Status: "{status}"',
             f"StatusText {status!r}; shown {shown!r}")
    sc.fact("status_line", status)
    ctr.delete()
