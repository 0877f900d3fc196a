"""The BPF device-program interpreter without a kernel: producer shapes agree with the
devices.list semantics, arithmetic corner cases, and everything it must refuse (unknown)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access.bpfeval import Insn
from nvsymlinkd.access.bpfgen import alu, exit_, ja, jmp, ldx, mov32, mov64
from nvsymlinkd.access.bpfprog import DeviceProgram
from nvsymlinkd.access.cgroup import AccessPolicy, AttachedProgram, V1Source, V2Source
from nvsymlinkd.access.rules import decide, parse_devices_list
from nvsymlinkd.host.devices import Access, Device, Rule
from tests import bpfasm

ACCESS = st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"])
REQUEST_ACCESS = st.sampled_from(["r", "w", "m", "rw"])
# systemd cannot express `*:N`, so its rules have a minor only with a major
systemd_rule = st.builds(lambda t, ma, mi, a: Rule(True, t, ma, mi if ma is not None else None, a),
                         st.sampled_from(["c", "b"]), st.one_of(st.none(), st.integers(0, 300)),
                         st.one_of(st.none(), st.integers(0, 300)), ACCESS)
runc_rule = st.builds(Rule, st.just(True), st.sampled_from(["c", "b"]),
                      st.one_of(st.none(), st.integers(0, 300)),
                      st.one_of(st.none(), st.integers(0, 300)), ACCESS)
request = st.tuples(st.builds(Device, st.sampled_from(["c", "b"]), st.integers(0, 300), st.integers(0, 300)),
                    REQUEST_ACCESS.map(Access))


GPU0 = Device.char(195, 0)


def run(insns, device=GPU0, access="rw"):
    return be.check(be.decode(be.encode(insns)), device, Access(access))


@settings(max_examples=300, deadline=None)
@given(st.lists(runc_rule, max_size=8), request)
def test_runc_allow_list_means_devices_list(rules, req):
    expected = decide(rules, *req).allowed
    assert run(bpfasm.runc_program(rules, default_allow=False), *req).allowed is expected


@settings(max_examples=300, deadline=None)
@given(st.lists(systemd_rule, max_size=8), request)
def test_systemd_allow_list_means_devices_list(rules, req):
    expected = decide(rules, *req).allowed
    assert run(bpfasm.systemd_program(rules, policy="strict"), *req).allowed is expected


def test_systemd_closed_policy_allows_its_static_devices_only():
    prog = bpfasm.systemd_program([], policy="closed")
    assert run(prog, Device.char(1, 3), "rw").allowed is True          # /dev/null
    assert run(prog, Device.char(136, 4), "rw").allowed is True        # pts
    assert run(prog, Device.char(136, 4), "m").allowed is False
    assert run(prog, Device.char(195, 0), "r").allowed is False


def test_nvidia_prepend_both_scratch_registers():
    """Current libnvidia-container uses r6 as the access scratch; an older stored version used
    r2, which also holds the type: a failed access test then corrupts the next block's type
    test. The interpreter runs whichever shape the kernel holds."""
    base = bpfasm.runc_program([], default_allow=False)                  # deny all
    spec = [(Rule(True, "c", 195, None, "rw"), True),                    # evaluated second
            (Rule(True, "c", 200, 0, "m"), True)]                        # evaluated first
    fixed = bpfasm.nvidia_prepend(spec, base, temp_reg=6)
    assert run(fixed, Device.char(195, 0), "rw").allowed is True
    assert run(fixed, Device.char(195, 0), "r").allowed is True
    old = bpfasm.nvidia_prepend(spec, base, temp_reg=2)
    # rw (bits 6): the m-block leaves r2 = 6 & 1 = 0; the 195 block compares r2 with CHAR (2),
    # falls through to the original program: deny, although `c 195:* rw` is in the spec
    assert run(old, Device.char(195, 0), "rw").allowed is False
    assert run(old, Device.char(200, 0), "m").allowed is True
    assert be.guess_producer("", be.decode(be.encode(old))) == "libnvidia-container"


def test_producer_guesses():
    rule = [Rule(True, "c", 195, 0, "rw")]
    assert be.guess_producer("sd_devices", []) == "systemd"
    assert be.guess_producer("", bpfasm.systemd_program(rule)) == "systemd"
    assert be.guess_producer("", bpfasm.runc_program(rule, False)) == "runc/crun"
    assert be.guess_producer("", [mov64(0, 1), exit_()]) == "unknown producer"


@pytest.mark.parametrize("insns,why", [
    ([Insn(be.JMP | be.CALL, 0, 0, 0, 5), mov64(0, 1), exit_()], "BPF_CALL"),
    ([Insn(be.LD | be.SIZE_DW, 1, 1, 0, 3), Insn(0, 0, 0, 0, 0), mov64(0, 1), exit_()],
     "loads a map"),
    ([mov64(0, 1), ja(-2), exit_()], "loop"),
    ([mov64(0, 1), ja(-1)], "loop"),
    ([exit_()], "r0 read before it is set"),
    ([ldx(be.SIZE_W, 0, 1, 12), exit_()], "outside the 12-byte context"),
    ([ldx(be.SIZE_W, 0, 10, -4), exit_()], "not the context pointer"),
    ([Insn(be.STX | be.MODE_MEM | be.SIZE_W, 10, 1, -4, 0), mov64(0, 1), exit_()], "writes memory"),
    ([mov64(0, 1), ja(5)], "left the program"),
    ([Insn(be.LD | be.SIZE_DW, 0, 0, 0, 1)], "truncated"),
    ([alu(be.ADD, 1, src=1, x=True, is64=True), mov64(0, 1), exit_()], "pointer"),
    ([alu(be.MOV, 0, src=1, x=True), exit_()], "pointer"),
    ([mov64(0, 1), Insn(be.JMP | 0xE0, 0, 0, 0, 0), exit_()], "insn 1"),
])
def test_unevaluable_is_unknown_never_allow(insns, why):
    r = run(insns)
    assert r.allowed is None and why in r.reason, r.reason


def test_ld_imm64_constant_and_pointer_arithmetic():
    prog = [Insn(be.LD | be.SIZE_DW, 6, 0, 0, 0x00000002), Insn(0, 0, 0, 0, 0x1),   # r6 = 1<<32 | 2
            mov64(7, 1), alu(be.LSH, 7, 32, is64=True), alu(be.OR, 7, 2, is64=True),
            alu(be.ADD, 1, 4, is64=True), ldx(be.SIZE_W, 8, 1, 0),                   # major via r1+4
            mov64(0, 0), jmp(be.JNE, 6, 2, src=7, x=True), jmp(be.JNE, 8, 1, 195), mov64(0, 1),
            exit_()]
    assert run(prog, Device.char(195, 0)).allowed is True
    assert run(prog, Device.char(196, 0)).allowed is False


@pytest.mark.parametrize("ops,expected", [
    ([mov64(2, 7), alu(be.DIV, 2, src=3, x=True, is64=True)], 0),                # x / 0 = 0
    ([mov64(2, 7), alu(be.MOD, 2, src=3, x=True, is64=True)], 7),                # x % 0 = x
    ([mov64(2, -8), alu(be.ARSH, 2, 1, is64=True)], (-4) & be.M64),
    ([mov64(2, -8), alu(be.ARSH, 2, 1)], (-4) & be.M32),                          # 32-bit, zero-extended
    ([mov64(2, -1), alu(be.ADD, 2, 1)], 0),                                       # wraps at 32 bits
    ([mov64(2, -1), alu(be.ADD, 2, 0)], be.M32),                                  # alu32 zero-extends
    ([mov64(2, -7), alu(be.DIV, 2, 2, is64=True, off=1)], (-3) & be.M64),         # sdiv truncates
    ([mov64(2, -7), alu(be.MOD, 2, 2, is64=True, off=1)], (-1) & be.M64),         # smod sign of dividend
    ([mov32(2, 0x1234), Insn(be.ALU | be.END | be.SRC_X, 2, 0, 0, 16)], 0x3412),  # to big-endian
    ([mov64(2, 0xFF), alu(be.MOV, 2, src=2, x=True, is64=True, off=8)], be.M64),  # movsx8
    ([mov64(2, 5), alu(be.NEG, 2, is64=True)], (-5) & be.M64),
    ([mov64(2, 1), alu(be.LSH, 2, src=4, x=True)], 1 << (195 & 31)),             # shift count masked
])
def test_alu_corner_cases(ops, expected):
    """r3 is 0 here; the result lands in r2 and is compared exactly."""
    lo, hi = expected & be.M32, expected >> 32
    prog = ([mov64(3, 0), ldx(be.SIZE_W, 4, 1, 4)] + ops +
            [Insn(be.LD | be.SIZE_DW, 5, 0, 0, lo), Insn(0, 0, 0, 0, hi),
             mov64(0, 0), jmp(be.JNE, 2, 1, src=5, x=True), mov64(0, 1), exit_()])
    r = run(prog, Device.char(195, 0))
    assert r.allowed is True, r


def test_jmp32_compares_low_words_signed():
    prog = [Insn(be.LD | be.SIZE_DW, 2, 0, 0, -1), Insn(0, 0, 0, 0, 5),       # r2 = 0x5_ffffffff
            mov64(0, 0), jmp(be.JSLT, 2, 1, 0, is32=True), exit_(), mov64(0, 1), exit_()]
    assert run(prog).allowed is True                                           # (s32)-1 < 0
    prog[3] = jmp(be.JSLT, 2, 1, 0)                                            # 64-bit: positive
    assert run(prog).allowed is False


def test_decode_rejects_partial_instruction():
    with pytest.raises(ValueError):
        be.decode(b"\x95" * 9)


def _v2(*programs):
    infos = [AttachedProgram(DeviceProgram(i + 1, "", "00" * 8, 15, be.encode(p)), be.decode(be.encode(p)),
                      "test") for i, p in enumerate(programs)]
    return V2Source("/x", "/sys/fs/cgroup/x", infos)


def test_policy_is_the_and_of_all_sources():
    allow_all = bpfasm.runc_allow_all()
    deny_all = bpfasm.runc_program([], default_allow=False)
    call = [Insn(be.JMP | be.CALL, 0, 0, 0, 5), mov64(0, 1), exit_()]
    v1_gpu = V1Source("/l", rules=parse_devices_list("c 195:* rw\n", "/l"))
    v1_none = V1Source("/l", rules=[])
    assert AccessPolicy([v1_gpu, _v2(allow_all)]).check(Device("c", 195, 0), "rw").state == "allow"
    assert AccessPolicy([v1_none, _v2(allow_all)]).check(Device("c", 195, 0), "rw").state == "deny"
    assert AccessPolicy([v1_gpu, _v2(allow_all, deny_all)]).check(Device("c", 195, 0), "r").state == "deny"
    v = AccessPolicy([v1_gpu, _v2(allow_all, call)]).check(Device("c", 195, 0), "r")
    assert v.state == "unknown" and "insn 0 (BPF_CALL" in v.reason
    assert AccessPolicy([v1_none, _v2(call)]).check(Device("c", 195, 0), "r").state == "deny"
    assert AccessPolicy([V1Source("/l", error="cannot read /l")]).check(Device("c", 1, 3), "r").state == "unknown"
    assert AccessPolicy([]).check(Device("c", 1, 3), "r").state == "allow"
    with pytest.raises(ValueError):
        AccessPolicy([]).check(Device("a", 1, 3), "r")
    with pytest.raises(ValueError):
        AccessPolicy([]).check(Device("c", 1, 3), "x")
