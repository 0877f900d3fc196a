"""The daemon's heap between passes: the startup objects frozen out of the collector's full collections
once the daemon is ready (gc.freeze), and the free pages of a verification of many containers given back
(malloc_trim through host/libc.malloc_compact)."""

from __future__ import annotations

import asyncio
import gc

from nvsymlinkd import journal
from nvsymlinkd.config import Config
from nvsymlinkd.daemon import containerwatch
from nvsymlinkd.daemon.containerwatch import ContainerWatch
from nvsymlinkd.daemon.loop import Daemon
from nvsymlinkd.daemon.notify import Notifier
from nvsymlinkd.host.root import HostRoot
from tests.conftest import v1_cgroup
from tests.fixtures.runtimes.layouts import Layouts
from tests.test_hostile_input import RecordingJournal
from tests.test_verify_cache import GPU_SPEC, two_gpu_host


def test_the_daemon_freezes_its_startup_objects_once_ready(gpu_host, tmp_path):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with open(tmp_path / "log", "w") as logf:
        daemon = Daemon(HostRoot(str(gpu_host.root)), Config(resync_interval=0),
                        journal=journal.Journal("stderr", stream=logf), notifier=Notifier({}),
                        use_udev=False, use_bus=False)

        async def scenario() -> tuple:
            task = asyncio.ensure_future(daemon.run())
            while not daemon._ready:
                await asyncio.sleep(0.01)
            frozen = gc.get_freeze_count()
            daemon.stop()
            return frozen, await asyncio.wait_for(task, 30)

        try:
            frozen, rc = asyncio.run(scenario())
        finally:
            gc.unfreeze()  # the test process's objects back where they were
    assert rc == 0
    assert frozen > 1000  # the modules' objects and the first picture


def test_a_verification_of_many_containers_gives_its_free_pages_back(fakehost, v1_parent, monkeypatch):
    root = two_gpu_host(fakehost)
    Layouts(fakehost).containerd("heap", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "heap", ["c 195:0 rw"]))
    trims: list = []
    monkeypatch.setattr(containerwatch.libc, "malloc_compact", lambda arenas=False: trims.append(arenas))
    watch = ContainerWatch(RecordingJournal(), root, lambda: Config().with_overrides(repair="off"), use_bus=False)
    monkeypatch.setattr(containerwatch, "TRIM_CONTAINERS", 2)
    assert len(watch.verify_and_repair("test").containers) == 1
    assert trims == []  # fewer than TRIM_CONTAINERS: nothing to give back worth a trim
    monkeypatch.setattr(containerwatch, "TRIM_CONTAINERS", 1)
    watch.verify_and_repair("test")
    assert trims == [False]
