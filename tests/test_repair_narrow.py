"""A repair never narrows (issue 39, item 0), with the kernel as the judge.

In a VM (cgroup v2, Podman 4.3 with crun and the NVIDIA hook) a container lacking the uvm nodes was repaired
"via systemd": SetUnitProperties(DeviceAllow=uvm) on its scope, whose DevicePolicy was auto (crun keeps its own
device program on `<scope>/container`). systemd turned the scope into an allow-list of just that entry and the
container lost c 195:0 and c 195:255 as well.

Here: real cgroup v2 directories with a process in the container's own cgroup (tests/bpfasm.kernel_probe:
open() of a mknod'ed node gives ENXIO when allowed, EPERM when denied; /dev/null's 1:3 opens), runtime programs
in runc's shape (crun emits the same), and a dbusmock systemd whose SetUnitProperties attaches the program
systemd would (tests/sdprogram.py: auto with entries is an allow-list of them plus the pseudo devices). For each
mechanism a partial loss repaired leaves every device the container could open before still open; where a
mechanism narrows, what it changed is put back and the repair says `narrowed, restored`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nvsymlinkd.access import bpfprog, bpfproof
from nvsymlinkd.config import Config
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.model import AT_RISK, LOST, RepairRequest
from nvsymlinkd.repair.plan import RepairHistory
from tests import bpfasm
from tests.bpfasm import kernel_probe, make_nodes
from tests.conftest import skip_or_fail
from tests.fakehost import FakeHost
from tests.test_verify_cache import Program

REPO = str(Path(__file__).resolve().parent.parent)
RUNC_DEFAULTS = [Rule(True, "c", None, None, "m"), Rule(True, "b", None, None, "m"), Rule(True, "c", 1, 3, "rwm"),
                 Rule(True, "c", 1, 5, "rwm"), Rule(True, "c", 136, None, "rwm")]


class Container:
    """A GPU container's cgroups (its scope's, and crun's `container` leaf when `leaf`), a fake --root whose
    /sys/fs/cgroup is the real one, nodes to probe, and its runtime's program on its own cgroup."""

    def __init__(self, v2, tmp_path, cid: str, leaf: bool, cgroupfs: bool = False):
        # Podman's cgroup names: libpod-<id>.scope with the systemd driver, libpod-<id> with cgroupfs
        self.cid, self.scope = cid, f"libpod-{cid}" + ("" if cgroupfs else ".scope")
        self.scope_cgroup = v2.make(self.scope)
        self.cgroup = v2.make(f"{self.scope}/container") if leaf else self.scope_cgroup
        self.real = v2.real(self.cgroup)
        self.scope_real = v2.real(self.scope_cgroup)
        self.uvm = Device("c", [m for m in bpfasm.free_majors("Character") if m != 195][0], 0)
        self.host = host = FakeHost(tmp_path / "root")
        host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": self.uvm.major})
        for path, dev in (("/dev/nvidia0", C0), ("/dev/nvidiactl", C255), ("/dev/nvidia-uvm", self.uvm)):
            host.node(path, dev.major, dev.minor)
        host.path("/sys/fs").mkdir(parents=True)
        os.symlink("/sys/fs/cgroup", host.path("/sys/fs/cgroup"))  # the real cgroups, seen from --root
        self.root = HostRoot(str(host.root))
        (tmp_path / "nodes").mkdir()
        self.scratch = str(tmp_path / "nodes")
        self.probes = [("c", 195, 0, "rw"), ("c", 195, 255, "rw"), ("c", self.uvm.major, 0, "rw"), ("c", 1, 3, "rw"),
                       ("c", 195, 7, "m")]
        self.nodes = make_nodes(self.scratch, sorted({p[:3] for p in self.probes}))
        self.programs: list = []

    def runtime_program(self, devices) -> Program:
        prog = Program(self.real, RUNC_DEFAULTS + [Rule(True, d.type, d.major, d.minor, "rw") for d in devices])
        self.programs.append(prog)
        return prog

    def kernel(self) -> list:
        """c 195:0, c 195:255, uvm, /dev/null (rw) and mknod, from a process in the container's own cgroup."""
        return kernel_probe([self.real + "/cgroup.procs"], self.nodes, self.scratch, self.probes)

    def request(self, devices, kind=LOST, driver="systemd", source="nvidia-hook") -> RepairRequest:
        grants = tuple(Grant(d, "rw", source) for d in devices)
        return RepairRequest(self.cid, "podman", self.scope if driver == "systemd" else None, None, self.cgroup,
                             None, driver, grants, kind)

    def close(self) -> None:
        for real in dict.fromkeys((self.real, self.scope_real)):
            bpfasm.detach_device_programs(real)
        for p in self.programs:
            os.close(p.cg_fd)
            if p.prog_fd is not None:
                os.close(p.prog_fd)


