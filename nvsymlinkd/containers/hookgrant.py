"""What the NVIDIA prestart hook granted a container, reconstructed exactly or not at all. Pure: no I/O.

The legacy NVIDIA hook (`nvidia-container-runtime-hook prestart`, injected by Docker's `--gpus` or by
the `nvidia-container-runtime` wrapper in legacy mode) grants devices in the container's device
cgroup that are not in its spec. Nothing records that grant; this module recomputes it from what
the hook itself reads, the way the hook computes it (docs/hookgrant.md has the source lines):

- the spec: the hook entry (its args, parsed as Go's flag package does, and its env), process.env,
  /dev/null mounts under /var/run/nvidia-container-devices (Go's filepath.Clean), CAP_SYS_ADMIN in the
  bounding set (privileged);
- HookInputs, what containers.hookhost read from the host: the toolkit's version, the installer's
  wrapper script when the hook path is one, the config.toml the hook of that version finds (config_search;
  absent: the defaults; unreadable, malformed or ambiguous: not trusted), the driver's map from GPU index
  / UUID / PCI bus id to device minor (excluded GPUs apart) and the uvm and modeset nodes.

`reconstruct()` answers None when the spec has no such hook (nothing to reconstruct), else a
HookGrant: `trusted` with the exact devices (possibly none), or not trusted with the reason. Any
request it cannot resolve exactly (a MIG device by index or one NVML cannot name now, an IMEX channel whose node
is not `c M:N` now,
a UUID the driver does not list, an index whose order is ambiguous, a config option that changes the
selection) is not trusted: never a guess, and never more than the hook would grant.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple

from nvsymlinkd.host import imex
from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.imex import ImexNodes
from nvsymlinkd.host.mig import MigDevice, MigMap
from nvsymlinkd.host.paths import normalize

SOURCE = "nvidia-hook"  # the expected-access source name (containers.expected, repair.plan)
RW = Access("rw")  # libnvidia-container writes `c M:m rw` (src/nvc_mount.c, setup_device_cgroup)
FRONTEND_MAJOR = 195  # NV_DEVICE_MAJOR
CTL_MINOR = 255  # NV_CTL_DEVICE_MINOR
MODESET_MINOR = 254  # NV_MODESET_DEVICE_MINOR
HOOK_NAMES = frozenset({"nvidia-container-runtime-hook", "nvidia-container-toolkit"})
HOOK_KINDS = frozenset({"prestart", "createRuntime"})
DEVICE_LIST_ROOT = "/var/run/nvidia-container-devices"
DEFAULT_CAPABILITIES = frozenset({"utility", "compute"})
SUPPORTED_CAPABILITIES = frozenset({"compute", "compat32", "graphics", "utility", "video", "display", "ngx"})
# matches_pci_format (libnvidia-container src/cli/common.c): sscanf("%x:%02x:%02x.0") == 3 counts only the
# three conversions, so whatever follows the device number (".0", ".1", nothing) is never compared
_PCI = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})")
# two colons that _PCI does not read: sscanf's %x also takes a sign, 0x, blanks, a longer domain (not modelled)
_PCI_ODD = re.compile(r"[^:]*:[^:]*:", re.S)
# select_gpu_device's index: strtoumax(dev, &ptr, 10) with *ptr == '\0' (a sign is taken; "-N" wraps)
_INDEX = re.compile(r"([+-]?)([0-9]+)")
_MIG_INDEX = re.compile(r"\s*[+-]?\d+:\s*[+-]?\d+.*", re.S)  # sscanf("%lu:%lu") == 2
UINTMAX = (1 << 64) - 1

# (kind, path, args, env); env None: the entry has none (absent or null), () : an explicitly empty environment
HookEntry = Tuple[str, str, Optional[Tuple[str, ...]], Optional[Tuple[str, ...]]]
Version = Tuple[int, int, int]
DRIVER_CONFIG = "/run/nvidia/driver/etc/nvidia-container-runtime/config.toml"  # hook_config.go driverPath+configPath
ETC_CONFIG = "/etc/nvidia-container-runtime/config.toml"
RELATIVE_CONFIG = "nvidia-container-runtime/config.toml"  # config.RelativeFilePath (1.18+)
CONFIG_ENV = "NVIDIA_CTK_CONFIG_FILE_PATH"  # config.FilePathOverrideEnvVar (1.18+)
XDG_ENV = "XDG_CONFIG_HOME"
IMEX_MOUNT_PREFIX = "imex/"


@dataclass(frozen=True)
class ToolkitConfig:
    """The toolkit's config.toml as the hook reads it: absent -> its defaults (api/config/v1/config.go)."""

    readable: bool = True
    why: str = ""  # when not readable
    present: bool = False
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False
    no_cgroups: bool = False
    load_kmods: bool = True
    driver_root: str = ""
    supported_capabilities: frozenset[str] = SUPPORTED_CAPABILITIES
    swarm_resource: str = ""
    mode: str = "auto"
    skip_mode_detection: bool = False
    ignore_imex_requests: bool = False
    path: str = ""  # the file it was read from ("" : none found, the defaults)
    digest: str = ""  # sha256 of the file's text (containers.hookrecord: an edit since a container's first sight)


def unreadable_config(why: str) -> ToolkitConfig:
    return ToolkitConfig(readable=False, why=why, present=True)


# How the hook's TOML decoder matches a key to a struct field's tag:
# - go-toml v1 (toolkit 1.14+, vendor/github.com/pelletier/go-toml/marshal.go valueFromTree, keysToTry):
#   the tag, strings.ToLower(tag), strings.ToTitle(tag), the tag with its first letter lowered; the first
#   present wins. The tags are lower case, so: the tag itself, else its upper-case spelling.
# - BurntSushi/toml v1.0.0 (toolkit 1.13, vendor/github.com/BurntSushi/toml/decode.go unifyStruct): every key
#   of the table equal to the tag or strings.EqualFold with it is decoded into the field, in Go's random map
#   order: with two such keys of different values the outcome is not knowable.
GO_TOML = "go-toml"
BURNTSUSHI = "burntsushi"


def go_equal_fold(key: str, tag: str) -> bool:
    """strings.EqualFold(key, tag) for an ASCII lower-case tag: Unicode simple folding adds only the Kelvin
    sign (U+212A ~ k) and the long s (U+017F ~ s) to the ASCII letters' orbits."""
    if len(key) != len(tag):
        return False
    folded = key.replace("\u212a", "k").replace("\u017f", "s")
    return folded.isascii() and folded.lower() == tag


def _lookup(table: Mapping[str, Any], tag: str, dialect: str) -> tuple[bool, Any]:
    """(present, value) of the field whose tag is `tag`, as the dialect's decoder finds it."""
    if dialect == GO_TOML:
        for key in (tag, tag.upper()):
            if key in table:
                return True, table[key]
        return False, None
    matches = [k for k in table if k == tag or go_equal_fold(k, tag)]
    if not matches:
        return False, None
    values = [table[k] for k in matches]
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"{tag} is set {len(matches)} times in different letter cases ({', '.join(sorted(matches))}) "
                         "with different values: which one the hook read depends on Go's map order")
    return True, values[0]


