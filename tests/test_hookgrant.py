"""containers.hookgrant as tables: what the legacy NVIDIA hook grants, reconstructed exactly or not trusted.

Each case is one spec + toolkit config + driver map, and either the exact devices the hook grants
(docs/hookgrant.md cites the toolkit's and libnvidia-container's lines) or "untrusted" with a word of
the reason. No root, no I/O.
"""

from __future__ import annotations

import pytest

from nvsymlinkd.containers.hookgrant import (
    DriverMap,
    GpuEntry,
    HookInputs,
    HookRequest,
    ToolkitConfig,
    legacy_hook,
    parse_toolkit_config,
    reconstruct,
)
from nvsymlinkd.host.devices import Device

HOOK = ("prestart", "/usr/bin/nvidia-container-runtime-hook", ("nvidia-container-runtime-hook", "prestart"), None)
UVM = (Device.char(509, 0), Device.char(509, 1))
GPUS = (GpuEntry("0000:3b:00.0", 0, "GPU-aaaa-1111"), GpuEntry("0000:5e:00.0", 1, "GPU-bbbb-2222"),
        GpuEntry("0000:86:00.0", 2, "GPU-cccc-3333"))
DRIVER = DriverMap(GPUS, True, "", UVM, False, modeset=True)
CTL = "c 195:255"
BASE = {CTL, "c 509:0", "c 509:1"}  # default capabilities utility,compute: nvidiactl + the uvm nodes


def req(env=None, hooks=(HOOK,), mounts=(), privileged=False) -> HookRequest:
    return HookRequest(tuple(hooks), dict(env or {}), tuple(mounts), privileged)


DEFAULTS = ToolkitConfig()  # no config.toml: the toolkit's defaults


def grant(request, config=DEFAULTS, driver=DRIVER, version=(1, 17, 8)):
    return reconstruct(request, HookInputs(config, driver, version, "test"))


def devices(g) -> set:
    assert g is not None and g.trusted, g
    assert all(a == "rw" for a in g.devices.values())
    return {str(d) for d in g.devices}


def gpus(*minors) -> set:
    return {f"c 195:{m}" for m in minors}


TRUSTED = {
    "one index": ({"NVIDIA_VISIBLE_DEVICES": "1"}, ToolkitConfig(), BASE | gpus(1)),
    "two indices, spaces and empty items": ({"NVIDIA_VISIBLE_DEVICES": " 0, ,2 "}, ToolkitConfig(), BASE | gpus(0, 2)),
    "all": ({"NVIDIA_VISIBLE_DEVICES": "all"}, ToolkitConfig(), BASE | gpus(0, 1, 2)),
    "all after an index": ({"NVIDIA_VISIBLE_DEVICES": "0,all"}, ToolkitConfig(), BASE | gpus(0, 1, 2)),
    "none: control devices only": ({"NVIDIA_VISIBLE_DEVICES": "none"}, ToolkitConfig(), BASE),
    "uuid": ({"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb-2222"}, ToolkitConfig(), BASE | gpus(1)),
    "uuid in other case": ({"NVIDIA_VISIBLE_DEVICES": "gpu-CCCC-3333"}, ToolkitConfig(), BASE | gpus(2)),
    "pci bus id": ({"NVIDIA_VISIBLE_DEVICES": "0000:5e:00.0"}, ToolkitConfig(), BASE | gpus(1)),
    "pci bus id, short domain": ({"NVIDIA_VISIBLE_DEVICES": "0:86:00.0"}, ToolkitConfig(), BASE | gpus(2)),
    "same gpu twice": ({"NVIDIA_VISIBLE_DEVICES": "1,GPU-bbbb-2222"}, ToolkitConfig(), BASE | gpus(1)),
    "utility only: no uvm": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility"},
                             ToolkitConfig(), {CTL} | gpus(0)),
    "display adds modeset": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,display"},
                             ToolkitConfig(), BASE | gpus(0) | {"c 195:254"}),
    "capabilities all": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"},
                         ToolkitConfig(), BASE | gpus(0) | {"c 195:254"}),
    "empty capabilities: the defaults": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": ""},
                                         ToolkitConfig(), BASE | gpus(0)),
    "legacy image: all devices, all capabilities": ({"CUDA_VERSION": "9.0"}, ToolkitConfig(),
                                                     BASE | gpus(0, 1, 2) | {"c 195:254"}),
    "legacy image with NVIDIA_REQUIRE_CUDA is not legacy": ({"CUDA_VERSION": "12.2", "NVIDIA_REQUIRE_CUDA": "cuda>=12"},
                                                            ToolkitConfig(), set()),
    "unset: nothing": ({}, ToolkitConfig(), set()),
    "void: nothing": ({"NVIDIA_VISIBLE_DEVICES": "void"}, ToolkitConfig(), set()),
    "void among others: nothing": ({"NVIDIA_VISIBLE_DEVICES": "0,void"}, ToolkitConfig(), set()),
    "empty: nothing": ({"NVIDIA_VISIBLE_DEVICES": ""}, ToolkitConfig(), set()),
    "unprivileged env refused by the config": ({"NVIDIA_VISIBLE_DEVICES": "0"},
                                               ToolkitConfig(accept_envvar_unprivileged=False), set()),
    "no-cgroups: nothing in the cgroup": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(no_cgroups=True), set()),
    "load-kmods off: the uvm nodes that exist still granted": ({"NVIDIA_VISIBLE_DEVICES": "0"},
                                                                ToolkitConfig(load_kmods=False), BASE | gpus(0)),
    "supported capabilities narrow the defaults": ({"NVIDIA_VISIBLE_DEVICES": "0"},
                                                   ToolkitConfig(supported_capabilities=frozenset({"utility"})),
                                                   {CTL} | gpus(0)),
    "imex none is no request": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "none"}, ToolkitConfig(),
                                BASE | gpus(0)),
}


