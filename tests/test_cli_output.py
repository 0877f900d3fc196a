"""What the CLI and the daemon write for an operator: names a container controls (a scope name with
escape sequences, a newline, a lone surrogate) escaped in human output and in the daemon's stderr lines; a
non-UTF-8 path on the command line refused in one line; the exit status kept through a closed pipe.
Through the CLI and the daemon as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.clirun import NVS, cli, no_traceback
from tests.daemonproc import DaemonProcess

EVIL = "docker-x\x1b[2J\x1b[31mPWNED\nforged line"  # item 6; with "\ud800" appended: item 2


@pytest.fixture(params=["escape", "escape+surrogate"])
def evil_host(fakehost, v1_parent, request):
    """A lost GPU container (plain runc, systemd driver names) whose state.json names an evil scope."""
    import json

    from tests.test_hostile_input import LostHost

    h = LostHost(fakehost, v1_parent, "runc")
    doc = h.doc(h.state)
    doc["config"]["cgroups"].update(name=EVIL + ("\ud800" if "surrogate" in request.param else ""), scope_prefix="docker", Systemd=True)
    h.put(h.state, json.dumps(doc))
    return h


def _assert_escaped(out: str) -> None:
    assert "\x1b" not in out and "\ud800" not in out, repr(out)
    assert not any(line.startswith("forged line") for line in out.splitlines()), out


@pytest.mark.parametrize("command", [["check", "--no-host", "--no-bus"], ["repair", "--dry-run"]])
def test_untrusted_names_are_escaped_in_human_output(evil_host, command):
    proc = cli("--root", evil_host.root, *command)
    no_traceback(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _assert_escaped(proc.stdout)
    assert "\\x1b[2J" in proc.stdout, proc.stdout  # still there to be read, escaped


def test_daemon_log_lines_on_stderr_escape_untrusted_names(evil_host, tmp_path):
    """Without journald the daemon writes one line per entry to stderr (journald's stream parser, or a
    terminal): a newline in a scope name would forge an entry, an escape sequence reach the terminal."""
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text('resync_interval = 0\nrepair = "report"\n')
    d = DaemonProcess(evil_host.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_for_line(r"verified \d+ GPU container")
        time.sleep(0.5)
    finally:
        d.stop()
    out = d.output()
    assert "PWNED" in out, out  # the name is there, escaped
    _assert_escaped(out)


@pytest.mark.parametrize("option", ["--driver-root", "--dev-char-path", "--state-dir", "--bindir"])
@pytest.mark.parametrize("where", ["--output", "--drop-ins"])
def test_render_refuses_a_non_utf8_command_line_path_in_one_line(tmp_path, option, where):
    proc = cli("--config", os.devnull, "render", option, b"/a\xffb", where, tmp_path / "out")
    no_traceback(proc)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "UTF-8" in proc.stderr and "\\xff" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.service*"))


def test_check_into_a_closed_pipe_keeps_the_exit_status_of_what_was_found(evil_host):
    # `check | head -1` under pipefail (`| true`: a reader gone before the first write, every time): the host is not as desired, whatever the reader did
    cmd = " ".join(["set -o pipefail;", *NVS, "--root", str(evil_host.root), "check", "--no-bus", "|", "true"])  # gone before the first write
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_sync_dry_run_into_a_closed_pipe_keeps_its_exit_status(gpu_host_null):
    cmd = " ".join(["set -o pipefail;", *NVS, "--root", str(gpu_host_null.root), "--config", os.devnull, "sync",
                    "--dry-run", "|", "true"])
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr  # links would be created: not as desired
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
