"""Reading nvsymlinkd at a terminal (issue 29, item 7): man pages from a checkout and without troff
warnings at 80 columns, `check` lines that fit the terminal (and full lines for pipes and --wide),
a JSON schema version with its counts split, and a README whose first screen says how to run the
two commands, what they need and how long they take.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_tool
from tests.fakehost import standard_host
from tests.runcfixture import device_node, device_rule

REPO = Path(__file__).parent.parent
PAGES = sorted(p.name for p in (REPO / "man").glob("*.rst"))


def render(page: str, out: Path) -> Path:
    docutils = pytest.importorskip("docutils.core")
    target = out / page[:-len(".rst")]
    docutils.publish_file(source_path=str(REPO / "man" / page), destination_path=str(target), writer_name="manpage",
                          settings_overrides={"report_level": 4})
    return target


@pytest.mark.parametrize("page", PAGES)
def test_pages_render_at_80_columns_without_troff_warnings(page, tmp_path):
    man = need_tool("man")
    built = render(page, tmp_path)
    proc = subprocess.run([man, "--warnings", "-l", str(built)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", f"{page} at 80 columns:\n{proc.stderr}"


def test_scripts_man_reads_a_page_from_a_checkout(tmp_path):
    need_tool("man")
    env = {**os.environ, "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"}
    proc = subprocess.run([str(REPO / "scripts/man"), "sync"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "NVSYMLINKD-SYNC(8)" in proc.stdout and "NVIDIA-CTK" in proc.stdout
    proc = subprocess.run([str(REPO / "scripts/man"), "--build", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("nvsymlinkd*")) == sorted(p[:-len(".rst")] for p in PAGES)
    proc = subprocess.run(["man", "nvsymlinkd-repair"], capture_output=True, text=True, timeout=60,
                          env={**env, "MANPATH": str(tmp_path)})
    assert "--force" in proc.stdout
    bad = subprocess.run([str(REPO / "scripts/man"), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no page nvsymlinkd-nope" in bad.stderr


def at_terminal(argv, columns: int) -> str:
    """stdout of argv run on a pseudo-terminal COLUMNS wide."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env={**os.environ, "COLUMNS": str(columns)})
    os.close(slave)
    out = _read_all(master)
    proc.wait(60)
    return out.decode().replace("\r\n", "\n")


def _read_all(master: int) -> bytes:
    """What the pseudo-terminal's other side wrote until it closed; closes MASTER."""
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return out


