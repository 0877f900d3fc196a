"""The one config model shared by the CLI, the daemon and the rendered units.

File: /etc/nvsymlinkd/nvsymlinkd.toml inside --root (or --config FILE, taken
as given). Flat `key = value` pairs. Command-line flags win over the file.
Unknown keys and wrong types are errors that name the file, the key and what
is allowed.
"""

from __future__ import annotations

import re
import sys

from nvsymlinkd.errors import ConfigError
from nvsymlinkd.record import dataclass, fields, replace
from nvsymlinkd.text import printable

DEFAULT_CONFIG = "/etc/nvsymlinkd/nvsymlinkd.toml"
MAX_CONFIG_BYTES = 1 << 20  # a flat file of ten keys: a MiB is a mistake, not a config


@dataclass(frozen=True)
class Key:
    name: str
    kind: str  # bool, path, optional_path, listen, seconds, choice, int, str
    default: object
    help: str
    choices: tuple = ()
    minimum: float = 0.0  # seconds: 0 (off) or a value within [minimum, maximum]
    maximum: float = float("inf")


KEYS = (
    Key("driver_root", "path", "/", "Root of the NVIDIA driver installation; nodes are searched under DRIVER_ROOT/dev "
        "(/run/nvidia/driver with the GPU Operator's driver container)."),
    Key("dev_char_path", "path", "/dev/char", "Directory of the MAJOR:MINOR symlinks systemd and runc look up."),
    Key("create_nodes", "bool", False, "Create missing device nodes the driver says should exist, with owner and mode "
        "from /proc/driver/nvidia/params."),
    # below 1 s a resync is a busy loop (each pass re-reads /proc and every container)
    Key("resync_interval", "seconds", 60.0, "Daemon: seconds between full resyncs (the safety net), 1 to 86400; "
        "0 disables.", minimum=1, maximum=86400),
    # the daemon pings at half the period; under 5 s a slow pass on a loaded node gets it killed
    Key("watchdog_sec", "seconds", 30.0, "Rendered unit: WatchdogSec= of nvsymlinkd.service, 5 to 3600; "
        "0 disables.", minimum=5, maximum=3600),
    Key("repair", "choice", "auto", "What to do about GPU containers that lost or are about to lose devices.",
        choices=("off", "report", "auto")),
    Key("state_dir", "path", "/run/nvsymlinkd", "Where the daemon keeps container baselines (tmpfs: gone at reboot)."),
    Key("metrics_textfile", "optional_path", "",
        "Daemon: Prometheus metrics file for node-exporter's textfile collector, replaced atomically, e.g. "
        "\"/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom\"; \"\" (default) writes none."),
    Key("metrics_listen", "listen", "", "Daemon: HOST:PORT to serve Prometheus metrics on (GET /metrics), "
        "e.g. \"127.0.0.1:9402\"; \"\" (default) serves nothing."),
)
KEY_BY_NAME = {k.name: k for k in KEYS}


@dataclass(frozen=True)
class Config:
    driver_root: str = "/"
    dev_char_path: str = "/dev/char"
    create_nodes: bool = False
    resync_interval: float = 60.0
    watchdog_sec: float = 30.0
    repair: str = "auto"
    state_dir: str = "/run/nvsymlinkd"
    metrics_textfile: str = ""
    metrics_listen: str = ""
    source: str | None = None  # the file it came from, for messages

    def with_overrides(self, **values) -> Config:
        """Apply command-line values; None means "not given" and keeps the file's value."""
        given = {k: v for k, v in values.items() if v is not None}
        for name, value in given.items():
            if name not in KEY_BY_NAME:
                raise KeyError(name)
            given[name] = _coerce(KEY_BY_NAME[name], value, "command line")
        return replace(self, **given)


assert {f.name for f in fields(Config)} - {"source"} == set(KEY_BY_NAME), "Config and KEYS disagree"


def toml_module():
    """tomllib, or its backport tomli before Python 3.11 (the one TOML reader of the project)."""
    if sys.version_info >= (3, 11):
        import tomllib  # novermin (guarded by the version check)
    else:  # pragma: no cover - exercised on 3.9/3.10
        import tomli as tomllib
    return tomllib


def _load_toml(data: bytes, path: str) -> dict:
    tomllib = toml_module()
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8")
    except tomllib.TOMLDecodeError as exc:
        # tomllib puts the position in the message: "(at line 3, column 5)" or "(at end of document)"
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column \d+\)", msg)
        line = int(m.group(1)) if m else max(1, data.count(b"\n"))
        msg = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)", "", msg)
        raise ConfigError(f"{path}:{line}: invalid TOML: {msg}; fix that line (see man nvsymlinkd.toml)")


# C0, DEL and C1: a newline in a value would start a new line in a rendered unit
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def has_control_character(text: str) -> bool:
    return _CONTROL.search(text) is not None


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _coerce(key: Key, value, where: str):
    def bad(what: str):
        return ConfigError(f"{where}: key '{key.name}' must be {what}, got {value!r}")

    if isinstance(value, str) and has_control_character(value):
        raise bad("free of control characters (newline, tab, ...)")
    if isinstance(value, str) and not is_utf8(value):
        # a command-line byte that is not UTF-8 (os.fsdecode made it a lone surrogate): a systemd unit
        # and the journal are UTF-8, and the value is shown with its bytes escaped
        raise ConfigError(f"{where}: key '{key.name}' must be UTF-8 text, got '{printable(value)}'")

    if key.kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if key.kind in ("path", "optional_path"):
        if not isinstance(value, str) or not (value.startswith("/") or key.kind == "optional_path" and value == ""):
            raise bad("an absolute path (a string starting with /)" if key.kind == "path"
                      else 'an absolute path or "" (off)')
        value = normal_path(value) if value else value
        problem = path_problem(key.name, value)
        if problem is not None:
            raise ConfigError(f"{where}: key '{key.name}' = {value!r}: {problem}")
        return value
    if key.kind == "listen":
        if not isinstance(value, str) or not (value == "" or _is_listen(value)):
            raise bad('HOST:PORT (e.g. "127.0.0.1:9402") or "" (off)')
        return value
    if key.kind == "seconds":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise bad("a number of seconds")
        if value != 0 and not key.minimum <= value <= key.maximum:
            raise bad(f"0 (off) or a number of seconds from {key.minimum:g} to {key.maximum:g}")
        return float(value) if value != 0 else 0.0  # -0.0 is off too, never rendered "-0"
    if key.kind == "choice":
        if value not in key.choices:
            raise bad("one of " + ", ".join(f'"{c}"' for c in key.choices))
        return value
    raise AssertionError(key.kind)


