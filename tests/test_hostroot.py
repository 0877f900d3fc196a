"""Root-confined path resolution: absolute and `..` link targets never leave the root."""

import os

from nvsymlinkd.hostroot import HostRoot, link_target, normalize, target_of


def test_paths_in_and_out(tmp_path):
    r = HostRoot(str(tmp_path))
    assert r.path("/proc/devices") == f"{tmp_path}/proc/devices"
    assert r.inside(f"{tmp_path}/dev/char") == "/dev/char"
    assert HostRoot("/").path("/dev") == "/dev"


def test_resolve_stays_inside_the_root(tmp_path):
    r = HostRoot(str(tmp_path))
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/real").write_text("x")
    os.symlink("/dev/real", tmp_path / "dev/abs")
    os.symlink("../../../../../../dev/real", tmp_path / "dev/climb")
    os.symlink("/etc/passwd", tmp_path / "dev/escape")  # exists on the real host, not in the root
    os.symlink("loop", tmp_path / "dev/loop")
    assert r.resolve("/dev/abs") == "/dev/real"
    assert r.resolve("/dev/climb") == "/dev/real"
    assert r.resolve("/dev/escape") is None
    assert r.resolve("/dev/loop") is None


def test_lexical_helpers():
    assert normalize("//dev/./char/") == "/dev/char"
    assert link_target("/dev/char/195:0", "/dev/nvidia0") == "../nvidia0"
    assert link_target("/dev/char/1:1", "/run/nvidia/driver/dev/nvidia0") == "../../run/nvidia/driver/dev/nvidia0"
    assert target_of("/dev/char/1:1", "../nvidia-caps/nvidia-cap1") == "/dev/nvidia-caps/nvidia-cap1"
    assert target_of("/dev/char/1:1", "/dev/x") == "/dev/x"
