"""The one systemd D-Bus client: the names, the call with its timeout and error policy, and the
connection a command (or the daemon's worker threads) reuses for every call.

Policy, the same for every caller:
  - every call has a timeout (CALL_TIMEOUT unless the caller passes its own); no reply in time, a
    connection that cannot be made or that closes under the call, and an error reply are all a
    SystemdCallError, which the caller sees: it either handles a named error it expects
    (`error_name`, e.g. NoSuchUnit: "not a systemd unit") or reports the failure. Nothing is turned
    into an empty answer here.
  - after a transport failure (timeout, closed connection) the connection is dropped; the next call
    makes a new one. A stuck connection is never reused.

`Client` is the blocking form for the CLI and for the daemon's worker threads: one connection, made on
first use, reused by every call of the process, on a private event loop in a thread of its own (so
callers in several threads pipeline their calls on that one connection, and a caller in a thread that
runs its own loop does not nest loops). The daemon's signal watch (systemd.bus) lives on the daemon's
loop and keeps its own connection there (its match rules and subscription belong to it); it uses the
names and `call` of this module.

The bus is DBUS_SYSTEM_BUS_ADDRESS when set (tests use a private bus), else the standard system bus
socket.
"""

from __future__ import annotations

import asyncio
import os
import threading

from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.systemd.deviceallow import DeviceAllow

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
SCOPE = "org.freedesktop.systemd1.Scope"
UNIT = "org.freedesktop.systemd1.Unit"
PROPERTIES = "org.freedesktop.DBus.Properties"
DBUS = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
DEFAULT_SYSTEM_BUS = "unix:path=/var/run/dbus/system_bus_socket"

CALL_TIMEOUT = 5.0  # seconds for one call (and for making the connection)
IN_FLIGHT = 32  # calls of one batch awaiting a reply at once (dbus-daemon caps pending replies per connection)


class SystemdCallError(NvsymlinkdError):
    """systemd refused the call (error_name set), or the bus could not be reached or did not answer in time
    (error_name None)."""

    exit_code = 1

    def __init__(self, message: str, error_name: str | None = None):
        super().__init__(message)
        self.error_name = error_name


def bus_address() -> str:
    return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS


def no_dbus_next(exc: ImportError) -> SystemdCallError:
    """dbus_next missing (an optional dependency, python3-dbus-next): no bus, said like any other."""
    return SystemdCallError(f"cannot talk to systemd: the Python module dbus_next is not importable ({exc}); "
                            "install python3-dbus-next (pip: dbus-next)")


async def open_bus():
    """The one way nvsymlinkd connects to the system bus (bus_address(): DBUS_SYSTEM_BUS_ADDRESS, else the
    standard socket): a connected dbus_next MessageBus; ImportError without dbus_next, any other exception
    for no bus. connect() below and the daemon's signal watch (systemd.bus) both come through here."""
    from dbus_next.aio import MessageBus

    return await MessageBus(bus_address=bus_address()).connect()