def parse_toolkit_config(doc: Mapping[str, Any], dialect: str | None = GO_TOML) -> ToolkitConfig:
    """The fields the hook's device selection depends on, from the parsed TOML; a wrong type is not
    readable (the hook's own unmarshal would fail: the running container was made under another file).
    dialect None: the toolkit's version is unknown; trusted only where both decoders agree."""
    try:
        if dialect is None:
            a, b = _parse_toolkit_config(doc, GO_TOML), _parse_toolkit_config(doc, BURNTSUSHI)
            if a != b:
                return unreadable_config("a key is spelled in another letter case, and go-toml (toolkit 1.14+) and "
                                         "BurntSushi/toml (1.13) read it differently: the toolkit's version is unknown")
            return a
        return _parse_toolkit_config(doc, dialect)
    except ValueError as exc:
        return unreadable_config(str(exc))


def _get(table: Mapping[str, Any], key: str, kind: type, default: Any, dialect: str, where: str = "") -> Any:
    present, value = _lookup(table, key, dialect)
    if not present:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}{key} is not a {kind.__name__}")
    return value


def _table(doc: Mapping[str, Any], key: str, dialect: str) -> Mapping[str, Any]:
    value = _get(doc, key, dict, {}, dialect)
    if not isinstance(value, dict):
        raise ValueError(f"[{key}] is not a table")
    return value


def _parse_toolkit_config(doc: Mapping[str, Any], dialect: str) -> ToolkitConfig:
    def get(table: Mapping[str, Any], key: str, kind: type, default: Any, where: str = "") -> Any:
        return _get(table, key, kind, default, dialect, where)

    cli = _table(doc, "nvidia-container-cli", dialect)
    runtime = _table(doc, "nvidia-container-runtime", dialect)
    hook = _table(doc, "nvidia-container-runtime-hook", dialect)
    features = _table(doc, "features", dialect)
    supported = get(doc, "supported-driver-capabilities", str, "all")
    caps = SUPPORTED_CAPABILITIES if supported == "all" else frozenset(_split(supported))
    if not caps <= SUPPORTED_CAPABILITIES:
        raise ValueError(f"supported-driver-capabilities {supported!r} names an unknown capability")
    return ToolkitConfig(
        present=True,
        accept_envvar_unprivileged=get(doc, "accept-nvidia-visible-devices-envvar-when-unprivileged", bool, True),
        accept_volume_mounts=get(doc, "accept-nvidia-visible-devices-as-volume-mounts", bool, False),
        no_cgroups=get(cli, "no-cgroups", bool, False, "nvidia-container-cli."),
        load_kmods=get(cli, "load-kmods", bool, True, "nvidia-container-cli."),  # unset: the default
        driver_root=get(cli, "root", str, "", "nvidia-container-cli."),
        supported_capabilities=caps,
        swarm_resource=get(doc, "swarm-resource", str, ""),
        mode=get(runtime, "mode", str, "auto", "nvidia-container-runtime."),
        skip_mode_detection=get(hook, "skip-mode-detection", bool, False, "nvidia-container-runtime-hook."),
        ignore_imex_requests=get(features, "ignore-imex-channel-requests", bool, False, "features."),
    )


def toml_dialect(version: Version | None) -> str | None:
    """The decoder the hook of this toolkit version unmarshals its config with (None: unknown)."""
    if version is None:
        return None
    return BURNTSUSHI if version < (1, 14, 0) else GO_TOML


@dataclass(frozen=True)
class GpuEntry:
    """One GPU as the driver lists it: /proc/driver/nvidia/gpus/<pci>/information."""

    pci: str  # the directory name, e.g. 0000:3b:00.0
    minor: int  # Device Minor
    uuid: str | None  # GPU UUID, None when the file has none
    excluded: bool = False  # `GPU Excluded: Yes`: NVML does not enumerate it


@dataclass(frozen=True)
class DriverMap:
    gpus: tuple[GpuEntry, ...] = ()
    readable: bool = True
    why: str = ""
    uvm: tuple[Device, ...] = ()  # nvidia-uvm and nvidia-uvm-tools nodes that exist on the host
    mig_instances: bool = False  # a MIG GPU or compute instance exists (capabilities/gpu*/mig/gi*)
    modeset: bool = False  # /dev/nvidia-modeset exists on the host
    mig: MigMap = MigMap()  # the driver's MIG map (host.mig), read under --root
    # NVML's MIG devices now: (UUID, parent GPU's device minor, GI id, CI id); None when NVML was not asked or
    # failed (mig_uuids_why says which): a MIG UUID is known only to NVML
    mig_uuids: Optional[Tuple[Tuple[str, int, int, int], ...]] = None
    mig_uuids_why: str = "NVML was not asked"
    mig_capable: Optional[Tuple[int, ...]] = None  # device minors of the GPUs NVML gives a MIG mode (with mig_uuids)
    # the root nvsymlinkd's node scan searched for uvm and modeset (its Config.driver_root, normalized): the cli
    # looks for them under its own --root (src/nvc_info.c lookup_devices -> find_device_node -> path_resolve_full)
    nodes_root: str = "/"
    # the IMEX channel nodes of that scan and the `nvidia-caps-imex-channels` major (host.imex)
    imex: ImexNodes = ImexNodes()


@dataclass(frozen=True)
class Wrapper:
    """The toolkit installer's shell wrapper around the hook (the GPU Operator's
    /usr/local/nvidia/toolkit/nvidia-container-runtime-hook), parsed: the variables it sets for the hook,
    the executable it runs, and the arguments it puts before the hook's own ("$@")."""

    env: tuple[tuple[str, str], ...]
    target: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class HookInputs:
    """Every host input the reconstruction reads, in one value (what a later change records at a container's
    first sight): the config with the path it came from, the driver's map, the toolkit's version, and the
    wrapper script when the hook path is one."""

    config: ToolkitConfig
    driver: DriverMap
    version: Version | None = None
    version_why: str = "not read"  # where the version came from, or why it is unknown
    wrapper: Wrapper | None = None
    wrapper_why: str = ""  # the hook path is a script of another shape, or cannot be read: not trusted


@dataclass(frozen=True)
class HookRequest:
    """What the hook reads from the spec (containers.ocispec.SpecFacts)."""

    hooks: tuple[HookEntry, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    device_list_mounts: tuple[str, ...] = ()
    privileged: bool = False


@dataclass(frozen=True)
class HookGrant:
    trusted: bool
    devices: Mapping[Device, Access]  # empty unless trusted
    detail: str  # what was reconstructed, or why it could not be
    mig: Tuple[MigGrant, ...] = ()  # the MIG devices among the devices
    imex: Tuple[ImexGrant, ...] = ()  # the IMEX channels among the devices

    def to_json(self) -> dict[str, Any]:
        return {"trusted": self.trusted, "devices": {str(d): str(a) for d, a in sorted(self.devices.items())},
                "detail": self.detail, "mig_devices": [m.to_json() for m in self.mig],
                "imex_channels": [c.to_json() for c in self.imex]}


@dataclass(frozen=True)
class ImexGrant:
    """A granted IMEX channel by the name people use: its number (NVIDIA_IMEX_CHANNELS, imex/N) and node."""

    channel: int
    device: Device

    @property
    def path(self) -> str:
        return imex.channel_path(self.channel)

    def to_json(self) -> dict[str, Any]:
        return {"channel": self.channel, "path": self.path, "device": str(self.device)}


@dataclass(frozen=True)
class MigGrant:
    """A granted MIG device by the names people use: its UUID, its `g:m` index in NVML's order now (what
    nvidia-smi -L shows; None when not known), the driver's instance, and its devices."""

    uuid: str
    index: Optional[str]
    instance: str  # gpu<minor>/gi<G>/ci<C>
    devices: Tuple[Device, ...]

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "index": self.index, "instance": self.instance,
                "devices": [str(d) for d in self.devices]}


def _untrusted(why: str) -> HookGrant:
    return HookGrant(False, {}, why)


def _nothing(why: str) -> HookGrant:
    return HookGrant(True, {}, why)


def _split(value: str) -> list[str]:
    """strings.Split(value, ",") with strings.TrimSpace and empty items dropped (cuda_image.go DevicesFromEnvvars)."""
    return [p for p in (_go_trim_space(q) for q in value.split(",")) if p]


_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


def _go_trim_space(text: str) -> str:
    """strings.TrimSpace: unicode.IsSpace (Python's str.strip also strips \\x1c-\\x1f, which Go keeps)."""
    return text.strip(_GO_SPACE)


# ---------------------------------------------------------------- Go's path/filepath.Clean

def go_clean(path: str) -> str:
    """path/filepath.Clean on Unix (go/src/path/path.go Clean): one slash for many, no `.` elements,
    `..` eats the element before it, none above the root, "" -> ".". Unlike os.path.normpath, a leading
    "//" becomes "/"."""
    if path == "":
        return "."
    rooted = path.startswith("/")
    out: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if out and out[-1] != "..":
                out.pop()
            elif not rooted:
                out.append("..")
            continue
        out.append(part)
    text = "/".join(out)
    if rooted:
        return "/" + text
    return text or "."


# ---------------------------------------------------------------- which hook, and how it was invoked

def legacy_hook(hooks: Sequence[HookEntry]) -> HookEntry | None:
    """The legacy NVIDIA hook entry: `nvidia-container-runtime-hook` (or its alias
    `nvidia-container-toolkit`) as a prestart/createRuntime hook (the runtime wrapper injects
    [basename, "prestart"], internal/modifier/stable.go). Whether it ran `prestart` is the hook's own
    argument parsing (invocation()). `nvidia-ctk hook ...` entries are CDI hooks: they grant no device."""
    for entry in hooks:
        kind, path, args = entry[0], entry[1], entry[2]
        if kind in HOOK_KINDS and os.path.basename(path) in HOOK_NAMES and args is not None:
            return entry
    return None


_BOOL_FLAGS = ("debug", "version")  # cmd/nvidia-container-runtime-hook/main.go: -debug, -version, -config
_GO_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
             "0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}  # strconv.ParseBool


def go_flag_parse(argv: Sequence[str]) -> tuple[str, str | None, str]:
    """The hook's main(): flag.Parse() over argv[1:] (ExitOnError), then flag.Args()[0] is the command.
    -> (config flag value, the command or None when the hook exits before running one, why it exits).
    Go's flag package (flag.go parseOne): flags end at the first non-flag argument or after `--`; `-x`
    and `--x` are the same; `-config=v` or `-config v`; a bool flag takes only `-b` or `-b=value`.
    `why` ends with the hook's exit status: 0 (help, version, poststart/poststop) or 2 (a usage error)."""
    config = ""
    version = False
    args = list(argv[1:])
    while args:
        s = args[0]
        if len(s) < 2 or s[0] != "-":
            break
        minuses = 2 if s[1] == "-" else 1
        if minuses == 2 and len(s) == 2:  # "--" ends the flags
            args = args[1:]
            break
        name = s[minuses:]
        if not name or name[0] in "-=":
            return config, None, f"bad flag syntax {s!r}: the hook exits 2"
        args = args[1:]
        name, has_value, value = name.partition("=")
        if name in ("help", "h"):
            return config, None, f"{s}: the hook prints its usage and exits 0"
        if name in _BOOL_FLAGS:
            if has_value and value not in _GO_BOOLS:
                return config, None, f"invalid boolean value {value!r} for -{name}: the hook exits 2"
            on = _GO_BOOLS[value] if has_value else True
            if name == "version":
                version = on
            continue
        if name != "config":
            return config, None, f"flag provided but not defined: -{name}: the hook exits 2"
        if not has_value:
            if not args:
                return config, None, "flag needs an argument: -config: the hook exits 2"
            value, args = args[0], args[1:]
        config = value
    if version:
        return config, None, "-version: the hook prints its version and exits 0"
    if not args:
        return config, None, "no command: the hook prints its usage and exits 2"
    if args[0] in ("poststart", "poststop"):
        return config, None, f"command {args[0]!r}: the hook exits 0, only `prestart` grants anything"
    if args[0] != "prestart":
        return config, None, f"unknown command {args[0][:40]!r}: the hook exits 2"
    return config, "prestart", ""


@dataclass(frozen=True)
class Invocation:
    """How the hook process ran: its config flag and the environment it read."""

    command: str | None
    config_flag: str
    env: Mapping[str, str]
    why: str  # when it ran no command, or when its invocation is not knowable
    knowable: bool = True
    runtime_env: bool = False  # the entry has no env: the hook ran with the runtime's own environment (not known)


def invocation(entry: HookEntry, wrapper: Wrapper | None) -> Invocation:
    """runc runs a hook with the entry's args and env (runc v1.1.5 libcontainer/configs/config.go:381-388,
    exec.Cmd{Env: c.Env}): an entry without env (absent or null, a nil slice) runs with runc's own environment
    (os/exec: nil Env = the parent's; recent crun, src/libcrun/container.c: `environ` unless hooks[i]->env), whose
    variables are not known here (`env` holds only the entry's and the wrapper's). A wrapper puts its
    assignments over that environment and its arguments before "$@"."""
    _, _, args, env_list = entry
    env: dict[str, str] = {}
    for item in env_list or ():
        name, sep, value = item.partition("=")
        if not sep:
            continue
        if name in env and env[name] != value and name in (CONFIG_ENV, XDG_ENV):
            # Go's os.Getenv takes the first, a shell the last: which the hook saw depends on the wrapper
            return Invocation(None, "", {}, f"the hook entry sets {name} twice", knowable=False)
        env.setdefault(name, value)  # syscall.copyenv: the first mention of a key wins
    argv = list(args or ())
    if wrapper is not None:
        env.update(wrapper.env)
        argv = [wrapper.target, *wrapper.args, *argv[1:]]
    config, command, why = go_flag_parse(argv)
    return Invocation(command, config, env, why, runtime_env=env_list is None)


# ---------------------------------------------------------------- the config file the hook reads

@dataclass(frozen=True)
class ConfigSearch:
    """Where the hook looks for its config: each path in order, the first that exists is read; `required`:
    a missing file makes the hook fail (so no container ran under it); none found -> the defaults."""

    paths: tuple[str, ...]
    required: bool
    why: str = ""  # not knowable (a relative path: the hook's working directory)


