"""The state directory (repairs.json, the repair lock, baselines, freeze records) and the metrics
textfile: never written outside --root whatever links lead out, a corrupt history read as empty, the
repair lock held even when its file is unlinked. Through the CLI and the daemon as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.clirun import cli, no_traceback
from tests.daemonproc import DaemonProcess


@pytest.fixture
def lost_runc_host(fakehost, v1_parent):
    from tests.test_hostile_input import LostHost

    return LostHost(fakehost, v1_parent, "runc")


def _all_files(top) -> list:
    """Every name under top, with a file's content and a link's text: what a write outside would change."""
    out = []
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out.append((p, "->", os.readlink(p)))
            elif os.path.isfile(p):
                out.append((p, open(p, "rb").read()))
            else:
                out.append((p,))
    return sorted(out)


@pytest.mark.parametrize("link", ["absolute", "relative", "run-absolute", "inner-links"])
def test_state_is_never_written_outside_the_root(lost_runc_host, tmp_path, link):
    """ROOT/run/nvsymlinkd (or ROOT/run, or what is in the state dir) and the metrics directory are links
    that lead out of the root when followed by the host's rules: the repair history, the lock, the
    baselines and the textfile stay inside."""
    root = lost_runc_host.host.root
    outside = tmp_path / "outside"
    for sub in ("state", "metrics", "run/nvsymlinkd"):
        (outside / sub).mkdir(parents=True)
    (outside / "metrics" / "keep").write_text("")
    up = os.path.relpath(outside, root / "run")
    if link == "run-absolute":  # a link higher up: ROOT/run -> /outside/run (lost_host's files moved there)
        import shutil

        for name in os.listdir(root / "run"):
            shutil.move(str(root / "run" / name), str(outside / "run" / name))
        os.rmdir(root / "run")
        os.symlink(str(outside / "run"), root / "run")
        shutil.copytree(outside / "run", root / str(outside / "run").lstrip("/"), symlinks=True)
        shutil.rmtree(root / str(outside / "run/nvsymlinkd").lstrip("/"))
    elif link == "inner-links":  # the state dir is real; what is in it points out
        state = root / "run/nvsymlinkd"
        state.mkdir()
        for name in ("baselines", "frozen"):
            os.symlink(str(outside / "state"), state / name)
        for name in ("repairs.json", "repair.lock"):
            (outside / "state" / name).write_text("{}\n")
            os.symlink(str(outside / "state" / name), state / name)
    else:
        os.symlink(str(outside / "state") if link == "absolute" else f"{up}/state", root / "run/nvsymlinkd")
    os.symlink(str(outside / "metrics") if link != "relative" else f"../{up}/metrics", root / "srv/metrics")
    before = _all_files(outside)
    proc = cli("--root", root, "repair")
    no_traceback(proc)
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text('resync_interval = 1\nmetrics_textfile = "/srv/metrics/nvsymlinkd.prom"\n')
    d = DaemonProcess(root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_for_line(r"verified \d+ GPU container")
        time.sleep(1.5)  # a resync, a metrics write
    finally:
        d.stop()
    assert _all_files(outside) == before, proc.stdout + proc.stderr + d.output()
    # the freeze path's lock and record (a systemd-driver repair): refused, or written inside
    from nvsymlinkd.config import Config
    from nvsymlinkd.errors import RepairError
    from nvsymlinkd.host.root import HostRoot
    from nvsymlinkd.repair.freeze import FreezeRecord, RepairLock
    from nvsymlinkd.repair.model import RepairRequest

    hr = HostRoot(str(root))
    try:
        with RepairLock(hr, Config(), wait=0.1):
            pass
    except RepairError as exc:
        assert "cannot open the repair lock" in str(exc)  # a link to a missing directory, or the lock a link
    request = RepairRequest("lost1", "runc", "x.scope", "/lost1", None, "/lost1", "systemd", ())
    try:
        FreezeRecord(hr, Config(), request).write()
    except OSError:
        pass
    assert _all_files(outside) == before


@pytest.mark.parametrize("corrupt", ["huge-number", "deep"])
def test_repair_reads_a_corrupt_history_as_empty(lost_runc_host, corrupt):
    history = lost_runc_host.host.path("/run/nvsymlinkd/repairs.json")
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text('{"last": {"lost1": 1' + "0" * 400 + "}}" if corrupt == "huge-number"
                       else "[" * 100_000 + "]" * 100_000)
    proc = cli("--root", lost_runc_host.root, "repair")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "repaired" in proc.stdout


HOLD_LOCK = """
import sys, time
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.freeze import RepairLock
with RepairLock(HostRoot(sys.argv[1]), Config(), wait=5):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_repair_lock_holds_when_its_file_is_unlinked(tmp_path, need_root):
    """A repair holds the host's repair lock (from its freeze to its thaw); someone removes repair.lock
    meanwhile ("a stale lock file"): a second repair still waits for the first, never overlaps it."""
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root), "10"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.unlink(root / "run/nvsymlinkd/repair.lock")
        second = subprocess.run([sys.executable, "-c", HOLD_LOCK.replace("wait=5", "wait=0.5"), str(root), "0"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "RepairBusy" in second.stderr, second.stdout + second.stderr
        assert "held" not in second.stdout
    finally:
        holder.kill()
        holder.wait()
    # the holder gone, the lock is free again (and its file made anew)
    again = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(root), "0"], capture_output=True, text=True,
                           timeout=60)
    assert again.stdout.strip() == "held", again.stderr
