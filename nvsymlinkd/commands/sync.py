"""`nvsymlinkd sync`: make /dev/char exact once (the boot-time job)."""

from __future__ import annotations

import argparse
import sys

from nvsymlinkd.commands.usage import SUMMARIES, HelpFormatter
from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK

EPILOG = """\
examples:
  nvsymlinkd sync --dry-run      # the plan; exit 1 if something would change
  nvsymlinkd sync                # make /dev/char exact
  nvsymlinkd sync --driver-root /run/nvidia/driver  # the driver container
  nvsymlinkd sync --create-nodes --json

actions, output and the JSON schema: man nvsymlinkd-sync
"""


def add_link_options(p) -> None:
    """Options shared by every command that manages links (sync, run)."""
    p.add_argument("--driver-root", default=None, metavar="DIR",
                   help="where the driver's dev/ lives, inside --root (default /; /run/nvidia/driver for the "
                        "driver container)")
    p.add_argument("--dev-char-path", default=None, metavar="DIR", help="symlink directory (default /dev/char)")
    p.add_argument("--create-nodes", default=None, action="store_true",
                   help="also create missing device nodes the driver says should exist")


def register(sub) -> None:
    p = sub.add_parser("sync", help=SUMMARIES["sync"],
                       description="Make DEV_CHAR_PATH/MAJOR:MINOR a relative symlink for every NVIDIA device node.",
                       epilog=EPILOG, formatter_class=HelpFormatter)
    add_link_options(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-sync)")
    add_ctk_options(p)
    p.set_defaults(func=run)


# `nvidia-ctk system create-dev-char-symlinks`'s own flags (cmd/nvidia-ctk/system/create-dev-char-symlinks
# in nvidia-container-toolkit), so a udev rule or unit that ran it works with `nvsymlinkd sync` in its
# place. --driver-root, --dev-char-path and --dry-run are the same words with the same meaning.
NO_MODULE_LOADING = (
    "nvsymlinkd does not load kernel modules: that is nvidia-modprobe's job (`nvidia-modprobe -u -c=0` "
    "loads nvidia and nvidia-uvm and makes their nodes; the driver's packages run it). Load them "
    "before sync; the daemon (nvsymlinkd run) links their nodes as they appear")
NO_WATCH = ("use `nvsymlinkd run` (nvsymlinkd.service): the daemon watches nodes, module loads and systemd "
            "reloads (nvidia-ctk removed --watch in 1.18.0)")


class _Refused(argparse.Action):
    """A flag of nvidia-ctk's that nvsymlinkd refuses, with why and what to do instead (exit 2)."""

    def __init__(self, option_strings, dest, why: str = "", **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def add_ctk_options(p) -> None:
    p.add_argument("--create-all", action="store_true",
                   help="accepted for nvidia-ctk's udev rule: sync always links every NVIDIA node that "
                        "exists; nodes made later are linked by the daemon (never a dangling link)")
    p.add_argument("--create-device-nodes", dest="create_nodes", default=None, action="store_true",
                   help="nvidia-ctk's name for --create-nodes")
    p.add_argument("--load-kernel-modules", action="store_true",
                   help="with --create-all refused: nvidia-modprobe loads the modules (man nvsymlinkd-sync, "
                        "NVIDIA-CTK); without it ignored with a warning, as nvidia-ctk does")
    p.add_argument("--watch", action=_Refused, why=NO_WATCH, help="refused: use `nvsymlinkd run`")


def _load_kernel_modules(args) -> None:
    """nvidia-ctk loads modules only with --create-all; without it, it warns and goes on
    (validateFlags, cmd/nvidia-ctk/system/create-dev-char-symlinks/create-dev-char-symlinks.go:134-137 at
    nvidia-container-toolkit v1.17.8, the same in v1.18.0: "load-kernel-modules is only applicable when
    create-all is set; ignoring"). With --create-all it asks for modules to be loaded, which nvsymlinkd
    refuses before doing anything."""
    if not args.load_kernel_modules:
        return
    if args.create_all:
        from nvsymlinkd.commands.usage import CommandLineError

        raise CommandLineError(f"--load-kernel-modules: {NO_MODULE_LOADING}")
    sys.stderr.write("nvsymlinkd: warning: --load-kernel-modules is only applicable with --create-all (as for "
                     "nvidia-ctk); ignoring\n")


def run(args, root, config) -> int:
    from nvsymlinkd.commands.output import write_output
    from nvsymlinkd.devchar.reconcile import reconcile
    from nvsymlinkd.devchar.summary import sync_warnings

    _load_kernel_modules(args)
    config = config.with_overrides(driver_root=args.driver_root, dev_char_path=args.dev_char_path,
                                   create_nodes=args.create_nodes)
    result = reconcile(root, config, dry_run=args.dry_run)
    # Not errors (exit 0: a CPU node, or a boot before the driver container, has nothing to link),
    # but never silent: a mistyped --driver-root in a boot unit must show in its log.
    warnings = sync_warnings(root, result)
    for w in warnings:
        sys.stderr.write(f"nvsymlinkd: warning: {w}\n")
    if args.json:
        import json  # only for --json: sync's start stays light

        from nvsymlinkd.commands.output import JSON_SCHEMA_VERSION

        doc = {"schema_version": JSON_SCHEMA_VERSION, **result.to_json()}
        doc["warnings"] = warnings
        write_output(json.dumps(doc, indent=2) + "\n")
    else:
        write_output("".join(line + "\n" for line in result.human_lines()))
    # what the pass found, even when the reader went away (`sync --dry-run | head -1` under pipefail)
    return EXIT_OK if result.as_desired else EXIT_NOT_DESIRED
