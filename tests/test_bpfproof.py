"""The bpf-program repair's pure parts, without a kernel: which numbers a program distinguishes
(bpfeval.distinguished), the policy stated as rules (bpfproof.policy_rules), the generator
(bpfgen.program) and the proof (bpfproof.prove). Tables, then properties over random rule sets
against a first-match oracle written from the rules alone."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access import bpfgen, bpfproof
from nvsymlinkd.access.bpfgen import alu, exit_, jmp, ldx, mov32
from nvsymlinkd.errors import CannotEvaluate
from nvsymlinkd.host.devices import Access, Device, Rule
from tests import bpfasm

RUNC_DEFAULTS = [Rule(True, "c", None, None, "m"), Rule(True, "b", None, None, "m"), Rule(True, "c", 1, 3, "rwm"),
                 Rule(True, "c", 1, 5, "rwm"), Rule(True, "c", 136, None, "rwm"), Rule(True, "c", 10, 200, "rwm")]
GPU = [Rule(True, "c", 195, 0, "rw"), Rule(True, "c", 195, 255, "rw")]
C0 = Device("c", 195, 0)


def runc(rules):
    return bpfasm.runc_program(rules, default_allow=False)


def test_distinguished_names_every_compared_number():
    d = be.distinguished(runc(RUNC_DEFAULTS + GPU))
    assert d.majors["c"] == {1, 10, 136, 195} and d.majors["b"] == set()
    assert d.minors["c"] == {1: {3, 5}, 10: {200}, 195: {0, 255}}
    # systemd's shape: the minor is compared only once the major matched
    d = be.distinguished(bpfasm.systemd_program([Rule(True, "c", 195, 0, "rw")], "closed"))
    assert d.minors["c"][195] == {0} and None not in d.minors["c"]
    # runc's `*:N` rule compares the minor whatever the major
    assert be.distinguished(runc([Rule(True, "c", None, 7, "r")])).minors["c"] == {None: {7}}


@pytest.mark.parametrize("temp_reg", [2, 6])
def test_distinguished_runs_the_nvidia_hook_shapes(temp_reg):
    prog = bpfasm.nvidia_prepend([(Rule(True, "c", 195, 1, "rw"), True)], runc(GPU), temp_reg=temp_reg)
    assert be.distinguished(prog).minors["c"][195] == {0, 1, 255}


LOAD = [ldx(be.SIZE_W, 4, 1, 4), ldx(be.SIZE_W, 5, 1, 8)]
ALLOW = [mov32(0, 1), exit_()]


@pytest.mark.parametrize("name, prog, words", [
    ("shifts the major", LOAD + [alu(be.RSH, 4, 4), jmp(be.JEQ, 4, 2, 12)] + ALLOW + ALLOW, "on the device's major"),
    ("orders the minor", LOAD + [jmp(be.JGT, 5, 2, 10)] + ALLOW + ALLOW, "only equality"),
    ("adds to the minor", LOAD + [alu(be.ADD, 5, 1, is64=True), jmp(be.JEQ, 5, 2, 10)] + ALLOW + ALLOW,
     "on the device's minor"),
    ("reads half the major", [ldx(be.SIZE_H, 4, 1, 4)] + ALLOW, "only whole u32"),
    ("compares the two numbers", LOAD + [jmp(be.JEQ, 4, 2, src=5, x=True)] + ALLOW + ALLOW, "non-constant"),
    ("calls a helper", [be.Insn(be.JMP | be.CALL, 0, 0, 0, 14)] + ALLOW, "BPF_CALL"),
])
def test_a_program_that_is_not_fully_decoded_is_refused(name, prog, words):
    with pytest.raises(CannotEvaluate, match=words):
        be.distinguished(prog)
    with pytest.raises(CannotEvaluate):
        bpfproof.policy_rules([prog], [(C0, Access("rw"))])


def test_copies_and_all_ones_masks_are_the_number_itself():
    prog = LOAD + [alu(be.MOV, 6, src=4, x=True), alu(be.AND, 6, -1, is64=True), alu(be.MOV, 7, src=6, x=True),
                   jmp(be.JNE, 7, 3, 195, is32=True), jmp(be.JNE, 5, 2, 0)] + ALLOW + [mov32(0, 0), exit_()]
    d = be.distinguished(prog)
    assert d.majors["c"] == {195} and d.minors["c"] == {195: {0}}


@pytest.mark.parametrize("name, programs, grants, rules", [
    ("runc's defaults and one lost GPU",
     [runc(RUNC_DEFAULTS + GPU[1:])], [(C0, "rw")],
     ["c 1:3 rwm", "c 1:5 rwm", "c 10:200 rwm", "c 195:0 rwm", "c 195:255 rwm", "c 136:* rwm", "c *:* m",
      "b *:* m"]),
    ("the grant's letters only, when the rest denies m",
     [runc(GPU[1:])], [(C0, "rw")], ["c 195:0 rw", "c 195:255 rw"]),
    ("a deny inside an allowed major stops the wildcard",
     [runc([Rule(True, "c", 195, None, "rw")]), bpfasm.runc_program([Rule(True, "c", 195, 1, "rwm")], True)],
     [], ["deny c 195:1 rwm", "c 195:* rw"]),
    ("r and w allowed apart, rw not: two rules",
     [runc([Rule(True, "c", 195, 0, "r"), Rule(True, "c", 195, 0, "w")])], [], ["c 195:0 r", "c 195:0 w"]),
    ("... and a stop where a wider rule would allow rw",
     [runc([Rule(True, "c", 195, None, "rw")]),
      bpfgen.program([Rule(True, "c", 195, 0, "r"), Rule(True, "c", 195, 0, "w"), Rule(False, "c", 195, 0, "rwm")],
                     default_allow=True)],
     [], ["c 195:0 r", "c 195:0 w", "deny c 195:0 rwm", "c 195:* rw"]),
    ("the AND of two programs",
     [runc(RUNC_DEFAULTS + GPU), runc([Rule(True, "c", 195, None, "rw"), Rule(True, "c", 1, None, "rwm")])],
     [], ["c 1:3 rwm", "c 1:5 rwm", "c 195:0 rw", "c 195:255 rw", "c 1:* m"]),
    ("no program says nothing is allowed", [bpfgen.program([])], [(C0, "rw")], ["c 195:0 rw"]),
])
def test_policy_rules(name, programs, grants, rules):
    grants = [(d, Access(a)) for d, a in grants]
    got = bpfproof.policy_rules(programs, grants)
    assert [str(r) if r.allow else r.describe() for r in got] == rules
    new = bpfgen.program(got)
    proof = bpfproof.prove(programs, [new], grants)
    assert proof.ok, proof.problems
    assert bool(proof.granted) == bool(grants)


def test_rw_without_r_takes_one_rule_per_request():
    # rw allowed, r and w denied: a program can say it; one rule per request, the smaller first
    prog = [ldx(be.SIZE_W, 3, 1, 0), alu(be.RSH, 3, 16), jmp(be.JEQ, 3, 2, 6)] + [mov32(0, 0), exit_()] + ALLOW
    rules = bpfproof.policy_rules([prog])
    assert [r.describe() for r in rules if r.type == "c"] == ["deny c *:* m", "deny c *:* r", "deny c *:* w",
                                                              "allow c *:* rw"]
    assert bpfproof.prove([prog], [bpfgen.program(rules)], []).ok


OLD = [runc(RUNC_DEFAULTS + GPU[1:])]


@pytest.mark.parametrize("name, new, grants, problem", [
    ("exactly the grant", [runc(RUNC_DEFAULTS + GPU)], [(C0, "rw")], None),
    ("nothing asked, nothing changed", OLD, [], None),
    ("a grant nobody asked for", [runc(RUNC_DEFAULTS + GPU)], [], "no grant asks for it"),
    ("more letters than the grant", [runc(RUNC_DEFAULTS + GPU)], [(C0, "r")], "c 195:0 w: denied before"),
    ("a neighbour of the grant", [runc(RUNC_DEFAULTS + GPU + [Rule(True, "c", 195, 1, "rw")])], [(C0, "rw")],
     "c 195:1 r: denied before"),
    ("a whole major", [runc(RUNC_DEFAULTS + [Rule(True, "c", 195, None, "rw")])], [(C0, "rw")],
     "c 195:* r: denied before"),
    ("a narrowing", [runc(RUNC_DEFAULTS[1:] + GPU)], [(C0, "rw")], "c *:* m: allowed before, denied"),
    ("a parent that still denies", [runc(RUNC_DEFAULTS + GPU), runc(RUNC_DEFAULTS + GPU[1:])], [(C0, "rw")],
     "still denied with the new program"),
])
def test_prove(name, new, grants, problem):
    proof = bpfproof.prove(OLD, new, [(d, Access(a)) for d, a in grants])
    if problem is None:
        assert proof.ok, proof.problems
    else:
        assert any(problem in p for p in proof.problems), proof.problems


# --- properties: random rule sets, a first-match oracle written from the rules alone ---------------

NUMS = st.one_of(st.none(), st.sampled_from([0, 1, 3, 195, 255, 4095]), st.integers(0, 300))
ACCESS = st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"])
rule = st.builds(Rule, st.booleans(), st.sampled_from(["c", "b", "a"]), NUMS, NUMS, ACCESS)
FEW = st.one_of(st.none(), st.sampled_from([0, 1, 195]))   # numbers that collide: wildcards meet exact rules
dense_rule = st.builds(Rule, st.booleans(), st.sampled_from(["c", "b", "a"]), FEW, FEW, ACCESS)
REQUESTS = ("r", "w", "rw", "m")


def first_match(rules, default_allow, device, access):
    for r in rules:
        if r.matches(device) and Access(r.access).covers(access):
            return r.allow
    return default_allow


def probes(rules, extra=()):
    numbers = {n for r in rules for n in (r.major, r.minor) if n is not None} | {2, 4000} | set(extra)
    return [Device(t, ma, mi) for t in ("c", "b") for ma in numbers for mi in numbers]


@settings(max_examples=150, deadline=None)
@given(st.lists(rule, max_size=8), st.booleans())
def test_generator_means_first_match(rules, default_allow):
    prog = bpfgen.program(rules, default_allow)
    for dev in probes(rules):
        for access in REQUESTS:
            assert be.check(prog, dev, access).allowed is \
                first_match(rules, default_allow, dev, access), (dev, access)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(rule, dense_rule), max_size=7), st.booleans(), st.lists(dense_rule, max_size=4),
       st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300), st.sampled_from(["rw", "r", "rwm"])), max_size=2))
def test_policy_rules_then_prove_round_trip(rules, default_allow, more, grant_numbers):
    """Whatever the programs (one or two, any rules), the rules stated for their AND plus the grants emit a
    program that proves against them, and agrees with the oracle on every probe."""
    programs = [bpfgen.program(rules, default_allow)] + ([bpfgen.program(more, True)] if more else [])
    grants = [(Device("c", ma, mi), Access(a)) for ma, mi, a in grant_numbers]
    new = bpfgen.program(bpfproof.policy_rules(programs, grants))
    proof = bpfproof.prove(programs, [new], grants)
    assert proof.ok, proof.problems
    for dev in probes(rules + more, [n for g in grant_numbers for n in g[:2]]):
        for access in REQUESTS:
            old = first_match(rules, default_allow, dev, access) and (not more or first_match(more, True, dev, access))
            granted = any(dev == g and Access(a).covers(access) for g, a in grants)
            assert be.check(new, dev, access).allowed is (old or granted), (dev, access)


def test_nothing_is_emitted_after_a_rule_that_decides_everything():
    # the verifier rejects unreachable instructions (found by the kernel differential test)
    prog = bpfgen.program([Rule(True, "a", None, None, "rwm"), Rule(False, "c", 1, 3, "r")])
    assert prog == list(bpfgen.LOAD_CTX) + [mov32(0, 1), exit_()]


def test_a_major_block_without_a_stop_lets_nothing_reach_a_minor_wildcard_it_should_not():
    # found by the kernel differential test (seed 3): c 195:0 m was denied by the first rule, but the
    # derived program let it fall through `c 195:* r` (no stop needed against *:*) to `c *:0 rm`
    rules = [Rule(False, "a", 195, None, "m"), Rule(True, "a", None, 0, "rm"), Rule(True, "c", None, 1, "m"),
             Rule(True, "c", 195, None, "rm"), Rule(True, "c", 195, 0, "rw"), Rule(True, "b", 195, 7, "m")]
    prog = bpfgen.program(rules)
    derived = bpfproof.policy_rules([prog])
    assert bpfproof.prove([prog], [bpfgen.program(derived)], []).ok
    assert be.check(bpfgen.program(derived), C0, Access("m")).allowed is False


# --- the one-pass proof against the path-by-path one it replaced (issue 38) -------------------------------
#
# The rule sets of the kernel differential tests (tests/test_bpf_kernel.py's producer shapes and random
# arithmetic, tests/test_bpf_repair_kernel.py's generator/derived sets), drawn here with fixed majors:
# bpfeval.decisions() answers every request as the interpreter does (its verdict and its words), and
# distinguished, classes, policy_rules and prove answer as tests/bpfproof_reference.py (the code before).

MAJORS = {"chars": [200, 201, 202], "blocks": [203]}
PROBE_NUMBERS = (0, 1, 7, 9, 200, 203, 4095, 70000)   # named by the rules, and not


def _drawn_programs(seed: int, count: int):
    from tests.test_bpf_kernel import random_rule
    from tests.test_bpf_repair_kernel import random_rules

    rng = random.Random(seed)
    for n in range(count):
        kind = ("repair", "systemd", "nvidia", "arithmetic", "runc", "nested")[n % 6]
        if kind == "repair":
            yield kind, [bpfgen.program(random_rules(rng, 200, 203), rng.random() < 0.3)]
        elif kind == "systemd":
            yield kind, [bpfasm.systemd_program([random_rule(rng, MAJORS) for _ in range(rng.randint(0, 6))],
                                                rng.choice(["strict", "closed"]))]
        elif kind == "nvidia":
            spec = [(random_rule(rng, MAJORS, types=("c", "b", "a")), rng.random() < 0.8) for _ in range(3)]
            spec = [(r, a) for r, a in spec if not (r.type == "a" and r.major is None and r.minor is None)]
            base = runc([random_rule(rng, MAJORS) for _ in range(3)])
            yield kind, [bpfasm.nvidia_prepend(spec, base, temp_reg=rng.choice([2, 6]))]
        elif kind == "arithmetic":
            yield kind, [bpfasm.random_alu_program(rng, rng.randint(3, 14), rng.randint(1, 4))]
        elif kind == "runc":
            yield kind, [bpfasm.runc_program([random_rule(rng, MAJORS) for _ in range(rng.randint(0, 8))],
                                             rng.random() < 0.5)]
        else:
            yield kind, [bpfasm.systemd_program([random_rule(rng, MAJORS) for _ in range(4)]),
                         runc([random_rule(rng, MAJORS) for _ in range(rng.randint(2, 8))])]


def _or_refused(fn, *args):
    try:
        return fn(*args)
    except CannotEvaluate:
        return "refused"


def test_decisions_answer_every_request_as_the_interpreter():
    decided = 0
    for kind, programs in _drawn_programs(2026_11_28, 60):
        for prog in programs:
            table = _or_refused(be.decisions, prog)
            if table == "refused":
                continue
            decided += 1
            for dev in (Device(t, ma, mi) for t in "cb" for ma in PROBE_NUMBERS for mi in PROBE_NUMBERS):
                for bits in be.ACCESS_SETS:
                    access = bpfgen.access_letters(bits)
                    want, got = be.check(prog, dev, access), table.check(dev, access)
                    assert (got.allowed, got.reason) == (want.allowed, want.reason), (kind, dev, access)
    assert decided > 45   # not vacuous: the arithmetic programs are the refused ones


def test_the_proof_answers_as_the_reference():
    from tests import bpfproof_reference as ref

    rng = random.Random(2026_11_28)
    proven = 0
    for kind, programs in _drawn_programs(2026_11_29, 90):
        assert [_or_refused(be.distinguished, p) for p in programs] == \
            [_or_refused(ref.distinguished, p) for p in programs], kind
        grants = [(Device("c", rng.choice([195, 200]), rng.choice([0, 1, 7])), Access(rng.choice(["rw", "r", "m"])))]
        rules = _or_refused(bpfproof.policy_rules, programs, grants)
        assert rules == _or_refused(ref.policy_rules, programs, grants), kind
        if rules == "refused":
            continue
        assert bpfproof.classes(programs, [grants[0][0]]) == ref.classes(programs, [grants[0][0]])
        new = bpfgen.program(rules)
        wider = bpfgen.program([Rule(True, "c", 200, None, "rw")] + rules[1:])   # one rule lost, one too wide
        for old, now in ((programs, [new]), (programs, [wider]), (programs + [wider], [new]), ([new], programs)):
            assert bpfproof.prove(old, now, grants) == ref.prove(old, now, grants), kind
            proven += 1
    assert proven > 200