@pytest.fixture
def container(v2_free2, tmp_path):
    made = []

    def make(cid="n39c0ffee", leaf=True, cgroupfs=False):
        c = Container(v2_free2, tmp_path, cid, leaf, cgroupfs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


ALL_OPEN = ["allow"] * 5
C0, C255 = Device("c", 195, 0), Device("c", 195, 255)


def test_the_vms_case_crun_below_an_auto_scope_gets_its_own_program_never_a_scope_allow_list(container, systemd):
    """The VM's case: auto scope, crun's program on `<scope>/container` has c 195:0 and c 195:255 but not uvm (the
    hook's grant lost). Asking systemd for DeviceAllow=uvm made the scope an allow-list of uvm alone (the
    container lost c 195:0 and c 195:255: EPERM). Now the scope is never asked: crun's program, on the
    container's own cgroup, is replaced by one that differs by the grant only."""
    from nvsymlinkd.repair.apply import repair_container

    c = container()
    c.runtime_program([C0, C255])
    systemd.add_scope(c.scope, [], policy="auto", v2=c.scope_real, repo=REPO)
    assert c.kernel() == ["allow", "allow", "deny", "allow", "allow"]
    res = repair_container(c.root, Config(), c.request([c.uvm]))
    assert c.kernel() == ALL_OPEN, (res.to_json(), c.kernel())  # uvm back, nothing else taken
    assert res.status == "repaired" and res.plan.mechanism == "bpf-program", res.to_json()
    assert res.plan.notes[0].startswith("not via systemd:") and "DevicePolicy=auto" in res.plan.notes[0]
    assert systemd.calls() == []  # the scope's policy is what it was: auto, no entries
    assert systemd.device_allow(c.scope) == []


def test_the_vms_case_through_the_cli(container, systemd, nvsymlinkd_cli):
    """The same through `nvsymlinkd repair --json` against a --root tree: Podman with crun (its status in
    /run/crun, the init in `<scope>/container`), the scope known to systemd as auto without entries; crun's
    program lost c 195:0 (the spec's). The verifier finds the loss, the repair replaces crun's program, the
    scope stays as it was, and the kernel sees c 195:0 back and c 195:255 kept."""
    from tests.fixtures.runtimes.layouts import Layouts
    from tests.test_verify_cache import GPU_SPEC

    c = container()
    Layouts(c.host).storage(c.cid, GPU_SPEC, "libpod", runtime_root="/run/crun", crun=True, cgroup=c.scope_cgroup)
    c.runtime_program([C255])
    systemd.add_scope(c.scope, [], policy="auto", v2=c.scope_real, repo=REPO)
    assert c.kernel()[:2] == ["deny", "allow"]
    proc = nvsymlinkd_cli("--root", c.root.root, "repair", "--json", c.cid)
    doc = json.loads(proc.stdout) if proc.stdout.startswith("{") else None
    assert doc is not None, proc.stdout + proc.stderr
    (res,) = doc["containers"]
    assert c.kernel()[:2] == ["allow", "allow"], res  # main: the scope's allow-list took c 195:255 too
    assert res["status"] == "repaired" and res["mechanism"] == "bpf-program", res
    assert any(n.startswith("not via systemd:") for n in res["notes"]), res["notes"]
    assert systemd.calls() == [] and proc.returncode == 0


def test_at_risk_below_an_auto_scope_is_refused_and_nothing_changes(container, systemd):
    """A prevention there: a reload re-applies nothing on an auto scope without entries, and an entry would take
    everything else. Refused, with the reason; the kernel sees the container as it was."""
    from nvsymlinkd.repair.apply import repair_container

    c = container()
    c.runtime_program([C0, C255, c.uvm])
    systemd.add_scope(c.scope, [], policy="auto", v2=c.scope_real, repo=REPO)
    res = repair_container(c.root, Config(), c.request([c.uvm], kind=AT_RISK))
    assert res.status == "cannot-repair" and "restricts nothing" in res.plan.cannot, res.to_json()
    assert systemd.calls() == [] and c.kernel() == ALL_OPEN


def own_programs(real: str) -> list:
    """The ids of the device programs attached to a cgroup v2 directory itself."""
    fd = bpfprog.open_cgroup_dir(real)
    try:
        return bpfprog.query_device_program_ids(fd, effective=False)
    finally:
        os.close(fd)


def test_a_systemd_call_that_narrows_on_a_strict_scope_is_put_back_and_says_so(container, systemd):
    """runc's systemd driver on cgroup v2: the scope is strict with the entries runc could give systemd, runc's
    own program on the scope allows what the container has: runc's rules (sent beside the grant: nothing of
    them narrows) and the hook's uvm, which no trusted source expects and no runtime rule names. Preventing the
    loss of c 195:0 re-applies systemd's allow-list, which lacks uvm: the container loses it at once. The repair
    reads back every device, sees the narrowing, puts the scope's DevicePolicy/DeviceAllow back and detaches
    the program systemd attached (runc had replaced systemd's own: none was there before), and fails as
    `narrowed, restored`; the rate limit then leaves the container as it was. (Before: a strict scope was not
    judged at all, and the container kept running without uvm.)"""
    from dataclasses import replace

    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False)
    c.runtime_program([C0, C255, c.uvm])
    runc_own = own_programs(c.scope_real)
    entries = [("/dev/char/195:255", "rw")]
    systemd.add_scope(c.scope, entries, policy="strict", v2=c.scope_real, repo=REPO)
    assert c.kernel() == ALL_OPEN
    history = RepairHistory()
    request = replace(c.request([C0], kind=AT_RISK), runtime_rules=tuple(RUNC_DEFAULTS) + (Rule(True, "c", 195, 255, "rw"),))
    res = repair_container(c.root, Config(), request, history=history, clock=lambda: 1000.0)
    assert c.kernel() == ALL_OPEN, (res.to_json(), c.kernel())
    assert res.status == "failed" and res.error.startswith(f"narrowed, restored: the container could open {c.uvm} rw "
                                                           "before the repair and not after"), res.to_json()
    assert systemd.device_allow(c.scope) == entries  # the properties as they were
    assert own_programs(c.scope_real) == runc_own  # systemd's put-back program detached: it was not there before
    assert any("(put back)" in s for s in res.steps), res.steps
    assert res.verification[c.uvm].state == "allow" and "narrowed by the repair" in res.verification[c.uvm].reason
    # the rate limit holds further preventions back, and what it holds back is the container as it was
    again = repair_container(c.root, Config(), request, history=history, clock=lambda: 1060.0)
    assert again.status == "cannot-repair" and "rate limit" in again.plan.cannot
    assert c.kernel() == ALL_OPEN