@pytest.mark.parametrize("name", sorted(TRUSTED))
def test_trusted(name):
    env, config, want = TRUSTED[name]
    assert devices(grant(req(env), config)) == want


def test_privileged_env_request_accepted_even_when_the_config_refuses_unprivileged():
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "2"}, privileged=True), ToolkitConfig(accept_envvar_unprivileged=False))
    assert devices(g) == BASE | gpus(2)


def test_volume_mounts_win_over_the_env_when_accepted():
    mounts = ("/var/run/nvidia-container-devices/0",)
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "all"}, mounts=mounts), ToolkitConfig(accept_volume_mounts=True))
    assert devices(g) == BASE | gpus(0)


def test_volume_mounts_ignored_unless_accepted():
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "2"}, mounts=("/var/run/nvidia-container-devices/0",)))
    assert devices(g) == BASE | gpus(2)


def test_only_imex_mounts_fall_back_to_the_env_and_request_a_channel():
    """1.17+: an imex/N mount is no device (the env decides the GPUs) but an IMEX channel request."""
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "1"}, mounts=("/var/run/nvidia-container-devices/imex/0",)),
              ToolkitConfig(accept_volume_mounts=True))
    assert g is not None and not g.trusted and "IMEX" in g.detail, g


UNTRUSTED = {
    "unknown uuid": ({"NVIDIA_VISIBLE_DEVICES": "GPU-ffff"}, ToolkitConfig(), DRIVER, "no GPU the driver lists"),
    "uuid prefix is no match": ({"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb"}, ToolkitConfig(), DRIVER, "no GPU"),
    "index past the last gpu": ({"NVIDIA_VISIBLE_DEVICES": "3"}, ToolkitConfig(), DRIVER, "no GPU"),
    "unknown word": ({"NVIDIA_VISIBLE_DEVICES": "first"}, ToolkitConfig(), DRIVER, "no GPU"),
    "cdi name": ({"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu=0"}, ToolkitConfig(), DRIVER, "no GPU"),
    "mig uuid": ({"NVIDIA_VISIBLE_DEVICES": "MIG-1234"}, ToolkitConfig(), DRIVER, "MIG"),
    "mig index": ({"NVIDIA_VISIBLE_DEVICES": "0:1"}, ToolkitConfig(), DRIVER, "MIG"),
    "all on a MIG host": ({"NVIDIA_VISIBLE_DEVICES": "all"}, ToolkitConfig(), DriverMap(GPUS, True, "", UVM, True),
                          "MIG"),
    # unprivileged: the hook panics (issue 35: privileged ones are reconstructed, test_hookgrant_upstream mig-*)
    "mig config": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_CONFIG_DEVICES": "all"}, ToolkitConfig(), DRIVER,
                   "unprivileged"),
    "mig monitor": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_MONITOR_DEVICES": "all"}, ToolkitConfig(), DRIVER,
                    "unprivileged"),
    "imex channels": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "0"}, ToolkitConfig(), DRIVER, "IMEX"),
    "unreadable config": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(readable=False, why="EACCES"), DRIVER,
                          "cannot be read"),
    "cdi mode": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(mode="cdi"), DRIVER, "mode"),
    "unsupported capability": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,teleport"},
                               ToolkitConfig(), DRIVER, "capabilities"),
    "driver list unreadable": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(),
                               DriverMap((), False, "EACCES", UVM), "cannot be read"),
    "a gpu without its uuid": ({"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa-1111"}, ToolkitConfig(),
                               DriverMap((GpuEntry("0000:3b:00.0", 0, None),), True, "", UVM), "UUID"),
    "index with minors out of pci order": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(),
                                           DriverMap((GpuEntry("0000:3b:00.0", 1, "GPU-a"),
                                                      GpuEntry("0000:5e:00.0", 0, "GPU-b")), True, "", UVM),
                                           "ambiguous"),
    "cdi device as a volume mount": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(accept_volume_mounts=True),
                                     DRIVER, "CDI"),
}


