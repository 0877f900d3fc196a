"""An H100 host with MIG instances, as its driver publishes them (issue 35), for FakeHost trees.

Each fact from the driver's open kernel modules (NVIDIA/open-gpu-kernel-modules 595.45.04; nvsymlinkd/host/mig.py
cites the lines): mig-minors lists every slot of 32 GPUs x 15 GPU instances x 8 compute instances whether it
exists or not, numbered in table order (config 1, monitor 2, gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, ...,
gpu0/gi1/access 12, gpu0/gi1/ci0/access 13); capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access exist only for
the instances that exist and hold `DeviceFileMinor/DeviceFileMode/DeviceFileModify`; the nodes are
/dev/nvidia-caps/nvidia-cap<minor>. The majors are those of a real H100 host (driver 580.159.04, REFERENCE.md):
241 nvidia-caps, 242 nvidia-caps-imex-channels.
"""

from __future__ import annotations

from pathlib import Path

CAPS_MAJOR = 241
IMEX_MAJOR = 242
CAPS = "/proc/driver/nvidia/capabilities"


def mig_minor_table(gpus: int = 32) -> dict:
    """name -> minor, in the driver's order (nv-caps.c: nvlink's fabric-mgmt takes 0, then this table)."""
    out = {"config": 1, "monitor": 2}
    minor = 3
    for g in range(gpus):
        for gi in range(15):
            out[f"gpu{g}/gi{gi}/access"] = minor
            minor += 1
            for ci in range(8):
                out[f"gpu{g}/gi{gi}/ci{ci}/access"] = minor
                minor += 1
    return out


def access_text(minor: int, mode: int = 0o444) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def write_mig_layout(fake, layout: dict, nodes: bool = True) -> dict:
    """layout: GPU minor -> {GI id: [CI ids]}. Writes mig-minors, the access files of those instances (and the
    global config/monitor ones) and, with nodes, their /dev/nvidia-caps nodes; returns the minor table."""
    table = mig_minor_table()
    fake.mig_minors(table)
    fake.write(f"{CAPS}/mig/config", access_text(1, 0o400))
    fake.write(f"{CAPS}/mig/monitor", access_text(2, 0o444))
    made = [1, 2]
    for gpu, gis in layout.items():
        for gi, cis in gis.items():
            name = f"gpu{gpu}/gi{gi}/access"
            fake.write(f"{CAPS}/gpu{gpu}/mig/gi{gi}/access", access_text(table[name]))
            made.append(table[name])
            for ci in cis:
                name = f"gpu{gpu}/gi{gi}/ci{ci}/access"
                fake.write(f"{CAPS}/gpu{gpu}/mig/gi{gi}/ci{ci}/access", access_text(table[name]))
                made.append(table[name])
    if nodes:
        for minor in made:
            if not fake.path(f"/dev/nvidia-caps/nvidia-cap{minor}").exists():
                fake.node(f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor, 0o444)
    return table


def cap(name: str) -> str:
    """"c 241:N" of a mig-minors name."""
    return f"c {CAPS_MAJOR}:{mig_minor_table()[name]}"


FAKE_PYNVML = '''"""A stand-in for pynvml with one host's MIG devices (tests only): the calls nvsymlinkd makes."""
GPUS = {gpus!r}  # NVML index -> (device minor, MIG mode)
MIGS = {migs!r}  # (UUID, GPU minor, GI, CI)
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_FunctionNotFound(NVMLError):
    pass


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(i):
    return ("gpu", GPUS[i][0])


def nvmlDeviceGetMigMode(h):
    mode = [m for minor, m in GPUS if minor == h[1]][0]
    if mode is None:
        raise NVMLError_NotSupported()
    return mode, mode


def nvmlDeviceGetMinorNumber(h):
    return h[1]


def nvmlDeviceGetMaxMigDeviceCount(h):
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(h, j):
    mine = [m for m in MIGS if m[1] == h[1]]
    if j >= len(mine) or mine[j][0] is None:  # None: no MIG device at this index (a gap)
        raise NVMLError_NotFound()
    return ("mig", mine[j])


def nvmlDeviceGetUUID(h):
    return h[1][0]


def nvmlDeviceGetGpuInstanceId(h):
    return h[1][2]


def nvmlDeviceGetComputeInstanceId(h):
    return h[1][3]
'''


def fake_pynvml(directory: Path, gpus: list, migs: list) -> Path:
    """Writes pynvml.py into directory (put it on PYTHONPATH): gpus [(minor, MIG mode or None)], migs
    [(UUID, GPU minor, GI, CI)]."""
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / "pynvml.py"
    p.write_text(FAKE_PYNVML.format(gpus=list(gpus), migs=list(migs)))
    return p
