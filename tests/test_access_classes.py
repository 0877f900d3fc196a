"""A policy's device classes (AccessPolicy.equivalence_key) against checking every device.

On a MIG host every container's policy is asked about ~2,000 capability nodes; the verifier decides
once per class of devices the policy cannot tell apart. Random devices.list texts and random devices:
two devices of one class must get the same state from every check(), and the verifier's reading of
what a cgroup allows (granted, unknown, one-check "rw") must be what checking each device gives.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.access import bpfeval, bpfgen
from nvsymlinkd.access.cgroup import policy_of
from nvsymlinkd.containers.expected import Expected
from nvsymlinkd.host.devices import Access, Device, Rule
from nvsymlinkd.host.nodes import NvidiaNode
from nvsymlinkd.verify.evaluate import HostDevices, read_live

MAJORS = (195, 509, 510)
number = st.one_of(st.just("*"), st.integers(0, 6).map(str))
rule = st.tuples(st.sampled_from("abc"), st.one_of(st.just("*"), st.sampled_from(MAJORS).map(str)), number,
                 st.sets(st.sampled_from("rwm"), min_size=1).map(lambda s: "".join(sorted(s))))
rules = st.lists(rule, max_size=6).map(lambda rs: "".join(f"{t} {ma}:{mi} {a}\n" for t, ma, mi, a in rs))
device = st.builds(Device, st.sampled_from("bc"), st.sampled_from(MAJORS), st.integers(0, 9))
ACCESSES = tuple(Access(a) for a in ("r", "w", "m", "rw", "rm", "wm", "rwm"))


@settings(max_examples=400, deadline=None)
@given(text=rules, devices=st.lists(device, min_size=2, max_size=12))
def test_devices_of_one_class_get_the_same_answers(text, devices):
    policy = policy_of(text)
    by_class: dict = {}
    for d in devices:
        key = policy.equivalence_key(d)
        assert key is not None  # v1 rules read without error always tell
        by_class.setdefault(key, []).append(d)
    for members in by_class.values():
        first = members[0]
        for other in members[1:]:
            for access in ACCESSES:
                assert policy.check(first, access).state == policy.check(other, access).state, (text, first, other)


class _PerDevice:
    """The same policy without its classes: what the verifier did before, one check per device."""

    def __init__(self, policy):
        self.check = policy.check


@settings(max_examples=200, deadline=None)
@given(text=rules, minors=st.sets(st.integers(0, 40), max_size=30), expected=st.sets(st.integers(0, 9), max_size=3))
def test_the_verifier_reads_a_cgroup_as_checking_each_device_does(text, minors, expected):
    policy = policy_of(text)
    host = HostDevices(tuple(NvidiaNode(f"/dev/nvidia-caps/nvidia-cap{m}", "cap", 509, m) for m in sorted(minors))
                       + (NvidiaNode("/dev/nvidia0", "gpu", 195, 0),), frozenset({195, 509}), None)
    exp = Expected({Device.char(195, m): "rw" for m in expected})
    dev_nodes = [("/dev/nvidia-caps/nvidia-cap3", Device.char(509, 3)), ("/dev/other", Device.char(7, 1))]
    assert read_live(policy, exp, host, dev_nodes) == read_live(_PerDevice(policy), exp, host, dev_nodes)


def test_bpf_programs_are_checked_device_by_device():
    program = [bpfeval.Insn(0xb7, 0, 0, 0, 1), bpfeval.Insn(0x95, 0, 0, 0, 0)]  # r0 = 1; exit: allow all
    assert policy_of(programs=[program]).equivalence_key(Device.char(509, 5)) is None
    assert policy_of("c 509:* rw\n", programs=[program]).equivalence_key(Device.char(509, 5)) is None


# --- AccessPolicy.states(): check()'s states for many devices at once (repair/keep.py, issue 38) ---------

program_rule = st.builds(lambda t, ma, mi, a, allow: Rule(allow, t, ma, mi, a), st.sampled_from("abc"), st.one_of(st.none(), st.sampled_from(MAJORS)),
    st.one_of(st.none(), st.integers(0, 6)), st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]), st.booleans())
UNDECODED = [bpfeval.Insn(0x61, 4, 1, 4, 0), bpfeval.Insn(0x77, 4, 0, 0, 1),   # r4 = major >> 1: arithmetic
             bpfeval.Insn(0x55, 4, 0, 1, 97), bpfeval.Insn(0xb7, 0, 0, 0, 1), bpfeval.Insn(0x95, 0, 0, 0, 0),
             bpfeval.Insn(0xb7, 0, 0, 0, 0), bpfeval.Insn(0x95, 0, 0, 0, 0)]


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.none(), rules), programs=st.lists(st.one_of(
           st.tuples(st.lists(program_rule, max_size=5), st.booleans()).map(lambda p: bpfgen.program(*p)),
           st.just(UNDECODED), st.just([])), max_size=3),
       devices=st.lists(device, min_size=1, max_size=8))
def test_states_are_checks_states(text, programs, devices):
    policy = policy_of(text, programs=programs)
    state = policy.states()
    for d in devices:
        for access in ACCESSES:
            assert state(d, access) == policy.check(d, access).state, (text, programs, d, access)
