"""systemd on the system bus: reloads, re-execs and container scopes.

- `Reloading(b)` from org.freedesktop.systemd1.Manager: false marks the end
  of a daemon-reload, the moment systemd has re-applied every unit's device
  policy (broadcast, no Subscribe needed).
- `NameOwnerChanged` for org.freedesktop.systemd1: a daemon-reexec drops PID
  1's connection and brings it back under a new unique name; the new owner
  means the re-exec finished (and re-applied device policies too).
- After `Subscribe()`: `UnitNew`/`JobRemoved` for container scopes.

Match rules and a message handler only: no introspection of the live
service, so this works against any systemd (and against a mock). Signals
are accepted only from the current unique owner of org.freedesktop.systemd1:
anyone on the bus can emit a signal, only systemd can own that name.

The bus being absent or dropping is logged once; everything else keeps
working and this reconnects with exponential backoff.
"""

from __future__ import annotations

import asyncio
import os
import re

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
DBUS = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"

MATCH_MANAGER = f"type='signal',sender='{SYSTEMD}',path='{SYSTEMD_PATH}',interface='{MANAGER}'"
MATCH_OWNER = (f"type='signal',sender='{DBUS}',path='{DBUS_PATH}',interface='{DBUS}',"
               f"member='NameOwnerChanged',arg0='{SYSTEMD}'")

CONTAINER_SCOPE = re.compile(r"(docker|cri-containerd|crio|libpod|runc)-[A-Za-z0-9][A-Za-z0-9_.:@-]{0,250}\.scope")
DEFAULT_SYSTEM_BUS = "unix:path=/var/run/dbus/system_bus_socket"


def is_container_scope(unit: str) -> bool:
    # crio-conmon-<id>.scope holds CRI-O's monitor process, not a container
    return bool(CONTAINER_SCOPE.fullmatch(unit)) and not unit.startswith("crio-conmon-")


def bus_address() -> str:
    return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS


