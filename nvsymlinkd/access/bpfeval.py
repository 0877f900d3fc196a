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

import struct
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple, NoReturn, Optional, Sequence, Union

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
    bits = 0
    for letter in access:
        bits |= ACCESS_BITS[letter]
    return struct.pack("=III", (bits << 16) | DEV_TYPES[device.type], device.major & M32, device.minor & M32)


@dataclass(frozen=True)
class EvalResult:
    allowed: Optional[bool]   # None: could not evaluate
    reason: str
    steps: int = 0


class _Ptr(NamedTuple):
    region: str   # "ctx" or "stack"
    off: int


# a register: unset, a scalar, or a pointer into the context or the stack (typing's: evaluated at import)
Reg = Union[None, int, _Ptr]
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
    regs[1] = _Ptr("ctx", 0)
    regs[10] = _Ptr("stack", 0)
    pc = 0
    steps = 0
    n = len(insns)

    def fail(why: str) -> NoReturn:
        raise CannotEvaluate(f"cannot evaluate insn {pc} ({why})")

    def scalar(reg: int) -> int:
        v = regs[reg]
        if v is None:
            fail(f"r{reg} read before it is set")
        if isinstance(v, _Ptr):
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
                regs[insn.dst] = _alu(insn, cls == ALU64, regs, scalar, fail)
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
                    taken = _condition(insn, cls == JMP32, regs, scalar, fail)
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
    if not isinstance(base, _Ptr) or base.region != "ctx":
        fail(f"BPF_LDX from r{insn.src}, which is not the context pointer")
    off = base.off + insn.off
    if off < 0 or off + size > len(ctx):
        fail(f"BPF_LDX at context offset {off} size {size}, outside the {len(ctx)}-byte context")
    value = int.from_bytes(ctx[off:off + size], sys.byteorder)
    if mode == MODE_MEMSX:
        value = _sext(value, size * 8) & M64
    return value


def _alu(insn: Insn, is64: bool, regs: list[Reg], scalar: Scalar, fail: Fail) -> int | _Ptr:
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
            if isinstance(src, _Ptr):
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
    if use_x and insn.src == insn.dst and op in (XOR, SUB) and not isinstance(dst_val, _Ptr):
        return 0   # zeroing idiom; constant blinding (bpf_jit_harden) emits it for `mov r, 0`
    if isinstance(dst_val, _Ptr):
        # pointer arithmetic on the context pointer: only +/- constant (compilers emit it)
        if is64 and not use_x and op in (ADD, SUB):
            return _Ptr(dst_val.region, dst_val.off + (insn.imm if op == ADD else -insn.imm))
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


def _condition(insn: Insn, is32: bool, regs: list[Reg], scalar: Scalar, fail: Fail) -> bool:
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


# --- which devices a program can tell apart ---------------------------------------------------
#
# Evaluating a program on one request says nothing about the 2^32 majors and minors it was not run
# on. `distinguished` finds, by running the program with the device numbers left symbolic, every
# major and minor it compares against: devices whose numbers are in none of those sets follow one
# path, so one representative of each class answers for all of its members (proof.classes turns
# these sets into classes). The type and the access are concrete (2 types x 7 access sets, every
# context the kernel can pass); a number may only be copied (mov, mov32: it is a u32) and compared
# for equality with a constant (jeq/jne, 32 or 64 bits), which is all runc, crun, systemd and
# libnvidia-container do with it. Anything else done with a number (arithmetic, an ordering
# compare, a partial load) raises CannotEvaluate: such a program is not fully decoded.

MAJOR, MINOR = "major", "minor"
ACCESS_SETS = tuple(range(1, 8))   # every non-empty combination of ACC_MKNOD | ACC_READ | ACC_WRITE
MAX_PATHS = 200_000                # symbolic paths per program (a runc program of n exact rules: ~14 n)
MAX_TOTAL_STEPS = 20_000_000       # instructions run over all of them (~10 s): beyond, not decoded


class _Sym(NamedTuple):
    field: str   # MAJOR or MINOR: the context's u32, unchanged


@dataclass(frozen=True)
class Distinguished:
    """The numbers a program compares a device's major and minor with, per device type.

    majors[t]: every constant a major of type t is compared with; minors[t][m]: the constants a
    minor is compared with while the major is known to be m (None: on a path where the major was
    not yet known, which holds for every major)."""

    majors: dict[str, frozenset[int]]
    minors: dict[str, dict[Optional[int], frozenset[int]]]