def config_search(inv: Invocation, version: Version) -> ConfigSearch:
    """The config file search of the hook of this toolkit version (cmd/nvidia-container-runtime-hook/
    hook_config.go loadConfig / getConfigFilePath)."""
    if version >= (1, 18, 0):
        # -config, then NVIDIA_CTK_CONFIG_FILE_PATH (both required), then $XDG_CONFIG_HOME or /etc
        if inv.config_flag:
            return _search((inv.config_flag,), True)
        if inv.env.get(CONFIG_ENV):
            return _search((inv.env[CONFIG_ENV],), True)
        root = inv.env.get(XDG_ENV) or "/etc"
        return _search((go_clean(root + "/" + RELATIVE_CONFIG),), False)
    if version == (1, 14, 0):
        # loadConfig without WithRequired: config.New turns a missing file into the defaults, so the driver
        # path alone is read (and a missing -config file is the defaults too)
        return _search((inv.config_flag or DRIVER_CONFIG,), False)
    if inv.config_flag:
        return _search((inv.config_flag,), True)
    return _search((DRIVER_CONFIG, ETC_CONFIG), False)


def _search(paths: tuple[str, ...], required: bool) -> ConfigSearch:
    for p in paths:
        if not p.startswith("/"):
            return ConfigSearch(paths, required, f"config path {p!r} is relative to the hook's working directory")
    return ConfigSearch(paths, required)


# representative versions of each search rule (config_search) and TOML decoder (toml_dialect)
VERSION_LINES: tuple[Version, ...] = ((1, 13, 0), (1, 14, 0), (1, 14, 1), (1, 18, 0))


# ---------------------------------------------------------------- the grant

def reconstruct(request: HookRequest, inputs: HookInputs) -> HookGrant | None:
    """The devices the hook granted this container; None when its spec has no legacy NVIDIA hook."""
    entry = legacy_hook(request.hooks)
    if entry is None:
        return None
    hook_kinds = [e for e in request.hooks if e[0] in HOOK_KINDS and os.path.basename(e[1]) in HOOK_NAMES]
    if any(e != entry for e in hook_kinds):
        return _untrusted("the spec runs the NVIDIA hook more than once, differently: not reconstructed")
    if inputs.wrapper_why:
        return _untrusted(f"the hook {entry[1]}: {inputs.wrapper_why}")
    inv = invocation(entry, inputs.wrapper)
    if not inv.knowable:
        return _untrusted(inv.why)
    if inv.command is None and inv.why.endswith("exits 2"):
        # runc fails the container's creation when a prestart hook fails (libcontainer/process_linux.go):
        # a running container was not made from this spec as it reads now
        return _untrusted(f"the hook could not have run from this spec: {inv.why}")
    if inv.command is None:
        return _nothing(f"the hook grants nothing: {inv.why}")
    config, driver, version = inputs.config, inputs.driver, inputs.version
    if inv.runtime_env and (version is None or version >= (1, 18, 0)) and not (inv.config_flag or inv.env.get(CONFIG_ENV)):
        # 1.18+ pick the file from NVIDIA_CTK_CONFIG_FILE_PATH or XDG_CONFIG_HOME (v1.18.0 hook_config.go:39-47,
        # internal/config/config.go:78-88), which the toolkit installer's runtime wrappers export to runc
        # (v1.18.0 cmd/nvidia-ctk-installer/toolkit/installer/executables.go:52-58) and the runtime wrapper's
        # entry inherits (internal/modifier/stable.go:66-69: Path and Args only); 1.13-1.17 read fixed paths
        return _untrusted("the hook ran with the runtime's environment, which may name another config "
                          f"({CONFIG_ENV}, {XDG_ENV}); toolkit version {_shown(version, inputs.version_why)}")
    if not config.readable:
        return _untrusted(f"the NVIDIA toolkit config cannot be read: {config.why}")
    refused = config.mode not in ("auto", "legacy") and not config.skip_mode_detection
    if refused and (version is None or version < (1, 14, 0)):
        # 1.13 checks the mode before it looks at the container (main.go doPrestart): every container fails
        return _untrusted(f"the toolkit's mode is {config.mode!r}: the hook refuses to run (before it looks at the "
                          f"container in toolkit 1.13; toolkit version {_shown(version, inputs.version_why)})")
    devices = _requested(request, config, version)
    if isinstance(devices, HookGrant):
        return devices
    if devices is None:
        return _nothing("the hook grants nothing: no device is requested (NVIDIA_VISIBLE_DEVICES unset, empty or "
                        "void, or an unprivileged request the config refuses)")
    # 1.14+: the mode is checked only for a GPU container (main.go doPrestart: `nvidia == nil` returns first)
    if refused:
        return _untrusted(f"the toolkit's mode is {config.mode!r}: its hook refuses to run, so this container was "
                          "configured under another config")
    env = request.env
    mig_global = _mig_global(request)
    if isinstance(mig_global, HookGrant):
        return mig_global
    channels = _imex_channels(request, config, version)  # parsed by the cli before anything is granted
    if isinstance(channels, HookGrant):
        return channels
    if config.no_cgroups:
        return _nothing("nvidia-container-cli no-cgroups = true: the hook grants no device access")
    caps = _capabilities(env, config)
    if isinstance(caps, HookGrant):
        return caps
    if caps & {"compute", "video", "display"}:
        # the uvm and modeset nodes granted are those under the cli's --root (v1.17.8 main.go:92-94; src/nvc_info.c
        # lookup_devices -> find_device_node); nvsymlinkd knows the ones under its own driver_root
        cli_root = config.driver_root or "/"
        if not cli_root.startswith("/") or normalize(cli_root) != normalize(driver.nodes_root):
            return _untrusted(f"nvidia-container-cli.root {cli_root[:80]!r} is not nvsymlinkd's driver_root "
                              f"{driver.nodes_root[:80]!r}: the uvm and modeset nodes the cli found under its root "
                              "are not the ones nvsymlinkd scanned (set driver_root to the cli's root)")
    selected = _select_gpus(devices, driver, bool(mig_global))
    if isinstance(selected, HookGrant):
        return selected
    gpus, migs = selected
    global_caps = _mig_global_caps(mig_global, devices, gpus, migs, driver)
    if isinstance(global_caps, HookGrant):
        return global_caps
    imex_granted = _imex_grant(channels, config, driver)
    if isinstance(imex_granted, HookGrant):
        return imex_granted
    return _grant(config, driver, devices, caps, gpus, migs, mig_global, global_caps, imex_granted)


def _grant(config: ToolkitConfig, driver: DriverMap, devices: list[str], caps: frozenset[str], gpus: list[GpuEntry],
           migs: dict[str, MigDevice], mig_global: tuple[str, ...], global_caps: tuple[Device, ...],
           imex_granted: tuple[ImexGrant, ...]) -> HookGrant:
    """What the hook's nvidia-container-cli grants once nothing refused: the control node, uvm and modeset by the
    capabilities, the selected GPUs, their MIG instances' caps (or the global caps) and IMEX channels."""
    granted: dict[Device, Access] = {Device.char(FRONTEND_MAJOR, CTL_MINOR): RW}
    # libnvidia-container src/options.h container_opts: "compute" and "video" both set OPT_COMPUTE_LIBS, and
    # src/nvc_mount.c nvc_driver_mount grants the devices outside major 195 (uvm) only with it; the uvm nodes
    # are in the list iff they exist (src/nvc_info.c lookup_devices -> find_device_node), whatever load-kmods
    if caps & {"compute", "video"}:
        for d in driver.uvm:
            granted[d] = RW
    # modeset: listed iff /dev/nvidia-modeset exists (lookup_devices), mounted only with OPT_DISPLAY
    if "display" in caps and driver.modeset:
        granted[Device.char(FRONTEND_MAJOR, MODESET_MINOR)] = RW
    for g in gpus:
        granted[Device.char(FRONTEND_MAJOR, g.minor)] = RW
    # a MIG device: its parent GPU (select_mig_device adds it) and the GPU and compute instances' access
    # capabilities (src/nvc_mount.c nvc_mig_device_access_caps_mount -> cap_device_mount -> setup_device_cgroup)
    # ... but not with mig-config or mig-monitor `all` (src/cli/configure.c configure_command, as src/cli/list.c
    # @042e7f85: the access caps only `if (!mig_config_devices.all && !mig_monitor_devices.all)`), which grant the
    # global caps instead
    for m in migs.values() if not mig_global else ():
        for cap in driver.mig.caps(m):
            granted[cap] = RW
    for cap in global_caps:
        granted[cap] = RW
    for channel in imex_granted:  # src/nvc_mount.c nvc_imex_channel_mount -> setup_device_cgroup
        granted[channel.device] = RW
    shown = ", ".join(str(d) for d in sorted(granted))
    where = f"; config {config.path or 'none (the defaults)'}"
    asked = ",".join(devices) or "none"
    asked = asked if len(asked) <= 200 else asked[:197] + "..."
    named = [MigGrant(u, _mig_index(m, driver), m.name, (Device.char(FRONTEND_MAJOR, m.gpu), *driver.mig.caps(m)))
             for u, m in migs.items()]
    shown_mig = "; MIG " + ", ".join(f"{g.uuid} ({g.index or '?'}) = {g.instance}" for g in named) if named else ""
    shown_imex = ("; IMEX " + ", ".join(f"channel {c.channel} = {c.device}" for c in imex_granted)
                  if imex_granted else "")
    return HookGrant(True, granted, f"the NVIDIA hook's grant for devices {asked} with "
                                    f"capabilities {','.join(sorted(caps)) or '-'}: {shown}{where}{shown_mig}"
                                    f"{shown_imex}",
                     tuple(named), imex_granted)


MIG_GLOBAL = (("NVIDIA_MIG_CONFIG_DEVICES", "config"), ("NVIDIA_MIG_MONITOR_DEVICES", "monitor"))


def _mig_global(request: HookRequest) -> tuple[str, ...] | HookGrant:
    """The global MIG capabilities asked for ("config", "monitor") by a request the hook passes on. The hook
    (container_config.go getMigDevices, 1.17.8:192-198 and :260-274) passes a set, non-empty value raw as
    --mig-config / --mig-monitor and panics for an unprivileged container; the cli (src/cli/common.c
    select_mig_config_devices / select_mig_monitor_devices) skips empty items, takes a first case-insensitive
    `all` and fails on any other item."""
    asked = []
    for name, which in MIG_GLOBAL:
        value = request.env.get(name, "")
        if not value:
            continue
        if not request.privileged:
            return _untrusted(f"{name} is set in an unprivileged container: the hook fails (\"cannot set "
                              "MIG_CONFIG_DEVICES in non privileged container\"), so the container was not made "
                              "from this spec")
        items = [i for i in value.split(",") if i]
        if items and items[0].lower() != "all":
            return _untrusted(f"{name}={value[:40]}: the cli accepts only `all` and fails, so the container was "
                              "not made from this spec")
        if items:
            asked.append(which)
    return tuple(asked)


def _mig_global_caps(asked: tuple[str, ...], devices: list[str], gpus: list[GpuEntry], migs: dict[str, MigDevice],
                     driver: DriverMap) -> tuple[Device, ...] | HookGrant:
    """The caps of mig-config / mig-monitor `all` (src/nvc_mount.c nvc_mig_config_global_caps_mount: the
    global config or monitor cap; nvc_device_mig_caps_mount -> setup_mig_minor_cgroups: every mig-minors slot
    of each selected MIG-capable GPU)."""
    if not asked:
        return ()
    visible_all = bool(devices) and any(d.lower() == "all" for d in devices)
    if migs and not visible_all:  # "cannot enable mig-config with specific MIG devices selected"
        return _untrusted("MIG config/monitor with specific MIG devices selected: the cli fails, so the container "
                          "was not made from this spec")
    if driver.mig_capable is None:
        return _untrusted(f"MIG config/monitor: which GPUs are MIG-capable is NVML's, and {driver.mig_uuids_why}")
    chosen = [g for g in gpus if g.minor in driver.mig_capable]
    if not chosen:
        return ()
    if not driver.mig.readable or driver.mig.caps_major is None or not driver.mig.slots:
        why = driver.mig.why or "no nvidia-caps major or mig-minors"
        return _untrusted(f"MIG config/monitor: the driver's MIG map cannot be read: {why}")
    out = []
    for which in asked:
        minor = driver.mig.config_minor if which == "config" else driver.mig.monitor_minor
        if minor is None:
            return _untrusted(f"MIG {which}: mig-minors lists no {which} capability")
        out.append(Device.char(driver.mig.caps_major, minor))
    for g in chosen:
        out += [Device.char(driver.mig.caps_major, m) for m in driver.mig.gpu_slots(g.minor)]
    return tuple(out)


def _mig_index(m: MigDevice, driver: DriverMap) -> str | None:
    """`g:m` as NVML numbers this MIG device now: its parent's NVML index (PCI order of the enumerated GPUs)
    and its place among that GPU's MIG devices as NVML lists them."""
    listed = sorted((g for g in driver.gpus if not g.excluded), key=lambda g: _pci_key(g.pci) or g.pci)
    g = next((i for i, e in enumerate(listed) if e.minor == m.gpu), None)
    mine = [(gi, ci) for _, gpu, gi, ci in driver.mig_uuids or () if gpu == m.gpu]
    if g is None or (m.gi, m.ci) not in mine:
        return None
    return f"{g}:{mine.index((m.gi, m.ci))}"


def _shown(version: Version | None, why: str) -> str:
    return ".".join(map(str, version)) if version is not None else f"unknown ({why})" if why else "unknown"


def _mount_devices(request: HookRequest) -> list[str]:
    """cuda_image.go DevicesFromMounts: /dev/null sources, destinations cleaned, under the root, trimmed of "/"."""
    out = []
    for dest in request.device_list_mounts:
        dest = go_clean(dest)
        if not dest.startswith(DEVICE_LIST_ROOT):  # strings.HasPrefix: a sibling name matches too
            continue
        device = dest[len(DEVICE_LIST_ROOT):].strip("/")
        if device and device not in out:
            out.append(device)
    return out