def test_the_judgment_waits_for_systemds_re_apply_which_comes_after_its_answer(container, systemd):
    """systemd answers SetUnitProperties before it re-applies the scope (dbus-cgroup.c only invalidates the unit's
    cgroup; the realize queue attaches the new program later). The mock here attaches it 0.3 s after its reply.
    The repair waits until the scope's programs change before it judges, so the narrowing (the hook's uvm, which
    nothing trusted names) is seen and put back; judged at once, it read the old programs, said `prevented`, and
    the container lost uvm 0.3 s later."""
    import time
    from dataclasses import replace

    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False)
    c.runtime_program([C0, C255, c.uvm])
    entries = [("/dev/char/195:255", "rw")]
    systemd.add_scope(c.scope, entries, policy="strict", v2=c.scope_real, repo=REPO, v2_delay=0.3)
    request = replace(c.request([C0], kind=AT_RISK), runtime_rules=tuple(RUNC_DEFAULTS))
    res = repair_container(c.root, Config(), request)
    time.sleep(0.6)  # anything the mock still had to attach is attached now
    assert c.kernel() == ALL_OPEN, (res.to_json(), c.kernel())
    assert res.status == "failed" and res.error.startswith(f"narrowed, restored: the container could open {c.uvm} rw"), \
        res.to_json()


