"""systemd on the system bus (systemd.bus.SystemdWatch): reloads, re-execs and container scopes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import DaemonView, Source

if TYPE_CHECKING:  # imported when the source starts
    from nvsymlinkd.systemd.bus import SystemdWatch


class SystemdSource(Source):
    """A reload or re-exec re-applies every scope's device policy: resync links, then let the container
    verifier look; a new container scope: the verifier looks at it. Connects after READY=1."""

    name = "systemd"

    def __init__(self, daemon: DaemonView) -> None:
        super().__init__(daemon)
        self.watch: SystemdWatch | None = None

    def start(self) -> None:
        _preload_bus()

    def started(self) -> None:
        from nvsymlinkd.systemd.bus import SystemdWatch

        self.watch = SystemdWatch(self.journal, self.on_reload, self.on_scope, self.daemon.set_bus_state,
                                  on_reload_start=self.on_reload_start, on_scope_gone=self.on_scope_gone,
                                  on_scope_again=self.on_scope_again)
        self.daemon.spawn(self.watch.run())

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def on_reload(self, why: str) -> None:
        """A reload or re-exec finished (or the bus came back): resync, then the verifier's reload_finished."""
        d = self.daemon
        d.metrics.on_reload()
        d.hook.systemd_reloading(False)
        d.reload_pending = True
        d.request(Reason.RELOADED, why)

    def on_reload_start(self) -> None:
        # Reloading(true) comes as systemd starts a reload: a pass now may still beat its
        # re-applying of device policies; Reloading(false) comes after it has applied them.
        self.daemon.hook.systemd_reloading(True)
        self.daemon.request(Reason.RELOAD_STARTED)

    def on_scope(self, unit: str) -> None:
        self.daemon.spawn(self.daemon.guarded(self.daemon.hook.scope_appeared(unit)))

    def on_scope_again(self, unit: str) -> None:
        self.daemon.spawn(self.daemon.guarded(self.daemon.hook.scope_announced_again(unit)))

    def on_scope_gone(self, unit: str) -> None:
        self.daemon.hook.scope_gone(unit)  # on the loop, before the next signal (a new scope of the name)


def _preload_bus() -> None:
    """Import the bus code before READY=1, not on the loop after it.

    On a slow host importing dbus_next takes seconds (measured under qemu TCG), and the
    container verifier's thread may be importing it at the same time: the loop, and with
    it the link watch, would stall just after the daemon said it was ready.
    """
    try:
        import dbus_next.aio  # noqa: F401
    except ImportError:
        pass  # SystemdWatch says what is missing when it starts
    import nvsymlinkd.systemd.bus  # noqa: F401
