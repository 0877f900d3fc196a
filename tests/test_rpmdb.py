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

from nvsymlinkd.containers.hookhost import VersionUnknown, read_toolkit_version
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


def version_or_why(root, binary):
    """(version, where it was read) or (None, why not): what read_hook_inputs keeps of VersionUnknown."""
    try:
        return read_toolkit_version(root, binary)
    except VersionUnknown as exc:
        return None, str(exc)


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
            with pytest.raises(rpmdb.RpmdbError, match="bytes"):
                rpmdb.owners(root, HOOK_PATH, ("nvidia-container-toolkit",))
    with monkeypatch.context() as m:
        m.setattr(rpmdb, "MAX_PACKAGES", 0)
        with pytest.raises(rpmdb.RpmdbError, match="^/var/lib/rpm/rpmdb.sqlite: more than 0 packages$"):
            rpmdb.owners(root, HOOK_PATH, ("nvidia-container-toolkit",))


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
    version, why = version_or_why(HostRoot(str(tmp_path / "rc")), HOOK_PATH)
    assert version is None and "1.17.0~rc.1-1 is not a release version" in why
    # two installed packages list it with two versions; a package of another name listing it is not the toolkit
    install(tmp_path / "two", rpms[("nvidia-container-toolkit", "1.17.8")])
    install(tmp_path / "two", rpms[("other-package", "1.18.0")], replace=True)
    assert rpmdb.owners(HostRoot(str(tmp_path / "two")), HOOK_PATH, ("nvidia-container-toolkit",))[0] == \
        [("nvidia-container-toolkit", "1.17.8", "1")]
    install(tmp_path / "two", rpms[("nvidia-container-toolkit-base", "1.18.0")], replace=True)
    (tmp_path / "two" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = version_or_why(HostRoot(str(tmp_path / "two")), HOOK_PATH)
    assert version is None and "several installed packages list it" in why
    # a transaction not checkpointed: the main file may lack it
    install(tmp_path / "wal", rpms[("nvidia-container-toolkit", "1.17.8")])
    (tmp_path / "wal" / "var/lib/rpm/rpmdb.sqlite-wal").write_bytes(b"\0" * 32)
    (tmp_path / "wal" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = version_or_why(HostRoot(str(tmp_path / "wal")), HOOK_PATH)
    assert version is None and "rpmdb.sqlite-wal holds a transaction" in why
    # the build info still speaks for the binary itself
    (tmp_path / "wal" / HOOK_PATH.lstrip("/")).write_bytes(elf("1.17.8"))
    assert read_toolkit_version(HostRoot(str(tmp_path / "wal")), HOOK_PATH)[0] == (1, 17, 8)
    (tmp_path / "wal" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    with pytest.raises(VersionUnknown, match="^/usr/bin/nvidia-container-runtime-hook: no dpkg or rpm package lists "
                       "it; /var/lib/rpm/rpmdb.sqlite-wal holds a transaction not checkpointed yet; its build info "
                       "names no release version$"):
        read_toolkit_version(HostRoot(str(tmp_path / "wal")), HOOK_PATH)
    # a header rpm's own checks refuse
    install(tmp_path / "bad", rpms[("nvidia-container-toolkit", "1.17.8")])
    db = sqlite3.connect(tmp_path / "bad" / "var/lib/rpm/rpmdb.sqlite")
    (blob,) = db.execute("SELECT blob FROM Packages").fetchone()
    db.execute("UPDATE Packages SET blob = ?", (blob[:-1],))
    db.commit()
    db.close()
    (tmp_path / "bad" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = version_or_why(HostRoot(str(tmp_path / "bad")), HOOK_PATH)
    assert version is None and "header of 1" not in why and "entries and" in why
    # a Packages file that is no Berkeley DB hash file, or beside rpmdb.sqlite (which one rpm reads is its config)
    (tmp_path / "bdb" / "var/lib/rpm").mkdir(parents=True)
    (tmp_path / "bdb" / "usr/bin").mkdir(parents=True)
    (tmp_path / "bdb" / "var/lib/rpm/Packages").write_bytes(b"\0" * 4096)
    (tmp_path / "bdb" / HOOK_PATH.lstrip("/")).write_bytes(hook)
    version, why = version_or_why(HostRoot(str(tmp_path / "bdb")), HOOK_PATH)
    assert version is None and "/var/lib/rpm/Packages: not a Berkeley DB hash file" in why
    (tmp_path / "two" / "var/lib/rpm/Packages").write_bytes(b"\0" * 4096)
    with pytest.raises(rpmdb.RpmdbError, match="^/var/lib/rpm/rpmdb.sqlite and /var/lib/rpm/Packages: which one "
                       "rpm reads is its %_db_backend"):
        rpmdb.owners(HostRoot(str(tmp_path / "two")), HOOK_PATH, ("nvidia-container-toolkit",))


def berkeley_db(sqlite_tree: Path, tree: Path, order: int, pagesize: int = 512) -> None:
    """RHEL 8's /var/lib/rpm/Packages made from an rpmdb.sqlite's blobs with Berkeley DB's own db_load (a hash
    file keyed by the 4-byte instance number, key 0 the next free one), small pages: the headers span overflow
    pages; h_ffactor=1: one record a bucket, so many buckets. order: 1234 little-endian, 4321 big-endian."""
    load = need_tool("db5.3_load")
    db = sqlite3.connect(sqlite_tree / "var/lib/rpm/rpmdb.sqlite")
    rows = db.execute("SELECT hnum, blob FROM Packages ORDER BY hnum").fetchall()
    db.close()
    fmt = "<I" if order == 1234 else ">I"
    lines = ["VERSION=3", "format=bytevalue", "type=hash", f"db_pagesize={pagesize}", "h_ffactor=1", "HEADER=END"]
    for k, v in [(0, struct.pack(fmt, rows[-1][0] + 1)), *((h, bytes(b)) for h, b in rows)]:
        lines += [" " + struct.pack(fmt, k).hex(), " " + v.hex()]
    dump = tree / "Packages.dump"
    tree.mkdir(parents=True, exist_ok=True)
    dump.write_text("\n".join([*lines, "DATA=END", ""]))
    (tree / "var/lib/rpm").mkdir(parents=True, exist_ok=True)
    subprocess.run([load, "-c", f"db_lorder={order}", "-f", str(dump), str(tree / "var/lib/rpm/Packages")],
                   check=True, capture_output=True, timeout=60)


@pytest.mark.parametrize("order", (1234, 4321))
def test_rhel8s_berkeley_db_read_as_rpms_own_reader_reads_it(rpms, tmp_path, order):
    install(tmp_path / "sql", rpms[("nvidia-container-toolkit", "1.17.8")])
    install(tmp_path / "sql", rpms[("other-package", "1.18.0")], replace=True)
    tree = tmp_path / "bdb"
    berkeley_db(tmp_path / "sql", tree, order)
    # rpm's own read-only Berkeley DB reader (bdb_ro) lists both: the file is an rpm database
    listed = subprocess.run(["rpm", "--root", str(tree), "--dbpath", "/var/lib/rpm", "--define",
                             "_db_backend bdb_ro", "-qa"], capture_output=True, text=True, timeout=60).stdout
    assert sorted(listed.split()) == ["nvidia-container-toolkit-1.17.8-1.noarch", "other-package-1.18.0-1.noarch"]
    (tree / HOOK_PATH.lstrip("/")).parent.mkdir(parents=True)
    (tree / HOOK_PATH.lstrip("/")).write_bytes(elf())
    root = HostRoot(str(tree))
    assert read_toolkit_version(root, HOOK_PATH) == ((1, 17, 8), "/var/lib/rpm/Packages: nvidia-container-toolkit 1.17.8-1")
    assert on_host(tree, {DRIVER_CFG: REFUSE}) == set()
    # bucket 0's page not itself (its number), an overflow page of another type: not read
    data = (tree / "var/lib/rpm/Packages").read_bytes()
    e = "<" if order == 1234 else ">"
    bucket0 = struct.unpack_from(e + "I", data, 96)[0]  # the metadata's spares[0]
    overflow = [n for n in range(1, len(data) // 512) if data[n * 512 + 25] == 7]
    assert overflow, "the headers did not span overflow pages"
    for at in (bucket0 * 512 + 8, overflow[0] * 512 + 25):
        bad = bytearray(data)
        bad[at] ^= 0xFF
        (tree / "var/lib/rpm/Packages").write_bytes(bytes(bad))
        with pytest.raises(rpmdb.RpmdbError, match="^/var/lib/rpm/Packages: "):
            rpmdb.owners(root, HOOK_PATH, ("nvidia-container-toolkit",))


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
