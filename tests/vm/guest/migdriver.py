"""A fake NVIDIA driver publishing an H100's MIG layout in the guest (issue 35, s28).

    majors = load_fake_mig_driver()            # nvidia.ko caps=1 (+ nvidia-uvm): /proc/devices has nvidia-caps
    publish_mig_layout({0: {1: [0], 2: [0]}}, {"MIG-...": (0, 1, 0), ...}, majors["nvidia-caps"])

The files are those of tests/migfixture.py (the driver's layout from NVIDIA/open-gpu-kernel-modules, cited
there and in nvsymlinkd/host/mig.py): /proc/driver/nvidia/gpus/<pci>/information, /proc/driver/nvidia-caps/
mig-minors (every slot, table order), /proc/driver/nvidia/capabilities/{mig/config,mig/monitor,gpu<N>/mig/
gi<G>[/ci<C>]/access} for the instances that exist, and the nodes /dev/nvidia-caps/nvidia-cap<minor> on the
fake module's dynamic nvidia-caps major. /proc/driver is a bind mount of a tmpfs tree (as s25's), published
into nvsymlinkd.service's own /proc by a BindReadOnlyPaths= drop-in.

    install_fake_nvml()                        # the driver's libnvidia-ml.so.1 and the real pynvml

NVML, as a real MIG node has it (libnvidia-ml.so.1 ships with the driver, pynvml is nvsymlinkd's optional
dependency): the real pynvml.py (nvidia-ml-py, pinned in vmhost.PYNVML) on the system Python's path, over the
fake driver's library (tests/vm/modules/libnvidia-ml.c), which answers from the same files: the GPUs of
/proc/driver/nvidia/gpus and the MIG UUID table the hook stand-in resolves (nvidia_hook.MIG_NVML), so NVML, the
hook and the driver's files never disagree.
"""
import json
import os
import shutil
import sys

from tests.migfixture import access_text, mig_minor_table
from tests.vm.guest.nvidia_hook import MIG_NVML
from tests.vm.guest.vmguest import (
    MODULES,
    daemon_reload,
    load_fake_uvm,
    mknod,
    proc_devices_majors,
    sh,
)

FAKE_PROC_DRIVER = "/run/vmtest/proc-driver"
DROP_IN = "/run/systemd/system/nvsymlinkd.service.d/50-proc-driver.conf"
CAPS = f"{FAKE_PROC_DRIVER}/nvidia/capabilities"
GPU_UUID = "GPU-00000000-vm28-0000-0000-000000000000"
NVML_LIB = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"  # where the driver's packages put it
# the system Python's local site directory: on nvsymlinkd.service's path and the maintainer scripts'
PYNVML = f"/usr/local/lib/python3.{sys.version_info.minor}/dist-packages/pynvml.py"


def load_fake_mig_driver() -> dict:
    """The fake nvidia.ko with its nvidia-caps major (caps=1, as the real module registers it) and nvidia-uvm."""
    sh("insmod", os.path.join(MODULES, "nvidia.ko"), "caps=1")
    load_fake_uvm()
    return {k: v for k, v in proc_devices_majors().items() if k.startswith("nvidia")}


def install_fake_nvml() -> None:
    """The fake libnvidia-ml.so.1 where the dynamic loader finds it (pynvml dlopens "libnvidia-ml.so.1") and
    the real pynvml.py, both built or fetched on the host (vmhost.build_modules, NVML_FILES)."""
    shutil.copy(os.path.join(MODULES, "libnvidia-ml.so.1"), NVML_LIB)
    sh("/sbin/ldconfig")
    os.makedirs(os.path.dirname(PYNVML), exist_ok=True)
    shutil.copy(os.path.join(MODULES, "pynvml.py"), PYNVML)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def publish_mig_layout(layout: dict, nvml: dict, caps_major: int) -> dict:
    """layout: GPU minor -> {GI: [CI]}; nvml: MIG UUID -> (GPU minor, GI, CI) for NVML and the hook. One GPU
    per minor under gpus/ (PCI 0000:00:05.0 + minor). Returns mig-minors' table (name -> minor)."""
    table = mig_minor_table()
    for gpu in layout:
        _write(f"{FAKE_PROC_DRIVER}/nvidia/gpus/0000:00:{5 + gpu:02x}.0/information",
               f"Model: \t\t Fake H100 80GB HBM3\nGPU UUID: \t {GPU_UUID[:-1]}{gpu}\nDevice Minor: \t {gpu}\n")
    # nv-caps.c:222-246 nv_procfs_read_mig_minors (595.45.04): "NAME MINOR" per slot, config/monitor first
    _write(f"{FAKE_PROC_DRIVER}/nvidia-caps/mig-minors", "".join(f"{n} {m}\n" for n, m in table.items()))
    _write(f"{CAPS}/mig/config", access_text(1, 0o400))
    _write(f"{CAPS}/mig/monitor", access_text(2, 0o444))
    minors = [1, 2]
    for gpu, gis in layout.items():
        for gi, cis in gis.items():
            _write(f"{CAPS}/gpu{gpu}/mig/gi{gi}/access", access_text(table[f"gpu{gpu}/gi{gi}/access"]))
            minors.append(table[f"gpu{gpu}/gi{gi}/access"])
            for ci in cis:
                name = f"gpu{gpu}/gi{gi}/ci{ci}/access"
                _write(f"{CAPS}/gpu{gpu}/mig/gi{gi}/ci{ci}/access", access_text(table[name]))
                minors.append(table[name])
    os.makedirs("/dev/nvidia-caps", exist_ok=True)
    for minor in minors:
        # 0666, not the driver's 0444: the hook stand-in makes the container's nodes 0666 too, and gpupoll
        # opens O_RDWR as libnvidia-container's users do; the device cgroup is what is judged
        mknod(f"/dev/nvidia-caps/nvidia-cap{minor}", caps_major, minor)
    _write(MIG_NVML, json.dumps({u: list(v) for u, v in nvml.items()}))
    sh("mount", "--bind", FAKE_PROC_DRIVER, "/proc/driver")
    _write(DROP_IN, f"[Service]\nBindReadOnlyPaths={FAKE_PROC_DRIVER}:/proc/driver\n")
    daemon_reload()
    return table