@pytest.mark.parametrize("name", sorted(UNTRUSTED))
def test_untrusted(name):
    env, config, driver, word = UNTRUSTED[name]
    mounts = ("/var/run/nvidia-container-devices/cdi/nvidia.com/gpu/0",) if "volume mount" in name else ()
    g = grant(req(env, mounts=mounts), config, driver)
    assert g is not None and not g.trusted and not g.devices, g
    assert word in g.detail, g.detail


def test_uuid_matches_when_minors_are_out_of_pci_order():
    driver = DriverMap((GpuEntry("0000:3b:00.0", 1, "GPU-a"), GpuEntry("0000:5e:00.0", 0, "GPU-b")), True, "", ())
    assert devices(grant(req({"NVIDIA_VISIBLE_DEVICES": "GPU-b"}), ToolkitConfig(), driver)) == {CTL} | gpus(0)


HOOKS = {
    "runtime wrapper's hook": (HOOK, True),
    "docker's nvidia-container-toolkit alias": (
        ("prestart", "/usr/bin/nvidia-container-toolkit", ("nvidia-container-toolkit", "prestart"), None), True),
    "hook with a debug flag": (
        ("prestart", "/usr/bin/nvidia-container-runtime-hook", ("nvidia-container-runtime-hook", "-debug", "prestart"),
         None), True),
    "createRuntime hook": (("createRuntime", HOOK[1], HOOK[2], None), True),
    "poststop hook does nothing": (("poststop", HOOK[1], ("nvidia-container-runtime-hook", "poststop"), None), False),
    "nvidia-ctk cdi hook grants nothing": (
        ("createContainer", "/usr/bin/nvidia-ctk", ("nvidia-ctk", "hook", "update-ldcache"), None), False),
    "args unreadable": (("prestart", HOOK[1], None, None), False),
    "another program": (("prestart", "/usr/bin/grant", ("grant", "prestart"), None), False),
}


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_which_hook_is_the_legacy_hook(name):
    entry, legacy = HOOKS[name]
    assert (legacy_hook([entry]) is not None) == legacy
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "0"}, hooks=[entry]))
    assert (g is not None) == legacy


def test_prestart_kind_running_another_command_grants_nothing():
    entry = ("prestart", HOOK[1], ("nvidia-container-runtime-hook", "poststart"), None)
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "0"}, hooks=[entry]))
    assert g is not None and g.trusted and not g.devices and "poststart" in g.detail


