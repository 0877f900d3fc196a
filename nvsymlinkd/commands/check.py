"""`nvsymlinkd check`: can every GPU container open its GPUs now, and will it after the next reload?"""

from __future__ import annotations

import argparse
import json
import sys

from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK, UsageError

EPILOG = """\
examples:
  nvsymlinkd check                              # every GPU container, then the host
  nvsymlinkd check 0f3c9a1e                     # one container: id, id prefix or scope name
  nvsymlinkd check --json --no-host

finding kinds, host findings and the JSON schema: man nvsymlinkd-check
"""


def register(sub) -> None:
    p = sub.add_parser("check", help="verify GPU containers' device access and the host (read-only)",
                       description="Find GPU containers, compare their device cgroup with what their spec, "
                                   "runtime state and baseline expect, predict losses at the next "
                                   "daemon-reload, and check the host. Exit 0 all ok, 1 findings, 2 error.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-check)")
    p.add_argument("--no-bus", action="store_true",
                   help="do not ask systemd over D-Bus; read its transient unit files only")
    p.add_argument("--no-host", action="store_true", help="containers only, skip the host findings")
    p.add_argument("container", nargs="?", default=None,
                   help="only this container (id, unique id prefix or scope name)")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.verifier import NOT_RUNNING, OK, Report, verify_all, verify_container

    use_bus = False if args.no_bus else None
    if args.container:
        import time

        start = time.perf_counter()
        one = verify_container(root, config, args.container, use_bus=use_bus)
        if one is None:
            raise UsageError(f"no container {args.container!r} (give an id, a unique id prefix or a scope name)")
        report = Report([one], [], 0, time.perf_counter() - start)
        if not args.no_host:
            from nvsymlinkd.hostcheck import check_host

            report.host = check_host(root, config)
    else:
        report = verify_all(root, config, use_bus=use_bus, with_host=not args.no_host)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for line in human_lines(report):
            print(line)
    ok = all(c.verdict in (OK, NOT_RUNNING, "not-gpu") for c in report.containers)
    ok = ok and not any(h.status == "warn" for h in report.host)
    return EXIT_OK if ok else EXIT_NOT_DESIRED


def human_lines(report) -> list:
    rows = [("CONTAINER", "RUNTIME", "STATUS", "MISSING", "FIX")]
    for c in report.containers:
        name = c.short_id
        if not c.findings:
            rows.append((name, c.runtime, c.verdict if c.verdict != "not-running" else f"not-running ({c.status})",
                         "-", "-"))
            continue
        for i, f in enumerate(c.findings):
            rows.append((name if i == 0 else "", c.runtime if i == 0 else "", f.kind,
                         ", ".join(f.devices) or "-", f.fix))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    if len(rows) == 1:
        lines.append("no GPU containers found")
    else:
        for r in rows:
            lines.append("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
        details = [(c, f) for c in report.containers for f in c.findings]
        if details:
            lines.append("")
            for c, f in details:
                lines.append(f"{c.short_id} {f.kind}: {f.detail}")
        untrusted = [c for c in report.containers if c.untrusted_nodes]
        for c in untrusted:
            lines.append(f"{c.short_id}: NVIDIA nodes in its /dev the runtime did not create (not trusted): "
                         + ", ".join(c.untrusted_nodes))
    if report.not_gpu:
        lines.append(f"({report.not_gpu} non-GPU containers not shown)")
    if report.host:
        lines.append("")
        lines.append("host:")
        for h in report.host:
            fix = f"  fix: {h.fix}" if h.fix and h.status == "warn" else ""
            lines.append(f"  {h.status:4s} {h.kind}: {h.detail}{fix}")
    return lines