async def connect(timeout: float = CALL_TIMEOUT):
    """A connection to the system bus (dbus_next MessageBus), or SystemdCallError."""
    try:
        import dbus_next.aio  # noqa: F401 - absent: said as SystemdCallError, before any connection
    except ImportError as exc:
        raise no_dbus_next(exc)

    quiet_dropped_writes()
    try:
        return await asyncio.wait_for(open_bus(), timeout)
    except asyncio.TimeoutError:
        raise SystemdCallError(f"system bus at {bus_address()}: no connection within {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - socket missing, auth refused, ...: all mean "no bus"
        raise SystemdCallError(f"system bus at {bus_address()}: cannot connect ({exc}); "
                               "is dbus running (DBUS_SYSTEM_BUS_ADDRESS)?")


async def call(bus, member: str, signature: str = "", body=(), *, destination: str = SYSTEMD,
               path: str = SYSTEMD_PATH, interface: str = MANAGER, timeout: float = CALL_TIMEOUT) -> list:
    """One method call on a connected bus; the reply's body, or SystemdCallError."""
    from dbus_next import Message, MessageType

    msg = Message(destination=destination, path=path, interface=interface, member=member,
                  signature=signature, body=list(body))
    try:
        reply = await asyncio.wait_for(bus.call(msg), timeout)
    except asyncio.TimeoutError:
        raise SystemdCallError(f"{interface}.{member}: no reply from {destination} within {timeout:g} s")
    except (EOFError, OSError) as exc:  # dbus restarted under the call: the connection is gone
        raise SystemdCallError(f"{interface}.{member}: the system bus connection closed before "
                               f"{destination} replied ({type(exc).__name__}); is dbus restarting?")
    if reply is None:  # dbus_next returns None only for a call flagged NO_REPLY_EXPECTED: never sent here
        raise SystemdCallError(f"{interface}.{member}: no reply from {destination}")
    if reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply.body else ""
        if isinstance(detail, str):  # one line for the journal; a service may send a whole traceback
            lines = [ln.strip() for ln in detail.strip().splitlines() if ln.strip()]
            detail = lines[-1] if lines else ""
        raise SystemdCallError(f"{interface}.{member}: {reply.error_name}: {detail}", reply.error_name)
    return list(reply.body)


# ---------------------------------------------------------------------------
# the calls nvsymlinkd makes, on a connected bus


def device_allow_property(entries) -> list:
    """The a(sv) body element for DeviceAllow: entries are DeviceAllow (path, access) pairs."""
    from dbus_next import Variant

    return ["DeviceAllow", Variant("a(ss)", [list(DeviceAllow.of_pair(entry)) for entry in entries])]


async def get_unit(bus, unit: str, timeout: float = CALL_TIMEOUT) -> str:
    """The unit's object path (NoSuchUnit as SystemdCallError with error_name NO_SUCH_UNIT)."""
    (obj,) = await call(bus, "GetUnit", "s", [unit], timeout=timeout)
    return str(obj)


async def set_device_allow(bus, unit: str, entries, timeout: float = CALL_TIMEOUT) -> None:
    """SetUnitProperties(unit, runtime=true, [DeviceAllow=entries]): systemd appends the entries (the same
    path updates in place) and re-applies the unit's device policy at once; runtime=true keeps them for
    the unit's lifetime, across daemon-reloads, without a drop-in on disk."""
    entries = list(entries)
    if not entries:
        raise ValueError("no DeviceAllow entries: an empty list would reset the unit's DeviceAllow")
    await call(bus, "SetUnitProperties", "sba(sv)", [unit, True, [device_allow_property(entries)]],
               timeout=timeout)


async def set_device_policy(bus, unit: str, policy: str, entries, timeout: float = CALL_TIMEOUT) -> None:
    """SetUnitProperties(unit, runtime=true, [DevicePolicy=policy, DeviceAllow=[], DeviceAllow=entries]): the
    empty array resets the unit's list (systemd src/core/dbus-cgroup.c, bus_cgroup_set_property, "DeviceAllow":
    n == 0 frees every entry), the entries follow in the same call, so systemd re-applies the policy once, as
    it was. A repair that narrowed puts the scope back with it."""
    from dbus_next import Variant

    props = [["DevicePolicy", Variant("s", str(policy))], device_allow_property([])]
    entries = list(entries)
    if entries:
        props.append(device_allow_property(entries))
    await call(bus, "SetUnitProperties", "sba(sv)", [unit, True, props], timeout=timeout)


async def get_device_allow(bus, unit: str, timeout: float = CALL_TIMEOUT) -> list:
    """The scope's current DeviceAllow entries: [DeviceAllow]."""
    obj = await get_unit(bus, unit, timeout)
    body = await call(bus, "Get", "ss", [SCOPE, "DeviceAllow"], path=obj, interface=PROPERTIES, timeout=timeout)
    value = body[0].value if body else []
    return [DeviceAllow.of_pair(pair) for pair in value]


async def _unit_get(bus, unit: str, name: str, timeout: float) -> list | None:
    """The reply body of Get(org.freedesktop.systemd1.Unit, name) on the unit; None when systemd does not
    know the unit (NoSuchUnit)."""
    try:
        obj = await get_unit(bus, unit, timeout)
    except SystemdCallError as exc:
        if exc.error_name == NO_SUCH_UNIT:
            return None
        raise
    return await call(bus, "Get", "ss", [UNIT, name], path=obj, interface=PROPERTIES, timeout=timeout)


async def invocation_id(bus, unit: str, timeout: float = CALL_TIMEOUT) -> str | None:
    """The unit's InvocationID (16 bytes, new each time systemd starts the unit) as 32 hex digits; None
    when systemd does not know the unit or names no InvocationID."""
    body = await _unit_get(bus, unit, "InvocationID", timeout)
    value = bytes(body[0].value) if body else b""
    return value.hex() if len(value) == 16 and any(value) else None


async def dropin_paths(bus, unit: str, timeout: float = CALL_TIMEOUT) -> list | None:
    """The drop-ins systemd read when it last loaded the unit (Unit.DropInPaths); None when it does not know
    the unit."""
    body = await _unit_get(bus, unit, "DropInPaths", timeout)
    if body is None:
        return None
    return [str(p) for p in body[0].value] if body else []


async def scope_properties(bus, scopes, timeout: float = CALL_TIMEOUT) -> dict:
    """scope -> its org.freedesktop.systemd1.Scope properties ({name: Variant}), or None for a scope
    systemd does not know (NoSuchUnit). Every scope asked at once, the calls pipelined on the one
    connection (at most IN_FLIGHT awaiting a reply): two round trips for the batch, not two per scope,
    which a loaded host (or a VM under emulation) pays for dearly. Any other failure: SystemdCallError."""
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(scope: str):
        async with slots:
            try:
                obj = await get_unit(bus, scope, timeout)
            except SystemdCallError as exc:
                if exc.error_name == NO_SUCH_UNIT:
                    return scope, None
                raise
            (props,) = await call(bus, "GetAll", "s", [SCOPE], path=obj, interface=PROPERTIES, timeout=timeout)
        return scope, props

    tasks = [asyncio.ensure_future(one(s)) for s in scopes]
    try:
        return dict(await asyncio.gather(*tasks))
    finally:
        for t in tasks:  # the first failure ends the batch: the others are not left running
            t.cancel()


# ---------------------------------------------------------------------------
# the blocking client


class Client:
    """One connection to the system bus, made on first use and reused by every call (from any thread)
    until a transport failure drops it. Its event loop runs in a daemon thread of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._bus = None
        self._connecting: asyncio.Lock | None = None
        self.connections = 0  # made so far (a test and the report's figure count them)
        # once_only(): the first transport failure (no connection, no reply in time) is kept and every
        # later call fails with it at once, without a new wait (a package script's one bounded wait)
        self.sticky = False
        self.failed: SystemdCallError | None = None

    def once_only(self) -> None:
        """From now on, one transport failure ends this client's use of the bus: a command that asks systemd
        about many containers (`repair --before-reload`, run by apt or dnf) waits for a hung bus once
        (CALL_TIMEOUT), not once per container, and the callers fall back to systemd's unit files."""
        self.sticky = True

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                try:
                    import dbus_next.aio  # noqa: F401 - imported here, not on the loop (a 0.3 s import stalls no call)
                except ImportError as exc:
                    raise no_dbus_next(exc)

                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    quiet_dropped_writes_on(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=main, name="nvsymlinkd-dbus", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def run(self, op, timeout: float = CALL_TIMEOUT):
        """op(bus) -> coroutine, run on the client's loop with its connection; its result or its
        SystemdCallError. The whole operation is bounded (a batch by a few timeouts)."""
        if self.failed is not None:
            raise SystemdCallError(f"{self.failed} (not asked again)")
        try:
            loop = self._start()
            future = asyncio.run_coroutine_threadsafe(self._with_bus(op, timeout), loop)
            return future.result()
        except SystemdCallError as exc:
            if self.sticky and exc.error_name is None:
                self.failed = exc
            raise

    async def _bus_now(self, timeout: float):
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # callers in several threads: one connection, not one each
            if self._bus is None or not self._bus.connected:
                self._bus = await connect(timeout)
                self.connections += 1
            return self._bus

    async def _with_bus(self, op, timeout: float):
        bus = await self._bus_now(timeout)
        try:
            return await op(bus)
        except SystemdCallError as exc:
            if exc.error_name is None and self._bus is bus:  # timed out or closed: never reuse it
                self._bus = None
                await close(bus)
            raise

    def get_unit(self, unit: str, timeout: float = CALL_TIMEOUT) -> str:
        return self.run(lambda bus: get_unit(bus, unit, timeout), timeout)  # type: ignore[no-any-return]

    def set_device_allow(self, unit: str, entries, timeout: float = CALL_TIMEOUT) -> None:
        entries = list(entries)
        if not entries:
            raise ValueError("no DeviceAllow entries: an empty list would reset the unit's DeviceAllow")
        self.run(lambda bus: set_device_allow(bus, unit, entries, timeout), timeout)

    def set_device_policy(self, unit: str, policy: str, entries, timeout: float = CALL_TIMEOUT) -> None:
        entries = list(entries)
        self.run(lambda bus: set_device_policy(bus, unit, policy, entries, timeout), timeout)

    def get_device_allow(self, unit: str, timeout: float = CALL_TIMEOUT) -> list:
        return self.run(lambda bus: get_device_allow(bus, unit, timeout), timeout)  # type: ignore[no-any-return]

    def invocation_id(self, unit: str, timeout: float = CALL_TIMEOUT) -> str | None:
        return self.run(lambda bus: invocation_id(bus, unit, timeout), timeout)  # type: ignore[no-any-return]

    def dropin_paths(self, unit: str, timeout: float = CALL_TIMEOUT) -> list | None:
        return self.run(lambda bus: dropin_paths(bus, unit, timeout), timeout)  # type: ignore[no-any-return]

    def scope_properties(self, scopes, timeout: float = CALL_TIMEOUT) -> dict:
        scopes = list(scopes)
        return self.run(lambda bus: scope_properties(bus, scopes, timeout), timeout)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Disconnect and stop the loop (a later call starts both again)."""
        with self._lock:
            loop, self._loop = self._loop, None
            thread, self._thread = self._thread, None
        if loop is None:
            return
        bus, self._bus = self._bus, None
        if bus is not None:
            asyncio.run_coroutine_threadsafe(close(bus), loop).result()
        self._connecting = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        loop.close()


_shared: Client | None = None
_shared_lock = threading.Lock()


def shared() -> Client:
    """The process's client: one connection for the command, or for the daemon's worker threads."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Client()
        return _shared


def reset_shared() -> None:
    """Close the process's client (tests that start and stop buses; a later call makes a new one)."""
    global _shared
    with _shared_lock:
        client, _shared = _shared, None
    if client is not None:
        client.close()


# ---------------------------------------------------------------------------
# connection housekeeping


def quiet_dropped_writes() -> None:
    """quiet_dropped_writes_on(the running loop)."""
    quiet_dropped_writes_on(asyncio.get_running_loop())


def quiet_dropped_writes_on(loop) -> None:
    """On this loop: a write dbus_next makes on a connection the bus has just dropped
    (dbus restarted) fails with BrokenPipeError/ConnectionResetError into a future its own call
    path never awaits (MessageBus._call discards send()'s future), so asyncio logs "Future
    exception was never retrieved" with a traceback when that future is collected (chaos soak,
    seed 20: dbus-restart then a module reload). The drop itself is handled where it is awaited:
    the watch's disconnect (bus-lost, reconnect), a call's SystemdCallError. Any other exception
    handler already set, and tasks, keep the default."""
    if loop.get_exception_handler() is None:
        loop.set_exception_handler(_dropped_write_handler)


def _dropped_write_handler(loop, context: dict) -> None:
    future = context.get("future")
    if (isinstance(context.get("exception"), (ConnectionError, EOFError)) and future is not None
            and not isinstance(future, asyncio.Task)
            and str(context.get("message", "")).endswith("exception was never retrieved")):
        return
    loop.default_exception_handler(context)


def disconnect(bus) -> None:
    try:
        bus.disconnect()
    except Exception:  # noqa: BLE001 - already closed by the other side
        pass


async def close(bus, timeout: float = 1.0) -> None:
    """Disconnect a connection and collect how it ended. A connection the other side
    dropped (dbus restarted mid-call) keeps its EOFError in dbus_next's disconnect future; nobody
    else awaits it, so asyncio would log it, traceback and all, when the future is collected."""
    disconnect(bus)
    try:
        await asyncio.wait_for(bus.wait_for_disconnect(), timeout)
    except Exception:  # noqa: BLE001 - the dropped connection's error, or no EOF in time: closed either way
        pass
