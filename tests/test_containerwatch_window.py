"""The daemon's second read of a new loss, by hierarchy (daemon/containerwatch.py, _confirmed).

cgroup v1: systemd's re-apply denies everything for a moment, so a loss read while systemd reloads is
read again after the reload before it is said or repaired. cgroup v2: systemd attaches a unit's new
device program before it detaches the old one, so a loss read there is real: said (and repaired) by
the pass that read it, even while systemd is still reloading. Seed 38 of the chaos soak: waiting for
reloads that came back to back kept a containerd container without its GPUs for ~4 s.

Real parts: a BPF_CGROUP_DEVICE program attached to a cgroup2 directory (the kernel's program ids and
instructions, read by the verifier) and a real v1 device cgroup; the container's runtime files in a
fake host tree (tests/fixtures/runtimes).
"""

from __future__ import annotations

import os

from nvsymlinkd.config import Config
from nvsymlinkd.daemon import containerwatch
from nvsymlinkd.daemon.containerwatch import ContainerWatch
from nvsymlinkd.host.devices import Rule
from tests.conftest import v1_cgroup
from tests.fixtures.runtimes.layouts import Layouts
from tests.test_hostile_input import RecordingJournal
from tests.test_verify_cache import GPU_SPEC, Program, two_gpu_host

HELD_BACK = "new findings while systemd reloads"


def _watch(root) -> tuple:
    journal = RecordingJournal()
    watch = ContainerWatch(journal, root, lambda: Config().with_overrides(repair="off"), use_bus=False)
    watch.settle = 0.0
    watch.systemd_reloading(True)  # Reloading(true) seen, Reloading(false) not yet
    return watch, journal


def _lost_said(journal) -> list:
    return [(f["container_id"], m) for k, m, f in journal.events if k == "container-lost"]


def test_a_v2_loss_read_during_a_reload_is_said_at_once(fakehost, v2, monkeypatch):  # noqa: F811
    monkeypatch.setattr(containerwatch, "RELOAD_WAIT", 0.2)  # the old code's wait, short
    root = two_gpu_host(fakehost)
    cgroup = v2.make("lost")
    pid = Layouts(fakehost).containerd("v2lost", GPU_SPEC, cgroup=cgroup)
    fakehost.write(f"/proc/{pid}/cgroup", Layouts.v2_cgroup(cgroup))  # v2 only: the program decides
    prog = Program(v2.real(cgroup), [Rule(True, "c", 195, 255, "rw")])  # the spec's c 195:0 taken
    try:
        watch, journal = _watch(root)
        report = watch.verify_and_repair("test")
    finally:
        prog.close()
    assert {c.id: c.verdict for c in report.containers} == {"v2lost": "lost"}
    assert not any(HELD_BACK in line for line in journal.lines), journal.lines
    (said,) = _lost_said(journal)
    assert said[0] == "v2lost" and "GPU device access lost: c 195:0" in said[1]


def test_a_v1_loss_read_during_a_reload_is_judged_after_it(fakehost, v1_parent, monkeypatch):
    monkeypatch.setattr(containerwatch, "RELOAD_WAIT", 0.2)
    root = two_gpu_host(fakehost)
    pid = Layouts(fakehost).containerd("v1lost", GPU_SPEC,
                                       cgroup=v1_cgroup(v1_parent, "v1lost", ["c 195:255 rw"]))
    assert os.path.exists(fakehost.path(f"/proc/{pid}/cgroup"))
    watch, journal = _watch(root)
    report = watch.verify_and_repair("test")
    assert {c.id: c.verdict for c in report.containers} == {"v1lost": "lost"}
    # read again after the reload (here: after RELOAD_WAIT), then said: a real loss persists
    assert any(HELD_BACK in line for line in journal.lines), journal.lines
    assert [cid for cid, _ in _lost_said(journal)] == ["v1lost"]


def test_a_reason_that_comes_while_a_burst_waits_gets_every_container_verified():
    """Runtime state events alone ask for the containers they name; anything else that joins the same
    pass (here a periodic resync arriving while a burst's pass waits out its duty cycle) asks for all."""
    import asyncio

    passes = []

    class Watch(ContainerWatch):
        def verify_and_repair(self, why, only=None):
            passes.append((why, only))

    async def scenario():
        watch = Watch(RecordingJournal(), None, Config)
        await watch.runtime_state_written(["/run/runc/a"])
        while len(passes) < 1:
            await asyncio.sleep(0.01)
        watch._last_seconds = 0.3  # as if that pass took 0.3 s: the next runtime-only one waits as long
        await watch.runtime_state_written(["/run/runc/b"])
        await asyncio.sleep(0.05)
        await watch.periodic()  # while the second pass waits
        while len(passes) < 2:
            await asyncio.sleep(0.01)
        await watch.runtime_state_written(["/run/containerd/runc/k8s.io/c", "(overflow)"])
        while len(passes) < 3:
            await asyncio.sleep(0.01)
        watch.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert passes[0] == ("runtime state written: a", frozenset({"a"}))
    assert passes[1] == ("periodic resync, runtime state written: b", None)
    assert passes[2][1] is None  # an overflow names no container: all are verified
