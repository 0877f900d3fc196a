"""The one seam between repair/ and systemd: the unit calls a repair makes (SystemdUnits), each failing as a
RepairError with systemd's own words; a change of how repair reaches systemd is made here.

    org.freedesktop.systemd1.Manager.SetUnitProperties(s name, b runtime, a(sv) properties)

with ("DeviceAllow", Variant("a(ss)", [("/dev/char/195:0", "rw"), ...])). systemd
appends the entries (the same path updates in place) and re-applies the unit's
device policy at once; runtime=true keeps them for the unit's lifetime, across
daemon-reloads: systemd writes them as a drop-in under /run (for a transient unit, every
container scope, beside it: /run/systemd/transient/<unit>.d/50-DeviceAllow.conf), gone
at reboot and with the unit.

Blocking calls on the process's one systemd client (systemd.client.shared()): one
connection for every call of a command, and for the daemon's worker threads. Entries are
systemd.deviceallow.DeviceAllow.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

from nvsymlinkd.errors import RepairError
from nvsymlinkd.systemd.client import SystemdCallError, shared
from nvsymlinkd.systemd.deviceallow import DeviceAllow


@contextmanager
def _said_as_repair_error() -> Iterator[None]:
    try:
        yield
    except SystemdCallError as exc:
        raise RepairError(str(exc))


class SystemdUnits:
    """The unit calls a repair makes, each failing as a RepairError with systemd's own words; `timeout`: the
    repair's, for each call."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    def set_device_allow(self, scope: str, entries: Sequence[DeviceAllow]) -> None:
        """SetUnitProperties(scope, runtime=true, DeviceAllow=entries)."""
        with _said_as_repair_error():
            shared().set_device_allow(scope, entries, self.timeout)

    def unit_known(self, scope: str) -> None:
        """RepairError unless systemd knows the unit (asked before anything is frozen)."""
        with _said_as_repair_error():
            shared().get_unit(scope, self.timeout)

    def device_policy(self, scope: str) -> tuple:
        """(DevicePolicy, [DeviceAllow]) of the scope as systemd holds them; RepairError also for a unit systemd
        does not know."""
        with _said_as_repair_error():
            props = shared().scope_properties([scope], self.timeout).get(scope)
        if props is None:
            raise RepairError(f"systemd does not know {scope}")
        policy, allow = props.get("DevicePolicy"), props.get("DeviceAllow")
        if policy is None or allow is None:
            raise RepairError(f"{scope} has no DevicePolicy/DeviceAllow property")
        return str(policy.value), [DeviceAllow.of_pair(pair) for pair in allow.value]

    def put_back_policy(self, scope: str, policy: str, entries: Sequence[DeviceAllow]) -> None:
        """SetUnitProperties(scope, runtime=true, DevicePolicy=policy, DeviceAllow= reset, then the entries): a
        scope's device properties put back as they were."""
        with _said_as_repair_error():
            shared().set_device_policy(scope, policy, list(entries), self.timeout)

    def device_allow(self, scope: str) -> list:
        """The scope's DeviceAllow as systemd holds it: [DeviceAllow]."""
        with _said_as_repair_error():
            return shared().get_device_allow(scope, self.timeout)  # type: ignore[no-any-return]
