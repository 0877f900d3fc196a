"""A small, exact interpreter for BPF_CGROUP_DEVICE programs (the kernel's xlated code).

systemd (src/core/bpf-devices.c), runc/crun (devicefilter) and libnvidia-container
(nvcgo/internal/cgroup/ebpf.go) all emit straight-line compare-and-jump code over
the context `struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor;}`
(access_type = access << 16 | type). Rather than pattern-matching their shapes we
run the program on the one request we care about: ALU/ALU64, loads from the
context, JMP/JMP32 and EXIT, with the kernel's semantics (32-bit ops zero-extend,
immediates sign-extend, shifts mask their count, division by zero gives 0).

Anything else (helper calls, map loads, stack memory, back-jumps, unknown
opcodes) makes the result `unknown` with the instruction named: an unevaluated
program never counts as allowing.
"""

from __future__ import annotations

import functools
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, NoReturn, Optional, Sequence, Union

from nvsymlinkd.errors import CannotEvaluate
from nvsymlinkd.host.devices import Access, Device

# instruction classes
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
# sizes (LD/LDX)
SIZE_W, SIZE_H, SIZE_B, SIZE_DW = 0x00, 0x08, 0x10, 0x18
SIZE_BYTES = {SIZE_W: 4, SIZE_H: 2, SIZE_B: 1, SIZE_DW: 8}
# modes
MODE_IMM, MODE_MEM, MODE_MEMSX = 0x00, 0x60, 0x80
# source operand
SRC_K, SRC_X = 0x00, 0x08
# ALU ops
ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR, MOV, ARSH, END = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0)
# JMP ops
JA, JEQ, JGT, JGE, JSET, JNE, JSGT, JSGE, CALL, EXIT, JLT, JLE, JSLT, JSLE = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0)

ALU_NAMES = {ADD: "add", SUB: "sub", MUL: "mul", DIV: "div", OR: "or", AND: "and", LSH: "lsh",
             RSH: "rsh", NEG: "neg", MOD: "mod", XOR: "xor", MOV: "mov", ARSH: "arsh", END: "end"}
JMP_NAMES = {JA: "ja", JEQ: "jeq", JGT: "jgt", JGE: "jge", JSET: "jset", JNE: "jne", JSGT: "jsgt",
             JSGE: "jsge", CALL: "call", EXIT: "exit", JLT: "jlt", JLE: "jle", JSLT: "jslt",
             JSLE: "jsle"}

# struct bpf_cgroup_dev_ctx encoding (include/uapi/linux/bpf.h)
DEV_BLOCK, DEV_CHAR = 1, 2
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4
DEV_TYPES = {"b": DEV_BLOCK, "c": DEV_CHAR}
ACCESS_BITS = {"m": ACC_MKNOD, "r": ACC_READ, "w": ACC_WRITE}

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
NREGS = 12          # r0-r10 and the JIT's hidden AX (r11, seen in constant-blinded code)
MAX_STEPS = 100000  # forward-only execution ends far earlier; a plain safety net

LITTLE = sys.byteorder == "little"
_INSN = struct.Struct("<BBhi" if LITTLE else ">BBhi")


class Insn(NamedTuple):
    code: int
    dst: int
    src: int
    off: int
    imm: int


def decode(raw: bytes) -> list[Insn]:
    """struct bpf_insn array (host byte order, as BPF_OBJ_GET_INFO_BY_FD returns it)."""
    if len(raw) % 8:
        raise ValueError(f"program is {len(raw)} bytes, not a multiple of 8")
    out = []
    for code, regs, off, imm in _INSN.iter_unpack(raw):
        # dst_reg:4 / src_reg:4 bitfields: low nibble first on little-endian hosts
        dst, src = (regs & 0x0F, regs >> 4) if LITTLE else (regs >> 4, regs & 0x0F)
        out.append(Insn(code, dst, src, off, imm))
    return out


def encode(insns: Sequence[Insn]) -> bytes:
    parts: list[bytes] = []
    for i in insns:
        regs = (i.dst & 0x0F) | ((i.src & 0x0F) << 4) if LITTLE else ((i.dst & 0x0F) << 4) | (i.src & 0x0F)
        imm = _s32(i.imm)   # accept unsigned spellings of 32-bit immediates
        parts.append(_INSN.pack(i.code, regs, i.off, imm))
    return b"".join(parts)


def make_ctx(device: Device, access: Access) -> bytes:
    """The context the kernel passes for one check (access letters combined, as the kernel does)."""
    bits = access_bits(access)
    return struct.pack("=III", (bits << 16) | DEV_TYPES[device.type], device.major & M32, device.minor & M32)


def access_bits(access: str) -> int:
    """The context's access bits of letters ("rw" -> ACC_READ | ACC_WRITE)."""
    bits = 0
    for letter in access:
        bits |= ACCESS_BITS[letter]
    return bits


def access_of(bits: int) -> Access:
    """The letters of access bits (ACC_READ | ACC_WRITE -> "rw")."""
    return Access("".join(letter for letter, bit in ACCESS_BITS.items() if bits & bit))


