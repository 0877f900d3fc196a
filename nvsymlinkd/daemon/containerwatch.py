"""The daemon's container side: verify GPU containers on events, journal findings, repair.

Plugged into nvsymlinkd.daemon.loop.Daemon as its ContainerHook (daemon/hook.py). Every trigger
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
import os
import threading
import time
from typing import TYPE_CHECKING

from nvsymlinkd import journal as journalmod
from nvsymlinkd.daemon.hook import ContainerHook
from nvsymlinkd.host import libc
from nvsymlinkd.verify.journaldiff import JournalState, finding_key, journal_changes, repair_is_news
from nvsymlinkd.verify.kinds import FindingKind

if TYPE_CHECKING:  # imported when the first repair runs (the daemon starts without it)
    from nvsymlinkd.repair.plan import RepairHistory

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
# On cgroup v1 systemd re-applies a unit's device policy by writing "a" to devices.deny, then one
# devices.allow per DeviceAllow= entry (src/core/cgroup.c, cgroup_apply_devices): at every reload,
# re-exec and SetUnitProperties (runc update) each scope denies everything for tens of ms (measured
# up to ~200 ms under qemu TCG). A read inside that window shows devices lost that are not. A new
# finding a window can make (a loss, uvm not granted, unknown) is read again before it is journaled
# or repaired: after systemd finished reloading, then SETTLE_SECONDS later. A real loss persists.
# On cgroup v2 systemd attaches a unit's new device program before it detaches the old one
# (src/core/bpf-devices.c, bpf_devices_apply_policy): no deny-all moment, so a loss read there is
# real and is repaired at once (waiting for the reload and a second read kept a container without
# its GPUs seconds longer when reloads came back to back). Only an unreadable program can pass.
WINDOW_KINDS = frozenset({FindingKind.LOST, FindingKind.DENIED, FindingKind.AT_RISK_UVM, FindingKind.UNKNOWN})
WINDOW_KINDS_V2 = frozenset({FindingKind.UNKNOWN})
SETTLE_SECONDS = 0.5
RELOAD_WAIT = 15.0  # at most this long for Reloading(false) (a missed signal must not stall the verifier)
CONFIRM_READS = 3  # reads after the first, while each shows a new finding the one before did not
# Node events ask for a verification this long after the first of them (the ones meanwhile join it): a
# container's access to a node that just appeared is judged within a second, and a host making 2,000
# nodes one at a time is verified a few times, not 2,000 (each event's link then waited on it).
NODES_DELAY = 1.0
# A verification of at least this many containers gives its heap's free pages back (malloc_trim: ~1.5 MiB
# after 1,000 containers; a few ms). Fewer leave little behind.
TRIM_CONTAINERS = 100


class _SayOnce:
    """The daemon's journal for repair_all, minus repeats of a quiet repair outcome already said
    (journaldiff.repair_is_news; the watch keeps the state)."""

    def __init__(self, journal, watch: ContainerWatch):
        self._journal = journal
        self._watch = watch

    def event(self, kind: str, priority: int, message: str, **fields) -> None:
        news, self._watch.said = repair_is_news(self._watch.said, fields.get("container_id"), kind, message)
        if news:
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
        self.history: RepairHistory | None = None
        self.said = JournalState()  # what the journal was told about each container (verify/journaldiff)
        self.passes = 0
        self.bus_error_said = False  # systemd's silence on the bus was journaled, and it has not answered since
        self.verify_cache: VerifyCache | None = None  # verify.cache.VerifyCache, made by the first pass (issue 16: reuse what did not change)
        self._pending: dict = {}  # reason (the journal's text) -> whether runtime state events alone asked it
        self._pending_ids: set = set()  # the containers runtime state events named since the last pass
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_end = 0.0  # loop time the last verification ended
        self._last_seconds = 0.0  # and how long it ran
        self._last_runtime_only = False  # whether it was asked for by runtime state events alone
        self._not_reloading = threading.Event()  # set while systemd is not reloading (as far as the bus says)
        self._not_reloading.set()
        self.settle = SETTLE_SECONDS
        self._nodes_timer: asyncio.TimerHandle | None = None  # the pending "NVIDIA nodes changed" request
        # unit -> (container, its entries): creation-time drop-ins written while systemd reloaded, which that
        # reload may have loaded the scope without (reassert_after_reload)
        self._written_in_reload: dict = {}

    # -- triggers (ContainerHook) -------------------------------------------

    async def started(self) -> None:
        self._request("daemon started")

    async def reload_finished(self) -> None:
        if self._written_in_reload:
            await asyncio.get_running_loop().run_in_executor(None, self.reassert_after_reload)
        self._request("systemd reload finished")

    def systemd_reloading(self, reloading: bool) -> None:
        if reloading:
            self._not_reloading.clear()
        else:
            self._not_reloading.set()

    def reloading(self) -> bool:
        """Whether systemd is reloading now, as its Reloading signals said (it answers no bus call then)."""
        return not self._not_reloading.is_set()

    async def scope_appeared(self, unit: str) -> None:
        loop = asyncio.get_running_loop()
        # before anything else: a drop-in of ours that is not this scope's (an earlier scope of the same
        # name: runc names scopes after containers, and `runc delete` frees the name) must not reach it
        await loop.run_in_executor(None, self.clear_inherited, unit)
        self.journal.debug(f"container scope {unit} appeared: verifying once its hooks have run")
        for delay in SCOPE_RECHECK_DELAYS:
            loop.call_later(delay, self._request, f"new scope {unit}")
        if self.get_config().repair == "auto":
            # a reload between the NVIDIA hook's grant and the pass state.json triggers must keep the
            # grant: written to a drop-in of ours, never to the scope's live policy (systemd.dropin)
            await loop.run_in_executor(None, self.keep_while_creating, unit)

    async def scope_announced_again(self, unit: str) -> None:
        # the same scope (a reload keeps its InvocationID) or another of the same name: only a drop-in of
        # ours that is no live scope's goes (dropin.is_stale; a stat here, the bus asked only when there is one)
        from nvsymlinkd.systemd import dropin

        if dropin.owner(self.root, unit) is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.clear_inherited, unit, False)

    def scope_gone(self, unit: str) -> None:
        """systemd dropped the scope (UnitRemoved outside a reload: systemd.bus): its drop-in of ours goes
        now, on the loop (a few syscalls on /run), before a new scope of the same name can be announced."""
        from nvsymlinkd.systemd import dropin

        try:
            if dropin.remove(self.root, unit):
                self.journal.debug(f"removed the drop-in of {unit}: systemd dropped the scope")
        except (OSError, ValueError) as exc:
            self.journal.log(journalmod.WARNING, f"cannot remove the drop-in of {unit}: {exc}")

    def clear_inherited(self, unit: str, new: bool = True) -> bool:
        """Remove the scope's drop-in of ours when it is no live scope's (systemd.dropin.is_stale): its
        owner line names another InvocationID than systemd says the scope has now; or, where either is not
        known (an owner line with none; systemd answering nothing during a reload), it is older than the
        scope's transient unit file. systemd is asked once it has finished reloading (for a new scope at
        once, then after the reload: after a daemon restart every scope's first UnitNew looks new, and one
        may come during a reload). Blocking (a worker thread). True when one was removed."""
        from nvsymlinkd.systemd import dropin
        from nvsymlinkd.systemd.scopes import scope_invocation

        found = dropin.owner(self.root, unit)
        if found is None:
            return False
        now = None
        if found[1] != "-":
            if not new:
                self._not_reloading.wait(RELOAD_WAIT)
            now = scope_invocation(self.root, unit, self.use_bus)
            if now is None:
                self._not_reloading.wait(RELOAD_WAIT)  # systemd answers no call while it reloads
                now = scope_invocation(self.root, unit, self.use_bus)
        try:
            removed = dropin.remove_stale(self.root, unit, now)
        except (OSError, ValueError) as exc:
            self.journal.log(journalmod.WARNING, f"cannot remove the drop-in of {unit}: {exc}")
            return False
        if removed:
            why = f"not its InvocationID {now}" if now is not None else "older than the scope's transient unit file"
            self.journal.log(journalmod.NOTICE, f"container scope {unit} announced with a drop-in of ours written "
                             f"for an earlier scope of that name ({why}): removed {dropin.dropin_path(unit)}",
                             unit=unit)
        return removed

    async def runtime_state_written(self, containers: list) -> None:
        names = [c.rpartition("/")[2] for c in containers]
        more = f" and {len(names) - REASON_NAMES} more" if len(names) > REASON_NAMES else ""
        # a name in parentheses ("(overflow)", "(unreadable events)") names no container: all are verified
        self._pending_ids.update(n if not n.startswith("(") else None for n in names)
        self._request(f"{RUNTIME_REASON}: {', '.join(names[:REASON_NAMES])}{more}", runtime=True)

    async def nodes_changed(self, result) -> None:
        # at most one verification per NODES_DELAY for node changes: one per event made every mknod's pass
        # wait on a verification of every container against every node (the GIL), O(nodes) per event: at
        # 2,006 nodes mknod -> link p50 9.8 ms against 1.2 ms without (issue 38)
        if self._nodes_timer is None:
            self._nodes_timer = asyncio.get_running_loop().call_later(NODES_DELAY, self._nodes_settled)

    def _nodes_settled(self) -> None:
        self._nodes_timer = None
        self._request("NVIDIA nodes changed")

    async def periodic(self) -> None:
        self._request("periodic resync")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._nodes_timer is not None:
            self._nodes_timer.cancel()

    def _say_bus_error(self, error: str | None) -> None:
        """systemd not answering for the scopes' DeviceAllow: journaled once when it starts (the unit files
        answer meanwhile), not at every pass."""
        if error and not self.bus_error_said:
            self.bus_error_said = True
            self.journal.log(journalmod.WARNING, f"systemd did not answer on the system bus ({error}); container "
                             "scopes are judged from systemd's unit files in /run/systemd until it does")
        elif not error:
            self.bus_error_said = False

    def keep_while_creating(self, unit: str) -> list | None:
        """Write to the scope's drop-in of ours (systemd.dropin) what the NVIDIA hook's trusted
        reconstruction and the container's spec grant and the scope's DeviceAllow lacks, while runc
        creates the container: a daemon-reload from then on re-applies them. Nothing live changes: a
        SetUnitProperties now makes systemd swap its device program under runc's and the hook's
        BPF_F_REPLACE, and the container fails to start (docs/daemon.md). Blocking (a worker thread).
        Returns the (Device, Access) entries written; None when nothing was written."""
        from nvsymlinkd.daemon.inotify import CreationWatch
        from nvsymlinkd.systemd import dropin
        from nvsymlinkd.systemd.scopes import scope_invocation
        from nvsymlinkd.verify import verifier

        # asked now, before runc sends its Set: a scope's InvocationID is made when systemd starts it and
        # stays its own (src/core/unit.c, unit_acquire_invocation_id); a D-Bus round trip after the Set is
        # time a reload can land in before the drop-in is there (issue 38)
        invocation = scope_invocation(self.root, unit, self.use_bus)
        try:
            found = verifier.creating_grants(self.root, self.get_config(), unit, use_bus=self.use_bus,
                                             watch=lambda scope, state_dir: CreationWatch(self.root, scope, state_dir,
                                                                                         reloading=self.reloading))
        except Exception as exc:  # noqa: BLE001 - the pass after state.json still judges the container
            self.journal.log(journalmod.WARNING, f"container scope {unit}: cannot read the container being "
                             f"created: {type(exc).__name__}: {exc}")
            return None
        if found is None:
            self.journal.debug(f"container scope {unit}: no container being created names it in its spec")
            return None
        c, hook, missing, seen, refused = found
        if hook is not None and not hook.trusted:
            self.journal.debug(f"container {c.id} ({unit}) being created: the NVIDIA hook's grant is not "
                               f"reconstructed ({hook.detail}): only the spec's devices are kept")
        if refused:
            self.journal.log(journalmod.INFO, f"container {c.id} ({unit}) being created: no drop-in written, "
                             f"{refused}; its state is judged once written ({seen})", container_id=c.id, unit=unit)
            return None
        if not missing:
            self.journal.debug(f"container {c.id} ({unit}) being created: its DeviceAllow lacks nothing ({seen})")
            return None
        self.journal.debug(f"container {c.id} ({unit}) being created: {seen}")
        shown = ", ".join(f"{d} {a}" for d, a in missing)
        if invocation is None:  # systemd had not said it yet
            invocation = scope_invocation(self.root, unit, self.use_bus)
        if invocation is None:
            # a drop-in that names no scope could outlive this one and reach the next of the name
            self.journal.log(journalmod.WARNING, f"container {c.id} ({unit}) being created: no drop-in written "
                             f"for {shown}, systemd did not say the scope's InvocationID (a drop-in must name "
                             "its scope); the pass after its state is written prevents the loss",
                             container_id=c.id, unit=unit)
            return None
        try:
            path = dropin.write(self.root, unit, c.id, invocation, missing)
        except (OSError, ValueError) as exc:
            self.journal.log(journalmod.WARNING, f"container {c.id} ({unit}) being created: cannot write {shown} "
                             f"to a drop-in of its scope: {exc}; the pass after its state is written prevents",
                             container_id=c.id, unit=unit)
            return None
        self.journal.log(journalmod.INFO, f"container {c.id} ({unit}) being created: wrote {shown} to {path} "
                         "(its spec and the NVIDIA hook's grant), so a daemon-reload keeps them; its live device "
                         "policy is left to runc", container_id=c.id, unit=unit)
        if self.reloading():
            self._written_in_reload[unit] = (c, list(missing))
        return list(missing)

    def reassert_after_reload(self) -> None:
        """After a reload that was under way when a creation-time drop-in was written: systemd reads a unit's
        drop-ins when it loads the unit, and a reload loads every unit again after its generators have run
        (src/core/manager.c at v252.39, manager_reload: Reloading(true) 3404, generators 3423, the units
        deserialized, and with them loaded, 3435; their cgroups realized again afterwards, src/core/unit.c 3672,
        unit_catchup -> unit_cgroup_catchup): a file written
        after that is read only at the next reload, and this reload's re-apply lacked the grant. systemd says
        which drop-ins it loaded (Unit.DropInPaths). One it did not load, for a container still being created:
        on cgroup v1, where systemd re-applies a scope by devices.deny/devices.allow writes and no program
        is swapped under runc's or the hook's BPF_F_REPLACE, the entries go to the live scope at once
        (SetUnitProperties, runtime=true); on v2 nothing live changes while runc creates the container, and
        the pass after its state is written gives the grant back. Blocking (a worker thread)."""
        from nvsymlinkd.containers.discovery import still_creating
        from nvsymlinkd.host.devices import Access
        from nvsymlinkd.systemd import client, dropin
        from nvsymlinkd.systemd.deviceallow import DeviceAllow
        from nvsymlinkd.systemd.scopes import bus_allowed

        written, self._written_in_reload = self._written_in_reload, {}
        use_bus = bus_allowed(self.root) if self.use_bus is None else self.use_bus
        for unit, (c, missing) in sorted(written.items()):
            if not use_bus or not still_creating(self.root, c):
                continue  # its state is written: the pass that follows judges it
            try:
                loaded = client.shared().dropin_paths(unit)
            except client.SystemdCallError as exc:
                self.journal.debug(f"container {c.id} ({unit}) being created: systemd did not say the drop-ins "
                                   f"it loaded after the reload ({exc})")
                continue
            if loaded is None or dropin.dropin_path(unit) in loaded:
                continue
            shown = ", ".join(f"{d} {a}" for d, a in missing)
            if not os.path.isdir(self.root.path("/sys/fs/cgroup/devices")):
                self.journal.log(journalmod.WARNING, f"container {c.id} ({unit}) being created: systemd's reload "
                                 f"loaded the scope before its drop-in was written and re-applied it without "
                                 f"{shown}; the pass after its state is written gives them back",
                                 container_id=c.id, unit=unit)
                continue
            try:
                client.shared().set_device_allow(unit, [DeviceAllow.of_device(d, str(Access(a))) for d, a in missing])
            except client.SystemdCallError as exc:
                self.journal.log(journalmod.WARNING, f"container {c.id} ({unit}) being created: cannot give back "
                                 f"{shown} after the reload: {exc}", container_id=c.id, unit=unit)
                continue
            self.journal.log(journalmod.INFO, f"container {c.id} ({unit}) being created: systemd's reload loaded "
                             f"the scope before its drop-in was written; gave back {shown} (cgroup v1: "
                             "SetUnitProperties)", container_id=c.id, unit=unit)

    def _remove_stale_dropins(self) -> None:
        """The drop-ins of ours whose scope systemd no longer has (systemd.dropin), or whose scope is
        another one now (the name was reused while no daemon listened: its InvocationID differs, or,
        where one is not known, the drop-in is older than the scope's transient unit file)."""
        from nvsymlinkd.systemd import dropin
        from nvsymlinkd.systemd.scopes import scope_invocation

        stale = set(dropin.stale_dropins(self.root))
        for scope in dropin.ours_dropins(self.root):
            try:
                if scope in stale:
                    if dropin.remove(self.root, scope):
                        self.journal.debug(f"removed the drop-in of {scope}: the scope is gone")
                    continue
                found = dropin.owner(self.root, scope)
                now = scope_invocation(self.root, scope, self.use_bus) if found and found[1] != "-" else None
                if dropin.remove_stale(self.root, scope, now):
                    self.journal.debug(f"removed the drop-in of {scope}: written for an earlier scope of that name")
            except (OSError, ValueError) as exc:
                self.journal.log(journalmod.WARNING, f"cannot remove {dropin.dropin_path(scope)}: {exc}")

    # -- the worker -----------------------------------------------------------

    def _request(self, reason: str, runtime: bool = False) -> None:
        self._pending[reason] = runtime
        self._wake.set()
        if self._task is None:
            self._task = asyncio.ensure_future(self._worker())

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            runtime_only = all(self._pending.values())
            if runtime_only and self._last_runtime_only:
                rest = self._last_end + RUNTIME_DUTY * self._last_seconds - loop.time()
                if rest > 0:
                    await asyncio.sleep(rest)  # a burst of starts: what lands meanwhile joins this pass
            self._wake.clear()
            pending, self._pending = self._pending, {}
            reasons = sorted(pending)
            ids, self._pending_ids = self._pending_ids, set()
            # runtime state events alone: only the containers they name (their hooks just ran: the
            # sooner they are judged, the sooner a hook's grant is protected from the next reload)
            # (asked again: another reason may have come while the burst's pass waited above)
            runtime_only = all(pending.values())
            only = frozenset(ids) if runtime_only and ids and None not in ids else None
            started = loop.time()
            try:
                await loop.run_in_executor(None, self.verify_and_repair, ", ".join(reasons), only)
            except Exception as exc:  # noqa: BLE001 - the link keeper must outlive any verifier bug
                self.journal.log(journalmod.ERR, f"container verification failed: {type(exc).__name__}: {exc}")
            self._last_end = loop.time()
            self._last_seconds = self._last_end - started
            self._last_runtime_only = runtime_only

    def verify_and_repair(self, why: str, only: frozenset | None = None):
        """One verification of every container, or of those with the ids in `only` (blocking; runs in a
        worker thread)."""
        from nvsymlinkd.repair.freeze import recover_frozen
        from nvsymlinkd.verify import verifier
        from nvsymlinkd.verify.cache import VerifyCache

        if self.verify_cache is None:
            self.verify_cache = VerifyCache()
        config = self.get_config()
        # thaw what a repair killed mid-way (this daemon's before a restart, or a CLI's) left frozen,
        # whatever `repair` says: such a container stands still until someone does
        recover_frozen(self.root, config, self.journal)
        # no baseline from a read while systemd reloads: on cgroup v1 its device re-apply may have
        # denied part of the container's devices for that moment, and a baseline never grows back
        # the NVIDIA hook's inputs are recorded at a container's first sight whatever systemd does (they are
        # the host's files, not the cgroup): a later edit of the toolkit's config changes no grant made before
        report = verifier.verify_all(self.root, config, update_baseline=self._not_reloading.is_set(),
                                     use_bus=self.use_bus, with_host=False, cache=self.verify_cache, only=only,
                                     record_inputs=True)
        self._say_bus_error(report.bus_error)
        report = self._confirmed(config, report, only)
        self.passes += 1
        self.journal.debug(f"verified {len(report.containers)} GPU containers in {report.seconds * 1000:.1f} ms ({why})")
        self._journal_changes(report, why, partial=only is not None)
        if self.metrics is not None and only is None:  # the gauges count every container
            self.metrics.on_containers(report)
        if config.repair != "off" and report.problems:
            self._repair(config, report, only)
        if only is None:
            self._remove_stale_dropins()
        if len(report.containers) >= TRIM_CONTAINERS:  # daemon/passes.py trims after a full link pass
            libc.malloc_compact()
        return report

    def _new_in_window(self, report) -> dict:
        """container id -> the findings a device re-apply window could explain, not said before."""
        out = {}
        for c in report.containers:
            before = self.said.findings.get(c.id, frozenset())
            window = WINDOW_KINDS if c.cgroup.get("devices") else WINDOW_KINDS_V2
            new = frozenset(k for k in map(finding_key, c.findings) if k[0] in window and k not in before)
            if new:
                out[c.id] = new
        return out

    def _confirmed(self, config, report, only: frozenset | None = None):
        """The report to journal and repair from: read again while a new loss may be a re-apply window.

        Only what persists across two reads, the second outside systemd's reload and after the
        window had time to close, is judged; what a read after that shows is what there is
        (unknown is never allow: a read that cannot decide is reported as such).
        """
        from nvsymlinkd.verify import verifier

        suspects = self._new_in_window(report)
        for _ in range(CONFIRM_READS):
            if not suspects:
                break
            names = ", ".join(f"{cid[:12]} ({', '.join(sorted(k.value for k, _ in keys))})"
                              for cid, keys in sorted(suspects.items()))
            if not self._not_reloading.is_set():
                self.journal.debug(f"new findings while systemd reloads: {names}; judging after the reload")
                self._not_reloading.wait(RELOAD_WAIT)
            self.journal.debug(f"new findings: {names}; reading again in {self.settle:g} s "
                               "(systemd's device re-apply denies all for a moment on cgroup v1)")
            time.sleep(self.settle)
            report = verifier.verify_all(self.root, config, use_bus=self.use_bus, with_host=False, only=only)
            now = self._new_in_window(report)
            # persisted from the read before: confirmed; anything new this time is read once more
            suspects = {cid: keys - suspects.get(cid, frozenset()) for cid, keys in now.items()}
            suspects = {cid: keys for cid, keys in suspects.items() if keys}
        return report

    def _journal_changes(self, report, why: str, partial: bool = False) -> None:
        entries, self.said = journal_changes(self.said, report, why, partial=partial)
        for e in entries:
            if e.kind is None:
                self.journal.log(e.priority, e.message, None, **e.fields)
            else:
                self.journal.event(e.kind, e.priority, e.message, **e.fields)

    def _repair(self, config, report, only: frozenset | None = None) -> None:
        from nvsymlinkd.repair.apply import repair_all
        from nvsymlinkd.repair.plan import RepairHistory

        if self.history is None:
            self.history = RepairHistory()
        if only is None:  # a report of every container: the history of those gone can go
            self.history.forget_except([c.id for c in report.containers])
        results = repair_all(self.root, config, report=report, history=self.history, clock=self.clock,
                             journal=_SayOnce(self.journal, self), use_bus=self.use_bus)
        if self.metrics is not None:
            for r in results:
                self.metrics.on_repair(r, r.ok)
        if any(r.status in ("repaired", "prevented") for r in results):
            # what changed is worth journaling as the new state; the next trigger would too, later
            from nvsymlinkd.verify import verifier

            fresh = verifier.verify_all(self.root, config, use_bus=self.use_bus, with_host=False,
                                        cache=self.verify_cache, only=only)
            self._journal_changes(fresh, "after repair", partial=only is not None)
            if self.metrics is not None and only is None:
                self.metrics.on_containers(fresh)
