"""Fake host trees for tests: real mknod'ed character devices and real /proc-style files.

    host = FakeHost(tmp_path)
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
    host.node("/dev/nvidia0", 195, 0)
    run nvsymlinkd with --root host.root
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

BASE_CHAR = {1: "mem", 4: "/dev/vc/0", 5: "/dev/tty", 10: "misc", 136: "pts"}
# what the link keeper makes on standard_host's nodes
STANDARD_LINKS = {
    "195:0": "../nvidia0",
    "195:1": "../nvidia1",
    "195:254": "../nvidia-modeset",
    "195:255": "../nvidiactl",
    "510:0": "../nvidia-uvm",
    "510:1": "../nvidia-uvm-tools",
}
CAPS_MAJOR = 509  # nvidia-caps on the daemon tests' hosts (conftest's caps_host)


class FakeHost:
    def __init__(self, root):
        self.root = Path(root)
        for d in ("dev", "proc/driver/nvidia/gpus", "etc", "run", "sys"):
            (self.root / d).mkdir(parents=True, exist_ok=True)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def write(self, inside: str, text: str) -> Path:
        p = self.path(inside)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def proc_devices(self, nvidia: dict, block: bool = True) -> None:
        """nvidia: name -> major (several names may share one major)."""
        lines = ["Character devices:"]
        rows = [(m, n) for m, n in BASE_CHAR.items()] + [(m, n) for n, m in nvidia.items()]
        lines += [f"{m:3d} {n}" for m, n in sorted(rows)]
        if block:
            lines += ["", "Block devices:", "  7 loop", "  8 sd"]
        self.write("/proc/devices", "\n".join(lines) + "\n")

    def node(self, inside: str, major: int, minor: int, mode: int = 0o666) -> Path:
        p = self.path(inside)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(p, stat.S_IFCHR | mode, os.makedev(major, minor))
        return p

    def symlink(self, inside: str, target: str) -> Path:
        p = self.path(inside)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)
        return p

    def gpu(self, pci: str, minor: int) -> None:
        self.write(f"/proc/driver/nvidia/gpus/{pci}/information",
                   f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{minor:08d}\n"
                   f"Video BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
                   f"DMA Mask: \t 0xfffffffffffff\nBus Location: \t {pci}\nDevice Minor: \t {minor}\n"
                   f"GPU Excluded:\t No\n")

    def params(self, uid: int = 0, gid: int = 0, mode: int = 0o666) -> None:
        self.write("/proc/driver/nvidia/params",
                   f"ResmanDebugLevel: 4294967295\nRmLogonRC: 1\nModifyDeviceFiles: 1\nDeviceFileUID: {uid}\n"
                   f"DeviceFileGID: {gid}\nDeviceFileMode: {mode}\nInitializeSystemMemoryAllocations: 1\n"
                   f'RegistryDwords: ""\nRegistryDwordsPerDevice: ""\n')

    def mig_minors(self, entries: dict) -> None:
        self.write("/proc/driver/nvidia-caps/mig-minors", "".join(f"{k} {v}\n" for k, v in entries.items()))

    def with_dev_null(self) -> FakeHost:
        self.node("/dev/null", 1, 3)
        return self

    def with_caps_major(self) -> FakeHost:
        """standard_host's /proc/devices, and nvidia-caps at CAPS_MAJOR."""
        self.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR})
        return self

    def links(self, dev_char: str = "/dev/char") -> dict:
        d = self.path(dev_char)
        if not d.is_dir():
            return {}
        return {e.name: os.readlink(e.path) for e in os.scandir(d) if e.is_symlink()}


def standard_host(root, uvm_major: int = 510, names=("nvidia-frontend",), gpus: int = 2) -> FakeHost:
    """A host with the 535-style frontend, uvm, nvidiactl, modeset and N GPUs."""
    host = FakeHost(root)
    nv = {n: 195 for n in names}
    nv["nvidia-uvm"] = uvm_major
    host.proc_devices(nv)
    for i in range(gpus):
        host.node(f"/dev/nvidia{i}", 195, i)
        host.gpu(f"0000:{i + 1:02x}:00.0", i)
    host.node("/dev/nvidiactl", 195, 255)
    host.node("/dev/nvidia-modeset", 195, 254)
    host.node("/dev/nvidia-uvm", uvm_major, 0)
    host.node("/dev/nvidia-uvm-tools", uvm_major, 1)
    host.params()
    return host


def links(host: FakeHost, dev_char: str = "/dev/char") -> dict | None:
    """host.links(), but None while the daemon is changing the directory under us."""
    try:
        return host.links(dev_char)
    except FileNotFoundError:
        return None