@dataclass(frozen=True)
class EvalResult:
    allowed: Optional[bool]   # None: could not evaluate
    reason: str
    steps: int = 0


class Ptr(NamedTuple):
    region: str   # "ctx" or "stack"
    off: int


# a register: unset, a scalar, or a pointer into the context or the stack (typing's: evaluated at import)
Reg = Union[None, int, Ptr]
Fail = Callable[[str], NoReturn]
Scalar = Callable[[int], int]


def _s64(v: int) -> int:
    return v - (1 << 64) if v & (1 << 63) else v


def _s32(v: int) -> int:
    v &= M32
    return v - (1 << 32) if v & (1 << 31) else v


def _sext(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v & (1 << (bits - 1)) else v


def _tdiv(a: int, b: int) -> int:
    """C division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def describe_insn(insn: Insn) -> str:
    cls = insn.code & 7
    if cls in (ALU, ALU64):
        name = ALU_NAMES.get(insn.code & 0xF0, f"op{insn.code & 0xF0:#x}")
        return f"BPF_{'ALU64' if cls == ALU64 else 'ALU'} {name}"
    if cls in (JMP, JMP32):
        op = insn.code & 0xF0
        if op == CALL:
            return "BPF_CALL"
        if op == EXIT:
            return "BPF_EXIT"
        return f"BPF_{'JMP32' if cls == JMP32 else 'JMP'} {JMP_NAMES.get(op, hex(op))}"
    if insn.code == (LD | MODE_IMM | SIZE_DW):
        return f"BPF_LD_IMM64 src={insn.src}"
    return {LD: "BPF_LD", LDX: "BPF_LDX", ST: "BPF_ST", STX: "BPF_STX"}[cls] + f" code={insn.code:#04x}"


def evaluate(insns: Sequence[Insn], ctx: bytes) -> EvalResult:
    """Run a decoded program on one context; allowed when r0's low bit is set (the kernel's test)."""
    regs: list[Reg] = [None] * NREGS
    regs[1] = Ptr("ctx", 0)
    regs[10] = Ptr("stack", 0)
    pc = 0
    steps = 0
    n = len(insns)

    def fail(why: str) -> NoReturn:
        raise CannotEvaluate(f"cannot evaluate insn {pc} ({why})")

    def scalar(reg: int) -> int:
        v = regs[reg]
        if v is None:
            fail(f"r{reg} read before it is set")
        if isinstance(v, Ptr):
            fail(f"arithmetic on {v.region} pointer r{reg}")
        return v

    try:
        while True:
            if not 0 <= pc < n:
                raise CannotEvaluate(f"cannot evaluate: execution left the program at insn {pc}")
            steps += 1
            if steps > MAX_STEPS:
                fail("step limit")
            insn = insns[pc]
            if insn.dst >= NREGS or insn.src >= NREGS:
                fail(f"register out of range in {describe_insn(insn)}")
            cls = insn.code & 7
            if cls in (ALU, ALU64):
                regs[insn.dst] = alu(insn, cls == ALU64, regs, scalar, fail)
                pc += 1
            elif cls == LDX:
                regs[insn.dst] = _load(insn, regs, ctx, fail)
                pc += 1
            elif cls == LD:
                if insn.code != (LD | MODE_IMM | SIZE_DW):
                    fail(describe_insn(insn))
                if insn.src != 0:
                    fail(f"BPF_LD_IMM64 src={insn.src}: loads a map or kernel object")
                if pc + 1 >= n:
                    fail("truncated BPF_LD_IMM64")
                regs[insn.dst] = (insn.imm & M32) | ((insns[pc + 1].imm & M32) << 32)
                pc += 2
            elif cls in (JMP, JMP32):
                op = insn.code & 0xF0
                if op == EXIT:
                    r0 = scalar(0)
                    verdict = bool(r0 & 1)
                    return EvalResult(verdict, f"returns {r0} at insn {pc}", steps)
                if op == CALL:
                    # xlated helper calls carry a kernel address offset, not the helper id
                    what = "calls a BPF function" if insn.src == 1 else "calls a kernel helper"
                    fail(f"BPF_CALL: {what}")
                if op == JA:
                    if insn.code & SRC_X:
                        fail(describe_insn(insn))
                    delta = insn.off if cls == JMP else insn.imm
                    taken = True
                else:
                    if op not in JMP_NAMES:
                        fail(describe_insn(insn))
                    taken = condition(insn, cls == JMP32, regs, scalar, fail)
                    delta = insn.off
                target = pc + 1 + delta if taken else pc + 1
                if target <= pc:
                    fail(f"{describe_insn(insn)} jumps back to insn {target} (a loop)")
                pc = target
            else:
                fail(f"{describe_insn(insn)}: writes memory")
    except CannotEvaluate as e:
        return EvalResult(None, str(e), steps)


def _load(insn: Insn, regs: list[Reg], ctx: bytes, fail: Fail) -> int:
    mode = insn.code & 0xE0
    size = SIZE_BYTES[insn.code & 0x18]
    if mode not in (MODE_MEM, MODE_MEMSX):
        fail(describe_insn(insn))
    base = regs[insn.src]
    if not isinstance(base, Ptr) or base.region != "ctx":
        fail(f"BPF_LDX from r{insn.src}, which is not the context pointer")
    off = base.off + insn.off
    if off < 0 or off + size > len(ctx):
        fail(f"BPF_LDX at context offset {off} size {size}, outside the {len(ctx)}-byte context")
    value = int.from_bytes(ctx[off:off + size], sys.byteorder)
    if mode == MODE_MEMSX:
        value = _sext(value, size * 8) & M64
    return value


def alu(insn: Insn, is64: bool, regs: list[Reg], scalar: Scalar, fail: Fail) -> int | Ptr:
    op = insn.code & 0xF0
    width = 64 if is64 else 32
    mask = M64 if is64 else M32
    use_x = bool(insn.code & SRC_X)

    if op == END:
        if insn.imm not in (16, 32, 64):
            fail(f"byte swap of width {insn.imm}")
        v = scalar(insn.dst) & ((1 << insn.imm) - 1)
        # ALU64 END is an unconditional swap (cpu v4); ALU END|X converts to big-endian, END|K to little
        if is64 or use_x == LITTLE:
            v = int.from_bytes(v.to_bytes(insn.imm // 8, "little"), "big")
        return v

    if op == MOV:
        if use_x:
            src = regs[insn.src]
            if isinstance(src, Ptr):
                if is64 and insn.off == 0:
                    return src  # pointer copy
                fail(f"32-bit move of {src.region} pointer r{insn.src}")
            v = scalar(insn.src)
            if insn.off in (8, 16, 32):   # MOVSX (cpu v4)
                v = _sext(v, insn.off)
            elif insn.off != 0:
                fail(f"mov with offset {insn.off}")
            return v & mask
        return (insn.imm if is64 else insn.imm & M32) & mask

    if insn.off != 0 and op not in (DIV, MOD):
        fail(f"{describe_insn(insn)} with offset {insn.off}")

    dst_val = regs[insn.dst]
    if use_x and insn.src == insn.dst and op in (XOR, SUB) and not isinstance(dst_val, Ptr):
        return 0   # zeroing idiom; constant blinding (bpf_jit_harden) emits it for `mov r, 0`
    if isinstance(dst_val, Ptr):
        # pointer arithmetic on the context pointer: only +/- constant (compilers emit it)
        if is64 and not use_x and op in (ADD, SUB):
            return Ptr(dst_val.region, dst_val.off + (insn.imm if op == ADD else -insn.imm))
        fail(f"{describe_insn(insn)} on {dst_val.region} pointer r{insn.dst}")
    a = scalar(insn.dst) & mask
    if op == NEG:
        return (-a) & mask
    b = (scalar(insn.src) if use_x else insn.imm) & mask

    if op == ADD:
        return (a + b) & mask
    if op == SUB:
        return (a - b) & mask
    if op == MUL:
        return (a * b) & mask
    if op == OR:
        return a | b
    if op == AND:
        return a & b
    if op == XOR:
        return a ^ b
    if op == LSH:
        return (a << (b & (width - 1))) & mask
    if op == RSH:
        return a >> (b & (width - 1))
    if op == ARSH:
        return (_sext(a, width) >> (b & (width - 1))) & mask
    if op in (DIV, MOD):
        signed = insn.off == 1
        if insn.off not in (0, 1):
            fail(f"{describe_insn(insn)} with offset {insn.off}")
        if b == 0:
            return 0 if op == DIV else a   # BPF: x/0 = 0, x%0 = x
        if not signed:
            return a // b if op == DIV else a % b
        sa, sb = _sext(a, width), _sext(b, width)
        q = _tdiv(sa, sb)
        return (q if op == DIV else sa - q * sb) & mask
    fail(describe_insn(insn))  # raises
    raise AssertionError("unreachable")


def condition(insn: Insn, is32: bool, regs: list[Reg], scalar: Scalar, fail: Fail) -> bool:
    op = insn.code & 0xF0
    a = scalar(insn.dst)
    b = scalar(insn.src) if insn.code & SRC_X else insn.imm & M64
    if is32:
        a, b = a & M32, b & M32
        sa, sb = _s32(a), _s32(b)
    else:
        sa, sb = _s64(a), _s64(b)
    if op == JEQ:
        return a == b
    if op == JNE:
        return a != b
    if op == JGT:
        return a > b
    if op == JGE:
        return a >= b
    if op == JLT:
        return a < b
    if op == JLE:
        return a <= b
    if op == JSET:
        return bool(a & b)
    if op == JSGT:
        return sa > sb
    if op == JSGE:
        return sa >= sb
    if op == JSLT:
        return sa < sb
    if op == JSLE:
        return sa <= sb
    fail(describe_insn(insn))


def check(insns: Sequence[Insn], device: Device, access: Access) -> EvalResult:
    return evaluate(insns, make_ctx(device, access))


def guess_producer(name: str, insns: Sequence[Insn]) -> str:
    """Best guess of who generated a device program, for humans only (never for decisions)."""
    if name.startswith("sd_"):
        return "systemd"
    if name == "nvsymlinkd":
        return "nvsymlinkd repair"     # repair.bpfrepair.PROGRAM_NAME
    if not insns:
        return "unknown producer"
    first = insns[0]
    if first.code == (LDX | MODE_MEM | SIZE_H) and first.dst == 2 and first.src == 1:
        return "libnvidia-container"   # it loads the type with a 16-bit load
    # shape, robust to constant blinding (which rewrites immediates, not jumps or exits)
    exits = sum(1 for i in insns if i.code == (JMP | EXIT))
    has_ja = any(i.code == (JMP | JA) for i in insns)
    loads_type = first.code == (LDX | MODE_MEM | SIZE_W) and first.dst == 2 and first.src == 1
    if has_ja and exits == 1:
        return "systemd"               # PASS jumps to one shared `mov64 r0, 1; exit`
    if loads_type and not has_ja:
        return "runc/crun"             # `mov32 r0, 0|1; exit` after each rule block
    return "unknown producer"



# --- every verdict of a program at once ---------------------------------------------------------
#
# Evaluating a program on one request says nothing about the 2^32 majors and minors it was not run
# on. `decisions` runs it once with the device numbers left symbolic, over every context the kernel
# can pass at once (2 types x 7 access sets: the access_type word is concrete in each, so a value
# computed from it is a vector, one value per context), and yields its verdict on every (type, access,
# major, minor) as a partition: each part is a major (one number, or every number but some), a minor
# (likewise) and the exit that decides them. `distinguished` is what it compared the numbers with: two
# devices whose numbers are in none of those sets follow one path (proof.classes turns these sets into
# classes).
#
# A number may only be copied (mov, mov32: it is a u32), masked with all ones and compared for
# equality with a constant (jeq/jne, 32 or 64 bits), which is all runc, crun, systemd and
# libnvidia-container do with it; anything else is understood only where every path reaching it
# already knows the number (it was compared equal). Anything else done with a number (arithmetic,
# an ordering compare, a partial load) raises CannotEvaluate: such a program is not fully decoded.
#
# The paths are run in instruction order (the programs jump forward only), and paths that reach one
# instruction with the same registers are one state holding all their parts: a runc program of n
# rules takes about one pass over its instructions, not one per major it names (issue 38: the proof
# of 1,000 rules went from seconds to milliseconds). tests/bpfproof_reference.py keeps the path by
# path evaluation this replaced; tests/test_bpfproof.py holds the two to the same answers.

MAJOR, MINOR = "major", "minor"
ACCESS_SETS = tuple(range(1, 8))   # every non-empty combination of ACC_MKNOD | ACC_READ | ACC_WRITE
CONTEXTS = tuple((tname, tbits, access) for tname, tbits in DEV_TYPES.items() for access in ACCESS_SETS)
MAX_PARTS = 1_000_000              # parts of the partition over every context: beyond, not decoded
MAX_STATE_STEPS = 4_000_000        # instructions run over every state (~10 s): beyond, not decoded


class _Sym(NamedTuple):
    field: str   # MAJOR or MINOR: the context's u32, unchanged


class _Vec(tuple):  # type: ignore[type-arg]
    """A value computed from the access_type word: one per context, in CONTEXTS' order."""


