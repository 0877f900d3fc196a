"""An event's pass does work for its change, not for the whole host (issue 38 item 2): the metrics of an
incremental pass are counted from its own outcomes (not the thousands of stand-ins `Picture.outcomes`
builds), and node events ask the container verifier once per ContainerWatch.NODES_DELAY, not once each."""

from __future__ import annotations

import asyncio
import os

from nvsymlinkd.config import Config
from nvsymlinkd.daemon import containerwatch
from nvsymlinkd.devchar.incremental import LinkState, Picture
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.metrics import Metrics
from tests.fakehost import standard_host

CAPS = 509


class _Journal:
    def debug(self, *a, **k):
        pass

    log = event = warning = info = notice = debug


def test_node_events_ask_for_one_verification_not_one_each(monkeypatch):
    monkeypatch.setattr(containerwatch, "NODES_DELAY", 0.2)
    cw = containerwatch.ContainerWatch(_Journal(), None, Config)
    asked = []
    monkeypatch.setattr(cw, "_request", asked.append)

    async def events():
        for _ in range(100):  # a host making nodes one at a time: a pass and its nodes_changed each
            await cw.nodes_changed(None)
        assert asked == []  # nothing yet: the first asks for one verification NODES_DELAY later
        await asyncio.sleep(0.4)
        await cw.nodes_changed(None)  # later changes ask again
        await asyncio.sleep(0.4)
        cw.close()

    asyncio.run(events())
    assert asked == ["NVIDIA nodes changed"] * 2


class _Counted(Picture):
    @property
    def outcomes(self):
        raise AssertionError("an incremental pass's metrics walked every link")


def test_an_incremental_pass_is_counted_from_its_own_outcomes(tmp_path, need_root):
    host = standard_host(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS})
    caps = host.path("/dev/nvidia-caps")
    caps.mkdir()
    for i in range(200):
        os.mknod(caps / f"nvidia-cap{i}", 0o20600, os.makedev(CAPS, i))
    host.path("/dev/char").mkdir()
    root, config = HostRoot(str(host.root)), Config()
    state = LinkState(root, reconcile(root, config))
    os.mknod(caps / "nvidia-cap200", 0o20600, os.makedev(CAPS, 200))
    delta = state.update({"nvidia-caps/nvidia-cap200"}, set())
    full = Metrics()
    full.on_reconcile(Picture(state, delta.outcomes))  # the stand-ins, as before
    m = Metrics()
    m.on_reconcile(_Counted(state, delta.outcomes))
    assert (m.nodes, m.links_managed, m.changes) == (full.nodes, full.links_managed, full.changes)
    assert m.links_managed == len(state.nodes) and m.changes["create"] == 1