def test_a_put_back_keeps_the_program_systemd_holds_now_never_a_freed_one(container, systemd, monkeypatch):
    """Review finding: a strict scope whose only program is systemd's own (a partial loss: c 195:0 no longer among
    its entries). A systemd call that narrows (made to here: DeviceAllow reset without c 195:255) makes
    systemd attach a new program and free the one it had; the put-back's SetUnitProperties attaches one more
    for the old policy. The put-back used to attach the freed program again and detach systemd's current one:
    the scope then ran a program systemd no longer knows (no later re-apply would ever detach it, so no later
    grant on the scope could pass it) while systemd's own was gone. Now the scope keeps the program systemd
    attached for the policy put back, the freed one stays detached, and the kernel sees the container as before."""
    import subprocess
    import sys

    from nvsymlinkd.repair import mechanisms
    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False)
    entries = [("/dev/char/195:255", "rw"), (f"/dev/char/{c.uvm.major}:0", "rw"), ("/dev/char/1:3", "rwm"),
               ("char-*", "m")]
    subprocess.run([sys.executable, "-m", "tests.sdprogram", c.scope_real, "strict", json.dumps(entries)], cwd=REPO,
                   check=True)
    systemd.add_scope(c.scope, entries, policy="strict", v2=c.scope_real, repo=REPO)
    (systemds_before,) = own_programs(c.scope_real)
    assert c.kernel() == ["deny", "allow", "allow", "allow", "allow"]

    def narrowing(host, request, grants, steps):  # systemd taking c 195:255 with its re-apply
        kept = [e for e in entries if e[0] != "/dev/char/195:255"] + [(g.device.dev_path, str(g.access)) for g in grants]
        host.systemd.put_back_policy(request.scope, "strict", kept)
        steps.append("SetUnitProperties (narrowing, made by the test)")

    monkeypatch.setattr(mechanisms, "_set_device_allow", narrowing)
    res = repair_container(c.root, Config(), c.request([C0]))
    assert res.status == "failed" and res.error.startswith("narrowed, restored: the container could open c 195:255"), \
        res.to_json()
    assert c.kernel() == ["deny", "allow", "allow", "allow", "allow"]
    assert systemd.device_allow(c.scope) == entries
    (now,) = own_programs(c.scope_real)
    assert now != systemds_before, res.steps  # main: the freed program attached again, systemd's own detached
    assert bpfprog.read_program(now).name == "sd_devices"
    assert any("freed by its owner, not attached again" in s for s in res.steps), res.steps


def test_a_podman_runc_prevention_keeps_dev_net_tun_through_the_cli(container, systemd, nvsymlinkd_cli):
    """The chaos soak's Docker and Podman preventions (s30): runc 1.1.5 records its default rules in state.json,
    /dev/net/tun's c 10:200 rwm among them (libcontainer/specconv/spec_linux.go AllowedDevices, "tuntap"), and
    programs all of them, but left 10:200 out of the scope ("skipping device /dev/char/10:200 for systemd: stat
    /sys/dev/char/10:200", tun not loaded) and so the NVIDIA node whose /dev/char link was missing. A prevention
    re-applies the scope: the runtime's rules from state.json go beside the grant, so systemd's new program
    allows 10:200 too and nothing narrows (the s30 run that saw `narrowed, restored: ... c 10:200 rw` ran a
    package built without the runtime's rules). Through `nvsymlinkd repair --json`, judged by the kernel from
    the container's cgroup, with the put-back armed on the strict scope."""
    from tests.fixtures.runtimes.layouts import RUNC_DEFAULT_RULES, Layouts
    from tests.test_verify_cache import GPU_SPEC

    c = container(leaf=False)
    Layouts(c.host).storage(c.cid, GPU_SPEC, "libpod", runtime_root="/run/runc", cgroup=c.scope_cgroup)
    runc_rules = [Rule(True, "c" if r["type"] == 99 else "b", None if r["major"] < 0 else r["major"],
                       None if r["minor"] < 0 else r["minor"], r["permissions"]) for r in RUNC_DEFAULT_RULES]
    c.programs.append(Program(c.real, runc_rules + [Rule(True, "c", 195, 0, "rw"), Rule(True, "c", 195, 255, "rw")]))
    # what runc 1.1.5 gave systemd: its rules less 10:200 and c 195:0 (no /sys/dev/char link for either)
    entries = [("char-*", "m"), ("block-*", "m"), ("/dev/char/1:3", "rwm"), ("/dev/char/1:8", "rwm"),
               ("/dev/char/1:7", "rwm"), ("/dev/char/5:0", "rwm"), ("/dev/char/1:5", "rwm"), ("/dev/char/1:9", "rwm"),
               ("char-136", "rwm"), ("/dev/char/5:2", "rwm"), ("/dev/char/195:255", "rw")]
    systemd.add_scope(c.scope, entries, policy="strict", v2=c.scope_real, repo=REPO)
    c.probes.append(("c", 10, 200, "rw"))
    c.nodes.update(make_nodes(c.scratch, [("c", 10, 200)]))
    before = ["allow", "allow", "deny", "allow", "allow", "allow"]  # the spec names no uvm
    assert c.kernel() == before
    proc = nvsymlinkd_cli("--root", c.root.root, "repair", "--json", c.cid)
    doc = json.loads(proc.stdout) if proc.stdout.startswith("{") else None
    assert doc is not None, proc.stdout + proc.stderr
    (res,) = doc["containers"]
    assert res["status"] == "prevented" and res["mechanism"] == "systemd", res
    assert not any("(put back)" in s for s in res["steps"]), res["steps"]
    assert c.kernel() == before, res  # 10:200 still opens: nothing narrowed
    allow = systemd.device_allow(c.scope)
    assert ("/dev/char/195:0", "rw") in allow and ("/dev/char/10:200", "rwm") in allow, allow
    assert proc.returncode == 0


