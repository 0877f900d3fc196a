"""`nvsymlinkd repair`: give GPU containers back the devices they lost, and make the grant stick."""

from __future__ import annotations

import argparse
import json
import os
import sys

from nvsymlinkd.cli import SUMMARIES
from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK

# Every command (`sync` at boot too) imports every command module to build its parser: what only
# `repair` needs is imported in its functions (repair.plan and verify.kinds cost `sync` ~5 ms).

EPILOG = """\
examples:
  nvsymlinkd repair --dry-run                   # what would be granted, and how
  nvsymlinkd repair 0f3c9a1e2b7d                # one container
  nvsymlinkd repair --json
  nvsymlinkd repair --before-reload             # package scripts, before their systemctl daemon-reload

mechanisms, statuses, journal MESSAGE_IDs and the JSON schema: man nvsymlinkd-repair
"""


def register(sub) -> None:
    p = sub.add_parser("repair", help=SUMMARIES["repair"],
                       description="Verify GPU containers, then grant back exactly the expected devices each one "
                                   "lost (or whose systemd scope lacks them), by the mechanism the host allows, "
                                   "and verify again. Without CONTAINER: every GPU container with findings.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("containers", nargs="*", metavar="CONTAINER",
                   help="container id, unique id prefix (4+ characters), scope name, Docker or Podman name, "
                        "or Kubernetes namespace/pod/container")
    p.add_argument("--dry-run", action="store_true", help="print what would be granted and how; change nothing")
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-repair)")
    p.add_argument("--before-reload", action="store_true",
                   help="for package scripts about to run `systemctl daemon-reload`: repair every GPU container "
                        "with findings (at-risk ones are prevented); print nothing when there is nothing to do or "
                        "systemd does not run here; failures on stderr")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.containers.discovery import find
    from nvsymlinkd.journal import Journal
    from nvsymlinkd.repair.apply import (
        history_path,
        recover_frozen,
        repair_all,
        thawed_line,
    )
    from nvsymlinkd.repair.plan import RepairHistory
    from nvsymlinkd.verify import verifier
    from nvsymlinkd.verify.kinds import Verdict

    if args.before_reload:
        from nvsymlinkd.errors import UsageError

        if args.containers or args.dry_run or args.json:
            raise UsageError("--before-reload repairs every GPU container with findings, quietly: not with "
                             "CONTAINER, --dry-run or --json")
        if not os.path.isdir(root.path("/run/systemd/system")):
            return EXIT_OK  # systemd does not run here (a chroot, an image build): no reload to prevent
    # An explicit command is the operator's decision: the config's `repair` key governs the daemon.
    config = config.with_overrides(repair="report" if args.dry_run else "auto")
    hist_file = history_path(root, config)
    history = RepairHistory.load(hist_file)
    # every change to a container's device access is journaled when journald is there (an audit trail);
    # the terminal gets the same facts from the printed report instead
    journal: Journal | None = Journal(target="journal")
    if journal is not None and journal.target != "journal":
        journal = None
    # first, thaw what a repair killed mid-way (SIGKILL, OOM) left frozen, whatever the findings are now
    thawed = [e for e in recover_frozen(root, config, journal, dry_run=args.dry_run)
              if e["action"] in ("thawed", "would-thaw")]
    report = verifier.verify_all(root, config, with_host=False)
    try:
        results = repair_all(root, config, args.containers, dry_run=args.dry_run, history=history,
                             journal=journal, report=report)
    except KeyError as exc:
        from nvsymlinkd.containers.discovery import no_such_container

        raise no_such_container(exc.args[0])
    # A container whose access cannot be judged has nothing to repair that we know of: say so, and
    # never report such a host as fine (exit 1).
    chosen = [find(report.containers, w) for w in args.containers] if args.containers else report.containers
    repaired = {r.request.container_id for r in results}
    unknown = [c for c in chosen if c is not None and c.verdict == Verdict.UNKNOWN and c.id not in repaired]
    if not args.dry_run and any(r.steps for r in results):
        try:
            history.save(hist_file)
        except OSError as exc:
            sys.stderr.write(f"nvsymlinkd: note: cannot record the repair time in {hist_file}: {exc.strerror}; "
                             "the rate limit will not see this repair\n")
    ok = all(r.ok for r in results) and not unknown
    if args.before_reload:
        ok = ok and not _unprotected(results)
    if args.json:
        doc = {"dry_run": args.dry_run, "ok": ok, "containers": [r.to_json() for r in results],
               "unknown": [{"container": c.id, "reason": _unknown_reason(c)} for c in unknown],
               "summary": _summary(results), "thawed": thawed}
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.before_reload:
        _before_reload_report(thawed, results, unknown)
    else:
        for e in thawed:
            print(thawed_line(e))
        for r in results:
            for line in r.human_lines():
                print(line)
            for step in r.steps:
                print(f"  step: {step}")
        for c in unknown:
            print(f"{c.short_id}: cannot judge its device access, not repaired: {_unknown_reason(c)}")
        from nvsymlinkd.summary import repair_line

        print(repair_line(results, _summary(results), args.dry_run))
    return EXIT_OK if ok else EXIT_NOT_DESIRED


