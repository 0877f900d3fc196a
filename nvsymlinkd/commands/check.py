"""`nvsymlinkd check`: can every GPU container open its GPUs now, and will it after the next reload?"""

from __future__ import annotations

import argparse
import json

from nvsymlinkd.cli import SUMMARIES
from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK

EPILOG = """\
examples:
  nvsymlinkd check                              # every GPU container, then the host
  nvsymlinkd check 0f3c9a1e                     # one container: id, id prefix or scope name
  nvsymlinkd check --json --no-host

finding kinds, host findings and the JSON schema: man nvsymlinkd-check
"""


def register(sub) -> None:
    p = sub.add_parser("check", help=SUMMARIES["check"],
                       description="Find GPU containers, compare their device cgroup with what their spec, "
                                   "runtime state and baseline expect, predict losses at the next "
                                   "daemon-reload, and check the host. Exit 0 all ok, 1 findings, 2 error.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-check)")
    p.add_argument("--no-bus", action="store_true",
                   help="do not ask systemd over D-Bus; read its transient unit files only")
    p.add_argument("--no-host", action="store_true", help="containers only, skip the host findings")
    p.add_argument("container", nargs="?", default=None,
                   help="only this container: id, unique id prefix, scope name, Docker or Podman name, "
                        "or Kubernetes namespace/pod/container")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.containers.discovery import no_such_container
    from nvsymlinkd.verify.verifier import Report, verify_all, verify_container

    use_bus = False if args.no_bus else None
    if args.container:
        import time

        start = time.perf_counter()
        one = verify_container(root, config, args.container, use_bus=use_bus)
        if one is None:
            raise no_such_container(args.container)
        report = Report([one], [], 0, time.perf_counter() - start)
        if not args.no_host:
            from nvsymlinkd.verify.hostcheck import check_host

            report.host = check_host(root, config)
    else:
        report = verify_all(root, config, use_bus=use_bus, with_host=not args.no_host)
    _hints_with_root(report, root)
    from nvsymlinkd.cli import write_output

    if args.json:
        write_output(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        write_output("".join(line + "\n" for line in human_lines(report)))
    # what was found, even when the reader went away (`check | head -1` under pipefail)
    return EXIT_OK if report.all_ok else EXIT_NOT_DESIRED


def _hints_with_root(report, root) -> None:
    """Fix hints that name an nvsymlinkd command carry this run's --root, so they can be pasted."""
    from dataclasses import replace

    from nvsymlinkd.cli import with_root

    if root.is_real_root:
        return
    for c in report.containers:
        c.findings = [replace(f, fix=with_root(f.fix, root)) for f in c.findings]
    report.host = [replace(h, fix=with_root(h.fix, root)) for h in report.host]


def human_lines(report) -> list:
    # in here: every command imports this module (see repair.py)
    from nvsymlinkd.cli import printable
    from nvsymlinkd.summary import plural
    from nvsymlinkd.verify.kinds import Verdict

    rows: list[tuple[str, ...]] = [("CONTAINER", "NAME", "RUNTIME", "STATUS", "MISSING", "FIX")]
    for c in report.containers:
        ident = (c.short_id, c.display_name or "-", c.runtime)
        if not c.findings:
            verdict = Verdict(c.verdict).value
            rows.append(ident + (verdict if verdict != Verdict.NOT_RUNNING else f"{verdict} ({c.status})",
                                 "-", "-"))
            continue
        for i, f in enumerate(c.findings):
            rows.append((ident if i == 0 else ("", "", "")) + (f.kind.value, ", ".join(f.devices) or "-", f.fix))
    # names, scopes and cgroup paths come from files a container can write: escaped before measuring
    rows = [tuple(printable(cell) for cell in r) for r in rows]
    last = len(rows[0]) - 1  # FIX: not padded
    widths = [max(len(r[i]) for r in rows) for i in range(last)]
    lines = []
    if len(rows) == 1:
        lines.append("no GPU containers found")
    else:
        for r in rows:
            lines.append("  ".join(r[i].ljust(widths[i]) for i in range(last)) + "  " + r[last])
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
        lines.append(f"({plural(report.not_gpu, 'non-GPU container')} not shown)")
    if report.host:
        lines.append("")
        lines.append("host:")
        for h in report.host:
            fix = f"  fix: {h.fix}" if h.fix and h.status == "warn" else ""
            lines.append(f"  {h.status:4s} {h.kind}: {h.detail}{fix}")
    return [printable(line) for line in lines]
