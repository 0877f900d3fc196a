"""The healthy baseline: a container's effective NVIDIA access when the daemon first saw it healthy.

Stored as STATE_DIR/baselines/<id>.json inside --root (written, listed and removed confined to it) (tmpfs by default: gone
at reboot, like the containers). Tied to the init process's start time, so a
new container reusing an id never inherits an old baseline. Written
atomically (temp file, fsync, rename); unreadable files count as absent.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass

from nvsymlinkd.containers.ocispec import load_json
from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.root import HostRoot

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
MAX_BASELINE_BYTES = 1 << 20


@dataclass(frozen=True)
class Baseline:
    container_id: str
    init_start: int | None
    devices: dict[Device, Access]
    recorded_at: float = 0.0

    def to_json(self) -> dict:
        return {
            "container_id": self.container_id,
            "init_start": self.init_start,
            "recorded_at": self.recorded_at,
            "devices": {str(k): v for k, v in sorted(self.devices.items())},
        }


def baseline_dir(config) -> str:
    return config.state_dir.rstrip("/") + "/baselines"


def _file_name(container_id: str) -> str:
    if SAFE_NAME.fullmatch(container_id):
        return container_id + ".json"
    return "sha256-" + hashlib.sha256(container_id.encode("utf-8", "replace")).hexdigest() + ".json"


def baseline_path(config, container_id: str) -> str:
    return f"{baseline_dir(config)}/{_file_name(container_id)}"


def load(root: HostRoot, config, container_id: str, init_start: int | None, files=None) -> Baseline | None:
    """The container's baseline, None when absent, unreadable or another container's.

    files: a verify.cache.FileCache (the file is written by atomic replace: a new one is a new inode).
    """
    try:
        # where save() writes: state_dir's links resolved confined to the root
        real = root.real_resolved(baseline_path(config, container_id))
        doc = (files.load if files is not None else load_json)(real, None, MAX_BASELINE_BYTES)
    except (OSError, ValueError):
        return None
    if doc.get("container_id") != container_id or doc.get("init_start") != init_start:
        return None  # another container that reused the id
    devices = {}
    raw = doc.get("devices")
    raw = raw if isinstance(raw, dict) else {}
    for text, access in raw.items():
        key = Device.try_parse(text)
        if key is not None and Access.valid(access):
            devices[key] = Access(access)
    recorded = doc.get("recorded_at")
    return Baseline(container_id, init_start, devices, float(recorded) if isinstance(recorded, (int, float)) else 0.0)


def save(root: HostRoot, config, baseline: Baseline) -> str:
    """Write atomically, every step confined to --root; returns the inside path. Raises OSError."""
    inside = baseline_path(config, baseline.container_id)
    root.write_file(inside, json.dumps(baseline.to_json(), indent=1, sort_keys=True), 0o600, dir_mode=0o700)
    return inside


def record(root: HostRoot, config, container_id: str, init_start: int | None, devices: dict) -> Baseline:
    baseline = Baseline(container_id, init_start, dict(devices), time.time())
    save(root, config, baseline)
    return baseline


def prune(root: HostRoot, config, live_ids) -> list:
    """Remove baselines of containers that no longer exist; returns the removed file names."""
    return prune_dir(root, baseline_dir(config), {_file_name(i) for i in live_ids})


def prune_dir(root: HostRoot, directory: str, keep) -> list:
    """Remove the .json records in `directory` (inside root) whose names are not in `keep`; returns their names.
    Shared by the baselines and the hook-input records (containers.hookrecord)."""
    removed: list = []
    try:
        names = root.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.endswith(".json") and name not in keep:
            try:
                if root.unlink(f"{directory}/{name}"):
                    removed.append(name)
            except OSError:
                pass
    return removed
