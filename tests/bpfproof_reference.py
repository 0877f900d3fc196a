"""The proof as it was before issue 38 (item 1), kept as the reference the fast one is compared with: the
symbolic evaluation run path by path (depth first, one context at a time) and the interpreter run on one
device per class (tests/test_bpfproof.py's differential test). Copied from nvsymlinkd/access/bpfeval.py and
bpfproof.py at 263dc1b; the package does not use it."""

# ruff: noqa
from __future__ import annotations

import sys
from typing import Iterable, NamedTuple, NoReturn, Optional, Sequence, Union

from nvsymlinkd.access.bpfeval import (ALU, ALU64, AND, CALL, DEV_TYPES, EXIT, JA, JEQ, JMP, JMP32, JMP_NAMES,
                                       JNE, LD, LDX, M32, M64, MAX_STEPS, MODE_IMM, MODE_MEM, MOV, NREGS,
                                       SIZE_BYTES, SIZE_DW, SRC_X, SUB, XOR, Distinguished, Fail, Insn, Reg, alu,
                                       condition, Ptr, describe_insn, evaluate, make_ctx)
from nvsymlinkd.access.bpfgen import access_letters, access_mask
from nvsymlinkd.access.bpfproof import ACCESS_MASKS, DeviceClass, Grant, Program, Proof, fresh
from nvsymlinkd.errors import CannotEvaluate
from nvsymlinkd.host.devices import TYPES, Device, Rule

MAJOR, MINOR = "major", "minor"
ACCESS_SETS = tuple(range(1, 8))   # every non-empty combination of ACC_MKNOD | ACC_READ | ACC_WRITE
MAX_PATHS = 200_000                # symbolic paths per program (a runc program of n exact rules: ~14 n)
MAX_TOTAL_STEPS = 20_000_000       # instructions run over all of them (~10 s): beyond, not decoded


class _Sym(NamedTuple):
    field: str   # MAJOR or MINOR: the context's u32, unchanged


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
            start[1] = Ptr("ctx", 0)
            start[10] = Ptr("stack", 0)
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
        if isinstance(v, Ptr):
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
            regs[insn.dst] = alu(insn, cls == ALU64, concrete_regs(), scalar, fail)
            pc += 1
        elif cls == LDX:
            mode = insn.code & 0xE0
            base = value(insn.src)
            if mode != MODE_MEM or not isinstance(base, Ptr) or base.region != "ctx":
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
                taken = condition(insn, cls == JMP32, concrete_regs(), scalar, fail)
                target = pc + 1 + insn.off if taken else pc + 1
            if target <= pc:
                fail(f"{describe_insn(insn)} jumps back to insn {target} (a loop)")
            pc = target
        else:
            fail(f"{describe_insn(insn)}: writes memory")


def classes(programs: Sequence[Program], extra: Iterable[Device] = ()) -> list[DeviceClass]:
    """Every class the programs (and the extra devices, e.g. grants) tell apart, both types."""
    majors: dict[str, set[int]] = {t: set() for t in TYPES}
    minors: dict[str, dict[Optional[int], set[int]]] = {t: {} for t in TYPES}
    for prog in programs:
        d = distinguished(prog)
        for t in TYPES:
            majors[t] |= d.majors.get(t, frozenset())
            for m, ns in d.minors.get(t, {}).items():
                minors[t].setdefault(m, set()).update(ns)
    for dev in extra:
        majors[dev.type].add(dev.major)
        minors[dev.type].setdefault(dev.major, set()).add(dev.minor)
    out: list[DeviceClass] = []
    for t in TYPES:
        every = minors[t].get(None, set())
        other_major = fresh(majors[t])
        for m in sorted(majors[t]):
            named = minors[t].get(m, set()) | every
            out += [DeviceClass(t, m, n, Device(t, m, n)) for n in sorted(named)]
            out.append(DeviceClass(t, m, None, Device(t, m, fresh(named))))
        out += [DeviceClass(t, None, n, Device(t, other_major, n)) for n in sorted(every)]
        out.append(DeviceClass(t, None, None, Device(t, other_major, fresh(every))))
    return out


def allowed(programs: Sequence[Program], device: Device) -> frozenset[int]:
    """The access sets (bit masks) every program allows for the device; CannotEvaluate for unknown."""
    out = set()
    for mask in ACCESS_MASKS:
        ctx = make_ctx(device, access_letters(mask))
        verdict = True
        for prog in programs:
            result = evaluate(prog, ctx)
            if result.allowed is None:
                raise CannotEvaluate(result.reason)
            if not result.allowed:
                verdict = False
                break
        if verdict:
            out.add(mask)
    return frozenset(out)


def _grant_masks(cls: DeviceClass, grants: Sequence[Grant]) -> frozenset[int]:
    device = cls.device
    out: set[int] = set()
    for gdev, gaccess in grants:
        if device is not None and device == gdev:
            gbits = access_mask(gaccess)
            out |= {m for m in ACCESS_MASKS if m & gbits == m}
    return frozenset(out)


