"""The daemon's parts on their own: filters, the inotify parser, sd_notify, the journal catalog, the hook."""

from __future__ import annotations

import asyncio
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest

from nvsymlinkd import journal
from nvsymlinkd.containers.runtimes import is_container_scope
from nvsymlinkd.daemon.hook import ContainerHook
from nvsymlinkd.daemon.inotify import (
    IN_CREATE,
    IN_ISDIR,
    IN_Q_OVERFLOW,
    DevWatch,
    LinkWatch,
    parse_events,
)
from nvsymlinkd.daemon.notify import Notifier, send_datagram
from nvsymlinkd.daemon.udev import is_nvidia_event
from nvsymlinkd.host.root import HostRoot
from tests.conftest import need_tool
from tests.daemonproc import notify_socket
from tests.fakehost import standard_host

CATALOG = Path(__file__).resolve().parent.parent / "catalog" / "nvsymlinkd.catalog"


def test_container_scopes():
    for unit in ("docker-0a1b.scope", "cri-containerd-0a1b.scope", "crio-0a1b.scope", "libpod-0a1b.scope",
                 "runc-mybox.scope", "crun-mybox.scope"):
        assert is_container_scope(unit), unit
    for unit in ("crio-conmon-0a1b.scope", "docker.service", "docker-0a1b.service", "session-3.scope",
                 "docker-.scope", "docker-a/../b.scope", "xdocker-1.scope"):
        assert not is_container_scope(unit), unit


def test_uevent_filter():
    assert is_nvidia_event("add", "module", "nvidia_uvm", {})
    assert is_nvidia_event("remove", "module", "nvidia", {})
    assert not is_nvidia_event("add", "module", "nouveau", {})
    assert not is_nvidia_event("change", "module", "nvidia", {})
    assert is_nvidia_event("bind", "pci", "0000:01:00.0", {"DRIVER": "nvidia"})
    assert not is_nvidia_event("bind", "pci", "0000:01:00.0", {"DRIVER": "nouveau"})
    # an unbind carries no DRIVER= any more: the vendor decides
    assert is_nvidia_event("unbind", "pci", "0000:01:00.0", {"PCI_ID": "10DE:2330"})
    assert not is_nvidia_event("unbind", "pci", "0000:01:00.0", {"PCI_ID": "8086:1234"})
    assert not is_nvidia_event("add", "pci", "0000:01:00.0", {"DRIVER": "nvidia"})


def test_parse_inotify_events():
    def event(wd, mask, name):
        raw = name.encode() + b"\0" * (16 - len(name)) if name else b""
        return struct.pack("iIII", wd, mask, 0, len(raw)) + raw

    buf = event(1, IN_CREATE, "nvidia0") + event(-1, IN_Q_OVERFLOW, "") + event(2, IN_CREATE | IN_ISDIR, "nvidia-caps")
    assert parse_events(buf) == [(1, IN_CREATE, "nvidia0"), (-1, IN_Q_OVERFLOW, ""),
                                 (2, IN_CREATE | IN_ISDIR, "nvidia-caps")]


def test_devwatch_filters_names_and_follows_subdirs(tmp_path):
    (tmp_path / "dev").mkdir()
    watch = DevWatch(HostRoot(str(tmp_path)), "/")
    try:
        assert watch.arm()
        assert watch.poll() == (False, False)
        (tmp_path / "dev" / "ttyS9").write_text("")  # not ours: no wakeup
        assert watch.poll() == (False, False)
        (tmp_path / "dev" / "nvidia-caps").mkdir()
        assert watch.poll() == (True, False)
        (tmp_path / "dev" / "nvidia-caps" / "nvidia-cap1").write_text("")
        assert watch.poll() == (True, False)  # the new subdirectory is watched
        assert sorted(p for p, _ in watch.watches.values()) == ["/dev", "/dev/nvidia-caps"]
    finally:
        watch.close()


