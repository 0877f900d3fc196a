"""cgroup v2 device programs against the real kernel.

Programs in the shapes runc, systemd and libnvidia-container emit (and random
arithmetic) are loaded with BPF_PROG_LOAD, attached to fresh cgroups under the
cgroup2 mount (BPF_F_ALLOW_MULTI, nested), read back through read_access (the
daemon's own syscall path), and every verdict is compared with what the kernel
does to a child process in that cgroup: open() of a mknod'ed node (EPERM = deny,
ENXIO = allow) and mknod() for `m`.
"""

from __future__ import annotations

import os
import random

import pytest

from nvsymlinkd import record
from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access import bpfprog
from nvsymlinkd.access.cgroup import find_cgroup_mounts, read_access
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.root import HostRoot
from tests import bpfasm
from tests.bpfasm import CgroupDirs, kernel_probe, make_nodes
from tests.conftest import skip_or_fail

SEED = int(os.environ.get("NVSD_TEST_SEED", "20261122"))
ACCESSES = ("r", "w", "rw", "m")
ROOT = HostRoot("/")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    if os.geteuid() != 0:
        skip_or_fail("needs root (bpf, cgroups, mknod)")
    mounts = find_cgroup_mounts(ROOT)
    if mounts.v2 is None:
        skip_or_fail("needs a cgroup2 mount")
    try:
        probe = bpfprog.load_device_program(be.encode(bpfasm.runc_allow_all()))
        os.close(probe)
    except bpfprog.BpfError as e:
        skip_or_fail(f"kernel cannot load BPF_CGROUP_DEVICE programs: {e}")
    chars = bpfasm.free_majors("Character")[:3]
    blocks = bpfasm.free_majors("Block")[:1]
    devices = [("c", m, n) for m in chars for n in (0, 1, 255)] + [("c", chars[0], 70000)]
    devices += [("b", m, n) for m in blocks for n in (0, 1)]
    nodes_dir = tmp_path_factory.mktemp("nodes")
    scratch = tmp_path_factory.mktemp("mknod")
    nodes = make_nodes(str(nodes_dir), devices)
    dirs = CgroupDirs(mounts.v2.mountpoint, "bpf")
    k = {"mounts": mounts, "devices": devices, "nodes": nodes, "scratch": str(scratch),
         "dirs": dirs, "chars": chars, "blocks": blocks, "cpu_v4": _supports_cpu_v4()}
    yield k
    dirs.close()


def _supports_cpu_v4() -> bool:
    prog = [bpfasm.mov64(2, 7), bpfasm.alu(be.DIV, 2, 2, is64=True, off=1),
            bpfasm.mov64(0, 1), bpfasm.exit_()]
    try:
        os.close(bpfprog.load_device_program(be.encode(prog)))
        return True
    except bpfprog.BpfError:
        return False


class Attached:
    """Programs attached to cgroups for one case; detached and closed at exit."""

    def __init__(self):
        self.pairs = []

    def attach(self, cgroup_dir: str, insns: list, name: str = "") -> None:
        prog_fd = bpfprog.load_device_program(be.encode(insns), name)
        cg_fd = bpfprog.open_cgroup_dir(cgroup_dir)
        bpfprog.attach_device_program(cg_fd, prog_fd, bpfprog.BPF_F_ALLOW_MULTI)
        self.pairs.append((cg_fd, prog_fd))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for cg_fd, prog_fd in self.pairs:
            bpfprog.detach_device_program(cg_fd, prog_fd)
            os.close(cg_fd)
            os.close(prog_fd)


def _v1_root_procs(k) -> list:
    # the machine may be hybrid: keep the child's v1 devices cgroup at the (allow-all) root
    v1 = k["mounts"].v1_devices
    return [os.path.join(v1.mountpoint, "cgroup.procs")] if v1 else []