def _env_devices(env: Mapping[str, str], names: Sequence[str]) -> list[str] | None:
    """DevicesFromEnvvars(names...): the items of every set variable; unset everywhere with a legacy
    image -> ["all"]; none, or `void` among them -> None (not a GPU container)."""
    items: list[str] = []
    is_set = False
    for name in names:
        if name in env:
            is_set = True
            items += _split(env[name])
    legacy_image = bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")
    if not is_set and not items and legacy_image:
        return ["all"]
    if not items or "void" in items:
        return None
    return items


def _requested(request: HookRequest, config: ToolkitConfig, version: Version | None) -> list[str] | None | HookGrant:
    """The device list the hook passes to nvidia-container-cli (container_config.go getDevices), None for
    none (the hook returns without doing anything)."""
    if config.accept_volume_mounts:
        from_mounts = []
        for device in _mount_devices(request):
            if device.startswith(IMEX_MOUNT_PREFIX):
                if version is not None and version >= (1, 17, 0):
                    continue  # 1.17+: IMEX channels, not devices (VisibleDevicesFromMounts)
                return _untrusted(f"volume mount {device}: a device before toolkit 1.17, a channel since; toolkit "
                                  f"version {_shown(version, '')}")
            if device.startswith("cdi/"):
                return _untrusted("a CDI device requested as a volume mount: not reconstructed")
            from_mounts.append(device)
        if from_mounts:
            return from_mounts
    env = request.env
    swarm = _split(config.swarm_resource)
    # getDevicesFromEnvvar: the swarm-resource variables when any of them is set, else NVIDIA_VISIBLE_DEVICES
    names = swarm if any(n in env for n in swarm) else ["NVIDIA_VISIBLE_DEVICES"]
    requested = _env_devices(env, names)
    if requested is None:
        return None
    if not (request.privileged or config.accept_envvar_unprivileged):
        return None  # "Ignoring devices requested by environment variable(s) in unprivileged container"
    for d in requested:  # NewVisibleDevices (devices.go): the first all/none/void decides, case-sensitively
        if d == "all":
            return ["all"]
        if d == "none":
            return []  # the hook runs with no --device: the driver's control devices only
    return requested


IMEX_ENV = "NVIDIA_IMEX_CHANNELS"
# representative versions of each IMEX rule (_imex_argument): none read, raw, the list, the list with the feature
IMEX_VERSION_LINES: tuple[Version, ...] = ((1, 14, 6), (1, 16, 2), (1, 17, 4), (1, 17, 5))


def _imex_argument(request: HookRequest, config: ToolkitConfig, version: Version) -> str | None:
    """The --imex-channel value the hook of this version passes nvidia-container-cli, None for no flag.
    - 1.13-1.14: no IMEX request is read (v1.14.6 main.go has no --imex-channel);
    - 1.15-1.16: NVIDIA_IMEX_CHANNELS as it is, when set and not empty, whatever the container's privileges
      (v1.16.2 container_config.go:279-285 getImexChannels, :341-344; main.go:129-131);
    - 1.17+: volume mounts imex/N first when accepted (their channels, joined), else the env as a device list
      (DevicesFromEnvvars: trimmed items, `void` anywhere or unset/empty = none; NewVisibleDevices: the first
      `all` lists ["all"], dropped when it is the whole list, the first `none` lists [""], joined to nothing),
      taken only from a privileged container or under accept-nvidia-visible-devices-envvar-when-unprivileged
      (v1.17.8 container_config.go:200-222 getImexChannels; internal/config/image/cuda_image.go:294-311,
      devices.go:36-50,67-69,109-116; v1.18.0 cuda_image.go:416-468 ImexChannelRequests, the same rules);
      from 1.17.5 `features.ignore-imex-channel-requests` drops both (v1.17.5 container_config.go:201-203,
      internal/config/features.go:47; v1.19.0 api/config/v1/features.go:49); main.go:134-136 joins with ","."""
    if version < (1, 15, 0):
        return None
    if version < (1, 17, 0):
        raw = request.env.get(IMEX_ENV, "")
        return raw or None
    if config.ignore_imex_requests and version >= (1, 17, 5):
        return None
    if config.accept_volume_mounts:
        # VisibleDevicesFromMounts' devices under imex/, prefix trimmed (ImexChannelsFromMounts)
        mounts = [d[len(IMEX_MOUNT_PREFIX):] for d in _mount_devices(request) if d.startswith(IMEX_MOUNT_PREFIX)]
        if mounts:
            return ",".join(mounts) or None
    env = {k: v for k, v in request.env.items() if k in (IMEX_ENV, "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA")}
    items = _env_devices(env, [IMEX_ENV])
    if items is None:
        return None
    first = next((c for c in items if c in ("all", "none")), None)
    if first is not None:
        return None  # ["all"] is dropped, [""] joins to nothing
    if not (request.privileged or config.accept_envvar_unprivileged):
        return None  # "Ignoring request by environment variable(s) in unprivileged container"
    return ",".join(dict.fromkeys(items))  # devices.List(): each item once (a repeat leaves an empty item)


def _imex_channels(request: HookRequest, config: ToolkitConfig, version: Version | None) -> tuple[int, ...] | HookGrant:
    """The IMEX channels nvidia-container-cli mounts and grants (host.imex.parse_channel_list, the cli's
    parse_imex_info), () for none; not trusted when the cli would have failed (so the container was not made
    from this spec) or the toolkit's version leaves the request unknown."""
    if version is None:
        answers = {v: _imex_argument(request, config, v) for v in IMEX_VERSION_LINES}
        if len(set(answers.values())) != 1:
            shown = "; ".join(f"{'.'.join(map(str, v))}: {a if a is not None else 'none'}"[:60]
                              for v, a in answers.items())
            return _untrusted(f"the toolkit's version is unknown and its hook passes IMEX channels by version "
                              f"({shown})")
        argument = next(iter(answers.values()))
    else:
        argument = _imex_argument(request, config, version)
    if argument is None:
        return ()
    channels = imex.parse_channel_list(argument)
    if isinstance(channels, str):
        return _untrusted(f"--imex-channel={argument[:60]}: {channels}: nvidia-container-cli fails, so the "
                          "container was not made from this spec")
    return channels


def _imex_grant(channels: tuple[int, ...], config: ToolkitConfig,
                driver: DriverMap) -> tuple[ImexGrant, ...] | HookGrant:
    """Each channel's node as the cli found it under its --root (nvc_imex_channel_mount -> find_device_node:
    its st_rdev): exact only where nvsymlinkd's node scan (under its driver_root, the same root) shows
    `channelN` as `c M:N` with M the `nvidia-caps-imex-channels` major, which is what nvidia-modprobe makes
    and what the cli then finds. A channel whose node is absent or another device now, or a host without
    that major, is not trusted: what the cli statted when the hook ran is not known."""
    if not channels:
        return ()
    cli_root = config.driver_root or "/"
    if not cli_root.startswith("/") or normalize(cli_root) != normalize(driver.nodes_root):
        return _untrusted(f"IMEX channels: nvidia-container-cli.root {cli_root[:80]!r} is not nvsymlinkd's driver_root "
                          f"{driver.nodes_root[:80]!r}: the channel nodes the cli found under its root are not the "
                          "ones nvsymlinkd scanned (set driver_root to the cli's root)")
    nodes = driver.imex
    out = []
    for n in channels:
        device = nodes.device(n)
        if device is None:
            path = driver.nodes_root.rstrip("/") + imex.channel_path(n)  # under the driver root the scan searched
            if nodes.major is None:
                why = "/proc/devices lists no single nvidia-caps-imex-channels major"
            else:  # the scan keeps only nodes of the imex major: one of another (nvidia-caps') is absent here
                why = f"{path} is not c {nodes.major}:{n} now ({'another device' if n in nodes.odd else 'absent'})"
            return _untrusted(f"IMEX channel {n}: {why}: the node the cli found when the hook ran is not known")
        out.append(ImexGrant(n, device))
    return tuple(out)


