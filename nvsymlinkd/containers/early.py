"""A container still being created: the DeviceAllow entries its scope lacks. Pure: no I/O.

runc's systemd driver makes the container's scope first (its UnitNew reaches the daemon early),
then programs the cgroup, then runs the prestart hooks (the legacy NVIDIA hook grants the GPUs
there), and writes state.json last (REFERENCE.md, "Order inside runc create"). A daemon-reload
between the hook's grant and state.json re-applies the scope's DeviceAllow, which never had the
hook's devices: the grant is gone before the daemon's usual pass (triggered by state.json) sees the
container. So the daemon reads the bundle's spec as soon as the scope appears (written by the
runtime's caller, never by the container), reconstructs what the hook will grant
(containers.hookgrant, trusted or nothing) plus the spec's own device rules, and adds to the scope
what it lacks (SetUnitProperties, runtime=true): a reload after the hook keeps them.

But not at UnitNew itself: runc makes the scope with no device properties at all (its systemd
driver's Apply starts the unit with Description, Slice, Delegate, PIDs, the accounting switches,
DefaultDependencies and the spec's SystemdProps: libcontainer/cgroups/systemd v1.go/v2.go) and sends
its device policy only in Set, which initProcess.start calls at procHooks, right before the prestart
hooks (DevicePolicy=strict, an empty DeviceAllow= that resets the list, then one entry per rule:
cgroups/devices/systemd.go). Until then the scope reads DevicePolicy=auto with no entries, which is
"no restriction": judged then, the scope lacks nothing (the chaos soak's early path said so for every
container). Entries added then would be wrong twice over: on an `auto` scope they make systemd
restrict the cgroup to them (an allow-list) while runc's init still creates the container's nodes,
and runc's Set resets them a moment later. So the daemon waits until the runtime's policy is visible
(runtime_policy_set), while the container is still being created, and judges then.

    scope_of_cgroups_path("system.slice:cri-containerd:ID")  # "cri-containerd-ID.scope"
    runtime_policy_set(scope_devices)                        # the runtime's Set has landed
    would_narrow(scope_devices)                              # why no drop-in may be written, or None
    missing_entries(expected, scope_devices)                 # [(Device, Access)] to add

A drop-in never narrows (issue 39): systemd turns a scope whose DevicePolicy is `auto` into an
allow-list as soon as it has any DeviceAllow= (REFERENCE.md), so on such a scope (a privileged
container, whose runc Set sends no device policy, or crun, which programs the cgroup below the scope)
one entry of ours would, at the next reload, deny everything else the container opens. A scope whose
policy cannot be read is the same unknown: nothing is written for either (would_narrow).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from nvsymlinkd.host.devices import Access, Device

if TYPE_CHECKING:  # an annotation only: containers.expected reads files through ocispec
    from nvsymlinkd.containers.expected import Expected

# systemd's unit names (what the bus reports): runc's getUnitName builds PREFIX-NAME.scope from them
UNIT_PART = re.compile(r"[A-Za-z0-9_.:@-]{1,250}")
# the only sources this acts on: what the runtime's caller wrote, and the hook's exact reconstruction
SOURCES = frozenset({"spec", "nvidia-hook"})  # containers.expected SPEC, HOOK


def scope_of_cgroups_path(cgroups_path: str | None) -> str | None:
    """The scope runc's systemd driver makes for an OCI `linux.cgroupsPath` of the form
    "slice:prefix:name" (libcontainer/cgroups/systemd, getUnitName: PREFIX-NAME.scope; a NAME
    ending in .slice is a slice, no scope); None for a cgroupfs path or anything else."""
    if not cgroups_path or cgroups_path.startswith("/"):
        return None
    parts = cgroups_path.split(":")
    if len(parts) != 3:
        return None
    _, prefix, name = parts
    if not name or name.endswith(".slice") or not UNIT_PART.fullmatch(name) or \
            (prefix and not UNIT_PART.fullmatch(prefix)):
        return None
    return f"{prefix}-{name}.scope"


def runtime_policy_set(scope_devices: Any) -> bool:
    """Whether the scope shows a runtime's device policy (a DevicePolicy other than auto, or any
    DeviceAllow entry): what runc's Set sends. A scope systemd does not know (None) shows none. A scope
    that still reads auto with no entries when its container leaves creation (a privileged container:
    runc's allow-all is exactly that; crun, which programs the cgroup itself) is not restricted by
    systemd at all, and a reload takes nothing from it."""
    return scope_devices is not None and (scope_devices.policy != "auto" or bool(scope_devices.entries))


def would_narrow(scope_devices: Any) -> str | None:
    """Why a drop-in of DeviceAllow= entries for this scope could take devices away at the next reload
    (None: it cannot; the scope's policy is strict or closed, already an allow-list that entries only
    add to). scope_devices: scopes.ScopeDevices, or None when neither systemd nor its files answered."""
    if scope_devices is None:
        return "its device policy cannot be read (an entry would make an unrestricted scope an allow-list)"
    if scope_devices.policy not in ("strict", "closed"):
        return (f"its DevicePolicy is {scope_devices.policy} (not restricted by systemd: a DeviceAllow= "
                "would make it an allow-list at the next reload)")
    return None


def missing_entries(expected: Expected, scope_devices: Any) -> list[tuple[Device, Access]]:
    """[(Device, Access)] the scope must hold before a reload and does not: every device the spec's
    rules or the NVIDIA hook's trusted reconstruction grant (nothing else), less what the scope's
    DeviceAllow covers already (scope_devices: scopes.ScopeDevices, or None when unknown: all)."""
    out: list[tuple[Device, Access]] = []
    for device, access in sorted(expected.devices.items()):
        if not set(expected.sources.get(device, ())) & SOURCES:
            continue
        if scope_devices is not None and scope_devices.covers(device, access):
            continue
        out.append((device, access))
    return out
