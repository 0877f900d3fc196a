"""The sync pass's fused observe+plan (devchar.quick) against observe() + plan_sync() as the oracle.

Random host trees (driver root at / or under /run/nvidia/driver, a symlinked dev/ or /dev/char,
nodes sharing an rdev, stale and non-character nodes, and at each /dev/char name: nothing, the
exact link, an absolute link, another text for the same node, a link to another node, a dangling
NVIDIA link, a foreign link, a file, a directory, a dead sync's temporary) must give the same
HostSnapshot and the same Plan, and `nvsymlinkd sync` must leave the same tree either way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvsymlinkd.devchar.quick as quick
from nvsymlinkd.config import Config
from nvsymlinkd.devchar.apply import apply_plan
from nvsymlinkd.devchar.plan import plan_sync
from nvsymlinkd.devchar.quick import observe_and_plan
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.devchar.snapshot import observe
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import FakeHost

CAPS = 509
LINK_KINDS = ("none", "exact", "absolute", "dotted", "other-node", "dangling", "foreign", "file", "dir")

node_st = st.tuples(st.sampled_from(["gpu", "cap", "stale", "file"]), st.integers(0, 5), st.integers(0, 5))
entry_st = st.tuples(st.sampled_from(["nvidia", "caps", "other"]), st.integers(0, 5),
                     st.sampled_from(LINK_KINDS), st.integers(0, 5))
tree_st = st.fixed_dictionaries({
    "driver_root": st.sampled_from(["/", "/run/nvidia/driver"]),
    "dev_symlinked": st.booleans(),
    "dev_char": st.sampled_from(["dir", "missing", "file", "symlinked-dir"]),
    "nodes": st.lists(node_st, max_size=12),
    "entries": st.lists(entry_st, max_size=12),
    "temp": st.booleans(),
})


def make_tree(base: Path, tree: dict) -> tuple:
    host = FakeHost(base / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS})
    host.node("/dev/null", 1, 3)
    droot = tree["driver_root"]
    dev = "/dev" if droot == "/" else f"{droot}/dev"
    if tree["dev_symlinked"] and droot != "/":  # the driver container's dev/ is a link to a directory beside it
        host.path(f"{droot}/real-dev").mkdir(parents=True)
        os.symlink("real-dev", host.path(dev))
    host.path(dev).mkdir(parents=True, exist_ok=True)
    host.path(f"{dev}/nvidia-caps").mkdir(exist_ok=True)
    for kind, slot, minor in tree["nodes"]:
        path = f"{dev}/nvidia{slot}" if kind in ("gpu", "stale") else f"{dev}/nvidia-caps/nvidia-cap{slot}"
        if os.path.lexists(host.path(path)):
            continue
        if kind == "file":
            host.path(path).write_text("")
        else:
            host.node(path, {"gpu": 195, "cap": CAPS, "stale": 7}[kind], minor)
    if tree["dev_char"] == "file":
        host.path("/dev/char").write_text("")
    elif tree["dev_char"] == "symlinked-dir":
        host.path("/dev/char-real").mkdir()
        os.symlink("char-real", host.path("/dev/char"))
    elif tree["dev_char"] == "dir":
        host.path("/dev/char").mkdir()
    char = host.path("/dev/char")
    if char.is_dir():
        for major_kind, minor, kind, other in tree["entries"]:
            major = {"nvidia": 195, "caps": CAPS, "other": 1}[major_kind]
            name = char / f"{major}:{minor}"
            if kind == "none" or os.path.lexists(name):
                continue
            node = f"nvidia{minor}" if major == 195 else f"nvidia-caps/nvidia-cap{minor}"
            rel = os.path.relpath(host.path(dev), os.path.realpath(char))
            text = {"exact": f"{rel}/{node}", "absolute": f"{dev}/{node}", "dotted": f"{rel}/./{node}",
                    "other-node": f"{rel}/nvidia-caps/nvidia-cap{other}", "dangling": f"{rel}/nvidia-gone{other}",
                    "foreign": "../null"}.get(kind)
            if text is not None:
                os.symlink(text, name)
            elif kind == "file":
                name.write_text("")
            else:
                name.mkdir()
        if tree["temp"]:
            (char / ".nvsymlinkd-tmp-4194000-195:0").symlink_to("../nvidia0")
    return host, HostRoot(str(host.root)), droot


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=tree_st)
def test_quick_pass_equals_observe_and_plan(example_base, tree):
    work = Path(tempfile.mkdtemp(dir=example_base))
    try:
        host, root, droot = make_tree(work, tree)
        oracle = observe(root, droot, "/dev/char", with_driver_info=False)
        snap, plan = observe_and_plan(root, droot, "/dev/char")
        assert snap == oracle
        assert plan == plan_sync(oracle)
        # and the pass that applies it leaves what the planner's own pass leaves
        twin = Path(tempfile.mkdtemp(dir=work))
        host2, root2, _ = make_tree(twin, tree)  # the same tree again
        config = Config().with_overrides(driver_root=droot)
        reconcile(root, config)
        snap2 = observe(root2, droot, "/dev/char", with_driver_info=False)
        apply_plan(root2, plan_sync(snap2))
        assert host.links() == host2.links()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_exact_links_are_settled_without_the_planner(example_base, monkeypatch):
    """A no-op MIG pass: every link exact, and the planner's per-link decider is never asked."""
    host, root, _ = make_tree(example_base, {"driver_root": "/", "dev_symlinked": False, "dev_char": "dir",
                                     "nodes": [("cap", i, i) for i in range(6)], "entries": [], "temp": False})
    reconcile(root, Config())
    def refuse(*args):
        raise AssertionError("an exact link went to the planner")

    monkeypatch.setattr(quick, "link_action", refuse)
    snap, plan = observe_and_plan(root)
    assert [a.action for a in plan.actions] == ["keep"] * 6
    assert plan == plan_sync(observe(root, with_driver_info=False))
