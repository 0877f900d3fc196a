"""Defects found by trying to break nvsymlinkd, round two (issue 26), each as an operator or an
attacker meets it: through the CLI or the daemon as a subprocess.

Each test here failed on the code before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from daemonproc import DaemonProcess
from fakehost import standard_host
from test_daemon import STANDARD_LINKS, links

NVS = [sys.executable, "-m", "nvsymlinkd"]


def cli(*argv, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*NVS, *map(os.fsdecode, argv)], capture_output=True, text=True, timeout=timeout,
                          errors="surrogateescape", **kw)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Error:" not in proc.stderr.replace("error:", ""), proc.stderr


@pytest.fixture
def host(tmp_path, need_root):
    h = standard_host(tmp_path / "root")
    h.node("/dev/null", 1, 3)
    return h


# -- 7. one rule for a /dev/char name ------------------------------------------------------------------------

ARABIC = "\u0661\u0669\u0665:7"  # "١٩٥:7": int() reads 195, but it is no /dev/char name of ours


def test_daemon_and_sync_agree_on_non_ascii_digit_names(host, tmp_path):
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(host.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_until(lambda: links(host) == STANDARD_LINKS, "the first full sync")
        d.wait_for_line(r"links directory watched")  # from now on, events make incremental passes
        os.symlink("../nvidia7", host.path(f"/dev/char/{ARABIC}"))  # a stale 195:7 link, were it ours
        os.unlink(host.path("/dev/char/195:1"))  # a change the watch acts on, after the odd name's event
        d.wait_until(lambda: (links(host) or {}).get("195:1") == "../nvidia1", "195:1 to come back")
        time.sleep(0.5)
        assert os.path.islink(host.path(f"/dev/char/{ARABIC}")), d.output()
    finally:
        d.stop()
    # and the full sync leaves it too
    proc = cli("--root", host.root, "--config", cfg, "sync")
    assert proc.returncode == 0, proc.stderr
    assert os.path.islink(host.path(f"/dev/char/{ARABIC}"))