CONFIGS = {
    "empty file: the defaults": ({}, ToolkitConfig(present=True)),
    "accept flags": ({"accept-nvidia-visible-devices-envvar-when-unprivileged": False,
                      "accept-nvidia-visible-devices-as-volume-mounts": True},
                     ToolkitConfig(present=True, accept_envvar_unprivileged=False, accept_volume_mounts=True)),
    "cli table": ({"nvidia-container-cli": {"no-cgroups": True, "load-kmods": False, "root": "/run/nvidia/driver"}},
                  ToolkitConfig(present=True, no_cgroups=True, load_kmods=False, driver_root="/run/nvidia/driver")),
    "runtime mode": ({"nvidia-container-runtime": {"mode": "legacy"}}, ToolkitConfig(present=True, mode="legacy")),
    "supported capabilities": ({"supported-driver-capabilities": "utility,compute"},
                               ToolkitConfig(present=True, supported_capabilities=frozenset({"utility", "compute"}))),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parse_toolkit_config(name):
    doc, want = CONFIGS[name]
    assert parse_toolkit_config(doc) == want


BAD_CONFIGS = {
    "flag as a string": {"accept-nvidia-visible-devices-envvar-when-unprivileged": "true"},
    "cli not a table": {"nvidia-container-cli": "x"},
    "no-cgroups as a number": {"nvidia-container-cli": {"no-cgroups": 1}},
    "unknown supported capability": {"supported-driver-capabilities": "compute,warp"},
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_malformed_toolkit_config_is_not_readable(name):
    config = parse_toolkit_config(BAD_CONFIGS[name])
    assert not config.readable and config.why
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "0"}), config)
    assert g is not None and not g.trusted


def test_never_more_than_requested():
    """Whatever the request, the grant holds only the control nodes, the uvm nodes and the GPUs asked for."""
    for value in ("0", "1", "2", "0,1", "GPU-cccc-3333", "none"):
        got = devices(grant(req({"NVIDIA_VISIBLE_DEVICES": value})))
        asked = {g.minor for g in GPUS if str(g.minor) in value.split(",") or (g.uuid or "") == value}
        assert got == BASE | gpus(*asked), value


# ---------------------------------------------------------------- hookhost: reading the inputs under --root

def _tree(tmp_path, files: dict):
    from nvsymlinkd.host.root import HostRoot

    for inside, text in files.items():
        path = tmp_path / inside.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return HostRoot(str(tmp_path))


def test_read_toolkit_config_absent_is_the_defaults(tmp_path):
    from nvsymlinkd.containers.hookhost import read_toolkit_config

    assert read_toolkit_config(_tree(tmp_path, {})) == ToolkitConfig()


def test_read_toolkit_config_invalid_toml_is_not_readable(tmp_path):
    from nvsymlinkd.containers.hookhost import TOOLKIT_CONFIG, read_toolkit_config

    config = read_toolkit_config(_tree(tmp_path, {TOOLKIT_CONFIG: "[nvidia-container-cli\n"}))
    assert not config.readable and TOOLKIT_CONFIG in config.why and "invalid TOML" in config.why


def test_read_toolkit_config_a_directory_is_not_readable(tmp_path):
    from nvsymlinkd.containers.hookhost import TOOLKIT_CONFIG, read_toolkit_config

    (tmp_path / TOOLKIT_CONFIG.lstrip("/")).mkdir(parents=True)
    assert not read_toolkit_config(_tree(tmp_path, {})).readable


def test_read_toolkit_config_overlays_the_defaults(tmp_path):
    from nvsymlinkd.containers.hookhost import TOOLKIT_CONFIG, read_toolkit_config

    text = '[nvidia-container-cli]\nno-cgroups = true\nroot = "/run/nvidia/driver"\n'
    config = read_toolkit_config(_tree(tmp_path, {TOOLKIT_CONFIG: text}))
    assert config.readable and config.no_cgroups and config.load_kmods and config.accept_envvar_unprivileged
    assert config.driver_root == "/run/nvidia/driver"


def test_read_driver_map(tmp_path):
    from nvsymlinkd.containers.hookhost import read_driver_map

    info = "Model:\t\t X\nIRQ:\t\t 1\nGPU UUID:\t GPU-1234-abcd\nDevice Minor:\t 3\n"
    root = _tree(tmp_path, {"/proc/driver/nvidia/gpus/0000:3b:00.0/information": info,
                            "/proc/driver/nvidia/capabilities/gpu3/mig/gi1/access": "DeviceFileMinor: 12\n"})
    driver = read_driver_map(root, ())
    assert driver.readable and driver.gpus == (GpuEntry("0000:3b:00.0", 3, "GPU-1234-abcd"),)
    assert driver.mig_instances


