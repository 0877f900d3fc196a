"""The daemon's full pass lists a directory again only when it may have changed (host/listings.py), and
what changed in a kept directory is still found by the next pass: a link replaced, a node re-made with
another minor, a tmpfs mounted on a subdirectory, a change whose directory times were put back (what a
change in the same tick as the listing looks like). The oracle is the pass that reads everything.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.daemon.passes import LinkPasses
from nvsymlinkd.daemon.reasons import Reason, asked
from nvsymlinkd.daemon.sources import Pending
from nvsymlinkd.devchar.quick import observe_and_plan
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.host.listings import GRANULARITY_NS, Listings, fresh
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import CAPS_MAJOR, FakeHost, standard_host

DIRS = ("/dev", "/dev/nvidia-caps", "/dev/char")
OLD = 1_000_000_000  # seconds since the epoch: long before any listing


def _host(tmp_path) -> FakeHost:
    host = standard_host(tmp_path / "root").with_caps_major()
    for minor in range(1, 21):
        host.node(f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor)
    return host


def _age(host: FakeHost) -> None:
    """The directories' mtimes far before any listing (a host whose /dev settled at boot)."""
    for d in DIRS:
        os.utime(host.path(d), (OLD, OLD))


def _fresh_read(root: HostRoot):
    return observe_and_plan(root)


def _same(root: HostRoot, listings: Listings) -> None:
    """A pass through `listings` sees what a pass that reads everything sees."""
    assert observe_and_plan(root, listings=listings) == _fresh_read(root)


@pytest.fixture
def synced(need_root, tmp_path):
    host = _host(tmp_path)
    root = HostRoot(str(host.root))
    listings = Listings()
    reconcile(root, Config(), listings=listings)  # the first pass: reads all, creates the links
    _age(host)
    reconcile(root, Config(), listings=listings)  # lists again (changed by the first); kept from now on
    return host, root, listings


