"""Changing a unit's device policy through systemd's D-Bus API (one call, short timeouts).

    org.freedesktop.systemd1.Manager.SetUnitProperties(s name, b runtime, a(sv) properties)

with ("DeviceAllow", Variant("a(ss)", [("/dev/char/195:0", "rw"), ...])). systemd
appends the entries (the same path updates in place) and re-applies the unit's
device policy at once; runtime=true keeps them for the unit's lifetime, across
daemon-reloads: systemd writes them as a drop-in under /run (for a transient unit, every
container scope, beside it: /run/systemd/transient/<unit>.d/50-DeviceAllow.conf), gone
at reboot and with the unit.

The bus is DBUS_SYSTEM_BUS_ADDRESS when set (tests use a private bus), else the
standard system bus socket. Each call opens its own connection: repairs are
rare, and a blocking caller (a CLI, an executor thread) needs no event loop.
"""

from __future__ import annotations

import asyncio

from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.systemd.bus import close, quiet_dropped_writes

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
SCOPE = "org.freedesktop.systemd1.Scope"
DEFAULT_TIMEOUT = 5.0


class SystemdCallError(NvsymlinkdError):
    """systemd refused the call, or the bus could not be reached in time."""

    exit_code = 1


def device_allow_property(entries) -> list:
    """The a(sv) body element for DeviceAllow: entries are (path, access) pairs."""
    from dbus_next import Variant

    return ["DeviceAllow", Variant("a(ss)", [[str(path), str(access)] for path, access in entries])]


async def _connect(timeout: float):
    from dbus_next import BusType
    from dbus_next.aio import MessageBus

    from nvsymlinkd.systemd.bus import bus_address

    quiet_dropped_writes()
    try:
        return await asyncio.wait_for(MessageBus(bus_type=BusType.SYSTEM).connect(), timeout)
    except asyncio.TimeoutError:
        raise SystemdCallError(f"system bus at {bus_address()}: no connection within {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - socket missing, auth refused, ...: all mean "no bus"
        raise SystemdCallError(f"system bus at {bus_address()}: cannot connect ({exc}); "
                               "is dbus running (DBUS_SYSTEM_BUS_ADDRESS)?")


async def _call(member: str, signature: str, body: list, timeout: float, destination=SYSTEMD,
                path=SYSTEMD_PATH, interface=MANAGER):
    from dbus_next import Message, MessageType

    bus = await _connect(timeout)
    try:
        msg = Message(destination=destination, path=path, interface=interface, member=member,
                      signature=signature, body=body)
        try:
            reply = await asyncio.wait_for(bus.call(msg), timeout)
        except asyncio.TimeoutError:
            raise SystemdCallError(f"{interface}.{member}: no reply from {destination} within {timeout:g} s")
        except (EOFError, OSError) as exc:  # dbus restarted under the call: the connection is gone
            raise SystemdCallError(f"{interface}.{member}: the system bus connection closed before "
                                   f"{destination} replied ({type(exc).__name__}); is dbus restarting?")
        if reply.message_type == MessageType.ERROR:
            detail = reply.body[0] if reply.body else ""
            if isinstance(detail, str):  # one line for the journal; a service may send a whole traceback
                lines = [ln.strip() for ln in detail.strip().splitlines() if ln.strip()]
                detail = lines[-1] if lines else ""
            raise SystemdCallError(f"{interface}.{member}: {reply.error_name}: {detail}")
        return reply.body
    finally:
        await close(bus)


async def set_device_allow_async(unit: str, entries, timeout: float = DEFAULT_TIMEOUT) -> None:
    """SetUnitProperties(unit, runtime=true, [DeviceAllow=entries]); raises SystemdCallError."""
    entries = list(entries)
    if not entries:
        raise ValueError("no DeviceAllow entries: an empty list would reset the unit's DeviceAllow")
    await _call("SetUnitProperties", "sba(sv)", [unit, True, [device_allow_property(entries)]], timeout)


def set_device_allow(unit: str, entries, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Blocking form for the CLI and executor threads (runs its own short-lived event loop)."""
    asyncio.run(set_device_allow_async(unit, entries, timeout))


async def get_unit_async(unit: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    """The unit's object path (org.freedesktop.systemd1.NoSuchUnit as SystemdCallError)."""
    (obj,) = await _call("GetUnit", "s", [unit], timeout)
    return str(obj)


def get_unit(unit: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    return asyncio.run(get_unit_async(unit, timeout))


async def get_device_allow_async(unit: str, timeout: float = DEFAULT_TIMEOUT) -> list:
    """The scope's current DeviceAllow entries as [(path, access)]."""
    obj = await get_unit_async(unit, timeout)
    body = await _call("Get", "ss", [SCOPE, "DeviceAllow"], timeout, path=obj, interface=PROPERTIES)
    value = body[0].value if body else []
    return [(str(p), str(a)) for p, a in value]


def get_device_allow(unit: str, timeout: float = DEFAULT_TIMEOUT) -> list:
    return asyncio.run(get_device_allow_async(unit, timeout))