# a minor in a part: one number (int), or every number but these (a set, owned by one part: a split adds
# the number it took out in place, where a copy per split made a MIG program's 1,000 minors quadratic)
MinorSpec = Union[int, set[int]]
Value = Union[Reg, _Sym, _Vec]
Leaf = tuple[int, int]   # (r0, the exit's insn)


class _Parts:
    """The (major, minor) pairs of one context that a state holds: known[M] the minors of major M,
    other the (majors but these, minor) pairs. Disjoint: each pair follows one path."""

    __slots__ = ("known", "other")

    def __init__(self, known: dict[int, list[MinorSpec]], other: list[tuple[set[int], MinorSpec]]) -> None:
        self.known = known
        self.other = other


class _State:
    __slots__ = ("regs", "parts")

    def __init__(self, regs: list[Value], parts: dict[int, _Parts]) -> None:
        self.regs = regs
        self.parts = parts   # context index -> its pairs


@dataclass(frozen=True)
class Distinguished:
    """The numbers a program compares a device's major and minor with, per device type.

    majors[t]: every constant a major of type t is compared with; minors[t][m]: the constants a
    minor is compared with while the major is known to be m (None: on a path where the major was
    not yet known, which holds for every major)."""

    majors: dict[str, frozenset[int]]
    minors: dict[str, dict[Optional[int], frozenset[int]]]


