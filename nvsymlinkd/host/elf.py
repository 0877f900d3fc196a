"""One named section of an ELF file, read bounded from an open descriptor (no library, nothing run).

The layout is the ELF specification's (glibc elf.h: Elf64_Ehdr/Elf32_Ehdr, Elf64_Shdr/Elf32_Shdr), read the
way Go's debug/elf (go1.22 src/debug/elf/file.go NewFile, Section) finds a section: the section header table
at e_shoff, e_shnum entries of e_shentsize bytes, names in the section e_shstrndx names, the first section of
that name. Extended numbering (e_shnum 0 with a table, e_shstrndx SHN_XINDEX) is refused, not followed: every
count read is one the file states directly. Every read is capped; anything inconsistent raises ValueError.

    read_section(fd, name) -> ElfSection | None   # None: the file has no such section (or no section table)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

MAX_SECTIONS = 4096  # a Go binary has ~40; the table is read in one capped pread
MAX_NAMES_BYTES = 1 << 20
MAX_SECTION_BYTES = 64 << 10
SHT_PROGBITS = 1
SHT_NOBITS = 8
SHN_XINDEX = 0xFFFF


@dataclass(frozen=True)
class ElfSection:
    data: bytes
    sh_type: int
    little: bool  # EI_DATA: the byte order of the file (and of the machine it runs on)


def _pread(fd: int, size: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"{what} lies past the end of the file")
    return data


def read_section(fd: int, name: str, limit: int = MAX_SECTION_BYTES) -> ElfSection | None:
    size = os.fstat(fd).st_size
    ident = _pread(fd, 16, 0, "the ELF header")
    if ident[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    cls, data = ident[4], ident[5]
    if cls not in (1, 2) or data not in (1, 2):
        raise ValueError(f"unknown ELF class {cls} or data encoding {data}")
    end = "<" if data == 1 else ">"
    if cls == 2:  # Elf64_Ehdr: e_shoff at 0x28, e_shentsize/e_shnum/e_shstrndx at 0x3a
        head = _pread(fd, 64, 0, "the ELF header")
        (shoff,) = struct.unpack_from(end + "Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", head, 0x3A)
        want, shdr = 64, end + "IIQQQQIIQQ"
    else:  # Elf32_Ehdr: e_shoff at 0x20, the counts at 0x2e
        head = _pread(fd, 52, 0, "the ELF header")
        (shoff,) = struct.unpack_from(end + "I", head, 0x20)
        shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", head, 0x2E)
        want, shdr = 40, end + "IIIIIIIIII"
    if shoff == 0 and shnum == 0:
        return None  # no section table: nothing (the installer, which writes through it, included) names one
    if shnum == 0 or shstrndx == SHN_XINDEX:
        raise ValueError("extended section numbering")
    if shentsize != want or shnum > MAX_SECTIONS or shstrndx >= shnum:
        raise ValueError(f"a section table of {shnum} entries of {shentsize} bytes (names in {shstrndx})")
    if shoff + shnum * shentsize > size:
        raise ValueError("the section table lies past the end of the file")
    table = _pread(fd, shnum * shentsize, shoff, "the section table")
    # (sh_name, sh_type, sh_offset, sh_size) of each entry
    entries = []
    for i in range(shnum):
        f = struct.unpack_from(shdr, table, i * shentsize)
        entries.append((f[0], f[1], f[4], f[5]))  # both layouts: name, type, flags, addr, offset, size, ...
    _, names_type, names_off, names_size = entries[shstrndx]
    if names_type == SHT_NOBITS or names_size > MAX_NAMES_BYTES or names_off + names_size > size:
        raise ValueError("the section names cannot be read")
    names = _pread(fd, names_size, names_off, "the section names")
    wanted = name.encode()
    for sh_name, sh_type, off, length in entries:
        nul = names.find(b"\0", sh_name) if sh_name < len(names) else -1
        if nul < 0 or names[sh_name:nul] != wanted:
            continue  # debug/elf getString: a name without its NUL is no name
        if sh_type == SHT_NOBITS:
            return ElfSection(b"", sh_type, data == 1)  # no bytes in the file
        if length > limit or off + length > size:
            raise ValueError(f"section {name} of {length} bytes at {off} cannot be read")
        return ElfSection(_pread(fd, length, off, f"section {name}"), sh_type, data == 1)
    return None
