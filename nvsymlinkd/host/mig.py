"""The host's MIG map: GPU -> GPU instances -> compute instances -> capability minors. Pure: no I/O.

What the NVIDIA driver publishes (NVIDIA/open-gpu-kernel-modules 595.45.04):

- /proc/driver/nvidia-caps/mig-minors, `NAME MINOR` lines: `config 1`, `monitor 2`, then
  `gpu<N>/gi<G>/access` and `gpu<N>/gi<G>/ci<C>/access` for every GPU 0-31, GI 0-14 and CI 0-7 whether
  the instance exists or not (kernel-open/nvidia/nv-caps.c:61-65 the config/monitor table, :72-148 the
  per-GPU table, :327-357 minors numbered in table order from 0: nvlink's fabric-mgmt 0, config 1,
  monitor 2, gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, ... gpu0/gi1/access 12; :242-246 the line format).
  A minor therefore names a slot, not an instance: a GI destroyed and made again has the same minor.
- /proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/access and .../gi<G>/ci<C>/access exist only while
  that instance exists (src/nvidia/arch/nvalloc/unix/src/os.c:4692 `gpu%u` by the GPU's device minor,
  :4776-4791 `gi%u` + `access` when a GPU instance is made, :4861-4876 `ci%u` + `access` for a compute
  instance); their content is `DeviceFileMinor: N`, `DeviceFileMode: M`, `DeviceFileModify: 0|1`
  (kernel-open/nvidia/nv-caps.c:421-423).
- the nodes are /dev/nvidia-caps/nvidia-cap<minor>, major `nvidia-caps` from /proc/devices.

libnvidia-container grants a MIG device's two access capabilities by the minor it reads from the access
file (src/nvc_mount.c nvc_mig_device_access_caps_mount -> cap_device_mount ->
nvc_nvcaps_device_from_proc_path): here the access file's minor must equal mig-minors' entry for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from nvsymlinkd.host.devices import Device

MAX_GPUS = 32  # nv-caps.c g_nv_cap_mig_gpu_table: gpu0..gpu31
MAX_GI = 15  # gi0..gi14
MAX_CI = 8  # ci0..ci7
_NAME = re.compile(r"gpu(\d{1,2})/gi(\d{1,2})(?:/ci(\d))?/access")

# (gpu minor, gi, ci or None for the GI's own access file) -> the DeviceFileMinor its access file shows
AccessFiles = Mapping[Tuple[int, int, Optional[int]], int]


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance in its GPU instance), as the hook grants it."""

    gpu: int  # the parent GPU's device minor (capabilities/gpu<minor>)
    gi: int
    ci: int
    gi_minor: int  # nvidia-caps minor of gpu<N>/gi<G>/access
    ci_minor: int  # nvidia-caps minor of gpu<N>/gi<G>/ci<C>/access

    @property
    def name(self) -> str:
        return f"gpu{self.gpu}/gi{self.gi}/ci{self.ci}"


@dataclass(frozen=True)
class MigMap:
    readable: bool = True
    why: str = ""  # when not readable
    caps_major: Optional[int] = None  # `nvidia-caps` in /proc/devices (exact name)
    devices: Tuple[MigDevice, ...] = ()  # sorted by (gpu, gi, ci)
    config_minor: Optional[int] = None
    monitor_minor: Optional[int] = None
    slots: Tuple[Tuple[str, int], ...] = ()  # every mig-minors line (name, minor), in the file's order

    def gpu_slots(self, gpu: int) -> Tuple[int, ...]:
        """Every minor mig-minors lists for GPU `gpu`, the way libnvidia-container's setup_mig_minor_cgroups
        picks them (sscanf(line, "gpu%u%s %u") == 3 and the GPU's minor): its GI and CI slots, existing or not."""
        out = []
        for name, minor in self.slots:
            m = re.match(r"gpu(\d+)\S", name)
            if m is not None and int(m.group(1)) == gpu:
                out.append(minor)
        return tuple(out)

    def find(self, gpu: int, gi: int, ci: int) -> Optional[MigDevice]:
        return next((d for d in self.devices if (d.gpu, d.gi, d.ci) == (gpu, gi, ci)), None)

    def caps(self, device: MigDevice) -> Tuple[Device, Device]:
        """The GPU instance's and the compute instance's capability nodes."""
        assert self.caps_major is not None
        return Device.char(self.caps_major, device.gi_minor), Device.char(self.caps_major, device.ci_minor)