class _Table:
    """One context's partition, indexed: exact (major, minor); major M with every minor but some;
    every major but some with minor m; every major but some with every minor but some."""

    __slots__ = ("exact", "major_rest", "other_exact", "other_rest")

    def __init__(self) -> None:
        self.exact: dict[tuple[int, int], Leaf] = {}
        self.major_rest: dict[int, list[tuple[set[int], Leaf]]] = {}
        self.other_exact: dict[int, list[tuple[set[int], Leaf]]] = {}
        self.other_rest: list[tuple[set[int], set[int], Leaf]] = []

    def find(self, major: int, minor: int) -> Leaf:
        leaf = self.exact.get((major, minor))
        if leaf is not None:
            return leaf
        for excluded, leaf in self.major_rest.get(major, ()):
            if minor not in excluded:
                return leaf
        for excluded, leaf in self.other_exact.get(minor, ()):
            if major not in excluded:
                return leaf
        for excluded, excluded_minors, leaf in self.other_rest:
            if major not in excluded and minor not in excluded_minors:
                return leaf
        raise AssertionError(f"no part holds {major}:{minor}")   # the parts cover every pair


class Decisions:
    """Every verdict of one program (decisions()): what evaluate() answers, without running it."""

    def __init__(self, tables: list[_Table], found: Distinguished) -> None:
        self._tables = tables
        self.distinguished = found

    def exit_of(self, device: Device, access_bits: int) -> Leaf:
        """(r0, the exit's insn) for a request (access bits ACC_*, non-empty)."""
        index = _TYPE_INDEX[device.type] * len(ACCESS_SETS) + access_bits - 1
        return self._tables[index].find(device.major & M32, device.minor & M32)

    def allows(self, device: Device, access_bits: int) -> bool:
        return bool(self.exit_of(device, access_bits)[0] & 1)

    def allowed(self, device: Device, requests: Sequence[int]) -> set[int]:
        """Which of the requests (access bits each) the program allows for the device."""
        first = _TYPE_INDEX[device.type] * len(ACCESS_SETS) - 1
        major, minor, tables = device.major & M32, device.minor & M32, self._tables
        return {bits for bits in requests if tables[first + bits].find(major, minor)[0] & 1}

    def check(self, device: Device, access: Access) -> EvalResult:
        """What check() returns (steps aside)."""
        r0, pc = self.exit_of(device, access_bits(access))
        return EvalResult(bool(r0 & 1), f"returns {r0} at insn {pc}")


