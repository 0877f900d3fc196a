"""What the NVIDIA prestart hook granted a container, reconstructed exactly or not at all. Pure: no I/O.

The legacy NVIDIA hook (`nvidia-container-runtime-hook prestart`, injected by Docker's `--gpus` or by
the `nvidia-container-runtime` wrapper in legacy mode) grants devices in the container's device
cgroup that are not in its spec. Nothing records that grant; this module recomputes it from what
the hook itself reads, the way the hook computes it (docs/hookgrant.md has the source lines):

- the spec: the hook entry, process.env, /dev/null mounts under /var/run/nvidia-container-devices,
  CAP_SYS_ADMIN in the bounding set (privileged);
- the toolkit's config.toml (absent: the toolkit's defaults; unreadable or malformed: not trusted);
- the driver's map from GPU index / UUID / PCI bus id to device minor, and the uvm nodes.

`reconstruct()` answers None when the spec has no such hook (nothing to reconstruct), else a
HookGrant: `trusted` with the exact devices (possibly none), or not trusted with the reason. Any
request it cannot resolve exactly (a MIG device, an IMEX channel, a UUID the driver does not list,
an index whose order is ambiguous, a config option that changes the selection) is not trusted:
never a guess, and never more than the hook would grant.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple

from nvsymlinkd.host.devices import Access, Device

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
_PCI = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.0")
_MIG_INDEX = re.compile(r"\d+:\d+")

HookEntry = Tuple[str, str, Optional[Tuple[str, ...]]]  # (kind, path, args or None)


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


def unreadable_config(why: str) -> ToolkitConfig:
    return ToolkitConfig(readable=False, why=why, present=True)


def parse_toolkit_config(doc: Mapping[str, Any]) -> ToolkitConfig:
    """The fields the hook's device selection depends on, from the parsed TOML; a wrong type is not
    readable (the hook's own unmarshal would fail: the running container was made under another file)."""
    try:
        return _parse_toolkit_config(doc)
    except ValueError as exc:
        return unreadable_config(str(exc))


def _get(table: Mapping[str, Any], key: str, kind: type, default: Any, where: str = "") -> Any:
    value = table.get(key, default)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}{key} is not a {kind.__name__}")
    return value


def _table(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"[{key}] is not a table")
    return value


def _parse_toolkit_config(doc: Mapping[str, Any]) -> ToolkitConfig:
    cli = _table(doc, "nvidia-container-cli")
    runtime = _table(doc, "nvidia-container-runtime")
    hook = _table(doc, "nvidia-container-runtime-hook")
    features = _table(doc, "features")
    supported = _get(doc, "supported-driver-capabilities", str, "all")
    caps = SUPPORTED_CAPABILITIES if supported == "all" else frozenset(_split(supported))
    if not caps <= SUPPORTED_CAPABILITIES:
        raise ValueError(f"supported-driver-capabilities {supported!r} names an unknown capability")
    return ToolkitConfig(
        present=True,
        accept_envvar_unprivileged=_get(doc, "accept-nvidia-visible-devices-envvar-when-unprivileged", bool, True),
        accept_volume_mounts=_get(doc, "accept-nvidia-visible-devices-as-volume-mounts", bool, False),
        no_cgroups=_get(cli, "no-cgroups", bool, False, "nvidia-container-cli."),
        load_kmods=_get(cli, "load-kmods", bool, True, "nvidia-container-cli."),  # unset: the default
        driver_root=_get(cli, "root", str, "", "nvidia-container-cli."),
        supported_capabilities=caps,
        swarm_resource=_get(doc, "swarm-resource", str, ""),
        mode=_get(runtime, "mode", str, "auto", "nvidia-container-runtime."),
        skip_mode_detection=_get(hook, "skip-mode-detection", bool, False, "nvidia-container-runtime-hook."),
        ignore_imex_requests=_get(features, "ignore-imex-channel-requests", bool, False, "features."),
    )


@dataclass(frozen=True)
class GpuEntry:
    """One GPU as the driver lists it: /proc/driver/nvidia/gpus/<pci>/information."""

    pci: str  # the directory name, e.g. 0000:3b:00.0
    minor: int  # Device Minor
    uuid: str | None  # GPU UUID, None when the file has none


