"""Deciding: the concrete udev rule and systemd units for one Config.

The jinja2 templates are the single source (the repo keeps them in rules/ and
units/; nvsymlinkd/templates/ links them into the package). Packaging runs
`nvsymlinkd render` at build time, operators run it to re-render for their
config. Pure: config in, {file name: text} out; the command writes files.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from nvsymlinkd.config import Config, has_control_character
from nvsymlinkd.errors import NvsymlinkdError

SERVICE = "nvsymlinkd.service"
SYNC_SERVICE = "nvsymlinkd-sync.service"
RULES = "71-nvsymlinkd.rules"
# output file name -> template file name (in nvsymlinkd/templates)
TEMPLATES = {
    RULES: RULES + ".j2",
    SERVICE: SERVICE + ".j2",
    SYNC_SERVICE: SYNC_SERVICE + ".j2",
}
DEFAULT_BINDIR = "/usr/bin"
DEFAULT_RUNTIME_PARENT = "/run"
# state_dir under one of these parents: systemd creates it (ProtectSystem=strict keeps it writable)
EXEC_DIRECTORIES = (("/run", "RuntimeDirectory"), ("/var/lib", "StateDirectory"), ("/var/cache", "CacheDirectory"),
                    ("/var/log", "LogsDirectory"))

_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


@dataclass(frozen=True)
class RenderOptions:
    bindir: str = DEFAULT_BINDIR  # where the nvsymlinkd entry point is installed


def systemd_word(word: str, variables: bool = True) -> str:
    """One word of a unit-file command line (variables=True: `$` is expanded there, so `$$`) or of a path
    list (ReadWritePaths=, StateDirectory=, RuntimeDirectory=: variables=False, since those expand
    specifiers only and `$$` would name another path). Specifiers (`%`) are escaped in both."""
    if has_control_character(word):
        # a unit line cannot carry one (a newline would start a new directive); config refuses them first
        raise NvsymlinkdError(f"{word!r}: a control character cannot be written into a systemd unit")
    escaped = word.replace("%", "%%")
    if variables:
        escaped = escaped.replace("$", "$$")
    if _PLAIN_WORD.fullmatch(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _seconds(value: float) -> str:
    """Plain decimal seconds to the microsecond, as systemd parses them (never 1e+07)."""
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def link_flags(config: Config) -> list[str]:
    """Flags for the values the units must pass: only those that differ from the built-in
    defaults, so an operator's config file still decides everything else."""
    default = Config()
    flags: list[str] = []
    if config.driver_root != default.driver_root:
        flags += ["--driver-root", config.driver_root]
    if config.dev_char_path != default.dev_char_path:
        flags += ["--dev-char-path", config.dev_char_path]
    if config.create_nodes:
        flags.append("--create-nodes")
    return flags


def writable_paths(config: Config, for_daemon: bool) -> list[str]:
    """Paths outside /dev the service writes, for ReadWritePaths= under ProtectSystem=strict."""
    paths = []
    if not _under(config.dev_char_path, "/dev"):
        paths.append(config.dev_char_path)
    driver_dev = posixpath.join(config.driver_root, "dev")
    if config.create_nodes and not _under(driver_dev, "/dev"):
        paths.append(driver_dev)
    textfile = getattr(config, "metrics_textfile", "")
    if for_daemon and textfile:
        # replaced atomically: a temporary file in the same directory, then rename
        paths.append(posixpath.dirname(textfile))
    return paths


LOOPBACK_HOSTS = ("localhost", "::1")


def network_policy(config: Config) -> dict:
    """Socket families and IP firewall of the daemon: none unless metrics_listen serves HTTP."""
    listen = getattr(config, "metrics_listen", "")
    if not listen:
        return {"address_families": "AF_UNIX AF_NETLINK", "ip_allow": None, "ip_deny": "any"}
    host = listen.rsplit(":", 1)[0].strip("[]")
    local = host in LOOPBACK_HOSTS or host.startswith("127.")
    return {"address_families": "AF_UNIX AF_NETLINK AF_INET AF_INET6",
            "ip_allow": "localhost" if local else None,
            "ip_deny": "any" if local else None}


