"""What systemd will re-apply on the next daemon-reload: a container scope's DeviceAllow.

Sources, best first:
  1. D-Bus: org.freedesktop.systemd1.Scope.DeviceAllow/DevicePolicy of the
     unit (live value; DBUS_SYSTEM_BUS_ADDRESS honoured; short timeouts).
  2. Files systemd writes for transient units: /run/systemd/transient/<scope>,
     then its drop-ins in name order: SetUnitProperties on a transient unit
     writes them beside it, /run/systemd/transient/<scope>.d/*.conf (systemd's
     unit_drop_in_dir: "drop-ins for transient units always into the transient
     directory"; the VM's s03 reads them there), and /run/systemd/system.control/
     <scope>.d/*.conf, the runtime control directory, which wins where both
     hold one name; an empty `DeviceAllow=` resets the list.
Neither -> None: the caller reports `unknown` for this check.

Entry forms (REFERENCE.md): `/dev/char/M:m` (parsed without stat by systemd
>= 240), `char-M` / `char-NAME` (NAME matched against /proc/devices),
`char-*`, block equivalents, or a plain /dev path that systemd stats.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import re
import stat
import time
from dataclasses import dataclass

from nvsymlinkd.containers.ocispec import MAX_SMALL_BYTES, read_bounded
from nvsymlinkd.host.devices import LETTERS, RWM, Access, Device, Rule
from nvsymlinkd.host.procdevices import decimal
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd.bus import close, quiet_dropped_writes

TRANSIENT_DIR = "/run/systemd/transient"
CONTROL_DIR = "/run/systemd/system.control"
SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
SCOPE_IFACE = "org.freedesktop.systemd1.Scope"
BUS_TIMEOUT = 1.0  # seconds per call; the whole query is bounded by BUS_TOTAL
BUS_TOTAL = 3.0
BUS_IN_FLIGHT = 32  # calls awaiting a reply at once (dbus-daemon limits pending replies per connection)
DEV_NUMBER_PATH = re.compile(r"/dev/(char|block)/(\d+):(\d+)")
SCOPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,250}\.scope")


@dataclass(frozen=True)
class ScopeDevices:
    scope: str
    source: str  # "dbus" or "files"
    policy: str  # auto, closed, strict
    entries: tuple  # (specifier, access) as systemd holds them
    rules: tuple  # Rule (allow) for the entries we could map to numbers
    unmapped: tuple = ()  # entries we could not map (plain paths that do not resolve, ...)

    def covers(self, device: Device, access: str) -> bool:
        """Would systemd's next apply allow this access? (one entry must cover every letter)"""
        if self.policy == "auto" and not self.entries:
            return True  # no device restriction at all
        return any(r.covers(device, access) for r in self.rules)


def unit_settings(text: str) -> tuple:
    """The DevicePolicy=/DeviceAllow= settings of one unit file or drop-in, in order: ("policy", value),
    ("allow", (spec, access)), or ("allow", None) for an empty DeviceAllow= (which resets the list)."""
    out: list = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;[":
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        if key == "DevicePolicy":
            out.append(("policy", value or "auto"))
        elif key == "DeviceAllow":
            if not value:
                out.append(("allow", None))
                continue
            spec, _, access = value.partition(" ")
            out.append(("allow", (spec, access.strip() or RWM)))
    return tuple(out)


def _apply_settings(settings: tuple, entries: list, policy: list) -> None:
    for key, value in settings:
        if key == "policy":
            policy[:] = [value]
        elif value is None:
            entries.clear()
        else:
            entries.append(value)


def read_scope_files(root: HostRoot, scope: str, files=None) -> ScopeDevices | None:
    """The scope's DeviceAllow from its transient unit file and system.control drop-ins.

    files: a verify.cache.FileCache: each file parsed again only when its identity changed, the
    drop-in directory listed again only when it changed (the daemon's pass; `check` reads afresh).
    """
    if not SCOPE_NAME.fullmatch(scope):
        return None
    entries: list = []
    policy = ["auto"]
    found = False

    def settings_of(inside: str) -> tuple:
        if files is not None:
            return files.load(root.path(inside), unit_settings, MAX_SMALL_BYTES, str)  # type: ignore[no-any-return]
        return unit_settings(read_bounded(root.path(inside), MAX_SMALL_BYTES).decode("utf-8", "replace"))

    try:
        _apply_settings(settings_of(f"{TRANSIENT_DIR}/{scope}"), entries, policy)
        found = True
    except OSError:
        pass
    # one name in both directories: the one earlier in systemd's search path (system.control) is used
    dropins: dict = {}
    for folder in (f"{TRANSIENT_DIR}/{scope}.d", f"{CONTROL_DIR}/{scope}.d"):
        if files is not None:
            listed = files.names(root.path(folder))
        else:
            try:
                listed = os.listdir(root.path(folder))
            except OSError:
                listed = None
        dropins.update((n, f"{folder}/{n}") for n in listed or () if n.endswith(".conf"))
    for name in sorted(dropins)[:256]:
        try:
            settings = settings_of(dropins[name])
        except OSError:
            continue
        _apply_settings(settings, entries, policy)
        found = True
    if not found:
        return None
    return ScopeDevices(scope, "files", policy[0], tuple(entries), (), ())


def map_entries(root: HostRoot, sd: ScopeDevices, majors) -> ScopeDevices:
    """Turn systemd's device specifiers into numeric allow rules."""
    rules, unmapped = [], []
    for spec, access in sd.entries:
        access = Access("".join(c for c in access if c in LETTERS))  # letters beyond rwm grant nothing
        rule = _map_one(root, spec, access, majors)
        if rule is None:
            unmapped.append(f"{spec} {access}")
        else:
            rules.extend(rule)
    return ScopeDevices(sd.scope, sd.source, sd.policy, sd.entries, tuple(rules), tuple(unmapped))


def _map_one(root: HostRoot, spec: str, access: Access, majors) -> list | None:
    m = DEV_NUMBER_PATH.fullmatch(spec)
    if m:
        # the kernel's ranges (12-bit major, 20-bit minor); beyond them no device, and no int() of 5,000 digits
        major, minor = decimal(m.group(2), (1 << 12) - 1), decimal(m.group(3), (1 << 20) - 1)
        if major is None or minor is None:
            return None
        return [Rule(True, "c" if m.group(1) == "char" else "b", major, minor, access)]
    for prefix, dev_type in (("char-", "c"), ("block-", "b")):
        if spec.startswith(prefix):
            name = spec[len(prefix):]
            if name == "*":
                return [Rule(True, dev_type, None, None, access)]
            if name.isdigit():
                major = decimal(name, (1 << 12) - 1)
                return None if major is None else [Rule(True, dev_type, major, None, access)]
            if dev_type == "b":
                return []  # not an NVIDIA device either way
            hits = sorted({m for n, m in majors.pairs if fnmatch.fnmatchcase(n, name)})
            return [Rule(True, "c", major, None, access) for major in hits]
    if spec.startswith("/dev/"):
        st = root.stat_resolved(spec)  # systemd stats these at apply time
        if st is None or not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            return None
        dev_type = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return [Rule(True, dev_type, os.major(st.st_rdev), os.minor(st.st_rdev), access)]
    return None


def bus_allowed(root: HostRoot) -> bool:
    """Ask the live systemd only for the real host, or when a bus address is given explicitly."""
    return root.is_real_root or bool(os.environ.get("DBUS_SYSTEM_BUS_ADDRESS"))


def read_scopes_bus(scopes, address: str | None = None) -> dict:
    """scope -> ScopeDevices for the scopes systemd knows; {} when the bus is absent or slow."""
    scopes = [s for s in scopes if SCOPE_NAME.fullmatch(s)]
    if not scopes:
        return {}
    try:
        asyncio.get_running_loop()
        return {}  # inside the daemon's loop: it has its own connection; files are the fallback here
    except RuntimeError:
        pass
    try:
        return asyncio.run(asyncio.wait_for(_query(scopes, address), BUS_TOTAL))
    except Exception:  # noqa: BLE001 - no bus, refused, timed out: the files are the fallback
        return {}


async def _query(scopes, address) -> dict:
    from dbus_next.aio import MessageBus

    if address is None:
        address = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "unix:path=/var/run/dbus/system_bus_socket"
    quiet_dropped_writes()
    bus = await asyncio.wait_for(MessageBus(bus_address=address).connect(), BUS_TIMEOUT)
    try:
        # every scope asked at once (the calls pipelined on one connection): two round trips per
        # pass, not two per scope, which a loaded host (or a VM under emulation) pays for dearly
        # (at most BUS_IN_FLIGHT at a time: the system bus caps a connection's pending replies)
        slots = asyncio.Semaphore(BUS_IN_FLIGHT)
        found = await asyncio.gather(*(_scope_devices(bus, scope, slots) for scope in scopes))
    finally:
        await close(bus)
    return {sd.scope: sd for sd in found if sd is not None}


async def _scope_devices(bus, scope: str, slots: asyncio.Semaphore):
    """ScopeDevices of one scope from systemd, or None when systemd does not know it."""
    from dbus_next import Message, MessageType

    async with slots:
        reply = await asyncio.wait_for(bus.call(Message(
            destination=SYSTEMD, path=SYSTEMD_PATH, interface=MANAGER, member="GetUnit",
            signature="s", body=[scope])), BUS_TIMEOUT)
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:  # None: never, a reply is expected
            return None  # NoSuchUnit: not a systemd-managed container
        reply = await asyncio.wait_for(bus.call(Message(
            destination=SYSTEMD, path=reply.body[0], interface="org.freedesktop.DBus.Properties",
            member="GetAll", signature="s", body=[SCOPE_IFACE])), BUS_TIMEOUT)
    if reply is None or reply.message_type != MessageType.METHOD_RETURN:
        return None
    props = reply.body[0]
    allow = props.get("DeviceAllow")
    policy = props.get("DevicePolicy")
    if allow is None:
        return None
    entries = tuple((str(p), str(a)) for p, a in allow.value)
    return ScopeDevices(scope, "dbus", str(policy.value) if policy is not None else "auto", entries, ())


async def _read_policy(bus, path: str, scope: str) -> ScopeDevices | None:
    """DevicePolicy and DeviceAllow of the scope at object path `path`, two Gets pipelined (small
    replies: a GetAll of a scope carries every cgroup property, and this is asked again and again)."""
    from dbus_next import Message, MessageType

    def get(name: str) -> Message:
        return Message(destination=SYSTEMD, path=path, interface="org.freedesktop.DBus.Properties",
                       member="Get", signature="ss", body=[SCOPE_IFACE, name])
    policy, allow = await asyncio.gather(*(asyncio.wait_for(bus.call(get(n)), BUS_TIMEOUT)
                                           for n in ("DevicePolicy", "DeviceAllow")))
    if any(r is None or r.message_type != MessageType.METHOD_RETURN for r in (policy, allow)):
        return None  # the unit went away (or is no scope)
    entries = tuple((str(p), str(a)) for p, a in allow.body[0].value)
    return ScopeDevices(scope, "dbus", str(policy.body[0].value), entries, ())


async def _poll_bus(scope: str, ready, timeout: float, interval: float, address: str | None):
    """(ScopeDevices or None, polls) over one connection: asked until ready(sd) or timeout."""
    from dbus_next import Message, MessageType
    from dbus_next.aio import MessageBus

    if address is None:
        address = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "unix:path=/var/run/dbus/system_bus_socket"
    quiet_dropped_writes()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    bus = await asyncio.wait_for(MessageBus(bus_address=address).connect(), BUS_TIMEOUT)
    try:
        reply = await asyncio.wait_for(bus.call(Message(
            destination=SYSTEMD, path=SYSTEMD_PATH, interface=MANAGER, member="GetUnit",
            signature="s", body=[scope])), BUS_TIMEOUT)
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            return None, 1
        path, polls = reply.body[0], 0
        while True:
            sd = await _read_policy(bus, path, scope)
            polls += 1
            if sd is None or ready(sd) or loop.time() >= deadline:
                return sd, polls
            await asyncio.sleep(interval)
    finally:
        await close(bus)


def wait_for_scope(root: HostRoot, scope: str, ready, timeout: float, interval: float,
                   use_bus: bool | None = None) -> tuple:
    """(ScopeDevices, unmapped, or None when neither source knows the scope; polls) read again every
    `interval` seconds until ready(ScopeDevices) is true or `timeout` has passed: a scope the runtime is
    still setting up (containers.early). D-Bus on one connection (the live values), else systemd's files;
    a bus that fails midway leaves the files for the time that is left."""
    if not SCOPE_NAME.fullmatch(scope):
        return None, 0
    if use_bus is None:
        use_bus = bus_allowed(root)
    start = time.monotonic()
    if use_bus:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # (a thread with no loop: the daemon's executor, the CLI)
            try:
                sd, polls = asyncio.run(_poll_bus(scope, ready, timeout, interval, None))
                if sd is not None:
                    return sd, polls
            except Exception:  # noqa: BLE001 - no bus, refused, timed out: the files are the fallback
                pass
    polls = 0
    while True:
        sd = read_scope_files(root, scope)
        polls += 1
        if sd is None or ready(sd) or time.monotonic() - start >= timeout:
            return sd, polls
        time.sleep(interval)


def _by_number(sd: ScopeDevices) -> bool:
    """Every entry maps without looking at the host (/dev/char/M:m, char-*, char-NAME by /proc/devices)."""
    return all(DEV_NUMBER_PATH.fullmatch(spec) or spec.startswith(("char-", "block-")) for spec, _ in sd.entries)


def read_scopes(root: HostRoot, scopes, majors, use_bus: bool | None = None, cache=None) -> dict:
    """scope -> ScopeDevices (numeric rules mapped) or None when neither source knows it.

    cache: a verify.cache.VerifyCache: the same entries and /proc/devices map to the same rules (a plain
    /dev path is stat'ed every time).
    """
    scopes = sorted(set(s for s in scopes if s))
    if use_bus is None:
        use_bus = bus_allowed(root)
    live = read_scopes_bus(scopes) if use_bus else {}
    out: dict = {}
    for scope in scopes:
        sd = live.get(scope) or read_scope_files(root, scope, cache.files if cache is not None else None)
        if sd is None:
            out[scope] = None
        elif cache is not None and _by_number(sd):
            out[scope] = cache.memo("scope", scope, (sd, majors.pairs), lambda sd=sd: map_entries(root, sd, majors))[0]
        else:
            out[scope] = map_entries(root, sd, majors)
    return out
