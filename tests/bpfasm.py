"""Test-side builder of BPF_CGROUP_DEVICE programs in the shapes real producers emit,
and a prober that asks the kernel itself (open()/mknod() from a child in a cgroup).

The assembler (ldx, alu, jmp, Label, ...) and runc's shape are the package's own generator,
nvsymlinkd.access.bpfgen; the other shapes are here, mirrored instruction by instruction:
  - runc_program: opencontainers/cgroups devicefilter, through bpfgen.program (one block per rule:
    jne type; [mov32 r1,r3; and32 r1,acc; jne r1,r3]; jne major; jne minor;
    mov32 r0,allow; exit; then `mov32 r0,default; exit`).
  - systemd_program: systemd src/core/bpf-devices.c (access check first, type,
    major, minor, `ja PASS`; then `mov64 r0,0; ja +1; mov64 r0,1; exit`).
  - nvidia_prepend: libnvidia-container nvcgo/internal/cgroup/ebpf.go
    (16-bit type load, r2 reused as the access temp, jne32 for the access test,
    blocks prepended to the program already attached).
  - random_alu_program: arbitrary ALU/ALU64/JMP/JMP32 code over the context, to
    check the interpreter's arithmetic against the kernel's.
"""

from __future__ import annotations

import errno
import os
import random
import stat

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access import bpfgen
from nvsymlinkd.access.bpfgen import (
    Label,
    alu,
    exit_,
    ja,
    jmp,
    ldx,
    mov32,
    mov64,
)
from nvsymlinkd.access.bpfgen import emit_jump as _emit_jump
from nvsymlinkd.access.bpfgen import place as _place
from nvsymlinkd.host.devices import Rule

LOAD_CTX = list(bpfgen.LOAD_CTX)   # a list: tests build programs by `+`
ACC_BITS = bpfgen.ACCESS_BITS
TYPE_BITS = bpfgen.TYPE_BITS


def acc_mask(access: str) -> int:
    return bpfgen.access_mask(access)


# --- producers ------------------------------------------------------------------------------

def runc_program(rules: list, default_allow: bool) -> list:
    """runc/crun: rules are exceptions (allow when default deny, deny when default allow);
    the first matching block decides. The package's generator (access.bpfgen) emits this shape."""
    return bpfgen.program([Rule(not default_allow, r.type, r.major, r.minor, r.access) for r in rules], default_allow)


def runc_allow_all() -> list:
    return bpfgen.allow_all()


# bpf_devices_allow_list_static(): what DevicePolicy=closed always allows
SYSTEMD_STATIC = [Rule(True, "c", 1, 3, "rwm"), Rule(True, "c", 1, 5, "rwm"),
                  Rule(True, "c", 1, 7, "rwm"), Rule(True, "c", 1, 8, "rwm"),
                  Rule(True, "c", 1, 9, "rwm"), Rule(True, "c", 5, 0, "rwm"),
                  Rule(True, "c", 5, 2, "rwm"), Rule(True, "c", 136, None, "rw")]


def systemd_program(allow: list, policy: str = "strict") -> list:
    """systemd's allow list; policy strict or closed (closed adds systemd's static list)."""
    if policy == "closed":
        allow = SYSTEMD_STATIC + list(allow)
    deny_everything = policy == "strict" and not allow
    prog = [] if deny_everything else list(LOAD_CTX)
    pass_label = Label()
    for rule in allow:
        bits = acc_mask(rule.access)
        nxt = Label()
        if bits != 7:
            prog.append(alu(be.MOV, 1, src=3, x=True))
            prog.append(alu(be.AND, 1, bits))
            _emit_jump(prog, jmp(be.JNE, 1, 0, src=3, x=True), nxt)
        _emit_jump(prog, jmp(be.JNE, 2, 0, TYPE_BITS[rule.dev_type]), nxt)
        if rule.major is not None:
            _emit_jump(prog, jmp(be.JNE, 4, 0, rule.major), nxt)
            if rule.minor is not None:
                _emit_jump(prog, jmp(be.JNE, 5, 0, rule.minor), nxt)
        _emit_jump(prog, ja(0), pass_label)
        _place(prog, nxt)
    if not deny_everything:
        prog += [mov64(0, 0), ja(1)]
        _place(prog, pass_label)
    prog += [mov64(0, 0 if deny_everything else 1), exit_()]
    return prog


