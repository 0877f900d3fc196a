"""The rpm database, read without rpm: which installed package lists a file, and its version.

rpm >= 4.16 (RHEL/Rocky 9, Fedora) keeps it in /var/lib/rpm/rpmdb.sqlite (lib/backend/sqlite.c at
rpm-4.18.0-release:262-266: table `Packages`, `hnum INTEGER PRIMARY KEY`, `blob BLOB`): each blob is one
installed package's header as lib/header.c writes it (headerExport; read back by hdrblobInit, header.c:2005-2031,
whose blob is exactly 8 + 16 * il + dl bytes, and hdrblobVerifyInfo, :273-330): big-endian int32 il (index
entries) and dl (data bytes), il entries of four big-endian int32 (tag, type, offset, count: struct
entryInfo_s), then the dl data bytes. The tags read (include/rpm/rpmtag.h:
73-79, 192-194): NAME 1000, VERSION 1001, RELEASE 1002 (RPM_STRING_TYPE 6: one NUL-terminated string),
DIRINDEXES 1116 (RPM_INT32_TYPE 4), BASENAMES 1117 and DIRNAMES 1118 (RPM_STRING_ARRAY_TYPE 8): file i is
DIRNAMES[DIRINDEXES[i]] + BASENAMES[i]. A header naming one of these tags twice (a region entry and a
"dribble" that replaces it, header.c:963) is not decoded.

rpm opens the database in WAL mode and truncates the log when it closes (sqlite.c:179-184, 207): a non-empty
rpmdb.sqlite-wal is a transaction not yet checkpointed, and the file is then not read (the main file may lack
it). The database is opened read-only and immutable through the descriptor opened confined under the root.
rpm < 4.16 (RHEL/Rocky 8: /var/lib/rpm/Packages, a Berkeley DB hash file) and the ndb backend (Packages.db)
are not read: their lists are "unknown", with that reason.

    parse_header(blob) -> dict          # {tag: str | tuple} for the tags above (pure); ValueError when malformed
    owners(root, path, names) -> (list[(name, version, release)] | None, why)
"""

from __future__ import annotations

import os
import struct

from nvsymlinkd.host.root import HostRoot

RPMDB_SQLITE = "/var/lib/rpm/rpmdb.sqlite"
RPMDB_BDB = "/var/lib/rpm/Packages"
RPMDB_NDB = "/var/lib/rpm/Packages.db"
NAME, VERSION, RELEASE, DIRINDEXES, BASENAMES, DIRNAMES = 1000, 1001, 1002, 1116, 1117, 1118
STRING, INT32, STRING_ARRAY = 6, 4, 8
_WANTED = {NAME: STRING, VERSION: STRING, RELEASE: STRING, DIRINDEXES: INT32, BASENAMES: STRING_ARRAY,
           DIRNAMES: STRING_ARRAY}
HEADER_TAGS_MAX = 0xFFFF  # header.c:123
HEADER_DATA_MAX = 0x0FFFFFFF  # header.c:155
MAX_PACKAGES = 100_000
MAX_BLOB_BYTES = 64 << 20
MAX_DB_BYTES = 2 << 30  # every header read in one lookup (a RHEL 9 server's ~1,500 packages: ~100 MiB)


def parse_header(blob: bytes, tags: frozenset = frozenset(_WANTED)) -> dict:
    """The wanted tags of one header blob; raises ValueError for a blob rpm's own checks refuse or one this reader
    cannot decode exactly (a tag twice, another type)."""
    if len(blob) < 8:
        raise ValueError("a header shorter than its counts")
    il, dl = struct.unpack_from(">ii", blob, 0)
    if not 0 < il <= HEADER_TAGS_MAX or not 0 <= dl <= HEADER_DATA_MAX or 8 + 16 * il + dl != len(blob):
        raise ValueError(f"a header of {il} entries and {dl} data bytes in {len(blob)} bytes")
    base = 8 + 16 * il
    out: dict = {}
    for i in range(il):
        tag, kind, offset, count = struct.unpack_from(">iiii", blob, 8 + 16 * i)
        if tag not in tags:
            continue
        if tag in out:
            raise ValueError(f"tag {tag} twice")
        if kind != _WANTED[tag] or not 0 <= offset < dl or not 0 < count <= dl:
            raise ValueError(f"tag {tag}: type {kind}, offset {offset}, count {count}")
        if kind == INT32:
            if offset % 4 or offset + 4 * count > dl:
                raise ValueError(f"tag {tag}: {count} int32 at {offset}")
            out[tag] = struct.unpack_from(f">{count}i", blob, base + offset)
            continue
        strings = []
        pos = base + offset
        for _ in range(count if kind == STRING_ARRAY else 1):
            end = blob.find(b"\0", pos, base + dl)
            if end < 0:
                raise ValueError(f"tag {tag}: a string without its NUL")
            strings.append(blob[pos:end].decode("utf-8", "surrogateescape"))
            pos = end + 1
        if kind == STRING and count != 1:
            raise ValueError(f"tag {tag}: a string of count {count}")
        out[tag] = strings[0] if kind == STRING else tuple(strings)
    return out


