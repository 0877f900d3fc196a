"""The link keeper at its edges: a /dev/char name with non-ASCII digits is no name of ours (the daemon
and sync agree), a directory left at a temporary name goes once, a writer that keeps changing a link is
corrected every time and said once with a count, a MIG capability node is never made with a mode the
driver does not say. Through the CLI and the daemon as subprocesses.
"""

from __future__ import annotations

import os
import time

from tests.clirun import cli, no_traceback
from tests.daemonproc import DaemonProcess
from tests.fakehost import STANDARD_LINKS, links

ARABIC = "\u0661\u0669\u0665:7"  # "١٩٥:7": int() reads 195, but it is no /dev/char name of ours


def test_daemon_and_sync_agree_on_non_ascii_digit_names(gpu_host_null, tmp_path):
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(gpu_host_null.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_until(lambda: links(gpu_host_null) == STANDARD_LINKS, "the first full sync")
        d.wait_for_line(r"links directory watched")  # from now on, events make incremental passes
        os.symlink("../nvidia7", gpu_host_null.path(f"/dev/char/{ARABIC}"))  # a stale 195:7 link, were it ours
        os.unlink(gpu_host_null.path("/dev/char/195:1"))  # a change the watch acts on, after the odd name's event
        d.wait_until(lambda: (links(gpu_host_null) or {}).get("195:1") == "../nvidia1", "195:1 to come back")
        time.sleep(0.5)
        assert os.path.islink(gpu_host_null.path(f"/dev/char/{ARABIC}")), d.output()
    finally:
        d.stop()
    # and the full sync leaves it too
    proc = cli("--root", gpu_host_null.root, "--config", cfg, "sync")
    assert proc.returncode == 0, proc.stderr
    assert os.path.islink(gpu_host_null.path(f"/dev/char/{ARABIC}"))


def test_a_directory_left_at_a_temporary_name_is_removed_not_reported_forever(gpu_host_null):
    gpu_host_null.params()
    odd = gpu_host_null.path("/dev/char/.nvsymlinkd-tmp-4194000-195:0")
    odd.parent.mkdir(parents=True, exist_ok=True)
    odd.mkdir()
    first = cli("--root", gpu_host_null.root, "--config", os.devnull, "sync")
    assert first.returncode == 0, first.stderr
    assert not odd.exists()
    again = cli("--root", gpu_host_null.root, "--config", os.devnull, "sync", "--dry-run")
    assert ".nvsymlinkd-tmp-" not in again.stdout + again.stderr
    # a full directory there is nobody's temporary of ours: not emptied, and not "removed" on every run
    odd.mkdir()
    (odd / "keep").write_text("")
    for _ in range(2):
        proc = cli("--root", gpu_host_null.root, "--config", os.devnull, "sync")
        assert ".nvsymlinkd-tmp-" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert (odd / "keep").exists()


def test_a_flapping_link_writer_is_corrected_every_time_and_said_once_with_a_count(gpu_host_null, tmp_path):
    import threading

    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(gpu_host_null.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    stop = threading.Event()
    flips = [0]

    def flap():
        tmp = gpu_host_null.path("/dev/char/.flapper-tmp")
        while not stop.is_set():
            try:
                os.symlink("../nvidia9", tmp)
                os.rename(tmp, gpu_host_null.path("/dev/char/195:0"))
                flips[0] += 1
            except OSError:
                pass
            time.sleep(0.001)

    try:
        d.wait_until(lambda: links(gpu_host_null) == STANDARD_LINKS, "the first full sync")
        d.wait_for_line(r"links directory watched")
        t = threading.Thread(target=flap)
        t.start()
        time.sleep(3)
        stop.set()
        t.join()
        d.wait_until(lambda: links(gpu_host_null) == STANDARD_LINKS, "195:0 corrected after the writer stopped")
    finally:
        code = d.stop()
    out = d.output()
    said = [line for line in out.splitlines() if "replaced link /dev/char/195:0" in line]
    assert flips[0] > 100
    assert 1 <= len(said) <= 2, out[-3000:]
    counted = [line for line in out.splitlines() if "replaced /dev/char/195:0" in line]
    assert len(counted) == 1 and "another writer keeps changing it" in counted[0], out[-3000:]
    assert code == 0


def test_create_nodes_never_makes_a_capability_node_whose_mode_the_driver_does_not_say(fakehost):
    import stat

    fakehost.proc_devices({"nvidia": 195, "nvidia-caps": 236})
    fakehost.gpu("0000:3b:00.0", 0)
    fakehost.params(mode=0o666)
    fakehost.mig_minors({"config": 1, "monitor": 2})
    fakehost.write("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: 1\nDeviceFileMode: 256\n")
    # monitor's file is missing: its node is not made 0666 from the driver-wide params
    proc = cli("--root", fakehost.root, "--config", os.devnull, "sync", "--create-nodes")
    no_traceback(proc)
    assert stat.S_IMODE(os.lstat(fakehost.path("/dev/nvidia-caps/nvidia-cap1")).st_mode) == 0o400
    assert not os.path.lexists(fakehost.path("/dev/nvidia-caps/nvidia-cap2"))
    assert "MIG capability monitor" in proc.stdout + proc.stderr and "not created" in proc.stdout + proc.stderr
    # a file without a mode line is the same
    fakehost.write("/proc/driver/nvidia/capabilities/mig/monitor", "DeviceFileMinor: 2\n")
    cli("--root", fakehost.root, "--config", os.devnull, "sync", "--create-nodes")
    assert not os.path.lexists(fakehost.path("/dev/nvidia-caps/nvidia-cap2"))
