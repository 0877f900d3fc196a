"""Root-confined path resolution: absolute and `..` link targets never leave the root."""

import os
import stat

import pytest

from nvsymlinkd.host import libc
from nvsymlinkd.host import root as root_module
from nvsymlinkd.host.paths import link_target, normalize, target_of
from nvsymlinkd.host.root import HostRoot


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


def confined_tree(tmp_path):
    """A root full of links that leave it, and a decoy tree beside it."""
    root = tmp_path / "root"
    out = tmp_path / "outside"
    for d in ("root/real/dev/char", "root/outside/dev", f"root{tmp_path}/outside/dev", "outside/dev/char"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    (root / "real/dev/file").write_text("x")
    links = {
        "abs": f"{out}/dev", "rel": "../outside/dev", "climb": "../../../../../../real/dev",
        "hop": "abs2", "abs2": "/real/dev", "dotdot": "real/dev/char/../..", "file": "real/dev/file",
        "dangling": f"{out}/missing", "loop": "loop", "magic": "/proc/self/root/etc",
    }
    for name, text in links.items():
        os.symlink(text, root / name)
    return HostRoot(str(root))


PROBES = ["/file", "/abs2/file", "/abs", "/rel", "/climb", "/hop", "/hop/char", "/dotdot", "/abs/../../..", "/rel/./../dev",
          "/file", "/dangling", "/loop", "/magic", "/", "/real/dev/char", "/nope"]


@pytest.mark.parametrize("walk", [False, True], ids=["openat2", "walk"])
def test_open_dir_agrees_with_resolve(tmp_path, monkeypatch, walk):
    """The kernel-confined fd names the directory HostRoot.resolve names, or fails where it gives None."""
    r = confined_tree(tmp_path)
    if walk:
        monkeypatch.setattr(libc, "_openat2_missing", True)
    else:
        try:
            os.close(libc.openat2(os.open("/", os.O_RDONLY), ".", os.O_RDONLY | os.O_DIRECTORY, 0))
        except OSError as exc:
            pytest.skip(f"no openat2 here: {exc}")
    for probe in PROBES:
        resolved = r.resolve(probe)
        want = os.lstat(r.path(resolved)) if resolved is not None else None
        got = r.stat_resolved(probe)  # any type, links followed confined
        assert (got.st_dev, got.st_ino) == (want.st_dev, want.st_ino) if want else got is None, probe
        if want is not None and not stat.S_ISDIR(want.st_mode):
            want = None
        try:
            fd = r.open_dir(probe)
        except OSError:
            assert want is None, probe
            continue
        try:
            got = os.fstat(fd)
        finally:
            os.close(fd)
        assert want is not None and (got.st_dev, got.st_ino) == (want.st_dev, want.st_ino), probe


@pytest.mark.parametrize("walk", [False, True], ids=["openat2", "walk"])
def test_make_dirs_creates_inside_and_never_through_a_dangling_link(tmp_path, monkeypatch, walk):
    r = confined_tree(tmp_path)
    if walk:
        monkeypatch.setattr(libc, "_openat2_missing", True)
    os.close(r.make_dirs("/abs/char/deeper"))
    assert os.path.isdir(r.path(f"{tmp_path}/outside/dev/char/deeper"))
    assert not os.path.exists(tmp_path / "outside/dev/char/deeper")
    with pytest.raises(NotADirectoryError, match="symlink to a missing directory"):
        r.make_dirs("/dangling/char")
    assert not os.path.exists(r.path(f"{tmp_path}/outside/missing"))
    assert r.read_confined("/abs2/file") == "x"


def test_resolve_prefix_appends_what_is_missing(tmp_path):
    r = confined_tree(tmp_path)
    assert r.resolve_prefix("/abs/char/x") == f"{tmp_path}/outside/dev/char/x"
    assert r.resolve_prefix("/rel") == "/outside/dev"
    assert r.resolve_prefix("/nope/a") == "/nope/a"


def test_resolve_of_a_path_without_links_is_one_kernel_walk(tmp_path, monkeypatch):
    """A link-free path is resolved by one openat2(RESOLVE_NO_SYMLINKS), not an lstat per component (the
    daemon's verify pass under --root resolved ~3,500 paths of 6-8 components per 1,000 containers):
    the answers stay those of the walk by hand, links, missing and non-directory components included."""
    r = confined_tree(tmp_path)
    (tmp_path / "root/real/dev/char/a/b/c").mkdir(parents=True)
    try:
        os.close(libc.openat2(-100, "/", os.O_PATH, libc.RESOLVE_NO_SYMLINKS))
    except OSError as exc:
        pytest.skip(f"no openat2 here: {exc}")
    probes = PROBES + ["/real/dev/char/a/b/c", "/real/dev/file/x", "/real/dev/../dev/char", "/hop/char/a/b",
                       "/real/nope/a/b", "/nope/x/y", "/real/dev/file/x/y", "/abs/nope/x", "/dangling/x"]
    fast = {p: r.resolve(p) for p in probes}
    fast_prefix = {p: r.resolve_prefix(p + "/missing/x") for p in probes}
    calls = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda *a, **k: calls.append(a[0]) or real_lstat(*a, **k))
    assert r.resolve("/real/dev/char/a/b/c") == "/real/dev/char/a/b/c"
    assert r.real_resolved("/real/dev/char/a/b/c/config.json") == f"{r.root}/real/dev/char/a/b/c/config.json"
    assert r.resolve_prefix("/real/nope/a/b") == "/real/nope/a/b"
    assert calls == [r.path("/real"), r.path("/real/nope")]  # not a walk from the top per missing level
    monkeypatch.setattr(libc, "_openat2_missing", True)  # the walk by hand: the answers before the fast path
    monkeypatch.setattr(root_module, "no_links_before_missing", lambda real_root, inside: False)
    assert fast == {p: r.resolve(p) for p in probes}
    assert fast_prefix == {p: r.resolve_prefix(p + "/missing/x") for p in probes}
