"""`nvsymlinkd check`: can every GPU container open its GPUs now, and will it after the next reload?"""

from __future__ import annotations

import json

from nvsymlinkd.commands.usage import SUMMARIES, HelpFormatter
from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK

EPILOG = """\
examples:
  nvsymlinkd check               # every GPU container, then the host
  nvsymlinkd check 0f3c9a1e      # one container: id, id prefix or scope name
  nvsymlinkd check --json --no-host

finding kinds, host findings and the JSON schema: man nvsymlinkd-check
"""


def register(sub) -> None:
    p = sub.add_parser("check", help=SUMMARIES["check"],
                       description="Find GPU containers, compare their device cgroup with what their spec, "
                                   "runtime state and baseline expect, predict losses at the next "
                                   "daemon-reload, and check the host.\n\nExit 0 all ok, 1 findings, 2 error.",
                       epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-check)")
    p.add_argument("--no-bus", action="store_true",
                   help="do not ask systemd over D-Bus; read its transient unit files only")
    p.add_argument("--no-host", action="store_true", help="containers only, skip the host findings")
    p.add_argument("--wide", action="store_true",
                   help="full lines at a terminal too (by default lines are wrapped to its width; "
                        "a pipe or file always gets full lines)")
    p.add_argument("container", nargs="?", default=None,
                   help="only this container: id, unique id prefix, scope name, Docker or Podman name, "
                        "or Kubernetes namespace/pod/container")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.containers.discovery import no_such_container
    from nvsymlinkd.verify.evaluate import Report
    from nvsymlinkd.verify.verifier import verify_all, verify_container

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
    from nvsymlinkd.commands.output import write_output

    if args.json:
        write_output(json.dumps(json_document(report), indent=2) + "\n")
    else:
        lines = human_lines(report, width=None if args.wide else terminal_width())
        write_output("".join(line + "\n" for line in lines))
    # what was found, even when the reader went away (`check | head -1` under pipefail)
    return EXIT_OK if report.all_ok else EXIT_NOT_DESIRED


def terminal_width() -> int | None:
    """The terminal's width (COLUMNS first) when stdout is one; None (full lines) for a pipe or file."""
    import sys

    if not sys.stdout.isatty():
        return None
    import shutil

    return max(40, shutil.get_terminal_size().columns)


def _wrap(line: str, width: int, indent: int) -> list:
    """One long line as lines of at most `width`, continued `indent` columns in."""
    import textwrap

    if len(line) <= width:
        return [line]
    return textwrap.wrap(line, width, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=True) or [line]


def _fit_row(head: str, fix: str, width: int) -> list:
    """A table row whose FIX starts at len(head): wrapped in its column, or, when the columns before it
    leave too little room, the FIX whole on the line below, under its column as far as it fits."""
    import textwrap

    room = width - len(head)
    if len(fix) <= room:
        return [head + fix]
    if room >= 24:
        parts = textwrap.wrap(fix, room, break_on_hyphens=False) or [""]
        return [head + parts[0]] + [" " * len(head) + p for p in parts[1:]]
    row = _wrap(head.rstrip(), width, 4)
    if len(fix) <= width - 4:
        return row + [" " * min(len(head), width - len(fix)) + fix]
    return row + _wrap(" " * 4 + fix, width, 8)


def json_document(report) -> dict:
    """The report's JSON with its schema version, and the summary's counts also split into what
    they count: `verdicts` (GPU containers by verdict, adding up to `containers.gpu`) and
    `containers` (how many of each kind); the flat keys stay as they were."""
    from nvsymlinkd.commands.output import JSON_SCHEMA_VERSION

    doc = {"schema_version": JSON_SCHEMA_VERSION, **report.to_json()}
    summary = doc["summary"]
    verdicts = {k: n for k, n in summary.items() if k not in ("gpu_containers", "not_gpu_containers")}
    summary["verdicts"] = verdicts
    summary["containers"] = {"gpu": summary["gpu_containers"],
                             "gpu_running": summary["gpu_containers"] - verdicts.get("not-running", 0),
                             "not_gpu": summary["not_gpu_containers"]}
    return doc


def _hints_with_root(report, root) -> None:
    """Fix hints that name an nvsymlinkd command carry this run's --root, so they can be pasted."""
    from dataclasses import replace

    from nvsymlinkd.commands.usage import with_root

    if root.is_real_root:
        return
    for c in report.containers:
        # the table's short FIX stays short: the finding's own line below it has the whole fix, with --root
        c.findings = [replace(f, fix=with_root(f.fix, root)) for f in c.findings]
    report.host = [replace(h, fix=with_root(h.fix, root)) for h in report.host]


def human_lines(report, width: int | None = None) -> list:
    """The report for people; with `width` (a terminal's), every line fits it (wrapped, nothing cut).

    The table's FIX is the fix in a few words (`nvsymlinkd repair ID`); each finding's own line below the
    table has its detail and the whole fix (why, and what else works), as the journal and --json do."""
    # in here: every command imports this module (see repair.py)
    from nvsymlinkd.text import plural, printable
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
            rows.append((ident if i == 0 else ("", "", "")) + (f.kind.value, ", ".join(str(d) for d in f.devices) or "-",
                                                                f.action or f.fix))
    # names, scopes and cgroup paths come from files a container can write: escaped before measuring
    rows = [tuple(printable(cell) for cell in r) for r in rows]
    last = len(rows[0]) - 1  # FIX: not padded
    widths = [max(len(r[i]) for r in rows) for i in range(last)]
    lines = []
    if len(rows) == 1:
        lines.append("no GPU containers found")
    else:
        for r in rows:
            head = "  ".join(r[i].ljust(widths[i]) for i in range(last)) + "  "
            lines += [head + r[last]] if width is None else _fit_row(head, r[last], width)
        details = [(c, f) for c in report.containers for f in c.findings]
        if details:
            lines.append("")
            for c, f in details:
                fix = f"  fix: {f.fix}" if f.fix and f.fix != f.action else ""
                lines += _fit(f"{c.short_id} {f.kind}: {f.detail}{fix}", width, 4)
        untrusted = [c for c in report.containers if c.untrusted_nodes]
        for c in untrusted:
            lines += _fit(f"{c.short_id}: NVIDIA nodes in its /dev the runtime did not create (not trusted): "
                          + ", ".join(c.untrusted_nodes), width, 4)
        for c in report.containers:  # the hook's grant judged on other inputs than the ones at its first sight
            inputs = (c.nvidia_hook or {}).get("inputs")
            if inputs and (not inputs["recorded"] or inputs["differences"]) and c.verdict != Verdict.NOT_RUNNING:
                lines += _fit(f"{c.short_id}: the NVIDIA hook's grant is {inputs['detail']}", width, 4)
    if report.not_gpu:
        lines.append(f"({plural(report.not_gpu, 'non-GPU container')} not shown)")
    if report.host:
        lines.append("")
        lines.append("host:")
        for h in report.host:
            fix = f"  fix: {h.fix}" if h.fix and h.status == "warn" else ""
            lines += _fit(f"  {h.status:4s} {h.kind}: {h.detail}{fix}", width, 7)
    return lines


def _fit(line: str, width: int | None, indent: int) -> list:
    # escaped first (untrusted names; main's printable), then wrapped: the widths are what is shown
    from nvsymlinkd.text import printable

    line = printable(line)
    return [line] if width is None else _wrap(line, width, indent)
