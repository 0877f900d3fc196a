"""The verdict on one GPU container (pure): its facts -> a ContainerReport.

`evaluate()` decides: the container's facts (spec, runtime state, names), what trusted sources
expect (containers.expected), the live access policy of its device cgroup, its scope's DeviceAllow and
the host's NVIDIA nodes -> ok, lost, denied, at-risk (three reasons) or unknown, one function per
finding kind. It reads nothing: verify/verifier.py gathers those facts from the host (the daemon and
`nvsymlinkd check` call it), and the tests give it tables of facts.

Verdicts and finding kinds are the enums of verify/kinds.py; each finding kind has a fixed journal
MESSAGE_ID in messageids.MESSAGE_IDS (under kinds.JOURNAL_KINDS[kind]).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Sequence, Tuple

from nvsymlinkd.containers.model import (
    CDI_ANNOTATION,
    CgroupDriver,
    Grant,
    display_name,
    exec_fifo_path,
)
from nvsymlinkd.host.devices import RW, Access, Device, Rule
from nvsymlinkd.host.nodes import NvidiaNode
from nvsymlinkd.messageids import MESSAGE_IDS
from nvsymlinkd.text import bounded
from nvsymlinkd.verify.kinds import GPU_VERDICTS, JOURNAL_KINDS, FindingKind, Verdict, verdict_of

if TYPE_CHECKING:  # the facts' types; their modules read the host, this one only reads their values
    from nvsymlinkd.access.cgroup import AccessPolicy
    from nvsymlinkd.containers.discovery import Container
    from nvsymlinkd.containers.expected import Expected
    from nvsymlinkd.systemd.scopes import ScopeDevices

# A node in the container's own /dev: (path, its char Device), untrusted (typing's: evaluated at import).
DevNode = Tuple[str, Device]
# _letters' answer: (granted letters, unknown reasons, whole access allowed by one check)
Letters = Tuple[Access, List[str], bool]

# The words, defined once in verify/kinds.py; these names stay for the callers.
OK, NOT_GPU, NOT_RUNNING = Verdict.OK, Verdict.NOT_GPU, Verdict.NOT_RUNNING
LOST = FindingKind.LOST
DENIED = FindingKind.DENIED
AT_RISK_SCOPE = FindingKind.AT_RISK_SCOPE
AT_RISK_NOT_IN_SPEC = FindingKind.AT_RISK_NOT_IN_SPEC
AT_RISK_UVM = FindingKind.AT_RISK_UVM
UNKNOWN = FindingKind.UNKNOWN
KINDS = tuple(FindingKind)
# Container verdicts, worst first.
VERDICTS = GPU_VERDICTS


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    devices: tuple[Device, ...]  # text ("c M:m") only in to_json, the journal and messages
    detail: str
    fix: str
    # the fix in a few words, for check's FIX column (the whole fix goes on the finding's own line below
    # the table); not in to_json: the fix is there whole
    action: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FindingKind(self.kind))

    @property
    def message_id(self) -> str:
        return MESSAGE_IDS[JOURNAL_KINDS[self.kind]]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "devices": [str(d) for d in self.devices], "detail": self.detail, "fix": self.fix,
                "message_id": self.message_id}


@dataclass(frozen=True)
class HostDevices:
    nodes: tuple[NvidiaNode, ...]  # on the host
    nvidia_majors: frozenset[int]
    uvm_major: int | None = None
    devices: frozenset[Device] = field(init=False, repr=False, compare=False)  # the nodes' Devices
    read_only_majors: frozenset[int] = field(init=False, repr=False, compare=False)  # nvidia-caps: opened read-only

    def __post_init__(self) -> None:
        # made once a pass, not per container (a MIG host has ~2,000 nodes)
        object.__setattr__(self, "devices", frozenset(Device.char(n.major, n.minor) for n in self.nodes))
        object.__setattr__(self, "read_only_majors", frozenset(n.major for n in self.nodes if n.kind == "cap"))

    @property
    def uvm_node(self) -> NvidiaNode | None:
        for n in self.nodes:
            if n.kind == "uvm":
                return n
        return None


@dataclass
class ContainerReport:
    id: str
    runtime: str
    namespace: str | None
    status: str  # the runtime's: created, running, creating, stopped, unknown
    verdict: Verdict
    scope: str | None = None
    init_pid: int | None = None
    gpu_signs: tuple[str, ...] = ()
    findings: list[Finding] = field(default_factory=list)
    expected: dict[Device, Grant] = field(default_factory=dict)  # the same records a repair grants
    granted: dict[Device, Access] = field(default_factory=dict)  # -> access the cgroup allows now
    untrusted_nodes: tuple[str, ...] = ()  # NVIDIA nodes seen in the container's own /dev (reported, never trusted)
    nvidia_hook: dict[str, Any] | None = None  # hookgrant.HookGrant.to_json() when the spec has the legacy NVIDIA hook
    cgroup: dict[str, str | None] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    baseline: str | None = None  # "recorded", "loaded" or None
    pod_namespace: str | None = None  # names for people (containers.Container), never for a decision
    pod_name: str | None = None
    container_name: str | None = None
    # runc's/crun's exec.fifo while the container is created, not started (not in the JSON): a repair
    # must not freeze it then, since the runtime cannot start a frozen container
    exec_fifo: str | None = None
    # the allow rules the runtime programmed (runc's state, else the spec's; not in the JSON): what a systemd
    # repair keeps in the scope beside its grant (repair.mechanisms: a repair never narrows)
    runtime_rules: tuple[Rule, ...] = ()
    # how the runtime manages the cgroup, and what says so (not in the JSON): the repair's row
    cgroup_driver: CgroupDriver | None = None

    @property
    def short_id(self) -> str:
        return self.id[:12] if len(self.id) == 64 else self.id

    @property
    def display_name(self) -> str | None:
        return display_name(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "runtime": self.runtime, "namespace": self.namespace, "status": self.status,
            "verdict": Verdict(self.verdict).value, "scope": self.scope, "init_pid": self.init_pid,
            "gpu_signs": list(self.gpu_signs), "findings": [f.to_json() for f in self.findings],
            "expected": {str(d): g.expected_json() for d, g in self.expected.items()},
            "granted": {str(d): a for d, a in self.granted.items()}, "untrusted_nodes": list(self.untrusted_nodes),
            "nvidia_hook": self.nvidia_hook,
            "cgroup": self.cgroup, "problems": list(self.problems), "baseline": self.baseline,
            "pod_namespace": self.pod_namespace, "pod_name": self.pod_name, "container_name": self.container_name,
        }


def _verdict(findings: list[Finding]) -> Verdict:
    return verdict_of(f.kind for f in findings)


def _letters(policy: AccessPolicy, key: Device, access: Access) -> Letters:
    """(granted letters, unknown reasons, whole access allowed by one check).

    The whole access is asked first (one call in the common case); only when
    that is not allowed is each letter asked separately, for the report.
    """
    v = policy.check(key, access)
    if v.state == "allow":  # the common case in one call
        return access, [], True
    granted: Access = Access()
    unknown: list[str] = []
    for letter in access:
        v = policy.check(key, Access(letter))
        if v.state == "allow":
            granted = granted.union(letter)
        elif v.state != "deny":
            unknown.append(v.reason)
    return granted, unknown, False


def _declared_nodes(c: Container) -> set[Device]:
    """The char Devices whose nodes the runtime itself created (spec linux.devices, runc's config.devices)."""
    return {node.device for facts in (c.spec, c.state) if facts is not None
            for node in facts.nodes if node.type == "c"}


def _devices(keys: Iterable[Device]) -> tuple[Device, ...]:
    return tuple(keys)


@dataclass
class _Live:
    """What the device cgroup allows now, per candidate device."""

    granted: dict[Device, Access] = field(default_factory=dict)  # allowed (some letters may be missing)
    unknown: dict[Device, str] = field(default_factory=dict)  # why its access cannot be decided
    together: set[Device] = field(default_factory=set)  # the Devices whose "rw" one check allowed


def read_live(policy: AccessPolicy, expected: Expected, host: HostDevices, dev_nodes: Iterable[DevNode]) -> _Live:
    candidates = set(expected.devices) | host.devices
    candidates |= {d for _, d in dev_nodes if d.major in host.nvidia_majors}
    live = _Live()
    classes: Callable[..., Any] | None = getattr(policy, "equivalence_key", None)
    decided: dict[Any, Letters] = {}  # equivalence key -> _letters' answer, where the policy can tell (access.cgroup)
    for key in sorted(candidates):
        eq = classes(key) if classes is not None else None
        answer = decided.get(eq) if eq is not None else None
        if answer is None:
            answer = _letters(policy, key, RW)
            if eq is not None and not answer[1]:  # an unknown's reason may name the device: never shared
                decided[eq] = answer
        got, why, whole = answer
        if whole:
            live.together.add(key)
        if got:
            live.granted[key] = got
        if why:
            live.unknown[key] = why[0]
    return live


def _lost_devices(policy: AccessPolicy, expected: Expected, live: _Live) -> list[Device]:
    """Expected devices the cgroup denies now; a device whose check is neither joins live.unknown.

    An open asks for all its letters at once, and the v1 kernel wants ONE rule covering them all:
    judge each expected device by one check of exactly what it needs.
    """
    lost = []
    for k, need in sorted(expected.devices.items()):
        if k in live.unknown:
            continue
        if k in live.together or (len(need) == 1 and need in live.granted.get(k, "")):
            continue
        v = policy.check(k, need)
        if v.state == "deny":
            lost.append(k)
        elif v.state != "allow":
            live.unknown[k] = v.reason
    return lost


def _unreadable_finding(c: Container, expected: Expected) -> Finding | None:
    """A runtime file that exists but cannot be read hides what it would say (a GPU sign, an expected
    device, the init pid): such a container is unknown, never "not a GPU container" nor guessed stopped."""
    unreadable = list(c.unreadable)
    if not unreadable or c.status == "stopped":
        return None
    # Permission denied is this user's lack of rights, not damage: the advice must not send anyone
    # to delete a runtime's state file
    denied = os.strerror(errno.EACCES)
    fix = (f"run nvsymlinkd as root: {denied} means this user may not read the runtime's files, not that "
           "they are damaged" if any(u.endswith(denied) for u in unreadable) else
           "the runtime writes these files as root: restore or remove the damaged file (or recreate the "
           "container); until then its device access cannot be judged")
    return Finding(
        UNKNOWN, _devices(sorted(expected.devices)),
        "; ".join(unreadable[:3]) + (f" (and {len(unreadable) - 3} more)" if len(unreadable) > 3 else ""), fix,
        "run nvsymlinkd as root" if fix.startswith("run") else "restore the runtime's files")


def _no_policy_finding(expected: Expected, policy_error: str | None) -> Finding:
    return Finding(UNKNOWN, _devices(sorted(expected.devices)), f"cannot read the device cgroup: {policy_error}",
                   "run as root on the host (not in a container); check /proc/<pid>/cgroup and the cgroup mounts",
                   "run as root on the host")


def _lost_finding(lost: list[Device], expected: Expected, who: str) -> list[Finding]:
    if not lost:
        return []
    sources = sorted({s for k in lost for s in expected.sources.get(k, ())})
    return [Finding(LOST, _devices(lost), f"expected by the {', '.join(sources)} but denied by the device cgroup "
                                          f"now{_named(expected, lost)}",
                    f"nvsymlinkd repair {who} (or recreate the container)", f"nvsymlinkd repair {who}")]


def _named(expected: Expected, devices: list[Device]) -> str:
    """The hook-granted MIG devices and IMEX channels among `devices`, by the names people use: a MIG device's
    UUID and g:m index (not only its capability minors), an IMEX channel's number and node (as
    NVIDIA_IMEX_CHANNELS and imex/N name it); the finding's detail carries them to check and the journal."""
    hook, among = expected.hook, set(devices)
    if hook is None:
        return ""
    named = "".join(f"; MIG device {m.uuid} ({m.index or 'index unknown'}, {m.instance})" for m in hook.mig
                    if among & set(m.devices))
    return named + "".join(f"; IMEX channel {c.channel} ({c.path})" for c in hook.imex if c.device in among)


def _not_in_spec_finding(c: Container, expected: Expected, live: _Live, scope_devices: ScopeDevices | None,
                         who: str) -> list[Finding]:
    """Allowed now but declared by neither the spec nor runc's recorded rules: injected by a hook."""
    not_declared = [k for k in sorted(live.granted) if k not in expected.declared]
    if not_declared and _systemd_scope(c) and scope_devices is not None:
        # systemd re-applies what the scope lists (repair adds hook devices there) and runc >= 1.0's
        # `update` leaves device rules alone: a device the scope covers is no longer at risk
        not_declared = [k for k in not_declared if not scope_devices.covers(k, live.granted[k])]
    if not not_declared:
        return []
    # Declared vs injected needs the spec or runc's recorded rules; without either, say so.
    if c.spec is None and (c.state is None or c.state.rules is None):
        return [Finding(
            UNKNOWN, _devices(not_declared),
            "allowed now, but neither the spec nor the runtime's state could be read to tell declared from "
            "hook-injected devices", "check the problems listed for this container (bundle or state file)",
            "see its problems")]
    return [Finding(
        AT_RISK_NOT_IN_SPEC, _devices(not_declared),
        "allowed now but not in the container's spec (injected by a hook): "
        + ("the next daemon-reload or runc update removes it" if c.scope else
           "the next runc update or re-apply of the spec removes it") + _named(expected, not_declared),
        *_not_in_spec_fix(c, expected, not_declared, who))]


def _not_in_spec_fix(c: Container, expected: Expected, devices: list[Device], who: str) -> tuple[str, str]:
    """What works for a hook-injected device, by what nvsymlinkd can do for it: only a device a trusted
    source expects (the reconstructed NVIDIA hook grant, a baseline) is ever granted by a repair."""
    recreate = "declare the devices in the spec (CDI, or the device plugin's PASS_DEVICE_SPECS) and recreate"
    if any(k not in expected.devices for k in devices):
        then = (f"adds them to {c.scope}'s DeviceAllow before a reload can take them" if c.scope else
                "gives them back after a loss")
        untrusted = ("nothing trusted records this grant yet" if expected.hook is None or expected.hook.trusted
                     else f"the NVIDIA hook's grant is not known: {expected.hook.detail}")
        return (f"{recreate}; until then keep the nvsymlinkd daemon running: it records them as this container's "
                f"baseline, then {then} ({untrusted}, so nvsymlinkd repair cannot)",
                "declare them in the spec, recreate")
    if c.scope:
        return (f"nvsymlinkd repair {who} adds them to {c.scope}'s DeviceAllow now, so reloads keep them (the "
                f"daemon does it by itself); for good, {recreate}", f"nvsymlinkd repair {who}")
    return (f"{recreate}: with the cgroupfs driver nothing else keeps them at the next runc update; after a loss, "
            f"nvsymlinkd repair {who} gives them back", "declare them in the spec, recreate")


def request_signs(c: Container, expected: Expected) -> list[str]:
    """Why the container asks for GPUs in a way a runtime acts on (nodes are judged one by one).

    CDI annotations, or the legacy NVIDIA hook whose grant cannot be reconstructed. Not
    NVIDIA_VISIBLE_DEVICES alone: the CUDA images set it to `all` for every container, and without the
    hook nothing reads it; nor a hook whose exact reconstruction grants nothing (void, or the toolkit's
    config refusing an unprivileged request): there the runtime was asked and deliberately gave nothing.
    """
    signs = []
    if c.spec is not None and any(k.startswith(CDI_ANNOTATION) for k in c.spec.annotations):
        signs.append("CDI annotations")
    hook = expected.hook
    if hook is not None and not hook.trusted:
        visible = c.spec.visible_devices if c.spec is not None else None
        # bounded for display only: the grant was decided on the whole value (a `void` may come past any cut)
        signs.append(f"the NVIDIA hook with NVIDIA_VISIBLE_DEVICES={bounded(visible)}" if visible is not None
                     else "the NVIDIA hook")
    return signs


def _denied_finding(c: Container, expected: Expected, live: _Live, policy: AccessPolicy, host: HostDevices,
                    dev_nodes: Sequence[DevNode], lost: list[Device]) -> list[Finding]:
    """NVIDIA devices the container has (nodes in its spec, its runtime state or its /dev: a sign, never a
    grant) or asks for, that the kernel denies and no trusted source expects: never ok, never repaired.
    Not while a runtime file is unreadable: what it hides may be the very grant (the container is unknown)."""
    if c.unreadable:
        return []
    have = {node.device for facts in (c.spec, c.state) if facts is not None
            for node in facts.nodes if node.type == "c" and node.major in host.nvidia_majors}
    have |= {d for _, d in dev_nodes if d.major in host.nvidia_majors}
    denied = []
    for k in sorted(have):
        if k in expected.devices or k in live.unknown or k in live.together:
            continue  # expected: judged as lost or not; undecided: said as unknown
        need = Access("r") if k.major in host.read_only_majors else RW
        if len(need) == 1 and need in live.granted.get(k, ""):
            continue
        v = policy.check(k, need)
        if v.state == "deny":
            denied.append(k)
        elif v.state != "allow":
            live.unknown[k] = v.reason
    why = ""
    if denied:
        why = "its NVIDIA nodes are denied by the device cgroup"
    else:
        asks = request_signs(c, expected)
        can_open = any(k.major in host.nvidia_majors for k in live.granted)
        if asks and not have and not can_open and not expected.devices and not lost:
            ctl_gpu = [Device.char(n.major, n.minor) for n in host.nodes if n.kind in ("ctl", "gpu")]
            denied = sorted(k for k in ctl_gpu if k not in live.unknown)
            why = f"it asks for GPUs ({', '.join(asks)}) but can open no NVIDIA device"
            if not denied:
                return []
    if not denied:
        return []
    hook = expected.hook
    hook_note = ""
    if hook is not None and not hook.trusted:
        hook_note = f"; the NVIDIA hook's grant could not be reconstructed: {hook.detail}"
    return [Finding(
        DENIED, _devices(denied),
        f"{why}, and nothing trusted (spec rules, runtime state, NVIDIA hook grant, baseline) says it was granted "
        f"them: nvsymlinkd cannot know whether they were granted and lost or never granted{hook_note}",
        "fix the runtime's configuration (docker --gpus or the NVIDIA runtime, the device plugin or CDI instead of "
        "mounted /dev/nvidia* nodes) and recreate the container; nvsymlinkd never grants what nothing trusted "
        "granted", "fix the runtime's config, recreate")]


def _systemd_scope(c: Container) -> str | None:
    """The scope whose DeviceAllow systemd re-applies to the container: none where the runtime's record says
    it wrote the cgroup itself (cgroupfs), whatever a directory in its path is named."""
    driver = c.cgroup_driver
    return None if driver is not None and driver.source != "inferred" and driver.name == "cgroupfs" else c.scope


def _scope_finding(c: Container, expected: Expected, scope_devices: ScopeDevices | None, lost: list[Device],
                   who: str) -> list[Finding]:
    """Declared devices the scope's DeviceAllow lacks: systemd's next apply takes them away."""
    if not _systemd_scope(c):
        return []
    if scope_devices is None:
        return [Finding(UNKNOWN, (), f"cannot read DeviceAllow of {c.scope} (no systemd bus, no transient unit file)",
                        "run on the host with /run/systemd and the system bus available", "run on the host")]
    lost_set = set(lost)
    missing = [k for k, need in sorted(expected.devices.items())
               if k in expected.declared and k not in lost_set and not scope_devices.covers(k, need)]
    if not missing:
        return []
    return [Finding(
        AT_RISK_SCOPE, _devices(missing),
        f"{c.scope} DeviceAllow (from {scope_devices.source}) lacks them: the next systemctl daemon-reload "
        "removes them",
        f"nvsymlinkd sync (creates /dev/char links for new containers), then nvsymlinkd repair {who}",
        f"nvsymlinkd repair {who}")]


def _uvm_finding(host: HostDevices, expected: Expected, live: _Live, kubernetes: bool = False) -> list[Finding]:
    """The host has nvidia-uvm, the container has GPUs but not it. The fix depends on who allocated the
    devices: the device plugin (a pod: restart it, then recreate), or the runtime's hook at create time
    (runc, Docker, Podman: recreating is enough now that nvidia-uvm is loaded)."""
    uvm = host.uvm_node
    if uvm is None:
        return []
    key = Device.char(uvm.major, uvm.minor)
    has_gpu = any(k.major in host.nvidia_majors and k != key for k in set(live.granted) | set(expected.devices))
    if not has_gpu or key in live.granted or key in expected.devices or key in live.unknown:
        return []
    return [Finding(
        AT_RISK_UVM, (key,),
        "the host has nvidia-uvm but this container was not given it ("
        + ("the device plugin started before nvidia-uvm was loaded" if kubernetes else
           "created before nvidia-uvm was loaded") + "): CUDA fails or falls back to the CPU",
        "restart the device plugin after nvidia-uvm is loaded, then recreate this container" if kubernetes else
        "recreate this container: nvidia-uvm is loaded now, so the runtime grants it to a new one (load it "
        "at boot, before containers start: nvidia-modprobe -u -c=0)",
        "restart the device plugin, recreate" if kubernetes else "recreate the container")]


def _undecided_finding(host: HostDevices, expected: Expected, live: _Live) -> list[Finding]:
    relevant = [k for k in sorted(live.unknown) if k in expected.devices or k.major in host.nvidia_majors]
    if not relevant:
        return []
    return [Finding(UNKNOWN, _devices(relevant), f"cannot decide access: {live.unknown[relevant[0]]}",
                    "see the reason; nvsymlinkd reads cgroup v1 devices.list and v2 BPF device programs as root",
                    "see below")]


def _new_report(c: Container, signs: Sequence[str], expected: Expected, host: HostDevices,
                dev_nodes: Sequence[DevNode]) -> ContainerReport:
    declared = _declared_nodes(c)
    return ContainerReport(
        c.id, c.runtime, c.namespace, c.status, OK, c.scope, c.init_pid, tuple(signs),
        expected=expected.grants(),
        untrusted_nodes=tuple(f"{p} ({d})" for p, d in dev_nodes if d.major in host.nvidia_majors and d not in declared),
        cgroup={"devices": c.cgroup_v1_devices, "unified": c.cgroup_v2, "freezer": c.cgroup_v1_freezer},
        problems=tuple(c.problems), pod_namespace=c.pod_namespace, pod_name=c.pod_name,
        nvidia_hook=expected.hook.to_json() if expected.hook is not None else None,
        exec_fifo=exec_fifo_path(c) if c.status == "created" else None,
        container_name=c.container_name,
        runtime_rules=_runtime_rules(c),
        cgroup_driver=c.cgroup_driver,
    )


def _runtime_rules(c: Container) -> tuple[Rule, ...]:
    """The allow rules the runtime programmed into the container's device cgroup: runc's recorded rules
    (state.json config.cgroups.devices), else the spec's linux.resources.devices."""
    rules = c.state.rules if c.state is not None and c.state.rules is not None else (
        c.spec.rules if c.spec is not None else ())
    return tuple(r for r in rules or () if r.allow and r.type in ("c", "b"))


def evaluate(c: Container, signs: Sequence[str], expected: Expected, policy: AccessPolicy | None,
             policy_error: str | None, scope_devices: ScopeDevices | None, host: HostDevices,
             dev_nodes: Sequence[DevNode] = ()) -> ContainerReport:
    """Decide one container's verdict: one finding function per kind, in the order they are reported.

    policy: an access.cgroup.AccessPolicy or None (then policy_error says why).
    scope_devices: a scopes.ScopeDevices, or None when the scope's DeviceAllow could not be read.
    dev_nodes: (path, Device) of the char nodes in the container's /dev, untrusted.
    """
    report = _new_report(c, signs, expected, host, dev_nodes)
    if c.status == "creating":  # hooks still running: nothing is settled yet, whatever it turns out to be
        report.verdict = NOT_RUNNING
        return report
    findings = report.findings
    running = c.status in ("created", "running")
    unreadable = _unreadable_finding(c, expected)
    if unreadable is not None:
        findings.append(unreadable)
        if not running or (not signs and not expected.devices):
            report.verdict = _verdict(findings)
            return report
    if not signs and not expected.devices:
        report.verdict = NOT_GPU
        return report
    if not running:
        report.verdict = NOT_RUNNING
        return report
    if policy is None:
        findings.append(_no_policy_finding(expected, policy_error))
        report.verdict = _verdict(findings)
        return report
    live = read_live(policy, expected, host, dev_nodes)
    report.granted = dict(sorted(live.granted.items()))
    lost = _lost_devices(policy, expected, live)
    findings += _lost_finding(lost, expected, c.short_id)
    findings += _denied_finding(c, expected, live, policy, host, dev_nodes, lost)
    findings += _not_in_spec_finding(c, expected, live, scope_devices, c.short_id)
    findings += _scope_finding(c, expected, scope_devices, lost, c.short_id)
    findings += _uvm_finding(host, expected, live, kubernetes=c.pod_namespace is not None)
    findings += _undecided_finding(host, expected, live)
    report.verdict = _verdict(findings)
    return report


def baseline_devices(report: ContainerReport) -> dict[Device, Access] | None:
    """The access to record as the healthy baseline, or None when this is not a healthy moment.

    Only once the runtime says created/running (hooks done), and never while
    something is lost or unknown.
    """
    if report.status not in ("created", "running") or report.verdict in (LOST, DENIED, UNKNOWN, NOT_GPU,
                                                                          NOT_RUNNING):
        return None
    if any(f.kind == UNKNOWN for f in report.findings):
        return None
    return dict(report.granted) or None


@dataclass(frozen=True)
class HostFinding:
    """One host-wide finding (verify/hostcheck.py makes them)."""

    kind: str  # privilege, cgroup-version, cgroup-driver, versions, dev-char, link-keepers, nvml
    status: str  # ok, warn, info
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "status": self.status, "detail": self.detail, "fix": self.fix}


