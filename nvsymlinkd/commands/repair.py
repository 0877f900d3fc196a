"""`nvsymlinkd repair`: give GPU containers back the devices they lost, and make the grant stick."""

from __future__ import annotations

import json
import os
import sys

from nvsymlinkd.commands.usage import SUMMARIES, HelpFormatter
from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK

# Every command (`sync` at boot too) imports every command module to build its parser: what only
# `repair` needs is imported in its functions (repair.plan and verify.kinds cost `sync` ~5 ms).

EPILOG = """\
examples:
  nvsymlinkd repair --dry-run           # what would be granted, and how
  nvsymlinkd repair 0f3c9a1e2b7d        # one container
  nvsymlinkd repair --json
  nvsymlinkd repair --force 0f3c9a1e2b7d  # again in the rate limit's window
  nvsymlinkd repair --before-reload     # package scripts, before a reload

mechanisms, statuses, MESSAGE_IDs and the JSON schema: man nvsymlinkd-repair
"""


def register(sub) -> None:
    p = sub.add_parser("repair", help=SUMMARIES["repair"],
                       description="Verify GPU containers, then grant back exactly the expected devices each one "
                                   "lost (or whose systemd scope lacks them), by the mechanism the host allows, "
                                   "and verify again.\n\nWithout CONTAINER: every GPU container with findings.",
                       epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("containers", nargs="*", metavar="CONTAINER",
                   help="container id, unique id prefix (4+ characters), scope name, Docker or Podman name, "
                        "or Kubernetes namespace/pod/container")
    p.add_argument("--dry-run", action="store_true", help="print what would be granted and how; change nothing")
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-repair)")
    p.add_argument("--before-reload", action="store_true",
                   help="for package scripts about to run `systemctl daemon-reload`: repair every GPU container "
                        "with findings (at-risk ones are prevented); print nothing when there is nothing to do or "
                        "systemd does not run here; every container left at risk named on stderr. Always exit 0 "
                        "and bounded: one wait for the system bus at most (then systemd's unit files), a bad "
                        "config file is named and the defaults used")
    p.add_argument("--force", action="store_true",
                   help="repair even within the rate limit's window (one repair per container per 600 s, "
                        "against loops); journaled as forced")
    p.set_defaults(func=run, on_config_error=_config_error)


# `--before-reload` runs inside apt's and dnf's transactions, just before their daemon-reload: it never
# fails or stalls them. Its status is always 0; what it could not protect is named on stderr and in the
# journal. Its bound: one wait for the bus (systemd.client.CALL_TIMEOUT, 5 s) for the whole run; repairs
# start within BEFORE_RELOAD_START seconds (a container whose turn comes later is named, not repaired),
# each waiting at most BEFORE_RELOAD_LOCK_WAIT for the repair lock (the daemon's own repair, a stuck
# CLI), then its own bounded steps (freeze and settle 5 s each: repair.cgroupfiles.SETTLE_TIMEOUT; a
# systemd call 5 s). Worst case about 30 + 10 + 15 s after the verification; measured: 5.4 s for 50
# containers at risk with a hung bus (tests/test_before_reload.py).
BEFORE_RELOAD_START = 30.0
BEFORE_RELOAD_LOCK_WAIT = 10.0


def _config_error(args, error):
    """The config file did not load: `--before-reload` goes on with the defaults (a repair's decisions do
    not depend on the file: the command sets `repair` itself, grants come from the runtimes' files) and
    says so; any other use of `repair` stops with the error (exit 2)."""
    if not args.before_reload:
        raise error
    from nvsymlinkd.config import Config
    from nvsymlinkd.text import printable

    sys.stderr.write(f"nvsymlinkd: before a daemon-reload: {printable(str(error))}; going on with the default "
                     "settings\n")
    return Config()


def run(args, root, config) -> int:
    if not args.before_reload:
        return _run(args, root, config)
    # Nothing that goes wrong here may fail the package operation: said on stderr, status 0
    from nvsymlinkd.errors import NvsymlinkdError, UsageError
    from nvsymlinkd.text import printable

    if args.containers or args.dry_run or args.json:
        raise UsageError("--before-reload repairs every GPU container with findings, quietly: not with "
                         "CONTAINER, --dry-run or --json")
    try:
        _run(args, root, config)
    except (NvsymlinkdError, OSError) as exc:
        line = (f"before a daemon-reload: the GPU containers could not be checked ({exc}); any of them may lose "
                "its devices at the reload: run nvsymlinkd check after it")
        sys.stderr.write(f"nvsymlinkd: {printable(line)}\n")
    return EXIT_OK