def normal_path(path: str) -> str:
    """`path` as systemd wants it in a unit (it ignores a path that is not normalized): no `.`, `..`, `//`
    or trailing `/`. Lexical, as systemd's own path_simplify."""
    import posixpath

    return "/" + posixpath.normpath(path).lstrip("/")


# Directories a config may not make writable: ReadWritePaths= of one of them undoes ProtectSystem=strict
# for all of it (dev_char_path = "/" rendered ReadWritePaths=-/), and the daemon would write among the
# system's own files. The metrics textfile's directory counts (the unit opens it for the atomic rename).
SYSTEM_DIRS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt",
                         "/opt", "/proc", "/run", "/sbin", "/sys", "/usr", "/var", "/var/cache", "/var/lib", "/var/log",
                         "/var/spool", "/run/systemd"})
SYSTEM_TREES = ("/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/usr")
# Private to the unit (PrivateTmp=yes, ProtectHome=yes): the daemon would use another directory than a CLI
# run from a shell, or none at all; systemd's /tmp is also cleaned behind its back.
PRIVATE_TREES = ("/tmp", "/var/tmp", "/home", "/root", "/run/user")
WRITABLE_KEYS = {"dev_char_path": "links are made in it", "state_dir": "the daemon writes its state there",
                 "metrics_textfile": "its directory is made writable for the atomic replace"}


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree + "/")


def path_problem(key: str, path: str) -> str | None:
    """Why a normalized path makes no sense for this key (see SYSTEM_DIRS, PRIVATE_TREES), or None."""
    if key not in WRITABLE_KEYS or not path:
        return None
    directory = path.rpartition("/")[0] or "/" if key == "metrics_textfile" else path
    what = "its directory " + directory if directory != path else "it"
    if key == "metrics_textfile" and path == "/":
        return "names no file; give a file in a directory of its own, e.g. " \
               "/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"
    if directory in SYSTEM_DIRS or any(_within(directory, t) for t in SYSTEM_TREES):
        return (f"{what} is a system directory the units keep read-only ({WRITABLE_KEYS[key]}); "
                "use a directory of its own")
    for tree in PRIVATE_TREES:
        if _within(directory, tree):
            return (f"{what} is under {tree}, which the units make private (PrivateTmp=, ProtectHome=): "
                    "the daemon and the command line would use different directories; use one under /run, "
                    "/var/lib or /srv")
    return None


def parse_listen(listen: str) -> tuple:
    """"127.0.0.1:9402" / "[::1]:9402" / ":9402" (all addresses) -> (host or None, port)."""
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^\[\]:]*)):(\d{1,5})", listen)
    if m is None or not 0 < int(m.group(3)) < 65536:
        raise ValueError(f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:9402, [::1]:9402)")
    host = m.group(1) if m.group(1) is not None else m.group(2)
    return (host or None), int(m.group(3))


def _is_listen(value: str) -> bool:
    try:
        parse_listen(value)
    except ValueError:
        return False
    return True


def parse_config(data: bytes, path: str) -> Config:
    raw = _load_toml(data, path)
    values = {}
    for name, value in raw.items():
        key = KEY_BY_NAME.get(name)
        if key is None:
            allowed = ", ".join(sorted(KEY_BY_NAME))
            raise ConfigError(f"{path}: unknown key '{name}' (allowed: {allowed})")
        values[name] = _coerce(key, value, path)
    return Config(source=path, **values)


def load_config(root, explicit_path: str | None = None) -> Config:
    """Load the config file; an absent default file is fine, an absent --config file is not.

    Read as runtime files are: a regular file (or /dev/null), at most MAX_CONFIG_BYTES, never blocking
    on a fifo; the default path is resolved confined to --root (an explicit --config is taken as given).
    """
    import os

    from nvsymlinkd.errors import UnsafeFile
    from nvsymlinkd.host.root import read_regular

    shown = explicit_path if explicit_path is not None else DEFAULT_CONFIG
    try:
        if explicit_path is not None:
            fd = os.open(explicit_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        else:
            fd = root.open_file(DEFAULT_CONFIG)
        try:
            data = read_regular(fd, shown, MAX_CONFIG_BYTES)
        finally:
            os.close(fd)
    except FileNotFoundError:
        if explicit_path is not None:
            raise ConfigError(f"{shown}: no such file; check the --config path")
        return Config()
    except UnsafeFile as exc:
        raise ConfigError(f"{exc}; the config must be a regular TOML file of at most {MAX_CONFIG_BYTES >> 20} MiB")
    except IsADirectoryError:
        raise ConfigError(f"{shown}: is a directory, not a TOML file")
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot read: {exc.strerror}")
    return parse_config(data, shown)