def test_a_prevention_keeps_the_runtimes_rules_that_runc_left_out_of_the_scope(container, systemd):
    """The VM's s03 (runc 1.1.5, systemd driver, cgroup v2): runc skipped rules whose /sys/dev/char/M:m is missing
    (there: /dev/net/tun's 10:200 while tun was not loaded; here /dev/null, pts and mknod), so its scope lacks them
    while runc's own program allows them. Preventing the loss of the hook's c 195:0 makes systemd re-apply the
    scope: without the runtime's rules beside the grant that took them at once, the keep check put everything back
    and the prevention failed. With them (RepairRequest.runtime_rules, from runc's state): prevented, nothing
    narrowed, c 195:0 now in the scope."""
    from dataclasses import replace

    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False)
    c.runtime_program([C0, C255])  # the hook's c 195:0 prepended to runc's rules
    entries = [("/dev/char/195:255", "rw")]  # what runc could give systemd
    systemd.add_scope(c.scope, entries, policy="strict", v2=c.scope_real, repo=REPO)
    before = c.kernel()
    assert before == ["allow", "allow", "deny", "allow", "allow"], before  # uvm: never granted
    runtime_rules = tuple(RUNC_DEFAULTS) + (Rule(True, "c", 195, 255, "rw"),)
    request = replace(c.request([C0], kind=AT_RISK), runtime_rules=runtime_rules)
    res = repair_container(c.root, Config(), request)
    assert res.status == "prevented", res.to_json()
    assert c.kernel() == before
    allow = systemd.device_allow(c.scope)
    assert ("/dev/char/195:0", "rw") in allow and ("char-*", "m") in allow and ("/dev/char/1:3", "rwm") in allow, allow


def test_a_systemd_repair_on_a_strict_scope_keeps_every_device(container, systemd):
    """systemd (cgroup v2): a strict scope whose program is systemd's own (the runtime's entries, c 195:0 among
    them no longer: a partial loss). DeviceAllow=c 195:0 widens the allow-list: c 195:0 back, every other
    device still open, judged by the kernel (a guard: an entry more on an allow-list never narrowed)."""
    import subprocess
    import sys

    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False)
    entries = [("/dev/char/195:255", "rw"), (f"/dev/char/{c.uvm.major}:0", "rw"), ("/dev/null", "rwm"),
               ("char-*", "m"), ("char-1", "rwm"), ("char-136", "rwm")]
    subprocess.run([sys.executable, "-m", "tests.sdprogram", c.scope_real, "strict", json.dumps(entries)], cwd=REPO,
                   check=True)
    systemd.add_scope(c.scope, entries, policy="strict", v2=c.scope_real, repo=REPO)
    assert c.kernel() == ["deny", "allow", "allow", "allow", "allow"]
    res = repair_container(c.root, Config(), c.request([C0]))
    assert res.status == "repaired" and res.plan.mechanism == "systemd", res.to_json()
    assert c.kernel() == ALL_OPEN
    assert systemd.device_allow(c.scope) == entries + [("/dev/char/195:0", "rw")]


