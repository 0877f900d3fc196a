"""Expected NVIDIA device access of a container, from trusted sources only.

Trusted: the OCI spec's `linux.resources.devices` rules (written by the
runtime's caller), runc's state.json `config.cgroups.devices` (what runc
itself programmed), the NVIDIA hook's grant where containers.hookgrant
reconstructs it exactly from the spec, the toolkit's config and the driver,
and the daemon's own healthy baseline. NOT trusted:
nodes in the container's /dev (a container with CAP_MKNOD can make any node)
and `linux.devices` alone (runc creates those nodes but does not allow them:
verified with runc 1.1.5, the rule it records for them is `allow: false`).

Devices are host.devices.Device, access host.devices.Access.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nvsymlinkd.containers.model import UNEXPECTED, Grant
from nvsymlinkd.containers.ocispec import FRONTEND_MAJOR
from nvsymlinkd.host.devices import Access, Device, named_minors, rule_class

SPEC = "spec"
RUNTIME_STATE = "runtime-state"
BASELINE = "baseline"
HOOK = "nvidia-hook"  # containers.hookgrant.SOURCE


def rules_access(rules, device: Device) -> Access:
    """Access the rule list grants to one device: for each letter, the last matching rule decides.

    Default deny, like runc's device emulator starting from `deny a`.
    """
    granted = Access()
    for rule in rules:
        if rule.matches(device):
            granted = granted.union(rule.access) if rule.allow else granted.difference(rule.access)
    return granted


def usable(access: str) -> Access:
    """The letters an open() needs checked (mknod is not use)."""
    return Access(access).usable


@dataclass(frozen=True)
class Expected:
    devices: dict[Device, Access] = field(default_factory=dict)  # what must be allowed ("rw", "r", ...)
    declared: frozenset[Device] = frozenset()  # Devices the spec/runtime state allows (not baseline-only)
    sources: dict[Device, tuple[str, ...]] = field(default_factory=dict)  # SPEC/RUNTIME_STATE/HOOK/BASELINE
    hook: Any = None  # the hookgrant.HookGrant reconstructed for the container, None without an NVIDIA hook

    def grants(self) -> dict[Device, Grant]:
        """One Grant per expected device, in device order, naming its first source."""
        out = {}
        for k, access in sorted(self.devices.items()):
            sources = tuple(self.sources.get(k, ()))
            out[k] = Grant(k, access, sources[0] if sources else UNEXPECTED, None, sources)
        return out


def nvidia_majors_of(majors) -> frozenset:
    return frozenset(majors.nvidia_majors) | {FRONTEND_MAJOR}


def candidate_devices(host_devices, spec, state, baseline, nvidia_majors: frozenset, hook=None) -> set:
    """NVIDIA devices worth asking about: the host nodes' (Devices), declared nodes, explicitly named rules,
    the hook's reconstructed grant, baseline."""
    keys = set(host_devices)
    if hook is not None and hook.trusted:
        keys.update(hook.devices)
    for facts in (spec, state):
        if facts is None:
            continue
        for node in facts.nodes:
            if node.type == "c" and node.major in nvidia_majors:
                keys.add(node.device)
        for rule in facts.rules or ():
            if rule.allow and rule.type == "c" and rule.major in nvidia_majors and rule.minor is not None:
                keys.add(Device.char(rule.major, rule.minor))
    if baseline is not None:
        keys.update(baseline.devices)
    return {k for k in keys if k.major in nvidia_majors}


def relevant(rules, majors: set) -> tuple:
    """Only rules that can match one of these char majors (runc's state lists ~12 unrelated defaults)."""
    return tuple(r for r in rules if r.type in ("a", "c") and (r.major is None or r.major in majors))


def expected_access(candidates, spec, state, baseline, hook=None) -> Expected:
    """What each candidate device must be allowed, from the spec's and the runtime state's rules, the
    NVIDIA hook's reconstructed grant (a hookgrant.HookGrant, used only when trusted) and the baseline.

    The rules are asked once per class of devices they cannot tell apart (host.devices.rule_class: a
    MIG host makes every one of its ~2,000 capability nodes a candidate of every container). The
    baseline is looked up per device."""
    majors = {k.major for k in candidates}
    spec_rules = relevant(spec.rules, majors) if spec is not None else None
    state_rules = relevant(state.rules, majors) if state is not None and state.rules is not None else None
    named = named_minors((spec_rules or ()) + (state_rules or ()))
    by_class: dict = {}  # (type, major, named minor or None) -> (sources, access) from the rules
    devices: dict = {}
    declared = set()
    sources: dict = {}
    for key in sorted(candidates):
        cls = rule_class(key, named)
        from_rules = by_class.get(cls)
        if from_rules is None:
            from_rules = by_class[cls] = _from_rules(spec_rules, state_rules, key)
        got, access = from_rules
        if got:
            declared.add(key)
        if hook is not None and hook.trusted and key in hook.devices:
            a = usable(hook.devices[key])
            if a:
                got = got + (HOOK,)
                access = access.union(a)
        if baseline is not None and key in baseline.devices:
            a = usable(baseline.devices[key])
            if a:
                got = got + (BASELINE,)
                access = access.union(a)
        if got:
            devices[key] = access
            sources[key] = got
    return Expected(devices, frozenset(declared), sources, hook)


def _from_rules(spec_rules, state_rules, key: Device) -> tuple:
    """(sources, access) the spec's and the runtime state's rules grant one device."""
    got: tuple = ()
    access = Access()
    if spec_rules is not None:
        a = usable(rules_access(spec_rules, key))
        if a:
            got += (SPEC,)
            access = access.union(a)
    if state_rules is not None:
        a = usable(rules_access(state_rules, key))
        if a:
            got += (RUNTIME_STATE,)
            access = access.union(a)
    return got, access
