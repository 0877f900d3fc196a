"""What the NVIDIA driver says should exist, from /proc/driver.

- GPUs: /proc/driver/nvidia/gpus/<pci>/information, `Device Minor: N`
- MIG capabilities: /proc/driver/nvidia-caps/mig-minors, `NAME MINOR` lines
- node owner and mode: /proc/driver/nvidia/params, DeviceFileUID/GID/Mode (decimal)
- per-capability mode: /proc/driver/nvidia/capabilities/<path>, same keys

All read with paths resolved confined to the host root (HostRoot.read_confined).
"""

from __future__ import annotations

import os

from nvsymlinkd.errors import HostFileError
from nvsymlinkd.host.procdevices import decimal
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.record import dataclass, field

GPUS_DIR = "/proc/driver/nvidia/gpus"
PARAMS = "/proc/driver/nvidia/params"
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
CAPABILITIES_DIR = "/proc/driver/nvidia/capabilities"
PROC_MODULES = "/proc/modules"

MAX_GPU_MINOR = 253  # 254 is nvidia-modeset, 255 nvidiactl
MAX_MINOR = (1 << 20) - 1


@dataclass(frozen=True)
class NodeOwnership:
    uid: int = 0
    gid: int = 0
    mode: int = 0o666


@dataclass(frozen=True)
class GPU:
    pci: str
    minor: int


@dataclass(frozen=True)
class DriverInfo:
    gpus: tuple = ()  # of GPU, sorted by minor
    mig_minors: dict = field(default_factory=dict)  # capability name -> minor
    ownership: NodeOwnership = NodeOwnership()
    loaded_modules: frozenset = frozenset()  # nvidia* module names from /proc/modules
    cap_ownership: dict = field(default_factory=dict)  # capability name -> NodeOwnership (only those read)

    def module_loaded(self, name: str) -> bool:
        return name in self.loaded_modules


def parse_key_values(text: str) -> dict:
    """`Key: value` lines; other lines are ignored."""
    out = {}
    for line in text.split("\n"):
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _int_field(values: dict, key: str, path: str, lo: int, hi: int, base: int = 10) -> int | None:
    if key not in values:
        return None
    raw = values[key]
    if len(raw) > 24:  # far more digits than any range here; int() of thousands is slow or refused (3.11+)
        raise HostFileError(path, f"{key} is not a number in range {lo}-{hi}: {raw[:20]!r}...")
    try:
        number = int(raw, base)
    except ValueError:
        raise HostFileError(path, f"{key} is not a number: {raw[:40]!r}")
    if not lo <= number <= hi:
        raise HostFileError(path, f"{key} {number} out of range {lo}-{hi}")
    return number


def parse_params(text: str, path: str = PARAMS) -> NodeOwnership:
    values = parse_key_values(text)
    default = NodeOwnership()
    uid = _int_field(values, "DeviceFileUID", path, 0, 2**32 - 2)
    gid = _int_field(values, "DeviceFileGID", path, 0, 2**32 - 2)
    mode = _int_field(values, "DeviceFileMode", path, 0, 0o7777)
    return NodeOwnership(
        uid=default.uid if uid is None else uid,
        gid=default.gid if gid is None else gid,
        mode=default.mode if mode is None else mode,
    )


def parse_gpu_information(text: str, path: str) -> int:
    minor = _int_field(parse_key_values(text), "Device Minor", path, 0, MAX_GPU_MINOR)
    if minor is None:
        raise HostFileError(path, "no 'Device Minor:' line")
    return minor


def parse_mig_minors(text: str, path: str = MIG_MINORS) -> dict:
    out = {}
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or not parts[1].isascii():
            raise HostFileError(path, f"expected 'NAME MINOR', got {line[:60]!r}", lineno)
        minor = decimal(parts[1], MAX_MINOR)
        if minor is None:
            raise HostFileError(path, f"minor {parts[1][:20]} out of range", lineno)
        out[parts[0]] = minor
    return out


def capability_proc_path(mig_name: str) -> str:
    """`gpu0/gi1/access` -> /proc/driver/nvidia/capabilities/gpu0/mig/gi1/access."""
    head, _, rest = mig_name.partition("/")
    if head.startswith("gpu") and rest:
        return f"{CAPABILITIES_DIR}/{head}/mig/{rest}"
    return f"{CAPABILITIES_DIR}/mig/{mig_name}"


