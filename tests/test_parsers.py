"""Parsers of host files: exact results on real-shaped input, only HostFileError on garbage."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.errors import HostFileError
from nvsymlinkd.host.driverinfo import (
    capability_proc_path,
    parse_gpu_information,
    parse_mig_minors,
    parse_params,
)
from nvsymlinkd.host.procdevices import parse_proc_devices

PROC_535 = """Character devices:
  1 mem
  4 /dev/vc/0
195 nvidia-frontend
226 drm
237 nvidia-nvlink
238 nvidia-caps
239 nvidia-nvswitch
510 nvidia-uvm

Block devices:
  7 loop
259 blkext
195 nvidia-not-a-char-device
"""

PROC_550 = """Character devices:
  1 mem
195 nvidia
195 nvidiactl
195 nvidia-modeset
234 nvidia-caps-imex-channels
235 nvidia-caps
511 nvidia-uvm
"""


def test_535_names_and_block_section_ignored():
    m = parse_proc_devices(PROC_535)
    assert m.by_name == {"nvidia-frontend": 195, "nvidia-nvlink": 237, "nvidia-caps": 238,
                         "nvidia-nvswitch": 239, "nvidia-uvm": 510}
    assert m.frontend() == 195
    assert m.nvidia_majors == {195, 237, 238, 239, 510}


def test_550_several_names_share_a_major_and_names_match_exactly():
    m = parse_proc_devices(PROC_550)
    assert m.names_of(195) == ["nvidia", "nvidia-modeset", "nvidiactl"]
    # nvidia-caps is a prefix of nvidia-caps-imex-channels: exact names, distinct majors
    assert m.major("nvidia-caps") == 235
    assert m.major("nvidia-caps-imex-channels") == 234
    assert m.major("nvidia-uvm") == 511


def test_no_driver_is_empty_not_an_error():
    m = parse_proc_devices("Character devices:\n  1 mem\n\nBlock devices:\n  8 sd\n")
    assert not m and m.frontend() is None


@pytest.mark.parametrize("text,line", [
    ("", None),
    ("Block devices:\n  8 sd\n", None),
    ("Character devices:\n195\n", 2),
    ("Character devices:\n  1 mem\nxyz nvidia\n", 3),
    ("Character devices:\n99999 nvidia\n", 2),
    ("195 nvidia\n", 1),
])
def test_malformed_proc_devices_names_file_and_line(text, line):
    with pytest.raises(HostFileError) as err:
        parse_proc_devices(text)
    assert err.value.path == "/proc/devices"
    assert err.value.line == line
    assert str(err.value).startswith("/proc/devices")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789 :\n\tnvidia-Chartcesd\u00e9\u0663")), max_size=300) | st.text(max_size=100))
def test_proc_devices_parser_raises_only_hostfileerror(text):
    try:
        parse_proc_devices(text)
    except HostFileError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4095), st.from_regex(r"nvidia[a-z-]{0,20}", fullmatch=True)), max_size=20))
def test_proc_devices_roundtrip(rows):
    text = "Character devices:\n" + "".join(f"{m:3d} {n}\n" for m, n in rows)
    owned = {}
    for m, n in rows:
        owned.setdefault(n, set()).add(m)  # a name listed twice owns both majors: no line re-maps another
    got = parse_proc_devices(text)
    assert got.by_name == {n: min(ms) for n, ms in owned.items() if len(ms) == 1}
    assert got.pairs == tuple((n, m) for m, n in rows)
    assert got.nvidia_majors == {m for m, _ in rows}
    assert got.ambiguous() == {n: tuple(sorted(ms)) for n, ms in owned.items() if len(ms) > 1}


def test_truncated_proc_devices_prefix_never_crashes():
    for cut in range(len(PROC_550)):
        try:
            parse_proc_devices(PROC_550[:cut])
        except HostFileError:
            pass


def test_params_decimal_mode_and_owner():
    own = parse_params("DeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\nRegistryDwords: \"\"\n")
    assert (own.uid, own.gid, own.mode) == (0, 44, 0o660)


def test_params_missing_keys_default_and_bad_values_error():
    assert parse_params("ModifyDeviceFiles: 1\n").mode == 0o666
    with pytest.raises(HostFileError, match="DeviceFileMode is not a number"):
        parse_params("DeviceFileMode: rw-rw-rw-\n")
    with pytest.raises(HostFileError, match="out of range"):
        parse_params("DeviceFileMode: 99999\n")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_params_parser_raises_only_hostfileerror(text):
    try:
        parse_params(text)
    except HostFileError:
        pass


def test_gpu_information_and_mig_minors():
    assert parse_gpu_information("Model: X\nDevice Minor: \t 3\n", "/p") == 3
    with pytest.raises(HostFileError, match="no 'Device Minor:' line"):
        parse_gpu_information("Model: X\n", "/p")
    mig = parse_mig_minors("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n")
    assert mig == {"config": 1, "monitor": 2, "gpu0/gi0/access": 3, "gpu0/gi0/ci0/access": 4}
    with pytest.raises(HostFileError) as err:
        parse_mig_minors("config 1\nmonitor two\n")
    assert err.value.line == 2


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_mig_and_information_parsers_raise_only_hostfileerror(text):
    for fn in (parse_mig_minors, lambda t: parse_gpu_information(t, "/x")):
        try:
            fn(text)
        except HostFileError:
            pass


def test_capability_proc_paths():
    assert capability_proc_path("config") == "/proc/driver/nvidia/capabilities/mig/config"
    assert capability_proc_path("gpu1/gi2/ci0/access") == "/proc/driver/nvidia/capabilities/gpu1/mig/gi2/ci0/access"