def _run(args, root, config) -> int:
    from nvsymlinkd.journal import Journal
    from nvsymlinkd.repair.apply import history_path, load_history, save_history
    from nvsymlinkd.repair.freeze import recover_frozen
    from nvsymlinkd.repair.model import RepairStatus
    from nvsymlinkd.verify import verifier

    if args.before_reload and not _reload_to_prevent(root):
        return EXIT_OK
    blind = _cannot_see(root)
    if blind:
        from nvsymlinkd.text import printable

        sys.stderr.write(f"nvsymlinkd: {printable(blind)}\n")
    # An explicit command is the operator's decision: the config's `repair` key governs the daemon.
    config = config.with_overrides(repair="report" if args.dry_run else "auto")
    history = load_history(root, config)
    # every change to a container's device access is journaled when journald is there (an audit trail);
    # the terminal gets the same facts from the printed report instead
    journal: Journal | None = Journal(target="journal")
    if journal is not None and journal.target != "journal":
        journal = None
    # first, thaw what a repair killed mid-way (SIGKILL, OOM) left frozen, whatever the findings are now
    thawed = [e for e in recover_frozen(root, config, journal, dry_run=args.dry_run)
              if e["action"] in ("thawed", "would-thaw")]
    report = verifier.verify_all(root, config, with_host=False)
    if report.bus_error:
        _bus_error_report(report.bus_error, journal, args.before_reload)
    results, late = _repairs(args, root, config, report, history, journal)
    unknown, denied, unfixable = _unrepaired(args, report, results, late)
    repaired = {r.request.container_id for r in results}
    if not args.dry_run and any(r.steps for r in results):
        try:
            save_history(root, config, history)
        except OSError as exc:
            sys.stderr.write(f"nvsymlinkd: note: cannot record the repair time in {history_path(config)}: "
                             f"{exc.strerror}; "
                             "the rate limit will not see this repair\n")
    # a container a repair could grant nothing to still has its finding (`check` exits 1 for it); so
    # does a host this user cannot see
    left = [r for r in results if RepairStatus(r.status) == RepairStatus.NOTHING]
    ok = all(r.ok for r in results) and not left and not unknown and not denied and not unfixable and not blind
    if args.before_reload:
        ok = ok and not _unprotected(results)
    summary = {**_summary(results), "cannot-judge": len(unknown), "not-repairable": len(unfixable),
               "denied": len([c for c in denied if c.id not in repaired])}
    _write_report(args, ok, results, thawed, (unknown, denied, unfixable), summary, journal, late)
    return EXIT_OK if ok else EXIT_NOT_DESIRED


def _reload_to_prevent(root) -> bool:
    """--before-reload: whether systemd runs here (not in a chroot, an image build: no reload to prevent)."""
    if not os.path.isdir(root.path("/run/systemd/system")):
        return False
    from nvsymlinkd.systemd.client import shared

    shared().once_only()  # a hung bus costs one wait in all, not one per container (then the unit files)
    return True


def _repairs(args, root, config, report, history, journal) -> tuple:
    """(results, late): every chosen container's repair; late (--before-reload): the containers whose turn
    came after its time to start repairs."""
    from nvsymlinkd.repair.apply import repair_all

    late: list = []
    try:
        if args.before_reload:
            results, late = _repairs_in_time(root, config, report, history=history, journal=journal,
                                             force=args.force, by_hand=True)
        else:
            results = repair_all(root, config, args.containers, dry_run=args.dry_run, history=history,
                                 journal=journal, report=report, force=args.force, by_hand=True)
    except KeyError as exc:
        from nvsymlinkd.containers.discovery import no_such_container

        raise no_such_container(exc.args[0])
    return results, late


def _unrepaired(args, report, results, late) -> tuple:
    """(unknown, denied, unfixable): the chosen containers no repair fixed, each kind reported with its fix."""
    from nvsymlinkd.containers.discovery import find
    from nvsymlinkd.verify.kinds import FindingKind, Verdict

    # A container whose access cannot be judged has nothing to repair that we know of: say so, and
    # never report such a host as fine (exit 1).
    chosen = [find(report.containers, w) for w in args.containers] if args.containers else report.containers
    repaired = {r.request.container_id for r in results}
    unknown = [c for c in chosen if c is not None and c.verdict == Verdict.UNKNOWN and c.id not in repaired]
    # Nodes it has or GPUs it asks for, denied, that nothing trusted granted: never "repaired" (that
    # would grant what no one granted); reported with the fix, and never a fine host (exit 1)
    denied = [c for c in chosen if c is not None and any(f.kind == FindingKind.DENIED for f in c.findings)]
    # other findings no repair can fix (nvidia-uvm never granted: nothing trusted expects it): counted as
    # `check` counts them, with their fix, never dropped
    unfixable = [c for c in chosen if c is not None and c.id not in repaired and c not in unknown and c not in late
                 and c not in denied and c.verdict in (Verdict.LOST, Verdict.AT_RISK)]
    return unknown, denied, unfixable