def test_an_unchanged_host_is_not_read_again(synced, monkeypatch):
    host, root, listings = synced
    calls = {"scandir": 0, "readlink": 0, "stat": 0}

    def counting(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(os, "scandir", counting("scandir", os.scandir))
    monkeypatch.setattr(os, "readlink", counting("readlink", os.readlink))
    monkeypatch.setattr(os, "stat", counting("stat", os.stat))
    listed, reused = listings.listed, listings.reused
    result = reconcile(root, Config(), listings=listings)
    assert (listings.listed - listed, listings.reused - reused) == (0, 3)
    assert calls == {"scandir": 0, "readlink": 0, "stat": 0}
    assert not result.plan.changes and len(host.links()) == 26
    monkeypatch.undo()
    _same(root, listings)


def test_sync_and_a_fresh_listings_read_everything(need_root, tmp_path):
    host = _host(tmp_path)
    root = HostRoot(str(host.root))
    reconcile(root, Config())
    _age(host)
    listings = Listings()
    reconcile(root, Config(), listings=listings)
    assert (listings.listed, listings.reused) == (3, 0)


def _put_back(host: FakeHost, d: str) -> None:
    os.utime(host.path(d), (OLD, OLD))  # the mtime as kept; the kernel sets ctime to now


def test_a_replaced_link_is_found(synced):
    host, root, listings = synced
    tmp = host.path("/dev/char/.swap")
    os.symlink("../nvidia-uvm", tmp)
    os.rename(tmp, host.path("/dev/char/195:0"))
    _put_back(host, "/dev/char")
    snap, plan = observe_and_plan(root, listings=listings)
    assert snap.entries["195:0"].link_text == "../nvidia-uvm"
    assert [a.link for a in plan.changes] == ["/dev/char/195:0"]
    _same(root, listings)
    reconcile(root, Config(), listings=listings)
    assert os.readlink(host.path("/dev/char/195:0")) == "../nvidia0"


def test_a_node_made_again_with_another_minor_is_found(synced):
    host, root, listings = synced
    os.unlink(host.path("/dev/nvidia-caps/nvidia-cap5"))
    host.node("/dev/nvidia-caps/nvidia-cap5", CAPS_MAJOR, 99)
    _put_back(host, "/dev/nvidia-caps")
    snap, _ = observe_and_plan(root, listings=listings)
    assert ("/dev/nvidia-caps/nvidia-cap5", "cap", CAPS_MAJOR, 99) in snap.nodes
    _same(root, listings)
    reconcile(root, Config(), listings=listings)
    links = host.links()
    assert links[f"{CAPS_MAJOR}:99"] == "../nvidia-caps/nvidia-cap5" and f"{CAPS_MAJOR}:5" not in links


def test_a_tmpfs_mounted_on_a_subdirectory_is_found(synced):
    host, root, listings = synced
    caps = host.path("/dev/nvidia-caps")
    subprocess.run(["mount", "-t", "tmpfs", "nvsymlinkd-speed4-listings", str(caps)], check=True)
    try:
        host.node("/dev/nvidia-caps/nvidia-cap77", CAPS_MAJOR, 77)
        os.utime(caps, (OLD, OLD))
        snap, _ = observe_and_plan(root, listings=listings)
        assert [n.path for n in snap.nodes if n.kind == "cap"] == ["/dev/nvidia-caps/nvidia-cap77"]
        _same(root, listings)
    finally:
        subprocess.run(["umount", str(caps)], check=True)


def test_a_change_right_after_a_listing_is_found(need_root, tmp_path):
    """A directory changed within the timestamp granularity before it was listed is listed again next
    time even where its stat compares equal (here: its mtime put back as a change in the same tick
    leaves it); kept only from a listing that began long enough after its last change."""
    host = _host(tmp_path)
    root = HostRoot(str(host.root))
    listings = Listings()
    reconcile(root, Config(), listings=listings)
    reconcile(root, Config(), listings=listings)  # the directories changed a moment ago: racy, read again
    assert listings.reused == 0
    os.unlink(host.path("/dev/nvidia-caps/nvidia-cap7"))
    _same(root, listings)


@pytest.mark.parametrize(("kept", "started", "now", "answer"), [
    ((1, 2, 100, 100), 100 + GRANULARITY_NS + 1, (1, 2, 100, 100), True),  # unchanged, listed well after
    ((1, 2, 100, 100), 100 + GRANULARITY_NS, (1, 2, 100, 100), False),  # same tick: racy
    ((1, 2, 100, 100), 150, (1, 2, 100, 100), False),  # listed right after a change: racy
    ((1, 2, 100, 100), 10**12, (1, 2, 200, 200), False),  # changed
    ((1, 2, 100, 100), 10**12, (1, 2, 100, 300), False),  # times set back by hand: the ctime still moved
    ((1, 2, 100, 100), 10**12, (1, 3, 100, 100), False),  # replaced (another inode)
    ((1, 2, 100, 100), 10**12, (9, 2, 100, 100), False),  # mounted on (another filesystem)
])
def test_fresh_is_the_racy_rule(kept, started, now, answer):
    assert fresh(kept, started, now) is answer



def test_the_daemon_reads_again_after_an_overflow_a_config_reload_or_a_mount(synced):
    """The daemon's full passes keep their listings (LinkPasses.listings); a request that may have lost
    events or changed what a directory's stat vouches for drops them."""
    _, root, _ = synced
    passes = LinkPasses(root)

    async def full_pass(reason: Reason) -> None:
        requests = asked(reason)
        picture = await passes.run(asyncio.get_running_loop(), Config(), requests, Pending(requests))
        assert picture.full

    def listed_reused(reason: Reason) -> tuple:
        listed, reused = passes.listings.listed, passes.listings.reused
        asyncio.run(full_pass(reason))
        return passes.listings.listed - listed, passes.listings.reused - reused

    assert listed_reused(Reason.STARTUP) == (3, 0)
    assert listed_reused(Reason.PERIODIC) == (0, 3)
    assert listed_reused(Reason.RELOADED) == (0, 3)
    for reason in (Reason.INOTIFY_OVERFLOW, Reason.UDEV_OVERFLOW, Reason.CONFIG, Reason.MOUNTS):
        assert listed_reused(reason) == (3, 0), reason
