"""host.elf: one named section of a real ELF (gcc-built, like the installer's Go wrapper's C part), and the
malformed tables a hostile or broken file can hold: each raises, none reads past the file or its caps."""

from __future__ import annotations

import os
import struct

import pytest

from nvsymlinkd.host.elf import SHT_PROGBITS, read_section
from tests.test_hookgrant_upstream import go_wrapper


def _section(data: bytes, name: str = ".nvctkiwc", tmp=None):
    path = tmp / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_section(fd, name)
    finally:
        os.close(fd)


def test_the_named_section_of_a_real_elf(tmp_path):
    data = go_wrapper('{"argv":["-debug"]}')
    got = _section(data, tmp=tmp_path)
    assert got is not None and got.sh_type == SHT_PROGBITS and got.little and len(got.data) == 4096
    config = b'{"argv":["-debug"]}'
    assert got.data[:4] == struct.pack("<I", len(config)) and got.data[4:4 + len(config)] == config
    assert _section(data, ".nvctkiwx", tmp=tmp_path) is None
    assert _section(data, ".nvctkiw", tmp=tmp_path) is None  # a prefix is not the name


def test_malformed_tables_raise(tmp_path):
    data = bytearray(go_wrapper("{}"))
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shnum, shstrndx = struct.unpack_from("<HH", data, 0x3C)
    # no section table at all: nothing names a section
    blank = bytearray(data)
    struct.pack_into("<QHHH", blank, 0x28, 0, 0, 0, 0)
    struct.pack_into("<H", blank, 0x3A, 64)
    assert _section(bytes(blank), tmp=tmp_path) is None
    bad = []
    cut = bytes(data[:shoff + 64])  # the table cut short
    bad.append(cut)
    ext = bytearray(data)
    struct.pack_into("<H", ext, 0x3C, 0)  # extended numbering (e_shnum 0 with a table)
    bad.append(bytes(ext))
    xindex = bytearray(data)
    struct.pack_into("<H", xindex, 0x3E, 0xFFFF)
    bad.append(bytes(xindex))
    huge = bytearray(data)
    struct.pack_into("<H", huge, 0x3C, 60000)
    bad.append(bytes(huge))
    names = bytearray(data)  # the names section's size made larger than the file
    struct.pack_into("<Q", names, shoff + shstrndx * 64 + 32, 1 << 40)
    bad.append(bytes(names))
    assert shnum > shstrndx
    for b in bad:
        with pytest.raises(ValueError):
            _section(b, tmp=tmp_path)


def test_a_hook_elf_whose_sections_cannot_be_read_is_not_trusted(tmp_path):
    """It may be the installer's Go wrapper pointing the hook at its own config: never read as the hook itself
    (with /etc's config, here none: the defaults would grant GPU 0)."""
    from tests.test_hookgrant_upstream import HOOK_PATH, UNTRUSTED, elf, on_host

    data = bytearray(go_wrapper("{}"))
    struct.pack_into("<H", data, 0x3C, 0)
    assert on_host(tmp_path / "a", {HOOK_PATH: bytes(data)}) == UNTRUSTED
    assert on_host(tmp_path / "b", {HOOK_PATH: elf("1.17.8")}) == {"c 195:255", "c 509:0", "c 509:1", "c 195:0"}


def test_the_go_wrapper_runs_its_own_resolved_path_dot_real(tmp_path):
    """os.Executable() is /proc/self/exe, links resolved: the installer's nvidia-container-toolkit link to the hook's
    wrapper runs nvidia-container-runtime-hook.real (a7b4038b executables.go:66-69 symlink, main.go:57-63)."""
    from nvsymlinkd.containers.hookhost import read_hook_executable
    from nvsymlinkd.host.root import HostRoot
    from tests.test_hookgrant_upstream import GO_WRAPPER_HOOK_JSON, OPERATOR, OPERATOR_CFG

    d = tmp_path / OPERATOR.lstrip("/")
    d.mkdir(parents=True)
    (d / "nvidia-container-runtime-hook").write_bytes(go_wrapper(GO_WRAPPER_HOOK_JSON))
    (d / "nvidia-container-toolkit").symlink_to("nvidia-container-runtime-hook")
    wrapper, binary = read_hook_executable(HostRoot(str(tmp_path)), f"{OPERATOR}/nvidia-container-toolkit")
    assert wrapper is not None
    assert binary == wrapper.target == f"{OPERATOR}/nvidia-container-runtime-hook.real"
    assert dict(wrapper.env) == {"NVIDIA_CTK_CONFIG_FILE_PATH": OPERATOR_CFG, "PATH": f"{OPERATOR}:$PATH"}
    assert wrapper.args == ()


@pytest.mark.parametrize("content,why", [
    (None, "does not exist on this host: what it was when it ran is not known"),
    ("dir", "is not a regular file"),
    (b"MZ\x90\x00", "is neither an ELF binary nor the toolkit installer's wrapper"),
    (b"\x7fELF\x02\x01\x01" + b"\0" * 9, "is an ELF file whose sections cannot be read ("),
])
def test_a_hook_path_that_cannot_be_known_raises_and_its_inputs_keep_why(tmp_path, content, why):
    """read_hook_executable raises HookUntrusted (issue 37 item 5: readers raise); read_hook_inputs is the
    boundary: the message is the inputs' wrapper_why, byte for byte, and no version is read."""
    from nvsymlinkd.containers.hookgrant import DriverMap
    from nvsymlinkd.containers.hookhost import HookUntrusted, read_hook_executable, read_hook_inputs
    from nvsymlinkd.host.root import HostRoot

    hook = tmp_path / "usr/bin/nvidia-container-runtime-hook"
    hook.parent.mkdir(parents=True)
    if content == "dir":
        hook.mkdir()
    elif content is not None:
        hook.write_bytes(content)
    root = HostRoot(str(tmp_path))
    with pytest.raises(HookUntrusted) as raised:
        read_hook_executable(root, "/usr/bin/nvidia-container-runtime-hook")
    assert str(raised.value).startswith(why)
    entry = ("prestart", "/usr/bin/nvidia-container-runtime-hook", ("nvidia-container-runtime-hook", "prestart"), ())
    inputs = read_hook_inputs(root, entry, (), driver=DriverMap())
    assert inputs.wrapper_why == str(raised.value) and inputs.version is None