@dataclass(frozen=True)
class DriverMap:
    gpus: tuple[GpuEntry, ...] = ()
    readable: bool = True
    why: str = ""
    uvm: tuple[Device, ...] = ()  # nvidia-uvm and nvidia-uvm-tools nodes that exist on the host
    mig_instances: bool = False  # a MIG GPU or compute instance exists (capabilities/gpu*/mig/gi*)


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

    def to_json(self) -> dict[str, Any]:
        return {"trusted": self.trusted, "devices": {str(d): str(a) for d, a in sorted(self.devices.items())},
                "detail": self.detail}


def _untrusted(why: str) -> HookGrant:
    return HookGrant(False, {}, why)


def _split(value: str) -> list[str]:
    return [p.strip() for p in value.split(",") if p.strip()]


def legacy_hook(hooks: Sequence[HookEntry]) -> HookEntry | None:
    """The legacy NVIDIA hook entry: `nvidia-container-runtime-hook` (or its alias
    `nvidia-container-toolkit`) run with the `prestart` command (the runtime wrapper injects
    [basename, "prestart"], internal/modifier/stable.go). `nvidia-ctk hook ...` entries are CDI hooks:
    they grant no device (CDI puts the devices in the spec)."""
    for entry in hooks:
        kind, path, args = entry
        if kind in HOOK_KINDS and os.path.basename(path) in HOOK_NAMES and args is not None and "prestart" in args[1:]:
            return entry
    return None


def reconstruct(request: HookRequest, config: ToolkitConfig, driver: DriverMap) -> HookGrant | None:
    """The devices the hook granted this container; None when its spec has no legacy NVIDIA hook."""
    entry = legacy_hook(request.hooks)
    if entry is None:
        return None
    args = entry[2] or ()
    if any(a.startswith(("-config", "--config")) for a in args):
        return _untrusted("the hook was given its own config file (-config): not the one read here")
    if not config.readable:
        return _untrusted(f"the NVIDIA toolkit config cannot be read: {config.why}")
    if config.mode not in ("auto", "legacy") and not config.skip_mode_detection:
        return _untrusted(f"the toolkit's mode is {config.mode!r}: its hook refuses to run, so this container was "
                          "configured under another config")
    if config.swarm_resource:
        return _untrusted("swarm-resource is set: the hook reads other variables first (not reconstructed)")
    devices = _requested(request, config)
    if isinstance(devices, HookGrant):
        return devices
    if devices is None:
        return HookGrant(True, {}, "the hook grants nothing: no device is requested (NVIDIA_VISIBLE_DEVICES unset, "
                                   "empty or void, or an unprivileged request the config refuses)")
    env = request.env
    for name in ("NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES"):
        if env.get(name):
            return _untrusted(f"{name} is set: MIG config/monitor grants are not reconstructed")
    if env.get("NVIDIA_IMEX_CHANNELS", "").strip() not in ("", "none", "void") and not config.ignore_imex_requests:
        return _untrusted("NVIDIA_IMEX_CHANNELS is set: IMEX channel grants are not reconstructed")
    if config.no_cgroups:
        return HookGrant(True, {}, "nvidia-container-cli no-cgroups = true: the hook grants no device access")
    caps = _capabilities(env, config)
    if isinstance(caps, HookGrant):
        return caps
    gpus = _select_gpus(devices, driver)
    if isinstance(gpus, HookGrant):
        return gpus
    granted: dict[Device, Access] = {Device.char(FRONTEND_MAJOR, CTL_MINOR): RW}
    notes = []
    if "compute" in caps:
        if config.load_kmods:
            # the hook runs nvidia-modprobe -u (load-kmods): the uvm nodes exist from then on
            for d in driver.uvm:
                granted[d] = RW
        elif driver.uvm:
            notes.append("nvidia-uvm left out: load-kmods is off, so it may not have existed when the hook ran")
    if "display" in caps:
        granted[Device.char(FRONTEND_MAJOR, MODESET_MINOR)] = RW
    for g in gpus:
        granted[Device.char(FRONTEND_MAJOR, g.minor)] = RW
    shown = ", ".join(str(d) for d in sorted(granted))
    detail = (f"the NVIDIA hook's grant for devices {','.join(devices) or 'none'} with capabilities "
              f"{','.join(sorted(caps)) or '-'}: {shown}")
    return HookGrant(True, granted, detail + ("; " + "; ".join(notes) if notes else ""))


