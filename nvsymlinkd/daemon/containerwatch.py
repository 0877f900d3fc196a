"""The daemon's container side: verify GPU containers on events, journal findings, repair.

Plugged into nvsymlinkd.daemon.loop.Daemon as its ContainerHook. Every trigger
(start, reload finished, a runtime's state file written, a new container
scope, NVIDIA nodes changed, the periodic resync) asks for one verification
of all containers; requests that arrive while one runs are folded into the
next. The work (cgroup reads, bpf,
D-Bus calls, freezer writes) runs in a worker thread so the event loop keeps
serving inotify and systemd signals.

Findings are journaled when they change, not at every pass: an operator
reading `journalctl -u nvsymlinkd` sees each loss, each risk and each repair
once. With repair = "auto", at-risk containers are fixed before a reload can
take their devices, and lost ones get them back.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from nvsymlinkd import journal as journalmod
from nvsymlinkd.daemon.loop import ContainerHook

if TYPE_CHECKING:  # an annotation only: the daemon imports the verifier in its worker thread
    from nvsymlinkd.verify.cache import VerifyCache

# A new scope appears before runc has run the container's hooks (REFERENCE: runc create
# order); look again once they have had time to finish, then once more for slow hooks.
# The fallback for runtimes whose state the daemon does not watch (the runtime watch
# verifies as soon as runc has written state.json, which it does once the hooks are done).
SCOPE_RECHECK_DELAYS = (1.0, 5.0)
RUNTIME_REASON = "runtime state written"
# A pass asked for only by runtime state events, right after another such pass, waits as
# long as that one took: many containers starting at once keep the verifier busy half the
# time at most, and each pass answers every container whose state landed meanwhile. A lone
# start (after a pass for any other reason) is not delayed.
RUNTIME_DUTY = 1.0
# Containers named in a reason (the journal's "check triggered by"); more are counted.
REASON_NAMES = 3
# Repair outcomes that change nothing: said once while the container's findings stay the same,
# not at every pass (a "report" config or an impossible repair would otherwise repeat each resync).
QUIET_REPEATS = ("repair-reported", "repair-refused", "repair-failed")


class _SayOnce:
    """The daemon's journal for repair_all, minus repeats of a QUIET_REPEATS entry already said."""

    def __init__(self, journal, said: dict):
        self._journal = journal
        self._said = said  # container id -> {(kind, message)}

    def event(self, kind: str, priority: int, message: str, **fields) -> None:
        cid = fields.get("container_id")
        if kind in QUIET_REPEATS and cid is not None:
            said = self._said.setdefault(cid, set())
            if (kind, message) in said:
                return
            said.add((kind, message))
        self._journal.event(kind, priority, message, **fields)

    def __getattr__(self, name):
        return getattr(self._journal, name)


class ContainerWatch(ContainerHook):
    def __init__(self, journal, root, get_config, use_bus: bool | None = None, metrics=None, clock=time.time):
        super().__init__(journal)
        self.root = root
        self.get_config = get_config  # () -> Config: SIGHUP may replace it
        self.use_bus = use_bus
        self.metrics = metrics
        self.clock = clock
        self.history = None
        self.seen: dict = {}  # container id -> frozenset of (finding kind, devices)
        self.risks_said: dict = {}  # container id -> at-risk findings said since it was last clean
        self.repairs_said: dict = {}  # container id -> quiet repair outcomes said for its current findings
        self.problems_said: dict = {}  # container id -> problems (unreadable spec, no baseline write) logged
        self.passes = 0
        self.verify_cache: VerifyCache | None = None  # verify.cache.VerifyCache, made by the first pass (issue 16: reuse what did not change)
        self._pending: set = set()
        self._wake = asyncio.Event()
        self._task = None
        self._last_end = 0.0  # loop time the last verification ended
        self._last_seconds = 0.0  # and how long it ran
        self._last_runtime_only = False  # whether it was asked for by runtime state events alone

    # -- triggers (ContainerHook) -------------------------------------------

    async def started(self) -> None:
        self._request("daemon started")

    async def reload_finished(self) -> None:
        self._request("systemd reload finished")

    async def scope_appeared(self, unit: str) -> None:
        self.journal.debug(f"container scope {unit} appeared: verifying once its hooks have run")
        for delay in SCOPE_RECHECK_DELAYS:
            asyncio.get_running_loop().call_later(delay, self._request, f"new scope {unit}")

    async def runtime_state_written(self, containers: list) -> None:
        names = [c.rpartition("/")[2] for c in containers]
        more = f" and {len(names) - REASON_NAMES} more" if len(names) > REASON_NAMES else ""
        self._request(f"{RUNTIME_REASON}: {', '.join(names[:REASON_NAMES])}{more}")

    async def nodes_changed(self, result) -> None:
        self._request("NVIDIA nodes changed")

    async def periodic(self) -> None:
        self._request("periodic resync")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- the worker -----------------------------------------------------------

    def _request(self, reason: str) -> None:
        self._pending.add(reason)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.ensure_future(self._worker())

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            runtime_only = all(r.startswith(RUNTIME_REASON) for r in self._pending)
            if runtime_only and self._last_runtime_only:
                rest = self._last_end + RUNTIME_DUTY * self._last_seconds - loop.time()
                if rest > 0:
                    await asyncio.sleep(rest)  # a burst of starts: what lands meanwhile joins this pass
            self._wake.clear()
            reasons, self._pending = sorted(self._pending), set()
            started = loop.time()
            try:
                await loop.run_in_executor(None, self.verify_and_repair, ", ".join(reasons))
            except Exception as exc:  # noqa: BLE001 - the link keeper must outlive any verifier bug
                self.journal.log(journalmod.ERR, f"container verification failed: {type(exc).__name__}: {exc}")
            self._last_end = loop.time()
            self._last_seconds = self._last_end - started
            self._last_runtime_only = runtime_only

    def verify_and_repair(self, why: str):
        """One verification of every container (blocking; runs in a worker thread)."""
        from nvsymlinkd.repair.apply import recover_frozen
        from nvsymlinkd.verify import verifier
        from nvsymlinkd.verify.cache import VerifyCache

        if self.verify_cache is None:
            self.verify_cache = VerifyCache()
        config = self.get_config()
        # thaw what a repair killed mid-way (this daemon's before a restart, or a CLI's) left frozen,
        # whatever `repair` says: such a container stands still until someone does
        recover_frozen(self.root, config, self.journal)
        report = verifier.verify_all(self.root, config, update_baseline=True, use_bus=self.use_bus,
                                     with_host=False, cache=self.verify_cache)
        if any(c.baseline == "recorded" and c.verdict == "at-risk" for c in report.containers):
            # a baseline recorded just now makes hook-injected devices expected: decide on it at once,
            # not at the next trigger (a reload may come first and take them)
            report = verifier.verify_all(self.root, config, use_bus=self.use_bus, with_host=False,
                                         cache=self.verify_cache)
        self.passes += 1
        self.journal.debug(f"verified {len(report.containers)} GPU containers in {report.seconds * 1000:.1f} ms ({why})")
        self._journal_changes(report, why)
        if self.metrics is not None:
            self.metrics.on_containers(report)
        if config.repair != "off" and report.problems:
            self._repair(config, report)
        return report

    def _journal_changes(self, report, why: str) -> None:
        from nvsymlinkd.verify import verifier

        live = set()
        at_risk = (verifier.AT_RISK_SCOPE, verifier.AT_RISK_NOT_IN_SPEC, verifier.AT_RISK_UVM)
        for c in report.containers:
            live.add(c.id)
            said = self.problems_said.setdefault(c.id, set())
            for problem in c.problems:
                if problem not in said:  # the same problem comes back at every pass: once is enough
                    said.add(problem)
                    self.journal.warning(f"container {c.short_id} ({c.runtime}): {problem}",
                                         container_id=c.id, unit=c.scope, runtime=c.runtime)
            now = frozenset((f.kind, tuple(f.devices)) for f in c.findings)
            before = self.seen.get(c.id)
            if now == before:
                continue
            self.seen[c.id] = now
            self.repairs_said.pop(c.id, None)  # new findings: the repair outcome is news again
            risks = self.risks_said.setdefault(c.id, set())
            for kind, priority, message, fields in verifier.journal_entries(c):
                f_key = next((k for k in now if verifier.JOURNAL_KINDS[k[0]] == kind), None)
                if before is not None and f_key in before:
                    continue  # already said
                if f_key is not None and f_key[0] in at_risk:
                    if f_key in risks:
                        continue  # said before a loss and its repair brought it back: still the same risk
                    risks.add(f_key)
                self.journal.event(kind, priority, f"{message} (check triggered by: {why})", **fields)
            lost_before = before is not None and any(k[0] == verifier.LOST for k in before)
            usable_now = not any(k[0] in (verifier.LOST, verifier.UNKNOWN) for k in now)
            if (not now and before) or (lost_before and usable_now):
                # an at-risk container (a hook's grant) is back to at-risk, not to clean: it can open them too
                self.journal.event(verifier.JOURNAL_KINDS[verifier.OK], journalmod.NOTICE,
                                   f"container {c.short_id} ({c.runtime}) can open all its GPU devices again",
                                   container_id=c.id, unit=c.scope, runtime=c.runtime)
            if not now:
                self.risks_said.pop(c.id, None)
        for gone in [cid for cid in self.seen if cid not in live]:
            del self.seen[gone]
            self.risks_said.pop(gone, None)
            self.repairs_said.pop(gone, None)
        for gone in [cid for cid in self.problems_said if cid not in live]:
            del self.problems_said[gone]

    def _repair(self, config, report) -> None:
        from nvsymlinkd.repair.apply import RepairHistory, repair_all

        if self.history is None:
            self.history = RepairHistory()
        self.history.forget_except([c.id for c in report.containers])
        results = repair_all(self.root, config, report=report, history=self.history, clock=self.clock,
                             journal=_SayOnce(self.journal, self.repairs_said), use_bus=self.use_bus)
        if self.metrics is not None:
            for r in results:
                self.metrics.on_repair(r, r.ok)
        if any(r.status in ("repaired", "prevented") for r in results):
            # what changed is worth journaling as the new state; the next trigger would too, later
            from nvsymlinkd.verify import verifier

            fresh = verifier.verify_all(self.root, config, use_bus=self.use_bus, with_host=False,
                                        cache=self.verify_cache)
            self._journal_changes(fresh, "after repair")
            if self.metrics is not None:
                self.metrics.on_containers(fresh)
