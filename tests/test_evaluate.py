"""verify/evaluate.py (pure) as tables: a container's facts (spec, expected access, the live access
policy, its scope's DeviceAllow, the host's NVIDIA nodes) -> its verdict and findings. The policies are the
real access engine's (access.cgroup.policy_of over devices.list text, and BPF programs); nothing is read.
"""

from __future__ import annotations

from nvsymlinkd.access import bpfeval as be
from nvsymlinkd.access.cgroup import AccessPolicy, policy_of
from nvsymlinkd.containers import baseline as baselinemod
from nvsymlinkd.containers.discovery import Container
from nvsymlinkd.containers.expected import candidate_devices, expected_access
from nvsymlinkd.containers.ocispec import parse_spec
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.nodes import NvidiaNode
from nvsymlinkd.messageids import MESSAGE_IDS
from nvsymlinkd.systemd.scopes import ScopeDevices
from nvsymlinkd.verify.evaluate import HostDevices, evaluate
from tests import bpfasm
from tests.fixtures.runtimes.layouts import oci_spec, spec_node, spec_rule

MAJORS = frozenset({195, 510})
HOST = HostDevices((NvidiaNode("/dev/nvidia0", "gpu", 195, 0), NvidiaNode("/dev/nvidia1", "gpu", 195, 1),
                    NvidiaNode("/dev/nvidiactl", "ctl", 195, 255)), MAJORS, None)
HOST_UVM = HostDevices(HOST.nodes + (NvidiaNode("/dev/nvidia-uvm", "uvm", 510, 0),), MAJORS, 510)


def v1(allowed: dict) -> AccessPolicy:
    """The real access engine on a cgroup v1 devices.list: {(major, minor): letters} -> `c M:m letters` lines."""
    return policy_of("".join(f"c {ma}:{mi} {a}\n" for (ma, mi), a in allowed.items()))


def undecidable(major: int, minor: int) -> list:
    """A BPF device program the interpreter cannot run for one device (it reads an unset register
    there), allowing every other one."""
    return bpfasm.LOAD_CTX + [bpfasm.jmp(be.JNE, 4, 2, major), bpfasm.jmp(be.JNE, 5, 1, minor),
                              bpfasm.alu(be.ADD, 6, 1), bpfasm.mov32(0, 1), bpfasm.exit_()]


def container(spec=None, status="running", scope=None, cid="c1"):
    c = Container(cid, "containerd", "k8s.io", status, init_pid=10, init_start=1)
    c.spec = parse_spec(spec) if spec is not None else None
    c.scope = scope
    return c


def run(spec, policy, host=HOST, scope_devices=None, scope=None, status="running", dev_nodes=(), base=None):
    c = container(spec, status, scope)
    cands = candidate_devices(host.devices, c.spec, None, base, MAJORS)
    exp = expected_access(cands, c.spec, None, base)
    signs = ["NVIDIA_VISIBLE_DEVICES=0"]
    return evaluate(c, signs, exp, policy, "no cgroup" if policy is None else None, scope_devices, host, dev_nodes)


GPU0 = oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 255)], nodes=[spec_node("/dev/nvidia0", 195, 0)])


def kinds(report):
    return {f.kind: tuple(str(d) for d in f.devices) for f in report.findings}


def test_ok():
    r = run(GPU0, v1({(195, 0): "rw", (195, 255): "rw"}))
    assert (r.verdict, r.findings) == ("ok", [])
    assert r.granted == {Device.char(195, 0): "rw", Device.char(195, 255): "rw"}


def test_lost_partial_access_counts():
    r = run(GPU0, v1({(195, 0): "r", (195, 255): "rw"}))
    assert r.verdict == "lost" and kinds(r) == {"lost": ("c 195:0",)}
    assert r.findings[0].message_id == MESSAGE_IDS["container-lost"]


def test_granted_not_declared_is_at_risk():
    r = run(GPU0, v1({(195, 0): "rw", (195, 255): "rw", (195, 1): "rw"}))
    assert r.verdict == "at-risk" and kinds(r) == {"at-risk-not-in-spec": ("c 195:1",)}


def test_hook_device_the_scope_lists_is_no_longer_at_risk():
    # after repair added the hook's device to the scope, a reload re-applies it: nothing left at risk
    policy = v1({(195, 0): "rw", (195, 255): "rw", (195, 1): "rw"})
    listed = ScopeDevices("x.scope", "dbus", "strict", (),
                          tuple(Rule(True, "c", 195, m, "rw") for m in (0, 1, 255)))
    assert run(GPU0, policy, scope="x.scope", scope_devices=listed).verdict == "ok"
    unlisted = ScopeDevices("x.scope", "dbus", "strict", (),
                            tuple(Rule(True, "c", 195, m, "rw") for m in (0, 255)))
    r = run(GPU0, policy, scope="x.scope", scope_devices=unlisted)
    assert kinds(r) == {"at-risk-not-in-spec": ("c 195:1",)}


def test_wildcard_spec_rule_declares_every_gpu():
    spec = oci_spec(rules=[spec_rule(195, None, "rwm")])
    r = run(spec, v1({(195, 0): "rw", (195, 1): "rw", (195, 255): "rw"}))
    assert r.verdict == "ok" and set(r.expected) == {Device.char(195, m) for m in (0, 1, 255)}