def compare(k, leaf_cgroup: str, stats: dict, label: str) -> None:
    """read_access + check for every device x access, against the kernel's own answer."""
    v1 = "/" if k["mounts"].v1_devices else None
    policy = read_access(ROOT, v1, leaf_cgroup, mounts=k["mounts"])
    probes = [(t, ma, mi, acc) for (t, ma, mi) in k["devices"] for acc in ACCESSES]
    kernel_says = kernel_probe([k["dirs"].real(leaf_cgroup) + "/cgroup.procs"] + _v1_root_procs(k),
                               k["nodes"], k["scratch"], probes)
    for probe, truth in zip(probes, kernel_says):
        verdict = policy.check(Device(*probe[:3]), probe[3])
        stats["cases"] += 1
        stats[truth] = stats.get(truth, 0) + 1
        if verdict.state == "unknown":
            stats["unknown"] += 1
            stats["examples"].append(f"{label} {probe}: unknown {verdict.reason}")
        elif verdict.state != truth:
            stats["mismatches"] += 1
            stats["examples"].append(f"{label} {probe}: we say {verdict.state} ({verdict.reason}),"
                                     f" kernel says {truth}\n  " + "\n  ".join(policy.describe()))


def random_rule(rng: random.Random, k, types=("c", "b")) -> Rule:
    dev_type = rng.choice(types)
    pool = k["chars"] if dev_type == "c" else k["blocks"]
    major = None if rng.random() < 0.2 else rng.choice(pool + [1, 4095])
    minor = None if rng.random() < 0.3 else rng.choice([0, 1, 255, 70000, 7])
    access = rng.choice(["r", "w", "m", "rw", "rm", "wm", "rwm", "rwm"])
    return Rule(True, dev_type, major, minor, access)


def _new_stats():
    return {"cases": 0, "mismatches": 0, "unknown": 0, "examples": [], "programs": 0}


def _report(name, stats, min_share=20):
    print(f"\n{name}: {stats['programs']} program sets, {stats['cases']} cases, "
          f"{stats['mismatches']} mismatches, {stats['unknown']} unknown; kernel allowed "
          f"{stats.get('allow', 0)}, denied {stats.get('deny', 0)} (seed {SEED})")
    assert stats["mismatches"] == 0 and stats["unknown"] == 0, "\n".join(stats["examples"][:10])
    # not vacuous: the kernel must have said both yes and no many times
    floor = stats["cases"] // min_share
    assert stats.get("allow", 0) > floor and stats.get("deny", 0) > floor


def test_producer_shapes_match_kernel(kernel):
    """runc, systemd and libnvidia-container shapes, one program per cgroup."""
    rng = random.Random(SEED)
    stats = _new_stats()
    for n in range(200):
        kind = ("runc", "runc-blacklist", "systemd", "nvidia")[n % 4]
        rules = [random_rule(rng, kernel) for _ in range(rng.randint(0, 6))]
        if kind == "runc":
            insns = bpfasm.runc_program(rules, default_allow=False)
        elif kind == "runc-blacklist":
            insns = bpfasm.runc_program(rules, default_allow=True)
        elif kind == "systemd":
            insns = bpfasm.systemd_program(rules, policy=rng.choice(["strict", "closed"]))
        else:
            base = bpfasm.runc_program([random_rule(rng, kernel) for _ in range(3)], False)
            spec = [(random_rule(rng, kernel, types=("c", "b", "a")), rng.random() < 0.8)
                    for _ in range(rng.randint(1, 4))]
            # a full wildcard would leave the original program unreachable: the verifier (and
            # so libnvidia-container itself) rejects that, so it never reaches a cgroup
            spec = [(record.replace(r, access="rw") if r.dev_type == "a" and r.major is None
                     and r.minor is None else r, allow) for r, allow in spec]
            insns = bpfasm.nvidia_prepend(spec, base, temp_reg=rng.choice([2, 6]))
        leaf = kernel["dirs"].make(f"shape{n}")
        with Attached() as att:
            att.attach(kernel["dirs"].real(leaf), insns, name="t_" + kind.replace("-", "_")[:12])
            stats["programs"] += 1
            compare(kernel, leaf, stats, f"{kind} #{n}")
    _report("producer shapes", stats)