def unreadable(why: str) -> MigMap:
    return MigMap(readable=False, why=why)


def parse_mig_minors(text: str) -> dict[str, int] | str:
    """mig-minors' `NAME MINOR` lines -> {name: minor}, or why the file is not the driver's."""
    out: dict[str, int] = {}
    for lineno, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        parts = raw.split()
        if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()) or len(parts[1]) > 7:
            return f"line {lineno}: expected 'NAME MINOR', got {raw[:60]!r}"
        if parts[0] in out:
            return f"line {lineno}: {parts[0][:60]} is listed twice"
        out[parts[0]] = int(parts[1])
    return out


def parse_access(text: str) -> int | None:
    """The `DeviceFileMinor: N` of a capability's access file (nv-caps.c:421), None when absent or odd."""
    for line in text.split("\n"):
        key, sep, value = line.partition(":")
        if sep and key.strip() == "DeviceFileMinor":
            value = value.strip()
            return int(value) if value.isascii() and value.isdigit() and len(value) <= 7 else None
    return None


def instance_path(gpu: int, gi: int, ci: int | None) -> str:
    """The mig-minors name (and the path under capabilities/ without `mig/`) of an access file."""
    return f"gpu{gpu}/gi{gi}/access" if ci is None else f"gpu{gpu}/gi{gi}/ci{ci}/access"


def build_map(minors: Mapping[str, int], access: AccessFiles, caps_major: int | None) -> MigMap:
    """The MIG map from mig-minors and the access files that exist; not readable where they disagree."""
    devices = []
    for (gpu, gi, ci), minor in sorted(access.items(), key=lambda kv: (kv[0][0], kv[0][1], -1 if kv[0][2] is None
                                                                         else kv[0][2])):
        name = instance_path(gpu, gi, ci)
        if minors.get(name) != minor:
            return unreadable(f"{name}: its access file says minor {minor}, mig-minors "
                              f"{minors.get(name, 'nothing')}: not the layout this driver publishes")
        if ci is None:
            continue
        gi_minor = access.get((gpu, gi, None))
        if gi_minor is None:
            return unreadable(f"{name} exists without its GPU instance's access file")
        devices.append(MigDevice(gpu, gi, ci, gi_minor, minor))
    if devices and caps_major is None:
        return unreadable("MIG instances exist but /proc/devices lists no single `nvidia-caps` major")
    return MigMap(True, "", caps_major, tuple(devices), minors.get("config"), minors.get("monitor"),
                  tuple(minors.items()))


def parse_instance_name(gpu_dir: str, gi_dir: str, ci_dir: str | None) -> Tuple[int, int, Optional[int]] | None:
    """(gpu, gi, ci) from capabilities/ directory names (`gpu0`, `gi1`, `ci0`), None for other names."""
    m = _NAME.fullmatch(f"{gpu_dir}/{gi_dir}{'' if ci_dir is None else '/' + ci_dir}/access")
    if m is None or any(g.startswith("0") and g != "0" for g in m.groups() if g is not None):
        return None
    gpu, gi = int(m.group(1)), int(m.group(2))
    ci = None if m.group(3) is None else int(m.group(3))
    if gpu >= MAX_GPUS or gi >= MAX_GI or (ci is not None and ci >= MAX_CI):
        return None
    return gpu, gi, ci


def describe(devices: Sequence[MigDevice]) -> str:
    return ", ".join(d.name for d in devices) or "none"
