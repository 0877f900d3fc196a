"""Changing a unit's device policy through systemd's D-Bus API, for repair/ and the daemon's prevention.

    org.freedesktop.systemd1.Manager.SetUnitProperties(s name, b runtime, a(sv) properties)

with ("DeviceAllow", Variant("a(ss)", [("/dev/char/195:0", "rw"), ...])). systemd
appends the entries (the same path updates in place) and re-applies the unit's
device policy at once; runtime=true keeps them for the unit's lifetime, across
daemon-reloads: systemd writes them as a drop-in under /run (for a transient unit, every
container scope, beside it: /run/systemd/transient/<unit>.d/50-DeviceAllow.conf), gone
at reboot and with the unit.

Blocking calls on the process's one systemd client (systemd.client.shared()): one
connection for every call of a command, and for the daemon's worker threads.
"""

from __future__ import annotations

from nvsymlinkd.systemd.client import (
    CALL_TIMEOUT,
    SystemdCallError,
    shared,
)
from nvsymlinkd.systemd.deviceallow import DeviceAllow

DEFAULT_TIMEOUT = CALL_TIMEOUT


def set_device_allow(unit: str, entries, timeout: float = DEFAULT_TIMEOUT) -> None:
    """SetUnitProperties(unit, runtime=true, [DeviceAllow=entries]); raises SystemdCallError."""
    shared().set_device_allow(unit, entries, timeout)


def get_unit(unit: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    """The unit's object path (org.freedesktop.systemd1.NoSuchUnit as SystemdCallError)."""
    return shared().get_unit(unit, timeout)


def get_device_allow(unit: str, timeout: float = DEFAULT_TIMEOUT) -> list:
    """The scope's current DeviceAllow entries: [DeviceAllow]."""
    return shared().get_device_allow(unit, timeout)


def get_device_policy(unit: str, timeout: float = DEFAULT_TIMEOUT) -> tuple:
    """(DevicePolicy, [DeviceAllow]) of a scope; SystemdCallError, also for an unknown unit."""
    props = shared().scope_properties([unit], timeout).get(unit)
    if props is None:
        raise SystemdCallError(f"systemd does not know {unit}")
    policy, allow = props.get("DevicePolicy"), props.get("DeviceAllow")
    if policy is None or allow is None:
        raise SystemdCallError(f"{unit} has no DevicePolicy/DeviceAllow property")
    return str(policy.value), [DeviceAllow.of_pair(pair) for pair in allow.value]


def set_device_policy(unit: str, policy: str, entries, timeout: float = DEFAULT_TIMEOUT) -> None:
    """SetUnitProperties(unit, runtime=true, [DevicePolicy, DeviceAllow=[] (reset), DeviceAllow=entries]):
    a scope's device properties put back as they were; raises SystemdCallError."""
    shared().set_device_policy(unit, policy, entries, timeout)
