"""`nvsymlinkd run`: the event daemon (Type=notify service)."""

from __future__ import annotations

import importlib
import sys

from nvsymlinkd.commands.sync import add_link_options
from nvsymlinkd.commands.usage import SUMMARIES, HelpFormatter

EPILOG = """\
examples:
  systemctl status nvsymlinkd           # the packaged unit runs this command
  systemctl reload nvsymlinkd           # SIGHUP: re-read the config file
  journalctl -x -u nvsymlinkd           # events, with the message catalog
  nvsymlinkd run --resync-interval 30   # in the foreground, for debugging

event sources, signals, journal MESSAGE_IDs and metrics: man nvsymlinkd-run
"""


def register(sub) -> None:
    p = sub.add_parser("run", help=SUMMARIES["run"],
                       description="Keep DEV_CHAR_PATH exact on every device-node, udev and systemd event, and "
                                   "notice systemd reloads. Runs until SIGTERM; SIGHUP re-reads the config.",
                       epilog=EPILOG, formatter_class=HelpFormatter)
    add_link_options(p)
    p.add_argument("--resync-interval", type=float, default=None, metavar="SEC",
                   help="seconds between full resyncs, the safety net (default 60; 0 disables)")
    p.set_defaults(func=run)


def _without_openssl_hashes() -> None:
    """hashlib's OpenSSL backend maps libcrypto (~3.5 MiB resident, measured); the daemon hashes only
    baseline and repair-record names with sha256, which Python's built-in module gives bit for bit.
    Only where that module exists (some distributions build Python without it)."""
    for builtin in ("_sha256", "_sha2"):  # Python 3.12 merged _sha256 into _sha2
        try:
            importlib.import_module(builtin)
        except ImportError:
            continue
        sys.modules.setdefault("_hashlib", None)  # type: ignore[arg-type]
        return


def run(args, root, config) -> int:
    # The daemon speaks no TLS; asyncio (and http.client) import ssl only when it is there, and
    # loading OpenSSL costs ~4 MiB of resident memory for the daemon's whole life (measured).
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]  # None: "not importable", by design
    # dbus_next loads its GLib backend too when PyGObject is installed (Debian's python3-gi often is):
    # GLib and GObject introspection cost ~3.7 MiB of resident memory; the daemon runs on asyncio.
    sys.modules.setdefault("gi", None)  # type: ignore[arg-type]  # None: "import gi" raises ImportError
    # pyudev imports ctypes.util, which imports shutil, which loads bz2 and lzma (libbz2, liblzma) when
    # they are there, for archives; the daemon compresses nothing (~0.3 MiB resident, measured; issue 38)
    for archive in ("bz2", "lzma"):
        sys.modules.setdefault(archive, None)  # type: ignore[arg-type]
    _without_openssl_hashes()
    import asyncio

    from nvsymlinkd.config import load_config
    from nvsymlinkd.daemon.loop import Daemon

    overrides = dict(driver_root=args.driver_root, dev_char_path=args.dev_char_path,
                     create_nodes=args.create_nodes, resync_interval=args.resync_interval)
    file_config, config = config, config.with_overrides(**overrides)

    async def main() -> int:
        from nvsymlinkd.daemon.containerwatch import ContainerWatch
        from nvsymlinkd.journal import Journal

        journal = Journal()

        def say_overridden(fresh, new) -> None:
            note = flags_over_file(fresh, new, overrides)
            if note:
                journal.notice(note)

        def reload_config():
            # command-line flags keep winning over the file after a SIGHUP too: said, never silent
            fresh = load_config(root, args.config)
            new = fresh.with_overrides(**overrides)
            say_overridden(fresh, new)
            return new

        say_overridden(file_config, config)
        daemon = Daemon(root, config, reload_config=reload_config, journal=journal)
        # the container verifier and repair ride on the daemon's events (reload, new scope, nodes, resync)
        daemon.hook = ContainerWatch(journal, root, lambda: daemon.config, metrics=daemon.metrics)
        return await daemon.run()

    return asyncio.run(main())


def flags_over_file(fresh, new, overrides: dict) -> str | None:
    """One line naming the config file's keys that a command-line flag overrides (`fresh`: the file's
    config, `new`: with the flags), or None: a key edited in the file then `systemctl reload` would
    otherwise change nothing without a word. A key the file leaves at its default is not named."""
    import json

    from nvsymlinkd.config import Config

    def shown(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return f"{value:g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, str) else str(value)

    default = Config()
    keys = [k for k, v in overrides.items() if v is not None and getattr(fresh, k) != getattr(new, k)
            and getattr(fresh, k) != getattr(default, k)]
    if not keys:
        return None
    said = ", ".join(f"{k} = {shown(getattr(fresh, k))} (--{k.replace('_', '-')} {shown(getattr(new, k))})"
                     for k in keys)
    return (f"config {fresh.source or 'file'}: {said}: the command-line flag wins over the file, at start and at "
            "every reload; drop the flag from the unit to use the file's value")
