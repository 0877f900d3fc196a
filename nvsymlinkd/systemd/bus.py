"""systemd on the system bus: reloads, re-execs and container scopes.

- `Reloading(b)` from org.freedesktop.systemd1.Manager: false marks the end
  of a daemon-reload, the moment systemd has re-applied every unit's device
  policy (broadcast, no Subscribe needed).
- `NameOwnerChanged` for org.freedesktop.systemd1: a daemon-reexec drops PID
  1's connection and brings it back under a new unique name; the new owner
  means the re-exec finished (and re-applied device policies too).
- After `Subscribe()`: `UnitNew`/`JobRemoved` for container scopes. systemd keeps
  its subscribers across a daemon-reexec (they are serialized with its state and
  restored before it serves the bus again), so after a re-exec Subscribe()
  answers `AlreadySubscribed`: that is a subscription, not a refusal.
- A daemon-reload frees and re-creates every unit (src/core/manager.c, manager_reload):
  subscribers see UnitRemoved then UnitNew for each scope, same name, same cgroup and
  invocation; a re-exec re-announces them too. A scope removed while systemd reloads
  (or is off the bus) and announced again is the same scope, not a new one.

Match rules and a message handler only: no introspection of the live
service, so this works against any systemd (and against a mock). Signals
are accepted only from the current unique owner of org.freedesktop.systemd1:
anyone on the bus can emit a signal, only systemd can own that name.

The bus being absent or dropping is logged once; everything else keeps
working and this reconnects with exponential backoff.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # dbus_next is imported when the watch starts (an optional dependency)
    from dbus_next.aio import MessageBus

from nvsymlinkd.containers.runtimes import is_container_scope  # the runtime table's scope names
from nvsymlinkd.systemd.client import (
    DBUS,
    DBUS_PATH,
    MANAGER,
    SYSTEMD,
    SYSTEMD_PATH,
    SystemdCallError,
    bus_address,
    call,
    disconnect,
    open_bus,
    quiet_dropped_writes,
)

MATCH_MANAGER = f"type='signal',sender='{SYSTEMD}',path='{SYSTEMD_PATH}',interface='{MANAGER}'"
MATCH_OWNER = (f"type='signal',sender='{DBUS}',path='{DBUS_PATH}',interface='{DBUS}',"
               f"member='NameOwnerChanged',arg0='{SYSTEMD}'")

# A scope removed during a reload or re-exec counts as the same scope when it is announced again
# within this long (systemd re-announces every unit as it finishes); later it is new.
REANNOUNCE_SECONDS = 60.0
# systemd's answer to a second Subscribe() from the same client (src/core/dbus-manager.c)
ALREADY_SUBSCRIBED = "org.freedesktop.systemd1.AlreadySubscribed"
# The watch's own calls wait longer than a repair's: systemd answers nothing while it reloads (10-20 s in
# an emulated guest), and a Subscribe() that waits out a reload is not a lost bus. dbus-daemon itself
# answers NoReply after 25 s.
WATCH_TIMEOUT = 30.0


class SystemdWatch:
    """Calls back into the daemon; every callback is a plain function that must not block.

    on_reload(why): a reload or re-exec finished ("reload", "reexec").
    on_reload_start(): systemd announced a daemon-reload (Reloading(true)).
    on_scope(unit): a container scope appeared (once per unit until it is removed).
    on_scope_again(unit): a container scope known already was announced again (a reload or re-exec
        re-announces every unit; a scope of the same name that replaced it looks the same here).
    on_scope_gone(unit): systemd dropped a container scope (UnitRemoved outside a reload: a reload's
        UnitRemoved/UnitNew pair between Reloading(true) and Reloading(false) is the same scope).
    on_bus(state): "connected", "lost" (for the status line).
    """

    def __init__(self, journal, on_reload, on_scope, on_bus=None,
                 backoff_start: float = 0.5, backoff_max: float = 60.0, connect_timeout: float = 10.0,
                 on_reload_start=None, on_scope_gone=None, on_scope_again=None):
        self.journal = journal
        self.on_reload = on_reload
        self.on_reload_start = on_reload_start or (lambda: None)
        self.on_scope = on_scope
        self.on_scope_gone = on_scope_gone or (lambda unit: None)
        self.on_scope_again = on_scope_again or (lambda unit: None)
        self.on_bus = on_bus or (lambda state: None)
        self.backoff_start = backoff_start
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self.bus: MessageBus | None = None
        self.owner: str | None = None  # unique name of systemd on the bus
        self.scopes: set = set()
        self.reloading = False  # between Reloading(true) and Reloading(false)
        self._held: dict = {}  # scope -> monotonic time it was removed during a reload or re-exec
        self._lost = False  # a loss was reported and not yet followed by "regained"
        self._tasks: set = set()

    async def run(self) -> None:
        import dbus_next.aio  # noqa: F401 - absent: the watch fails here, at once, not in the retry loop

        quiet_dropped_writes()  # the loop's, once: every connection below lives on it
        delay = self.backoff_start
        while True:
            try:
                bus = await asyncio.wait_for(open_bus(), self.connect_timeout)  # the client's one way in
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
            await call(bus, "AddMatch", "s", [rule], destination=DBUS, path=DBUS_PATH, interface=DBUS,
                       timeout=WATCH_TIMEOUT)
        try:
            (owner,) = await call(bus, "GetNameOwner", "s", [SYSTEMD], destination=DBUS, path=DBUS_PATH,
                                  interface=DBUS, timeout=WATCH_TIMEOUT)
        except SystemdCallError as exc:
            if exc.error_name is None:  # no answer: the connection is in doubt, run() treats it as a drop
                raise
            self.journal.notice(f"{SYSTEMD} is not on the system bus yet; waiting for it")
        else:
            self.owner = owner
            await self._subscribe(bus)

    async def _subscribe(self, bus) -> None:
        subscribed, detail = await self._try_subscribe(bus)
        if not subscribed:
            self.journal.notice(f"systemd refused Subscribe() ({detail}); reloads are still seen, "
                                "container scopes are not")

    async def _try_subscribe(self, bus) -> tuple:
        """Subscribe() -> (True, "") or (True, "already") when systemd says we already are
        subscribed (that is a subscription), else (False, its error)."""
        try:
            await call(bus, "Subscribe", timeout=WATCH_TIMEOUT)
        except SystemdCallError as exc:
            if exc.error_name == ALREADY_SUBSCRIBED:
                return True, "already"
            if exc.error_name is None:  # no answer at all: not a refusal, the caller's failure to handle
                raise
            return False, str(exc).split(": ", 1)[-1].rstrip(": ")
        return True, ""

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
            self.reloading = bool(msg.body[0])
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
            unit = msg.body[0]
            if unit in self.scopes and self.reloading:
                self._held[unit] = time.monotonic()  # the reload re-creates it: see _scope
            elif not self.reloading and is_container_scope(unit):
                self.on_scope_gone(unit)  # gone for good: not during a reload, which frees and re-creates all
            self.scopes.discard(unit)
        return None

    def _owner_changed(self, old: str, new: str) -> None:
        self.owner = new or None
        if not new:
            self.journal.notice("systemd left the system bus (daemon-reexec in progress?)")
            return
        self.journal.event("systemd-restarted", 5, "systemd is (back) on the system bus (daemon-reexec finished?): "
                           "resyncing links", action="reexec")
        # a re-exec'ed systemd announces its units again: the scopes known before are the same ones
        now = time.monotonic()
        self._held.update(dict.fromkeys(self.scopes, now))
        self.scopes.clear()
        self.reloading = False
        if self.bus is not None:
            self._spawn(self._subscribe_quietly(self.bus))
        self.on_reload("reexec")

    async def _subscribe_quietly(self, bus) -> None:
        # A re-exec'ed systemd takes its bus name before it is done deserializing and may refuse
        # Subscribe() for a moment: retry for about 30 s before giving up on scope signals.
        # A re-exec'ed systemd normally still has us subscribed (AlreadySubscribed, which counts).
        delay = 0.1
        for _ in range(12):
            try:
                subscribed, detail = await self._try_subscribe(bus)
            except Exception as exc:  # noqa: BLE001 - the bus may drop right now; run() handles that
                self.journal.debug(f"Subscribe() after re-exec failed: {_why(exc)}")
                return
            if subscribed:
                self.journal.debug("systemd kept our subscription across the re-exec" if detail == "already"
                                   else "subscribed to the re-exec'ed systemd")
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        self.journal.notice(f"systemd refused Subscribe() after re-exec ({detail}); reloads are still seen, "
                            "new container scopes only at the next resync")

    def _scope(self, unit: str) -> None:
        if not is_container_scope(unit):
            return
        if unit in self.scopes:
            self.on_scope_again(unit)
            return
        held = self._held.pop(unit, None)
        now = time.monotonic()
        if len(self._held) > 1000:  # announced again or gone for good: never grow without bound
            self._held = {u: t for u, t in self._held.items() if now - t < REANNOUNCE_SECONDS}
        if held is not None and now - held < REANNOUNCE_SECONDS:
            self.scopes.add(unit)  # re-announced by a reload or re-exec: known, not new
            self.on_scope_again(unit)
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
    disconnect(bus)


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