@pytest.mark.parametrize("files,why", [
    ({}, "lists no GPU"),
    ({"/proc/driver/nvidia/gpus/0000:3b:00.0/information": "Device Minor: 300\n"}, "Device Minor"),
    ({"/proc/driver/nvidia/gpus/0000:3b:00.0/information": "GPU UUID: GPU-1\n"}, "Device Minor"),
])
def test_read_driver_map_not_readable(tmp_path, files, why):
    from nvsymlinkd.containers.hookhost import read_driver_map

    driver = read_driver_map(_tree(tmp_path, files), ())
    assert not driver.readable and why in driver.why
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "all"}), DEFAULTS, driver)
    assert g is not None and not g.trusted


# ---------------------------------------------------------------- issue 34: the hook's own parsing, exactly

# Go's own table for Clean (go/src/path/filepath/path_test.go cleantests, the Unix cases): each result is
# also clean already
GO_CLEAN = [
    ("abc", "abc"), ("abc/def", "abc/def"), ("a/b/c", "a/b/c"), (".", "."), ("..", ".."), ("../..", "../.."),
    ("../../abc", "../../abc"), ("/abc", "/abc"), ("/", "/"), ("", "."),
    ("abc/", "abc"), ("abc/def/", "abc/def"), ("a/b/c/", "a/b/c"), ("./", "."), ("../", ".."), ("../../", "../.."),
    ("/abc/", "/abc"),
    ("abc//def//ghi", "abc/def/ghi"), ("//abc", "/abc"), ("///abc", "/abc"), ("//abc//", "/abc"), ("abc//", "abc"),
    ("abc/./def", "abc/def"), ("/./abc/def", "/abc/def"), ("abc/.", "abc"),
    ("abc/def/ghi/../jkl", "abc/def/jkl"), ("abc/def/../ghi/../jkl", "abc/jkl"), ("abc/def/..", "abc"),
    ("abc/def/../..", "."), ("/abc/def/../..", "/"), ("abc/def/../../..", ".."), ("/abc/def/../../..", "/"),
    ("abc/def/../../../ghi/jkl/../../../mno", "../../mno"), ("/../abc", "/abc"),
    ("abc/./../def", "def"), ("abc//./../def", "def"), ("abc/../../././../def", "../../def"),
]


@pytest.mark.parametrize("path,want", GO_CLEAN)
def test_go_clean_is_filepath_clean(path, want):
    from nvsymlinkd.containers.hookgrant import go_clean

    assert go_clean(path) == want
    assert go_clean(want) == want


def test_go_clean_differs_from_normpath_where_the_hook_would_see_a_device():
    import os.path

    from nvsymlinkd.containers.hookgrant import go_clean

    assert os.path.normpath("//var/run/nvidia-container-devices/1") == "//var/run/nvidia-container-devices/1"
    assert go_clean("//var/run/nvidia-container-devices/1") == "/var/run/nvidia-container-devices/1"


ARGS = {  # argv as runc passes it (argv[0] first) -> (the -config value, the command or None)
    "plain": (["hook", "prestart"], ("", "prestart")),
    "config with =": (["hook", "-config=/a.toml", "prestart"], ("/a.toml", "prestart")),
    "config as the next argument": (["hook", "-config", "/a.toml", "prestart"], ("/a.toml", "prestart")),
    "double dash flag": (["hook", "--config=/a.toml", "prestart"], ("/a.toml", "prestart")),
    "last config wins": (["hook", "-config=/a", "-config=/b", "prestart"], ("/b", "prestart")),
    "empty config is none": (["hook", "-config=", "prestart"], ("", "prestart")),
    "debug then command": (["hook", "-debug", "prestart"], ("", "prestart")),
    "debug=false": (["hook", "-debug=false", "prestart"], ("", "prestart")),
    "flags after the command are arguments": (["hook", "prestart", "-foo"], ("", "prestart")),
    "second positional ignored": (["hook", "poststart", "prestart"], ("", None)),
    "unknown flag exits": (["hook", "-foo", "prestart"], ("", None)),
    "help exits": (["hook", "-h", "prestart"], ("", None)),
    "version exits": (["hook", "-version", "prestart"], ("", None)),
    "version=false runs": (["hook", "-version=false", "prestart"], ("", "prestart")),
    "config missing its value": (["hook", "-config"], ("", None)),
    "triple dash is bad syntax": (["hook", "---config=x", "prestart"], ("", None)),
    "lone dash is a positional": (["hook", "-", "prestart"], ("", None)),
    "double dash ends flags": (["hook", "--", "-config=x"], ("", None)),
    "no command": (["hook", "-debug"], ("", None)),
}