def state_directory(config: Config) -> tuple[str, str] | None:
    """(directive, name) that makes systemd create state_dir, e.g. ("StateDirectory", "nvsymlinkd") for
    /var/lib/nvsymlinkd; None when state_dir is elsewhere (then it must exist: ReadWritePaths=)."""
    path = config.state_dir.rstrip("/")
    if posixpath.normpath(path) != path:
        return None  # "..", "." or "//": not a plain directory below the parent
    for parent, directive in EXEC_DIRECTORIES:
        if path.startswith(parent + "/"):
            return directive, path[len(parent) + 1:]
    return None


def runtime_directory(config: Config) -> str | None:
    """RuntimeDirectory= name when state_dir is under /run, else None."""
    found = state_directory(config)
    return found[1] if found and found[0] == "RuntimeDirectory" else None


def state_directory_line(config: Config) -> str | None:
    found = state_directory(config)
    return f"{found[0]}={systemd_path(found[1])}" if found else None


def systemd_path(path: str) -> str:
    """One path of a path-list directive: specifiers escaped, `$` kept (see systemd_word)."""
    return systemd_word(path, variables=False)


def checked(config: Config) -> Config:
    """The config with its paths normalized (systemd ignores a path that is not: "path is not normalized"),
    or NvsymlinkdError for a path that makes no sense in a unit (config.path_problem): a Config built in
    code gets the checks a config file gets."""
    from nvsymlinkd.config import KEY_BY_NAME, normal_path, path_problem
    from nvsymlinkd.record import replace

    changes: dict = {}
    for key in KEY_BY_NAME.values():
        value = getattr(config, key.name)
        if key.kind in ("path", "optional_path") and value:
            normal = normal_path(value)
            problem = path_problem(key.name, normal)
            if problem is not None:
                raise NvsymlinkdError(f"{key.name} = {value!r}: {problem}")
            if normal != value:
                changes[key.name] = normal
    return replace(config, **changes) if changes else config


def template_values(config: Config, options: RenderOptions) -> dict:
    config = checked(config)
    exe = posixpath.join(options.bindir, "nvsymlinkd")
    flags = link_flags(config)
    run_flags = list(flags)
    if config.resync_interval != Config().resync_interval:
        run_flags += ["--resync-interval", _seconds(config.resync_interval)]
    return {
        "service": SERVICE,
        "exec_start": " ".join(systemd_word(w) for w in [exe, "run", *run_flags]),
        "exec_sync": " ".join(systemd_word(w) for w in [exe, "sync", *flags]),
        "watchdog_sec": _seconds(config.watchdog_sec) if config.watchdog_sec > 0 else None,
        "state_directory": state_directory_line(config),
        "runtime_directory": runtime_directory(config),
        "extra_rw_paths": [systemd_path(p) for p in writable_paths(config, for_daemon=True)],
        # no "-": a missing state_dir fails the start loudly instead of losing every baseline write
        "state_rw_path": systemd_path(config.state_dir) if state_directory(config) is None else None,
        "sync_rw_paths": [systemd_path(p) for p in writable_paths(config, for_daemon=False)],
        "metrics_listen": getattr(config, "metrics_listen", ""),
        **network_policy(config),
    }


def header(template: str) -> str:
    return (f"# Generated by `nvsymlinkd render` from {template}; do not edit or copy.\n"
            "# After changing /etc/nvsymlinkd/nvsymlinkd.toml: `nvsymlinkd render --drop-ins /etc/systemd/system`\n"
            "# (overrides for exactly the changed settings) and `systemctl daemon-reload`.")