def _requested(request: HookRequest, config: ToolkitConfig) -> list[str] | None | HookGrant:
    """The device list the hook passes to nvidia-container-cli (CUDA.VisibleDevices), None for none (the
    hook returns without doing anything)."""
    if config.accept_volume_mounts:
        from_mounts = []
        for dest in request.device_list_mounts:
            device = dest[len(DEVICE_LIST_ROOT):].strip("/") if dest.startswith(DEVICE_LIST_ROOT) else ""
            if not device or device.startswith("imex/"):
                continue
            if device.startswith("cdi/"):
                return _untrusted("a CDI device requested as a volume mount: not reconstructed")
            from_mounts.append(device)
        if from_mounts:
            return from_mounts
    env = request.env
    requested = _split(env["NVIDIA_VISIBLE_DEVICES"]) if "NVIDIA_VISIBLE_DEVICES" in env else []
    legacy_image = bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")
    if "NVIDIA_VISIBLE_DEVICES" not in env and legacy_image:
        requested = ["all"]
    if not requested or "void" in requested:
        return None
    if not (request.privileged or config.accept_envvar_unprivileged):
        return None  # "Ignoring devices requested by environment variable(s) in unprivileged container"
    for d in requested:  # NewVisibleDevices: the first all/none/void decides
        if d == "all":
            return ["all"]
        if d == "none":
            return []  # the hook runs with no --device: the driver's control devices only
    return requested


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
    m = _PCI.fullmatch(text)
    if m is None:
        return None
    return f"{int(m.group(1), 16):08x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.0"


def _select_gpus(devices: list[str], driver: DriverMap) -> list[GpuEntry] | HookGrant:
    """The GPUs nvidia-container-cli selects (src/cli/common.c, select_devices): `all`, a full GPU UUID,
    a PCI bus id, or an index in NVML's order."""
    if not devices:
        return []
    if not driver.readable:
        return _untrusted(f"the driver's GPU list cannot be read: {driver.why}")
    if devices == ["all"]:
        if driver.mig_instances:
            return _untrusted("`all` on a host with MIG instances also grants their capabilities: not reconstructed")
        return sorted(driver.gpus, key=lambda g: g.minor)
    by_pci = sorted(driver.gpus, key=lambda g: _pci_key(g.pci) or g.pci)
    chosen: list[GpuEntry] = []
    for d in devices:
        gpu: GpuEntry | None = None
        if d.lower().startswith("gpu-") and len(d) > 4:
            if any(g.uuid is None for g in driver.gpus):
                return _untrusted(f"{d}: the driver does not list every GPU's UUID")
            gpu = next((g for g in driver.gpus if g.uuid is not None and g.uuid.lower() == d.lower()), None)
        if gpu is None and _pci_key(d) is not None:
            gpu = next((g for g in driver.gpus if _pci_key(g.pci) == _pci_key(d)), None)
        if gpu is None and d.isdigit() and d.isascii() and len(d) <= 6:
            n = int(d)
            if n < len(by_pci):
                # NVML enumerates by PCI bus id; trusted only where that order is also the minors' order
                if [g.minor for g in by_pci] != sorted(g.minor for g in by_pci):
                    return _untrusted(f"index {d}: the GPUs' PCI order and minor order differ, so the index is "
                                      "ambiguous")
                gpu = by_pci[n]
        if gpu is None:
            if d.lower().startswith("mig-") or _MIG_INDEX.fullmatch(d):
                return _untrusted(f"{d}: MIG device requests are not reconstructed")
            return _untrusted(f"{d}: no GPU the driver lists matches it")
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen
