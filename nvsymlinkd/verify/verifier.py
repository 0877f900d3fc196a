"""Verdicts on GPU containers, gathered from the host: `verify_all()` / `verify_container()` read each
container's facts (runtime state, spec, baseline, device cgroup, its /dev, its scope's DeviceAllow, the
host's NVIDIA nodes) and hand them to the pure `verify.evaluate.evaluate()`, which decides (the daemon
and `nvsymlinkd check` call them). The report's types and words live in verify/evaluate.py and
verify/kinds.py; the names below stay importable from here for the callers.

cache: the daemon's verify.cache.VerifyCache, kept from pass to pass, or a verify.cache.NoCache that
keeps nothing: one path through the gathering either way.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

from nvsymlinkd.access.cgroup import AccessPolicy, CgroupMounts, find_cgroup_mounts, read_access
from nvsymlinkd.config import Config
from nvsymlinkd.containers import baseline as baselinemod
from nvsymlinkd.containers import hookrecord
from nvsymlinkd.containers.discovery import (
    Container,
    container_dev_nodes,
    discover,
    find,
    still_creating,
)
from nvsymlinkd.containers.expected import (
    Expected,
    candidate_devices,
    expected_access,
    nvidia_majors_of,
)
from nvsymlinkd.containers.hookgrant import HookGrant, HookRequest, legacy_hook, reconstruct
from nvsymlinkd.containers.ocispec import gpu_signs
from nvsymlinkd.devchar.snapshot import observe, read_majors
from nvsymlinkd.errors import CgroupPathError
from nvsymlinkd.host.paths import normalize
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd.scopes import ScopeDevices, map_entries, read_scopes, wait_for_scope
from nvsymlinkd.verify.cache import Cache, NoCache, VerifyCache
from nvsymlinkd.verify.evaluate import (
    NOT_GPU,
    ContainerReport,
    HostDevices,
    Report,
    baseline_devices,
    evaluate,
)
from nvsymlinkd.verify.hostcheck import check_host

# A container being created: how long the daemon waits for the runtime's device policy to show on the
# new scope (runc sends it right before the hooks; under qemu TCG 0.4-3 s after UnitNew), and how often
# it asks where nothing wakes it (the daemon's wait wakes on the scope's transient drop-ins and the
# container's state directory: daemon.inotify.CreationWatch). Past the wait, or once the state file is written, the scope is judged as it reads then.
POLICY_WAIT = 30.0
POLICY_POLL = 0.01

# ---------------------------------------------------------------------------
# Gathering: read the host once, then evaluate every container.


class _HostContext:
    """What every container's evaluation shares: majors, host nodes, scopes, the access reader.

    The whole HostSnapshot (with /dev/char, a readlink per link) only for the host findings; the
    containers need the nodes alone, which the daemon's cache scans again only when they changed.
    """

    def __init__(self, root: HostRoot, config: Config, with_host: bool, cache: Cache, record_inputs: bool = False):
        self.snapshot = None
        self.config = config
        self.cache = cache
        self.record_inputs = record_inputs  # the daemon's passes: a container's first sight records the hook's inputs
        self.hook_notes: dict = {}  # (namespace, id) -> what the hook grant was judged on (the report's nvidia_hook.inputs)
        if with_host:
            self.snapshot = observe(root, config.driver_root, config.dev_char_path, with_driver_info=False)
            majors, nodes = self.snapshot.majors, self.snapshot.nodes
        else:
            majors = read_majors(root)
            driver_root = normalize(config.driver_root)
            nodes = cache.host_nodes(root, driver_root, majors)
        self.majors = majors
        # what every container's inputs share: the objects kept from the last pass when equal, so that the
        # cache compares them by identity in each container's inputs
        self.nvidia_majors = cache.same("nvidia majors", nvidia_majors_of(majors))
        self.host = cache.same("host", HostDevices(nodes, nvidia_majors_of(majors), majors.major("nvidia-uvm")))
        self.mounts = find_cgroup_mounts(root)  # cgroup mounts, read once for all containers
        self.root = root
        self._hook_driver = None  # hookgrant.DriverMap, read once a pass when a container has the hook
        self._hook_inputs: dict = {}  # hook entry -> hookgrant.HookInputs
        self._hook_memo: dict = {}  # (config path, dialect) -> the file's ToolkitConfig, once a pass

    def hook_inputs(self, entry):
        """The NVIDIA hook's host inputs for this spec hook entry (its wrapper, the toolkit's version, the
        config its search finds, the driver map): read once a pass per distinct entry."""
        from nvsymlinkd.containers.hookhost import read_driver_map, read_hook_inputs

        if self._hook_driver is None:
            self._hook_driver = read_driver_map(self.root, self.host.nodes, self.config.driver_root)
        if entry not in self._hook_inputs:
            self._hook_inputs[entry] = read_hook_inputs(self.root, entry, self.host.nodes, self._hook_driver,
                                                        self._hook_memo)
        return self._hook_inputs[entry]


def hook_request(spec) -> HookRequest:
    return HookRequest(spec.hook_entries, spec.env, spec.device_list_mounts, spec.privileged)


def _hook_grant(c: Container, ctx: _HostContext):
    """The NVIDIA hook's reconstructed grant (hookgrant.HookGrant), None without the legacy hook; judged on
    the inputs recorded at the container's first sight when there is a record (containers.hookrecord)."""
    if c.spec is None or not c.spec.hook_entries:
        return None
    request = hook_request(c.spec)
    entry = legacy_hook(request.hooks)
    if entry is None:
        return None
    current = ctx.hook_inputs(entry)
    inputs = _container_hook_inputs(c, entry, ctx, current)
    grant = reconstruct(request, inputs)
    if grant is None or not grant.trusted or inputs is current:
        return grant
    # the recorded IMEX channels are c M:N with the major of the first sight: the dynamic major of another
    # driver load may name another device now, so they hold only while the major is still the one recorded
    if grant.imex and current.driver.imex.major != inputs.driver.imex.major:
        return HookGrant(False, {}, f"the IMEX channels the hook granted were c {inputs.driver.imex.major}:N; "
                                    f"/proc/devices' nvidia-caps-imex-channels major is {current.driver.imex.major} "
                                    "now (the driver was loaded again)")
    if not grant.mig:
        return grant
    # MIG instances made again keep their slots' minors: a grant judged on the inputs of its first sight
    # holds only while NVML still names each granted instance by the same UUID (issue 35, item 4)
    now = set(current.driver.mig_uuids or ())
    then = {u: (u, g, gi, ci) for u, g, gi, ci in inputs.driver.mig_uuids or ()}
    gone = [m.uuid for m in grant.mig if then.get(m.uuid) not in now]
    if gone:
        return HookGrant(False, {}, f"the MIG instance {', '.join(gone)} the hook granted is not the one NVML lists "
                                    f"now (destroyed, made again, or NVML unreadable: {current.driver.mig_uuids_why or 'ok'})")
    return grant