class SystemdWatch:
    """Calls back into the daemon; every callback is a plain function that must not block.

    on_reload(why): a reload or re-exec finished ("reload", "reexec").
    on_reload_start(): systemd announced a daemon-reload (Reloading(true)).
    on_scope(unit): a container scope appeared (once per unit until it is removed).
    on_bus(state): "connected", "lost" (for the status line).
    """

    def __init__(self, journal, on_reload, on_scope, on_bus=None,
                 backoff_start: float = 0.5, backoff_max: float = 60.0, connect_timeout: float = 10.0,
                 on_reload_start=None):
        self.journal = journal
        self.on_reload = on_reload
        self.on_reload_start = on_reload_start or (lambda: None)
        self.on_scope = on_scope
        self.on_bus = on_bus or (lambda state: None)
        self.backoff_start = backoff_start
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self.bus = None
        self.owner: str | None = None  # unique name of systemd on the bus
        self.scopes: set = set()
        self._lost = False  # a loss was reported and not yet followed by "regained"
        self._tasks: set = set()

    async def run(self) -> None:
        from dbus_next import BusType
        from dbus_next.aio import MessageBus

        delay = self.backoff_start
        while True:
            try:
                bus = await asyncio.wait_for(MessageBus(bus_type=BusType.SYSTEM).connect(), self.connect_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to connect means "no bus now"
                if not self._lost:
                    self._lost = True
                    self.on_bus("lost")
                    self.journal.event("bus-lost", 4, f"system bus not reachable at {bus_address()} ({_why(exc)}); "
                                       "links are still kept in sync; retrying in the background")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max)
                continue
            delay = self.backoff_start
            self.bus = bus
            try:
                await self._setup(bus)
            except asyncio.CancelledError:
                _disconnect(bus)
                raise
            except Exception as exc:  # noqa: BLE001 - the bus died during setup: treat as a drop
                self.journal.debug(f"system bus setup failed: {_why(exc)}")
            else:
                if self._lost:
                    self._lost = False
                    self.journal.event("bus-regained", 6, f"connected to the system bus at {bus_address()} again; "
                                       "resyncing in case a reload was missed")
                    self.on_reload("bus regained")
                else:
                    self.journal.info(f"watching systemd on the system bus at {bus_address()}")
                self.on_bus("connected")
                try:
                    await bus.wait_for_disconnect()
                except asyncio.CancelledError:
                    _disconnect(bus)
                    raise
                except Exception:  # noqa: BLE001 - a disconnect with an error is still a disconnect
                    pass
            self.bus = None
            self.owner = None
            _disconnect(bus)
            if not self._lost:
                self._lost = True
                self.on_bus("lost")
                self.journal.event("bus-lost", 4, "lost the system bus; links are still kept in sync; reconnecting")
            await asyncio.sleep(delay)

    async def _setup(self, bus) -> None:
        bus.add_message_handler(self._on_message)
        for rule in (MATCH_OWNER, MATCH_MANAGER):
            await self._call(bus, DBUS, DBUS_PATH, DBUS, "AddMatch", "s", [rule])
        reply = await self._call(bus, DBUS, DBUS_PATH, DBUS, "GetNameOwner", "s", [SYSTEMD], check=False)
        if reply is not None:
            self.owner = reply.body[0]
            await self._subscribe(bus)
        else:
            self.journal.notice(f"{SYSTEMD} is not on the system bus yet; waiting for it")

    async def _subscribe(self, bus) -> None:
        if await self._call(bus, SYSTEMD, SYSTEMD_PATH, MANAGER, "Subscribe", "", [], check=False) is None:
            self.journal.notice("systemd refused Subscribe(); reloads are still seen, container scopes are not")

    async def _call(self, bus, dest, path, iface, member, sig, body, check=True):
        from dbus_next import Message, MessageType

        reply = await bus.call(Message(destination=dest, path=path, interface=iface, member=member,
                                       signature=sig, body=body))
        if reply.message_type == MessageType.ERROR:
            if check:
                raise RuntimeError(f"{member}: {reply.error_name}: {reply.body[0] if reply.body else ''}")
            return None
        return reply

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_message(self, msg):
        from dbus_next import MessageType

        if msg.message_type != MessageType.SIGNAL:
            return None
        if msg.interface == DBUS and msg.member == "NameOwnerChanged" and msg.sender == DBUS:
            if msg.signature == "sss" and msg.body[0] == SYSTEMD:
                self._owner_changed(msg.body[1], msg.body[2])
            return None
        if msg.interface != MANAGER or msg.path != SYSTEMD_PATH or msg.sender != self.owner or not self.owner:
            return None
        if msg.member == "Reloading" and msg.signature == "b":
            if msg.body[0]:
                self.journal.debug("systemd reload started: resyncing links")
                self.on_reload_start()
            else:
                self.journal.event("reload-seen", 6, "systemd finished a daemon-reload: resyncing links",
                                   action="reload")
                self.on_reload("reload")
        elif msg.member == "UnitNew" and msg.signature == "so":
            self._scope(msg.body[0])
        elif msg.member == "JobRemoved" and msg.signature == "uoss":
            if msg.body[3] == "done":
                self._scope(msg.body[2])
        elif msg.member == "UnitRemoved" and msg.signature == "so":
            self.scopes.discard(msg.body[0])
        return None

    def _owner_changed(self, old: str, new: str) -> None:
        self.owner = new or None
        if not new:
            self.journal.notice("systemd left the system bus (daemon-reexec in progress?)")
            return
        self.journal.event("systemd-restarted", 5, "systemd is (back) on the system bus (daemon-reexec finished?): "
                           "resyncing links", action="reexec")
        self.scopes.clear()  # a re-exec'ed systemd announces units again
        if self.bus is not None:
            self._spawn(self._subscribe_quietly(self.bus))
        self.on_reload("reexec")

    async def _subscribe_quietly(self, bus) -> None:
        # A re-exec'ed systemd takes its bus name before it is done deserializing and may refuse
        # Subscribe() for a moment: retry for about 30 s before giving up on scope signals.
        delay = 0.1
        for _ in range(12):
            try:
                reply = await self._call(bus, SYSTEMD, SYSTEMD_PATH, MANAGER, "Subscribe", "", [], check=False)
            except Exception as exc:  # noqa: BLE001 - the bus may drop right now; run() handles that
                self.journal.debug(f"Subscribe() after re-exec failed: {_why(exc)}")
                return
            if reply is not None:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        self.journal.notice("systemd refused Subscribe() after re-exec; reloads are still seen, new container "
                            "scopes only at the next resync")

    def _scope(self, unit: str) -> None:
        if not is_container_scope(unit) or unit in self.scopes:
            return
        if len(self.scopes) > 100000:  # never grow without bound if UnitRemoved is missed
            self.scopes.clear()
        self.scopes.add(unit)
        self.on_scope(unit)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.bus is not None:
            _disconnect(self.bus)
            self.bus = None


def _disconnect(bus) -> None:
    try:
        bus.disconnect()
    except Exception:  # noqa: BLE001 - already closed by the other side
        pass


async def close(bus, timeout: float = 1.0) -> None:
    """Disconnect a short-lived connection and collect how it ended. A connection the other side
    dropped (dbus restarted mid-call) keeps its EOFError in dbus_next's disconnect future; nobody
    else awaits it, so asyncio would log it, traceback and all, when the future is collected."""
    _disconnect(bus)
    try:
        await asyncio.wait_for(bus.wait_for_disconnect(), timeout)
    except Exception:  # noqa: BLE001 - the dropped connection's error, or no EOF in time: closed either way
        pass


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
