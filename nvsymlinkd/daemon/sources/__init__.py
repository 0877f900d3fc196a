"""The daemon's event sources, each one class behind one small interface.

A source watches one thing and only *asks*: for a pass (`daemon.request(Reason.X)`), or of the
container hook (`daemon.spawn(daemon.guarded(daemon.hook.scope_appeared(unit)))`). It never runs a pass itself. The loop
(daemon/loop.py) drives every source the same way, in the order of its SOURCES table:

    start()             before the first pass: open what it watches. A source that cannot says so
                        once (journal) and stays off; the others keep working.
    fileno()            the fd the loop reads (add_reader), or None (off, or a task/timer source)
    handle()            that fd is readable: drain it, ask for what it means (never blocks)
    started()           after READY=1 (the first full pass is done): start tasks, timers
    before_pass(p)      right before a pass observes: drain quietly (that pass answers what is
                        queued), re-add watches, put the names it saw into `p` (a Pending); again
                        during an incremental pass while some source's waiting() is true
    waiting()           events queued or read and not taken yet (one poll(2), no read)
    after_pass(state)   after a pass succeeded, with the picture it left (devchar.incremental.LinkState)
    stop()              close; the loop removes the reader first
    config_keys         the config keys it is built from: a SIGHUP that changes one restarts it

A new event source is one class here and one entry in loop.SOURCES.

What a source may use of the daemon is DaemonView: root, config, journal, hook, metrics, request(),
spawn(), guarded(), reload_pending, set_bus_state().
"""

from __future__ import annotations

import select
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, ClassVar, Coroutine, Optional, Protocol

from nvsymlinkd.daemon.reasons import Reason, Requests
from nvsymlinkd.journal import NOTICE

if TYPE_CHECKING:
    import asyncio

    from nvsymlinkd.config import Config
    from nvsymlinkd.daemon.hook import ContainerHook
    from nvsymlinkd.host.root import HostRoot
    from nvsymlinkd.journal import Journal
    from nvsymlinkd.metrics import Metrics


class DaemonView(Protocol):
    """What a source may use of the daemon (daemon/loop.py's Daemon): the interface, not the loop's class,
    so that this package does not import the loop that imports it (no import circle)."""

    root: HostRoot
    config: Config
    journal: Journal
    hook: ContainerHook
    metrics: Metrics
    reload_pending: bool

    def request(self, reason: Reason, detail: Optional[str] = None) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...

    def guarded(self, call: Awaitable[None]) -> Coroutine[Any, Any, None]: ...

    def set_bus_state(self, state: str) -> None: ...


@dataclass
class Pending:
    """What the next pass is asked to answer, gathered right before it observes."""

    requests: Requests                              # what was asked since the last pass (reasons.py)
    nodes: set = field(default_factory=set)         # names under DRIVER_ROOT/dev that events were about
    links: set = field(default_factory=set)         # `M:m` names in DEV_CHAR_PATH that events were about
    full: bool = False                              # something only the whole picture answers (a directory
                                                    # came, went or was replaced; a queue overflowed)
    event_at: Optional[float] = None                # monotonic time of the first node event not yet answered


class Source:
    """An event source that does nothing: subclasses override what they need."""

    name: ClassVar[str] = "source"
    config_keys: ClassVar[tuple] = ()

    def __init__(self, daemon: DaemonView):
        self.daemon = daemon
        self.journal = daemon.journal

    def start(self) -> None:
        pass

    def fileno(self) -> Optional[int]:
        return None

    def handle(self) -> None:
        pass

    def started(self) -> None:
        pass

    def before_pass(self, pending: Pending) -> None:
        pass

    def waiting(self) -> bool:
        return False

    def after_pass(self, state) -> None:
        pass

    def stop(self) -> None:
        pass


class WatchSource(Source):
    """A source over one daemon.inotify watch (LinkWatch, DevWatch): its fd, its reader, its close.
    Subclasses open `watch` in start() and say what a change means (changed_reason, changed())."""

    changed_reason: ClassVar[Reason]

    def __init__(self, daemon: DaemonView):
        super().__init__(daemon)
        self.watch: Any = None

    def fileno(self) -> Optional[int]:
        return self.watch.fileno() if self.watch is not None else None

    def handle(self) -> None:
        self._read(request=True)

    def waiting(self) -> bool:
        watch = self.watch
        if watch is None:
            return False
        if watch.names or watch.full:  # handle() read them while a pass ran in its thread
            return True
        return bool(select.select([watch.fileno()], [], [], 0)[0])

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def overflow_text(self) -> str:
        return "inotify queue overflowed: full resync"

    def changed(self) -> None:
        """Events arrived (no overflow): what the subclass keeps of that moment."""

    def _read(self, request: bool) -> None:
        assert self.watch is not None  # its reader goes before it does
        try:
            changed, overflowed = self.watch.poll()
        except OSError as exc:
            self.journal.warning(f"reading inotify events failed ({exc.strerror}); resyncing")
            changed, overflowed = True, False
        if overflowed:
            self.journal.event("event-overflow", NOTICE, self.overflow_text())
            if request:
                self.daemon.request(Reason.INOTIFY_OVERFLOW)
        elif changed:
            self.changed()
            if request:
                self.daemon.request(self.changed_reason)