def test_a_bpf_program_that_would_narrow_is_detached_and_the_old_one_put_back(container, monkeypatch):
    """bpf-program (cgroupfs driver): the proof already rules a narrower program out; here it is made to pass one
    (the derived policy loses c 195:255) to show the read-back of every device and the put-back at work."""
    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False, cgroupfs=True)
    c.runtime_program([C255, c.uvm])
    assert c.kernel() == ["deny", "allow", "allow", "allow", "allow"]
    real_rules = bpfproof.policy_rules
    monkeypatch.setattr(bpfproof, "policy_rules", lambda programs, grants=(): [
        Rule(False, "c", 195, 255, "rwm")] + real_rules(programs, grants))
    monkeypatch.setattr(bpfproof, "prove", lambda *a: bpfproof.Proof(1, 4, (), ()))
    res = repair_container(c.root, Config(), c.request([C0], driver="cgroupfs", source="spec"))
    assert c.kernel() == ["deny", "allow", "allow", "allow", "allow"], res.to_json()  # as before: not narrowed
    assert res.status == "failed" and res.error.startswith("narrowed, restored: the container could open c 195:255"), \
        res.to_json()
    assert [s for s in res.steps if "put back" in s or "not there before" in s], res.steps


def test_a_bpf_repair_keeps_every_device(container):
    """bpf-program, the partial loss repaired: c 195:0 back, and every device it could open before still open (a
    guard: the proof kept this mechanism from narrowing before issue 39 too)."""
    from nvsymlinkd.repair.apply import repair_container

    c = container(leaf=False, cgroupfs=True)
    c.runtime_program([C255, c.uvm])
    res = repair_container(c.root, Config(), c.request([C0], driver="cgroupfs", source="spec"))
    assert res.status == "repaired", res.to_json()
    assert c.kernel() == ALL_OPEN


