"""The NVIDIA hook's inputs as they stood at a container's first sight (issue 34 item 4).

The hook read its config, the driver's map and its own version once, when the container was created
(containers.hookhost reads them now; containers.hookgrant decides from them). A site that edits its
config.toml later (refusing unprivileged NVIDIA_VISIBLE_DEVICES, say) or upgrades the toolkit changes
nothing the running container was granted, so the daemon records the inputs the first time it sees
the container and judges it on them from then on; `check` says where the recorded and current inputs
differ, or that no record was there and the current ones were used.

Stored as STATE_DIR/hookinputs/<id>.json inside --root, as the baselines are (containers.baseline):
written only by the daemon into its own state dir (nothing a container can write feeds it), atomically,
confined to the root, bounded; tied to the init process's start time and to the spec's hook entry, so a
new container reusing an id never inherits a record; removed with the container. A record that cannot
be read, is too large or does not parse counts as absent.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, fields
from typing import Any

from nvsymlinkd.containers.baseline import SAFE_NAME, prune_dir
from nvsymlinkd.containers.hookgrant import (
    DriverMap,
    GpuEntry,
    HookEntry,
    HookInputs,
    ToolkitConfig,
    Wrapper,
)
from nvsymlinkd.containers.ocispec import load_json
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.imex import ImexNodes
from nvsymlinkd.host.mig import MigDevice, MigMap
from nvsymlinkd.host.root import HostRoot

FORMAT = 1
MAX_RECORD_BYTES = 256 << 10  # a wrapper's env and 254 GPUs' entries fit many times over
MAX_DIFFERENCES = 8
SHOWN = 60  # characters of a recorded or current value in a difference


@dataclass(frozen=True)
class HookRecord:
    container_id: str
    init_start: int
    entry: HookEntry
    inputs: HookInputs
    recorded_at: float = 0.0


def record_dir(config) -> str:
    return config.state_dir.rstrip("/") + "/hookinputs"


def _file_name(container_id: str) -> str:
    if SAFE_NAME.fullmatch(container_id):
        return container_id + ".json"
    return "sha256-" + hashlib.sha256(container_id.encode("utf-8", "replace")).hexdigest() + ".json"


def record_path(config, container_id: str) -> str:
    return f"{record_dir(config)}/{_file_name(container_id)}"


# ---------------------------------------------------------------------------
# HookInputs <-> JSON: every field of the dataclasses, by the type of its default (a field added to
# ToolkitConfig or DriverMap is recorded with no change here; a record lacking one is absent)


def _encode(value: Any) -> Any:
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, Device):
        return str(value)
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, (ToolkitConfig, DriverMap, GpuEntry, Wrapper, MigMap, MigDevice, ImexNodes)):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    raise TypeError(f"cannot record {type(value).__name__}")


def encode_inputs(inputs: HookInputs) -> dict:
    return {f.name: _encode(getattr(inputs, f.name)) for f in fields(inputs)}


def _strings(raw: Any, what: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ValueError(f"{what} is not a list of strings")
    return tuple(raw)


def _decode_fields(cls, raw: Any, special: dict) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{cls.__name__} is not an object")
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            raise ValueError(f"{cls.__name__}.{f.name} is missing")
        value = raw[f.name]
        if f.name in special:
            value = special[f.name](value)
        elif isinstance(f.default, bool) or isinstance(f.default, str):
            if type(value) is not type(f.default):
                raise ValueError(f"{cls.__name__}.{f.name} is not a {type(f.default).__name__}")
        elif isinstance(f.default, frozenset):
            value = frozenset(_strings(value, f"{cls.__name__}.{f.name}"))
        elif isinstance(f.default, int):
            if type(value) is not int:
                raise ValueError(f"{cls.__name__}.{f.name} is not an int")
        else:
            raise ValueError(f"{cls.__name__}.{f.name}: no rule to read it")
        values[f.name] = value
    return cls(**values)


def _gpu(raw: Any) -> GpuEntry:
    if not isinstance(raw, dict):
        raise ValueError("a GPU entry is not an object")
    pci, minor, uuid, excluded = raw.get("pci"), raw.get("minor"), raw.get("uuid"), raw.get("excluded")
    if not (isinstance(pci, str) and type(minor) is int and (uuid is None or isinstance(uuid, str))
            and isinstance(excluded, bool)) or set(raw) != {f.name for f in fields(GpuEntry)}:
        raise ValueError("a GPU entry is malformed")
    return GpuEntry(pci, minor, uuid, excluded)


def _devices(raw: Any) -> tuple[Device, ...]:
    got = tuple(Device.try_parse(t) for t in _strings(raw, "DriverMap.uvm"))
    if any(d is None for d in got):
        raise ValueError("DriverMap.uvm names something that is not a device")
    return got  # type: ignore[return-value]


def _int(raw: Any, what: str) -> int:
    if type(raw) is not int:
        raise ValueError(f"{what} is not an int")
    return raw


def _optional_int(raw: Any, what: str) -> int | None:
    return None if raw is None else _int(raw, what)


def _list(raw: Any, what: str) -> list:
    if not isinstance(raw, list):
        raise ValueError(f"{what} is not a list")
    return raw


def _mig_device(raw: Any) -> MigDevice:
    if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(MigDevice)}:
        raise ValueError("a MIG device is malformed")
    return MigDevice(**{f.name: _int(raw[f.name], f"MigDevice.{f.name}") for f in fields(MigDevice)})


def _slot(raw: Any) -> tuple[str, int]:
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)):
        raise ValueError("a mig-minors slot is malformed")
    return raw[0], _int(raw[1], "a mig-minors slot's minor")


def _mig_map(raw: Any) -> MigMap:
    # the MIG map the decision used (host.mig): its slots decide the MIG config/monitor grants
    return _decode_fields(MigMap, raw, {
        "caps_major": lambda v: _optional_int(v, "MigMap.caps_major"),
        "devices": lambda v: tuple(_mig_device(d) for d in _list(v, "MigMap.devices")),
        "config_minor": lambda v: _optional_int(v, "MigMap.config_minor"),
        "monitor_minor": lambda v: _optional_int(v, "MigMap.monitor_minor"),
        "slots": lambda v: tuple(_slot(x) for x in _list(v, "MigMap.slots"))})


def _imex_nodes(raw: Any) -> ImexNodes:
    # the IMEX channel nodes the decision used (host.imex): the channels granted are those exact then
    return _decode_fields(ImexNodes, raw, {
        "major": lambda v: _optional_int(v, "ImexNodes.major"),
        "exact": lambda v: tuple(_int(x, "ImexNodes.exact") for x in _list(v, "ImexNodes.exact")),
        "odd": lambda v: tuple(_int(x, "ImexNodes.odd") for x in _list(v, "ImexNodes.odd"))})


def _mig_uuid(raw: Any) -> tuple[str, int, int, int]:
    if not (isinstance(raw, list) and len(raw) == 4 and isinstance(raw[0], str)):
        raise ValueError("a MIG UUID entry is malformed")
    return raw[0], _int(raw[1], "gpu"), _int(raw[2], "gi"), _int(raw[3], "ci")


def _optional_tuple(raw: Any, item) -> tuple | None:
    return None if raw is None else tuple(item(x) for x in _list(raw, "a list"))


def _version(raw: Any):
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == 3 and all(type(x) is int for x in raw)):
        raise ValueError("version is not three integers")
    return tuple(raw)


def _wrapper(raw: Any) -> Wrapper | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("target"), str):
        raise ValueError("wrapper is malformed")
    env = raw.get("env")
    if not isinstance(env, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                            for p in env):
        raise ValueError("wrapper.env is malformed")
    return Wrapper(tuple((k, v) for k, v in env), raw["target"], _strings(raw.get("args"), "wrapper.args"))


def decode_inputs(doc: Any) -> HookInputs:
    """Raises ValueError for anything but what encode_inputs writes."""
    if not isinstance(doc, dict):
        raise ValueError("inputs is not an object")
    config = _decode_fields(ToolkitConfig, doc.get("config"), {})
    driver = _decode_fields(DriverMap, doc.get("driver"),
                            {"gpus": lambda raw: tuple(_gpu(g) for g in (raw if isinstance(raw, list) else [None])),
                             "uvm": _devices, "mig": _mig_map, "imex": _imex_nodes,
                             "mig_uuids": lambda raw: _optional_tuple(raw, _mig_uuid),
                             "mig_capable": lambda raw: _optional_tuple(raw, lambda v: _int(v, "mig_capable"))})
    for name in ("version_why", "wrapper_why"):
        if not isinstance(doc.get(name), str):
            raise ValueError(f"{name} is not a string")
    return HookInputs(config, driver, _version(doc.get("version")), doc["version_why"], _wrapper(doc.get("wrapper")),
                      doc["wrapper_why"])


def _encode_entry(entry: HookEntry) -> list:
    return [entry[0], entry[1], None if entry[2] is None else list(entry[2]), None if entry[3] is None else list(entry[3])]


# ---------------------------------------------------------------------------


def load(root: HostRoot, config, container_id: str, init_start: int | None, entry: HookEntry,
         files=None) -> HookRecord | None:
    """The container's record, None when absent, unreadable, malformed, or another container's (another
    init start time, another hook entry). files: a verify.cache.FileCache (written by atomic replace)."""
    if init_start is None:
        return None
    try:
        real = root.real_resolved(record_path(config, container_id))
        doc = (files.load if files is not None else load_json)(real, None, MAX_RECORD_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("container_id") != container_id \
            or doc.get("init_start") != init_start or doc.get("entry") != _encode_entry(entry):
        return None  # another container that reused the id, or another hook
    try:
        inputs = decode_inputs(doc.get("inputs"))
    except (ValueError, TypeError):
        return None
    recorded = doc.get("recorded_at")
    return HookRecord(container_id, init_start, entry, inputs,
                      float(recorded) if isinstance(recorded, (int, float)) else 0.0)


def save(root: HostRoot, config, record: HookRecord) -> str:
    """Write atomically, confined to --root; returns the inside path. Raises OSError, ValueError (too large)."""
    doc = {"format": FORMAT, "container_id": record.container_id, "init_start": record.init_start,
           "entry": _encode_entry(record.entry), "recorded_at": record.recorded_at,
           "inputs": encode_inputs(record.inputs)}
    text = json.dumps(doc, indent=1, sort_keys=True)
    if len(text.encode()) > MAX_RECORD_BYTES:
        raise ValueError(f"the hook's inputs take more than {MAX_RECORD_BYTES} bytes")
    inside = record_path(config, record.container_id)
    root.write_file(inside, text, 0o600, dir_mode=0o700)
    return inside


def record(root: HostRoot, config, container_id: str, init_start: int, entry: HookEntry,
           inputs: HookInputs) -> HookRecord:
    got = HookRecord(container_id, init_start, entry, inputs, time.time())
    save(root, config, got)
    return got


def prune(root: HostRoot, config, live_ids) -> list:
    """Remove the records of containers that no longer exist; returns the removed file names."""
    return prune_dir(root, record_dir(config), {_file_name(i) for i in live_ids})


# ---------------------------------------------------------------------------


def _imex_shown(nodes: ImexNodes) -> str:
    channels = ",".join(map(str, nodes.exact)) or "(none)"
    return _shown(f"channels {channels} on major {'unknown' if nodes.major is None else nodes.major}")


def _shown(value: Any) -> str:
    if isinstance(value, frozenset):
        value = ",".join(sorted(value)) or "(none)"
    elif isinstance(value, tuple) and len(value) == 3 and all(type(x) is int for x in value):
        value = ".".join(map(str, value))
    text = "unknown" if value is None else str(value) if not isinstance(value, str) else (value or '""')
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def differences(recorded: HookInputs, current: HookInputs) -> list[str]:
    """What differs between the inputs recorded at first sight and the host's current ones, for people
    (at most MAX_DIFFERENCES, each bounded)."""
    out: list[str] = []
    rc, cc = recorded.config, current.config
    if rc.path != cc.path:
        out.append(f"config: {_shown(rc.path or 'none (defaults)')} then, {_shown(cc.path or 'none (defaults)')} now")
    elif rc.digest != cc.digest:
        out.append(f"config {_shown(rc.path)}: edited since")
    for f in fields(ToolkitConfig):
        if f.name in ("path", "digest", "present"):
            continue
        a, b = getattr(rc, f.name), getattr(cc, f.name)
        if a != b:
            out.append(f"config {f.name}: {_shown(a)} then, {_shown(b)} now")
    if recorded.version != current.version:
        out.append(f"toolkit version: {_shown(recorded.version)} then, {_shown(current.version)} now")
    if recorded.wrapper != current.wrapper or recorded.wrapper_why != current.wrapper_why:
        out.append("the hook's wrapper (script or Go wrapper): changed since")
    rd, cd = recorded.driver, current.driver
    for f in fields(DriverMap):
        a, b = getattr(rd, f.name), getattr(cd, f.name)
        if a != b:
            if f.name == "gpus":
                out.append(f"driver GPUs: {len(a)} then, {len(b)} now" if len(a) != len(b)
                           else "driver GPUs: their minors, UUIDs or exclusions changed")
            elif f.name == "mig":
                out.append("the MIG map (instances or their minors): changed since")
            elif f.name == "mig_uuids":
                out.append("NVML's MIG devices: changed since")
            elif f.name == "imex":
                out.append(f"IMEX channel nodes: {_imex_shown(a)} then, {_imex_shown(b)} now")
            elif f.name == "uvm":
                out.append(f"uvm nodes: {_shown(','.join(map(str, a)) or '(none)')} then, "
                           f"{_shown(','.join(map(str, b)) or '(none)')} now")
            else:
                out.append(f"driver {f.name}: {_shown(a)} then, {_shown(b)} now")
    return out[:MAX_DIFFERENCES] + ([f"(and {len(out) - MAX_DIFFERENCES} more)"] if len(out) > MAX_DIFFERENCES else [])