def test_devwatch_driver_root_appearing_later(tmp_path):
    watch = DevWatch(HostRoot(str(tmp_path)), "/run/nvidia/driver")
    try:
        assert not watch.arm()
        (tmp_path / "run/nvidia/driver/dev").mkdir(parents=True)
        assert watch.arm()
        (tmp_path / "run/nvidia/driver/dev/nvidia0").write_text("")
        assert watch.poll() == (True, False)
        # dev/ replaced by another directory (a driver container restarting): re-watched
        os.rename(tmp_path / "run/nvidia/driver/dev", tmp_path / "run/nvidia/driver/old-dev")
        (tmp_path / "run/nvidia/driver/dev").mkdir()
        watch.poll()
        assert watch.arm()
        (tmp_path / "run/nvidia/driver/dev/nvidia1").write_text("")
        assert watch.poll() == (True, False)
        assert [p for p, _ in watch.watches.values()] == ["/run/nvidia/driver/dev"]
    finally:
        watch.close()


def test_devwatch_waits_for_a_missing_driver_root_from_above(tmp_path):
    (tmp_path / "run").mkdir()
    watch = DevWatch(HostRoot(str(tmp_path)), "/run/nvidia/driver")

    def watched():
        return sorted(p for p, _ in watch.watches.values())

    try:
        assert not watch.arm()
        assert watched() == ["/run"]  # the nearest directory there is
        (tmp_path / "run/other").mkdir()
        assert watch.poll() == (False, False)  # not on the way: nothing
        (tmp_path / "run/nvidia/driver").mkdir(parents=True)
        assert watch.poll() == (False, False)  # on the way, no dev/ yet: waited for from nearer
        assert watched() == ["/run/nvidia/driver"]
        (tmp_path / "run/nvidia/driver/dev").mkdir()
        assert watch.poll() == (True, False)  # there: watched, and a full pass for what is in it
        assert watch.take() == (set(), True)
        assert watched() == ["/run/nvidia/driver/dev"]
        (tmp_path / "run/nvidia/driver/dev/nvidia0").write_text("")
        assert watch.poll() == (True, False)
        assert watch.take() == ({"nvidia0"}, False)
        # dev/ goes (the driver container stopped): waited for from above again
        (tmp_path / "run/nvidia/driver/dev/nvidia0").unlink()
        (tmp_path / "run/nvidia/driver/dev").rmdir()
        assert watch.poll()[0]
        assert not watch.arm()
        assert watched() == ["/run/nvidia/driver"]
    finally:
        watch.close()


def test_linkwatch_wakes_for_nvidia_links_and_the_directory_only(tmp_path):
    watch = LinkWatch(HostRoot(str(tmp_path)), "/dev/char")
    try:
        assert not watch.arm()  # neither /dev nor /dev/char yet
        (tmp_path / "dev").mkdir()
        assert not watch.arm()  # the parent is watched now, DEV_CHAR_PATH is not there
        (tmp_path / "dev" / "char").mkdir()
        assert watch.poll() == (True, False)  # the directory appeared
        assert watch.arm()  # newly watched: the caller looks once more
        assert not watch.arm()
        watch.majors = frozenset({195})
        d = tmp_path / "dev" / "char"
        os.symlink("../tty0", d / "4:0")  # udev's link for another device
        os.symlink("../nvidia0", d / ".nvsymlinkd-tmp-1-195:0")  # our temporary name
        (tmp_path / "dev" / "ttyS9").write_text("")  # elsewhere in the parent
        assert watch.poll() == (False, False)
        os.rename(d / ".nvsymlinkd-tmp-1-195:0", d / "195:0")
        assert watch.poll() == (True, False)
        os.unlink(d / "195:0")
        assert watch.poll() == (True, False)
        # the directory replaced: the old watch goes, the new directory is watched after arm()
        os.rename(d, tmp_path / "dev" / "char.old")
        d.mkdir()
        assert watch.poll() == (True, False)
        assert watch.arm()
        os.symlink("../nvidia1", d / "195:1")
        assert watch.poll() == (True, False)
        os.unlink(tmp_path / "dev" / "char.old" / "4:0")
        assert watch.poll() == (False, False)
        assert sorted(p for p, _ in watch.watches.values()) == ["/dev", "/dev/char"]
    finally:
        watch.close()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notify_fallback_protocol(tmp_path, abstract):
    sock, address = notify_socket(tmp_path, abstract, timeout=10)
    with sock:
        # an explicit environ means the built-in protocol, not libsystemd
        n = Notifier({"NOTIFY_SOCKET": address})
        n.ready("2 links\nfor 2 nodes")
        assert sock.recv(1024) == b"READY=1\nSTATUS=2 links for 2 nodes"
        n.watchdog()
        assert sock.recv(1024) == b"WATCHDOG=1"
        n.stopping()
        assert sock.recv(1024) == b"STOPPING=1\nSTATUS=stopping"
    assert not send_datagram(str(tmp_path / "gone.sock"), "READY=1")


