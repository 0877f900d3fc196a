"""systemd.dropin: nvsymlinkd's own drop-in for a container scope (issue 24), on a real directory tree."""

from __future__ import annotations

import os

import pytest

from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd import dropin, scopes

SCOPE = "docker-" + "ab" * 32 + ".scope"
INV = "0123456789abcdef" * 2  # a scope's InvocationID


def test_the_text_says_whose_and_lists_each_device_once_in_order():
    text = dropin.dropin_text("ab" * 32, INV, [(Device("c", 195, 255), Access("rw")), (Device("c", 195, 0), Access("rw")),
                                                 (Device("c", 510, 0), Access("rwm"))])
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == ["[Scope]", "DeviceAllow=/dev/char/195:0 rw", "DeviceAllow=/dev/char/195:255 rw",
                    "DeviceAllow=/dev/char/510:0 rwm"]
    assert "ab" * 32 in text


@pytest.mark.parametrize("name", ["../../etc/x.scope", "a/b.scope", "docker-1.service", "", ".scope", "..scope", "a\0.scope"])
def test_no_path_for_a_name_that_is_no_scope(name):
    with pytest.raises(ValueError):
        dropin.dropin_path(name)


def test_write_remove_and_stale(tmp_path):
    root = HostRoot(str(tmp_path))
    path = dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    assert path == f"/run/systemd/system/{SCOPE}.d/90-nvsymlinkd-keep.conf"
    real = tmp_path / path.lstrip("/")
    assert "DeviceAllow=/dev/char/195:0 rw" in real.read_text()
    assert oct(real.stat().st_mode & 0o777) == "0o644"
    assert [p for p in os.listdir(real.parent) if p.endswith(".tmp")] == []
    # its scope's transient unit file gone: stale
    assert dropin.stale_dropins(root) == [SCOPE]
    (tmp_path / "run/systemd/transient").mkdir(parents=True)
    (tmp_path / "run/systemd/transient" / SCOPE).write_text("[Scope]\n")
    assert dropin.stale_dropins(root) == []
    (tmp_path / "run/systemd/transient" / SCOPE).unlink()
    # another writer's file in the same directory stays, and so does the directory
    (real.parent / "10-admin.conf").write_text("[Scope]\n")
    assert dropin.remove(root, SCOPE) is True
    assert not real.exists() and (real.parent / "10-admin.conf").exists()
    assert dropin.remove(root, SCOPE) is False
    (real.parent / "10-admin.conf").unlink()
    dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    assert dropin.remove(root, SCOPE) is True and not real.parent.exists()
    # a directory of a unit that is no scope, or holding no drop-in of ours, is never ours to judge
    (tmp_path / "run/systemd/system/foo.service.d").mkdir()
    (tmp_path / f"run/systemd/system/{SCOPE}.d").mkdir()
    assert dropin.stale_dropins(root) == []


def test_a_symlinked_directory_is_never_written_through(tmp_path):
    """/run/systemd/system/<scope>.d as a link (to anywhere): the write does not follow it out of the root,
    and remove() never unlinks through it."""
    root = HostRoot(str(tmp_path))
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    os.symlink(str(outside), tmp_path / f"run/systemd/system/{SCOPE}.d")
    try:
        dropin.write(root, SCOPE, "x", INV, [(Device("c", 195, 0), Access("rw"))])
    except OSError:
        pass
    assert list(outside.iterdir()) == []
    (outside / dropin.NAME).write_text("not ours to remove")
    assert dropin.remove(root, SCOPE) is False
    assert (outside / dropin.NAME).exists()


def test_the_file_names_its_container_and_scope_invocation(tmp_path):
    """Issue 34 item 5: the first line says whose the drop-in is (a comment systemd ignores)."""
    root = HostRoot(str(tmp_path))
    dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    text = (tmp_path / dropin.dropin_path(SCOPE).lstrip("/")).read_text()
    assert text.splitlines()[0] == f"# nvsymlinkd-owner: container={'ab' * 32} invocation={INV}"
    assert dropin.owner(root, SCOPE) == ("ab" * 32, INV)
    with pytest.raises(ValueError):
        dropin.write(root, SCOPE, "ab" * 32, "a" * 31, [])
    with pytest.raises(ValueError):
        dropin.write(root, SCOPE, "a\nDeviceAllow=char-* rwm", INV, [])


