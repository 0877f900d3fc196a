"""`nvsymlinkd render`: the udev rule and systemd units for this config, from the packaged templates."""

from __future__ import annotations

import os
import sys

from nvsymlinkd.commands.usage import SUMMARIES, HelpFormatter
from nvsymlinkd.config import has_control_character, is_utf8
from nvsymlinkd.errors import EXIT_OK, NvsymlinkdError, UsageError

EPILOG = """\
examples:
  nvsymlinkd render              # print the rule and the units
  nvsymlinkd render --config /dev/null --output build/units  # packaging
  # after changing /etc/nvsymlinkd/nvsymlinkd.toml:
  nvsymlinkd render --drop-ins /etc/systemd/system && systemctl daemon-reload

what becomes ExecStart= flags and ReadWritePaths=: man nvsymlinkd-render
"""


def register(sub) -> None:
    from nvsymlinkd.commands.sync import add_link_options

    p = sub.add_parser("render", help=SUMMARIES["render"],
                       description="Render 71-nvsymlinkd.rules, nvsymlinkd.service and nvsymlinkd-sync.service "
                                   "from the templates, with values from the config file and these options.\n\n"
                                   "Packaging runs this at build time: use --config /dev/null there so the "
                                   "build machine's config does not leak in.",
                       epilog=EPILOG, formatter_class=HelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--output", default=None, metavar="DIR",
                       help="write the complete files into DIR (created if missing; taken as given, not under "
                            "--root), e.g. for packaging; default: print them to stdout, each after a "
                            "'==> NAME <==' line")
    where.add_argument("--drop-ins", default=None, metavar="DIR",
                       help="write DIR/nvsymlinkd.service.d/50-nvsymlinkd-config.conf and the sync unit's with "
                            "exactly the settings that differ from the packaged units (a stale one is removed "
                            "when nothing differs); for operators: --drop-ins /etc/systemd/system, then "
                            "systemctl daemon-reload. The udev rule does not depend on the config.")
    add_link_options(p)
    p.add_argument("--resync-interval", type=float, default=None, metavar="SEC",
                   help="daemon resync interval passed to `nvsymlinkd run` (default 60; 0 disables)")
    p.add_argument("--watchdog-sec", type=float, default=None, metavar="SEC",
                   help="WatchdogSec= of nvsymlinkd.service (default 30; 0 disables)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="daemon state directory (default /run/nvsymlinkd, made by RuntimeDirectory=)")
    p.add_argument("--bindir", default=None, metavar="DIR",
                   help="directory of the installed nvsymlinkd program, for ExecStart= (default /usr/bin)")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.systemd.render import DEFAULT_BINDIR, RenderOptions, render_all, render_drop_ins

    config = config.with_overrides(driver_root=args.driver_root, dev_char_path=args.dev_char_path,
                                   create_nodes=args.create_nodes, resync_interval=args.resync_interval,
                                   watchdog_sec=args.watchdog_sec, state_dir=args.state_dir)
    bindir = args.bindir or DEFAULT_BINDIR
    if not bindir.startswith("/"):
        raise UsageError(f"--bindir {bindir}: must be an absolute path (ExecStart= needs one)")
    if has_control_character(bindir):
        raise UsageError(f"--bindir {bindir!r}: must be free of control characters (newline, tab, ...)")
    if not is_utf8(bindir):
        from nvsymlinkd.text import printable

        raise UsageError(f"--bindir {printable(bindir)}: must be UTF-8 text (it goes into ExecStart=)")
    if args.drop_ins is not None:
        for name, text in render_drop_ins(config, RenderOptions(bindir=bindir)).items():
            path = os.path.join(args.drop_ins, name)
            if text is not None:
                write_file(path, text)
            else:
                remove_file(path)
        return EXIT_OK
    files = render_all(config, RenderOptions(bindir=bindir))
    if args.output is None:
        for i, (name, text) in enumerate(files.items()):
            sys.stdout.write(("\n" if i else "") + f"==> {name} <==\n{text}")
        return EXIT_OK
    for name, text in files.items():
        write_file(os.path.join(args.output, name), text)
    return EXIT_OK


def write_file(path: str, text: str) -> None:
    """Replace PATH atomically (a reader never sees half a unit), mode 0644."""
    from nvsymlinkd.host.atomicfile import write_atomic

    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomic(path, text, 0o644)
    except OSError as exc:
        raise NvsymlinkdError(f"{exc.filename or path}: cannot write: {exc.strerror}; "
                              "check --output (an existing, writable directory or a path that can be created)")


def remove_file(path: str) -> None:
    """Remove a drop-in an earlier render wrote, now that the packaged unit is right again."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise NvsymlinkdError(f"{path}: cannot remove the stale drop-in: {exc.strerror}")