@pytest.mark.parametrize("name", sorted(ARGS))
def test_go_flag_parse(name):
    from nvsymlinkd.containers.hookgrant import go_flag_parse

    argv, (config, command) = ARGS[name]
    got_config, got_command, why = go_flag_parse(argv)
    assert (got_config if got_command else "", got_command) == (config if command else "", command), why
    assert bool(why) == (command is None)


def test_wrapper_shapes_of_both_installers_parse():
    from nvsymlinkd.containers.hookgrant import Wrapper, parse_wrapper

    old = ('#! /bin/sh\nPATH=/usr/local/nvidia/toolkit:$PATH \\\n/usr/local/nvidia/toolkit/nvidia-container-runtime-'
           'hook.real \\\n\t-config "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml" \\\n'
           '\t"$@"\n')
    assert parse_wrapper(old) == Wrapper((("PATH", "/usr/local/nvidia/toolkit:$PATH"),),
                                         "/usr/local/nvidia/toolkit/nvidia-container-runtime-hook.real",
                                         ("-config", "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/"
                                                     "config.toml"))
    new = ('#! /bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH=/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/'
           'config.toml \\\nPATH=/usr/local/nvidia/toolkit:$PATH \\\n\t/usr/local/nvidia/toolkit/nvidia-container-'
           'runtime-hook.real \\\n\t\t"$@"\n')
    got = parse_wrapper(new)
    assert isinstance(got, Wrapper) and got.args == ()
    assert dict(got.env)["NVIDIA_CTK_CONFIG_FILE_PATH"].endswith("/.config/nvidia-container-runtime/config.toml")


@pytest.mark.parametrize("text", [
    "#!/bin/sh\nexec /usr/bin/nvidia-container-runtime-hook.real \"$@\"\n",  # another shebang, another shape
    "#! /bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH=$HOME/c.toml \\\n\t/x/hook.real \\\n\t\t\"$@\"\n",  # an expansion
    "#! /bin/sh\nPATH=/x:$PATH \\\n\t/x/hook.real \\\n\t\t\"$@\"\nexport X=1\n",  # a line after
    "#! /bin/sh\nPATH=/x:$PATH \\\n\t/x/hook.real \\\n\t-config \"$(cat /c)\" \\\n\t\"$@\"\n",  # a command in -config
])
def test_other_scripts_are_not_the_wrapper(text):
    from nvsymlinkd.containers.hookgrant import parse_wrapper

    assert isinstance(parse_wrapper(text), str)


@pytest.mark.parametrize("status,want", [
    ("Version: 1.17.8-1\n", (1, 17, 8)),
    ("Version: 1:1.18.0-1ubuntu1\n", (1, 18, 0)),
    ("Version: 1.17.0~rc.1-1\n", None),  # a pre-release is not the release
    ("Version: 1.17\n", None),
])
def test_toolkit_version_from_dpkg(tmp_path, status, want):
    from nvsymlinkd.containers.hookhost import VersionUnknown, read_toolkit_version

    root = _tree(tmp_path, {"/var/lib/dpkg/status": "Package: nvidia-container-toolkit\nStatus: install ok installed\n"
                                                    + status + "\nPackage: other\nVersion: 9.9.9\n",
                            "/var/lib/dpkg/info/nvidia-container-toolkit.list": "/usr/bin\n" + HOOK[1] + "\n",
                            HOOK[1]: "\x7fELF"})
    try:
        version, why = read_toolkit_version(root, HOOK[1])
    except VersionUnknown as exc:  # read_hook_inputs keeps the reason with version None
        version, why = None, str(exc)
    assert version == want, why


