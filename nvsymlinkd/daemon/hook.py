"""Where the container verifier plugs into the daemon (daemon/containerwatch.py's ContainerWatch is the one
`nvsymlinkd run` installs). The daemon calls these methods directly, each awaited through Daemon.guarded():
the verifier must never take the link keeper down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nvsymlinkd.journal import Journal


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
