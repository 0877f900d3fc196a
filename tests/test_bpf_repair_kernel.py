"""The bpf-program repair (cgroup v2, cgroupfs driver) against the real kernel.

A GPU container's runtime state (containerd's layout in a fake --root tree) points at a real cgroup2
directory; its device program is the runtime's (runc's shape, attached with BPF_F_ALLOW_MULTI) until
it is replaced the way systemd's re-apply does (attach the new, detach the old) by one without
c 195:0. Ground truth is a real process in that cgroup: open() of a mknod'ed c 195:0 node gives EPERM
while the cgroup denies it and ENXIO once it is allowed (no driver behind the node).

Then the differential test: random rule sets through the generator (bpfgen), the interpreter
(bpfeval on the kernel's own xlated code) and the kernel (open/mknod from a process in the cgroup),
for every device class the program distinguishes, and the same for the program the repair derives
from it (bpfproof.policy_rules): zero disagreements.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access import bpfgen, bpfprog, bpfproof
from nvsymlinkd.config import Config
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.repair.apply import repair_all
from nvsymlinkd.repair.plan import RepairHistory
from tests import bpfasm
from tests.bpfasm import kernel_probe, make_nodes
from tests.conftest import skip_or_fail
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_node, spec_rule
from tests.test_verify_cache import GPU_SPEC, Program, two_gpu_host

pytestmark = pytest.mark.usefixtures("no_system_bus")
SEED = int(os.environ.get("NVSD_TEST_SEED", "20261126"))
# runc's default allow list (libcontainer/specconv AllowedDevices, as runc's emulator states it)
RUNC_DEFAULTS = [Rule(True, "c", None, None, "m"), Rule(True, "b", None, None, "m"), Rule(True, "c", 1, 3, "rwm"),
                 Rule(True, "c", 1, 8, "rwm"), Rule(True, "c", 1, 7, "rwm"), Rule(True, "c", 5, 0, "rwm"),
                 Rule(True, "c", 1, 5, "rwm"), Rule(True, "c", 1, 9, "rwm"), Rule(True, "c", 5, 1, "rwm"),
                 Rule(True, "c", 136, None, "rwm"), Rule(True, "c", 5, 2, "rwm"), Rule(True, "c", 10, 200, "rwm")]
HEALTHY = RUNC_DEFAULTS + [Rule(True, "c", 195, 0, "rw"), Rule(True, "c", 195, 255, "rw")]
LOST = RUNC_DEFAULTS + [Rule(True, "c", 195, 255, "rw")]
C0_DEVICE = Device("c", 195, 0)
PROBES = [("c", 195, 0, "rw"), ("c", 195, 255, "rw"), ("c", 195, 1, "rw"), ("c", 195, 0, "m")]


class Gpu:
    """A GPU container (containerd layout, cgroupfs driver) whose cgroup2 directory is real."""

    def __init__(self, fakehost, v2, tmp_path, cid: str, spec=GPU_SPEC):
        self.root = two_gpu_host(fakehost)
        self.cid = cid
        self.cgroup = v2.make(cid)
        self.real = v2.real(self.cgroup)
        pid = Layouts(fakehost).containerd(cid, spec, cgroup=self.cgroup)
        fakehost.write(f"/proc/{pid}/cgroup", Layouts.v2_cgroup(self.cgroup))  # pure v2: the program decides
        (tmp_path / "nodes").mkdir()
        (tmp_path / "scratch").mkdir()
        self.nodes = make_nodes(str(tmp_path / "nodes"), [("c", 195, 0), ("c", 195, 255), ("c", 195, 1)])
        self.scratch = str(tmp_path / "scratch")
        self.programs: list = []

    def runtime_program(self, rules, flags=bpfprog.BPF_F_ALLOW_MULTI) -> Program:
        if flags == bpfprog.BPF_F_ALLOW_MULTI:
            prog = Program(self.real, rules)
        else:   # attached without BPF_F_ALLOW_MULTI (an older runtime's exclusive attach)
            prog = Program.__new__(Program)
            prog.cg_fd = bpfprog.open_cgroup_dir(self.real)
            prog.prog_fd = bpfprog.load_device_program(be.encode(bpfasm.runc_program(rules, False)))
            bpfprog.attach_device_program(prog.cg_fd, prog.prog_fd, flags)
        self.programs.append(prog)
        return prog

    def runtime_reattach(self, rules) -> None:
        """runc (1.1, ebpf_linux.go) with one old program: BPF_F_ALLOW_MULTI | BPF_F_REPLACE over it."""
        cg_fd = bpfprog.open_cgroup_dir(self.real)
        try:
            (old,) = bpfprog.query_device_program_ids(cg_fd, effective=False)
            old_fd = bpfprog.program_fd(old)
            runc_fd = bpfprog.load_device_program(be.encode(bpfasm.runc_program(rules, False)))
            try:
                bpfprog.attach_device_program(cg_fd, runc_fd, bpfprog.BPF_F_ALLOW_MULTI | bpfprog.BPF_F_REPLACE,
                                              old_fd)
            finally:
                os.close(old_fd)
                os.close(runc_fd)
        finally:
            os.close(cg_fd)

    def kernel(self) -> list:
        """What the kernel does to a process in the container's cgroup, per PROBES."""
        return kernel_probe([self.real + "/cgroup.procs"], self.nodes, self.scratch, PROBES)

    def own(self) -> tuple:
        fd = bpfprog.open_cgroup_dir(self.real)
        try:
            ids, flags = bpfprog.query_device_programs(fd, effective=False)
        finally:
            os.close(fd)
        return [bpfprog.read_program(i).name for i in ids], flags

    def close(self) -> None:
        bpfasm.detach_device_programs(self.real)
        for p in self.programs:
            os.close(p.cg_fd)
            if p.prog_fd is not None:
                os.close(p.prog_fd)