def test_toolkit_version_from_build_info_needs_one_release(tmp_path):
    from nvsymlinkd.containers.hookhost import VersionUnknown, read_toolkit_version
    from nvsymlinkd.host.root import HostRoot

    flag = b"-X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version="
    for content, want in ((b"\x7fELF" + flag + b"1.16.2 ", (1, 16, 2)), (b"\x7fELF" + flag + b"1.17.0~rc.2 ", None),
                          (b"\x7fELF" + flag + b"1.16.2 " + flag + b"1.17.0 ", None), (b"\x7fELF", None)):
        (tmp_path / "hook").write_bytes(content)
        if want is None:
            with pytest.raises(VersionUnknown, match="^/hook: "):
                read_toolkit_version(HostRoot(str(tmp_path)), "/hook")
        else:
            assert read_toolkit_version(HostRoot(str(tmp_path)), "/hook")[0] == want, content


def test_excluded_gpu_read_from_the_driver(tmp_path):
    from nvsymlinkd.containers.hookhost import read_driver_map

    info = "Device Minor:\t 0\nGPU UUID:\t GPU-0\nGPU Excluded:\t Yes\n"
    driver = read_driver_map(_tree(tmp_path, {"/proc/driver/nvidia/gpus/0000:3b:00.0/information": info}), ())
    assert driver.readable and driver.gpus[0].excluded


def test_nvidia_visible_devices_is_never_cut():
    """Issue 34: the spec reader cut NVIDIA_VISIBLE_DEVICES at 1,024 characters, losing a `void` after it."""
    from nvsymlinkd.containers.ocispec import parse_spec

    value = ",".join(["0"] * 700) + ",void"
    spec = parse_spec({"process": {"env": [f"NVIDIA_VISIBLE_DEVICES={value}", "DOCKER_RESOURCE_GPU=1"]}})
    assert spec.env["NVIDIA_VISIBLE_DEVICES"] == value and spec.visible_devices == value
    assert spec.env["DOCKER_RESOURCE_GPU"] == "1"  # any variable: swarm-resource can name it


def test_hook_entry_keeps_its_env():
    from nvsymlinkd.containers.ocispec import parse_spec

    spec = parse_spec({"hooks": {"prestart": [{"path": HOOK[1], "args": list(HOOK[2]),
                                               "env": ["NVIDIA_CTK_CONFIG_FILE_PATH=/c.toml"]}]}})
    assert spec.hook_entries == (("prestart", HOOK[1], HOOK[2], ("NVIDIA_CTK_CONFIG_FILE_PATH=/c.toml",)),)


def test_hook_env_setting_the_config_path_twice_is_not_trusted():
    entry = ("prestart", HOOK[1], HOOK[2], ("NVIDIA_CTK_CONFIG_FILE_PATH=/a", "NVIDIA_CTK_CONFIG_FILE_PATH=/b"))
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": "0"}, hooks=[entry]))
    assert g is not None and not g.trusted and "twice" in g.detail


@pytest.mark.parametrize("value,want", [
    ("0000:5e:00.1", {1}), ("0:5e:0", {1}), ("0000:5e:00.0junk", {1}), ("0x0:5e:00.0", None),
    ("+1", {1}), ("-0", {0}), ("01", {1}), ("-1", None), ("1 ", {1}),  # the hook trims the item
    ("all,0", {0, 1, 2}), ("ALL", {0, 1, 2}), ("aLl,bogus", {0, 1, 2}), ("bogus,all", {0, 1, 2}),  # the hook: the first `all` decides
])
def test_cli_selection_edge_cases(value, want):
    g = grant(req({"NVIDIA_VISIBLE_DEVICES": value}))
    if want is None:
        assert g is not None and not g.trusted, g
    else:
        assert devices(g) == BASE | gpus(*want)


def test_config_key_spelling_ambiguity_with_an_unknown_version():
    """go-toml reads only the exact and upper-case spellings, BurntSushi any case: where they differ and the
    version is unknown, not trusted."""
    doc = {"Accept-Nvidia-Visible-Devices-Envvar-When-Unprivileged": False}
    assert parse_toolkit_config(doc, "go-toml").accept_envvar_unprivileged is True
    assert parse_toolkit_config(doc, "burntsushi").accept_envvar_unprivileged is False
    assert not parse_toolkit_config(doc, None).readable
    kelvin = {"\u212aeys": 1}  # strings.EqualFold folds the Kelvin sign to k
    from nvsymlinkd.containers.hookgrant import go_equal_fold

    assert go_equal_fold(next(iter(kelvin)), "keys") and not go_equal_fold("KEYS!", "keys")


