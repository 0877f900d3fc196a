"""systemd.dropin: nvsymlinkd's own drop-in for a container scope (issue 24), on a real directory tree."""

import os

import pytest

from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd import dropin

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
    dropin.write(root, SCOPE, "ab" * 32, None, [(Device("c", 195, 0), Access("rw"))])  # unknown: "-"
    assert dropin.owner(root, SCOPE) == ("ab" * 32, "-")
    with pytest.raises(ValueError):
        dropin.write(root, SCOPE, "a\nDeviceAllow=char-* rwm", INV, [])


def test_remove_unless_the_invocation_is_the_scopes_own(tmp_path):
    """A new scope of the same name (another InvocationID) never keeps an earlier scope's drop-in."""
    root = HostRoot(str(tmp_path))
    dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    assert dropin.remove(root, SCOPE, unless_invocation=INV) is False
    assert dropin.owner(root, SCOPE) is not None
    assert dropin.remove(root, SCOPE, unless_invocation="f" * 32) is True
    assert dropin.owner(root, SCOPE) is None
    # one written before owners were named is no scope's: removed at any new scope
    d = tmp_path / f"run/systemd/system/{SCOPE}.d"
    d.mkdir()
    (d / dropin.NAME).write_text("[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")
    assert dropin.owner(root, SCOPE) == ("", "-")
    assert dropin.remove(root, SCOPE, unless_invocation=INV) is True


def test_a_symlinked_directory_inside_the_root_is_never_followed(tmp_path):
    """Issue 39 item 6: <scope>.d as a link to another unit's drop-in directory (inside the root, where a
    confined lookup would follow it): nothing is written there, read from there or removed there."""
    root = HostRoot(str(tmp_path))
    other = tmp_path / "etc/systemd/system/ssh.service.d"
    other.mkdir(parents=True)
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    os.symlink("/etc/systemd/system/ssh.service.d", tmp_path / f"run/systemd/system/{SCOPE}.d")
    with pytest.raises(dropin.UnsafeDirectory):
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
    with pytest.raises(dropin.UnsafeDirectory):
        dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    os.chown(d, 0, 0)
    os.chmod(d, 0o777)
    with pytest.raises(dropin.UnsafeDirectory):
        dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
    os.chmod(d, 0o755)
    dropin.write(root, SCOPE, "ab" * 32, INV, [(Device("c", 195, 0), Access("rw"))])
