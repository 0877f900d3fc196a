"""host.rpmdb and the toolkit's version from an rpm database (issue 34 note, item 1): real rpms built with
rpmbuild, installed with `rpm --root TREE --dbpath /var/lib/rpm -i --nodeps --justdb` into a scratch
rpmdb.sqlite (rpm's sqlite backend), read back without rpm. Before, only dpkg's status and the binary's build
info were read: a RHEL/Rocky 9 host's hook without build info had no version (not trusted)."""

from __future__ import annotations

import sqlite3
import struct
import subprocess
from pathlib import Path

import pytest

from nvsymlinkd.containers.hookhost import read_toolkit_version
from nvsymlinkd.host import rpmdb
from nvsymlinkd.host.root import HostRoot
from tests.conftest import need_tool
from tests.test_hookgrant_upstream import DRIVER_CFG, HOOK_PATH, REFUSE, UNTRUSTED, elf, on_host

SPEC = """Name: {name}
Version: {version}
Release: {release}
Summary: a stand-in of NVIDIA's package (hook2)
License: none
BuildArch: noarch
%description
stand-in
%install
mkdir -p %{{buildroot}}/usr/bin
printf x > %{{buildroot}}{path}
%files
{path}
"""


@pytest.fixture(scope="module")
def rpms(tmp_path_factory):
    """{(name, version): path of a built .rpm listing the hook binary}."""
    rpmbuild = need_tool("rpmbuild")
    need_tool("rpm")
    work = tmp_path_factory.mktemp("hook2-rpms")
    out = {}
    for name, version in (("nvidia-container-toolkit", "1.17.8"), ("nvidia-container-toolkit-base", "1.18.0"),
                          ("nvidia-container-toolkit", "1.17.0~rc.1"), ("other-package", "1.18.0")):
        spec = work / f"{name}-{version}.spec"
        spec.write_text(SPEC.format(name=name, version=version, release="1", path=HOOK_PATH))
        subprocess.run([rpmbuild, "-bb", "--define", f"_topdir {work / 'top'}", "--define", "_build_id_links none",
                        str(spec)], check=True, capture_output=True, timeout=120)
        (built,) = (work / "top" / "RPMS" / "noarch").glob(f"{name}-{version}-1.noarch.rpm")
        out[(name, version)] = built
    return out