@pytest.fixture
def gpu(fakehost, v2_free195, tmp_path):
    made = []

    def make(cid="v2gpu-0f3c9a1e", spec=GPU_SPEC):
        g = Gpu(fakehost, v2_free195, tmp_path, cid, spec)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def repair_cli(nvsymlinkd_cli, g, *args):
    proc = nvsymlinkd_cli("--root", g.root.root, "repair", "--json", *args)
    return proc, json.loads(proc.stdout) if proc.stdout.startswith("{") else None


def test_lost_device_gets_a_new_program_and_the_kernel_agrees(gpu, nvsymlinkd_cli):
    g = gpu()
    prog = g.runtime_program(HEALTHY)
    assert g.kernel() == ["allow", "allow", "deny", "allow"]
    prog.replace(LOST)  # as systemd's re-apply does: attach the new, detach the old
    assert g.kernel() == ["deny", "allow", "deny", "allow"]

    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (res,) = doc["containers"]
    assert res["status"] == "repaired" and res["mechanism"] == "bpf-program", res
    assert [(x["major"], x["minor"], x["access"]) for x in res["grants"]] == [(195, 0, "rw")]
    assert res["steps"][0].startswith(f"BPF_PROG_ATTACH {g.real}") and "BPF_F_ALLOW_MULTI" in res["steps"][0]
    assert res["steps"][1].startswith("BPF_PROG_DETACH") and res["steps"][2].startswith("read back:")
    assert "allow c 195:0 rwm" in res["program"] and res["program"][-1] == "deny everything else"
    assert res["verification"]["c 195:0"]["state"] == "allow"
    # the kernel agrees, from a process in the cgroup: c 195:0 back, and nothing else changed
    assert g.kernel() == ["allow", "allow", "deny", "allow"]
    assert g.own() == (["nvsymlinkd"], bpfprog.BPF_F_ALLOW_MULTI)   # ours alone: the old one is detached
    # and the verifier, through its normal path, finds the container fine
    summary = json.loads(nvsymlinkd_cli("--root", g.root.root, "check", "--json").stdout)["summary"]
    assert (summary["ok"], summary["lost"], summary["unknown"]) == (1, 0, 0)


# the legacy NVIDIA hook's container: the spec has only nvidiactl; the hook grants the GPU itself
HOOK_SPEC = oci_spec(rules=[spec_rule(195, 255)], nodes=[spec_node("/dev/nvidiactl", 195, 255)],
                     env=["NVIDIA_VISIBLE_DEVICES=0"])


