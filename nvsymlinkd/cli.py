"""Command line: global options, then one subcommand per module in nvsymlinkd.commands.

Only the module of the command that runs is imported (the others appear in `--help` by
their one-line summary), and command modules stay cheap to import: each imports its heavy
parts inside its run function, so `nvsymlinkd sync` never pays for D-Bus or jinja2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from nvsymlinkd import __version__
from nvsymlinkd.commands.output import JSON_SCHEMA_VERSION, stdout_gone
from nvsymlinkd.commands.usage import SUMMARIES, CommandLineError, HelpFormatter, with_root
from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.text import printable

# Each name is a module nvsymlinkd.commands.<name> with register(subparsers); its summary (the
# subparser's help=) is in commands.usage, so `nvsymlinkd --help` lists every command without importing them.
COMMANDS = ("sync", "run", "render", "check", "repair")

EPILOG = """\
examples:
  nvsymlinkd sync --dry-run      # what the links need; nothing changed
  nvsymlinkd check               # are GPU containers about to lose devices?
  nvsymlinkd repair --dry-run
  nvsymlinkd COMMAND --help

reference: man nvsymlinkd, nvsymlinkd-COMMAND, nvsymlinkd.toml (config file)"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 2 with one line, like every other error
        self.print_usage(sys.stderr)
        raise CommandLineError(message)

    def _get_formatter(self):
        # While the parser is built, argparse makes a formatter per add_argument only to check a
        # metavar (no width used): a fixed width spares sync's start the `shutil` import (~1.5 ms)
        # that asks the terminal's. Help and usage text are formatted after, at the real width.
        if _building:
            return self.formatter_class(prog=self.prog, width=80)
        return super()._get_formatter()


_building = False

# Commands for the shell completions only (completions/): never in --help, the man pages or the docs.
HIDDEN_COMMANDS = ("complete-containers",)
# what a CONTAINER word may hold: the characters of runtime ids, Kubernetes and Docker names and `/` (never
# a shell's: `$`, backquotes, `;`, globs, blanks); the shells filter the same way (completions/)
COMPLETION_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+/-]{0,512}")


def _complete_containers(args, root, config) -> int:
    """The words `check` and `repair` take for CONTAINER, one per line: each GPU container's short id
    and its names. Discovery only (no verification, no bus): fast enough for a TAB, and quiet."""
    from nvsymlinkd.containers.discovery import discover, names_of
    from nvsymlinkd.containers.ocispec import gpu_signs
    from nvsymlinkd.devchar.snapshot import read_majors

    try:
        majors = frozenset(read_majors(root).nvidia_majors)
    except NvsymlinkdError:
        majors = frozenset()
    words = []
    for c in discover(root):
        if not gpu_signs(c.spec, c.state, majors):
            continue
        for word in (c.short_id, *sorted(names_of(c))):
            if word not in words and COMPLETION_WORD.fullmatch(word):
                words.append(word)
    sys.stdout.write("".join(w + "\n" for w in words))
    return 0


def _global_options(parser, default_root, default_config) -> None:
    parser.add_argument("--root", default=default_root, metavar="DIR",
                        help="resolve every host path (/dev, /proc, /sys, /run, /etc) under DIR (default /)")
    parser.add_argument("--config", default=default_config, metavar="FILE",
                        help="config file (default /etc/nvsymlinkd/nvsymlinkd.toml inside --root)")


def build_parser(only: str | None = None, stubs: bool = False) -> argparse.ArgumentParser:
    """The whole command line; with `only`, that command's parser in full and every other one a
    stub (its summary for `--help`, no options: never chosen once `only` is the command given);
    with `stubs`, every command a stub (enough to learn which command argv names)."""
    global _building
    _building = True
    try:
        parser = _Parser(prog="nvsymlinkd", description="Keep GPU containers from silently losing their NVIDIA devices.",
                         epilog=EPILOG, formatter_class=HelpFormatter)
        parser.add_argument("--version", action="version", version=f"nvsymlinkd {__version__}")
        _global_options(parser, "/", None)
        sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
        sub.required = True
        for name in COMMANDS:
            if stubs or only not in (None, name):
                sub.add_parser(name, help=SUMMARIES[name], add_help=False)
                continue
            importlib.import_module(f"nvsymlinkd.commands.{name}").register(sub)
            # the global options are accepted after the subcommand too (`nvsymlinkd sync --root X`);
            # SUPPRESS: given there, they win; not given, the value from before the subcommand stays
            _global_options(sub.choices[name], argparse.SUPPRESS, argparse.SUPPRESS)
        for name in HIDDEN_COMMANDS:  # no help=: not listed in --help, not documented (shells call it)
            hidden = sub.add_parser(name, add_help=False)
            hidden.set_defaults(func=_complete_containers)
            _global_options(hidden, argparse.SUPPRESS, argparse.SUPPRESS)
        return parser
    finally:
        _building = False


def parse_args(argv: list) -> argparse.Namespace:
    """argv parsed by the parser of the command it names, the other commands' modules not imported.

    The stub pass's top-level parser is the full one's (same options, summaries, errors, --help,
    --version), and a stub takes no options (`sync --help` is left for the full pass), so both
    passes read the global options and the command name from argv the same way."""
    command = build_parser(stubs=True).parse_known_args(argv)[0].command
    return build_parser(only=command).parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = root = None
    try:
        args = parse_args(argv)
        from nvsymlinkd.config import load_config
        from nvsymlinkd.host.root import HostRoot

        root = HostRoot(args.root)
        try:
            config = load_config(root, args.config)
        except NvsymlinkdError as exc:
            # a command that must go on without its config (repair --before-reload, in a package
            # script) says so and returns the defaults; any other re-raises (exit 2)
            fallback = getattr(args, "on_config_error", None)
            if fallback is None:
                raise
            config = fallback(args, exc)
        return args.func(args, root, config)
    except NvsymlinkdError as exc:
        message = printable(with_root(str(exc), root) if root is not None else str(exc))
        prefix = "error: " if isinstance(exc, CommandLineError) else ""
        sys.stderr.write(f"nvsymlinkd: {prefix}{message}\n")
        wants_json = getattr(args, "json", False) if args is not None else "--json" in argv
        if wants_json:  # `... --json | jq` gets a document, not empty input
            _print_json_error(message, exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        stdout_gone()
        return 0


def _print_json_error(message: str, exit_code: int) -> None:
    import json  # only on this error path: not on every command's start

    try:
        json.dump({"schema_version": JSON_SCHEMA_VERSION, "ok": False, "error": message, "exit_code": exit_code},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


