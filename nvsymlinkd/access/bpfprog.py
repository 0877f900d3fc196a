"""The bpf(2) syscall (host/libc.py makes the call): read the device programs a cgroup runs.

Reading (what the daemon does):
  BPF_PROG_QUERY(attach_type=BPF_CGROUP_DEVICE, query_flags=BPF_F_QUERY_EFFECTIVE)
  on the cgroup directory gives the ids of every program the kernel runs for a
  process in that cgroup (its own and inherited ones); BPF_PROG_GET_FD_BY_ID
  and BPF_OBJ_GET_INFO_BY_FD (twice: the length, then the instructions) give
  each program's name, tag and xlated (post-verifier) instructions.

Replacing (the `bpf-program` repair, nvsymlinkd.repair.bpfrepair): BPF_PROG_LOAD
a program, BPF_PROG_ATTACH it to the cgroup with BPF_F_ALLOW_MULTI, then
BPF_PROG_DETACH the old ones by the fds BPF_PROG_GET_FD_BY_ID gave (as runc and
systemd do: never a moment with no program). The tests build programs the same way.

Only the union bpf_attr / struct bpf_prog_info fields that have kept their
offsets since Linux 4.15 are used, and the size passed to the kernel ends at
the last field we set (the kernel zero-fills the rest). Every failure raises
BpfError (errno and the command named), never a bare OSError.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

from nvsymlinkd.errors import BpfError
from nvsymlinkd.host import libc

# commands
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
COMMAND_NAMES = {BPF_PROG_LOAD: "BPF_PROG_LOAD", BPF_PROG_ATTACH: "BPF_PROG_ATTACH",
                 BPF_PROG_DETACH: "BPF_PROG_DETACH", BPF_PROG_GET_FD_BY_ID: "BPF_PROG_GET_FD_BY_ID",
                 BPF_OBJ_GET_INFO_BY_FD: "BPF_OBJ_GET_INFO_BY_FD", BPF_PROG_QUERY: "BPF_PROG_QUERY"}

BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_QUERY_EFFECTIVE = 1
BPF_F_ALLOW_OVERRIDE = 1
BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4

ATTR_BUFFER = 256        # bigger than any kernel's union bpf_attr: the kernel may write past what we pass
INFO_LEN = 88            # struct bpf_prog_info through `ifindex` + the gpl_compatible word
LOG_BUFFER = 1 << 20      # the verifier log, asked for only to explain a failed load
QUERY_SLOTS = 64         # programs per query before we ask again with the count the kernel reported

def _bpf(cmd: int, attr: libc.Buffer, size: int) -> int:
    try:
        return libc.bpf(cmd, attr, size)
    except OSError as exc:
        err, why = exc.errno or errno.EIO, exc.strerror or ""
        if why.startswith("no bpf syscall number"):
            raise BpfError("bpf", err, why) from None
        raise BpfError(COMMAND_NAMES.get(cmd, f"bpf cmd {cmd}"), err) from None


def _attr(*fields) -> libc.Buffer:
    """A zeroed attr buffer with (offset, struct format, value) fields set."""
    buf = libc.buffer(ATTR_BUFFER)
    for off, fmt, value in fields:
        struct.pack_into(fmt, buf, off, value)
    return buf


def query_device_program_ids(cgroup_fd: int, effective: bool = True) -> list:
    """Ids of the BPF_CGROUP_DEVICE programs of an open cgroup2 directory."""
    return query_device_programs(cgroup_fd, effective)[0]


def query_device_programs(cgroup_fd: int, effective: bool = True) -> tuple:
    """(program ids, attach flags) of an open cgroup2 directory: with `effective`, every program the
    kernel runs for it (its own and its ancestors', in run order); without, its own, and the flags
    they were attached with (BPF_F_ALLOW_MULTI, BPF_F_ALLOW_OVERRIDE or 0)."""
    slots = QUERY_SLOTS
    for _ in range(8):
        ids = libc.buffer(4 * slots)  # __u32 prog_ids[slots]
        attr = _attr((0, "=I", cgroup_fd), (4, "=I", BPF_CGROUP_DEVICE),
                     (8, "=I", BPF_F_QUERY_EFFECTIVE if effective else 0),
                     (16, "=Q", libc.address(ids)), (24, "=I", slots))
        try:
            _bpf(BPF_PROG_QUERY, attr, 28)
        except BpfError as e:
            if e.errno == errno.ENOSPC:   # more programs than slots: the kernel wrote the count
                slots = max(struct.unpack_from("=I", attr, 24)[0], slots * 2)
                continue
            raise
        count = struct.unpack_from("=I", attr, 24)[0]
        return list(struct.unpack_from(f"={count}I", ids)), struct.unpack_from("=I", attr, 12)[0]
    raise BpfError("BPF_PROG_QUERY", errno.ENOSPC, "program list kept growing")


@dataclass(frozen=True)
class DeviceProgram:
    prog_id: int
    name: str
    tag: str            # hex of the kernel's 8-byte program tag
    prog_type: int
    xlated: bytes       # struct bpf_insn array as the kernel runs it (before JIT)


def program_fd(prog_id: int) -> int:
    """BPF_PROG_GET_FD_BY_ID: a descriptor holding the program (for BPF_PROG_DETACH); close it."""
    return _bpf(BPF_PROG_GET_FD_BY_ID, _attr((0, "=I", prog_id)), 12)


def read_program(prog_id: int) -> DeviceProgram:
    fd = program_fd(prog_id)
    try:
        return read_program_fd(fd)
    finally:
        os.close(fd)


def read_program_fd(fd: int) -> DeviceProgram:
    """A program's id, name, tag, type and xlated instructions, from a descriptor of it."""
    info = libc.buffer(ATTR_BUFFER)
    _get_info(fd, info)
    prog_type, got_id = struct.unpack_from("=II", info, 0)
    tag = bytes(info.raw[8:16]).hex()
    xlated_len = struct.unpack_from("=I", info, 20)[0]
    name = info.raw[64:80].split(b"\0", 1)[0].decode("ascii", "replace")
    insns = b""
    if xlated_len:
        code = libc.buffer(xlated_len)
        info2 = libc.buffer(ATTR_BUFFER)
        struct.pack_into("=I", info2, 20, xlated_len)
        struct.pack_into("=Q", info2, 32, libc.address(code))
        _get_info(fd, info2)
        got_len = struct.unpack_from("=I", info2, 20)[0]
        insns = code.raw[:min(got_len, xlated_len)]
    return DeviceProgram(got_id, name, tag, prog_type, insns)


def _get_info(fd: int, info: libc.Buffer) -> None:
    attr = _attr((0, "=I", fd), (4, "=I", INFO_LEN), (8, "=Q", libc.address(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, 16)


def open_cgroup_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def read_cgroup_device_programs(cgroup_dir: str) -> list:
    """Every effective device program of a cgroup2 directory (real path), in run order."""
    fd = open_cgroup_dir(cgroup_dir)
    try:
        ids = query_device_program_ids(fd)
    finally:
        os.close(fd)
    return [read_program(i) for i in ids]


# --- loading and attaching: the bpf-program repair, the tests and benchmarks --------------------

def load_device_program(xlated: bytes, name: str = "", license: str = "GPL") -> int:
    """BPF_PROG_LOAD a BPF_PROG_TYPE_CGROUP_DEVICE program; returns its fd.

    Loaded without a verifier log: a log buffer that overflows fails the load with ENOSPC even when the
    program verifies (kernel/bpf/verifier.c, bpf_check: `if (log->level && bpf_verifier_log_full(log))
    ret = -ENOSPC` up to 6.3; bpf_vlog_finalize since 6.4), and a repair program of a few hundred rules
    writes more than any fixed buffer. Only a failed load is tried again with the log (level 1, LOG_BUFFER),
    to explain it: the BpfError carries the first errno and the log's last lines.
    """
    insns = libc.buffer(xlated)
    lic = libc.buffer(license.encode() + b"\0")
    prog_name = name.encode()[:15]
    fields = [(0, "=I", BPF_PROG_TYPE_CGROUP_DEVICE), (4, "=I", len(xlated) // 8),
              (8, "=Q", libc.address(insns)), (16, "=Q", libc.address(lic)), (48, "16s", prog_name)]
    try:
        return _bpf(BPF_PROG_LOAD, _attr(*fields), 72)
    except BpfError as first:
        log = libc.buffer(LOG_BUFFER)
        try:
            fd = _bpf(BPF_PROG_LOAD, _attr(*fields, (24, "=I", 1), (28, "=I", len(log)),
                                           (32, "=Q", libc.address(log))), 72)
        except BpfError:
            lines = log.raw.split(b"\0", 1)[0].decode(errors="replace").strip().splitlines()
            raise BpfError(first.command, first.errno, "verifier: " + " | ".join(lines[-3:])) from None
        return fd  # the same program loaded the second time (the first failure was transient: EAGAIN)


def attach_device_program(cgroup_fd: int, prog_fd: int, flags: int = BPF_F_ALLOW_MULTI,
                          replace_fd: int = 0) -> None:
    """BPF_PROG_ATTACH. With BPF_F_ALLOW_MULTI the program joins the cgroup's list (all must allow);
    without it (flags 0 or BPF_F_ALLOW_OVERRIDE) it takes the place of the one program there. With
    BPF_F_REPLACE | BPF_F_ALLOW_MULTI and replace_fd, it takes replace_fd's place (5.6+: runc 1.1)."""
    attr = _attr((0, "=I", cgroup_fd), (4, "=I", prog_fd), (8, "=I", BPF_CGROUP_DEVICE),
                 (12, "=I", flags), (16, "=I", replace_fd))
    _bpf(BPF_PROG_ATTACH, attr, 20)


def detach_device_program(cgroup_fd: int, prog_fd: int) -> None:
    attr = _attr((0, "=I", cgroup_fd), (4, "=I", prog_fd), (8, "=I", BPF_CGROUP_DEVICE))
    _bpf(BPF_PROG_DETACH, attr, 20)