def install(tree: Path, *packages: Path, replace=False) -> None:
    """Into the tree's database only (--justdb): the hook file itself is the test's to write."""
    (tree / HOOK_PATH.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    argv = ["rpm", "--root", str(tree), "--dbpath", "/var/lib/rpm", "-i", "--nodeps", "--justdb"]
    subprocess.run(argv + (["--replacefiles"] if replace else []) + [str(p) for p in packages], check=True,
                   capture_output=True, timeout=60)
    assert (tree / "var/lib/rpm/rpmdb.sqlite").stat().st_size > 0


def test_the_version_of_the_rpm_that_lists_the_hook(rpms, tmp_path):
    install(tmp_path, rpms[("nvidia-container-toolkit", "1.17.8")])
    (tmp_path / HOOK_PATH.lstrip("/")).write_bytes(elf())  # no build info: only the database knows
    root = HostRoot(str(tmp_path))
    assert read_toolkit_version(root, HOOK_PATH) == \
        ((1, 17, 8), "/var/lib/rpm/rpmdb.sqlite: nvidia-container-toolkit 1.17.8-1")
    assert rpmdb.owners(root, "/usr/bin/nvidia-ctk", ("nvidia-container-toolkit",)) == ([], rpmdb.RPMDB_SQLITE)


def test_the_reads_are_capped(rpms, tmp_path, monkeypatch):
    install(tmp_path, rpms[("nvidia-container-toolkit", "1.17.8")])
    root = HostRoot(str(tmp_path))
    for cap in ("MAX_BLOB_BYTES", "MAX_DB_BYTES"):
        with monkeypatch.context() as m:
            m.setattr(rpmdb, cap, 100)
            owned, why = rpmdb.owners(root, HOOK_PATH, ("nvidia-container-toolkit",))
            assert owned is None and "bytes" in why, why
    with monkeypatch.context() as m:
        m.setattr(rpmdb, "MAX_PACKAGES", 0)
        assert rpmdb.owners(root, HOOK_PATH, ("nvidia-container-toolkit",))[0] is None


def test_the_grant_follows_the_rpm_version(rpms, tmp_path):
    """1.17.8 reads the driver-root config first; that config refuses the unprivileged env request: nothing.
    Without a version (the tree before) 1.17 and 1.18 read different files: not trusted."""
    install(tmp_path / "rpm", rpms[("nvidia-container-toolkit", "1.17.8")])
    assert on_host(tmp_path / "rpm", {HOOK_PATH: elf(), DRIVER_CFG: REFUSE}) == set()
    assert on_host(tmp_path / "none", {HOOK_PATH: elf(), DRIVER_CFG: REFUSE}) == UNTRUSTED


def test_what_the_database_cannot_say_exactly(rpms, tmp_path):
    hook = elf()
    # a pre-release is not the release it precedes
    install(tmp_path / "rc", rpms[("nvidia-container-toolkit", "1.17.0~rc.1")])
    (tmp_path / "rc" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = read_toolkit_version(HostRoot(str(tmp_path / "rc")), HOOK_PATH)
    assert version is None and "1.17.0~rc.1-1 is not a release version" in why
    # two installed packages list it with two versions; a package of another name listing it is not the toolkit
    install(tmp_path / "two", rpms[("nvidia-container-toolkit", "1.17.8")])
    install(tmp_path / "two", rpms[("other-package", "1.18.0")], replace=True)
    assert rpmdb.owners(HostRoot(str(tmp_path / "two")), HOOK_PATH, ("nvidia-container-toolkit",))[0] == \
        [("nvidia-container-toolkit", "1.17.8", "1")]
    install(tmp_path / "two", rpms[("nvidia-container-toolkit-base", "1.18.0")], replace=True)
    (tmp_path / "two" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = read_toolkit_version(HostRoot(str(tmp_path / "two")), HOOK_PATH)
    assert version is None and "several installed packages list it" in why
    # a transaction not checkpointed: the main file may lack it
    install(tmp_path / "wal", rpms[("nvidia-container-toolkit", "1.17.8")])
    (tmp_path / "wal" / "var/lib/rpm/rpmdb.sqlite-wal").write_bytes(b"\0" * 32)
    (tmp_path / "wal" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = read_toolkit_version(HostRoot(str(tmp_path / "wal")), HOOK_PATH)
    assert version is None and "rpmdb.sqlite-wal holds a transaction" in why
    # the build info still speaks for the binary itself
    (tmp_path / "wal" / HOOK_PATH.lstrip("/")).write_bytes(elf("1.17.8"))
    assert read_toolkit_version(HostRoot(str(tmp_path / "wal")), HOOK_PATH)[0] == (1, 17, 8)
    # a header rpm's own checks refuse
    install(tmp_path / "bad", rpms[("nvidia-container-toolkit", "1.17.8")])
    db = sqlite3.connect(tmp_path / "bad" / "var/lib/rpm/rpmdb.sqlite")
    (blob,) = db.execute("SELECT blob FROM Packages").fetchone()
    db.execute("UPDATE Packages SET blob = ?", (blob[:-1],))
    db.commit()
    db.close()
    (tmp_path / "bad" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = read_toolkit_version(HostRoot(str(tmp_path / "bad")), HOOK_PATH)
    assert version is None and "header of 1" not in why and "entries and" in why
    # RHEL 8's Berkeley DB: not read, and said so
    (tmp_path / "bdb" / "var/lib/rpm").mkdir(parents=True)
    (tmp_path / "bdb" / "usr/bin").mkdir(parents=True)
    (tmp_path / "bdb" / "var/lib/rpm/Packages").write_bytes(b"\0" * 4096)
    (tmp_path / "bdb" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = read_toolkit_version(HostRoot(str(tmp_path / "bdb")), HOOK_PATH)
    assert version is None and "Berkeley DB rpm database (rpm < 4.16), which is not read" in why


def _blob(entries, data: bytes) -> bytes:
    return struct.pack(">ii", len(entries), len(data)) + b"".join(struct.pack(">iiii", *e) for e in entries) + data


def test_header_blobs_as_rpm_lays_them_out():
    data = b"tk\0" + b"1.2.3\0" + b"\0\0\0" + struct.pack(">ii", 0, 0) + b"a\0b\0" + b"/usr/bin/\0"
    # NAME, VERSION, DIRINDEXES (aligned at 12), BASENAMES, DIRNAMES
    entries = [(1000, 6, 0, 1), (1001, 6, 3, 1), (1116, 4, 12, 2), (1117, 8, 20, 2), (1118, 8, 24, 1)]
    header = rpmdb.parse_header(_blob(entries, data))
    assert header[1000] == "tk" and header[1001] == "1.2.3" and header[1116] == (0, 0)
    assert rpmdb.files(header) == {"/usr/bin/a", "/usr/bin/b"}
    bad = [
        _blob(entries, data)[:-1],  # the data shorter than dl
        _blob(entries + [(1000, 6, 0, 1)], data),  # a tag twice
        _blob([(1000, 8, 0, 1)], data),  # another type
        _blob([(1116, 4, 13, 2)], data),  # int32 not aligned
        _blob([(1118, 8, 20, 4)], data),  # more strings than NULs
        _blob([(1001, 6, len(data), 1)], data),  # past the data
    ]
    for blob in bad:
        with pytest.raises(ValueError):
            rpmdb.parse_header(blob)
    with pytest.raises(ValueError):
        rpmdb.files({1117: ("a",), 1118: ("/",), 1116: (1,)})