def nvidia_prepend(devices: list, original: list, temp_reg: int = 6) -> list:
    """libnvidia-container: spec devices (list of (Rule, allow)) become blocks in front of
    the program already attached; it iterates the list from the end, like the original.

    temp_reg: the access-test scratch register. Current sources use r6; one stored older
    version used r2, which also holds the type, so a failed access test corrupts the next
    block's type test. Both shapes are real; the interpreter must run either like the kernel."""
    prog = [ldx(be.SIZE_H, 2, 1, 0), ldx(be.SIZE_W, 3, 1, 0), alu(be.RSH, 3, 16),
            ldx(be.SIZE_W, 4, 1, 4), ldx(be.SIZE_W, 5, 1, 8)]
    pending = None
    for rule, allow in reversed(devices):
        nxt = Label()
        if pending is not None:
            _place(prog, pending)
        has_type = rule.dev_type != "a"
        bits = acc_mask(rule.access)
        if has_type:
            _emit_jump(prog, jmp(be.JNE, 2, 0, TYPE_BITS[rule.dev_type]), nxt)
        if bits != 7:
            prog.append(alu(be.MOV, temp_reg, src=3, x=True))
            prog.append(alu(be.AND, temp_reg, bits))
            _emit_jump(prog, jmp(be.JNE, temp_reg, 0, src=3, x=True, is32=True), nxt)
        if rule.major is not None:
            _emit_jump(prog, jmp(be.JNE, 4, 0, rule.major), nxt)
        if rule.minor is not None:
            _emit_jump(prog, jmp(be.JNE, 5, 0, rule.minor), nxt)
        prog += [mov32(0, 1 if allow else 0), exit_()]
        pending = nxt
        if not has_type and bits == 7 and rule.major is None and rule.minor is None:
            break   # upstream ignores entries after a full wildcard
    if pending is not None:
        _place(prog, pending)
    return prog + list(original)


# --- random arithmetic, to pin the interpreter's semantics to the kernel's ----------------

ALU_OPS = [be.ADD, be.SUB, be.MUL, be.DIV, be.MOD, be.OR, be.AND, be.LSH, be.RSH, be.ARSH,
           be.XOR, be.MOV, be.NEG]
JMP_OPS = [be.JEQ, be.JNE, be.JGT, be.JGE, be.JLT, be.JLE, be.JSET, be.JSGT, be.JSGE, be.JSLT,
           be.JSLE]
SCRATCH = [2, 3, 4, 5, 6, 7, 8]


def _rand_imm(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 3, 7, 16, 195, 255, 0xFFFF, -1, -2, -195, 0x7FFFFFFF,
                       -0x80000000, rng.randint(-2**31, 2**31 - 1)])


def random_alu_program(rng: random.Random, n_ops: int = 10, n_jumps: int = 3,
                       cpu_v4: bool = False) -> list:
    prog = [ldx(be.SIZE_W, 2, 1, 0), ldx(be.SIZE_W, 4, 1, 4), ldx(be.SIZE_W, 5, 1, 8),
            ldx(be.SIZE_H, 6, 1, 0), ldx(be.SIZE_B, 7, 1, 2), ldx(be.SIZE_H, 3, 1, 2),
            mov64(8, _rand_imm(rng))]
    for _ in range(n_ops):
        op = rng.choice(ALU_OPS)
        is64 = rng.random() < 0.5
        width = 64 if is64 else 32
        dst = rng.choice(SCRATCH)
        off = 0
        if op == be.NEG:
            prog.append(alu(op, dst, is64=is64))
            continue
        use_x = rng.random() < 0.4
        if op in (be.DIV, be.MOD) and cpu_v4 and rng.random() < 0.3:
            off = 1
        if op == be.MOV and use_x and cpu_v4 and rng.random() < 0.3:
            off = rng.choice([8, 16] + ([32] if is64 else []))
        if use_x:
            prog.append(alu(op, dst, src=rng.choice(SCRATCH), x=True, is64=is64, off=off))
        else:
            if op in (be.LSH, be.RSH, be.ARSH):
                imm = rng.randrange(width)
            elif op in (be.DIV, be.MOD):
                imm = rng.choice([1, 2, 3, 7, 255, -1, -7, 0x10001])
            else:
                imm = _rand_imm(rng)
            prog.append(alu(op, dst, imm, is64=is64, off=off))
    allow = Label()
    for _ in range(n_jumps):
        op = rng.choice(JMP_OPS)
        is32 = rng.random() < 0.4
        dst = rng.choice(SCRATCH)
        if rng.random() < 0.4:
            _emit_jump(prog, jmp(op, dst, 0, src=rng.choice(SCRATCH), x=True, is32=is32), allow)
        else:
            _emit_jump(prog, jmp(op, dst, 0, _rand_imm(rng), is32=is32), allow)
    prog += [mov64(0, rng.randint(0, 1)), exit_()]
    _place(prog, allow)
    prog += [mov64(0, rng.randint(0, 1)), exit_()]
    return prog


