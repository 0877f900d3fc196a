"""The real daemon against a fake root: inotify fast path, overflow, signals, sd_notify."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.daemonproc import DaemonProcess, notify_socket
from tests.fakehost import CAPS_MAJOR, STANDARD_LINKS, links  # noqa: F401 - also the names other files took from here


@pytest.fixture
def daemon_factory():
    started = []

    def start(root, *args, **kw):
        d = DaemonProcess(root, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.signal(signal.SIGCONT)
        d.stop()


def test_node_appears_and_goes(caps_host, daemon_factory):
    d = daemon_factory(caps_host.root, "--resync-interval", "0", journal=True)
    d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the first full sync")
    caps_host.node("/dev/nvidia7", 195, 7)
    d.wait_until(lambda: (links(caps_host) or {}).get("195:7") == "../nvidia7", "a link for a new node")
    os.unlink(caps_host.path("/dev/nvidia7"))
    d.wait_until(lambda: "195:7" not in (links(caps_host) or {"195:7": 0}), "the link of a removed node to go")
    assert links(caps_host) == STANDARD_LINKS
    d.wait_entry("link-created", NVSYMLINKD_LINK="/dev/char/195:7", NVSYMLINKD_DEVICE="c 195:7")
    d.wait_entry("link-removed", NVSYMLINKD_LINK="/dev/char/195:7", NVSYMLINKD_DEVICE="c 195:7")
    assert d.stop() == 0


def test_subdirectory_created_later_is_watched(caps_host, daemon_factory):
    # resync disabled: only inotify can explain the links appearing
    d = daemon_factory(caps_host.root, "--resync-interval", "0")
    d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the first full sync")
    caps_host.node("/dev/nvidia-caps/nvidia-cap1", CAPS_MAJOR, 1)
    d.wait_until(lambda: "509:1" in (links(caps_host) or {}), "a link for a node in a new subdirectory")
    caps_host.node("/dev/nvidia-caps/nvidia-cap2", CAPS_MAJOR, 2)
    d.wait_until(lambda: (links(caps_host) or {}).get("509:2") == "../nvidia-caps/nvidia-cap2", "a second node in it")
    # a node with an unrelated name in /dev wakes nobody and changes nothing
    caps_host.node("/dev/ttyFAKE0", 4, 64)
    assert d.stop() == 0


def test_inotify_overflow_ends_exact(caps_host, daemon_factory):
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    if limit > 200_000:
        pytest.skip(f"fs.inotify.max_queued_events={limit} is too large to overflow in a test")
    d = daemon_factory(caps_host.root, "--resync-interval", "0", journal=True)
    caps_host.node("/dev/nvidia-caps/nvidia-cap0", CAPS_MAJOR, 0)
    d.wait_until(lambda: "509:0" in (links(caps_host) or {}), "the caps directory to be watched")
    count = limit + 500
    d.signal(signal.SIGSTOP)  # the queue fills while the daemon cannot read it
    try:
        caps = caps_host.path("/dev/nvidia-caps")
        for i in range(1, count):
            os.mknod(caps / f"nvidia-cap{i}", 0o20600, os.makedev(CAPS_MAJOR, i))
    finally:
        d.signal(signal.SIGCONT)
    expected = dict(STANDARD_LINKS)
    expected.update({f"{CAPS_MAJOR}:{i}": f"../nvidia-caps/nvidia-cap{i}" for i in range(count)})
    d.wait_until(lambda: links(caps_host) == expected, f"{count} links after an inotify overflow", timeout=120)
    d.wait_entry("event-overflow")
    # and all of them go again, removed in one burst
    subprocess.run(["rm", "-rf", str(caps_host.path("/dev/nvidia-caps"))], check=True)
    d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the cap links to go", timeout=120)
    assert d.alive()
    assert d.stop() == 0


def test_burst_is_coalesced(caps_host, daemon_factory):
    d = daemon_factory(caps_host.root, "--resync-interval", "0", journal=True)
    d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the first full sync")
    # 50 nodes appear while the daemon cannot run (as if all of them landed within one pass)
    d.signal(signal.SIGSTOP)
    try:
        for i in range(2, 52):
            caps_host.node(f"/dev/nvidia{i}", 195, i)
    finally:
        d.signal(signal.SIGCONT)
    d.wait_until(lambda: len(links(caps_host) or {}) == len(STANDARD_LINKS) + 50, "50 links")
    assert d.stop() == 0
    (message, _), = d.entries(kind="daemon-stopped")
    passes = int(message.split("stopped after ", 1)[1].split()[0])  # the count is only in its words
    # the startup pass, then one (rarely two) for the whole burst; one per event would be 51
    assert passes <= 4, f"{passes} sync passes for one burst of 50 nodes"


def test_sigterm_and_sigint_exit_zero(caps_host, daemon_factory):
    for sig in (signal.SIGTERM, signal.SIGINT):
        d = daemon_factory(caps_host.root, journal=True)
        d.wait_entry("daemon-started")
        d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the first full sync")
        d.signal(sig)
        assert d.proc.wait(30) == 0
        d.wait_entry("daemon-stopped")


def test_sighup_bad_config_keeps_old(caps_host, daemon_factory, tmp_path):
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = daemon_factory(caps_host.root, config=cfg, journal=True)
    d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the first full sync")
    cfg.write_text("resync_interval = -5\nno_such_key = 1\n")
    mark = d.mark()
    d.signal(signal.SIGHUP)
    message, fields = d.wait_entry("config-error", after=mark)
    assert str(cfg) in message and fields["PRIORITY"] == "3"  # names the file to fix
    assert d.alive()
    caps_host.node("/dev/nvidia9", 195, 9)  # still working
    d.wait_until(lambda: "195:9" in (links(caps_host) or {}), "a link after a bad SIGHUP")
    # a good config is taken: links move to another directory
    cfg.write_text('resync_interval = 0\ndev_char_path = "/dev/char2"\n')
    mark = d.mark()
    d.signal(signal.SIGHUP)
    message, _ = d.wait_entry("config-reloaded", after=mark)
    assert message == f'config reloaded from {cfg}: dev_char_path "/dev/char" -> "/dev/char2"', message
    d.wait_until(lambda: (links(caps_host, "/dev/char2") or {}).get("195:9") == "../nvidia9",
                 "links in the new directory")
    mark = d.mark()
    d.signal(signal.SIGHUP)  # the same file again
    message, _ = d.wait_entry("config-reloaded", after=mark)
    assert message.endswith(": nothing changed"), message
    assert d.stop() == 0


def test_sighup_says_which_file_keys_a_flag_overrides(caps_host, daemon_factory, tmp_path):
    """A key the operator edits in the file while the unit's command line sets it: the reload keeps the
    flag's value, and says so (the key, the file's value, the flag's, that the flag wins); it was silent
    (issue 39 item 13). At start too."""
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text('resync_interval = 0\ndev_char_path = "/dev/char-file"\n')
    d = daemon_factory(caps_host.root, "--dev-char-path", "/dev/char", config=cfg, journal=True)
    d.wait_until(lambda: links(caps_host) == STANDARD_LINKS, "the first full sync")
    said = f'config {cfg}: dev_char_path = "/dev/char-file" (--dev-char-path "/dev/char"): the command-line flag wins'
    d.wait_for_line(re.escape(said))
    cfg.write_text('resync_interval = 0\ndev_char_path = "/dev/char2"\n')
    mark = d.mark()
    d.signal(signal.SIGHUP)
    message, _ = d.wait_entry("config-reloaded", after=mark)
    assert message.endswith(": nothing changed"), message
    line = d.lines[d.wait_for_line(r"the command-line flag wins", after=mark)]
    assert f'config {cfg}: dev_char_path = "/dev/char2" (--dev-char-path "/dev/char"): the command-line flag wins ' \
           "over the file, at start and at every reload" in line, line
    assert "resync_interval" not in line  # no flag for it: the file's value is used, nothing to say
    assert not os.path.exists(caps_host.path("/dev/char2"))  # the flag's directory is kept
    assert d.stop() == 0


def test_driver_not_loaded_is_said_once(caps_host, daemon_factory):
    caps_host.proc_devices({})  # no NVIDIA entry: the module is not loaded
    d = daemon_factory(caps_host.root, "--resync-interval", "1", journal=True)
    d.wait_until(lambda: len(d.entries(kind="daemon-started")) == 1, "the daemon to start")
    said = lambda: [m for m, _ in d.entries() if m.startswith("NVIDIA driver not loaded")]  # noqa: E731
    d.wait_until(lambda: said(), "the warning")
    time.sleep(2.5)  # more periodic passes
    assert len(said()) == 1, d.entries()
    (_, fields), = [e for e in d.entries() if e[0].startswith("NVIDIA driver not loaded")]
    assert fields["PRIORITY"] == "4"
    caps_host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
    d.wait_until(lambda: any(m == "NVIDIA driver loaded: linking its nodes" for m, _ in d.entries()),
                 "the driver to be noticed")
    d.wait_until(lambda: (links(caps_host) or {}).get("195:0") == "../nvidia0", "links once the driver is there")
    assert len(said()) == 1
    assert d.stop() == 0


def test_bad_config_at_start_exits_2(caps_host, tmp_path, nvsymlinkd_cli):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("resync_interval = 'often'\n")
    proc = nvsymlinkd_cli("--root", caps_host.root, "--config", cfg, "run")
    assert proc.returncode == 2
    assert "resync_interval" in proc.stderr
    proc = nvsymlinkd_cli("--root", caps_host.root, "run", "--resync-interval", "-1")
    assert proc.returncode == 2


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notify_socket(caps_host, daemon_factory, tmp_path, abstract):
    sock, address = notify_socket(tmp_path, abstract)
    with sock:
        d = daemon_factory(caps_host.root, env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"})
        got: list = []

        def receive_until(word):
            while not any(word in m for m in got):
                got.append(sock.recv(4096).decode())

        receive_until("READY=1")
        ready = next(m for m in got if "READY=1" in m)
        assert "STATUS=6 links for 6 NVIDIA nodes" in ready
        assert links(caps_host) == STANDARD_LINKS  # READY=1 comes after the first full sync
        # watchdog pings every 50 ms; a few of them
        while sum(m.count("WATCHDOG=1") for m in got) < 3:
            got.append(sock.recv(4096).decode())
        d.signal(signal.SIGTERM)
        receive_until("STOPPING=1")
        assert d.proc.wait(30) == 0


def test_watchdog_pid_for_another_process_means_no_pings(caps_host, daemon_factory, tmp_path):
    sock, address = notify_socket(tmp_path, False)
    with sock:
        d = daemon_factory(caps_host.root, env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000",
                                           "WATCHDOG_PID": "1"})
        got = []
        while not any("READY=1" in m for m in got):
            got.append(sock.recv(4096).decode())
        d.signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in got):
            got.append(sock.recv(4096).decode())
        assert not any("WATCHDOG=1" in m for m in got), got
        assert d.proc.wait(30) == 0


def test_priority_prefixes_only_when_stderr_is_the_journal_stream(caps_host, tmp_path):
    for matching in (True, False):
        log = tmp_path / f"stderr-{matching}.log"
        with open(log, "w") as f:
            st = os.fstat(f.fileno())
            inode = st.st_ino if matching else st.st_ino + 1
            d = DaemonProcess(caps_host.root, "--resync-interval", "0", stderr_file=f,
                              env={"JOURNAL_STREAM": f"{st.st_dev}:{inode}"})
            d.wait_until(lambda log=log: "nvsymlinkd: starting" in log.read_text(), "the first line")
            assert d.stop() == 0
        text = log.read_text()
        if matching:
            assert "<6>nvsymlinkd: starting" in text
            assert "<6>nvsymlinkd: stopped after" in text
        else:
            assert "<6>" not in text and "nvsymlinkd: stopped after" in text
