"""`nvsymlinkd repair`: give GPU containers back the devices they lost, and make the grant stick."""

from __future__ import annotations

import argparse
import json
import sys

from nvsymlinkd.errors import EXIT_ERROR, EXIT_NOT_DESIRED, EXIT_OK

EPILOG = """\
examples:
  nvsymlinkd repair --dry-run                   # what would be granted, and how
  nvsymlinkd repair 0f3c9a1e2b7d                # one container
  nvsymlinkd repair --json

mechanisms, statuses, journal MESSAGE_IDs and the JSON schema: man nvsymlinkd-repair
"""


def register(sub) -> None:
    p = sub.add_parser("repair", help="re-grant NVIDIA devices GPU containers lost (or are about to lose)",
                       description="Verify GPU containers, then grant back exactly the expected devices each one "
                                   "lost (or whose systemd scope lacks them), by the mechanism the host allows, "
                                   "and verify again. Without CONTAINER_ID: every GPU container with findings.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("containers", nargs="*", metavar="CONTAINER_ID",
                   help="container id, unique id prefix (4+ characters) or scope name")
    p.add_argument("--dry-run", action="store_true", help="print what would be granted and how; change nothing")
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-repair)")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.journal import Journal
    from nvsymlinkd.repairer import SUCCESS, history_path, repair_all
    from nvsymlinkd.repairplan import RepairHistory

    # An explicit command is the operator's decision: the config's `repair` key governs the daemon.
    config = config.with_overrides(repair="report" if args.dry_run else "auto")
    hist_file = history_path(root, config)
    history = RepairHistory.load(hist_file)
    # every change to a container's device access is journaled when journald is there (an audit trail);
    # the terminal gets the same facts from the printed report instead
    journal = Journal(target="journal")
    if journal.target != "journal":
        journal = None
    try:
        results = repair_all(root, config, args.containers, dry_run=args.dry_run, history=history,
                             journal=journal)
    except KeyError as exc:
        sys.stderr.write(f"nvsymlinkd: no container matches {exc.args[0]!r} (try `nvsymlinkd check`)\n")
        return EXIT_ERROR
    if not args.dry_run and any(r.steps for r in results):
        try:
            history.save(hist_file)
        except OSError as exc:
            sys.stderr.write(f"nvsymlinkd: note: cannot record the repair time in {hist_file}: {exc.strerror}; "
                             "the rate limit will not see this repair\n")
    ok = all(r.status in SUCCESS for r in results)
    if args.json:
        doc = {"dry_run": args.dry_run, "ok": ok, "containers": [r.to_json() for r in results],
               "summary": _summary(results)}
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for r in results:
            for line in r.human_lines():
                print(line)
            for step in r.steps:
                print(f"  step: {step}")
        counts = _summary(results)
        parts = [f"{n} {k}" for k, n in counts.items() if n]
        head = "repair (dry run)" if args.dry_run else "repair"
        print(f"{head}: {len(results)} containers with findings" + (": " + ", ".join(parts) if parts else ""))
    return EXIT_OK if ok else EXIT_NOT_DESIRED


def _summary(results) -> dict:
    from nvsymlinkd.repairer import CANNOT, FAILED, NOTHING, PREVENTED, REPAIRED, WOULD

    counts = {k: 0 for k in (REPAIRED, PREVENTED, NOTHING, WOULD, CANNOT, FAILED)}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts
