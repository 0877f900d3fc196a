"""What the daemon keeps per link between passes (issue 38 item 3): one str object for a text or a path
that several records of the picture hold, whichever pass (full or incremental) put them there, and no
cache of every link's text. Checked as object identity and as the bytes the picture holds, not as RSS
(benchmarks/memory_bench.py prints the figures)."""

from __future__ import annotations

import os
import tracemalloc

from nvsymlinkd.config import Config
from nvsymlinkd.devchar.incremental import LinkState
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.host import paths
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import standard_host

CAPS = 509
COUNT = 40


def _host(tmp_path):
    host = standard_host(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS})
    caps = host.path("/dev/nvidia-caps")
    caps.mkdir()
    for i in range(COUNT):
        os.mknod(caps / f"nvidia-cap{i}", 0o20600, os.makedev(CAPS, i))
    host.path("/dev/char").mkdir()
    return host, caps


def _shared(state: LinkState, name: str) -> None:
    entry, action = state.entries[name], state.actions[name]
    (node,) = state.by_rdev[name]
    assert entry.link_text == action.target and entry.link_text is action.target, name
    assert entry.target == node.path and entry.target is node.path, name
    assert state.nodes[node.path] is node


def test_a_link_text_and_a_node_path_are_kept_once(tmp_path, need_root):
    host, caps = _host(tmp_path)
    root, config = HostRoot(str(host.root)), Config()
    state = LinkState(root, reconcile(root, config))  # the full pass creates every link
    names = [f"{CAPS}:{i}" for i in range(COUNT)]
    for name in names:
        _shared(state, name)
    # an incremental pass: a link removed by someone else and made again, a node made again
    os.unlink(host.path("/dev/char") / names[0])
    os.unlink(caps / "nvidia-cap1")
    os.mknod(caps / "nvidia-cap1", 0o20600, os.makedev(CAPS, 1))
    delta = state.update({"nvidia-caps/nvidia-cap1"}, {names[0]}, config.create_nodes)
    assert delta is not None and not delta.errors
    for name in names:
        _shared(state, name)


def test_reading_link_texts_keeps_nothing_per_text():
    # the daemon's full pass reads every link's text; before, each text stayed in a memo for good
    texts = [f"../nvidia-caps/nvidia-cap{i}" for i in range(2000)]
    paths.target_of("/dev/char/0:0", texts[0])  # the directory memo, shared by every text
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        got = [paths.target_of(f"/dev/char/{CAPS}:{i}", t) for i, t in enumerate(texts)]
        assert got[7] == "/dev/nvidia-caps/nvidia-cap7"
        del got
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2000 * 16, held  # was ~2000 * 150 (key, text and answer of each)


def test_one_access_object_per_set_of_letters():
    # every parsed rule of every container's spec and state held its own Access (~50 bytes each,
    # ~2.5 KB of what the daemon keeps per container)
    from nvsymlinkd.containers.ocispec import parse_state_rule
    from nvsymlinkd.host import devices
    from nvsymlinkd.host.devices import Access

    rules = [parse_state_rule({"allow": True, "type": 99, "major": 195, "minor": i, "permissions": "rwm"})
             for i in range(3)]
    assert rules[0].access is rules[1].access is rules[2].access == "rwm"
    assert Access("wr") is Access("rw") is Access(Access("rw")) == "rw"
    # what a container writes cannot grow the table: keyed by the canonical letters only
    for text in ("rrrrw", "wwr", "mmmm", "rwmrwm", "", "mr"):
        assert Access(text) is Access("".join(c for c in "rwm" if c in text))
    assert set(devices._ACCESS) <= {"", "r", "w", "m", "rw", "rm", "wm", "rwm"}
    for bad in ("x", "rwx", "R"):
        try:
            Access(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} taken")


def test_the_verifier_and_the_link_picture_share_the_node_paths(tmp_path, need_root):
    # the verify cache keeps the host's nodes between passes too: before, a second copy of every path
    from nvsymlinkd.devchar.snapshot import read_majors
    from nvsymlinkd.verify.cache import VerifyCache

    host, _ = _host(tmp_path)
    root, config = HostRoot(str(host.root)), Config()
    state = LinkState(root, reconcile(root, config))
    kept = VerifyCache().host_nodes(root, "/", read_majors(root))
    assert len(kept) == len(state.nodes) > COUNT
    for n in kept:
        assert n.path is state.nodes[n.path].path, n.path