def test_nested_and_multiple_programs_match_kernel(kernel):
    """ALLOW_MULTI: programs on the parent and two on the leaf; all must allow."""
    rng = random.Random(SEED + 1)
    stats = _new_stats()
    for n in range(50):
        leaf = kernel["dirs"].make(f"nest{n}/leaf")
        parent = leaf.rsplit("/", 1)[0]
        with Attached() as att:
            parent_rules = [random_rule(rng, kernel) for _ in range(rng.randint(2, 8))]
            if n % 3 == 0:   # a broad parent, so that the leaf programs decide more often
                parent_rules.append(Rule(True, "c", None, None, "rwm"))
            att.attach(kernel["dirs"].real(parent), bpfasm.systemd_program(parent_rules),
                       name="sd_devices")
            att.attach(kernel["dirs"].real(leaf), bpfasm.runc_program(
                [random_rule(rng, kernel) for _ in range(rng.randint(2, 8))], default_allow=False))
            if n % 2:
                att.attach(kernel["dirs"].real(leaf), bpfasm.runc_program(
                    [random_rule(rng, kernel) for _ in range(2)], default_allow=True))
            stats["programs"] += 1
            policy = read_access(ROOT, None, leaf, mounts=kernel["mounts"])
            ids = [line for line in policy.describe() if "BPF prog" in line]
            assert len(ids) == 2 + n % 2, policy.describe()
            compare(kernel, leaf, stats, f"nested #{n}")
    _report("nested programs", stats, min_share=100)


def test_random_arithmetic_matches_kernel(kernel):
    """ALU/ALU64 (K and X), signed/unsigned JMP/JMP32: the interpreter's arithmetic is the kernel's."""
    rng = random.Random(SEED + 2)
    stats = _new_stats()
    for n in range(300):
        insns = bpfasm.random_alu_program(rng, n_ops=rng.randint(3, 14), n_jumps=rng.randint(1, 4),
                                          cpu_v4=kernel["cpu_v4"])
        leaf = kernel["dirs"].make(f"alu{n}")
        with Attached() as att:
            att.attach(kernel["dirs"].real(leaf), insns)
            stats["programs"] += 1
            compare(kernel, leaf, stats, f"alu #{n}")
    _report("random arithmetic", stats)


HARDEN = "/proc/sys/net/core/bpf_jit_harden"


def test_constant_blinding_matches_kernel(kernel):
    """bpf_jit_harden=2 rewrites constants through the hidden AX register (r11) and turns
    `mov r, 0` into `xor r, r` in the xlated code we read back; verdicts must not change."""
    if not os.path.exists(HARDEN):
        skip_or_fail(f"no {HARDEN} (kernel without BPF JIT)")
    with open(HARDEN) as f:
        saved = f.read().strip()
    rng = random.Random(SEED + 3)
    stats = _new_stats()
    saw_ax = False
    try:
        with open(HARDEN, "w") as f:
            f.write("2")
        for n in range(40):
            if n % 2:
                insns = bpfasm.random_alu_program(rng, n_ops=8, n_jumps=3, cpu_v4=kernel["cpu_v4"])
            else:
                insns = bpfasm.runc_program([random_rule(rng, kernel) for _ in range(4)], n % 4 == 2)
            leaf = kernel["dirs"].make(f"blind{n}")
            with Attached() as att:
                att.attach(kernel["dirs"].real(leaf), insns)
                stats["programs"] += 1
                for info in bpfprog.read_cgroup_device_programs(kernel["dirs"].real(leaf)):
                    saw_ax = saw_ax or any(11 in (i.dst, i.src) for i in be.decode(info.xlated))
                compare(kernel, leaf, stats, f"blinded #{n}")
    finally:
        with open(HARDEN, "w") as f:
            f.write(saved)
    _report("constant blinding", stats)
    assert saw_ax, "bpf_jit_harden=2 did not show in the xlated code"