@pytest.fixture
def v1(need_root, tmp_path):
    """A real cgroup v1 devices cgroup with what runc gives a GPU container, less c 195:0 (lost)."""
    base = Path("/sys/fs/cgroup/devices")
    if not (base / "devices.list").exists():
        skip_or_fail("needs the cgroup v1 devices controller at /sys/fs/cgroup/devices")
    free = bpfasm.free_majors("Character")
    if 195 not in free or len(free) < 2:
        skip_or_fail("needs char major 195 and another without a driver (an allowed open says ENXIO)")
    name = f"n39-v1-{os.getpid()}"
    d = base / name
    d.mkdir()
    uvm = [m for m in free if m != 195][0]
    (d / "devices.deny").write_text("a")
    for rule in ("c *:* m", "b *:* m", "c 1:3 rwm", "c 1:5 rwm", "c 136:* rwm", "c 195:255 rw", f"c {uvm}:0 rw"):
        (d / "devices.allow").write_text(rule)
    host = FakeHost(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": uvm})
    host.path("/sys/fs").mkdir(parents=True)
    os.symlink("/sys/fs/cgroup", host.path("/sys/fs/cgroup"))
    (tmp_path / "nodes").mkdir()
    probes = [("c", 195, 0, "rw"), ("c", 195, 255, "rw"), ("c", uvm, 0, "rw"), ("c", 1, 3, "rw"), ("c", 195, 7, "m"),
              ("c", 136, 9, "rw")]
    nodes = make_nodes(str(tmp_path / "nodes"), sorted({p[:3] for p in probes}))

    def kernel():
        return kernel_probe([str(d / "cgroup.procs")], nodes, str(tmp_path / "nodes"), probes)

    request = RepairRequest("n39v1", "runc", None, f"/{name}", None, None, "cgroupfs",
                            (Grant(C0, "rw", "spec"),), LOST)
    yield HostRoot(str(host.root)), d, request, kernel
    for _ in range(50):
        try:
            d.rmdir()
            break
        except OSError:
            import time

            time.sleep(0.02)


def test_v1_devices_allow_keeps_every_device(v1):
    """devices.allow (cgroup v1, cgroupfs): c 195:0 back; /dev/null, pts (c 136:*), mknod and the rest still open
    (a guard: appending to devices.allow never narrowed)."""
    from nvsymlinkd.repair.apply import repair_container

    root, d, request, kernel = v1
    before = kernel()
    assert before[:5] == ["deny", "allow", "allow", "allow", "allow"] and before[5] != "deny", before
    res = repair_container(root, Config(), request)
    assert res.status == "repaired" and res.plan.mechanism == "devices.allow", res.to_json()
    after = kernel()
    assert after[:5] == ["allow"] * 5 and after[5] != "deny", after


def test_v1_a_narrowing_is_put_back_from_the_saved_devices_list(v1, monkeypatch):
    """A v1 repair that narrows (here: made to deny pts and mknod beside its grant, as a re-apply from deny-all
    would) gets the saved devices.list's allow rules written back, wildcards included, and says so."""
    from nvsymlinkd.repair import cgroupfiles
    from nvsymlinkd.repair.apply import repair_container

    root, d, request, kernel = v1
    real_write = cgroupfiles.write_devices_allow

    def narrowing(root_, devices_dir, grants, steps):
        real_write(root_, devices_dir, grants, steps)
        for rule in ("c 136:* rwm", "c *:* m"):
            (d / "devices.deny").write_text(rule)

    monkeypatch.setattr(cgroupfiles, "write_devices_allow", narrowing)
    res = repair_container(root, Config(), request)
    assert res.status == "failed" and res.error.startswith("narrowed, restored:"), res.to_json()
    assert "c 136:* rw" in res.error and "c *:* m" in res.error
    assert {"devices.allow c *:* m (put back)", "devices.allow c 136:* rwm (put back)"} <= set(res.steps), res.steps
    after = kernel()
    assert after[:5] == ["allow"] * 5 and after[5] != "deny", after


def test_v1_a_narrowing_that_cannot_be_put_back_is_not_counted_by_the_rate_limit(v1, monkeypatch):
    """`narrowed, NOT restored`: the attempt is not recorded, so the next pass repairs the loss instead of the
    rate limit leaving the container narrowed."""
    from nvsymlinkd.repair import cgroupfiles
    from nvsymlinkd.repair.apply import repair_container
    from nvsymlinkd.repair.host import RepairHost

    root, d, request, kernel = v1
    real_write = cgroupfiles.write_devices_allow

    def narrowing(root_, devices_dir, grants, steps):
        real_write(root_, devices_dir, grants, steps)
        (d / "devices.deny").write_text("c 136:* rwm")

    monkeypatch.setattr(cgroupfiles, "write_devices_allow", narrowing)
    monkeypatch.setattr(RepairHost, "put_back", lambda self, saved, steps: ["made to fail"])
    history = RepairHistory()
    res = repair_container(root, Config(), request, history=history, clock=lambda: 1000.0)
    assert res.status == "failed" and res.error.startswith("narrowed, NOT restored: c 136:* rw"), res.to_json()
    assert "(made to fail)" in res.error
    assert history.since_last(request.container_id, 1001.0) is None  # the next pass may repair at once


def test_v1_a_repair_that_waited_in_vain_on_the_lock_puts_nothing_back(v1, monkeypatch):
    """Another repair held the lock (RepairBusy): this one changed nothing, so a narrowing seen meanwhile is someone
    else's (that repair's deny-all window, systemd's re-apply), and putting back this one's saved devices.list would
    undo their change. Nothing is written; the kernel sees what the other left."""
    from nvsymlinkd.errors import RepairBusy
    from nvsymlinkd.repair import cgroupfiles
    from nvsymlinkd.repair.apply import repair_container

    root, d, request, kernel = v1

    def someone_else_then_busy(root_, devices_dir, grants, steps):
        (d / "devices.deny").write_text("c 136:* rwm")  # another writer's change, while we wait on the lock
        raise RepairBusy("another repair holds the lock")

    monkeypatch.setattr(cgroupfiles, "write_devices_allow", someone_else_then_busy)
    res = repair_container(root, Config(), request)
    assert res.status == "failed" and "another repair holds the lock" in res.error, res.to_json()
    assert not any("put back" in s for s in res.steps), res.steps
    assert kernel()[5] == "deny"  # c 136:9: what the other writer left, not put back by a repair that did nothing
