"""Command line: global options, then one subcommand per module in nvsymlinkd.commands.

Command modules stay cheap to import: each imports its heavy parts inside
its run function, so `nvsymlinkd sync` never pays for D-Bus or jinja2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nvsymlinkd import __version__
from nvsymlinkd.errors import EXIT_ERROR, NvsymlinkdError

# Each name is a module nvsymlinkd.commands.<name> with register(subparsers).
COMMANDS = ("sync", "run", "render", "check", "repair")

EPILOG = """\
examples:
  nvsymlinkd sync --dry-run                     # what the links need; nothing changed
  nvsymlinkd check                              # are GPU containers about to lose devices?
  nvsymlinkd repair --dry-run
  nvsymlinkd COMMAND --help

reference: man nvsymlinkd, man nvsymlinkd-COMMAND, man nvsymlinkd.toml (the config file)"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 2 with one line, like every other error
        self.print_usage(sys.stderr)
        sys.stderr.write(f"nvsymlinkd: error: {message}\n")
        raise SystemExit(EXIT_ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nvsymlinkd", description="Keep GPU containers from silently losing their NVIDIA devices.",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"nvsymlinkd {__version__}")
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="resolve every host path (/dev, /proc, /sys, /run, /etc) under DIR (default /)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="config file (default /etc/nvsymlinkd/nvsymlinkd.toml inside --root)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"nvsymlinkd.commands.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from nvsymlinkd.config import load_config
        from nvsymlinkd.hostroot import HostRoot

        root = HostRoot(args.root)
        config = load_config(root, args.config)
        return args.func(args, root, config)
    except NvsymlinkdError as exc:
        sys.stderr.write(f"nvsymlinkd: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