@pytest.fixture
def long_lines_host(runc_host, monkeypatch):
    """A lost and a uvm-less container: rows whose FIX and details run past 200 characters."""
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    runc_host.fake.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 509})
    runc_host.fake.node("/dev/nvidia-uvm", 509, 0)
    c = runc_host.run("gpu-wide-lost", rules=[device_rule(195, 0), device_rule(509, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"],
                      nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidia-uvm", 509, 0)])
    c.deny("c 195:0 rw")
    runc_host.run("gpu-wide-nouvm", rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                  env=["NVIDIA_VISIBLE_DEVICES=0"])
    return runc_host


def test_check_fits_the_terminal_and_pipes_get_full_lines(long_lines_host):
    argv = [sys.executable, "-m", "nvsymlinkd", "--root", str(long_lines_host.root), "check", "--no-bus"]
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    assert max(map(len, piped.splitlines())) > 100  # the rows as they are, for grep
    for columns in (80, 100):
        shown = at_terminal(argv, columns)
        assert max(map(len, shown.splitlines())) <= columns, shown
        # wrapped, nothing cut: only white space differs
        assert "".join(shown.split()) == "".join(piped.split())
    wide = at_terminal(argv + ["--wide"], 80)
    assert wide.splitlines() == piped.splitlines()


def test_json_has_a_schema_version_and_split_counts(long_lines_host, tmp_path):
    argv = [sys.executable, "-m", "nvsymlinkd", "--root", str(long_lines_host.root)]
    doc = json.loads(subprocess.run(argv + ["check", "--json", "--no-bus"], capture_output=True, text=True).stdout)
    assert doc["schema_version"] == 1
    s = doc["summary"]
    assert (s["gpu_containers"], s["lost"], s["at-risk"]) == (2, 1, 1)  # the flat keys stay
    assert s["verdicts"] == {k: s[k] for k in s["verdicts"]}
    assert sum(s["verdicts"].values()) == s["containers"]["gpu"] == s["gpu_containers"]
    assert s["containers"] == {"gpu": 2, "gpu_running": 2, "not_gpu": s["not_gpu_containers"]}
    for command in (["repair", "--dry-run", "--json"], ["sync", "--dry-run", "--json"]):
        out = subprocess.run(argv + command, capture_output=True, text=True).stdout
        assert json.loads(out)["schema_version"] == 1, command
    error = subprocess.run(argv + ["check", "--json", "no-such"], capture_output=True, text=True)
    assert error.returncode == 2 and json.loads(error.stdout)["schema_version"] == 1


def test_readme_first_screen_says_how_long_and_what_it_needs():
    first = "\n".join((REPO / "README.md").read_text().splitlines()[:45])
    for needle in ("scripts/setup && .venv/bin/nvsymlinkd sync --dry-run", "scripts/test -q -x --ignore=tests/vm",
                   "scripts/test ", "as root", "Debian 12", "no GPU", "6.8 s", "min", ".ci/apt.d"):
        assert needle in first, needle
    assert "--ignore=tests/vm" in (REPO / "docs/testing.md").read_text()  # the same quick command there


def test_readme_first_screen_at_80_columns_shows_the_two_commands():
    """Issue 36, item 4: a terminal of 80x24 (`less README.md`) shows both commands on its first screen,
    each of those lines one row; the README stays the front door (about 12 KB, its sections kept)."""
    text = (REPO / "README.md").read_text()
    first = text.splitlines()[:24]
    assert [line for line in first if len(line) > 80] == []
    screen = "\n".join(first)
    assert "    scripts/setup && .venv/bin/nvsymlinkd sync --dry-run" in screen
    assert "    scripts/test -q -x --ignore=tests/vm" in screen and "    scripts/test  " in screen
    assert 11000 < len(text.encode()) < 14000
    for heading in ("## The two commands", "## Why", "## Install", "## On Kubernetes", "## A quick tour"):
        assert f"\n{heading}\n" in text, heading


def test_standard_host_check_is_unchanged_when_piped(tmp_path, need_root):
    """No terminal: the table is exactly what it was (scripts and grep rely on one row per line)."""
    host = standard_host(tmp_path)
    out = subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(host.root), "check", "--no-host"],
                         capture_output=True, text=True).stdout
    assert out.splitlines() == ["no GPU containers found"]


def on_a_pty(argv, columns: int = 80) -> str:
    """stdout and stderr of argv run on a real pseudo-terminal `columns` wide, as a terminal sets it
    (TIOCSWINSZ), with COLUMNS and LINES unset: what argparse and check measure is the terminal's."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(argv, stdout=slave, stderr=slave, stdin=slave, env=env)
    os.close(slave)
    out = _read_all(master)
    assert proc.wait(60) in (0, 1), out
    return out.decode().replace("\r\n", "\n")


def too_long(text: str, columns: int = 80) -> list:
    return [line for line in text.splitlines() if len(line) > columns]


@pytest.mark.parametrize("command", [None, "sync", "run", "render", "check", "repair"])
def test_help_fits_80_columns(command):
    """Issue 36, item 4: every --help at a terminal 80 wide, descriptions filled as paragraphs, examples
    one per line (a comment that cannot fit goes below its command)."""
    argv = [sys.executable, "-m", "nvsymlinkd", *([command] if command else []), "--help"]
    shown = on_a_pty(argv)
    assert "usage: nvsymlinkd" in shown and "examples:\n  " in shown
    assert too_long(shown) == [], shown


def test_check_fits_80_columns_with_a_short_fix(long_lines_host):
    """check at a terminal 80 wide: a lost and a uvm-less container, one table line each, FIX in a few
    words (`nvsymlinkd repair ID`), the detail and the whole fix (with --root) on the finding's own line."""
    root = str(long_lines_host.root)
    shown = on_a_pty([sys.executable, "-m", "nvsymlinkd", "--root", root, "check", "--no-bus"])
    assert too_long(shown) == [], shown
    lines = shown.splitlines()
    table = lines[:lines.index("")]
    assert table[0].split() == ["CONTAINER", "NAME", "RUNTIME", "STATUS", "MISSING", "FIX"], shown
    # each finding's FIX whole on one line: in its column, or below its row (its id's column is too wide)
    for cid, fix in (("gpu-wide-lost", "nvsymlinkd repair gpu-wide-lost"), ("gpu-wide-nouvm", "recreate the container")):
        row = next(i for i, line in enumerate(table) if line.startswith(cid + " "))
        assert table[row].endswith("  " + fix) or table[row + 1].strip() == fix, shown
    assert len(table) <= 5, shown
    below = " ".join(" ".join(lines[len(table):]).split())
    assert (f"gpu-wide-lost lost: expected by the runtime-state, spec but denied by the device cgroup now fix: "
            f"nvsymlinkd --root {root} repair gpu-wide-lost (or recreate the container)") in below, shown
    assert "gpu-wide-nouvm at-risk-uvm-missing: the host has nvidia-uvm" in below, shown


def test_check_of_a_standard_host_fits_80_columns(tmp_path, need_root):
    host = standard_host(tmp_path)
    shown = on_a_pty([sys.executable, "-m", "nvsymlinkd", "--root", str(host.root), "check", "--no-bus"])
    assert "host:" in shown and too_long(shown) == [], shown