# --- asking the kernel ------------------------------------------------------------------------

ALLOWED, DENIED = "allow", "deny"


def make_nodes(directory: str, devices) -> dict:
    """mknod a node for each (type, major, minor); returns {(type, major, minor): path}."""
    out = {}
    for dev_type, major, minor in devices:
        path = os.path.join(directory, f"{dev_type}_{major}_{minor}")
        mode = (stat.S_IFCHR if dev_type == "c" else stat.S_IFBLK) | 0o600
        if not os.path.exists(path):
            os.mknod(path, mode, os.makedev(major, minor))
        out[(dev_type, major, minor)] = path
    return out


def _probe_one(nodes: dict, scratch: str, dev_type: str, major: int, minor: int, access: str,
               n: int) -> str:
    try:
        if access == "m":
            path = os.path.join(scratch, f"mknod_{n}")
            mode = (stat.S_IFCHR if dev_type == "c" else stat.S_IFBLK) | 0o600
            os.mknod(path, mode, os.makedev(major, minor))
            os.unlink(path)
        else:
            flags = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}[access]
            os.close(os.open(nodes[(dev_type, major, minor)], flags | os.O_NONBLOCK | os.O_NOCTTY))
        return ALLOWED
    except OSError as e:
        if e.errno == errno.EPERM:
            return DENIED
        if e.errno in (errno.ENXIO, errno.ENODEV):
            return ALLOWED   # past the device cgroup; no driver behind the node
        return f"errno {errno.errorcode.get(e.errno, e.errno)}"


def kernel_probe(procs_files: list, nodes: dict, scratch: str, probes: list) -> list:
    """Fork a child, move it into the cgroups (write its pid to each cgroup.procs), and
    let the kernel answer each probe (type, major, minor, access in r/w/rw/m)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:   # child: never return into pytest
        code = 1
        try:
            os.close(rfd)
            for procs in procs_files:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            answers = [_probe_one(nodes, scratch, *p, n) for n, p in enumerate(probes)]
            os.write(wfd, "\n".join(answers).encode())
            code = 0
        except BaseException as e:   # noqa: BLE001 - report anything to the parent
            try:
                os.write(wfd, f"child failed: {e!r}".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(wfd)
    chunks = []
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(text or f"probe child exited with status {status}")
    answers = text.split("\n") if probes else []
    if len(answers) != len(probes):
        raise RuntimeError(f"probe child answered {len(answers)} of {len(probes)}")
    return answers


# --- real cgroups for the kernel tests --------------------------------------------------------

def free_majors(section: str, candidates=(195, 200, 201, 202, 231, 232, 233, 234, 235, 236)) -> list:
    """Majors with no driver in /proc/devices' section ("Character" or "Block"): open gives ENXIO."""
    used, current = set(), None
    with open("/proc/devices") as f:
        for line in f:
            line = line.strip()
            if line.endswith("devices:"):
                current = line.split()[0]
            elif line and current == section:
                used.add(int(line.split()[0]))
    return [m for m in candidates if m not in used]


def detach_device_programs(cgroup_dir: str) -> None:
    """Detach every BPF_CGROUP_DEVICE program attached to cgroup_dir itself (not inherited ones). bpfprog is
    imported here: the guest's NVIDIA hook stand-in imports this module for nvidia_prepend alone."""
    from nvsymlinkd.access import bpfprog

    fd = bpfprog.open_cgroup_dir(cgroup_dir)
    try:
        for prog_id in bpfprog.query_device_program_ids(fd, effective=False):
            pfd = bpfprog.program_fd(prog_id)
            try:
                bpfprog.detach_device_program(fd, pfd)
            finally:
                os.close(pfd)
    finally:
        os.close(fd)


class CgroupDirs:
    """Fresh cgroup directories under a hierarchy's mount point, removed at close()."""

    def __init__(self, mountpoint: str, tag: str):
        self.mountpoint = mountpoint
        self.tag = f"nvsd-test-{tag}-{os.getpid()}"
        self.made: list = []

    def make(self, rel: str) -> str:
        """rel like 'a' or 'a/b' (parents first); returns the cgroup path as /proc/<pid>/cgroup shows it."""
        path = f"/{self.tag}/{rel}".rstrip("/")
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            d = os.path.join(self.mountpoint, *parts[:i])
            if not os.path.isdir(d):
                os.mkdir(d)
                self.made.append(d)
        return path

    def real(self, cgroup_path: str) -> str:
        return self.mountpoint + cgroup_path

    def close(self) -> None:
        import time
        for d in sorted(self.made, key=len, reverse=True):
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.02)   # a reaped child can take a moment to leave the cgroup
        self.made.clear()