def test_watchdog_interval():
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval() == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_interval() is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_interval() is None
    assert Notifier({"WATCHDOG_USEC": "soon"}).watchdog_interval() is None
    assert Notifier({}).watchdog_interval() is None
    assert not Notifier({}).send("READY=1")


def _catalog_entries(text: str) -> dict:
    """Parse the catalog like systemd's catalog.c: '-- ID' starts an entry, headers, a blank line, a body."""
    entries: dict = {}
    current = None
    in_headers = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"-- ([0-9a-f]{32})(?: ([a-z]{2}(?:_[A-Z]{2})?))?", line)
        if m:
            assert m.group(1) not in entries, f"line {number}: duplicate entry {m.group(1)}"
            current = entries[m.group(1)] = {"headers": {}, "body": []}
            in_headers = True
            continue
        if line.startswith("--"):
            raise AssertionError(f"line {number}: bad entry line {line!r}")
        if current is None:
            assert not line.strip(), f"line {number}: text before the first entry"
            continue
        if in_headers:
            if not line:
                in_headers = False
                continue
            key, sep, value = line.partition(": ")
            assert sep and re.fullmatch(r"[A-Z][A-Za-z-]*", key), f"line {number}: bad header {line!r}"
            current["headers"][key] = value
        else:
            current["body"].append(line)
    return entries


def test_catalog_covers_every_message_id():
    entries = _catalog_entries(CATALOG.read_text())
    assert set(journal.MESSAGE_IDS.values()) <= set(entries)
    assert len(set(journal.MESSAGE_IDS.values())) == len(journal.MESSAGE_IDS), "two kinds share an ID"
    for mid, entry in entries.items():
        assert entry["headers"].get("Subject"), mid
        assert entry["headers"].get("Defined-By") == "nvsymlinkd", mid
        assert any(line.strip() for line in entry["body"]), f"{mid}: empty body"
    for kind, mid in journal.MESSAGE_IDS.items():
        assert re.fullmatch(r"[0-9a-f]{32}", mid), kind


def test_catalog_compiles_with_journalctl(tmp_path):
    # --root keeps journalctl away from the host's catalog database
    journalctl = need_tool("journalctl")
    catdir = tmp_path / "usr/lib/systemd/catalog"
    catdir.mkdir(parents=True)
    (tmp_path / "var/lib/systemd/catalog").mkdir(parents=True)
    (catdir / "nvsymlinkd.catalog").write_text(CATALOG.read_text())
    subprocess.run([journalctl, "--root", str(tmp_path), "--update-catalog"], check=True)
    listed = subprocess.run([journalctl, "--root", str(tmp_path), "--list-catalog"], check=True,
                            capture_output=True, text=True).stdout
    ids = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert set(journal.MESSAGE_IDS.values()) <= ids


def test_journal_stderr_lines(tmp_path):
    with open(tmp_path / "err", "w+") as f:
        j = journal.Journal("stderr", stream=f)
        assert j.target == "stderr"
        j.event("link-created", journal.INFO, "created link /dev/char/195:0 -> ../nvidia0 (c 195:0)",
                link="/dev/char/195:0", device="c 195:0", action="create")
        j.debug("not shown without NVSYMLINKD_DEBUG=1")
        f.seek(0)
        assert f.read() == "nvsymlinkd: created link /dev/char/195:0 -> ../nvidia0 (c 195:0)\n"


class RecordingHook(ContainerHook):
    """The daemon calls its hook's methods directly: a hook is a ContainerHook (what it leaves alone does nothing)."""

    def __init__(self):
        super().__init__(journal.Journal("stderr", stream=open(os.devnull, "w")))
        self.calls = []
        self.reloading = []  # systemd_reloading(bool): told at once, from the event loop, not awaited

    def systemd_reloading(self, reloading):
        self.reloading.append(reloading)

    async def reload_finished(self):
        self.calls.append(("reload_finished",))

    async def scope_appeared(self, unit):
        self.calls.append(("scope_appeared", unit))

    async def nodes_changed(self, result):
        self.calls.append(("nodes_changed", len(result.snapshot.nodes)))