@pytest.mark.parametrize("temp_reg", [6, 2])
def test_a_hook_granted_device_is_given_back_from_the_baseline(gpu, nvsymlinkd_cli, temp_reg):
    """libnvidia-container prepends its blocks to the runtime's program (nvcgo ebpf.go); the daemon records
    the healthy access as the baseline; the runtime's program alone comes back (the hook's grant gone):
    the baseline is the trusted source, and the new program gives exactly c 195:0 back."""
    from nvsymlinkd.verify.verifier import verify_all

    g = gpu("v2hook-7b22e0c1", HOOK_SPEC)
    prog = g.runtime_program(LOST)
    hooked = bpfasm.nvidia_prepend([(Rule(True, "c", 195, 0, "rw"), True)], bpfasm.runc_program(LOST, False),
                                   temp_reg=temp_reg)
    new = bpfprog.load_device_program(be.encode(hooked))
    bpfprog.attach_device_program(prog.cg_fd, new, bpfprog.BPF_F_ALLOW_MULTI)
    prog.detach()
    prog.prog_fd = new
    assert g.kernel()[0] == "allow"
    report = verify_all(g.root, Config(), update_baseline=True, use_bus=False, with_host=False)  # the daemon's pass
    assert [c.baseline for c in report.containers] == ["recorded"]
    prog.replace(LOST)
    assert g.kernel()[0] == "deny"
    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "repaired" and res["mechanism"] == "bpf-program", res
    assert [(x["minor"], x["source"]) for x in res["grants"]] == [(0, "baseline")]
    assert g.kernel() == ["allow", "allow", "deny", "allow"]