def _write_report(args, ok, results, thawed, unrepaired, summary, journal, late) -> None:
    """The report: JSON, --before-reload's words for apt's or dnf's output, or the terminal's lines."""
    from nvsymlinkd.commands.output import write_output
    from nvsymlinkd.repair.freeze import thawed_line
    from nvsymlinkd.text import printable

    unknown, denied, unfixable = unrepaired
    if args.json:
        from nvsymlinkd.commands.output import JSON_SCHEMA_VERSION

        doc = {"schema_version": JSON_SCHEMA_VERSION, "dry_run": args.dry_run, "ok": ok,
               "containers": [r.to_json() for r in results],
               "unknown": [{"container": c.id, "reason": _unknown_reason(c)} for c in unknown],
               "denied": [_denied_json(c) for c in denied],
               "not_repairable": [_unfixable_json(c) for c in unfixable],
               "summary": summary, "thawed": thawed}
        write_output(json.dumps(doc, indent=2) + "\n")
    elif args.before_reload:
        _before_reload_report(thawed, results, unknown, denied, unfixable, summary, journal, late)
    else:
        lines = [thawed_line(e) for e in thawed]
        for r in results:
            lines += r.human_lines()
            lines += [f"  step: {step}" for step in r.steps]
        lines += _unrepaired_lines(unknown, denied, unfixable)
        from nvsymlinkd.devchar.summary import repair_line

        lines.append(repair_line(results, summary, args.dry_run))
        # scope names and cgroup paths come from files a container can write: escaped for the terminal
        write_output("".join(printable(line) + "\n" for line in lines))


def _repairs_in_time(root, config, report, **kw) -> tuple:
    """(results, late): repair_all for one container after the other while BEFORE_RELOAD_START has not
    passed; the containers with something to repair whose turn came later, not tried."""
    import time

    from nvsymlinkd.repair.apply import repair_all
    from nvsymlinkd.repair.plan import requests_from_report

    deadline = time.monotonic() + BEFORE_RELOAD_START
    results: list = []
    late: list = []
    for c in report.containers:
        if requests_from_report(c) is None:
            continue
        if time.monotonic() >= deadline:
            late.append(c)
            continue
        results += repair_all(root, config, [c.id], report=report, lock_wait=BEFORE_RELOAD_LOCK_WAIT, **kw)
    return results, late


def _short(container_id: str) -> str:
    return container_id[:12] if len(container_id) == 64 else container_id


def _cannot_see(root) -> str | None:
    """Why this run cannot see the containers (not root: the runtimes' state and the cgroups are root's),
    or None. `check` says the same as its `privilege` host finding."""
    if os.geteuid() == 0:
        return None
    return ("repair: not running as root: the runtimes' state (/run/runc, /run/containerd) and the cgroups "
            "are unreadable, so containers with findings may be missing from this report and none can be "
            "repaired; run it as root")


def _unrepaired_lines(unknown, denied, unfixable) -> list:
    """The containers no repair was tried for, one line each with why: the same in the report and before a reload."""
    lines = [f"{c.short_id}: cannot judge its device access, not repaired: {_unknown_reason(c)}" for c in unknown]
    for c in denied:
        f = _denied_json(c)
        lines.append(f"{c.short_id}: denied {', '.join(f['devices'])}, not repaired (nothing trusted granted them): "
                     f"{f['fix']}")
    lines += [f"{c.short_id}: {f.kind} {', '.join(str(d) for d in f.devices)}: no repair can grant it (expected by no trusted "
              f"source); fix: {f.fix}" for c in unfixable for f in c.findings]
    return lines


def _denied_json(report) -> dict:
    from nvsymlinkd.verify.kinds import FindingKind

    f = next(f for f in report.findings if f.kind == FindingKind.DENIED)
    return {"container": report.id, "devices": [str(d) for d in f.devices], "detail": f.detail, "fix": f.fix}


