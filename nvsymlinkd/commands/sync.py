"""`nvsymlinkd sync`: make /dev/char exact once (the boot-time job)."""

from __future__ import annotations

import argparse
import sys

from nvsymlinkd.cli import SUMMARIES
from nvsymlinkd.errors import EXIT_NOT_DESIRED, EXIT_OK

EPILOG = """\
examples:
  nvsymlinkd sync --dry-run                     # the plan; exit 1 when something would change
  nvsymlinkd sync                               # make /dev/char exact
  nvsymlinkd sync --driver-root /run/nvidia/driver   # the GPU Operator's driver container
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
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_link_options(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    p.add_argument("--json", action="store_true", help="print a JSON document (schema: man nvsymlinkd-sync)")
    p.set_defaults(func=run)


def run(args, root, config) -> int:
    from nvsymlinkd.cli import write_output
    from nvsymlinkd.devchar.reconcile import reconcile
    from nvsymlinkd.summary import sync_warnings

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

        doc = result.to_json()
        doc["warnings"] = warnings
        write_output(json.dumps(doc, indent=2) + "\n")
    else:
        write_output("".join(line + "\n" for line in result.human_lines()))
    # what the pass found, even when the reader went away (`sync --dry-run | head -1` under pipefail)
    return EXIT_OK if result.as_desired else EXIT_NOT_DESIRED