def _ctx_value(ctx_type: int, access: int, off: int, size: int, fail: Fail) -> Union[int, _Sym]:
    """A context load: the access_type word is concrete, the numbers symbolic (whole u32 loads only)."""
    word = ((access << 16) | ctx_type).to_bytes(4, sys.byteorder)
    if off + size <= 4:
        return int.from_bytes(word[off:off + size], sys.byteorder)
    if size == 4 and off in (4, 8):
        return _Sym(MAJOR if off == 4 else MINOR)
    fail(f"a {size}-byte load at context offset {off}: only whole u32 device numbers are understood")


def distinguished(insns: Sequence[Insn]) -> Distinguished:
    """Every constant the program compares the major and minor with (see above); CannotEvaluate when
    the program does anything else with them, or is not a forward-only program `evaluate` can run."""
    majors: dict[str, set[int]] = {t: set() for t in DEV_TYPES}
    minors: dict[str, dict[Optional[int], set[int]]] = {t: {} for t in DEV_TYPES}
    paths = 0
    budget = [MAX_TOTAL_STEPS]
    for tname, tbits in DEV_TYPES.items():
        for access in ACCESS_SETS:
            # a path: (pc, registers, known numbers, numbers excluded), depth first
            start: list[Union[Reg, _Sym]] = [None] * NREGS
            start[1] = _Ptr("ctx", 0)
            start[10] = _Ptr("stack", 0)
            todo: list[tuple[int, list[Union[Reg, _Sym]], dict[str, int], dict[str, frozenset[int]]]] = [
                (0, start, {}, {MAJOR: frozenset(), MINOR: frozenset()})]
            while todo:
                paths += 1
                if paths > MAX_PATHS:
                    raise CannotEvaluate(f"more than {MAX_PATHS} paths through the program")
                pc, regs, known, excluded = todo.pop()
                forks = _run_symbolic(insns, pc, regs, known, excluded, tbits, access,
                                      majors[tname], minors[tname], budget)
                todo.extend(forks)
    return Distinguished({t: frozenset(v) for t, v in majors.items()},
                         {t: {k: frozenset(v) for k, v in by.items()} for t, by in minors.items()})