def _maximal(masks: frozenset[int]) -> list[int]:
    return sorted((m for m in masks if not any(o != m and o & m == m for o in masks)),
                  key=lambda m: (-bin(m).count("1"), m))


def _block(cls: DeviceClass, masks: frozenset[int], falls_to: frozenset[int]) -> list[Rule]:
    """A class's rules. A rule allows (or denies) each request whose letters it has, so when every
    allowed request's own requests are allowed too (r and w with rw): one allow of every allowed letter
    when that says exactly the allowed requests, else one allow per maximal request; then a deny of the
    rest when the rules after it (`falls_to` allows) would allow some of it. Otherwise (rw allowed, r
    not: a program can say that) one rule per request, the smaller first, each deciding only itself."""
    if any(sub & m == sub and sub not in masks for m in masks for sub in ACCESS_MASKS):
        order = sorted(ACCESS_MASKS, key=lambda m: (bin(m).count("1"), m))
        return [cls.rule(m in masks, access_letters(m)) for m in order]
    union = 0
    for m in masks:
        union |= m
    if masks and masks == {m for m in ACCESS_MASKS if m & union == m}:
        rules = [cls.rule(True, access_letters(union))]
    else:
        rules = [cls.rule(True, access_letters(m)) for m in _maximal(masks)]
    if falls_to - masks:
        rules.append(cls.rule(False, "rwm"))
    return rules


def policy_rules(programs: Sequence[Program], grants: Sequence[Grant] = ()) -> list[Rule]:
    """The AND of `programs` plus the grants, as first-match Rules with a default deny.

    Most specific first: exact devices, then MAJOR:*, then *:MINOR, then *:*. A class's block ends
    with a deny of what it does not allow when a rule after it would allow that; a block that would
    say what the class's requests fall through to anyway is left out. CannotEvaluate when a program is
    not fully decoded."""
    table = {cls: allowed(programs, cls.sample) | _grant_masks(cls, grants)
             for cls in classes(programs, (d for d, _ in grants))}
    rules: list[Rule] = []
    for t in TYPES:
        mine = [c for c in table if c.type == t]
        # built from the least specific block up: each block is weighed against the rules that will
        # follow it (what its class's requests fall through to), emitted only where that differs
        tail = _block(next(c for c in mine if c.major is None and c.minor is None),
                      table[next(c for c in mine if c.major is None and c.minor is None)], frozenset())
        order = (sorted((c for c in mine if c.major is None and c.minor is not None), reverse=True)
                 + sorted((c for c in mine if c.major is not None and c.minor is None), reverse=True)
                 + sorted((c for c in mine if c.major is not None and c.minor is not None), reverse=True))
        for c in order:
            falls_to = first_match(tail, c.sample)
            if table[c] != falls_to:
                tail = _block(c, table[c], falls_to) + tail
        rules += tail
    return rules


def first_match(rules: Sequence[Rule], device: Device) -> frozenset[int]:
    """The requests (access masks) the rules allow for a device, the first matching rule deciding
    (what bpfgen.program() emits, its default deny included)."""
    out = set()
    for m in ACCESS_MASKS:
        letters = access_letters(m)
        for r in rules:
            if r.matches(device) and r.access.covers(letters):
                if r.allow:
                    out.add(m)
                break
    return frozenset(out)


def prove(old: Sequence[Program], new: Sequence[Program], grants: Sequence[Grant]) -> Proof:
    """Compare the AND of `old` with the AND of `new` on every class either distinguishes (and the
    grants' devices), every access set. CannotEvaluate when a program is not fully decoded."""
    problems: list[str] = []
    granted: list[str] = []
    every = classes(list(old) + list(new), (d for d, _ in grants))
    for cls in every:
        before, after = allowed(old, cls.sample), allowed(new, cls.sample)
        grantable = _grant_masks(cls, grants)
        for m in ACCESS_MASKS:
            a = access_letters(m)
            if (m in before) == (m in after):
                continue
            if m in before:
                problems.append(f"{cls} {a}: allowed before, denied by the new program (a narrowing)")
            elif m in grantable:
                granted.append(f"{cls} {a}")
            else:
                problems.append(f"{cls} {a}: denied before, allowed by the new program, and no grant asks for it")
    for gdev, gaccess in grants:
        after = allowed(new, gdev)
        missing = [access_letters(m) for m in ACCESS_MASKS if m & access_mask(gaccess) == m and m not in after]
        if missing:
            problems.append(f"{gdev} {'/'.join(missing)}: still denied with the new program (a program of a "
                            "parent cgroup denies it: a child never gets what its parent denies)")
    return Proof(len(every), len(every) * len(ACCESS_MASKS), tuple(granted), tuple(problems))