def read_capability_ownership(root: HostRoot, mig_name: str, fallback: NodeOwnership) -> NodeOwnership | None:
    """The owner and mode the driver gives this capability's node, or None when its mode cannot be read: the
    mode is the capability's access control (0400 config, 0444 monitor), never the driver-wide 0666."""
    path = capability_proc_path(mig_name)
    try:
        text = root.read_confined(path)
    except OSError:
        return None
    values = parse_key_values(text)
    mode = _int_field(values, "DeviceFileMode", path, 0, 0o7777)
    if mode is None:
        return None
    uid = _int_field(values, "DeviceFileUID", path, 0, 2**32 - 2)
    gid = _int_field(values, "DeviceFileGID", path, 0, 2**32 - 2)
    return NodeOwnership(
        uid=fallback.uid if uid is None else uid,
        gid=fallback.gid if gid is None else gid,
        mode=mode,
    )


def _read_optional(root: HostRoot, path: str) -> str | None:
    try:
        return root.read_confined(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except OSError as exc:
        raise HostFileError(path, f"cannot read: {exc.strerror}")


def _list_dir(root: HostRoot, inside: str) -> list | None:
    """Sorted names in a directory, or None when it cannot be opened."""
    try:
        fd = root.open_dir(inside)
    except OSError:
        return None
    try:
        return sorted(os.listdir(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def read_driver_info(root: HostRoot) -> DriverInfo:
    gpus = []
    entries = _list_dir(root, GPUS_DIR)
    for pci in entries or ():
        path = f"{GPUS_DIR}/{pci}/information"
        text = _read_optional(root, path)
        if text is None:
            continue
        gpus.append(GPU(pci=pci, minor=parse_gpu_information(text, path)))
    gpus.sort(key=lambda g: g.minor)

    params = _read_optional(root, PARAMS)
    ownership = parse_params(params) if params is not None else NodeOwnership()
    mig_text = _read_optional(root, MIG_MINORS)
    mig = parse_mig_minors(mig_text) if mig_text is not None else {}
    # a capability whose mode cannot be read has no entry: its node is never created (plan notes why)
    caps_own = {}
    for name in mig:
        own = read_capability_ownership(root, name, ownership)
        if own is not None:
            caps_own[name] = own
    modules_text = _read_optional(root, PROC_MODULES) or ""
    modules = frozenset(
        line.split(None, 1)[0]
        for line in modules_text.split("\n")
        if line.startswith("nvidia")
    )
    return DriverInfo(gpus=tuple(gpus), mig_minors=mig, ownership=ownership, loaded_modules=modules,
                      cap_ownership=caps_own)


def read_mig_map(root: HostRoot):
    """The host's MIG map (host.mig): mig-minors, the access files of the instances that exist, and the
    `nvidia-caps` major (exact name: `nvidia-caps-imex-channels` shares its prefix). No MIG instance
    anywhere: an empty readable map; what cannot be read: not readable, with the file."""
    from nvsymlinkd.host import mig
    from nvsymlinkd.host.procdevices import CAPS, PROC_DEVICES, parse_proc_devices

    access: dict = {}
    for gpu_dir in _list_dir(root, CAPABILITIES_DIR) or ():
        gis = _list_dir(root, f"{CAPABILITIES_DIR}/{gpu_dir}/mig") if gpu_dir.startswith("gpu") else None
        for gi_dir in gis or ():
            for ci_dir in [None, *(_list_dir(root, f"{CAPABILITIES_DIR}/{gpu_dir}/mig/{gi_dir}") or ())]:
                if ci_dir is not None and not ci_dir.startswith("ci"):
                    continue
                key = mig.parse_instance_name(gpu_dir, gi_dir, ci_dir)
                if key is None:
                    continue
                path = capability_proc_path(mig.instance_path(*key))
                try:
                    minor = mig.parse_access(root.read_confined(path))
                except FileNotFoundError:
                    continue  # destroyed between the listing and the read
                except OSError as exc:
                    return mig.unreadable(f"{path}: {exc.strerror or exc}")
                if minor is None:
                    return mig.unreadable(f"{path}: no valid 'DeviceFileMinor'")
                access[key] = minor
    if not access:
        return mig.MigMap()
    try:
        minors = mig.parse_mig_minors(root.read_confined(MIG_MINORS))
        majors = parse_proc_devices(root.read_confined(PROC_DEVICES))
    except (OSError, HostFileError) as exc:
        return mig.unreadable(f"{MIG_MINORS} or {PROC_DEVICES}: {getattr(exc, 'strerror', None) or exc}")
    if isinstance(minors, str):
        return mig.unreadable(f"{MIG_MINORS}: {minors}")
    return mig.build_map(minors, access, majors.major(CAPS))