def _before_reload_report(thawed, results, unknown) -> None:
    """What a package script shows: nothing when nothing was to be done; what was granted on stdout; what
    could not be (failed, refused, not judged) on stderr, each line prefixed, since it lands amid apt's
    or dnf's output. Each repair is journaled as well (repair-prevented, repair-failed, ...)."""
    from nvsymlinkd.repair.apply import thawed_line
    from nvsymlinkd.repair.plan import RepairStatus
    from nvsymlinkd.summary import repair_line

    acted = [r for r in results if RepairStatus(r.status) != RepairStatus.NOTHING]
    unprotected = _unprotected(results)
    if not (thawed or acted or unknown or unprotected):
        return
    for e in thawed:
        print(f"nvsymlinkd: {thawed_line(e)}")
    for r in acted:
        out = sys.stdout if r.ok else sys.stderr
        for line in r.human_lines():
            out.write(f"nvsymlinkd: {line}\n")
    for r in unprotected:
        who = r.human_lines()[0].rsplit(": nothing to grant", 1)[0]
        sys.stderr.write(f"nvsymlinkd: {who}: left at risk of the reload: nothing trusted expects the devices "
                         "its scope lacks\n")
        for line in r.human_lines()[1:]:
            sys.stderr.write(f"nvsymlinkd: {line}\n")
    for c in unknown:
        sys.stderr.write(f"nvsymlinkd: {c.short_id}: cannot judge its device access, not repaired: "
                         f"{_unknown_reason(c)}\n")
    out = sys.stdout if all(r.ok for r in results) and not unknown and not unprotected else sys.stderr
    sys.stdout.flush()
    out.write(f"nvsymlinkd: {repair_line(results, _summary(results), False)} (before a daemon-reload)\n")


def _unprotected(results) -> list:
    """Containers in a systemd scope with devices a reload would take and none that may be granted (each
    refused: expected by nothing trusted, e.g. a hook's grant with no baseline yet): "nothing to do" for
    `repair`, but for a package script about to reload, a container it leaves at risk."""
    from nvsymlinkd.repair.plan import RepairStatus

    return [r for r in results if RepairStatus(r.status) == RepairStatus.NOTHING and r.plan.refused
            and r.request.scope]


def _unknown_reason(report) -> str:
    from nvsymlinkd.verify.kinds import FindingKind

    return next((f.detail for f in report.findings if f.kind == FindingKind.UNKNOWN), "unknown")


def _summary(results) -> dict:
    from nvsymlinkd.repair.plan import RepairStatus

    counts = {s.value: 0 for s in RepairStatus}
    for r in results:
        counts[RepairStatus(r.status).value] += 1
    return counts