def _capabilities(env: Mapping[str, str], config: ToolkitConfig) -> frozenset[str] | HookGrant:
    """The driver capabilities the hook passes (getDriverCapabilities)."""
    supported = config.supported_capabilities
    legacy_image = bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")
    if "NVIDIA_DRIVER_CAPABILITIES" not in env and legacy_image:
        return supported
    value = env.get("NVIDIA_DRIVER_CAPABILITIES", "")
    if value:
        wanted = frozenset(_split(value))
        if "all" in wanted:
            return supported
        if not wanted <= supported:
            return _untrusted(f"NVIDIA_DRIVER_CAPABILITIES={value} names capabilities the config does not support: "
                              "the hook refuses that")
        return wanted & supported
    return supported & DEFAULT_CAPABILITIES


def _pci_key(text: str) -> str | None:
    m = _PCI.match(text)
    if m is None:
        return None
    return f"{int(m.group(1), 16):08x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.0"


def _index(text: str) -> int | None:
    """strtoumax(text, &end, 10) with *end == '\\0' and n < UINTMAX_MAX (select_gpu_device); None otherwise."""
    m = _INDEX.fullmatch(text)
    if m is None:
        return None
    n = int(m.group(2)) if len(m.group(2)) <= 40 else UINTMAX  # ERANGE saturates at UINTMAX_MAX
    n = min(n, UINTMAX)
    if m.group(1) == "-" and n != UINTMAX:
        n = (-n) & UINTMAX  # strtoumax negates in the unsigned type
    return n if n < UINTMAX else None


def _select_gpus(devices: list[str], driver: DriverMap,
                 mig_global: bool = False) -> tuple[list[GpuEntry], dict[str, MigDevice]] | HookGrant:
    """The GPUs and MIG devices (by the UUID asked for) nvidia-container-cli selects (src/cli/common.c
    select_devices): per item, case-insensitive `all` (every GPU and MIG device, then stop), a full GPU UUID,
    a PCI bus id, an index in NVML's order, else a MIG device (select_mig_device: a full MIG UUID, then
    `<gpu>:<mig>`); anything else fails the hook."""
    migs: dict[str, MigDevice] = {}
    if not devices:
        return [], migs
    if not driver.readable:
        return _untrusted(f"the driver's GPU list cannot be read: {driver.why}")
    # NVML does not enumerate excluded GPUs: they are not `all`, and the indexes skip them
    listed = [g for g in driver.gpus if not g.excluded]
    by_pci = sorted(listed, key=lambda g: _pci_key(g.pci) or g.pci)
    chosen: list[GpuEntry] = []
    for d in devices:
        if d.lower() == "all":  # str_case_equal: `ALL` reaches the cli raw (the hook's own test is exact)
            if driver.mig_instances and not mig_global:
                # with mig-config/monitor `all` the instances' own caps are not mounted (the global ones are)
                return _untrusted("`all` on a host with MIG instances also grants the capabilities of the MIG "
                                  "devices there were when the hook ran: not reconstructed")
            for g in sorted(listed, key=lambda g: g.minor):
                if g not in chosen:
                    chosen.append(g)
            break  # select_devices stops at `all`: later items are never looked at
        gpu: GpuEntry | None = None
        if d[:4].lower() == "gpu-" and len(d) > 4:
            if any(g.uuid is None for g in listed):
                return _untrusted(f"{d}: the driver does not list every GPU's UUID")
            gpu = next((g for g in listed if g.uuid is not None and g.uuid.lower() == d.lower()), None)
        if gpu is None and _pci_key(d) is not None:
            gpu = next((g for g in listed if _pci_key(g.pci) == _pci_key(d)), None)
        elif gpu is None and _PCI_ODD.match(d):
            return _untrusted(f"{d}: a PCI bus id in a form sscanf reads in ways not modelled here")
        if gpu is None:
            n = _index(d)
            if n is not None and n < len(by_pci):
                # NVML enumerates by PCI bus id; trusted only where that order is also the minors' order
                if [g.minor for g in by_pci] != sorted(g.minor for g in by_pci):
                    return _untrusted(f"index {d}: the GPUs' PCI order and minor order differ, so the index is "
                                      "ambiguous")
                gpu = by_pci[n]
        if gpu is None and d[:4].lower() == "mig-" and len(d) > 4:
            mig = _mig_by_uuid(d, driver)
            if isinstance(mig, HookGrant):
                return mig
            gpu = next((g for g in listed if g.minor == mig.gpu), None)
            if gpu is None:  # NVML does not enumerate an excluded GPU, nor its MIG devices
                return _untrusted(f"{d}: its parent GPU (minor {mig.gpu}) is not one the driver lists as enumerated")
            migs.setdefault(d, mig)
        if gpu is None:
            if _MIG_INDEX.fullmatch(d):
                # select_mig_device: gpus[i].mig_devices[j], NVML's MIG handle order at the hook's run; /proc
                # shows neither that order nor whether an instance was destroyed and made again since
                return _untrusted(f"{d}: a MIG index names whichever MIG device was j-th when the hook ran; "
                                  "that order and the instances of then are not knowable now")
            return _untrusted(f"{d}: no GPU the driver lists matches it")
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen, migs


def _mig_by_uuid(uuid: str, driver: DriverMap) -> MigDevice | HookGrant:
    """The MIG device a full MIG UUID names (select_mig_device: strcasecmp with equal lengths), through NVML's
    UUID -> (GPU, GI, CI) now and the driver's MIG map. The hook granted the slot the UUID named then, and a
    slot's minors are fixed (nv-caps.c's table): a UUID NVML still lists names that slot now (one UUID, one
    instance), so its minors are the granted ones; a UUID it no longer lists (the instance destroyed, maybe
    made again under a new UUID) is never resolved through the slot it used to name."""
    shown = uuid if len(uuid) <= 60 else uuid[:57] + "..."
    if driver.mig_uuids is None:
        return _untrusted(f"{shown}: a MIG UUID is known only to NVML, and {driver.mig_uuids_why}")
    if not driver.mig.readable:
        return _untrusted(f"{shown}: the driver's MIG map cannot be read: {driver.mig.why}")
    # strcasecmp folds ASCII only: str.lower() would also fold U+212A KELVIN SIGN to "k"
    hits = {(g, gi, ci) for u, g, gi, ci in driver.mig_uuids if uuid.isascii() and u.lower() == uuid.lower()}
    if len(hits) != 1:
        return _untrusted(f"{shown}: NVML lists {'no' if not hits else 'more than one'} MIG device with this UUID "
                          "now (destroyed or made again since the hook ran, or never there)")
    gpu, gi, ci = hits.pop()
    mig = driver.mig.find(gpu, gi, ci)
    if mig is None:
        return _untrusted(f"{shown}: NVML names gpu{gpu}/gi{gi}/ci{ci}, which the driver's capabilities under "
                          "--root do not show")
    return mig