def files(header: dict) -> set:
    """The paths a parsed header lists (none without BASENAMES); ValueError when its three lists disagree."""
    base, dirs, index = header.get(BASENAMES, ()), header.get(DIRNAMES, ()), header.get(DIRINDEXES, ())
    if len(base) != len(index) or any(not 0 <= i < len(dirs) for i in index):
        raise ValueError("BASENAMES, DIRNAMES and DIRINDEXES disagree")
    return {dirs[i] + b for b, i in zip(base, index)}


def _nonempty(root: HostRoot, inside: str) -> bool:
    st = root.stat_resolved(inside)
    return st is not None and st.st_size > 0


def owners(root: HostRoot, path: str, names: tuple) -> tuple[list | None, str]:
    """([(name, version, release)] of the installed packages among `names` that list `path`, "where"), or
    (None, why the database cannot say). ([], why) when there is no rpm database."""
    try:
        fd = root.open_file(RPMDB_SQLITE)
    except FileNotFoundError:
        for other, what in ((RPMDB_BDB, "a Berkeley DB rpm database (rpm < 4.16)"),
                            (RPMDB_NDB, "an ndb rpm database")):
            if root.stat_resolved(other) is not None:
                return None, f"{other} is {what}, which is not read"
        return [], f"no rpm database ({RPMDB_SQLITE})"
    except OSError as exc:
        return None, f"{RPMDB_SQLITE}: {exc.strerror or exc}"
    try:
        if _nonempty(root, RPMDB_SQLITE + "-wal"):
            return None, f"{RPMDB_SQLITE}-wal holds a transaction not checkpointed yet"
        return _owners(fd, path, names)
    finally:
        os.close(fd)


def _owners(fd: int, path: str, names: tuple) -> tuple[list | None, str]:
    import sqlite3

    try:
        db = sqlite3.connect(f"file:/proc/self/fd/{fd}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as exc:
        return None, f"{RPMDB_SQLITE}: {exc}"
    found = []
    try:
        # the blob's length first: a huge one is refused before it is read
        rows = db.execute("SELECT hnum, length(blob) FROM Packages ORDER BY hnum LIMIT ?", (MAX_PACKAGES + 1,))
        sizes = rows.fetchall()
        if len(sizes) > MAX_PACKAGES:
            return None, f"{RPMDB_SQLITE}: more than {MAX_PACKAGES} packages"
        total = 0
        for hnum, size in sizes:
            if not isinstance(size, int) or size > MAX_BLOB_BYTES:
                return None, f"{RPMDB_SQLITE}: package {hnum}'s header is {size} bytes"
            total += size
            if total > MAX_DB_BYTES:
                return None, f"{RPMDB_SQLITE}: its headers are more than {MAX_DB_BYTES} bytes"
            (blob,) = db.execute("SELECT blob FROM Packages WHERE hnum = ?", (hnum,)).fetchone()
            if not isinstance(blob, bytes):
                return None, f"{RPMDB_SQLITE}: package {hnum}'s header is not a blob"
            try:
                name = parse_header(blob, frozenset({NAME})).get(NAME)
                if name not in names:
                    continue
                header = parse_header(blob)
                if path in files(header):
                    found.append((name, header.get(VERSION, ""), header.get(RELEASE, "")))
            except ValueError as exc:
                return None, f"{RPMDB_SQLITE}: package {hnum}'s header: {exc}"
    except sqlite3.Error as exc:
        return None, f"{RPMDB_SQLITE}: {exc}"
    finally:
        db.close()
    return found, RPMDB_SQLITE
