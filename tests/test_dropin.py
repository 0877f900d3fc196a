"""systemd.dropin: nvsymlinkd's own drop-in for a container scope (issue 24), on a real directory tree."""

import os

import pytest

from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd import dropin

SCOPE = "docker-" + "ab" * 32 + ".scope"


def test_the_text_says_whose_and_lists_each_device_once_in_order():
    text = dropin.dropin_text("ab" * 32, [(Device("c", 195, 255), Access("rw")), (Device("c", 195, 0), Access("rw")),
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
    path = dropin.write(root, SCOPE, "ab" * 32, [(Device("c", 195, 0), Access("rw"))])
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
    dropin.write(root, SCOPE, "ab" * 32, [(Device("c", 195, 0), Access("rw"))])
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
        dropin.write(root, SCOPE, "x", [(Device("c", 195, 0), Access("rw"))])
    except OSError:
        pass
    assert list(outside.iterdir()) == []
    (outside / dropin.NAME).write_text("not ours to remove")
    assert dropin.remove(root, SCOPE) is False
    assert (outside / dropin.NAME).exists()
