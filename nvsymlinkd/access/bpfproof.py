"""Device classes of BPF device programs, the policy they state as Rules, and the proof that a
replacement program differs from the old ones only by the grants. Pure.

A cgroup v2 device policy is the AND of the BPF_CGROUP_DEVICE programs the kernel runs for the
cgroup. bpfeval.distinguished() finds every major and minor a program compares with; devices that
no program names behave alike, so the policy is decided by evaluating one member of each class,
for each request the kernel makes (r, w, rw, m). That gives:

  - classes(programs, extra): the classes every given program (and the extra devices) distinguish;
  - policy_rules(programs, grants): the programs' AND plus the grants, stated as first-match Rules
    (bpfgen.program() turns them back into a program): what the repair attaches;
  - prove(old, new, grants): for every class either set of programs distinguishes and every access
    set, the old AND and the new AND agree, except where the new one allows exactly a grant (its
    device, letters within its access). Anything else, a narrowing included, is a problem.

A program that cannot be fully decoded raises CannotEvaluate from every function here: the repair
refuses it, as the verifier never counts such a program as allowing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access.bpfeval import Insn
from nvsymlinkd.access.bpfgen import access_letters, access_mask
from nvsymlinkd.host.devices import TYPES, Access, Device, Rule

# The requests the kernel makes (security/device_cgroup.c, devcgroup_check_permission): open asks for
# r, w or rw, mknod for m; rm, wm and rwm are never asked, so two policies that agree on these four
# are the same policy.
ACCESS_MASKS = (be.ACC_READ, be.ACC_WRITE, be.ACC_READ | be.ACC_WRITE, be.ACC_MKNOD)
ACCESSES = tuple(access_letters(m) for m in ACCESS_MASKS)
FULL = frozenset(ACCESS_MASKS)
Program = Sequence[Insn]
Grant = tuple[Device, Access]


def fresh(taken: Iterable[int]) -> int:
    """The smallest number not in `taken`: a member of the class of numbers no program names."""
    used = set(taken)
    n = 0
    while n in used:
        n += 1
    return n


@dataclass(frozen=True, order=True)
class DeviceClass:
    """Devices that every program involved treats alike. major/minor None: every number the programs
    do not name (for the minor: none named for this major, nor for every major)."""

    type: str
    major: Optional[int]
    minor: Optional[int]
    sample: Device = field(compare=False)   # one member, what is evaluated

    @property
    def device(self) -> Optional[Device]:
        """The one device of an exact class."""
        if self.major is None or self.minor is None:
            return None
        return Device(self.type, self.major, self.minor)

    def rule(self, allow: bool, access: str) -> Rule:
        return Rule(allow, self.type, self.major, self.minor, Access(access))

    def __str__(self) -> str:
        return f"{self.type} {'*' if self.major is None else self.major}:{'*' if self.minor is None else self.minor}"


def classes(programs: Sequence[Program], extra: Iterable[Device] = ()) -> list[DeviceClass]:
    """Every class the programs (and the extra devices, e.g. grants) tell apart, both types."""
    return _classes([be.decisions(prog) for prog in programs], extra)


def _classes(decided: Sequence[be.Decisions], extra: Iterable[Device] = ()) -> list[DeviceClass]:
    majors: dict[str, set[int]] = {t: set() for t in TYPES}
    minors: dict[str, dict[Optional[int], set[int]]] = {t: {} for t in TYPES}
    for dec in decided:
        d = dec.distinguished
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
    """The access sets (bit masks) every program allows for the device; CannotEvaluate when a program is
    not fully decoded."""
    return _allowed([be.decisions(prog) for prog in programs], device)


def _allowed(decided: Sequence[be.Decisions], device: Device) -> frozenset[int]:
    out = set(ACCESS_MASKS)
    for d in decided:
        out &= d.allowed(device, ACCESS_MASKS)
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
    return [cls.rule(allow, access) for allow, access in _block_shape(masks, falls_to)]


@functools.cache   # 16 x 16 possible arguments: a program's 1,000 classes share a few
def _block_shape(masks: frozenset[int], falls_to: frozenset[int]) -> tuple[tuple[bool, Access], ...]:
    if any(sub & m == sub and sub not in masks for m in masks for sub in ACCESS_MASKS):
        order = sorted(ACCESS_MASKS, key=lambda m: (bin(m).count("1"), m))
        return tuple((m in masks, access_letters(m)) for m in order)
    union = 0
    for m in masks:
        union |= m
    if masks and masks == {m for m in ACCESS_MASKS if m & union == m}:
        shape = [(True, access_letters(union))]
    else:
        shape = [(True, access_letters(m)) for m in _maximal(masks)]
    if falls_to - masks:
        shape.append((False, Access("rwm")))
    return tuple(shape)


def policy_rules(programs: Sequence[Program], grants: Sequence[Grant] = ()) -> list[Rule]:
    """The AND of `programs` plus the grants, as first-match Rules with a default deny.

    Most specific first: exact devices, then MAJOR:*, then *:MINOR, then *:*. A class's block ends
    with a deny of what it does not allow when a rule after it would allow that; a block that would
    say what the class's requests fall through to anyway is left out. CannotEvaluate when a program is
    not fully decoded."""
    decided = [be.decisions(prog) for prog in programs]
    table = {cls: _allowed(decided, cls.sample) | _grant_masks(cls, grants)
             for cls in _classes(decided, (d for d, _ in grants))}
    rules: list[Rule] = []
    for t in TYPES:
        mine = [c for c in table if c.type == t]
        # built from the least specific block up: each block is weighed against the rules that will
        # follow it (what its class's requests fall through to), emitted only where that differs. Of the
        # blocks after it, only its major's M:*, its minor's *:N and *:* can match a class's sample (in
        # that order: the exact ones name other devices, the samples of M:* and *:* avoid every named
        # number), so those three decide what it falls through to
        rest = next(c for c in mine if c.major is None and c.minor is None)
        blocks: dict[tuple[Optional[int], Optional[int]], list[Rule]] = {(None, None): _block(rest, table[rest],
                                                                                              frozenset())}
        order = (sorted((c for c in mine if c.major is None and c.minor is not None), key=_numbers, reverse=True)
                 + sorted((c for c in mine if c.major is not None and c.minor is None), key=_numbers, reverse=True)
                 + sorted((c for c in mine if c.major is not None and c.minor is not None), key=_numbers,
                          reverse=True))
        emitted = [blocks[(None, None)]]
        for c in order:
            after = [blocks.get((c.sample.major, None)), blocks.get((None, c.sample.minor)), blocks[(None, None)]]
            falls_to = first_match([r for b in after if b is not None for r in b], c.sample)
            if table[c] != falls_to:
                block = _block(c, table[c], falls_to)
                blocks[(c.major, c.minor)] = block
                emitted.append(block)
        rules += [r for block in reversed(emitted) for r in block]
    return rules


def _numbers(c: DeviceClass) -> tuple[Optional[int], Optional[int]]:
    """DeviceClass's order within one type and one shape (None in the same places): faster than its __lt__."""
    return c.major, c.minor


