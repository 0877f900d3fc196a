"""A burst of nodes is one pass (issue 38): names that arrive while an incremental pass works are taken by
that pass before it returns, and a later batch that needs the whole picture is left to a full pass, not lost.

In-process, on a fake root (mknod needs root): "arriving while the pass works" is made certain by making the
next batch of nodes from inside the pass's first update (LinkState.update), as another process would."""

from __future__ import annotations

import asyncio
import os
import re

from nvsymlinkd import journal
from nvsymlinkd.config import Config
from nvsymlinkd.daemon.loop import Daemon
from nvsymlinkd.daemon.notify import Notifier
from nvsymlinkd.daemon.sources.links import LinkSource
from nvsymlinkd.daemon.sources.nodes import NodeSource
from nvsymlinkd.devchar.incremental import LinkState
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import standard_host

CAPS = 509


class _Writes:
    """A stream that keeps each write() call's text."""

    def __init__(self, f):
        self.f, self.writes = f, []

    def write(self, text):
        self.writes.append(text)
        return self.f.write(text)

    def flush(self):
        self.f.flush()

    def isatty(self):
        return False

    def fileno(self):
        return self.f.fileno()


def _burst(tmp_path, monkeypatch, during):
    """Start a daemon, mknod cap0 and, inside the pass's first update, call during(caps) -> (the links in
    DEV_CHAR_PATH after it, the journal text with each pass's debug line)."""
    host = standard_host(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS})
    caps = host.path("/dev/nvidia-caps")
    caps.mkdir()
    dev_char = host.path("/dev/char")
    dev_char.mkdir()
    real_update = LinkState.update
    armed: list = []

    def update(self, node_names, link_names, create_nodes=False):
        if armed:
            armed.clear()
            during(caps)  # after the pass took cap0's name, before it returns
        return real_update(self, node_names, link_names, create_nodes)

    monkeypatch.setattr(LinkState, "update", update)
    monkeypatch.setenv("NVSYMLINKD_DEBUG", "1")  # each pass says why it ran and which kind it was
    log = tmp_path / "log"
    with open(log, "w") as logf:
        stream = _Writes(logf)
        daemon = Daemon(HostRoot(str(host.root)), Config(resync_interval=0, metrics_textfile=""),
                        journal=journal.Journal("stderr", stream=stream), notifier=Notifier({}),
                        use_udev=False, use_bus=False, sources=(NodeSource, LinkSource))

        async def scenario():
            task = asyncio.ensure_future(daemon.run())
            while daemon.passes < 1:
                await asyncio.sleep(0.01)
            armed.append(True)
            os.mknod(caps / "nvidia-cap0", 0o20600, os.makedev(CAPS, 0))
            want = {f"{CAPS}:{i}" for i in range(101)}
            for _ in range(1000):
                if want <= set(os.listdir(dev_char)):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # any pass still to come has come
            daemon.stop()
            assert await asyncio.wait_for(task, 30) == 0

        asyncio.run(scenario())
    return set(os.listdir(dev_char)), log.read_text(), stream.writes


def _working(log) -> list:
    """(changes, incremental) of each pass after the first that changed something."""
    found = re.findall(r"pass (\d+) \([^)]*\): (\d+) changes(, incremental)?", log)
    return [(int(k), bool(inc)) for n, k, inc in found if int(n) > 1 and int(k)]


def _make(caps, first, count):
    for i in range(first, first + count):
        os.mknod(caps / f"nvidia-cap{i}", 0o20600, os.makedev(CAPS, i))


def test_names_arriving_during_a_pass_are_that_pass(tmp_path, monkeypatch, need_root):
    names, log, writes = _burst(tmp_path, monkeypatch, lambda caps: _make(caps, 1, 100))
    assert {f"{CAPS}:{i}" for i in range(101)} <= names
    assert _working(log) == [(101, True)], log  # one pass made them all (it was 1, then 100)
    made = f"created link /dev/char/{CAPS}:"
    assert log.count(made) == 101  # one journal entry per link, as before...
    assert [w.count(made) for w in writes if made in w] == [101]  # ...in one write(2)


def test_a_batch_needing_the_whole_picture_goes_to_a_full_pass(tmp_path, monkeypatch, need_root):
    def during(caps):
        _make(caps, 1, 100)
        # a new subdirectory of nodes under DRIVER_ROOT/dev: only the full pass answers it
        os.mkdir(caps.parent / "nvidia-caps-imex-channels")

    names, log, writes = _burst(tmp_path, monkeypatch, during)
    assert {f"{CAPS}:{i}" for i in range(101)} <= names
    # the incremental pass for cap0, the full one for what came during it
    assert _working(log) == [(1, True), (100, False)], log


def test_a_pass_takes_more_names_a_bounded_number_of_times(tmp_path, monkeypatch, need_root):
    from nvsymlinkd.daemon import passes

    monkeypatch.setattr(passes, "MORE_ROUNDS", 1)  # a writer that never stops cannot keep one pass going
    names, log, _ = _burst(tmp_path, monkeypatch, lambda caps: _make(caps, 1, 100))
    assert {f"{CAPS}:{i}" for i in range(101)} <= names
    assert _working(log) == [(1, True), (100, True)], log  # the rest: the next pass, still incremental
