"""The event daemon: one asyncio loop, several event sources, one reconciler.

Sources (each optional, each failing alone; daemon/sources/, one class each, listed in SOURCES):
inotify on DRIVER_ROOT/dev (the fast path), inotify on DEV_CHAR_PATH (a link
someone removed or rewrote is back within milliseconds), the mount table (a
driver root mounted after start), udev module/PCI events, systemd on the system
bus (reload started, reload finished, re-exec), a periodic resync. Every source only *requests* a reconcile; a single worker runs
`reconcile()` (observe + plan + apply, always the whole picture) in a
thread, so a burst of 50 mknods costs a handful of passes: the first event
starts a pass at once (a single node gets its link in about a millisecond on
a small host), everything arriving while it runs is folded into the next one.

The container verifier plugs in through ContainerHook: after a reload has
been followed by a link resync, when a container scope appears, when a
runtime wrote a container's state file (inotify on the runtimes' state roots:
runc writes state.json once the container's hooks have run), and when the set
of NVIDIA nodes changed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING

from nvsymlinkd.daemon.notify import Notifier
from nvsymlinkd.daemon.sources import Pending, Source
from nvsymlinkd.daemon.sources.links import LinkSource
from nvsymlinkd.daemon.sources.mounts import MountSource
from nvsymlinkd.daemon.sources.nodes import NodeSource
from nvsymlinkd.daemon.sources.resync import ResyncSource
from nvsymlinkd.daemon.sources.runtimes import RuntimeSource
from nvsymlinkd.daemon.sources.systemd import SystemdSource
from nvsymlinkd.daemon.sources.udev import UdevSource
from nvsymlinkd.devchar.summary import plural
from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.host import libc
from nvsymlinkd.journal import ERR, INFO, NOTICE, WARNING, Journal

if TYPE_CHECKING:
    from nvsymlinkd.devchar.incremental import LinkState

# The event sources, in the order they start and are asked before and after each pass. Each
# imports what it watches with (inotify, pyudev, dbus_next) when it starts.
SOURCES = (NodeSource, LinkSource, RuntimeSource, UdevSource, MountSource, SystemdSource, ResyncSource)

# Wait this long after the first event before a pass (0: just let the loop drain
# what is already readable). Coalescing comes from "one pass at a time, requests
# made meanwhile fold into the next"; a delay here only adds latency (measured).
SETTLE_SECONDS = 0.0
# Reasons a pass may answer with work for the named nodes and links only (devchar.incremental);
# any other reason (resync, overflow, udev, reload, config) runs the full pass.
EVENT_REASONS = frozenset({"device nodes changed", "links changed"})
# An incremental pass for at most this many names runs on the loop itself, more in a thread.
INLINE_NAMES = 64
# STATUS= at most this often: the manager's notify queue is short and shared
STATUS_EVERY = 1.0


# applied plan action -> (journal kind, priority, what the line says)
# A link another writer keeps changing (a flapping tool): the daemon corrects it every time, but says so
# once per FLAP_WINDOW seconds per link, and then how many more corrections it made meanwhile (1,144 lines
# in 3 s before: a journal flood that buries everything else).
FLAP_WINDOW = 10.0

_CHANGE_EVENTS = {
    "create": ("link-created", INFO, "created link"),
    "replace": ("link-replaced", NOTICE, "replaced link"),
    "remove": ("link-removed", INFO, "removed link"),
    "create-node": ("node-created", NOTICE, "created node"),
}


class ContainerHook:
    """Where the container verifier plugs in. This default only logs.

    Methods are awaited on the event loop: do blocking work in a thread.
    """

    def __init__(self, journal: Journal):
        self.journal = journal

    async def reload_finished(self) -> None:
        """systemd finished a reload/re-exec and the links have been resynced since."""
        self.journal.debug("reload finished (no container verifier installed)")

    def systemd_reloading(self, reloading: bool) -> None:
        """systemd started (True) or finished (False) a reload or re-exec: said at once, on the loop
        (must not block); reload_finished comes later, after the link resync."""

    async def scope_appeared(self, unit: str) -> None:
        """A container scope (docker-*.scope, cri-containerd-*.scope, ...) appeared."""
        self.journal.debug(f"container scope {unit} appeared (no container verifier installed)")

    async def scope_announced_again(self, unit: str) -> None:
        """A container scope known already was announced again (a reload, a re-exec, or a new scope of
        the same name that the signals alone cannot tell apart)."""

    def scope_gone(self, unit: str) -> None:
        """systemd dropped a container scope (not a reload's re-creation): said at once, on the loop."""

    async def runtime_state_written(self, containers: list) -> None:
        """A runtime wrote the state file of these containers (inside paths of their state
        directories): runc does once a container's hooks have run, so verify now."""
        self.journal.debug(f"runtime state written for {len(containers)} containers (no container verifier installed)")

    async def nodes_changed(self, result) -> None:
        """The set of NVIDIA nodes changed; `result` is the reconcile's SyncResult."""
        self.journal.debug(f"NVIDIA nodes changed: now {len(result.snapshot.nodes)}")

    async def started(self) -> None:
        """The first full sync is done and READY=1 was sent."""

    async def periodic(self) -> None:
        """A periodic resync ran (the safety net for missed events)."""

    def close(self) -> None:
        """The daemon is stopping."""


class Daemon:
    def __init__(self, root, config, reload_config=None, hook=None, journal=None, notifier=None,
                 use_udev: bool = True, use_bus: bool = True, metrics=None, sources=SOURCES):
        self.root = root
        self.config = config
        self.reload_config = reload_config  # () -> Config, raises NvsymlinkdError
        self.journal = journal or Journal()
        self.hook = hook or ContainerHook(self.journal)
        self.notifier = notifier or Notifier()
        off: set = {UdevSource} if not use_udev else set()
        off |= {SystemdSource} if not use_bus else set()
        self.sources: list[Source] = [cls(self) for cls in sources if cls not in off]
        self.bus_state = "off"
        self.passes = 0
        from nvsymlinkd.metrics import Metrics

        self.metrics = metrics or Metrics(root, config, self.journal)
        self._reasons: dict = {}
        self.reload_pending = False  # a reload or re-exec finished: reload_finished after the next pass
        self._ready = False
        self._pass_started: float | None = None
        self._last_nodes = None
        self.state: LinkState | None = None  # of the last full pass, kept up to date per event
        self._last_conflicts: set = set()
        self._last_notes: set = set()
        self._last_failure: str | None = None
        self._said_change: dict = {}  # link -> [when last said (monotonic), corrections not said since]
        self._last_status = "starting"
        self._tasks: set = set()
        self._status_sent = 0.0
        self._status_handle: asyncio.TimerHandle | None = None
        self._said_no_driver = False  # "NVIDIA driver not loaded" is said once, again only after it was loaded

    def request(self, reason: str) -> None:
        """What every event source does: ask for a pass (requests made during one fold into the next)."""
        self._reasons[reason] = self._reasons.get(reason, 0) + 1
        self._wake.set()

    def set_bus_state(self, state: str) -> None:
        self.bus_state = state
        self._status_soon()

    # -- lifecycle --------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._status_sent = time.monotonic()  # the first status goes out with READY=1
        libc.malloc_compact(arenas=True)  # before the first worker thread exists: one heap, not one each
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        self.journal.event("daemon-started", INFO, f"starting: driver root {self.config.driver_root}, "
                           f"links in {self.config.dev_char_path}, resync every {self._interval_text()}")
        for source in self.sources:
            self._start(source)
        self.spawn(self.metrics.run())
        await self._pass({"startup": 1})
        if self._status_handle is not None:
            self._status_handle.cancel()
            self._status_handle = None
        self._status_sent = time.monotonic()
        self.notifier.ready(self.status_line())
        self._ready = True
        self.spawn(self._worker())
        await self.call_hook("started")
        self._status_sent = 0.0
        interval = self.notifier.watchdog_interval()
        if interval:
            self.spawn(self._watchdog(interval))
        for source in self.sources:
            source.started()
        await self._stop.wait()
        if self._status_handle is not None:
            self._status_handle.cancel()
        self.notifier.stopping("stopping")
        await self._shutdown()
        self._flush_flaps(final=True)
        self.journal.event("daemon-stopped", INFO, f"stopped after {plural(self.passes, 'sync pass', 'sync passes')}")
        return 0

    def stop(self) -> None:
        """Ask run() to return (what SIGTERM does)."""
        self._stop.set()

    def _start(self, source: Source) -> None:
        source.start()
        fd = source.fileno()
        if fd is not None:
            self.loop.add_reader(fd, source.handle)

    def _close(self, source: Source) -> None:
        fd = source.fileno()
        if fd is not None:
            self.loop.remove_reader(fd)
        source.stop()

    async def _shutdown(self) -> None:
        try:
            self.hook.close()
        except Exception:  # noqa: BLE001 - shutting down regardless
            pass
        for source in reversed(self.sources):
            self._close(source)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def spawn(self, coro):
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.journal.log(ERR, f"internal error in a background task: {type(exc).__name__}: {exc}")

    # -- the worker ---------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(SETTLE_SECONDS)
            self._wake.clear()
            reasons, self._reasons = self._reasons, {}
            reload_done, self.reload_pending = self.reload_pending, False
            try:
                await self._pass(reasons)
            except Exception as exc:  # noqa: BLE001 - the worker must outlive any one pass
                self._failed(f"unexpected {type(exc).__name__}: {exc}")
            if reload_done:
                await self.call_hook("reload_finished")
            elif "periodic resync" in reasons:
                await self.call_hook("periodic")

    async def _pass(self, reasons: dict) -> None:
        pending = Pending(reasons)
        for source in self.sources:
            # what their queues hold now: this pass answers it (without this, an event not read yet
            # when the pass starts would be answered by it and then wake another one for nothing)
            source.before_pass(pending)
        config = self.config
        self._pass_started = time.monotonic()
        event_at = pending.event_at
        try:
            result = None
            if not pending.full and self.state is not None and not (reasons.keys() - EVENT_REASONS):
                result = await self._incremental(pending.nodes, pending.links, config)
            if result is None:
                result = await self._full(config)
        except NvsymlinkdError as exc:
            self.metrics.on_sync_failed()
            self._failed(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - keep running; the next event or resync retries
            self.state = None
            self.metrics.on_sync_failed()
            self._failed(f"unexpected {type(exc).__name__}: {exc}")
            return
        finally:
            self._pass_started = None
            self.passes += 1
        self._last_failure = None
        state = self.state
        assert state is not None  # the pass that just succeeded left its picture
        for source in self.sources:
            source.after_pass(state)
        self._driver_note(bool(state.nvidia_majors))
        self._report(result)
        self.metrics.on_reconcile(result)
        changes = any(o.action.changes for o in result.pass_outcomes)
        if event_at is not None and changes:
            self.metrics.on_event_latency(time.monotonic() - event_at)
        why = ", ".join(sorted(reasons))
        self.journal.debug(f"pass {self.passes} ({why}): {sum(o.action.changes for o in result.pass_outcomes)} "
                           f"changes{'' if result.full else ', incremental'}")
        self._last_status = f"last sync {time.strftime('%H:%M:%S')} ({why})"
        self._result = result
        self._status_soon()
        if state.nodes_changed:
            state.nodes_changed = False
            await self.call_hook("nodes_changed", result)

    async def _full(self, config):
        from nvsymlinkd.devchar.incremental import LinkState
        from nvsymlinkd.devchar.reconcile import reconcile

        if self.state is not None:  # what the incremental passes since the last full one made of the nodes
            self._last_nodes = frozenset(self.state.nodes.values())
        self.state = None  # a failed pass leaves no picture to build on
        sync = await self.loop.run_in_executor(None, reconcile, self.root, config)
        state = LinkState(self.root, sync)
        nodes = frozenset(sync.snapshot.nodes)
        state.nodes_changed = self._last_nodes is not None and nodes != self._last_nodes
        self._last_nodes = nodes
        self.state = state
        outcomes = sync.outcomes
        del sync, nodes
        libc.malloc_compact()  # a full pass's thousands of short-lived objects: their pages go back
        result = state.result(outcomes)
        result.full = True
        return result

    async def _incremental(self, node_names, link_names, config):
        """Work for the names events were about -> the pass's Picture, or None (a full pass is needed)."""
        state = self.state
        if len(node_names) + len(link_names) <= INLINE_NAMES:
            # a handful of syscalls: cheaper here than the hop to a thread and back
            delta = state.update(node_names, link_names, config.create_nodes)
        else:
            delta = await self.loop.run_in_executor(None, state.update, node_names, link_names,
                                                     config.create_nodes)
        if delta is None:
            return None
        result = state.result(delta.outcomes)
        result.full = False
        return result

    def _driver_note(self, loaded: bool) -> None:
        """Once, not at every pass: a daemon that links nothing should say why."""
        if not loaded and not self._said_no_driver:
            self._said_no_driver = True
            self.journal.warning("NVIDIA driver not loaded (no nvidia entry in /proc/devices): no nodes to link "
                                 "yet; linking as soon as the module loads (udev event or the next resync)")
        elif loaded and self._said_no_driver:
            self._said_no_driver = False
            self.journal.info("NVIDIA driver loaded: linking its nodes")

    def _failed(self, message: str) -> None:
        self._last_status = f"last sync failed: {message}"
        self._status_soon()
        if message != self._last_failure:  # say it once, not at every event
            self._last_failure = message
            self.journal.event("sync-failed", ERR, f"sync failed: {message}")

    def _report(self, result) -> None:
        j = self.journal
        for outcome in result.pass_outcomes:
            a = outcome.action
            where = a.link or a.target
            if outcome.raced:
                # another writer got there between planning and applying: its change raised
                # an event of its own, and the next pass plans from what it left
                j.info(f"{a.action} {where} ({a.device}) not done: {outcome.error}")
            elif outcome.error is not None:
                j.event("link-failed", ERR, f"failed to {a.action} {where} ({a.device}): {outcome.error}",
                        link=where, device=a.device, action=a.action)
            elif a.action in _CHANGE_EVENTS and self._say_change((where, a.action)):
                kind, priority, text = _CHANGE_EVENTS[a.action]
                why = f": {a.reason}" if a.action != "create" else ""
                arrow = f" -> {a.target}" if a.action in ("create", "replace") else ""
                j.event(kind, priority, f"{text} {where}{arrow} ({a.device}){why}",
                        link=where, device=a.device, action=a.action)
        self._flush_flaps()
        assert self.state is not None  # reported right after the pass that made it
        foreign = self.state.foreign()
        self.metrics.on_foreign_links(len(foreign))
        # once per (path, device, reason): a foreign link's reason names its target, so a new target is news
        conflicts = {(a.link or a.target, a.device, a.reason) for a in self.state.conflicts.values()}
        for where, device, reason in sorted(conflicts - self._last_conflicts):
            entry = foreign.get(where)
            if entry is not None:
                j.event("link-foreign", WARNING, f"conflict at {where} ({device}): {reason}; "
                        f"{_resolves_to(entry)}, so {_systemd_gets(entry, where, device)}",
                        link=where, device=device, action="conflict", target=entry.link_text)
            else:
                j.event("link-conflict", WARNING, f"conflict at {where} ({device}): {reason}",
                        link=where, device=device, action="conflict")
        self._last_conflicts = conflicts
        notes = set(result.plan.notes)
        for note in sorted(notes - self._last_notes):
            j.info(f"note: {note}")
        self._last_notes = notes

    def _say_change(self, key: tuple, now: float | None = None) -> bool:
        """Whether to journal this change (key: link, action): the first in FLAP_WINDOW seconds is said, the
        rest counted (and said as a count by _flush_flaps). The change itself is always made."""
        now = time.monotonic() if now is None else now
        said = self._said_change.get(key)
        if said is not None and now - said[0] < FLAP_WINDOW:
            said[1] += 1
            return False
        if said is not None and said[1]:
            self._flush_flap(key, said, now)
        self._said_change[key] = [now, 0]
        return True

    def _flush_flaps(self, final: bool = False) -> None:
        now = time.monotonic()
        for key, said in list(self._said_change.items()):
            if final or now - said[0] >= FLAP_WINDOW:
                if said[1]:
                    self._flush_flap(key, said, now)
                del self._said_change[key]

    def _flush_flap(self, key: tuple, said: list, now: float) -> None:
        where, action = key
        kind, priority, text = _CHANGE_EVENTS[action]
        self.journal.event(kind, min(priority, NOTICE),
                           f"{text.split()[0]} {where} {plural(said[1], 'more time')} in the last "
                           f"{now - said[0]:.0f} s: another writer keeps changing it (find it: auditctl -w on the "
                           "link); each change is made, only this count is said", link=where, action=action,
                           count=said[1])
        said[1] = 0

    async def call_hook(self, name: str, *args) -> None:
        try:
            await getattr(self.hook, name)(*args)
        except Exception as exc:  # noqa: BLE001 - the verifier must never take the link keeper down
            self.journal.log(ERR, f"container hook {name} failed: {type(exc).__name__}: {exc}")

    # -- timers and signals ------------------------------------------------------

    async def _watchdog(self, interval: float) -> None:
        while True:
            # a pass stuck far beyond the watchdog period stops the pings: systemd restarts us
            started = self._pass_started
            if started is None or time.monotonic() - started < 4 * interval:
                self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _on_sighup(self) -> None:
        if self.reload_config is None:
            return
        try:
            new = self.reload_config()
        except NvsymlinkdError as exc:
            self.journal.event("config-error", ERR, f"config not reloaded, keeping the old one: {exc}")
            return
        old, self.config = self.config, new
        self.metrics.config = new  # a new metrics_textfile applies at the next write; metrics_listen at restart
        self.journal.event("config-reloaded", INFO,
                           f"config reloaded from {new.source or 'defaults'}: {config_changes(old, new)}")
        for i, source in enumerate(self.sources):
            if any(getattr(old, key) != getattr(new, key) for key in source.config_keys):
                self._close(source)
                self.sources[i] = source = type(source)(self)
                self._start(source)
                if self._ready:
                    source.started()
        self.request("config reloaded")

    # -- status -----------------------------------------------------------------

    def _status_soon(self) -> None:
        """Send STATUS= now, or once STATUS_EVERY has passed since the last one (latest text wins)."""
        if not self.notifier.enabled or self._status_handle is not None:
            return
        delay = self._status_sent + STATUS_EVERY - time.monotonic()
        if delay <= 0:
            self._send_status()
        else:
            self._status_handle = self.loop.call_later(delay, self._send_status)

    def _send_status(self) -> None:
        self._status_handle = None
        self._status_sent = time.monotonic()
        self.notifier.status(self.status_line())

    def status_line(self) -> str:
        result = getattr(self, "_result", None)
        if result is None:
            head = "no successful sync yet"
        else:
            counts = result.plan.summary()
            links = counts["create"] + counts["replace"] + counts["keep"]
            nodes = len(result.snapshot.nodes)
            head = f"{plural(links, 'link')} for {plural(nodes, 'NVIDIA node')}"
            if counts["conflict"]:
                head += f", {plural(counts['conflict'], 'conflict')}"
        passes = plural(self.passes, "sync pass", "sync passes")
        return f"{head}; {self._last_status}; {passes}; system bus {self.bus_state}"

    def _interval_text(self) -> str:
        return f"{self.config.resync_interval:g} s" if self.config.resync_interval > 0 else "never (disabled)"


def config_changes(old, new) -> str:
    """`repair "auto" -> "report", resync_interval 60 -> 30`, or `nothing changed` (values as TOML writes them)."""
    import json

    from nvsymlinkd.record import fields

    def shown(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            return f"{value:g}"
        return json.dumps(value) if isinstance(value, str) else str(value)  # quoted, control characters escaped

    changed = [f"{f.name} {shown(getattr(old, f.name))} -> {shown(getattr(new, f.name))}" for f in fields(new)
               if f.name != "source" and getattr(old, f.name) != getattr(new, f.name)]
    return ", ".join(changed) if changed else "nothing changed"


def _resolves_to(entry) -> str:
    if entry.resolved is not None:
        return f"it resolves to c {entry.resolved[0]}:{entry.resolved[1]}"
    if entry.resolved_kind == "missing":
        return "it resolves to nothing"
    return "it resolves to no character device"


def _systemd_gets(entry, where: str, device: str) -> str:
    # runc stat()s /dev/char/M:m before passing DeviceAllow= to systemd; systemd >= 240 parses
    # the name, older ones stat() it too (REFERENCE: runc with the systemd cgroup driver)
    if entry.resolved is not None:
        return f"whatever stat()s {where} gets that device instead (systemd < 240 for DeviceAllow=)"
    return (f"runc 1.1.3-1.1.6 (any runc with systemd < 240) leaves {device} out of containers created "
            "meanwhile, and the next daemon-reload takes it from them")
