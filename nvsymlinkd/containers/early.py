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

    scope_of_cgroups_path("system.slice:cri-containerd:ID")  # "cri-containerd-ID.scope"
    missing_entries(expected, scope_devices)                 # [(Device, Access)] to add
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


def missing_entries(expected: Expected, scope_devices: Any) -> list[tuple[Device, Access]]:
    """[(Device, Access)] the scope must hold before a reload and does not: every device the spec's
    rules or the NVIDIA hook's trusted reconstruction grant (nothing else), less what the scope's
    DeviceAllow covers already (scope_devices: scopes.ScopeDevices, or None when unknown: all)."""
    out: list[tuple[Device, Access]] = []
    for device, access in sorted(expected.devices.items()):
        if not set(expected.sources.get(device, ())) & SOURCES:
            continue
        if scope_devices is not None and scope_devices.covers(device, str(access)):
            continue
        out.append((device, access))
    return out