def test_uvm_missing_only_when_the_host_has_it():
    policy = v1({(195, 0): "rw", (195, 255): "rw"})
    assert run(GPU0, policy).verdict == "ok"
    r = run(GPU0, policy, host=HOST_UVM)
    assert kinds(r) == {"at-risk-uvm-missing": ("c 510:0",)}
    spec = oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 255), spec_rule(510, 0)])
    r = run(spec, v1({(195, 0): "rw", (195, 255): "rw", (510, 0): "rw"}), host=HOST_UVM)
    assert r.verdict == "ok"


def test_scope_checks():
    policy = v1({(195, 0): "rw", (195, 255): "rw"})
    sd = ScopeDevices("x.scope", "files", "strict", (("/dev/char/195:0", "rw"),),
                      (Rule(True, "c", 195, 0, "rw"),))
    r = run(GPU0, policy, scope="x.scope", scope_devices=sd)
    assert kinds(r) == {"at-risk-scope": ("c 195:255",)}
    r = run(GPU0, policy, scope="x.scope", scope_devices=None)
    assert r.verdict == "unknown" and "DeviceAllow of x.scope" in r.findings[0].detail
    everything = ScopeDevices("x.scope", "dbus", "auto", (), ())
    assert run(GPU0, policy, scope="x.scope", scope_devices=everything).verdict == "ok"


def test_unknown_is_never_ok():
    allowed = "c 195:0 rw\nc 195:255 rw\n"
    r = run(GPU0, policy_of(allowed, [undecidable(195, 0)]))
    assert r.verdict == "unknown" and kinds(r) == {"unknown": ("c 195:0",)}
    r = run(GPU0, None)
    assert r.verdict == "unknown" and "no cgroup" in r.findings[0].detail


def test_lost_beats_at_risk_and_not_running_and_not_gpu():
    r = run(GPU0, v1({(195, 1): "rw", (195, 255): "rw"}), host=HOST_UVM)
    assert r.verdict == "lost" and set(kinds(r)) == {"lost", "at-risk-not-in-spec", "at-risk-uvm-missing"}
    assert run(GPU0, v1({}), status="stopped").verdict == "not-running"
    c = container(oci_spec(), "running")
    exp = expected_access(set(), c.spec, None, None)
    assert evaluate(c, [], exp, v1({}), None, None, HOST).verdict == "not-gpu"


def test_untrusted_nodes_are_reported_not_expected():
    r = run(GPU0, v1({(195, 0): "rw", (195, 255): "rw"}), dev_nodes=[("/dev/nvidia3", Device.char(195, 3))])
    assert r.untrusted_nodes == ("/dev/nvidia3 (c 195:3)",)
    # a sign, never a grant: the node the container holds but cannot open is denied, never ok
    assert Device.char(195, 3) not in r.expected and r.verdict == "denied"
    assert kinds(r) == {"denied": ("c 195:3",)}


def test_baseline_only_device_is_lost_when_denied():
    base = baselinemod.Baseline("c1", 1, {Device("c", 195, 1): "rw"})
    r = run(GPU0, v1({(195, 0): "rw", (195, 255): "rw"}), base=base)
    assert kinds(r) == {"lost": ("c 195:1",)} and r.expected[Device.char(195, 1)].sources == ("baseline",)


def test_no_spec_and_no_state_is_unknown_not_at_risk():
    c = container(None)
    exp = expected_access({Device("c", 195, 0)}, None, None, None)
    r = evaluate(c, ["NVIDIA_VISIBLE_DEVICES=0"], exp, v1({(195, 0): "rw"}), None, None, HOST)
    assert r.verdict == "unknown" and kinds(r) == {"unknown": ("c 195:0",)}


def test_journal_entries_and_ids():
    from nvsymlinkd.verify.journaldiff import journal_entries

    r = run(GPU0, v1({(195, 255): "rw"}), scope="cri-containerd-c1.scope",
            scope_devices=ScopeDevices("cri-containerd-c1.scope", "files", "auto", (), ()))
    ((kind, priority, message, fields),) = journal_entries(r)
    assert (kind, priority) == ("container-lost", 3)
    assert fields["container_id"] == "c1" and fields["unit"] == "cri-containerd-c1.scope"
    assert "c 195:0" in message and MESSAGE_IDS[kind] == r.findings[0].message_id
    ids = list(MESSAGE_IDS.values())
    assert len(set(ids)) == len(ids) and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_letters_allowed_apart_but_not_together_is_lost():
    # O_RDWR needs one v1 exception covering rw; r and w from two rules do not add up in the kernel
    r = run(GPU0, policy_of("c 195:0 r\nc 195:0 w\nc 195:255 rw\n"))
    assert r.verdict == "lost" and kinds(r) == {"lost": ("c 195:0",)}
    assert r.granted[Device.char(195, 0)] == "rw"  # each letter alone is allowed, and the report says so


def test_a_container_whose_hooks_still_run_is_not_judged_yet():
    # creating: runc's hooks may still grant devices (REFERENCE.md, runc's initProcess.start) and write its
    # files: nothing is settled, not even a file that cannot be read yet; paused with one is unknown
    exp = expected_access({Device("c", 195, 0)}, None, None, None)
    for status, verdict in (("creating", "not-running"), ("paused", "unknown")):
        c = container(None, status)
        c.unreadable = ["config.json: Permission denied"]
        r = evaluate(c, ["NVIDIA_VISIBLE_DEVICES=0"], exp, v1({}), None, None, HOST)
        assert r.verdict == verdict, status
    assert run(GPU0, v1({(195, 255): "rw"}), status="created").verdict == "lost"  # hooks done: judged
