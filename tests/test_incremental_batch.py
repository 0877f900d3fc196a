"""A burst's names cost their own syscalls (issue 38 item 2): LinkState.update for many names walks
DRIVER_ROOT/dev and DEV_CHAR_PATH from the root once each per look, not once per name, and a link it just
made to a node it just lstat'ed is read back without resolving its target again. Counted as confined
directory walks (HostRoot._open: one openat2 with RESOLVE_IN_ROOT each); the answers stay the full pass's
(tests/test_incremental.py holds them equal on random sequences)."""

from __future__ import annotations

import os

from nvsymlinkd.config import Config
from nvsymlinkd.devchar.incremental import LinkState
from nvsymlinkd.devchar.plan import plan_sync
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.devchar.snapshot import observe
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import standard_host

CAPS = 509
BURST = 50


def test_a_burst_is_a_few_walks_not_a_few_per_name(tmp_path, need_root, monkeypatch):
    host = standard_host(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS})
    caps = host.path("/dev/nvidia-caps")
    caps.mkdir()
    host.path("/dev/char").mkdir()
    root, config = HostRoot(str(host.root)), Config()
    state = LinkState(root, reconcile(root, config))
    for i in range(BURST):
        os.mknod(caps / f"nvidia-cap{i}", 0o20600, os.makedev(CAPS, i))
    walks = []
    real_open = HostRoot._open
    monkeypatch.setattr(HostRoot, "_open", lambda self, inside, flags: walks.append(inside) or
                        real_open(self, inside, flags))
    delta = state.update({f"nvidia-caps/nvidia-cap{i}" for i in range(BURST)}, set(), config.create_nodes)
    monkeypatch.undo()
    assert delta is not None and len(delta.changes) == BURST and not delta.errors
    # DRIVER_ROOT/dev once, DEV_CHAR_PATH before and after the links are made, the applier's own
    # (at most once per link: its directory, confined); before: ~4 per name
    assert len(walks) <= BURST + 3, sorted(set(walks))
    assert len([w for w in walks if w != "/dev/char"]) <= 1, walks
    fresh = observe(root)
    assert state.snapshot().entries == fresh.entries and not plan_sync(fresh, config).changes
