"""The config file read as runtime files are (no FIFO, device or huge file: refused at once, in one
line), and the units rendered from it saying what it says, as systemd reads them (normalized paths, `$`
and `%` kept, directories the sandbox would hide refused). Through the CLI as a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.clirun import cli, no_traceback


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "default-fifo", "too-big"])
def test_config_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    root = tmp_path / "root"
    (root / "etc/nvsymlinkd").mkdir(parents=True)
    argv = ["--root", root]
    if kind == "dev-zero":
        argv += ["--config", "/dev/zero"]
    elif kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        argv += ["--config", tmp_path / "fifo"]
    elif kind == "default-fifo":
        os.mkfifo(root / "etc/nvsymlinkd/nvsymlinkd.toml")
    else:
        big = tmp_path / "big.toml"
        big.write_text("# " + "x" * (2 << 20) + "\n")
        argv += ["--config", big]
    start = time.monotonic()
    proc = cli(*argv, "sync", "--dry-run", timeout=20)
    assert time.monotonic() - start < 10
    assert proc.returncode == 2, proc.stderr
    no_traceback(proc)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("not a regular file" if kind != "too-big" else "larger than") in proc.stderr
    # /dev/null stays "no config" (packaging renders with it)
    assert cli("--config", "/dev/null", "render").returncode == 0


@pytest.mark.parametrize("where", ["flag", "file"])
def test_negative_zero_resync_interval_renders_as_off(tmp_path, where):
    cfg = tmp_path / "c.toml"
    cfg.write_text("resync_interval = -0.0\n" if where == "file" else "")
    flags = ["--resync-interval", "-0.0"] if where == "flag" else []
    proc = cli("--config", cfg, "render", *flags)
    assert proc.returncode == 0, proc.stderr
    assert "-0" not in proc.stdout.replace("--", "  "), proc.stdout
    assert "--resync-interval 0" in proc.stdout


UNIT_CASES = {
    "not-normalized-state": ('state_dir = "/var/lib/../srv/nvs"\n', ("ReadWritePaths", "/var/srv/nvs")),
    "not-normalized-var-lib": ('state_dir = "/var/lib/./nv//state/"\n', ("StateDirectory", "nv/state")),
    "dollar-state-dir": ('state_dir = "/var/lib/nv$x"\n', ("StateDirectory", "nv$x")),
    "dollar-run": ('state_dir = "/run/nv$x"\n', ("RuntimeDirectory", "nv$x")),
    "dollar-dev-char": ('dev_char_path = "/srv/d$v"\n', ("ReadWritePaths", "-/srv/d$v")),
    "dollar-textfile": ('metrics_textfile = "/srv/m$t/n.prom"\n', ("ReadWritePaths", "-/srv/m$t")),
    "percent-space": ('state_dir = "/srv/a b%c"\n', ("ReadWritePaths", "/srv/a b%c")),
    "dev-char-root": ('dev_char_path = "/"\n', None),
    "textfile-root": ('metrics_textfile = "/"\n', None),
    "textfile-etc": ('metrics_textfile = "/etc/n.prom"\n', None),
    "textfile-top": ('metrics_textfile = "/n.prom"\n', None),
    "state-var-lib-itself": ('state_dir = "/var/lib"\n', None),
    "state-dotdot-etc": ('state_dir = "/var/lib/../../etc"\n', None),
    "dev-char-usr": ('dev_char_path = "/usr/lib/x"\n', None),
    # prove or refute: PrivateTmp=yes, ProtectHome=yes would give the daemon other directories than the CLI
    "state-tmp": ('state_dir = "/tmp/nvsymlinkd"\n', None),
    "state-var-tmp": ('state_dir = "/var/tmp/nvsymlinkd"\n', None),
    "state-home": ('state_dir = "/home/ops/nvsymlinkd"\n', None),
    "state-root-home": ('state_dir = "/root/nvsymlinkd"\n', None),
    "textfile-tmp": ('metrics_textfile = "/tmp/prom/n.prom"\n', None),
}


def _unit_words(value: str) -> list:
    """A path-list value as systemd reads it: words split, quotes removed, %% unescaped, $ kept."""
    import shlex

    return [w.replace("%%", "%") for w in shlex.split(value)]


@pytest.mark.parametrize("case", sorted(UNIT_CASES))
def test_rendered_units_say_what_the_config_says(tmp_path, case):
    from tests.conftest import need_tool

    text, expect = UNIT_CASES[case]
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    out = tmp_path / "out"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvsymlinkd").write_text("#!/bin/sh\n")
    (bindir / "nvsymlinkd").chmod(0o755)
    proc = cli("--config", cfg, "render", "--bindir", bindir, "--output", out)
    no_traceback(proc)
    if expect is None:
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "c.toml" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    tool = need_tool("systemd-analyze")
    service = (out / "nvsymlinkd.service").read_text()
    for unit in ("nvsymlinkd.service", "nvsymlinkd-sync.service"):
        v = subprocess.run([tool, "verify", "--man=no", str(out / unit)], capture_output=True, text=True,
                           timeout=120, cwd=out)
        assert v.returncode == 0 and v.stderr == "", f"{unit}:\n{v.stderr}"
    directive, path = expect
    words = [w for line in service.splitlines() if line.startswith(directive + "=")
             for w in _unit_words(line.partition("=")[2])]
    assert path in words, (directive, words)