def test_remove_stale_unless_the_invocation_is_the_scopes_own(tmp_path):
    """A new scope of the same name (another InvocationID) never keeps an earlier scope's drop-in."""
    root = HostRoot(str(tmp_path))
    dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    transient(tmp_path, after=1)  # a scope of the name made since: the ids still decide
    assert dropin.remove_stale(root, SCOPE, INV) is False
    assert dropin.owner(root, SCOPE) is not None
    assert dropin.remove_stale(root, SCOPE, "f" * 32) is True
    assert dropin.owner(root, SCOPE) is None
    assert dropin.remove_stale(root, SCOPE, INV) is False  # none there


def transient(tmp_path, after: float) -> None:
    """The scope's transient unit file, made `after` seconds after its drop-in of ours (negative: before)."""
    path = tmp_path / "run/systemd/transient" / SCOPE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[Scope]\n")
    t = (tmp_path / dropin.dropin_path(SCOPE).lstrip("/")).stat().st_mtime + after
    os.utime(path, (t, t))


@pytest.mark.parametrize("written, now, predates, stale", [
    (INV, INV, True, False),  # two known ids decide
    (INV, "f" * 32, False, True),
    (INV, None, False, False),  # systemd silent: the age decides
    (INV, None, True, True),
    ("-", INV, False, False),  # no id written (or no owner line): the age decides
    ("-", INV, True, True),
    ("-", None, True, True),
    ("-", None, False, False),
])
def test_is_stale(written, now, predates, stale):
    """Issue 34 item 5 review: an unknown id on either side never decides by itself."""
    assert dropin.is_stale(written, now, predates) is stale


def legacy(tmp_path, first_line: str | None) -> None:
    d = tmp_path / f"run/systemd/system/{SCOPE}.d"
    d.mkdir(parents=True, exist_ok=True)
    head = f"{first_line}\n" if first_line else ""
    (d / dropin.NAME).write_text(f"{head}[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")


@pytest.mark.parametrize("first_line", [f"# nvsymlinkd-owner: container={'ab' * 32} invocation=-", None])
def test_a_drop_in_naming_no_invocation_goes_by_age(tmp_path, first_line):
    """Issue 34 item 5 review: one written with `invocation=-`, or with no owner line, by an earlier version
    stays while it is newer than the scope's transient unit file (its own scope), whatever the scope's
    InvocationID; it goes once it is older (a scope of the name made since) or that file is missing."""
    root = HostRoot(str(tmp_path))
    legacy(tmp_path, first_line)
    transient(tmp_path, after=-5)  # the drop-in written 5 s after its scope was made: its own
    assert dropin.predates_scope(root, SCOPE) is False
    assert dropin.remove_stale(root, SCOPE, INV) is False
    assert dropin.remove_stale(root, SCOPE, None) is False
    transient(tmp_path, after=5)  # a scope of the name made since
    assert dropin.predates_scope(root, SCOPE) is True
    assert dropin.remove_stale(root, SCOPE, INV) is True
    legacy(tmp_path, first_line)
    (tmp_path / "run/systemd/transient" / SCOPE).unlink()
    assert dropin.predates_scope(root, SCOPE) is True
    assert dropin.remove_stale(root, SCOPE, None) is True


def test_a_symlinked_directory_inside_the_root_is_never_followed(tmp_path):
    """Issue 39 item 6: <scope>.d as a link to another unit's drop-in directory (inside the root, where a
    confined lookup would follow it): nothing is written there, read from there or removed there."""
    root = HostRoot(str(tmp_path))
    other = tmp_path / "etc/systemd/system/ssh.service.d"
    other.mkdir(parents=True)
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    os.symlink("/etc/systemd/system/ssh.service.d", tmp_path / f"run/systemd/system/{SCOPE}.d")
    with pytest.raises(scopes.UnsafeDirectory):
        dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    assert list(other.iterdir()) == []
    (other / dropin.NAME).write_text(f"# nvsymlinkd-owner: container={'ab' * 32} invocation={INV}\n")
    assert dropin.owner(root, SCOPE) is None
    assert dropin.remove(root, SCOPE) is False
    assert (other / dropin.NAME).exists()