def test_helper_call_is_unknown_never_allow(kernel):
    prog = [Insn(be.JMP | be.CALL, 0, 0, 0, 5),   # bpf_ktime_get_ns
            bpfasm.mov64(0, 1), bpfasm.exit_()]
    leaf = kernel["dirs"].make("helper")
    with Attached() as att:
        att.attach(kernel["dirs"].real(leaf), prog)
        v = read_access(ROOT, None, leaf).check(Device("c", 195, 0), "rw")
    assert v.state == "unknown"
    assert "insn 0 (BPF_CALL" in v.reason and "helper" in v.reason


def test_deny_wins_over_unknown(kernel):
    leaf = kernel["dirs"].make("denywins")
    with Attached() as att:
        att.attach(kernel["dirs"].real(leaf), [Insn(be.JMP | be.CALL, 0, 0, 0, 5),
                                               bpfasm.mov64(0, 1), bpfasm.exit_()])
        att.attach(kernel["dirs"].real(leaf), bpfasm.runc_program([], default_allow=False))
        v = read_access(ROOT, None, leaf).check(Device("c", 195, 0), "r")
    assert v.state == "deny", v


def test_no_program_is_allow_and_described(kernel):
    leaf = kernel["dirs"].make("empty")
    policy = read_access(ROOT, None, leaf)
    assert policy.check(Device("c", 195, 0), "rw").state == "allow"
    assert any("no BPF_CGROUP_DEVICE program" in line for line in policy.describe())


def test_missing_cgroup_is_unknown(kernel):
    v = read_access(ROOT, None, "/nvsd-test-no-such-cgroup").check(Device("c", 195, 0), "r")
    assert v.state == "unknown" and "cgroup gone" in v.reason


def test_producer_guess_from_real_readback(kernel):
    leaf = kernel["dirs"].make("guess")
    rule = [Rule(True, "c", 195, None, "rw")]
    with Attached() as att:
        att.attach(kernel["dirs"].real(leaf), bpfasm.systemd_program(rule), name="sd_devices")
        att.attach(kernel["dirs"].real(leaf), bpfasm.runc_program(rule, False))
        att.attach(kernel["dirs"].real(leaf), bpfasm.nvidia_prepend(
            [(rule[0], True)], bpfasm.runc_program(rule, False)))
        text = "\n".join(read_access(ROOT, None, leaf).describe())
    assert "'sd_devices' (systemd)" in text
    assert "(runc/crun)" in text and "(libnvidia-container)" in text


def test_unprivileged_reader_gets_unknown(kernel):
    """Without CAP_SYS_ADMIN the bpf syscall fails: the verdict is unknown, never a crash."""
    leaf = kernel["dirs"].make("unpriv")
    with Attached() as att:
        att.attach(kernel["dirs"].real(leaf), bpfasm.runc_allow_all())
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(rfd)
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                v = read_access(ROOT, None, leaf).check(Device("c", 195, 0), "r")
                os.write(wfd, f"{v.state}|{v.reason}".encode())
            finally:
                os._exit(0)
        os.close(wfd)
        out = os.read(rfd, 4096).decode()
        os.close(rfd)
        os.waitpid(pid, 0)
    state, _, reason = out.partition("|")
    assert state == "unknown", out
    assert "EPERM" in reason or "EACCES" in reason, reason


Insn = be.Insn


def test_a_rejected_program_is_explained_by_the_verifier_log(kernel):
    """Loads go without a log (issue 39 item 4); a rejected one is loaded again with it, to say why."""
    bad = [bpfasm.mov64(0, 1)]  # no exit: the verifier rejects it
    with pytest.raises(bpfprog.BpfError) as err:
        bpfprog.load_device_program(be.encode(bad))
    assert err.value.errno == 22 and "verifier: " in str(err.value)
    assert "exit" in str(err.value).split("verifier: ", 1)[1], str(err.value)