def first_match(rules: Sequence[Rule], device: Device) -> frozenset[int]:
    """The requests (access masks) the rules allow for a device, the first matching rule deciding
    (what bpfgen.program() emits, its default deny included)."""
    out = set()
    for m, letters in zip(ACCESS_MASKS, ACCESSES):
        for r in rules:
            if r.matches(device) and r.access.covers(letters):
                if r.allow:
                    out.add(m)
                break
    return frozenset(out)


@dataclass(frozen=True)
class Proof:
    """What prove() compared: `checked` (class, access) pairs, the grants it saw take effect, problems."""

    classes: int
    checked: int
    granted: tuple[str, ...]          # "c 195:0 rw" per class and access set newly allowed by a grant
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def prove(old: Sequence[Program], new: Sequence[Program], grants: Sequence[Grant]) -> Proof:
    """Compare the AND of `old` with the AND of `new` on every class either distinguishes (and the
    grants' devices), every access set. CannotEvaluate when a program is not fully decoded."""
    problems: list[str] = []
    granted: list[str] = []
    before_all, after_all = [be.decisions(p) for p in old], [be.decisions(p) for p in new]
    every = _classes(before_all + after_all, (d for d, _ in grants))
    for cls in every:
        before, after = _allowed(before_all, cls.sample), _allowed(after_all, cls.sample)
        if before == after:
            continue
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
        after = _allowed(after_all, gdev)
        missing = [access_letters(m) for m in ACCESS_MASKS if m & access_mask(gaccess) == m and m not in after]
        if missing:
            problems.append(f"{gdev} {'/'.join(missing)}: still denied with the new program (a program of a "
                            "parent cgroup denies it: a child never gets what its parent denies)")
    return Proof(len(every), len(every) * len(ACCESS_MASKS), tuple(granted), tuple(problems))