def test_bpfdrop_takes_devices_away_and_repair_gives_them_back(gpu, nvsymlinkd_cli):
    """tests/bpfdrop.py, the GPU suite's way to make the loss on a real host, then the repair."""
    import subprocess
    import sys

    g = gpu()
    g.runtime_program(HEALTHY)
    proc = subprocess.run([sys.executable, "tests/bpfdrop.py", g.real, "c 195:0", "c 195:255"], capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["deny c 195:0 rw", "deny c 195:255 rw"]
    assert g.kernel() == ["deny", "deny", "deny", "allow"] and g.own()[0] == ["bpfdrop"]
    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "repaired" and [x["minor"] for x in res["grants"]] == [0, 255], res
    assert g.kernel() == ["allow", "allow", "deny", "allow"]


def test_dry_run_shows_the_program_and_changes_nothing(gpu, nvsymlinkd_cli):
    g = gpu()
    g.runtime_program(LOST)
    before = g.own()
    proc, doc = repair_cli(nvsymlinkd_cli, g, "--dry-run", g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "would-repair" and res["mechanism"] == "bpf-program", res
    assert res["program"][:3] == ["allow c 1:3 rwm", "allow c 1:5 rwm", "allow c 1:7 rwm"]
    assert "allow c 195:0 rwm" in res["program"] and "allow c *:* m" in res["program"]
    assert res["steps"] == []
    assert g.own() == before and g.kernel()[0] == "deny"
    text = nvsymlinkd_cli("--root", g.root.root, "repair", "--dry-run", g.cid).stdout
    assert "would grant c 195:0 rw via bpf-program" in text and "  program: allow c 195:0 rwm" in text


def test_a_program_attached_without_allow_multi_is_replaced_in_place(gpu, nvsymlinkd_cli):
    g = gpu()
    g.runtime_program(LOST, flags=0)
    assert g.kernel()[0] == "deny"
    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "repaired", res
    assert "no flags" in res["steps"][0] and "replaced in place" in res["steps"][1]
    assert g.kernel() == ["allow", "allow", "deny", "allow"]
    assert g.own() == (["nvsymlinkd"], 0)


def test_a_program_not_fully_decoded_is_refused_and_left_alone(gpu, nvsymlinkd_cli):
    g = gpu()
    prog = g.runtime_program(LOST)
    # arithmetic on the minor: evaluable for one request, but not decodable for every device
    odd = [bpfasm.ldx(be.SIZE_W, 6, 1, 8), bpfasm.alu(be.ADD, 6, 1, is64=True)] + bpfasm.runc_program(LOST, False)
    new = bpfprog.load_device_program(be.encode(odd))
    bpfprog.attach_device_program(prog.cg_fd, new, bpfprog.BPF_F_ALLOW_MULTI)
    prog.detach()
    prog.prog_fd = new
    before = g.own()
    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "cannot-repair" and "cannot be fully decoded" in res["cannot"], res
    assert "on the device's minor" in res["cannot"]
    assert proc.returncode != 0
    assert g.own() == before and g.kernel()[0] == "deny"


@pytest.mark.parametrize("flags", [bpfprog.BPF_F_ALLOW_MULTI, 0])
def test_a_read_back_that_does_not_prove_puts_the_old_program_back(gpu, monkeypatch, flags):
    """After the swap the kernel's own view is proven again; when it does not prove (here: made to fail),
    the old program goes back and the repair fails: never a program nvsymlinkd could not prove."""
    from nvsymlinkd.containers.model import Grant as PlanGrant
    from nvsymlinkd.errors import RepairError
    from nvsymlinkd.repair import bpfrepair
    from nvsymlinkd.repair.model import RepairRequest

    g = gpu()
    g.runtime_program(LOST, flags=flags)
    grants = (PlanGrant(C0_DEVICE, "rw", "spec"),)
    request = RepairRequest(g.cid, "containerd", None, None, g.cgroup, None, "cgroupfs", grants)
    prepared = bpfrepair.prepare(g.root, request, grants)
    monkeypatch.setattr(bpfproof, "prove", lambda *a: bpfproof.Proof(1, 4, (), ("made to fail",)))
    steps = []
    with pytest.raises(RepairError, match="does not prove: made to fail"):
        bpfrepair.replace(g.root, prepared, grants, steps)
    assert steps[-1].startswith("put back the old programs")
    assert g.own() == ([""], flags) and g.kernel()[0] == "deny"


def test_the_runtime_attaching_its_program_again_is_repaired_again_within_the_rate_limit(gpu):
    """What happens next: the runtime re-applies its own program (runc attaches with BPF_F_ALLOW_MULTI |
    BPF_F_REPLACE over ours). The daemon's next pass (repair_all is what it runs) sees the loss: a second
    repair inside the rate limit's window is reported, not looped; after the window it is repaired again."""
    g = gpu()
    g.runtime_program(LOST)
    config = Config()
    history, now = RepairHistory(), [1000.0]

    def repair():
        (res,) = repair_all(g.root, config, [g.cid], history=history, clock=lambda: now[0], use_bus=False)
        return res

    assert repair().status == "repaired" and g.kernel()[0] == "allow"
    g.runtime_reattach(LOST)
    assert g.kernel()[0] == "deny" and g.own()[0] == [""]
    now[0] += 60   # the next resync
    res = repair()
    assert res.status == "cannot-repair" and "rate limit" in res.plan.cannot
    assert g.kernel()[0] == "deny"
    now[0] += 600  # past the window
    assert repair().status == "repaired" and g.kernel()[0] == "allow"


def test_the_daemon_repairs_at_its_next_pass_and_reports_a_loss_that_comes_back(gpu):
    """The real daemon (periodic resync every second: nothing in the kernel announces a new device
    program): a lost device gets a new program at its next pass; when the runtime attaches its own program
    again, the next pass sees the loss and, inside the rate limit's window, reports it (repair-refused)
    instead of repairing in a loop."""
    import time

    from tests.daemonproc import DaemonProcess

    g = gpu()
    g.runtime_program(LOST)
    d = DaemonProcess(g.root.root, "--resync-interval", "1", journal=True)
    try:
        _, fields = d.wait_entry("repair-done", g.cid)
        assert fields["NVSYMLINKD_MECHANISM"] == "bpf-program" and fields["NVSYMLINKD_DEVICES"] == "c 195:0:rw"
        assert g.kernel()[0] == "allow" and g.own()[0] == ["nvsymlinkd"]
        mark = d.mark()
        g.runtime_reattach(LOST)   # the runtime's program again, in ours' place
        taken = time.monotonic()
        assert g.kernel()[0] == "deny"
        message, _ = d.wait_entry("repair-refused", g.cid, mark)
        noticed = time.monotonic() - taken
        assert "rate limit" in message
        d.wait_entry("container-lost", g.cid, mark)
        assert g.kernel()[0] == "deny"   # reported, not repaired in a loop
        print(f"\nruntime re-attached its program -> the daemon's report: {noticed:.2f} s (resync_interval 1 s)")
        assert d.alive()
    finally:
        d.stop()


# --- the differential test ----------------------------------------------------------------------

def random_rules(rng: random.Random, char: int, block: int) -> list:
    rules = []
    for _ in range(rng.randint(0, 7)):
        dev_type = rng.choice(["c", "c", "b", "a"])
        major = rng.choice([char if dev_type == "c" else block if dev_type == "b" else rng.choice([char, block]), None])
        rules.append(Rule(rng.random() < 0.7, dev_type, major, rng.choice([0, 1, 7, None]),
                          rng.choice(["r", "w", "m", "rw", "rm", "wm", "rwm"])))
    return rules


def test_differential_generator_interpreter_kernel(v2_free195, tmp_path, capsys):
    """Random rule sets: the generator's program, loaded and attached, judged by the interpreter (on the
    kernel's xlated code) and by the kernel, for every class it distinguishes; then the program the repair
    derives from it (policy_rules), by the kernel on the same classes. Zero disagreements."""
    rng = random.Random(SEED)
    chars, blocks = bpfasm.free_majors("Character"), bpfasm.free_majors("Block")
    if not chars or not blocks:
        skip_or_fail("needs free char and block majors")
    named = {"c": chars[0], "b": blocks[0]}   # the majors rules name; every sample has no driver (ENXIO)
    others = {t: [m for m in free if m not in named.values()] for t, free in (("c", chars), ("b", blocks))}
    if not others["c"] or not others["b"]:
        skip_or_fail("needs a second free char and block major")
    sets = int(os.environ.get("NVSD_DIFF_SETS", "60"))
    counts = {"rule sets": 0, "classes": 0, "probes": 0, "interpreter vs kernel": 0, "derived vs kernel": 0}
    (tmp_path / "n").mkdir()
    (tmp_path / "s").mkdir()
    for n in range(sets):
        rules = random_rules(rng, named["c"], named["b"])
        default_allow = rng.random() < 0.3
        prog = bpfgen.program(rules, default_allow)
        producer = rng.choice(["runc", "systemd", "nvidia"])   # the shapes a repair meets
        if producer == "systemd":   # an allow list; no `a` type, no minor without a major
            allow = [Rule(True, r.type, r.major, r.minor if r.major is not None else None, r.access)
                     for r in rules if r.type != "a"]
            prog = bpfasm.systemd_program(allow, rng.choice(["strict", "closed"]))
        elif producer == "nvidia":  # the hook's blocks prepended to the runtime's program
            hook = [(Rule(True, r.type, r.major, r.minor, r.access), r.allow) for r in rules[:2] if r.type != "a"]
            prog = bpfasm.nvidia_prepend(hook, bpfgen.program(rules[2:], default_allow), temp_reg=rng.choice([2, 6]))
        counts[producer] = counts.get(producer, 0) + 1
        derived = bpfgen.program(bpfproof.policy_rules([prog]))
        classes = bpfproof.classes([prog, derived])
        samples = [(c.type, c.sample.major if c.major is not None else others[c.type][0], c.sample.minor, a)
                   for c in classes for a in ("r", "w", "rw", "m")]
        nodes = make_nodes(str(tmp_path / "n"), sorted({p[:3] for p in samples}))
        verdicts = {}
        for name, insns in (("generated", prog), ("derived", derived)):
            cg = v2_free195.make(f"diff{n}-{name}")
            cg_fd = bpfprog.open_cgroup_dir(v2_free195.real(cg))
            prog_fd = bpfprog.load_device_program(be.encode(insns))
            try:
                bpfprog.attach_device_program(cg_fd, prog_fd, bpfprog.BPF_F_ALLOW_MULTI)
                xlated = be.decode(bpfprog.read_program_fd(prog_fd).xlated)
                kernel = kernel_probe([v2_free195.real(cg) + "/cgroup.procs"], nodes, str(tmp_path / "s"), samples)
                # past the device cgroup, a real driver (systemd's static list: null, ptmx, pts) answers
                # with its own errno: only EPERM is the cgroup's no
                kernel = ["deny" if k == "deny" else "allow" for k in kernel]
                bpfprog.detach_device_program(cg_fd, prog_fd)
            finally:
                os.close(prog_fd)
                os.close(cg_fd)
            verdicts[name] = kernel
            interp = ["allow" if be.check(xlated, Device(*p[:3]), p[3]).allowed else "deny" for p in samples]
            bad = [(p, i, k) for p, i, k in zip(samples, interp, kernel) if i != k]
            counts["interpreter vs kernel"] += len(bad)
            assert not bad, (name, producer, rules, default_allow, bad[:5])
        bad = [(p, a, b) for p, a, b in zip(samples, verdicts["generated"], verdicts["derived"]) if a != b]
        counts["derived vs kernel"] += len(bad)
        assert not bad, (producer, rules, default_allow, bad[:5])
        counts["rule sets"] += 1
        counts["classes"] += len(classes)
        counts["probes"] += 2 * len(samples)
    with capsys.disabled():
        print(f"\ndifferential (seed {SEED}): " + ", ".join(f"{k}: {v}" for k, v in counts.items()))


@pytest.mark.parametrize("where", ["same", "below"])
def test_a_plain_container_in_the_same_cgroup_makes_the_repair_refuse(gpu, fakehost, nvsymlinkd_cli, where):
    """A device program applies to its cgroup and everything below it: a container without GPUs whose cgroup
    is the GPU container's (or below it) would have its devices changed too. The report holds only GPU
    containers; the sharing check must see every container the discovery found."""
    g = gpu()
    g.runtime_program(LOST)
    plain = "plain-5e1f0aa2"
    cgroup = g.cgroup if where == "same" else f"{g.cgroup}/{plain}"
    pid = Layouts(fakehost, next_pid=41000).containerd(plain, oci_spec(), cgroup=cgroup)  # not the GPU one's pid
    fakehost.write(f"/proc/{pid}/cgroup", Layouts.v2_cgroup(cgroup))
    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "cannot-repair" and "also holds another container" in res["cannot"], res
    assert g.kernel()[0] == "deny" and g.own()[0] != ["nvsymlinkd"]
    # and the daemon's pass over only the GPU container (runtime state events) sees the plain one too
    from nvsymlinkd.verify.verifier import verify_all

    report = verify_all(g.root, Config(), use_bus=False, with_host=False, only=frozenset({g.cid}))
    (result,) = repair_all(g.root, Config(repair="auto"), report=report, history=RepairHistory(), use_bus=False)
    assert result.status == "cannot-repair" and "also holds another container" in result.plan.cannot, result
    assert g.kernel()[0] == "deny"


def test_a_repair_program_of_hundreds_of_rules_loads_and_is_enforced(gpu, nvsymlinkd_cli):
    """Issue 39 item 4: a program of more than about 70 rules overflowed the 64 KiB verifier log (log level 1)
    and BPF_PROG_LOAD failed with ENOSPC although the program verifies. A runtime program of 320 exact
    rules (c 200:0..319 beside the GPU's), c 195:0 lost: the repair's program (320+ rules) loads, and the
    kernel enforces it: c 195:0 back, the other rules kept, c 195:1 still denied."""
    many = [Rule(True, "c", 200, n, "rw") for n in range(320)]
    g = gpu()
    g.runtime_program(LOST + many)
    assert g.kernel()[0] == "deny"
    proc, doc = repair_cli(nvsymlinkd_cli, g, g.cid)
    (res,) = doc["containers"]
    assert res["status"] == "repaired" and res["mechanism"] == "bpf-program", res
    assert len(res["program"]) > 320 and any(r.startswith("allow c 200:319 ") for r in res["program"])
    assert g.kernel() == ["allow", "allow", "deny", "allow"]
    if 200 in bpfasm.free_majors("Character"):  # the kept rules, judged by the kernel too
        nodes = make_nodes(g.scratch, [("c", 200, 0), ("c", 200, 319), ("c", 200, 320)])
        probes = [("c", 200, 0, "rw"), ("c", 200, 319, "rw"), ("c", 200, 320, "rw")]
        assert kernel_probe([g.real + "/cgroup.procs"], nodes, g.scratch, probes) == ["allow", "allow", "deny"]
