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
rpm < 4.16 (RHEL/Rocky 8) keeps the same blobs in /var/lib/rpm/Packages, a Berkeley DB hash file keyed by the
4-byte instance number (key 0: the next free one, no header). It is read as rpm >= 4.16's own read-only reader
reads it (lib/backend/bdb_ro.c at rpm-4.18.0-release: bdb_open:156-212 the metadata page, bdb_getpage:134-147,
ovfl_get:214-252, hash_bucket_to_page:256-263, hash_getkv:287-305, hash_next:307-346: every bucket's page chain
in order, overflow chains for big items), with caps rpm lacks (each page of a chain once, an overflow page that
carries nothing is an error). Both files present (which one rpm uses is its %_db_backend), or the ndb backend
(Packages.db): "unknown", with that reason.

    parse_header(blob) -> dict          # {tag: str | tuple} for the tags above (pure); ValueError when malformed
    owners(root, path, names) -> (list[(name, version, release)], where)   # RpmdbError: it cannot say
"""

from __future__ import annotations

import os
import struct

from nvsymlinkd.errors import NvsymlinkdError
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


class RpmdbError(NvsymlinkdError):
    """The rpm database is there but cannot say which package lists a file; the message names the file
    and why (the toolkit's version is then read from the binary, and this said with it)."""


def _nonempty(root: HostRoot, inside: str) -> bool:
    st = root.stat_resolved(inside)
    return st is not None and st.st_size > 0


def owners(root: HostRoot, path: str, names: tuple) -> tuple[list, str]:
    """([(name, version, release)] of the installed packages among `names` that list `path`, "where");
    ([], why) when there is no rpm database. Raises RpmdbError when the database cannot say."""
    present = [p for p in (RPMDB_SQLITE, RPMDB_BDB, RPMDB_NDB) if root.stat_resolved(p) is not None]
    if not present:
        return [], f"no rpm database ({RPMDB_SQLITE}, {RPMDB_BDB})"
    if len(present) > 1 or present[0] == RPMDB_NDB:
        raise RpmdbError(f"{' and '.join(present)}: which one rpm reads is its %_db_backend (an ndb one is not read)")
    try:
        fd = root.open_file(present[0])
    except OSError as exc:
        raise RpmdbError(f"{present[0]}: {exc.strerror or exc}") from exc
    try:
        if present[0] == RPMDB_BDB:
            return _select(_bdb_headers(fd), path, names, RPMDB_BDB)
        if _nonempty(root, RPMDB_SQLITE + "-wal"):
            raise RpmdbError(f"{RPMDB_SQLITE}-wal holds a transaction not checkpointed yet")
        return _owners(fd, path, names)
    finally:
        os.close(fd)


def _select(headers, path: str, names: tuple, where: str) -> tuple[list, str]:
    """The packages among `names` listing `path`, from (instance, blob) pairs; a malformed one: RpmdbError."""
    found = []
    try:
        for _hnum, blob in headers:
            listing = _listing(blob, path, names)
            if listing is not None:
                found.append(listing)
    except ValueError as exc:
        raise RpmdbError(f"{where}: {exc}") from exc
    return found, where


def _listing(blob: bytes, path: str, names: tuple) -> tuple | None:
    """(name, version, release) of a header among `names` that lists `path`, else None; ValueError when the
    header is malformed. Only the name is parsed of the packages that are not the toolkit's."""
    name = parse_header(blob, frozenset({NAME})).get(NAME)
    if name not in names:
        return None
    header = parse_header(blob)
    return (name, header.get(VERSION, ""), header.get(RELEASE, "")) if path in files(header) else None


def _bdb_meta(fd: int) -> tuple:
    """(byte order, page size, last page, max bucket, spares) from a Berkeley DB hash file's metadata page, as
    bdb_ro.c checks them; ValueError for anything it would refuse."""
    size = os.fstat(fd).st_size
    meta = os.pread(fd, 512, 0)
    if len(meta) != 512:
        raise ValueError("shorter than its metadata page")
    magic = struct.unpack_from("<I", meta, 12)[0]
    if magic not in (0x00061561, 0x61150600):
        raise ValueError("not a Berkeley DB hash file")
    e = "<" if magic == 0x00061561 else ">"  # bdb_open: a swapped magic is the other byte order
    version, pagesize = struct.unpack_from(e + "II", meta, 16)
    (lastpage,) = struct.unpack_from(e + "I", meta, 32)
    maxbucket, highmask, lowmask = struct.unpack_from(e + "III", meta, 72)
    spares = struct.unpack_from(e + "32I", meta, 96)
    del highmask, lowmask  # lookups only
    if not 8 <= version <= 10:
        raise ValueError(f"hash version {version}")
    if pagesize not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536) or (lastpage + 1) * pagesize > size:
        raise ValueError(f"page size {pagesize}, last page {lastpage}, in {size} bytes")
    if maxbucket > lastpage:
        raise ValueError(f"{maxbucket} buckets in {lastpage} pages")
    return e, pagesize, lastpage, maxbucket, spares