@dataclass
class Report:
    containers: list[ContainerReport]  # GPU containers only, plus not-running ones seen
    host: list[HostFinding]
    not_gpu: int = 0
    seconds: float = 0.0
    # why systemd could not be asked for the scopes' DeviceAllow (the unit files answered instead); not in
    # the JSON: `repair --before-reload` and the daemon report it
    bus_error: str | None = None
    # (container id, cgroup v2 path) of every container discovered, GPU or not, also in a pass over only some
    # (a repair that replaces a cgroup's device program must see every container it would touch)
    cgroups_v2: tuple[tuple[str, str], ...] = ()

    @property
    def problems(self) -> list[ContainerReport]:
        return [c for c in self.containers if c.verdict not in (OK, NOT_RUNNING, NOT_GPU)]

    @property
    def all_ok(self) -> bool:
        return not self.problems and not any(h.status == "warn" for h in self.host)

    def to_json(self) -> dict[str, Any]:
        counts = {v.value: 0 for v in VERDICTS + (NOT_RUNNING,)}
        for c in self.containers:
            verdict = Verdict(c.verdict).value
            counts[verdict] = counts.get(verdict, 0) + 1
        return {
            "ok": self.all_ok,
            "containers": [c.to_json() for c in self.containers],
            "host": [h.to_json() for h in self.host],
            "summary": {"gpu_containers": len(self.containers), "not_gpu_containers": self.not_gpu, **counts},
            "seconds": round(self.seconds, 4),
        }

