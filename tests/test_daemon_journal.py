"""Structured entries reach a journal socket: a private /run in a mount namespace stands in for journald."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nvsymlinkd import journal
from tests.conftest import IN_CI, need_tool
from tests.fakehost import standard_host
from tests.journalproto import PARSE_SOURCE

# Runs as root in its own mount namespace with a tmpfs on /run: binds the journal socket
# where libsystemd sends to, runs the daemon with stderr a pipe (not a terminal), and
# prints every datagram it got, decoded with journald's native protocol.
LISTENER = r"""
import json, os, signal, socket, struct, subprocess, sys

__PARSE__

root, stopped_id = sys.argv[1], sys.argv[2]
os.makedirs("/run/systemd/journal")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind("/run/systemd/journal/socket")
sock.settimeout(30)
env = dict(os.environ, NVSYMLINKD_LOG="auto", DBUS_SYSTEM_BUS_ADDRESS="unix:path=/nonexistent")
daemon = subprocess.Popen([sys.executable, "-m", "nvsymlinkd", "--root", root, "run", "--resync-interval", "0"],
                          env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
entries = []
while not any(e.get("NVSYMLINKD_LINK") == "/dev/char/510:1" for e in entries):
    entries.append(parse(sock.recv(1 << 20)))
daemon.send_signal(signal.SIGTERM)
while not any(e.get("MESSAGE_ID") == stopped_id for e in entries):
    entries.append(parse(sock.recv(1 << 20)))
print(json.dumps({"entries": entries, "stderr": daemon.stderr.read(), "rc": daemon.wait()}))
""".replace("__PARSE__", PARSE_SOURCE)


def test_entries_carry_message_id_fields_and_priority(tmp_path, need_root):
    try:
        import systemd.journal  # noqa: F401
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"CI must run this test, but: {exc} (python3-systemd)", pytrace=False)
        pytest.skip(f"python3-systemd: {exc}")
    unshare = need_tool("unshare")
    host = standard_host(tmp_path / "root")
    script = tmp_path / "listener.py"
    script.write_text(LISTENER)
    proc = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c",
                           'mount -t tmpfs tmpfs /run && exec "$0" "$@"', sys.executable, str(script),
                           str(host.root), journal.MESSAGE_IDS["daemon-stopped"]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["rc"] == 0
    assert out["stderr"] == "", "with a journal, nothing goes to stderr"
    entries = out["entries"]
    created = [e for e in entries if e.get("MESSAGE_ID") == journal.MESSAGE_IDS["link-created"]]
    assert {e["NVSYMLINKD_LINK"] for e in created} == {
        "/dev/char/195:0", "/dev/char/195:1", "/dev/char/195:254", "/dev/char/195:255",
        "/dev/char/510:0", "/dev/char/510:1"}
    first = next(e for e in created if e["NVSYMLINKD_LINK"] == "/dev/char/195:0")
    assert first["MESSAGE"] == "created link /dev/char/195:0 -> ../nvidia0 (c 195:0)"
    assert first["NVSYMLINKD_DEVICE"] == "c 195:0"
    assert first["NVSYMLINKD_ACTION"] == "create"
    assert first["PRIORITY"] == str(journal.INFO)
    assert first["SYSLOG_IDENTIFIER"] == "nvsymlinkd"
    assert first["CODE_FILE"].endswith("daemon/loop.py") and first["CODE_FUNC"] == "_report"
    lost = [e for e in entries if e.get("MESSAGE_ID") == journal.MESSAGE_IDS["bus-lost"]]
    assert len(lost) == 1 and lost[0]["PRIORITY"] == str(journal.WARNING)
    kinds = {e.get("MESSAGE_ID") for e in entries}
    assert journal.MESSAGE_IDS["daemon-started"] in kinds