def _run_symbolic(insns: Sequence[Insn], pc: int, regs: list[Union[Reg, _Sym]], known: dict[str, int],
                  excluded: dict[str, frozenset[int]], ctx_type: int, access: int, majors: set[int],
                  minors: dict[Optional[int], set[int]], budget: list[int]) -> list[
                      tuple[int, list[Union[Reg, _Sym]], dict[str, int], dict[str, frozenset[int]]]]:
    """Run one path until it exits (no forks returned) or compares an unknown number (two returned)."""
    n = len(insns)
    steps = 0

    def fail(why: str) -> NoReturn:
        raise CannotEvaluate(f"cannot decode insn {pc} ({why})")

    def value(reg: int) -> Union[Reg, _Sym]:
        v = regs[reg]
        if isinstance(v, _Sym) and v.field in known:
            return known[v.field]
        return v

    def concrete_regs() -> list[Reg]:
        out: list[Reg] = []
        for i in range(NREGS):
            v = value(i)
            out.append(None if isinstance(v, _Sym) else v)   # never read: checked before use
        return out

    def scalar(reg: int) -> int:
        v = value(reg)
        if v is None:
            fail(f"r{reg} read before it is set")
        if isinstance(v, _Ptr):
            fail(f"arithmetic on {v.region} pointer r{reg}")
        if isinstance(v, _Sym):
            fail(f"arithmetic on the device's {v.field}")
        return v

    while True:
        if not 0 <= pc < n:
            raise CannotEvaluate(f"cannot decode: execution left the program at insn {pc}")
        steps += 1
        budget[0] -= 1
        if steps > MAX_STEPS or budget[0] < 0:
            fail(f"step limit: more than {MAX_TOTAL_STEPS} instructions over every path")
        insn = insns[pc]
        if insn.dst >= NREGS or insn.src >= NREGS:
            fail(f"register out of range in {describe_insn(insn)}")
        cls = insn.code & 7
        use_x = bool(insn.code & SRC_X)
        if cls in (ALU, ALU64):
            op = insn.code & 0xF0
            dst, src = value(insn.dst), value(insn.src) if use_x else None
            if isinstance(src, _Sym):
                if op == MOV and insn.off == 0:
                    regs[insn.dst] = src    # mov and mov32 of a u32: the number itself
                    pc += 1
                    continue
                if not (op in (XOR, SUB) and insn.src == insn.dst):
                    fail(f"{describe_insn(insn)} uses the device's {src.field}")
            if isinstance(dst, _Sym) and op != MOV:
                ones = M64 if cls == ALU64 else M32
                if op == AND and not use_x and (insn.imm & ones) == ones:
                    pc += 1                 # and with all ones: the number itself
                    continue
                if op in (XOR, SUB) and use_x and insn.src == insn.dst:
                    regs[insn.dst] = 0
                    pc += 1
                    continue
                fail(f"{describe_insn(insn)} on the device's {dst.field}")
            regs[insn.dst] = _alu(insn, cls == ALU64, concrete_regs(), scalar, fail)
            pc += 1
        elif cls == LDX:
            mode = insn.code & 0xE0
            base = value(insn.src)
            if mode != MODE_MEM or not isinstance(base, _Ptr) or base.region != "ctx":
                fail(describe_insn(insn) + " (not a plain load from the context)")
            off, size = base.off + insn.off, SIZE_BYTES[insn.code & 0x18]
            if off < 0 or off + size > 12:
                fail(f"BPF_LDX at context offset {off} size {size}, outside the 12-byte context")
            regs[insn.dst] = _ctx_value(ctx_type, access, off, size, fail)
            pc += 1
        elif cls == LD:
            if insn.code != (LD | MODE_IMM | SIZE_DW) or insn.src != 0 or pc + 1 >= n:
                fail(describe_insn(insn))
            regs[insn.dst] = (insn.imm & M32) | ((insns[pc + 1].imm & M32) << 32)
            pc += 2
        elif cls in (JMP, JMP32):
            op = insn.code & 0xF0
            if op == EXIT:
                scalar(0)
                return []
            if op == CALL:
                fail("BPF_CALL")
            if op == JA:
                if use_x:
                    fail(describe_insn(insn))
                target = pc + 1 + (insn.off if cls == JMP else insn.imm)
            else:
                if op not in JMP_NAMES:
                    fail(describe_insn(insn))
                a = value(insn.dst)
                b = value(insn.src) if use_x else None
                if isinstance(b, _Sym) and not isinstance(a, _Sym):
                    fail(f"{describe_insn(insn)} compares with the device's {b.field}")
                if isinstance(a, _Sym):
                    if op not in (JEQ, JNE):
                        fail(f"{describe_insn(insn)} on the device's {a.field}: only equality is understood")
                    if use_x:
                        if not isinstance(b, int):
                            fail(f"{describe_insn(insn)} compares the device's {a.field} with a non-constant")
                        c = b
                    else:
                        c = insn.imm & M64
                    if cls == JMP32:
                        c &= M32
                    equal_target = pc + 1 + insn.off if op == JEQ else pc + 1
                    other_target = pc + 1 if op == JEQ else pc + 1 + insn.off
                    if equal_target <= pc or other_target <= pc:
                        fail(f"{describe_insn(insn)} jumps back (a loop)")
                    if c > M32 or c in excluded[a.field]:
                        pc = other_target     # a u32 never equals it, or this path already knows it does not
                        continue
                    if a.field == MAJOR:
                        majors.add(c)
                    else:
                        minors.setdefault(known.get(MAJOR), set()).add(c)
                    eq_known = dict(known)
                    eq_known[a.field] = c
                    ne_excluded = dict(excluded)
                    ne_excluded[a.field] = excluded[a.field] | {c}
                    return [(equal_target, list(regs), eq_known, dict(excluded)),
                            (other_target, list(regs), dict(known), ne_excluded)]
                taken = _condition(insn, cls == JMP32, concrete_regs(), scalar, fail)
                target = pc + 1 + insn.off if taken else pc + 1
            if target <= pc:
                fail(f"{describe_insn(insn)} jumps back to insn {target} (a loop)")
            pc = target
        else:
            fail(f"{describe_insn(insn)}: writes memory")