def parse_wrapper(text: str) -> Wrapper | str:
    """The installer's wrapper script, or why the hook path is a script of another shape (not trusted).
    Two shapes: toolkit <= 1.17 (tools/container/toolkit/executable.go writeWrapperTo: `KEY=VALUE \\`
    lines, the .real path, `\\t-config "PATH" \\` argument lines, `\\t"$@"`) and 1.18+
    (cmd/nvidia-ctk-installer/toolkit/installer/executables.go render: the same with tabs)."""
    lines = text.split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines or lines[0] != "#! /bin/sh" or len(lines) > 40:
        return "a script that is not the toolkit installer's wrapper"
    env: list[tuple[str, str]] = []
    i = 1
    while i < len(lines):
        m = _ASSIGN.fullmatch(lines[i])
        if m is None:
            break
        name, value = m.group(1), m.group(2)
        if "$" in value and name != "PATH":
            return f"the wrapper sets {name} from a shell expansion"
        env.append((name, value))
        i += 1
    m = _EXEC.fullmatch(lines[i]) if i < len(lines) else None
    if m is None:
        return "a script that is not the toolkit installer's wrapper (no executable line)"
    target = m.group(1)
    i += 1
    args: list[str] = []
    while i < len(lines) and (a := _ARG.fullmatch(lines[i])) is not None:
        args += ["-config", a.group(1)]
        i += 1
    if i != len(lines) - 1 or _TAIL.fullmatch(lines[i]) is None:
        return "a script that is not the toolkit installer's wrapper (other lines)"
    return Wrapper(tuple(env), target, tuple(args))


# The installer's Go wrapper (nvidia-container-toolkit a7b4038b, after v1.20.0: "Replace shell script wrappers with a
# Go wrapper"): an ELF whose section .nvctkiwc (cmd/nvidia-ctk-installer/toolkit/installer/wrappercore/wrappercore.go:
# 29, InstallerWrapperConfigELFSectionName) is the C array `char wrapper_config[4096]` (cmd/nvidia-ctk-installer-
# wrapper/main.go:20-24), written by WriteWrapperConfigSection (wrappercore.go:50-64): a uint32 length in the
# machine's byte order, then json.Marshal(WrapperConfig) (wrappercore.go:35-47: argv, envm, requiresKernelModule,
# defaultRuntimeExecutablePath, all omitempty); the hook's wrapper sets NVIDIA_CTK_CONFIG_FILE_PATH and <PATH
# (executables.go:66-74, 84-96).
GO_WRAPPER_SECTION = ".nvctkiwc"
GO_WRAPPER_SECTION_BYTES = 4096
_GO_WRAPPER_FIELDS = {"argv": list, "envm": dict, "requiresKernelModule": bool, "defaultRuntimeExecutablePath": str}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_go_wrapper(section: bytes, little: bool, executable: str) -> Wrapper | str:
    """The installer's Go wrapper from its .nvctkiwc section's bytes, or why it is not decoded exactly (then not
    trusted, never "no wrapper"). `executable`: the wrapper's own path, links resolved (os.Executable, the kernel's
    /proc/self/exe). What it does (main.go:57-66, 83-102): exec `executable + ".real"` with argv [argv0 + ".real",
    *config.argv, *os.Args[1:]] and env [each envm entry, *os.Environ()]: its entries come first, and Go's getenv
    takes the first of a name (syscall.copyenv), so they win over the runtime's, as a script's assignments do; a
    `<NAME`/`>NAME` key prepends/appends to the inherited value (main.go:93-98). json.Unmarshal would also take
    other cases of the field names, unknown fields, duplicate keys and invalid UTF-8; json.Marshal writes none of
    them, so any of them is not decoded."""
    if len(section) != GO_WRAPPER_SECTION_BYTES:
        return f"its {GO_WRAPPER_SECTION} section is {len(section)} bytes, not the wrapper's {GO_WRAPPER_SECTION_BYTES}"
    size = int.from_bytes(section[:4], "little" if little else "big")
    if size + 4 > len(section):  # ReadWrapperConfigSection's check (wrappercore.go:72-74): the wrapper exits
        return f"its {GO_WRAPPER_SECTION} section says {size} bytes of config, more than it holds"
    if any(section[4 + size:]):
        return f"its {GO_WRAPPER_SECTION} section holds bytes past the config it names"
    import json

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError("a key twice")
        return dict(items)

    try:
        doc = json.loads(section[4:4 + size].decode("utf-8"), object_pairs_hook=pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"its {GO_WRAPPER_SECTION} config is not the installer's JSON: {str(exc)[:80]}"
    if not isinstance(doc, dict) or not set(doc) <= set(_GO_WRAPPER_FIELDS):
        return f"its {GO_WRAPPER_SECTION} config has fields the installer does not write"
    for key, kind in _GO_WRAPPER_FIELDS.items():
        if key in doc and type(doc[key]) is not kind:
            return f"its {GO_WRAPPER_SECTION} config's {key} is not a {kind.__name__}"
    if doc.get("requiresKernelModule"):
        # only the runtime wrappers set it (executables.go:49-57): without the driver the wrapper runs the default
        # runtime, not the hook
        return "a wrapper that runs the default runtime while the driver is not loaded, not the hook's wrapper"
    args = doc.get("argv", [])
    envm = doc.get("envm", {})
    if not all(isinstance(a, str) and "\0" not in a for a in args):
        return f"its {GO_WRAPPER_SECTION} config's argv is not a list of strings"
    env: dict[str, str] = {}
    for key, value in sorted(envm.items()):
        name = key[1:] if key[:1] in ("<", ">") else key
        if not isinstance(value, str) or "\0" in value or _ENV_NAME.fullmatch(name) is None or name in env:
            return f"its {GO_WRAPPER_SECTION} config's envm entry {key[:40]!r} is not one the installer writes"
        if key != name and name in (CONFIG_ENV, XDG_ENV):
            return f"the wrapper sets {name} from the hook's environment"
        # the script wrapper's own shape for PATH (`PATH=DIR:$PATH`)
        env[name] = f"{value}:${name}" if key[0] == "<" else f"${name}:{value}" if key[0] == ">" else value
    return Wrapper(tuple(env.items()), normalize(executable) + ".real", tuple(args))


_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([A-Za-z0-9_./:@%+,$-]*) \\")
_EXEC = re.compile(r"\t{0,2}(/[A-Za-z0-9_./@%+,-]+) \\")
_ARG = re.compile(r"\t-config \"([A-Za-z0-9_./@%+,:-]+)\" \\")
_TAIL = re.compile(r"\t{1,2}\"\$@\"")
