"""The daemon's per-name path (devchar.incremental) against the full pass as the oracle.

Random sequences of what happens to a MIG host's nodes and links (mknod, rm, the same name
re-made with another rdev, a link removed, a foreign or wrong link put in its place, an
inotify overflow) go through the real inotify watches; the names they report go to
LinkState.update. After every step the incremental picture must equal a fresh full
observe of the host, and a full pass must find nothing left to change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvsymlinkd.config import Config
from nvsymlinkd.daemon.inotify import DevWatch, LinkWatch
from nvsymlinkd.devchar.incremental import LinkState
from nvsymlinkd.devchar.plan import plan_sync
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.devchar.snapshot import observe
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import standard_host

CAPS = 509
SLOTS = 6  # cap names nvidia-cap0..5; minors 0..7, so names and rdevs collide and get reused

node_op = st.tuples(st.just("mknod"), st.integers(0, SLOTS - 1), st.integers(0, 7))
rm_op = st.tuples(st.just("rm"), st.integers(0, SLOTS - 1), st.just(0))
remake_op = st.tuples(st.just("remake"), st.integers(0, SLOTS - 1), st.integers(0, 7))
unlink_op = st.tuples(st.just("unlink"), st.integers(0, 7), st.just(0))
foreign_op = st.tuples(st.just("foreign"), st.integers(0, 7), st.just(0))
wrong_op = st.tuples(st.just("wrong"), st.integers(0, 7), st.integers(0, SLOTS - 1))
gpu_op = st.tuples(st.just("gpu"), st.integers(0, 3), st.integers(0, 3))
notdev_op = st.tuples(st.just("file"), st.integers(0, SLOTS - 1), st.just(0))
overflow_op = st.tuples(st.just("overflow"), st.just(0), st.just(0))
ops = st.lists(st.lists(st.one_of(node_op, rm_op, remake_op, unlink_op, foreign_op, wrong_op, gpu_op,
                                  notdev_op, overflow_op), min_size=1, max_size=4),
               min_size=1, max_size=8)


class Harness:
    def __init__(self, base: Path):
        self.host = standard_host(base / "root")
        self.host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS})
        self.host.node("/dev/null", 1, 3)
        self.host.path("/dev/nvidia-caps").mkdir()
        self.root = HostRoot(str(self.host.root))
        self.config = Config()
        self.devwatch = DevWatch(self.root, "/")
        self.linkwatch = LinkWatch(self.root, "/dev/char")
        self.full_passes = 0
        self.full()
        assert self.devwatch.arm() and self.linkwatch.arm() is not None

    def close(self):
        self.devwatch.close()
        self.linkwatch.close()

    def full(self):
        result = reconcile(self.root, self.config)
        self.full_passes += 1
        self.linkwatch.majors = result.snapshot.majors.nvidia_majors
        self.state = LinkState(self.root, result)

    def caps(self, slot: int) -> Path:
        return self.host.path(f"/dev/nvidia-caps/nvidia-cap{slot}")

    def do(self, op, arg, extra) -> None:
        char = self.host.path("/dev/char")
        if op == "mknod" and not os.path.lexists(self.caps(arg)):
            os.mknod(self.caps(arg), 0o20600, os.makedev(CAPS, extra))
        elif op == "rm" and os.path.lexists(self.caps(arg)):
            os.unlink(self.caps(arg))
        elif op == "remake":  # the trap: same name, another rdev (and likely the old inode number)
            if os.path.lexists(self.caps(arg)):
                os.unlink(self.caps(arg))
            os.mknod(self.caps(arg), 0o20600, os.makedev(CAPS, extra))
        elif op == "gpu":
            path = self.host.path(f"/dev/nvidia{arg}")
            if os.path.lexists(path):
                os.unlink(path)
            os.mknod(path, 0o20600, os.makedev(195, extra))
        elif op == "file":
            if os.path.lexists(self.caps(arg)):
                os.unlink(self.caps(arg))
            self.caps(arg).write_text("")
        elif op in ("unlink", "foreign", "wrong"):
            name = char / f"{CAPS}:{arg}"
            if os.path.lexists(name):
                os.unlink(name)
            if op == "foreign":
                os.symlink("../null", name)
            elif op == "wrong":
                os.symlink(f"../nvidia-caps/nvidia-cap{extra}", name)
        elif op == "overflow":
            self.devwatch.full = True  # what poll() records for IN_Q_OVERFLOW

    def settle(self) -> None:
        """What the daemon does: read the events, update (or a full pass), until a fixed point."""
        for _ in range(10):
            self.devwatch.poll()
            self.linkwatch.poll()
            nodes, full1 = self.devwatch.take()
            links, full2 = self.linkwatch.take()
            if full1 or full2:
                self.full()
                continue
            if not nodes and not links:
                return
            if self.state.update(nodes, links) is None:
                self.full()
        raise AssertionError("no fixed point after 10 rounds")

    def check(self) -> None:
        oracle = observe(self.root, "/", "/dev/char", with_driver_info=False)
        mine = self.state.snapshot()
        assert mine.nodes == oracle.nodes
        assert mine.ignored == oracle.ignored
        assert mine.entries == oracle.entries
        full = plan_sync(oracle)
        assert full.changes == []
        # the per-name decisions match the full pass's (a create or replace done is a keep now)
        have = {(a.link, a.device, "keep" if a.action in ("create", "replace") else a.action)
                for a in self.state.plan().actions if a.action != "remove"}
        want = {(a.link, a.device, a.action) for a in full.actions}
        assert have == want
        assert self.state.summary()["conflict"] == full.summary()["conflict"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops)
def test_incremental_equals_full_pass(example_base, steps):
    work = Path(tempfile.mkdtemp(dir=example_base))
    h = Harness(work)
    try:
        for batch in steps:
            for op in batch:
                h.do(*op)
            h.settle()
            h.check()
    finally:
        h.close()
        shutil.rmtree(work, ignore_errors=True)


def test_name_reuse_with_another_rdev_is_seen(example_base):
    """rm + mknod of the same name, another minor, read as one batch of events: the old link goes,
    the new one comes, without a full pass."""
    h = Harness(example_base)
    try:
        os.mknod(h.caps(1), 0o20600, os.makedev(CAPS, 1))
        h.settle()
        passes = h.full_passes
        os.unlink(h.caps(1))
        os.mknod(h.caps(1), 0o20600, os.makedev(CAPS, 2))
        h.settle()
        assert h.full_passes == passes
        assert h.host.links().get(f"{CAPS}:2") == "../nvidia-caps/nvidia-cap1"
        assert f"{CAPS}:1" not in h.host.links()
        h.check()
    finally:
        h.close()


def test_unknown_major_falls_back_to_a_full_pass(example_base):
    h = Harness(example_base)
    try:
        h.host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS, "nvidia-nvswitch": 240})
        h.host.node("/dev/nvidia-nvswitch0", 240, 0)
        passes = h.full_passes
        h.settle()
        assert h.full_passes == passes + 1
        assert h.host.links().get("240:0") == "../nvidia-nvswitch0"
        h.check()
    finally:
        h.close()