def _bdb_headers(fd: int):
    """(instance, header blob) of each record of a Berkeley DB hash file in bdb_ro.c's order; ValueError for
    anything it would refuse or a cap."""
    e, pagesize, lastpage, maxbucket, spares = _bdb_meta(fd)

    def page(pgno: int) -> bytes:
        if not 0 < pgno <= lastpage:
            raise ValueError(f"page {pgno} out of 1..{lastpage}")
        data = os.pread(fd, pagesize, pgno * pagesize)
        if len(data) != pagesize or struct.unpack_from(e + "I", data, 8)[0] != pgno:
            raise ValueError(f"page {pgno} is not itself")
        return data

    def item(p: bytes, off: int, length: int) -> bytes:
        if length <= 0 or off + length > pagesize:
            raise ValueError("an item past its page")
        if p[off] == 1:  # H_KEYDATA
            return p[off + 1:off + length]
        if p[off] != 3 or length != 12:  # H_OFFPAGE; duplicates (H_DUPLICATE, H_OFFDUP) are not rpm's
            raise ValueError(f"an item of type {p[off]}")
        pgno, total = struct.unpack_from(e + "II", p, off + 4)
        if not 0 < total <= MAX_BLOB_BYTES:
            raise ValueError(f"an overflow item of {total} bytes")
        out = bytearray()
        while len(out) < total:
            ov = page(pgno)
            plen = struct.unpack_from(e + "H", ov, 22)[0]
            if ov[25] != 7 or plen == 0 or plen + 26 > pagesize or plen > total - len(out):
                raise ValueError(f"overflow page {pgno}")
            out += ov[26:26 + plen]
            pgno = struct.unpack_from(e + "I", ov, 16)[0]
        return bytes(out)

    seen: set = set()
    read = 0
    for bucket in range(maxbucket + 1):
        pgno = bucket + spares[bucket.bit_length()]  # hash_bucket_to_page
        while pgno:
            if pgno in seen:
                raise ValueError(f"page {pgno} twice")
            seen.add(pgno)
            p = page(pgno)
            if p[25] not in (2, 8, 13):
                raise ValueError(f"page {pgno} of type {p[25]}")
            nent = struct.unpack_from(e + "H", p, 20)[0]
            if 26 + 2 * nent > pagesize:
                raise ValueError(f"page {pgno}: {nent} entries")
            offs = struct.unpack_from(e + f"{nent}H", p, 26)
            for idx in range(0, nent - 1, 2):
                koff, voff = offs[idx], offs[idx + 1]
                if koff >= pagesize or voff >= pagesize:
                    raise ValueError(f"page {pgno}: an offset past it")
                klen = pagesize - koff if idx == 0 else offs[idx - 1] - koff
                key, value = item(p, koff, klen), item(p, voff, koff - voff)
                if len(key) != 4:
                    raise ValueError(f"a key of {len(key)} bytes")
                hnum = struct.unpack(e + "I", key)[0]
                if hnum == 0:
                    continue  # the next free instance number, no header
                read += len(value)
                if read > MAX_DB_BYTES or len(seen) > MAX_PACKAGES * 64:
                    raise ValueError("past the caps")
                yield hnum, value
            pgno = struct.unpack_from(e + "I", p, 16)[0]


def _owners(fd: int, path: str, names: tuple) -> tuple[list, str]:
    import sqlite3

    try:
        db = sqlite3.connect(f"file:/proc/self/fd/{fd}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as exc:
        raise RpmdbError(f"{RPMDB_SQLITE}: {exc}") from exc
    found = []
    try:
        # the blob's length first: a huge one is refused before it is read
        rows = db.execute("SELECT hnum, length(blob) FROM Packages ORDER BY hnum LIMIT ?", (MAX_PACKAGES + 1,))
        sizes = rows.fetchall()
        if len(sizes) > MAX_PACKAGES:
            raise RpmdbError(f"{RPMDB_SQLITE}: more than {MAX_PACKAGES} packages")
        total = 0
        for hnum, size in sizes:
            if not isinstance(size, int) or size > MAX_BLOB_BYTES:
                raise RpmdbError(f"{RPMDB_SQLITE}: package {hnum}'s header is {size} bytes")
            total += size
            if total > MAX_DB_BYTES:
                raise RpmdbError(f"{RPMDB_SQLITE}: its headers are more than {MAX_DB_BYTES} bytes")
            (blob,) = db.execute("SELECT blob FROM Packages WHERE hnum = ?", (hnum,)).fetchone()
            if not isinstance(blob, bytes):
                raise RpmdbError(f"{RPMDB_SQLITE}: package {hnum}'s header is not a blob")
            try:
                listing = _listing(blob, path, names)
            except ValueError as exc:
                raise RpmdbError(f"{RPMDB_SQLITE}: package {hnum}'s header: {exc}") from exc
            if listing is not None:
                found.append(listing)
    except sqlite3.Error as exc:
        raise RpmdbError(f"{RPMDB_SQLITE}: {exc}") from exc
    finally:
        db.close()
    return found, RPMDB_SQLITE