_TYPE_INDEX = {tname: i for i, tname in enumerate(DEV_TYPES)}
_CTX_TYPE = tuple(tname for tname, _, _ in CONTEXTS)
_MISS = object()


def distinguished(insns: Sequence[Insn]) -> Distinguished:
    """Every constant the program compares the major and minor with (see above); CannotEvaluate when
    the program does anything else with them, or is not a forward-only program `evaluate` can run."""
    return decisions(insns).distinguished


def decisions(insns: Sequence[Insn]) -> Decisions:
    """Every verdict of the program (see above); CannotEvaluate when it is not fully decoded. The last
    programs' answers are kept: a repair asks about the same programs several times."""
    return _decisions(tuple(insns))


@functools.lru_cache(maxsize=16)
def _decisions(insns: tuple[Insn, ...]) -> Decisions:
    return _Run(insns).run()


class _Run:
    """One symbolic run of a program over every context (decisions())."""

    def __init__(self, insns: Sequence[Insn]) -> None:
        self.insns = insns
        self.pc = 0
        self.tables = [_Table() for _ in CONTEXTS]
        self.majors: dict[str, set[int]] = {t: set() for t in DEV_TYPES}
        self.minors: dict[str, dict[Optional[int], set[int]]] = {t: {} for t in DEV_TYPES}
        self.memo: dict[tuple[Any, ...], Any] = {}
        self.parts = 0
        self.steps = 0

    def fail(self, why: str) -> NoReturn:
        raise CannotEvaluate(f"cannot decode insn {self.pc} ({why})")

    def run(self) -> Decisions:
        regs: list[Value] = [None] * NREGS
        regs[1] = Ptr("ctx", 0)
        regs[10] = Ptr("stack", 0)
        every = {i: _Parts({}, [(set(), set())]) for i in range(len(CONTEXTS))}
        n, step = len(self.insns), self.step
        pending: list[Optional[list[_State]]] = [None] * n    # the states waiting at each insn
        pending[0] = [_State(regs, every)]
        for pc in range(n):
            states = pending[pc]
            if states is None:
                continue
            pending[pc] = None
            self.pc = pc
            for state in _merged(states) if len(states) > 1 else states:
                for target, out in step(state):
                    if target <= pc:
                        self.fail(f"{describe_insn(self.insns[pc])} jumps back to insn {target} (a loop)")
                    if target >= n:
                        raise CannotEvaluate(f"cannot decode: execution left the program at insn {target}")
                    waiting = pending[target]
                    if waiting is None:
                        pending[target] = [out]
                    else:
                        waiting.append(out)
        return Decisions(self.tables, Distinguished(
            {t: frozenset(v) for t, v in self.majors.items()},
            {t: {k: frozenset(v) for k, v in by.items()} for t, by in self.minors.items()}))

    # --- one instruction ---

    def scalar_of(self, regs: Sequence[Value]) -> Scalar:
        def scalar(reg: int) -> int:
            v = regs[reg]
            if v is None:
                self.fail(f"r{reg} read before it is set")
            if type(v) is Ptr:
                self.fail(f"arithmetic on {v.region} pointer r{reg}")
            if type(v) is _Sym:
                self.fail(f"arithmetic on the device's {v.field}")
            return v  # type: ignore[return-value]
        return scalar

    def again(self, states: list[_State]) -> list[tuple[int, _State]]:
        out: list[tuple[int, _State]] = []
        for s in states:
            out += self.step(s)
        return out

    def step(self, state: _State) -> list[tuple[int, _State]]:
        """The instruction at self.pc on STATE: the (next pc, state) pairs it leads to."""
        self.steps += 1
        if self.steps > MAX_STATE_STEPS:
            self.fail(f"step limit: more than {MAX_STATE_STEPS} instructions over every path")
        insn = self.insns[self.pc]
        if insn.dst >= NREGS or insn.src >= NREGS:
            self.fail(f"register out of range in {describe_insn(insn)}")
        cls = insn.code & 7
        if cls in (ALU, ALU64):
            return self.step_alu(state, insn, cls)
        if cls in (LDX, LD):
            return self.step_load(state, insn, cls)
        if cls not in (JMP, JMP32):
            self.fail(f"{describe_insn(insn)}: writes memory")
        return self.step_jump(state, insn, cls)

    def step_alu(self, state: _State, insn: Insn, cls: int) -> list[tuple[int, _State]]:
        """Arithmetic: a number, a per-context vector, or (on the device's fields) a split first."""
        pc, regs, use_x, op = self.pc, state.regs, bool(insn.code & SRC_X), insn.code & 0xF0
        if op == MOV and not use_x:   # a constant (what alu does; the producers' verdicts are these)
            regs[insn.dst] = insn.imm & (M64 if cls == ALU64 else M32)
            return [(pc + 1, state)]
        dst, src = regs[insn.dst], regs[insn.src] if use_x else None
        if type(src) is _Sym:
            if op == MOV and insn.off == 0:
                regs[insn.dst] = src      # mov and mov32 of a u32: the number itself
                return [(pc + 1, state)]
            if not (op in (XOR, SUB) and insn.src == insn.dst):
                return self.again(self.known(state, src.field, f"{describe_insn(insn)} uses the device's "
                                                               f"{src.field}"))
        if type(dst) is _Sym and op != MOV:
            ones = M64 if cls == ALU64 else M32
            if op == AND and not use_x and (insn.imm & ones) == ones:
                return [(pc + 1, state)]  # and with all ones: the number itself
            if op in (XOR, SUB) and use_x and insn.src == insn.dst:
                regs[insn.dst] = 0
                return [(pc + 1, state)]
            return self.again(self.known(state, dst.field, f"{describe_insn(insn)} on the device's {dst.field}"))
        if type(dst) is _Vec or type(src) is _Vec:
            key = (insn, dst, src)
            hit = self.memo.get(key, _MISS)
            if hit is _MISS:
                hit = self.memo[key] = self.per_context(
                    lambda tmp: alu(insn, cls == ALU64, tmp, self.scalar_of(tmp), self.fail), insn, dst, src)
            regs[insn.dst] = hit
        else:
            regs[insn.dst] = alu(insn, cls == ALU64, regs, self.scalar_of(regs), self.fail)  # type: ignore[arg-type]
        return [(pc + 1, state)]

    def step_load(self, state: _State, insn: Insn, cls: int) -> list[tuple[int, _State]]:
        """A load from the 12-byte context (BPF_LDX) or a 64-bit constant (BPF_LD | BPF_IMM | BPF_DW)."""
        pc, regs = self.pc, state.regs
        if cls == LDX:
            mode = insn.code & 0xE0
            base = regs[insn.src]
            if mode != MODE_MEM or type(base) is not Ptr or base.region != "ctx":
                self.fail(describe_insn(insn) + " (not a plain load from the context)")
            off, size = base.off + insn.off, SIZE_BYTES[insn.code & 0x18]
            if off < 0 or off + size > 12:
                self.fail(f"BPF_LDX at context offset {off} size {size}, outside the 12-byte context")
            regs[insn.dst] = self.load(off, size)
            return [(pc + 1, state)]
        # BPF_LD
        if insn.code != (LD | MODE_IMM | SIZE_DW) or insn.src != 0 or pc + 1 >= len(self.insns):
            self.fail(describe_insn(insn))
        regs[insn.dst] = (insn.imm & M32) | ((self.insns[pc + 1].imm & M32) << 32)
        return [(pc + 2, state)]

    def step_jump(self, state: _State, insn: Insn, cls: int) -> list[tuple[int, _State]]:
        """Exit (a leaf: the verdict), a jump, or a condition: both ways, or the contexts split between them."""
        pc, regs, use_x, op = self.pc, state.regs, bool(insn.code & SRC_X), insn.code & 0xF0
        if op == EXIT:
            r0 = regs[0]
            if type(r0) is _Sym:
                return self.again(self.known(state, r0.field, f"arithmetic on the device's {r0.field}"))
            if type(r0) is not _Vec:
                self.scalar_of(regs)(0)
            self.leaf(state, r0, pc)    # type: ignore[arg-type]
            return []
        if op == CALL:
            self.fail("BPF_CALL")
        if op == JA:
            if use_x:
                self.fail(describe_insn(insn))
            return [(pc + 1 + (insn.off if cls == JMP else insn.imm), state)]
        if op not in JMP_NAMES:
            self.fail(describe_insn(insn))
        a, b = regs[insn.dst], regs[insn.src] if use_x else None
        if type(b) is _Sym and type(a) is not _Sym:
            return self.again(self.known(state, b.field, f"{describe_insn(insn)} compares with the device's {b.field}"))
        if type(a) is _Sym:
            return self.jump_on_field(state, insn, cls, a, b)
        taken_target = pc + 1 + insn.off
        if type(a) is _Vec or type(b) is _Vec:
            key = (insn, a, b)
            taken = self.memo.get(key, _MISS)
            if taken is _MISS:
                taken = self.memo[key] = self.per_context(
                    lambda tmp: condition(insn, cls == JMP32, tmp, self.scalar_of(tmp), self.fail), insn, a, b)
            if type(taken) is not _Vec:
                return [(taken_target if taken else pc + 1, state)]
            parts = state.parts
            yes = [i for i in parts if taken[i]]
            if len(yes) == len(parts) or not yes:    # every context of the state goes one way
                return [(taken_target if yes else pc + 1, state)]
            state.parts = {i: p for i, p in parts.items() if not taken[i]}
            return [(taken_target, _State(list(regs), {i: parts[i] for i in yes})), (pc + 1, state)]
        taken = condition(insn, cls == JMP32, regs, self.scalar_of(regs), self.fail)  # type: ignore[arg-type]
        return [(taken_target if taken else pc + 1, state)]

    def jump_on_field(self, state: _State, insn: Insn, cls: int, a: _Sym, b: Value) -> list[tuple[int, _State]]:
        """A condition on one of the device's fields: equality with a constant splits the state's parts."""
        pc, use_x, op = self.pc, bool(insn.code & SRC_X), insn.code & 0xF0
        if op not in (JEQ, JNE):
            return self.again(self.known(state, a.field, f"{describe_insn(insn)} on the device's {a.field}: "
                                                         "only equality is understood"))
        if use_x and type(b) is not int:
            why = f"{describe_insn(insn)} compares the device's {a.field} with a non-constant"
            if type(b) is _Sym:
                return self.again(self.known(state, b.field, why))
            if type(b) is _Vec:
                return self.again(_per_context_states(state))
            self.fail(why)
        c = b if use_x else insn.imm & M64
        if cls == JMP32:
            c &= M32   # type: ignore[operator]
        equal_target = pc + 1 + insn.off if op == JEQ else pc + 1
        other_target = pc + 1 if op == JEQ else pc + 1 + insn.off
        if equal_target <= pc or other_target <= pc:
            self.fail(f"{describe_insn(insn)} jumps back (a loop)")
        if c > M32:            # type: ignore[operator]
            return [(other_target, state)]   # a u32 never equals it
        equal = self.split(state, a.field, c)   # type: ignore[arg-type]
        out = [(equal_target, equal)] if equal is not None else []
        return out + ([(other_target, state)] if state.parts else [])

    def per_context(self, fn: Callable[[list[Reg]], Any], insn: Insn, dst: Value, src: Value) -> Any:
        """fn on each context's values of the operands: one value when all agree, else a _Vec (the callers
        memoize it: runc's blocks compute the same access test again and again)."""
        out = []
        for i in range(len(CONTEXTS)):
            tmp: list[Reg] = [None] * NREGS
            tmp[insn.dst] = dst[i] if type(dst) is _Vec else dst  # type: ignore[assignment]
            if insn.code & SRC_X and insn.src != insn.dst:
                tmp[insn.src] = src[i] if type(src) is _Vec else src  # type: ignore[assignment]
            out.append(fn(tmp))
        return out[0] if all(v == out[0] for v in out) else _Vec(out)

    def load(self, off: int, size: int) -> Value:
        if off + size <= 4:
            values = [_ctx_value(tbits, access, off, size, self.fail) for _, tbits, access in CONTEXTS]
            return values[0] if all(v == values[0] for v in values) else _Vec(values)
        if size == 4 and off in (4, 8):
            return _Sym(MAJOR if off == 4 else MINOR)
        self.fail(f"a {size}-byte load at context offset {off}: only whole u32 device numbers are understood")

    # --- the parts ---

    def known(self, state: _State, field: str, why: str) -> list[_State]:
        """The state split by the value of `field` in its parts, that value in place of the number in the
        registers (what the path already knows); CannotEvaluate (why) when some part does not know it."""
        by: dict[int, dict[int, _Parts]] = {}
        for i, p in state.parts.items():
            if field == MAJOR:
                if p.other:
                    self.fail(why)
                for m, specs in p.known.items():
                    by.setdefault(m, {})[i] = _Parts({m: specs}, [])
            else:
                for m, specs in p.known.items():
                    for spec in specs:
                        if type(spec) is not int:
                            self.fail(why)
                        by.setdefault(spec, {}).setdefault(i, _Parts({}, [])).known[m] = [spec]
                for excluded, spec in p.other:
                    if type(spec) is not int:
                        self.fail(why)
                    by.setdefault(spec, {}).setdefault(i, _Parts({}, [])).other.append((excluded, spec))
        sym = _Sym(field)
        return [_State([value if v == sym and type(v) is _Sym else v for v in state.regs], parts)
                for value, parts in by.items()]

    def split(self, state: _State, field: str, c: int) -> Optional[_State]:
        """Take the pairs whose `field` equals c out of the state (which keeps the others) into a new one."""
        equal: dict[int, _Parts] = {}
        parts = state.parts
        split = self._split_major if field == MAJOR else self._split_minor
        for i, p in list(parts.items()):
            got = split(p, c, _CTX_TYPE[i])
            if got is not None:
                equal[i] = got
            if not p.known and not p.other:
                del parts[i]
        return _State(list(state.regs), equal) if equal else None

    def _split_major(self, p: _Parts, c: int, tname: str) -> Optional[_Parts]:
        specs = p.known.pop(c, None)
        if p.other:
            rest: list[tuple[set[int], MinorSpec]] = []
            for excluded, spec in p.other:
                if c in excluded:
                    rest.append((excluded, spec))
                    continue
                self.majors[tname].add(c)
                if specs is None:
                    specs = []
                specs.append(spec if type(spec) is int else set(spec))   # type: ignore[arg-type]
                excluded.add(c)
                rest.append((excluded, spec))
            p.other = rest
        return _Parts({c: specs}, []) if specs else None

    def _split_minor(self, p: _Parts, c: int, tname: str) -> Optional[_Parts]:
        out = _Parts({}, [])
        for m in list(p.known):
            eq, ne = self._split_specs(p.known[m], c, tname, m)
            if eq is not None:
                out.known[m] = [eq]
            if ne:
                p.known[m] = ne
            else:
                del p.known[m]
        if p.other:
            rest = []
            for excluded, spec in p.other:
                eq, ne = self._split_specs([spec], c, tname, None)
                if eq is not None:
                    out.other.append((set(excluded), eq))
                rest += [(excluded, s) for s in ne]
            p.other = rest
        return out if out.known or out.other else None

    def _split_specs(self, specs: list[MinorSpec], c: int, tname: str,
                     major: Optional[int]) -> tuple[Optional[int], list[MinorSpec]]:
        eq: Optional[int] = None
        ne: list[MinorSpec] = []
        for spec in specs:
            if type(spec) is int:
                if spec == c:
                    eq = c
                else:
                    ne.append(spec)
            elif c in spec:  # type: ignore[operator]
                ne.append(spec)
            else:
                self.minors[tname].setdefault(major, set()).add(c)
                eq = c
                spec.add(c)  # type: ignore[union-attr]
                ne.append(spec)
        return eq, ne

    def leaf(self, state: _State, r0: Union[int, _Vec], pc: int) -> None:
        for i, p in state.parts.items():
            leaf: Leaf = (r0[i] if type(r0) is _Vec else r0, pc)  # type: ignore[assignment]
            table = self.tables[i]
            for m, specs in p.known.items():
                for spec in specs:
                    if type(spec) is int:
                        table.exact[(m, spec)] = leaf
                    else:
                        table.major_rest.setdefault(m, []).append((spec, leaf))  # type: ignore[arg-type]
                self.parts += len(specs)
            for excluded, spec in p.other:
                if type(spec) is int:
                    table.other_exact.setdefault(spec, []).append((excluded, leaf))
                else:
                    table.other_rest.append((excluded, spec, leaf))  # type: ignore[arg-type]
            self.parts += len(p.other)
        if self.parts > MAX_PARTS:
            self.fail(f"more than {MAX_PARTS} parts: the program tells too many devices apart")


