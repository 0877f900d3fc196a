"""The host's MIG map from the driver's files (issue 35 item 1): host/mig.py (pure) and
host/driverinfo.read_mig_map on an H100 fixture tree laid out as the driver publishes it (tests/migfixture.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from nvsymlinkd.host import mig
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.driverinfo import read_mig_map
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import FakeHost
from tests.migfixture import CAPS_MAJOR, IMEX_MAJOR, access_text, mig_minor_table, write_mig_layout


def h100(tmp_path, layout=None, names=None) -> FakeHost:
    fake = FakeHost(tmp_path)
    fake.proc_devices(names if names is not None else {"nvidia": 195, "nvidiactl": 195, "nvidia-uvm": 238,
                                                       "nvidia-caps": CAPS_MAJOR,
                                                       "nvidia-caps-imex-channels": IMEX_MAJOR})
    write_mig_layout(fake, layout if layout is not None else {0: {1: [0], 2: [0, 1]}, 1: {0: [0]}}, nodes=False)
    return fake


def test_minor_table_is_the_drivers():
    t = mig_minor_table()
    # REFERENCE.md, read from a real host: config 1, monitor 2, gpu0/gi1/access 12, gpu0/gi1/ci0/access 13
    assert (t["config"], t["monitor"], t["gpu0/gi1/access"], t["gpu0/gi1/ci0/access"]) == (1, 2, 12, 13)
    assert mig.parse_mig_minors("config 1\nmonitor 2\ngpu0/gi1/access 12\n") == {"config": 1, "monitor": 2,
                                                                                  "gpu0/gi1/access": 12}
    assert isinstance(mig.parse_mig_minors("config one\n"), str)
    assert isinstance(mig.parse_mig_minors("config 1\nconfig 1\n"), str)


def test_access_file_minor():
    assert mig.parse_access(access_text(13)) == 13
    assert mig.parse_access("DeviceFileMode: 292\n") is None
    assert mig.parse_access("DeviceFileMinor: -1\n") is None


def test_map_of_an_h100_with_instances(tmp_path):
    got = read_mig_map(HostRoot(str(h100(tmp_path).root)))
    assert got.readable, got.why
    assert got.caps_major == CAPS_MAJOR  # `nvidia-caps`, not the imex channels' major sharing its prefix
    assert [d.name for d in got.devices] == ["gpu0/gi1/ci0", "gpu0/gi2/ci0", "gpu0/gi2/ci1", "gpu1/gi0/ci0"]
    d = got.find(0, 2, 1)
    assert d is not None and (d.gi_minor, d.ci_minor) == (21, 23)
    assert got.caps(d) == (Device.char(CAPS_MAJOR, 21), Device.char(CAPS_MAJOR, 23))
    assert got.find(0, 3, 0) is None and (got.config_minor, got.monitor_minor) == (1, 2)


def test_no_instances_is_an_empty_map(tmp_path):
    got = read_mig_map(HostRoot(str(h100(tmp_path, layout={}).root)))
    assert got.readable and got.devices == ()


def test_access_file_that_disagrees_with_mig_minors_is_not_readable(tmp_path):
    fake = h100(tmp_path)
    fake.write("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access", access_text(99))
    got = read_mig_map(HostRoot(str(fake.root)))
    assert not got.readable and "gpu0/gi1/ci0/access" in got.why


def test_imex_major_alone_is_not_the_caps_major(tmp_path):
    fake = h100(tmp_path, names={"nvidia": 195, "nvidia-caps-imex-channels": IMEX_MAJOR})
    got = read_mig_map(HostRoot(str(fake.root)))
    assert not got.readable and "nvidia-caps" in got.why


def test_compute_instance_without_its_gpu_instance_file_is_not_readable(tmp_path):
    fake = h100(tmp_path)
    fake.path("/proc/driver/nvidia/capabilities/gpu1/mig/gi0/access").unlink()
    got = read_mig_map(HostRoot(str(fake.root)))
    assert not got.readable and "gpu1/gi0/ci0/access" in got.why


def test_odd_names_are_not_instances():
    assert mig.parse_instance_name("gpu0", "gi1", "ci0") == (0, 1, 0)
    assert mig.parse_instance_name("gpu0", "gi01", None) is None
    assert mig.parse_instance_name("gpu32", "gi1", None) is None
    assert mig.parse_instance_name("gpu0", "gi15", None) is None
    assert mig.parse_instance_name("gpu0", "gi1", "ci8") is None


REAL = Path(__file__).resolve().parent / "fixtures" / "mig-h200-580.159.04"


def test_fixture_table_is_a_real_drivers_mig_minors():
    """The H200 recorded with driver 580.159.04 (MIG off): its mig-minors is the table the fixtures build."""
    real = mig.parse_mig_minors((REAL / "proc/driver/nvidia-caps/mig-minors").read_text())
    assert real == mig_minor_table() and len(real) == 4322


def test_real_host_with_mig_off_has_an_empty_map(tmp_path):
    shutil.copytree(REAL, tmp_path / "root")
    got = read_mig_map(HostRoot(str(tmp_path / "root")))
    assert got.readable and got.devices == ()
    # an instance made there (the layout the driver would publish): gi1/ci0 with minors 12 and 13
    fake = FakeHost(tmp_path / "root")
    fake.write("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access", access_text(12))
    fake.write("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access", access_text(13))
    got = read_mig_map(HostRoot(str(fake.root)))
    assert got.readable and [(d.name, d.gi_minor, d.ci_minor) for d in got.devices] == [("gpu0/gi1/ci0", 12, 13)]
    assert got.caps_major == 241


def test_nvml_mig_devices_as_libnvidia_container_lists_them(tmp_path, monkeypatch):
    """hookhost.read_mig_uuids through a stand-in pynvml: GPUs in MIG mode only, and per GPU the MIG handles by
    index up to the first index without one (libnvidia-container src/nvc_info.c fill_mig_device_info stops
    there: a device past a gap was never selectable by the hook)."""
    import importlib.util
    import sys

    from nvsymlinkd.containers.hookhost import read_mig_uuids, read_nvml_mig
    from tests.migfixture import fake_pynvml

    path = fake_pynvml(tmp_path / "nvml", [(0, 1), (1, 0), (2, None)],
                       [("MIG-a", 0, 1, 0), (None, 0, 0, 0), ("MIG-past-gap", 0, 2, 0), ("MIG-off", 1, 1, 0)])
    spec = importlib.util.spec_from_file_location("pynvml", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert read_mig_uuids() == ((("MIG-a", 0, 1, 0),), "NVML")
    assert read_nvml_mig()[2] == (0, 1)  # MIG-capable: a MIG mode (on or off), not NotSupported
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable
    assert read_mig_uuids() == (None, "pynvml cannot be imported")


def test_nvml_failures_raise_where_found_and_are_the_driver_maps_words(monkeypatch):
    """nvml_mig raises NvmlError at each failure (issue 37 item 5); read_nvml_mig is the boundary, where the
    message becomes DriverMap.mig_uuids_why: the words it returned as (None, why, None) before."""
    import sys
    import types

    import pytest

    from nvsymlinkd.containers.hookhost import nvml_mig, read_nvml_mig
    from nvsymlinkd.errors import NvmlError

    def fake(init_error=None, count_error=None):
        module = types.ModuleType("pynvml")

        def init():
            if init_error:
                raise OSError(init_error)

        def count():
            if count_error:
                raise RuntimeError(count_error)
            return 0

        module.nvmlInit, module.nvmlShutdown, module.nvmlDeviceGetCount = init, lambda: None, count
        return module

    for module, words in ((None, "pynvml cannot be imported"),
                          (fake(init_error="libnvidia-ml.so.1: cannot open shared object file" + "x" * 80),
                           "NVML cannot be initialised: libnvidia-ml.so.1: cannot open shared object file"
                           + "x" * 31),  # str(exc)[:80]
                          (fake(count_error="Unknown Error"), "NVML failed listing MIG devices: Unknown Error")):
        monkeypatch.setitem(sys.modules, "pynvml", module)
        with pytest.raises(NvmlError) as raised:
            nvml_mig()
        assert str(raised.value) == words
        assert read_nvml_mig() == (None, words, None)
    monkeypatch.setitem(sys.modules, "pynvml", fake())
    assert read_nvml_mig() == ((), "NVML", ())
