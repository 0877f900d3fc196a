"""Moving over from nvidia-ctk (issue 29, item 6): `nvsymlinkd sync` takes every flag of
`nvidia-ctk system create-dev-char-symlinks`, each with the meaning docs/install.md gives it, or a
one-line error saying what to use instead. The flag list is nvidia-container-toolkit's
cmd/nvidia-ctk/system/create-dev-char-symlinks/create-dev-char-symlinks.go (read at d34b3046,
2026-08-21), plus --watch, which it had until 1.18.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakehost import standard_host

REPO = Path(__file__).parent.parent
CTK_FLAGS = ("--dev-char-path", "--driver-root", "--create-all", "--load-kernel-modules",
             "--create-device-nodes", "--dry-run", "--watch")
pytestmark = pytest.mark.root


def sync(root, *argv):
    return subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(root), "sync", *argv],
                          capture_output=True, text=True, timeout=60)


def test_create_all_is_the_plain_sync(tmp_path, need_root):
    a, b = standard_host(tmp_path / "a"), standard_host(tmp_path / "b")
    plain, ctk = sync(a.root), sync(b.root, "--create-all")
    assert (ctk.returncode, ctk.stderr) == (0, ""), ctk.stderr
    assert ctk.stdout == plain.stdout
    assert b.links() == a.links() and b.links()  # the same links, made
    assert sync(b.root, "--create-all", "--dry-run").returncode == 0  # nothing left to do


def test_the_udev_rules_words_work(tmp_path, need_root):
    """The documented rule's command line with only the program swapped, driver container root included."""
    host = standard_host(tmp_path)
    for minor in (0, 255):
        name = "nvidia0" if minor == 0 else "nvidiactl"
        host.node(f"/run/nvidia/driver/dev/{name}", 195, minor)
    proc = sync(host.root, "--create-all", "--driver-root=/run/nvidia/driver", "--dev-char-path=/dev/char")
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(host.path("/dev/char/195:0")) == "../../run/nvidia/driver/dev/nvidia0"


def test_create_device_nodes_is_create_nodes(tmp_path, need_root):
    host = standard_host(tmp_path)
    os.unlink(host.path("/dev/nvidiactl"))
    doc = json.loads(sync(host.root, "--create-all", "--create-device-nodes", "--json").stdout)
    assert os.path.exists(host.path("/dev/nvidiactl"))
    assert doc["summary"]["create-node"] == 1


@pytest.mark.parametrize("flag, says", [
    ("--load-kernel-modules", "nvidia-modprobe"),
    ("--watch", "nvsymlinkd run"),
])
def test_refused_flags_say_what_to_use(tmp_path, need_root, flag, says):
    host = standard_host(tmp_path)
    proc = sync(host.root, "--create-all", flag)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nvsymlinkd: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"nvsymlinkd: error: {flag}: ") and says in errors[0], proc.stderr
    assert not host.path("/dev/char").exists()  # refused before anything was done


def test_load_kernel_modules_without_create_all_warns_and_goes_on(tmp_path, need_root):
    """nvidia-ctk ignores --load-kernel-modules without --create-all, with a warning, and makes the links
    (validateFlags, create-dev-char-symlinks.go:134-137 at v1.17.8); exit 2 with usage broke a unit or
    udev rule that carried the flag (issue 39 item 14)."""
    host, plain = standard_host(tmp_path / "a"), standard_host(tmp_path / "b")
    proc = sync(host.root, "--load-kernel-modules")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("nvsymlinkd: warning: --load-kernel-modules is only applicable with --create-all (as for "
                           "nvidia-ctk); ignoring\n"), proc.stderr
    assert proc.stdout == sync(plain.root).stdout
    assert host.links() == plain.links() and host.links()


def test_every_ctk_flag_is_accepted_or_refused_and_documented():
    from nvsymlinkd.cli import build_parser

    sync_parser = build_parser(only="sync")._subparsers._group_actions[0].choices["sync"]
    known = {s for a in sync_parser._actions for s in a.option_strings}
    assert set(CTK_FLAGS) <= known, sorted(set(CTK_FLAGS) - known)
    table = (REPO / "docs/install.md").read_text().split("### nvidia-ctk's flags", 1)[1]
    man = (REPO / "man/nvsymlinkd-sync.8.rst").read_text().split("NVIDIA-CTK\n==========", 1)[1]
    for flag in CTK_FLAGS:
        assert f"| `{flag}" in table, f"docs/install.md has no row for {flag}"
        assert f"**{flag}**" in man, f"man nvsymlinkd-sync's NVIDIA-CTK says nothing of {flag}"