def _merged(states: list[_State]) -> list[_State]:
    """States with the same registers as one (their parts joined: disjoint, each pair follows one path)."""
    if len(states) == 1:
        return states
    by: dict[tuple[Value, ...], _State] = {}
    for s in states:
        key = tuple(s.regs)
        into = by.get(key)
        if into is None:
            by[key] = s
            continue
        for i, p in s.parts.items():
            q = into.parts.get(i)
            if q is None:
                into.parts[i] = p
                continue
            if len(q.known) < len(p.known):
                q.known, p.known = p.known, q.known
            for m, specs in p.known.items():
                mine = q.known.get(m)
                if mine is None:
                    q.known[m] = specs
                else:
                    mine.extend(specs)
            q.other.extend(p.other)
    return list(by.values())


def _per_context_states(state: _State) -> list[_State]:
    """The state as one state per context, each context's values in its registers."""
    return [_State([v[i] if type(v) is _Vec else v for v in state.regs], {i: p})
            for i, p in state.parts.items()]


def _ctx_value(ctx_type: int, access: int, off: int, size: int, fail: Fail) -> Union[int, _Sym]:
    """A context load: the access_type word is concrete, the numbers symbolic (whole u32 loads only)."""
    word = ((access << 16) | ctx_type).to_bytes(4, sys.byteorder)
    if off + size <= 4:
        return int.from_bytes(word[off:off + size], sys.byteorder)
    if size == 4 and off in (4, 8):
        return _Sym(MAJOR if off == 4 else MINOR)
    fail(f"a {size}-byte load at context offset {off}: only whole u32 device numbers are understood")
