"""Emit a BPF_CGROUP_DEVICE program from device Rules (host.devices): the repair's generator. Pure.

The shape is runc's (opencontainers/cgroups devices/devicefilter.go, itself crun's ebpf.c): load
the context into r2 (type), r3 (access), r4 (major), r5 (minor), then one block per rule

    jne r2, TYPE, next            (no test for type "a")
    mov32 r1, r3; and32 r1, ACC; jne r1, r3, next     (no test when ACC is rwm)
    jne r4, MAJOR, next           (none for *)
    jne r5, MINOR, next           (none for *)
    mov32 r0, ALLOW; exit

and `mov32 r0, DEFAULT; exit` at the end. The first rule that matches the request decides (runc
feeds it the emulator's clean list in that order; systemd's bpf-devices.c, an allow list, has the
same meaning with every rule allowing). A rule matches when its type, major and minor match and the
request's access letters are all in the rule's: `c 195:0 rw` allows r, w and rw, not m.

The program uses no maps, no helpers, no stack and no back jumps: the kernel's verifier accepts it
on every kernel with BPF_CGROUP_DEVICE (4.15+), and bpfeval runs it exactly.
"""

from __future__ import annotations

from typing import Optional, Sequence

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access.bpfeval import Insn
from nvsymlinkd.host.devices import RWM, Access, Rule

ACCESS_BITS = {"r": be.ACC_READ, "w": be.ACC_WRITE, "m": be.ACC_MKNOD}
TYPE_BITS = {"c": be.DEV_CHAR, "b": be.DEV_BLOCK}
MAX_RULES = 4000   # the kernel takes 1M insns (4096 before 5.2 for unprivileged: we are root); ~8 per rule


def access_mask(access: str) -> int:
    """The context's access bits for letters ("rw" -> ACC_READ | ACC_WRITE)."""
    return sum(ACCESS_BITS[c] for c in set(access))


def access_letters(mask: int) -> Access:
    """The letters of an access bit mask (ACC_READ | ACC_WRITE -> "rw")."""
    return Access("".join(c for c, bit in ACCESS_BITS.items() if mask & bit))


# --- instructions (also the tests' assembler) ---------------------------------------------------

def ldx(size: int, dst: int, src: int, off: int) -> Insn:
    return Insn(be.LDX | be.MODE_MEM | size, dst, src, off, 0)


def alu(op: int, dst: int, imm: int = 0, src: int = 0, x: bool = False, is64: bool = False,
        off: int = 0) -> Insn:
    cls = be.ALU64 if is64 else be.ALU
    return Insn(cls | op | (be.SRC_X if x else be.SRC_K), dst, src if x else 0, off, 0 if x else imm)


def jmp(op: int, dst: int, off: int, imm: int = 0, src: int = 0, x: bool = False,
        is32: bool = False) -> Insn:
    cls = be.JMP32 if is32 else be.JMP
    return Insn(cls | op | (be.SRC_X if x else be.SRC_K), dst, src if x else 0, off, 0 if x else imm)


def ja(off: int) -> Insn:
    return Insn(be.JMP | be.JA, 0, 0, off, 0)


def exit_() -> Insn:
    return Insn(be.JMP | be.EXIT, 0, 0, 0, 0)


def mov32(dst: int, imm: int) -> Insn:
    return alu(be.MOV, dst, imm)


def mov64(dst: int, imm: int) -> Insn:
    return alu(be.MOV, dst, imm, is64=True)


class Label:
    """A forward jump target: jumps are emitted with a placeholder offset and patched at place()."""

    def __init__(self) -> None:
        self.at: Optional[int] = None
        self.users: list[int] = []


def emit_jump(prog: list[Insn], insn: Insn, label: Label) -> None:
    label.users.append(len(prog))
    prog.append(insn)


def place(prog: list[Insn], label: Label) -> None:
    label.at = len(prog)
    for i in label.users:
        prog[i] = prog[i]._replace(off=label.at - i - 1)


# runc's prologue: r2 type, r3 access, r4 major, r5 minor
LOAD_CTX = (
    ldx(be.SIZE_W, 2, 1, 0), alu(be.AND, 2, 0xFFFF),
    ldx(be.SIZE_W, 3, 1, 0), alu(be.RSH, 3, 16),
    ldx(be.SIZE_W, 4, 1, 4),
    ldx(be.SIZE_W, 5, 1, 8),
)


def rule_block(prog: list[Insn], rule: Rule) -> None:
    """Append one rule's block (see the module's text). Each test jumps to the block's end, whose distance
    is known before the block is written (no labels to patch: a 1,000-rule program is emitted per repair)."""
    bits = access_mask(rule.access)
    tests = [rule.type != "a", bits != access_mask(RWM), rule.major is not None, rule.minor is not None]
    size = tests[0] + 3 * tests[1] + tests[2] + tests[3] + 2
    block: list[Insn] = []
    if tests[0]:
        block.append(jmp(be.JNE, 2, size - 1, TYPE_BITS[rule.type]))
    if tests[1]:
        block += [alu(be.MOV, 1, src=3, x=True), alu(be.AND, 1, bits)]
        block.append(jmp(be.JNE, 1, size - len(block) - 1, src=3, x=True))
    if rule.major is not None:
        block.append(jmp(be.JNE, 4, size - len(block) - 1, rule.major))
    if rule.minor is not None:
        block.append(jmp(be.JNE, 5, size - len(block) - 1, rule.minor))
    prog += block
    prog += [mov32(0, 1 if rule.allow else 0), exit_()]


def program(rules: Sequence[Rule], default_allow: bool = False) -> list[Insn]:
    """The program for `rules`, first match deciding, `default_allow` when none matches.

    ValueError for what no program should say: an empty access (matches nothing, surely a mistake),
    numbers outside the kernel's dev_t, or more rules than a program should hold."""
    if len(rules) > MAX_RULES:
        raise ValueError(f"{len(rules)} rules: more than {MAX_RULES} in one device program")
    prog = list(LOAD_CTX)
    for rule in rules:
        if not rule.access:
            raise ValueError(f"rule {rule.describe()} has no access letters")
        for number, top in ((rule.major, 0xFFF), (rule.minor, 0xFFFFF)):
            if number is not None and not 0 <= number <= top:
                raise ValueError(f"rule {rule.describe()}: {number} is outside the kernel's dev_t")
        rule_block(prog, rule)
        if rule.type == "a" and rule.major is None and rule.minor is None and rule.access == RWM:
            # `a *:* rwm` decides every request: what follows is unreachable, which the verifier
            # rejects ("unreachable insn"); runc's emulator never emits rules after it either
            return prog
    prog += [mov32(0, 1 if default_allow else 0), exit_()]
    return prog


def allow_all() -> list[Insn]:
    return list(LOAD_CTX) + [mov32(0, 1), exit_()]