def test_hook_is_swappable(tmp_path, need_root):
    from nvsymlinkd.config import Config
    from nvsymlinkd.daemon.loop import Daemon
    from nvsymlinkd.daemon.sources.systemd import SystemdSource

    host = standard_host(tmp_path / "root")
    hook = RecordingHook()
    with open(tmp_path / "log", "w") as logf:
        daemon = Daemon(HostRoot(str(host.root)), Config(resync_interval=0), hook=hook,
                        journal=journal.Journal("stderr", stream=logf), notifier=Notifier({}),
                        use_udev=False, use_bus=False)

        async def scenario():
            task = asyncio.ensure_future(daemon.run())
            while daemon.passes < 1:
                await asyncio.sleep(0.01)
            host.node("/dev/nvidia5", 195, 5)
            while not hook.calls:
                await asyncio.sleep(0.01)
            bus = SystemdSource(daemon)  # what the systemd source calls back with (no bus here)
            bus.on_reload("reload")
            bus.on_scope("docker-1.scope")
            while len(hook.calls) < 3:
                await asyncio.sleep(0.01)
            daemon.stop()
            return await asyncio.wait_for(task, 30)

        assert asyncio.run(scenario()) == 0
    assert hook.calls[0] == ("nodes_changed", 7)
    assert sorted(hook.calls[1:]) == [("reload_finished",), ("scope_appeared", "docker-1.scope")]
    assert hook.reloading == [False]  # the finished reload, before the hook is asked to verify


def test_module_journal_kinds_are_in_the_one_table():
    # the verifier and repair name their journal kinds; journal.MESSAGE_IDS (and so the catalog) holds the IDs
    from nvsymlinkd import journal as journalmod
    from nvsymlinkd.repair import apply as repairer
    from nvsymlinkd.verify import evaluate
    from nvsymlinkd.verify import kinds as findingkinds

    for kind in (*findingkinds.JOURNAL_KINDS.values(), *repairer.JOURNAL_KINDS.values(), "repair-thawed"):
        assert kind in journalmod.MESSAGE_IDS
    assert set(findingkinds.JOURNAL_KINDS) == {evaluate.OK, *evaluate.KINDS}
    ids = list(journalmod.MESSAGE_IDS.values())
    assert len(ids) == len(set(ids))


def test_a_failing_hook_is_journaled_never_raised(tmp_path):
    """The daemon calls its hook's methods directly, each through Daemon.guarded: what one raises is one ERR line
    naming the method (the line the call by name wrote), and the link keeper goes on."""
    from nvsymlinkd.config import Config
    from nvsymlinkd.daemon.loop import Daemon

    class Failing(ContainerHook):
        async def scope_appeared(self, unit):
            raise RuntimeError(f"boom {unit}")

    with open(tmp_path / "log", "w+") as logf:
        j = journal.Journal("stderr", stream=logf)
        daemon = Daemon(HostRoot(str(tmp_path)), Config(resync_interval=0, metrics_textfile=""), hook=Failing(j),
                        journal=j, notifier=Notifier({}), use_udev=False, use_bus=False)
        asyncio.run(daemon.guarded(daemon.hook.scope_appeared("docker-1.scope")))
        logf.seek(0)
        assert logf.read() == "nvsymlinkd: container hook scope_appeared failed: RuntimeError: boom docker-1.scope\n"


def test_shutdown_cancels_again_a_task_that_lost_its_cancel(tmp_path):
    """asyncio.wait_for before Python 3.12 can lose a cancel that lands as its inner future finishes (CPython
    gh-86296): the bus watch then went on to its retry sleep and a SIGTERM never stopped the daemon (1 run in 8
    of test_daemon_journal's). A task that swallows its first cancel must still end at shutdown."""
    from nvsymlinkd.config import Config
    from nvsymlinkd.daemon.loop import Daemon

    with open(tmp_path / "log", "w") as logf:
        j = journal.Journal("stderr", stream=logf)
        daemon = Daemon(HostRoot(str(tmp_path)), Config(resync_interval=0, metrics_textfile=""), hook=ContainerHook(j),
                        journal=j, notifier=Notifier({}), use_udev=False, use_bus=False)
        swallowed = []

        async def retrying():
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed.append(1)  # what the lost cancel looks like from inside

        async def scenario():
            daemon.spawn(retrying())
            await asyncio.sleep(0)
            await asyncio.wait_for(daemon._shutdown(), 10)

        asyncio.run(scenario())
    assert swallowed == [1] and not daemon._tasks