def _before_reload_report(thawed, results, unknown, denied, unfixable, summary, journal=None, late=()) -> None:
    """What a package script shows: nothing when nothing was to be done; what was granted on stdout; what
    could not be (failed, refused, denied, not judged) on stderr, each line prefixed, since it lands amid
    apt's or dnf's output, and escaped like every report (names come from container-writable files). Each
    repair is journaled as well (repair-prevented, repair-failed, ...)."""
    from nvsymlinkd.devchar.summary import repair_line
    from nvsymlinkd.repair.freeze import thawed_line
    from nvsymlinkd.repair.model import RepairStatus
    from nvsymlinkd.text import printable

    acted = [r for r in results if RepairStatus(r.status) != RepairStatus.NOTHING]
    unprotected = _unprotected(results)
    if not (thawed or acted or unknown or denied or unfixable or unprotected or late):
        return
    good: list = [thawed_line(e) for e in thawed]
    bad: list = []
    for r in acted:
        (good if r.ok else bad).extend(r.human_lines())
    for r in unprotected:
        who = r.human_lines()[0].rsplit(": nothing to grant", 1)[0]
        bad.append(f"{who}: left at risk of the reload: nothing trusted expects the devices its scope lacks")
        bad += r.human_lines()[1:]
    bad += _unrepaired_lines(unknown, denied, unfixable)
    bad += [f"{c.short_id}: not repaired: its turn came after the {BEFORE_RELOAD_START:g} s this step may take to "
            "start repairs, so the reload may take its devices" for c in late]
    (bad if bad else good).append(f"{repair_line(results, summary, False)} (before a daemon-reload)")
    if bad:  # the package script goes on (status 0): this line is what its operator must not miss
        at_risk = sorted({_short(r.request.container_id) for r in results if not r.ok or r in unprotected}
                         | {c.short_id for c in (*unknown, *denied, *unfixable, *late)})
        last = (f"not every GPU container could be kept safe from this daemon-reload ({', '.join(at_risk)}); "
                "nvsymlinkd.service repairs what it can after it: nvsymlinkd check, journalctl -t nvsymlinkd")
        bad.append(last)
        if journal is not None:
            from nvsymlinkd.journal import WARNING

            journal.log(WARNING, last)
    sys.stdout.write("".join(f"nvsymlinkd: {printable(line)}\n" for line in good))
    sys.stdout.flush()
    sys.stderr.write("".join(f"nvsymlinkd: {printable(line)}\n" for line in bad))


def _bus_error_report(error: str, journal, before_reload: bool) -> None:
    """systemd did not answer for the scopes' DeviceAllow: they were judged from its unit files (which it
    writes for every transient scope and runtime property). Said, never silent: on stderr (amid apt's or
    dnf's output before a reload) and in the journal; what the files could not answer is reported per
    container as `cannot judge`."""
    from nvsymlinkd.journal import WARNING
    from nvsymlinkd.text import printable

    what = "before a daemon-reload" if before_reload else "repair"
    line = (f"{what}: systemd did not answer on the system bus ({error}); the containers' scopes were judged "
            "from systemd's unit files in /run/systemd instead")
    sys.stderr.write(f"nvsymlinkd: {printable(line)}\n")
    sys.stderr.flush()
    if journal is not None:
        journal.log(WARNING, line)


def _unprotected(results) -> list:
    """Containers in a systemd scope with devices a reload would take and none that may be granted (each
    refused: expected by nothing trusted, e.g. a hook's grant with no baseline yet): "nothing to do" for
    `repair`, but for a package script about to reload, a container it leaves at risk."""
    from nvsymlinkd.repair.model import RepairStatus

    return [r for r in results if RepairStatus(r.status) == RepairStatus.NOTHING and r.plan.refused
            and r.request.scope]


def _unknown_reason(report) -> str:
    from nvsymlinkd.verify.kinds import FindingKind

    return next((f.detail for f in report.findings if f.kind == FindingKind.UNKNOWN), "unknown")


def _unfixable_json(report) -> dict:
    return {"container": report.id, "verdict": str(report.verdict),
            "findings": [{"kind": str(f.kind), "devices": [str(d) for d in f.devices], "fix": f.fix} for f in report.findings]}


def _summary(results) -> dict:
    from nvsymlinkd.repair.model import RepairStatus

    counts = {s.value: 0 for s in RepairStatus}
    for r in results:
        counts[RepairStatus(r.status).value] += 1
    return counts

