"""The host facts the NVIDIA hook's grant is reconstructed from (containers.hookgrant decides; this reads).

- /etc/nvidia-container-runtime/config.toml (the toolkit's default path; absent: its defaults);
- /proc/driver/nvidia/gpus/<pci>/information (`Device Minor`, `GPU UUID`);
- /proc/driver/nvidia/capabilities/gpu*/mig/gi* (whether MIG instances exist);
- the host's nvidia-uvm / nvidia-uvm-tools nodes (from the pass's node scan).

All read under --root, confined (HostRoot.read_confined).
"""

from __future__ import annotations

from nvsymlinkd.containers.hookgrant import (
    DriverMap,
    GpuEntry,
    ToolkitConfig,
    parse_toolkit_config,
    unreadable_config,
)
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.driverinfo import CAPABILITIES_DIR, GPUS_DIR, parse_key_values
from nvsymlinkd.host.root import HostRoot

TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
MAX_CONFIG_BYTES = 1 << 20


def read_toolkit_config(root: HostRoot, path: str = TOOLKIT_CONFIG) -> ToolkitConfig:
    try:
        text = root.read_confined(path)
    except FileNotFoundError:
        return ToolkitConfig()  # the hook's own fallback: config.GetDefault()
    except OSError as exc:
        return unreadable_config(f"{path}: {exc.strerror or exc}")
    if len(text) > MAX_CONFIG_BYTES:
        return unreadable_config(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    from nvsymlinkd.config import toml_module

    tomllib = toml_module()
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError) as exc:
        return unreadable_config(f"{path}: invalid TOML: {str(exc)[:120]}")
    config = parse_toolkit_config(doc)
    if not config.readable:
        return unreadable_config(f"{path}: {config.why}")
    return config


def _list(root: HostRoot, inside: str) -> list | None:
    import os

    try:
        fd = root.open_dir(inside)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    try:
        return sorted(os.listdir(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def read_driver_map(root: HostRoot, host_nodes) -> DriverMap:
    """host_nodes: the pass's NvidiaNode list (for the uvm nodes)."""
    uvm = tuple(sorted(Device.char(n.major, n.minor) for n in host_nodes if n.kind in ("uvm", "uvm-tools")))
    names = _list(root, GPUS_DIR)
    if not names:  # absent: no driver loaded, so no GPU the hook could have selected is known
        return DriverMap(readable=False, why=f"{GPUS_DIR} lists no GPU" if names is not None else
                         f"cannot list {GPUS_DIR}", uvm=uvm)
    gpus = []
    for pci in names:
        path = f"{GPUS_DIR}/{pci}/information"
        try:
            values = parse_key_values(root.read_confined(path))
        except OSError as exc:
            return DriverMap(readable=False, why=f"{path}: {exc.strerror or exc}", uvm=uvm)
        minor = values.get("Device Minor", "")
        if not (minor.isascii() and minor.isdigit() and len(minor) <= 3 and int(minor) <= 253):
            return DriverMap(readable=False, why=f"{path}: no valid 'Device Minor'", uvm=uvm)
        uuid = values.get("GPU UUID") or None
        gpus.append(GpuEntry(pci, int(minor), uuid[:128] if uuid else None))
    mig = False
    for name in _list(root, CAPABILITIES_DIR) or ():
        if name.startswith("gpu") and any(e.startswith("gi") for e in _list(root, f"{CAPABILITIES_DIR}/{name}/mig") or ()):
            mig = True
            break
    return DriverMap(tuple(gpus), True, "", uvm, mig)