def _container_hook_inputs(c: Container, entry, ctx: _HostContext, current):
    """The inputs recorded at c's first sight, else `current` (recorded now in the daemon's pass when c
    is live); what was used and what differs goes to ctx.hook_notes."""
    rec = None
    if c.live and c.init_start is not None:
        path = ctx.root.path(hookrecord.record_path(ctx.config, c.id))
        if not ctx.cache.absent(path):
            rec = hookrecord.load(ctx.root, ctx.config, c.id, c.init_start, entry, ctx.cache.files)
        if rec is None and ctx.record_inputs:
            try:
                rec = hookrecord.record(ctx.root, ctx.config, c.id, c.init_start, entry, current)
            except (OSError, ValueError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                ctx.hook_notes[(c.namespace, c.id)] = {
                    "recorded": False, "recorded_at": None, "differences": [],
                    "detail": f"judged on the host's current inputs: cannot record them: {why}"}
                return current
            ctx.hook_notes[(c.namespace, c.id)] = {
                "recorded": True, "recorded_at": rec.recorded_at, "differences": [],
                "detail": "judged on the inputs recorded now, at its first sight"}
            return current
    if rec is None:
        ctx.hook_notes[(c.namespace, c.id)] = {
            "recorded": False, "recorded_at": None, "differences": [],
            "detail": "judged on the host's current inputs: no record of them from its first sight"}
        return current
    diffs = hookrecord.differences(rec.inputs, current)
    ctx.hook_notes[(c.namespace, c.id)] = {
        "recorded": True, "recorded_at": rec.recorded_at, "differences": diffs,
        "detail": "judged on the inputs recorded at its first sight"
                  + (f"; the host's differ now: {'; '.join(diffs)}" if diffs else "")}
    return rec.inputs


def read_policy(root: HostRoot, c: Container, mounts: CgroupMounts, cache: Cache) -> AccessPolicy:
    """The container's device access; CgroupPathError when no cgroup of it is known."""
    if c.cgroup_v1_devices is None and c.cgroup_v2 is None:
        raise CgroupPathError(f"no cgroup known for init pid {c.init_pid}")
    return read_access(root, c.cgroup_v1_devices, c.cgroup_v2, mounts, cache)



def _expect(c: Container, base, ctx: _HostContext, hook=None) -> tuple:
    signs = gpu_signs(c.spec, c.state, ctx.nvidia_majors)
    cands = candidate_devices(ctx.host.devices, c.spec, c.state, base, ctx.nvidia_majors, hook)
    return signs, expected_access(cands, c.spec, c.state, base, hook)


def _evaluate(c: Container, signs, expected: Expected, policy, why, scope_devices, host: HostDevices, dev_nodes,
              cache: Cache) -> ContainerReport:
    # every input of evaluate(), as values: the container's every field (spec and runtime state
    # included), the policy by what it was read from, the scope's DeviceAllow, the host's nodes
    inputs = (tuple(vars(c).values()), signs, expected, policy.key if policy is not None else None, why,
              scope_devices, host, tuple(dev_nodes))
    report, hit = cache.memo("verdict", (c.namespace, c.id), inputs,
                             lambda: evaluate(c, signs, expected, policy, why, scope_devices, host, dev_nodes))
    if hit:
        cache.verdict_hits += 1
    # a copy the caller may amend (baseline, problems), the kept one stays as evaluate() made it
    # (copy.copy's shallow copy, without its reduce protocol: one per container per pass)
    kept, report = report, object.__new__(ContainerReport)
    report.__dict__.update(kept.__dict__)
    report.findings = list(kept.findings)
    return report


def _baseline(root: HostRoot, config: Config, c: Container, cache: Cache):
    if not c.live:
        return None
    if cache.absent(root.path(baselinemod.baseline_path(config, c.id))):
        return None  # what load() answers for a missing file, without opening it (most containers have none)
    return baselinemod.load(root, config, c.id, c.init_start, cache.files)


def _prepare(root: HostRoot, config: Config, ctx: _HostContext, c: Container, cache: Cache) -> tuple:
    """(baseline, gpu signs, expected access): all a container needs before its cgroup and scope are read."""
    base = _baseline(root, config, c, cache)
    return (base,) + _expected(c, base, ctx, cache)


def _is_gpu(prepared: tuple) -> bool:
    _, signs, expected = prepared
    return bool(signs or expected.devices)


def _verify_one(root: HostRoot, config: Config, ctx: _HostContext, c: Container, prepared: tuple,
                scope_devices: ScopeDevices | None, update_baseline: bool, cache: Cache) -> ContainerReport:
    """prepared: _prepare's (baseline, signs, expected) for c."""
    base, signs, expected = prepared
    if not _is_gpu(prepared):
        return _evaluate(c, signs, expected, None, None, None, ctx.host, (), cache)
    policy: AccessPolicy | None = None
    why: str | None = None
    if c.live:
        try:
            policy = read_policy(root, c, ctx.mounts, cache)
        except Exception as exc:  # noqa: BLE001 - the boundary: a failure to read is the finding's detail, never 'ok'
            why = str(exc) or exc.__class__.__name__
    if policy is None and c.init_pid and not os.path.exists(root.path(f"/proc/{c.init_pid}")):
        # deleted between discovery and the cgroup read: gone, not "unknown"
        c.status = "stopped"
    dev_nodes = container_dev_nodes(root, c.init_pid) if c.live and c.init_pid else []
    report = _evaluate(c, signs, expected, policy, why, scope_devices, ctx.host, dev_nodes, cache)
    _note_inputs(report, c, ctx)
    if base is not None:
        report.baseline = "loaded"
    elif update_baseline:
        devices = baseline_devices(report)
        if devices:
            try:
                base = baselinemod.record(root, config, c.id, c.init_start, devices)
            except OSError as exc:
                report.problems = report.problems + (f"cannot write baseline: {exc.strerror}",)
            else:
                # judged again at once on what was just recorded (the same reads): what a hook granted
                # is expected from now on, so it is at risk in this pass, not the next one a reload
                # may come before
                signs, expected = _expected(c, base, ctx, cache)
                report = _evaluate(c, signs, expected, policy, why, scope_devices, ctx.host, dev_nodes, cache)
                _note_inputs(report, c, ctx)
                report.baseline = "recorded"
    return report


def _note_inputs(report: ContainerReport, c: Container, ctx: _HostContext) -> None:
    """The report's nvidia_hook says which inputs its grant was judged on (a new dict: the kept report's
    stays as evaluate() made it)."""
    note = ctx.hook_notes.get((c.namespace, c.id))
    if report.nvidia_hook is not None and note is not None:
        report.nvidia_hook = {**report.nvidia_hook, "inputs": note}


def _expected(c: Container, base, ctx: _HostContext, cache: Cache) -> tuple:
    hook = _hook_grant(c, ctx)
    return cache.memo("expected", (c.namespace, c.id), (c.spec, c.state, base, ctx.host, ctx.nvidia_majors, hook),
                      lambda: _expect(c, base, ctx, hook))[0]


def verify_all(root: HostRoot, config: Config, update_baseline: bool = False, use_bus: bool | None = None,
               with_host: bool = True, cache: VerifyCache | None = None, only: frozenset | None = None,
               record_inputs: bool = False) -> Report:
    """Every container on the host, plus host findings. The daemon passes update_baseline=True.

    cache: the daemon's verify.cache.VerifyCache, kept from pass to pass (what did not change is not
    parsed or judged again); the report is the same as without it (None: a NoCache, nothing kept).
    only: container ids: the report holds only those (the daemon's pass for containers whose runtime
    state was just written); no baseline is pruned then.
    record_inputs: the daemon's: a live container's NVIDIA hook inputs are recorded at its first sight
    (containers.hookrecord), and the records of containers gone are removed.
    """
    start = time.perf_counter()
    pass_cache: Cache = cache if cache is not None else NoCache()
    pass_cache.begin_pass()
    ctx = _HostContext(root, config, with_host, pass_cache, record_inputs)
    containers = discover(root, pass_cache.files)
    cgroups_v2 = tuple((c.id, c.cgroup_v2) for c in containers if c.cgroup_v2 is not None)
    if only is not None:
        containers = [c for c in containers if c.id in only]
    prepared = [_prepare(root, config, ctx, c, pass_cache) for c in containers]
    # only GPU containers' scopes are judged: a plain container's costs no D-Bus call
    scopes = read_scopes(root, [c.scope for c, p in zip(containers, prepared) if c.live and c.scope and _is_gpu(p)],
                         ctx.majors, use_bus, pass_cache)
    reports, not_gpu = [], 0
    for c, p in zip(containers, prepared):
        r = _verify_one(root, config, ctx, c, p, scopes.get(c.scope) if c.scope else None, update_baseline,
                        pass_cache)
        if r.verdict == NOT_GPU:
            not_gpu += 1
        else:
            reports.append(r)
    host = []
    if with_host:
        host = check_host(root, config, ctx.snapshot)
    if update_baseline and only is None:  # pruning needs every container's id
        baselinemod.prune(root, config, [c.id for c in containers if c.status != "stopped"])
    if record_inputs and only is None:
        hookrecord.prune(root, config, [c.id for c in containers if c.status != "stopped"])
    pass_cache.end_pass(drop_unused=only is None)  # a pass over some containers keeps the others' entries
    return Report(reports, host, not_gpu, time.perf_counter() - start, scopes.bus_error, cgroups_v2)


def verify_container(root: HostRoot, config: Config, container_id_or_scope: str, update_baseline: bool = False,
                     use_bus: bool | None = None) -> ContainerReport | None:
    """One container by id, unique id prefix or scope name; None if no such container."""
    cache = NoCache()
    ctx = _HostContext(root, config, True, cache)
    c = find(discover(root), container_id_or_scope)
    if c is None:
        return None
    prepared = _prepare(root, config, ctx, c, cache)
    scope_devices = None
    if c.scope and c.live and _is_gpu(prepared):
        scope_devices = read_scopes(root, [c.scope], ctx.majors, use_bus).get(c.scope)
    return _verify_one(root, config, ctx, c, prepared, scope_devices, update_baseline, cache)


class Creating(NamedTuple):
    """creating_grants' answer for the container being created whose scope appeared."""

    container: Container
    hook: Any  # the NVIDIA hook's reconstructed grant (containers.hookgrant), or None
    missing: list  # [(Device, Access)] the scope's DeviceAllow lacks (spec, trusted reconstruction)
    seen: str  # what was expected and what the scope read, for the debug journal
    refused: str | None = None  # why nothing may be written: it could narrow (containers.early.would_narrow)


def creating_grants(root: HostRoot, config: Config, unit: str, use_bus: bool | None = None,
                    watch=None) -> Creating | None:
    """The daemon's prevention while a container is being created (containers.early): for the container
    that has no runtime state yet and whose bundle's spec makes the scope `unit` (its cgroupsPath), what
    the scope's DeviceAllow lacks of what the spec's rules and the trusted reconstruction grant, or why
    nothing may be added (Creating); None when no such container is known (the scope is no container's
    being created, or the runtime's bundle is not found). watch(unit, state_dir): what the wait for runc's
    Set wakes on (daemon.inotify.CreationWatch, closed here); None: a read every POLICY_POLL seconds."""
    from nvsymlinkd.containers.early import (
        missing_entries,
        runtime_policy_set,
        scope_of_cgroups_path,
        would_narrow,
    )

    # being created: runc's exec.fifo and no state.json yet (runc makes the fifo before the scope)
    found = [c for c in discover(root) if c.status == "creating" and c.spec is not None
             and scope_of_cgroups_path(c.spec.cgroups_path) == unit]
    if len(found) != 1:  # none, or two bundles naming one scope: nothing is this scope's for sure
        return None
    (c,) = found
    ctx = _HostContext(root, config, False, NoCache())
    hook = _hook_grant(c, ctx)
    candidates = candidate_devices(ctx.host.devices, c.spec, None, None, ctx.nvidia_majors, hook)
    expected = expected_access(candidates, c.spec, None, None, hook)
    if not expected.devices:
        return Creating(c, hook, [], "nothing trusted grants it an NVIDIA device")
    # runc makes the scope with no device properties and sends its policy (Set) only right before the
    # hooks: until then the scope reads "no restriction", which it will not be (containers.early)
    waited = time.monotonic()
    wake = None
    if watch is not None:
        try:
            wake = watch(unit, c.state_path.rpartition("/")[0] if c.state_path else None)
        except OSError:  # no inotify (its limits reached): a read every POLICY_POLL seconds
            wake = None
    try:
        raw, reads = wait_for_scope(root, unit, lambda sd: runtime_policy_set(sd) or not still_creating(root, c),
                                    POLICY_WAIT, POLICY_POLL, use_bus, wake)
    finally:
        if wake is not None:
            wake.close()
    waited = time.monotonic() - waited
    scope = None if raw is None else map_entries(root, raw, ctx.majors)
    if scope is None:
        seen = "unknown (-)"
    else:
        seen = (f"DevicePolicy={scope.policy}, {len(scope.entries)} DeviceAllow entries ({scope.source}), "
                f"after {waited * 1000:.0f} ms and {reads} reads"
                + ("" if runtime_policy_set(scope) else " (no device policy from the runtime: not restricted)"))
    seen = f"{len(expected.devices)} devices expected (spec, nvidia-hook); the scope reads {seen}"
    refused = would_narrow(scope)
    return Creating(c, hook, [] if refused else missing_entries(expected, scope), seen, refused)