def test_lost_and_at_risk_findings_name_mig_devices_and_imex_channels_in_check_and_the_journal():
    """Issue 35 items 1 and 3: a hook-granted MIG device by its UUID and g:m index, an IMEX channel by its number
    and node, in the finding's detail (check's line and the journal's MESSAGE), lost or at risk alike."""
    from nvsymlinkd.containers.expected import Expected
    from nvsymlinkd.containers.hookgrant import RW, HookGrant, ImexGrant, MigGrant
    from nvsymlinkd.verify import evaluate
    from nvsymlinkd.verify.evaluate import ContainerReport
    from nvsymlinkd.verify.journaldiff import journal_entries
    from nvsymlinkd.verify.kinds import FindingKind, verdict_of

    gpu, gi, ci, ch0, ch1 = (Device.char(195, 0), Device.char(241, 12), Device.char(241, 13), Device.char(242, 0),
                             Device.char(242, 1))
    mig = MigGrant("MIG-2a3b4c5d-aaaa-5e6f-8a9b-0c1d2e3f4a5b", "0:0", "gpu0/gi1/ci0", (gpu, gi, ci))
    hook = HookGrant(True, {d: RW for d in (gpu, gi, ci, ch0, ch1)}, "x", (mig,),
                     (ImexGrant(0, ch0), ImexGrant(1, ch1)))
    expected = Expected(dict(hook.devices), frozenset(), {d: ("nvidia-hook",) for d in hook.devices}, hook)
    (lost,) = evaluate._lost_finding([gi, ch0], expected, "ID")
    assert "MIG device MIG-2a3b4c5d-aaaa-5e6f-8a9b-0c1d2e3f4a5b (0:0, gpu0/gi1/ci0)" in lost.detail, lost.detail
    assert "IMEX channel 0 (/dev/nvidia-caps-imex-channels/channel0)" in lost.detail
    assert "channel 1" not in lost.detail  # only what was lost
    assert evaluate._named(expected, [ch1]) == "; IMEX channel 1 (/dev/nvidia-caps-imex-channels/channel1)"
    assert evaluate._named(Expected(), [ch1]) == ""
    report = ContainerReport("a" * 64, "runc", "", "running", verdict_of([FindingKind.LOST]), findings=[lost])
    ((_, _, message, fields),) = journal_entries(report)
    assert "MIG device MIG-2a3b4c5d" in message and "IMEX channel 0 (" in message, message
    assert fields["devices"] == "c 241:12, c 242:0"


@pytest.mark.parametrize("value, want", [
    ("", ()), (",,", ()), ("0", (0,)), ("3,1,3", (3, 1)), (" 7", (7,)), ("\t+3", (3,)), ("-0", (0,)),
    ("007", (7,)), ("1048575", (1048575,)),
    ("1048576", None), ("-1", None), ("1 ", None), ("0x1", None), ("all", None), (" ", None), ("+", None),
    ("9" * 30, None), ("٣", None),  # strtoumax reads ASCII digits only
])
def test_imex_channel_list_as_the_cli_parses_it(value, want):
    """host.imex.parse_channel_list = libnvidia-container's parse_imex_info: strsep on ',', empty items skipped,
    strtoumax(item, &end, 10) ending the item and below 2^20, else the cli fails."""
    from nvsymlinkd.host.imex import parse_channel_list

    got = parse_channel_list(value)
    assert (got if not isinstance(got, str) else None) == want, got


def test_imex_nodes_as_the_cli_would_stat_them():
    from nvsymlinkd.host.imex import ImexNodes, channel_of, imex_nodes

    d = "/run/nvidia/driver/dev/nvidia-caps-imex-channels"
    got = imex_nodes(242, [(f"{d}/channel0", 242, 0), (f"{d}/channel1", 242, 7), (f"{d}/channel03", 242, 3),
                           (f"{d}/channel2", 243, 2)])
    assert got == ImexNodes(242, (0,), (1, 2))
    assert got.device(0) == Device.char(242, 0) and got.device(1) is None and got.device(3) is None
    assert imex_nodes(None, [(f"{d}/channel0", 242, 0)]) == ImexNodes(None, (), (0,))
    assert channel_of("/dev/nvidia-caps-imex-channels/channel12") == 12 and channel_of("x/channel-1") is None