def render_all(config: Config, options: RenderOptions | None = None) -> dict[str, str]:
    """{output file name: text} for every template, in a fixed order."""
    import jinja2

    options = options or RenderOptions()
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("nvsymlinkd", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # unit files and udev rules, not HTML
    )
    values = template_values(config, options)
    out = {}
    for name, template in TEMPLATES.items():
        try:
            loaded = env.get_template(template)
        except jinja2.TemplateNotFound:
            raise NvsymlinkdError(f"nvsymlinkd/templates/{template}: missing from the installed package; "
                                  "reinstall nvsymlinkd (a source checkout needs its rules/ and units/)")
        out[name] = loaded.render(header=header(template), **values)
    return out


# -- drop-ins: overrides of the packaged units for exactly the settings this config changes ------------------

DROP_IN = "50-nvsymlinkd-config.conf"
# Directives holding lists: an empty assignment resets them. Where the new list only adds to the packaged
# one, the drop-in adds (later package fixes to the list still apply); otherwise it resets and restates.
LIST_DIRECTIVES = {"ExecStart", "ReadWritePaths", "RuntimeDirectory", "StateDirectory", "CacheDirectory",
                   "LogsDirectory", "RestrictAddressFamilies", "IPAddressAllow", "IPAddressDeny"}
ADDITIVE_DIRECTIVES = LIST_DIRECTIVES - {"ExecStart", "RestrictAddressFamilies", "IPAddressDeny"}
# What a scalar directive the packaged unit sets but this config drops must be set to
OFF_VALUES = {"WatchdogSec": "0", "RuntimeDirectoryPreserve": "no"}
_WORD = re.compile(r'(?:[^\s"]|"(?:\\.|[^"\\])*")+')


def _settings(text: str) -> dict:
    """{(section, directive): [value of each line]} of a unit file, comments left out."""
    out: dict = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault((section, key), []).append(value)
    return out


def drop_in(packaged: str, effective: str, unit: str, source: str | None = None) -> str | None:
    """The drop-in that turns the packaged unit into the effective one, or None when they agree.
    `source`: the config file the settings came from (Config.source), named in the header."""
    before, after = _settings(packaged), _settings(effective)
    sections: dict = {}
    for section, key in list(before) + [k for k in after if k not in before]:
        old, new = before.get((section, key), []), after.get((section, key), [])
        if old == new:
            continue
        lines = sections.setdefault(section, [])
        old_words = [w for v in old for w in _WORD.findall(v)]
        new_words = [w for v in new for w in _WORD.findall(v)]
        if key in ADDITIVE_DIRECTIVES and new and all(w in new_words for w in old_words):
            lines.append(f"{key}=" + " ".join(w for w in new_words if w not in old_words))
        elif key in LIST_DIRECTIVES:
            lines += [f"{key}="] + [f"{key}={v}" for v in new]
        elif new:
            lines.append(f"{key}={new[-1]}")
        elif key in OFF_VALUES:
            lines.append(f"{key}={OFF_VALUES[key]}")
        else:  # a template change this table does not know yet: never write a drop-in that is silently wrong
            raise AssertionError(f"{unit}: no known way to unset {key}= in a drop-in")
    if not sections:
        return None
    body = "".join(f"\n[{section}]\n" + "".join(line + "\n" for line in lines) for section, lines in sections.items())
    where = source or "no config file (built-in defaults)"
    return (f"# Generated by `nvsymlinkd render --drop-ins`: the settings of {where}\n"
            f"# and the render options that differ from the packaged {unit}. Do not edit: change the\n"
            "# config, render again and `systemctl daemon-reload`. Delete it to return to the packaged unit.\n"
            + body)


def render_drop_ins(config: Config, options: RenderOptions | None = None) -> dict[str, str | None]:
    """{"UNIT.d/50-nvsymlinkd-config.conf": text, or None where the packaged unit is already right}."""
    packaged, effective = render_all(Config()), render_all(config, options)
    # The udev rule does not depend on the config (tests/test_render.py checks it): nothing to override.
    assert packaged[RULES] == effective[RULES], "the udev rule now depends on the config: handle it here"
    return {f"{unit}.d/{DROP_IN}": drop_in(packaged[unit], effective[unit], unit, config.source)
            for unit in (SERVICE, SYNC_SERVICE)}