@pytest.mark.parametrize("where", ["run", "run/systemd", "run/systemd/system", "scope.d"])
def test_a_directory_on_the_way_that_is_not_roots_alone_is_refused(tmp_path, where, need_root):
    root = HostRoot(str(tmp_path))
    (tmp_path / f"run/systemd/system/{SCOPE}.d").mkdir(parents=True)
    d = tmp_path / (f"run/systemd/system/{SCOPE}.d" if where == "scope.d" else where)
    os.chown(d, 1000, 1000)
    with pytest.raises(scopes.UnsafeDirectory):
        dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    os.chown(d, 0, 0)
    os.chmod(d, 0o777)
    with pytest.raises(scopes.UnsafeDirectory):
        dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    os.chmod(d, 0o775)  # group-writable: not root's alone either (issue 34 review)
    with pytest.raises(scopes.UnsafeDirectory):
        dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    os.chmod(d, 0o755)
    dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])


def watch_of(tmp_path):
    from nvsymlinkd.config import Config
    from nvsymlinkd.daemon.containerwatch import ContainerWatch
    from tests.test_hostile_input import RecordingJournal

    journal = RecordingJournal()
    return ContainerWatch(journal, HostRoot(str(tmp_path)), lambda: Config(), use_bus=False), journal


@pytest.mark.parametrize("first_line", [f"# nvsymlinkd-owner: container={'ab' * 32} invocation=-", None])
def test_the_full_pass_removes_a_drop_in_naming_no_invocation_once_older_than_its_scope(tmp_path, first_line):
    """Issue 34 item 5 review: the full pass kept `invocation=-` and ownerless drop-ins for ever, so a runc
    container id reused while the daemon was down inherited the earlier container's grant at the next reload."""
    watch, _ = watch_of(tmp_path)
    legacy(tmp_path, first_line)
    transient(tmp_path, after=-5)  # its own scope's
    watch._remove_stale_dropins()
    assert dropin.owner(watch.root, SCOPE) is not None
    transient(tmp_path, after=5)  # the name reused since
    watch._remove_stale_dropins()
    assert dropin.owner(watch.root, SCOPE) is None


def test_a_new_scope_keeps_its_drop_in_when_systemd_does_not_say_its_invocation(tmp_path):
    """Issue 34 item 5 review: after a daemon restart every scope's first UnitNew looks new; systemd answering
    nothing then (a reload) removed the scope's own valid drop-in. Unknown now: the age decides."""
    watch, journal = watch_of(tmp_path)
    dropin.write(watch.root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    transient(tmp_path, after=-5)
    assert watch.clear_inherited(SCOPE, new=True) is False
    assert dropin.owner(watch.root, SCOPE) == ("ab" * 32, INV)
    transient(tmp_path, after=5)  # an earlier scope's drop-in
    assert watch.clear_inherited(SCOPE, new=True) is True
    assert dropin.owner(watch.root, SCOPE) is None
    assert "older than the scope's transient unit file" in journal.lines[-1]


def test_a_new_scope_asks_systemd_again_once_its_reload_is_over(tmp_path, monkeypatch):
    """Issue 34 item 5 review: a new scope's InvocationID unreadable during a reload is read again after it."""
    import threading
    import time

    from nvsymlinkd.systemd import scopes

    watch, _ = watch_of(tmp_path)
    dropin.write(watch.root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    transient(tmp_path, after=5)  # by age alone it would go: the InvocationID read after the reload keeps it
    asked = []

    def invocation(root, scope, use_bus=None):
        asked.append(watch._not_reloading.is_set())
        return INV if watch._not_reloading.is_set() else None  # systemd answers no call while it reloads

    monkeypatch.setattr(scopes, "scope_invocation", invocation)
    watch.systemd_reloading(True)
    threading.Timer(0.2, watch.systemd_reloading, (False,)).start()
    start = time.monotonic()
    assert watch.clear_inherited(SCOPE, new=True) is False
    assert time.monotonic() - start >= 0.15
    assert asked == [False, True]
    assert dropin.owner(watch.root, SCOPE) == ("ab" * 32, INV)
