"""The VM's fake NVML (issue 35, s28): tests/vm/modules/libnvidia-ml.c, loaded by the real pynvml (nvidia-ml-py,
the version vmhost.PYNVML pins), answers nvsymlinkd's reconstruction (hookhost.read_nvml_mig) from the layout the
fake driver publishes: the GPUs of /proc/driver/nvidia/gpus and migdriver's MIG UUID table, the same instances
whose access files the driver tree holds (tests/migfixture.py, host/driverinfo.read_mig_map)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvsymlinkd.host.driverinfo import read_mig_map
from nvsymlinkd.host.root import HostRoot
from tests.conftest import need_tool, skip_or_fail
from tests.fakehost import FakeHost
from tests.migfixture import CAPS_MAJOR, write_mig_layout
from tests.vm import vmhost

REPO = Path(__file__).resolve().parent.parent
MIG_A = "MIG-2a3b4c5d-aaaa-5e6f-8a9b-0c1d2e3f4a5b"
MIG_B = "MIG-7e8f9a0b-bbbb-5c6d-9e0f-1a2b3c4d5e6f"
MIG_C = "MIG-0c0c0c0c-cccc-5c6d-9e0f-1a2b3c4d5e6f"


def real_pynvml() -> Path | None:
    """The pinned pynvml.py: $NVSYMLINKD_PYNVML, an installed nvidia-ml-py, or one vmhost fetched into its cache."""
    spec = importlib.util.find_spec("pynvml")
    found = [Path(os.environ.get("NVSYMLINKD_PYNVML", "/nonexistent"))]
    found += [Path(spec.origin)] if spec and spec.origin else []
    found += sorted(vmhost.CACHE.glob("modules-*/pynvml.py"))
    for path in found:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == vmhost.PYNVML[1]:
            return path
    return None


@pytest.fixture(scope="module")
def libdir(tmp_path_factory) -> Path:
    """The fake library built and the pinned pynvml.py beside it: found (real_pynvml), else fetched as vmhost does
    for the VM (pip download of the pinned wheel, sha256-checked); in CI both must work, elsewhere a skip says why."""
    gcc = need_tool("gcc")
    out = tmp_path_factory.mktemp("nvml")
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1",
                    "-o", str(out / "libnvidia-ml.so.1"), str(REPO / "tests/vm/modules/libnvidia-ml.c")], check=True)
    found = real_pynvml()
    if found is not None:
        shutil.copy(found, out / "pynvml.py")
        return out
    try:
        vmhost.fetch_pynvml(out / "pynvml.py", tmp_dir=out)
    except vmhost.VmError as exc:
        skip_or_fail(f"the real pynvml.py of {vmhost.PYNVML[0]}: {exc} (pip install it, or set NVSYMLINKD_PYNVML)")
    return out


def nvml(libdir: Path, fake: FakeHost, table: dict | None) -> list:
    """read_nvml_mig() in a fresh process: the real pynvml dlopens libnvidia-ml.so.1 via LD_LIBRARY_PATH."""
    mig = fake.path("/run/vmtest/nvml-mig.json")
    if table is not None:  # as migdriver.publish_mig_layout writes it
        fake.write("/run/vmtest/nvml-mig.json", json.dumps({u: list(v) for u, v in table.items()}))
    env = dict(os.environ, LD_LIBRARY_PATH=str(libdir), PYTHONPATH=f"{libdir}{os.pathsep}{REPO}",
               FAKE_NVML_GPUS=str(fake.path("/proc/driver/nvidia/gpus")), FAKE_NVML_MIG=str(mig))
    code = ("import json, pynvml; from nvsymlinkd.containers.hookhost import read_nvml_mig; "
            f"assert pynvml.__file__.startswith({str(libdir)!r}); print(json.dumps(read_nvml_mig()))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_nvml_answers_the_drivers_mig_layout(tmp_path, libdir):
    """s28's H100 (GPU 0: GI 1 and GI 2, CI 0 each) and a GPU 1 in MIG mode with one instance: every MIG device
    NVML lists is one whose access files the driver publishes, by the same GPU minor, GI and CI."""
    fake = FakeHost(tmp_path / "root")
    fake.gpu("0000:00:05.0", 0)
    fake.gpu("0000:00:06.0", 1)
    fake.proc_devices({"nvidia": 195, "nvidiactl": 195, "nvidia-caps": CAPS_MAJOR})
    write_mig_layout(fake, {0: {1: [0], 2: [0]}, 1: {3: [0]}}, nodes=False)
    uuids, why, capable = nvml(libdir, fake, {MIG_A: (0, 1, 0), MIG_B: (0, 2, 0), MIG_C: (1, 3, 0)})
    assert why == "NVML" and capable == [0, 1]
    assert uuids == [[MIG_A, 0, 1, 0], [MIG_B, 0, 2, 0], [MIG_C, 1, 3, 0]]
    published = {d.name for d in read_mig_map(HostRoot(str(fake.root))).devices}
    assert {f"gpu{g}/gi{gi}/ci{ci}" for _, g, gi, ci in uuids} == published


def test_gpu_without_mig_devices_is_capable_and_lists_none(tmp_path, libdir):
    fake = FakeHost(tmp_path / "root")
    fake.gpu("0000:00:05.0", 0)
    assert nvml(libdir, fake, None) == [[], "NVML", [0]]


def test_no_driver_is_nvml_not_initialised(tmp_path, libdir):
    fake = FakeHost(tmp_path / "root")
    shutil.rmtree(fake.path("/proc/driver/nvidia/gpus"))
    uuids, why, capable = nvml(libdir, fake, {MIG_A: (0, 1, 0)})
    assert uuids is None and capable is None and why == "NVML cannot be initialised: Driver Not Loaded"
