"""One link pass at a time: the whole picture (devchar.reconcile, in a thread) or, for node and link events
alone, work for the names they were about (devchar.incremental), kept as the LinkState the next pass builds on.
An incremental pass takes, before it returns, the names that arrived while it worked (a burst of mknods is
one pass, not one per batch that arrived meanwhile).

The daemon's worker (daemon/loop.py) decides when a pass runs and says what it did; this decides how.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.host import libc
from nvsymlinkd.host.listings import Listings

if TYPE_CHECKING:
    from nvsymlinkd.daemon.reasons import Requests
    from nvsymlinkd.daemon.sources import Pending
    from nvsymlinkd.devchar.incremental import LinkState

# An incremental pass for at most this many names runs on the loop itself, more in a thread.
INLINE_NAMES = 64
# An incremental pass takes names that arrived while it worked at most this many times: a writer that
# never stops (links made and removed in a loop) cannot keep one pass going, and the watchdog fed.
MORE_ROUNDS = 64
# A full pass asked for by these reads every directory again (the listings kept from the last one dropped):
# an overflow lost events, a new config may name other directories, and a mount on a single node (a bind
# mount over /dev/nvidia0) changes no directory's stat (host/listings.py).
RELIST = frozenset({Reason.INOTIFY_OVERFLOW, Reason.UDEV_OVERFLOW, Reason.CONFIG, Reason.MOUNTS})


class LinkPasses:
    def __init__(self, root):
        self.root = root
        self.state: LinkState | None = None  # of the last full pass, kept up to date per event
        self._last_nodes = None
        self.leftover: Pending | None = None  # a batch the last pass took but left for a full pass
        # what the full passes read from each directory: the next lists only those that changed (the
        # first reads everything; `sync` keeps none)
        self.listings = Listings()

    async def run(self, loop, config, requests: Requests, pending: Pending,
                  more: Optional[Callable[[], Optional[Pending]]] = None):
        """One pass -> its Picture (`.full` says which kind ran). Raises what reconcile raises; a pass that
        fails leaves no picture to build on. `more()`: the names that arrived since, or None when none did;
        an incremental pass asks it until None."""
        result = None
        if any(reason in requests for reason in RELIST):
            self.listings.clear()
        if not pending.full and self.state is not None and requests.incremental():
            result = await self._incremental(loop, pending, config, more)
        if result is None:
            result = await self._full(loop, config)
        return result

    async def _full(self, loop, config):
        from nvsymlinkd.devchar.incremental import LinkState
        from nvsymlinkd.devchar.reconcile import reconcile

        if self.state is not None:  # what the incremental passes since the last full one made of the nodes
            self._last_nodes = frozenset(self.state.nodes.values())
        self.state = None  # a failed pass leaves no picture to build on
        try:
            sync = await loop.run_in_executor(None, reconcile, self.root, config, False, self.listings)
        except BaseException:
            self.listings.clear()  # nor anything read on the way
            raise
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

    async def _incremental(self, loop, pending: Pending, config, more):
        """Work for the names events were about, and for those that arrive meanwhile -> the pass's Picture, or
        None (a full pass is needed). A later batch that needs the whole picture ends the pass with what it did
        so far and is left in `leftover` for the next pass (which then runs a full one)."""
        state = self.state
        assert state is not None  # run() asks for one only on a picture
        outcomes: tuple = ()
        first = True
        for round_ in range(MORE_ROUNDS):
            delta = None if pending.full else await self._update(loop, state, pending, config)
            if delta is None:  # update() changed nothing before saying so
                if first:
                    return None
                self.leftover = pending
                break
            first = False
            outcomes += delta.outcomes
            # the last round takes no more: what is waiting then stays queued, and asks for the next pass
            later = more() if more is not None and round_ < MORE_ROUNDS - 1 else None
            if later is None:
                break
            pending = later
        result = state.result(outcomes)
        result.full = False
        return result

    async def _update(self, loop, state: LinkState, pending: Pending, config):
        if len(pending.nodes) + len(pending.links) <= INLINE_NAMES:
            # a handful of syscalls: cheaper here than the hop to a thread and back
            return state.update(pending.nodes, pending.links, config.create_nodes)
        return await loop.run_in_executor(None, state.update, pending.nodes, pending.links, config.create_nodes)
