"""The event daemon: one asyncio loop, several event sources, one reconciler.

Sources (each optional, each failing alone; daemon/sources/, one class each, listed in SOURCES):
inotify on DRIVER_ROOT/dev (the fast path), inotify on DEV_CHAR_PATH (a link
someone removed or rewrote is back within milliseconds), the mount table (a
driver root mounted after start), udev module/PCI events, systemd on the system
bus (reload started, reload finished, re-exec), a periodic resync. Every source only *requests* a reconcile; a single worker runs
`reconcile()` (observe + plan + apply, always the whole picture) in a
thread: the first event starts a pass at once (a single node gets its link in about
a millisecond on a small host), everything arriving while it runs is folded into
the next one, except node and link names an incremental pass takes before it returns
(_more: a burst of mknods is one pass, not one per batch that arrived meanwhile).

The container verifier plugs in through ContainerHook (daemon/hook.py): after a reload has
been followed by a link resync, when a container scope appears, when a
runtime wrote a container's state file (inotify on the runtimes' state roots:
runc writes state.json once the container's hooks have run), and when the set
of NVIDIA nodes changed.

The Daemon keeps the loop's lifecycle: it starts and stops the sources, runs one pass at a time
and journals it. Its pieces live beside it: why a pass was asked for (reasons.py), how a pass
runs (passes.py), what of it is news for the journal (linknews.py, pure), the STATUS= line
(status.py), the hook's interface (hook.py).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time

from nvsymlinkd.daemon.hook import ContainerHook
from nvsymlinkd.daemon.linknews import LinkNews
from nvsymlinkd.daemon.notify import Notifier
from nvsymlinkd.daemon.passes import LinkPasses
from nvsymlinkd.daemon.reasons import Reason, Requests, asked
from nvsymlinkd.daemon.sources import Pending, Source
from nvsymlinkd.daemon.sources.links import LinkSource
from nvsymlinkd.daemon.sources.mounts import MountSource
from nvsymlinkd.daemon.sources.nodes import NodeSource
from nvsymlinkd.daemon.sources.resync import ResyncSource
from nvsymlinkd.daemon.sources.runtimes import RuntimeSource
from nvsymlinkd.daemon.sources.systemd import SystemdSource
from nvsymlinkd.daemon.sources.udev import UdevSource
from nvsymlinkd.daemon.status import Status
from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.host import libc
from nvsymlinkd.journal import ERR, INFO, Journal
from nvsymlinkd.text import plural

# The event sources, in the order they start and are asked before and after each pass. Each
# imports what it watches with (inotify, pyudev, dbus_next) when it starts.
SOURCES = (NodeSource, LinkSource, RuntimeSource, UdevSource, MountSource, SystemdSource, ResyncSource)

# Wait this long after the first event before a pass (0: just let the loop drain
# what is already readable). Coalescing comes from "one pass at a time, requests
# made meanwhile fold into the next"; a delay here only adds latency (measured).
SETTLE_SECONDS = 0.0
# At shutdown, a background task still running this long after its cancel is cancelled again.
SHUTDOWN_RECANCEL_SECONDS = 0.2


class Daemon:
    def __init__(self, root, config, reload_config=None, hook: ContainerHook | None = None,
                 journal: Journal | None = None, notifier: Notifier | None = None,
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
        from nvsymlinkd.metrics import Metrics

        self.metrics = metrics or Metrics(root, config, self.journal)
        self.status = Status(self.notifier)
        self.links = LinkPasses(root)
        self.news = LinkNews()
        self._requests = Requests()
        self.reload_pending = False  # a reload or re-exec finished: reload_finished after the next pass
        self._ready = False
        self._pass_started: float | None = None
        self._tasks: set = set()

    @property
    def passes(self) -> int:
        return self.status.passes

    def request(self, reason: Reason, detail: str | None = None) -> None:
        """What every event source does: ask for a pass (requests made during one fold into the next)."""
        self._requests.add(reason, detail)
        self._wake.set()

    def set_bus_state(self, state: str) -> None:
        self.status.bus = state
        self.status.soon()

    # -- lifecycle --------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.loop = self.status.loop = loop
        self.status.sent = time.monotonic()  # the first status goes out with READY=1
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
        await self._pass(asked(Reason.STARTUP))
        self.status.cancel()
        self.status.sent = time.monotonic()
        self.notifier.ready(self.status.line())
        self._ready = True
        # The modules' objects (~23,000 of them) and the first picture live as long as the daemon: out of
        # every full collection from now on, which walked them all (~9 ms each; docs/performance.md).
        # Collected first: a cycle frozen while garbage would never be freed.
        gc.collect()
        gc.freeze()
        self.spawn(self._worker())
        await self.guarded(self.hook.started())
        self.status.sent = 0.0
        interval = self.notifier.watchdog_interval()
        if interval:
            self.spawn(self._watchdog(interval))
        for source in self.sources:
            source.started()
        await self._stop.wait()
        self.status.cancel()
        self.notifier.stopping("stopping")
        await self._shutdown()
        self._report()
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
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            # Asked again while one is still running: asyncio.wait_for before Python 3.12 loses a cancel that
            # lands as its inner future finishes (CPython gh-86296), and the bus watch's retry loop then
            # sleeps on, so a SIGTERM during the first connection attempt never stopped the daemon.
            _, pending = await asyncio.wait(pending, timeout=SHUTDOWN_RECANCEL_SECONDS)

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

    async def guarded(self, call) -> None:
        """Await one of the container hook's methods, e.g. `guarded(hook.scope_appeared(unit))`: a failure is
        journaled, never raised."""
        try:
            await call
        except Exception as exc:  # noqa: BLE001 - the verifier must never take the link keeper down
            name = getattr(call, "__name__", type(call).__name__)  # a coroutine's is its method's
            self.journal.log(ERR, f"container hook {name} failed: {type(exc).__name__}: {exc}")

    # -- the worker ---------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(SETTLE_SECONDS)
            self._wake.clear()
            requests, self._requests = self._requests, Requests()
            reload_done, self.reload_pending = self.reload_pending, False
            try:
                await self._pass(requests)
            except Exception as exc:  # noqa: BLE001 - the worker must outlive any one pass
                self._failed(f"unexpected {type(exc).__name__}: {exc}")
            if reload_done:
                await self.guarded(self.hook.reload_finished())
            elif Reason.PERIODIC in requests:
                await self.guarded(self.hook.periodic())

    async def _pass(self, requests: Requests) -> None:
        pending = Pending(requests)
        left, self.links.leftover = self.links.leftover, None
        if left is not None:  # names the last pass took but left for this one
            pending.nodes, pending.links, pending.full = left.nodes, left.links, True
        for source in self.sources:
            # what their queues hold now: this pass answers it (without this, an event not read yet
            # when the pass starts would be answered by it and then wake another one for nothing)
            source.before_pass(pending)
        self._pass_started = time.monotonic()
        event_at = pending.event_at
        try:
            result = await self.links.run(self.loop, self.config, requests, pending, self._more)
        except NvsymlinkdError as exc:
            self.metrics.on_sync_failed()
            self._failed(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - keep running; the next event or resync retries
            self.links.state = None
            self.metrics.on_sync_failed()
            self._failed(f"unexpected {type(exc).__name__}: {exc}")
            return
        finally:
            self._pass_started = None
            self.status.passes += 1
        if self.links.leftover is not None:
            self.request(Reason.NODES)  # its run() sees the leftover and runs a full pass
        state = self.links.state
        assert state is not None  # the pass that just succeeded left its picture
        for source in self.sources:
            source.after_pass(state)
        self._report(result)
        self.metrics.on_reconcile(result)
        changes = any(o.action.changes for o in result.pass_outcomes)
        if event_at is not None and changes:
            self.metrics.on_event_latency(time.monotonic() - event_at)
        why = requests.why()
        self.journal.debug(f"pass {self.passes} ({why}): {sum(o.action.changes for o in result.pass_outcomes)} "
                           f"changes{'' if result.full else ', incremental'}")
        self.status.last = f"last sync {time.strftime('%H:%M:%S')} ({why})"
        self.status.result = result
        self.status.soon()
        if state.nodes_changed:
            state.nodes_changed = False
            await self.guarded(self.hook.nodes_changed(result))

    def _more(self) -> Pending | None:
        """The names events brought while an incremental pass worked (that pass takes them), or None. The
        requests their reads made meanwhile are answered by it too: they wake no pass of their own."""
        if not self._requests.incremental():
            return None  # something asked meanwhile needs a full pass (a reload, a resync): it goes next
        if not any(source.waiting() for source in self.sources):
            return None
        self._requests = Requests()  # NODES and LINKS, from reads made meanwhile: what we take now
        self._wake.clear()
        more = Pending(Requests())
        for source in self.sources:
            source.before_pass(more)
        return more

    def _failed(self, message: str) -> None:
        self.status.last = f"last sync failed: {message}"
        self.status.soon()
        for e in self.news.failed(message):
            self.journal.log(e.priority, e.message, e.kind, **e.fields)

    def _report(self, result=None) -> None:
        """Journal what of this pass is news (linknews.py decides); with no pass (stopping), the counts of
        corrections to flapping links not said yet."""
        if result is None:
            entries = self.news.flush(time.monotonic(), final=True)
        else:
            state = self.links.state
            assert state is not None  # reported right after the pass that made it
            foreign = state.foreign()
            self.metrics.on_foreign_links(len(foreign))
            entries = self.news.driver(bool(state.nvidia_majors))
            entries += self.news.after_pass(result.pass_outcomes, state.conflicts.values(), foreign,
                                            result.plan.notes, time.monotonic())
        self.journal.log_all((e.priority, e.message, e.kind, e.fields) for e in entries)

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
        self.request(Reason.CONFIG)

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
