"""The legacy NVIDIA hook's behaviour as its upstream source has it, one case per row of the table in
docs/hookgrant.md ("Upstream behaviour, row by row"), run against the reconstruction (issue 34 items 1-3).

Each row names the source it was read from (nvidia-container-toolkit at a tag, libnvidia-container at a
commit) and what the hook does; the case builds that input and asserts the devices the reconstruction
says the hook granted (a set of "c M:m"), or UNTRUSTED. Host-file rows (config search, wrapper, version)
go through containers.hookhost on a tree under tmp_path; the rest are pure. No root.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from nvsymlinkd.containers.hookgrant import (
    DriverMap,
    GpuEntry,
    HookInputs,
    HookRequest,
    ToolkitConfig,
    reconstruct,
)
from nvsymlinkd.containers.hookhost import read_hook_inputs
from nvsymlinkd.containers.ocispec import parse_spec
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.imex import ImexNodes
from nvsymlinkd.host.mig import build_map
from nvsymlinkd.host.root import HostRoot
from tests.migfixture import CAPS_MAJOR, IMEX_MAJOR, cap, mig_minor_table

UNTRUSTED = "untrusted"
MIG_A, MIG_B = "MIG-2a3b4c5d-aaaa-5e6f-8a9b-0c1d2e3f4a5b", "MIG-7e8f9a0b-bbbb-5c6d-9e0f-1a2b3c4d5e6f"
MIG_A_CAPS = {cap("gpu0/gi1/access"), cap("gpu0/gi1/ci0/access")}
HOOK_PATH = "/usr/bin/nvidia-container-runtime-hook"
GPUS = (GpuEntry("0000:3b:00.0", 0, "GPU-aaaa-1111"), GpuEntry("0000:5e:00.0", 1, "GPU-bbbb-2222"),
        GpuEntry("0000:86:00.0", 2, "GPU-cccc-3333"))
UVM = (Device.char(509, 0), Device.char(509, 1))
DRIVER = DriverMap(GPUS, True, "", UVM, False, modeset=False)
MIG_DRIVER = replace(DRIVER, mig_instances=True, mig=build_map(mig_minor_table(), {
    (0, 1, None): 12, (0, 1, 0): 13, (0, 2, None): 21, (0, 2, 0): 22}, CAPS_MAJOR),
    mig_uuids=((MIG_A, 0, 1, 0), (MIG_B, 0, 2, 0)), mig_uuids_why="NVML", mig_capable=(0,))
GPU0_SLOTS = {f"c {CAPS_MAJOR}:{m}" for n, m in mig_minor_table().items() if n.startswith("gpu0/")}
CTL, U0, U1, MODESET = "c 195:255", "c 509:0", "c 509:1", "c 195:254"
BASE = {CTL, U0, U1}
REFUSE = "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
LIST_ROOT = "/var/run/nvidia-container-devices"
# an IMEX host: /proc/devices' nvidia-caps-imex-channels major, channel0-2 as c 242:N, channel5 another device
IMEX_DRIVER = replace(DRIVER, imex=ImexNodes(IMEX_MAJOR, (0, 1, 2), (5,)))
IMEX_C0, IMEX_C1, IMEX_C2 = (f"c {IMEX_MAJOR}:{n}" for n in range(3))
IMEX0 = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "0"}
REFUSING_MOUNTS = ToolkitConfig(accept_envvar_unprivileged=False, accept_volume_mounts=True)


def gpus(*minors) -> set:
    return {f"c 195:{m}" for m in minors}


def entry(*args, env=(), path=HOOK_PATH):
    """env: the entry's explicit environment (Docker's --gpus gives one); None: no env (the runtime's own)."""
    return ("prestart", path, ("nvidia-container-runtime-hook", *args), tuple(env) if env is not None else None)


def outcome(g):
    assert g is not None, "no legacy hook found"
    if not g.trusted:
        return UNTRUSTED
    assert all(a == "rw" for a in g.devices.values())
    return {str(d) for d in g.devices}


DEFAULTS = ToolkitConfig()


def pure(env=None, config=DEFAULTS, driver=DRIVER, version=(1, 17, 8), hook=None, mounts=(),
         privileged=False):
    request = HookRequest((hook or entry("prestart"),), dict(env or {}), tuple(mounts), privileged)
    return outcome(reconstruct(request, HookInputs(config, driver, version, "row")))


def elf(version: str | None = None) -> bytes:
    """A stand-in hook binary: ELF magic and, like a real build, the linker flags in its Go build info."""
    info = b"" if version is None else (
        b"\x00build\t-ldflags=\"-s -w -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version="
        + version.encode() + b"\"\n")
    return b"\x7fELF\x02\x01\x01" + b"\x00" * 64 + info


def on_host(tmp: Path, files: dict, hook=None, env=None, privileged=False, driver=DRIVER):
    """The reconstruction for a spec with `hook`, on a host tree holding `files` (inside path -> text/bytes)."""
    for inside, content in files.items():
        p = tmp / inside.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    hook = hook or entry("prestart")
    inputs = read_hook_inputs(HostRoot(str(tmp)), hook, (), driver)
    request = HookRequest((hook,), dict(env or {"NVIDIA_VISIBLE_DEVICES": "0"}), (), privileged)
    return outcome(reconstruct(request, inputs))


def deb(version: str) -> dict:
    return {"/var/lib/dpkg/status": f"Package: nvidia-container-toolkit\nStatus: install ok installed\n"
                                    f"Architecture: amd64\nVersion: {version}\n\n",
            "/var/lib/dpkg/info/nvidia-container-toolkit.list": f"/.\n/usr\n/usr/bin\n{HOOK_PATH}\n",
            HOOK_PATH: elf()}


DRIVER_CFG = "/run/nvidia/driver/etc/nvidia-container-runtime/config.toml"
ETC_CFG = "/etc/nvidia-container-runtime/config.toml"
OPERATOR = "/usr/local/nvidia/toolkit"
OPERATOR_CFG = f"{OPERATOR}/.config/nvidia-container-runtime/config.toml"
WRAPPER_117 = (f"#! /bin/sh\nPATH={OPERATOR}:$PATH \\\n{OPERATOR}/nvidia-container-runtime-hook.real \\\n"
               f"\t-config \"{OPERATOR_CFG}\" \\\n\t\"$@\"\n")
WRAPPER_118 = (f"#! /bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH={OPERATOR_CFG} \\\nPATH={OPERATOR}:$PATH \\\n"
               f"\t{OPERATOR}/nvidia-container-runtime-hook.real \\\n\t\t\"$@\"\n")
OPERATOR_HOOK = entry("prestart", path=f"{OPERATOR}/nvidia-container-runtime-hook")
TK = "nvidia-container-toolkit"
# The installer's Go wrapper (nvidia-container-toolkit a7b4038b): upstream's own C declaration of its config
# section, compiled; the section then holds what WriteWrapperConfigSection writes (a little-endian uint32 length
# on x86-64, json.Marshal's bytes: HTML-escaped `<`, sorted map keys, zeros after), put in with objcopy
GO_WRAPPER_C = ('__attribute__((section(".nvctkiwc")))\nchar wrapper_config[4096] = {0};\n'
                'extern char wrapper_config[4096];\nint main(void) { return wrapper_config[0]; }\n')
GO_WRAPPER_HOOK_JSON = ('{"envm":{"\\u003cPATH":"' + OPERATOR + '","NVIDIA_CTK_CONFIG_FILE_PATH":"' + OPERATOR_CFG
                        + '"},"defaultRuntimeExecutablePath":"runc"}')
_GO_WRAPPERS: dict = {}


def go_wrapper(config: str | bytes, length: int | None = None) -> bytes:
    """An ELF like the installer's Go wrapper whose .nvctkiwc section holds `config` after its length header
    (`length`: another header value)."""
    import shutil
    import struct
    import subprocess
    import tempfile

    from tests.conftest import need_tool

    raw = config.encode() if isinstance(config, str) else config
    key = (raw, length)
    if key not in _GO_WRAPPERS:
        need_tool("gcc")
        need_tool("objcopy")
        with tempfile.TemporaryDirectory(prefix="hook2-gowrapper-") as d:
            src, blank, blob, out = (f"{d}/{n}" for n in ("w.c", "w", "section", "w.out"))
            Path(src).write_text(GO_WRAPPER_C)
            subprocess.run([shutil.which("gcc"), "-O0", "-o", blank, src], check=True, capture_output=True)
            data = struct.pack("<I", len(raw) if length is None else length) + raw
            Path(blob).write_bytes(data + b"\0" * (4096 - len(data)))
            subprocess.run([shutil.which("objcopy"), "--update-section", f".nvctkiwc={blob}", blank, out],
                           check=True, capture_output=True)
            _GO_WRAPPERS[key] = Path(out).read_bytes()
    return _GO_WRAPPERS[key]


def on_go_wrapper(t: Path, config, length=None, hook=None, real=True):
    files = {f"{OPERATOR}/nvidia-container-runtime-hook": go_wrapper(config, length), OPERATOR_CFG: REFUSE}
    if real:
        files[f"{OPERATOR}/nvidia-container-runtime-hook.real"] = elf("1.20.0")
    return on_host(t, files, hook=hook or OPERATOR_HOOK)


GOW = f"{TK} a7b4038b (after v1.20.0) cmd/nvidia-ctk-installer"
LNC = "libnvidia-container"  # by commit: the stored copies name no tag

# id -> (source, what the hook does, case(tmp_path) -> (got, want))
ROWS = {
    # ---- the config file search
    "config-driver-root-first-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/hook_config.go:34",
        "1.13-1.17 read /run/nvidia/driver/etc/nvidia-container-runtime/config.toml before /etc",
        lambda t: (on_host(t, {**deb("1.17.8-1"), DRIVER_CFG: REFUSE, ETC_CFG: ""}), set())),
    "config-etc-when-no-driver-root-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/hook_config.go:34-50",
        "1.13-1.17: no driver-root file -> /etc",
        lambda t: (on_host(t, {**deb("1.17.8-1"), ETC_CFG: REFUSE}), set())),
    "config-1.14.0-driver-root-only": (
        f"{TK} v1.14.0 cmd/nvidia-container-runtime-hook/hook_config.go:45-57, internal/config/toml.go:62",
        "1.14.0 reads the driver-root file only (no WithRequired: missing = defaults): /etc is never read",
        lambda t: (on_host(t, {**deb("1.14.0-1"), ETC_CFG: REFUSE}), BASE | gpus(0))),
    "config-flag-required-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/hook_config.go:30-32,47",
        "-config names the only file read; missing -> the hook fails",
        lambda t: (on_host(t, deb("1.17.8-1"), hook=entry("-config", "/opt/x.toml", "prestart")), UNTRUSTED)),
    "config-flag-read-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/hook_config.go:30-32",
        "-config=FILE wins over the driver-root and /etc files",
        lambda t: (on_host(t, {**deb("1.17.8-1"), "/opt/x.toml": REFUSE},
                           hook=entry("-config=/opt/x.toml", "prestart")), set())),
    "config-1.18-driver-root-not-read": (
        f"{TK} v1.18.0 cmd/nvidia-container-runtime-hook/hook_config.go:39-47",
        "1.18+ no longer read the driver-root file",
        lambda t: (on_host(t, {**deb("1.18.0-1"), DRIVER_CFG: REFUSE}), BASE | gpus(0))),
    "config-1.18-env-path": (
        f"{TK} v1.18.0 cmd/nvidia-container-runtime-hook/hook_config.go:43-45",
        "1.18+: NVIDIA_CTK_CONFIG_FILE_PATH in the hook's env names the file (required)",
        lambda t: (on_host(t, {**deb("1.18.0-1"), "/opt/c.toml": REFUSE},
                           hook=entry("prestart", env=["NVIDIA_CTK_CONFIG_FILE_PATH=/opt/c.toml"])), set())),
    "config-1.17-env-path-ignored": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/hook_config.go:27-51",
        "1.13-1.17 do not read NVIDIA_CTK_CONFIG_FILE_PATH",
        lambda t: (on_host(t, {**deb("1.17.8-1"), "/opt/c.toml": REFUSE},
                           hook=entry("prestart", env=["NVIDIA_CTK_CONFIG_FILE_PATH=/opt/c.toml"])), BASE | gpus(0))),
    "config-1.18-xdg": (
        f"{TK} v1.18.0 internal/config/config.go:78-88",
        "1.18+: $XDG_CONFIG_HOME/nvidia-container-runtime/config.toml instead of /etc",
        lambda t: (on_host(t, {**deb("1.18.0-1"), "/xdg/nvidia-container-runtime/config.toml": REFUSE},
                           hook=entry("prestart", env=["XDG_CONFIG_HOME=/xdg"])), set())),
    "wrapper-1.17-config-flag": (
        f"{TK} v1.17.8 tools/container/toolkit/toolkit.go:584-598, executable.go:93-139",
        "the GPU Operator's <=1.17 wrapper passes -config with its own config.toml",
        lambda t: (on_host(t, {f"{OPERATOR}/nvidia-container-runtime-hook": WRAPPER_117,
                               f"{OPERATOR}/nvidia-container-runtime-hook.real": elf("1.17.8"), OPERATOR_CFG: REFUSE},
                           hook=OPERATOR_HOOK), set())),
    "wrapper-1.18-exports-config-path": (
        f"{TK} v1.18.0 cmd/nvidia-ctk-installer/toolkit/installer/executables.go:70-77,161-174",
        "the 1.18+ wrapper sets NVIDIA_CTK_CONFIG_FILE_PATH to its own config.toml",
        lambda t: (on_host(t, {f"{OPERATOR}/nvidia-container-runtime-hook": WRAPPER_118,
                               f"{OPERATOR}/nvidia-container-runtime-hook.real": elf("1.18.0"), OPERATOR_CFG: REFUSE},
                           hook=OPERATOR_HOOK), set())),
    "env-absent-runtime-env-1.18": (
        f"runc v1.1.5 libcontainer/configs/config.go:381-388; {TK} v1.18.0 internal/modifier/stable.go:66-69, "
        "cmd/nvidia-ctk-installer/toolkit/installer/executables.go:52-58, internal/config/config.go:78-88",
        "no env in the entry (the runtime wrapper's injection): runc runs the hook with its own environment, "
        "where the installer's runtime wrapper exported NVIDIA_CTK_CONFIG_FILE_PATH: the config is not known",
        lambda t: (on_host(t, deb("1.18.0-1"), hook=entry("prestart", env=None)), UNTRUSTED)),
    "env-absent-version-unknown": (
        f"runc v1.1.5 libcontainer/configs/config.go:381-388; {TK} v1.18.0 hook_config.go:39-47",
        "no env and no version: a 1.18+ hook could have read another config",
        lambda t: (on_host(t, {HOOK_PATH: elf()}, hook=entry("prestart", env=None)), UNTRUSTED)),
    "env-absent-1.17-fixed-paths": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/hook_config.go:15-18,27-35 (v1.13.0 :14-22)",
        "1.13-1.17 read -config or fixed paths whatever their environment: no env changes nothing",
        lambda t: (on_host(t, {**deb("1.17.8-1"), ETC_CFG: REFUSE}, hook=entry("prestart", env=None)), set())),
    "env-absent-config-flag-1.18": (
        f"{TK} v1.18.0 cmd/nvidia-container-runtime-hook/hook_config.go:40-42",
        "-config wins over the environment",
        lambda t: (on_host(t, {**deb("1.18.0-1"), "/opt/x.toml": REFUSE},
                           hook=entry("-config=/opt/x.toml", "prestart", env=None)), set())),
    "env-absent-wrapper-exports-1.18": (
        f"{TK} v1.18.0 cmd/nvidia-ctk-installer/toolkit/installer/executables.go:70-77",
        "the installer's hook wrapper sets NVIDIA_CTK_CONFIG_FILE_PATH over the runtime's environment",
        lambda t: (on_host(t, {f"{OPERATOR}/nvidia-container-runtime-hook": WRAPPER_118,
                               f"{OPERATOR}/nvidia-container-runtime-hook.real": elf("1.18.0"), OPERATOR_CFG: REFUSE},
                           hook=entry("prestart", env=None, path=f"{OPERATOR}/nvidia-container-runtime-hook")),
                   set())),
    "env-empty-list-1.18": (
        "runc v1.1.5 libcontainer/configs/config.go:381-388 (a non-nil empty Env)",
        "`env: []` is an empty environment: /etc decides",
        lambda t: (on_host(t, {**deb("1.18.0-1"), ETC_CFG: REFUSE}, hook=entry("prestart", env=[])), set())),
    "env-absent-through-the-spec": (
        f"{TK} v1.18.0 internal/modifier/stable.go:66-69",
        "a config.json hook without `env` (or `env: null`) is the runtime's environment, `[]` an empty one",
        lambda t: ((_from_spec(["NVIDIA_VISIBLE_DEVICES=0"], version=(1, 18, 0), env=None),
                    _from_spec(["NVIDIA_VISIBLE_DEVICES=0"], version=(1, 18, 0), env="null"),
                    _from_spec(["NVIDIA_VISIBLE_DEVICES=0"], version=(1, 18, 0), env=[])),
                   (UNTRUSTED, UNTRUSTED, BASE | gpus(0)))),
    "wrapper-other-shape": (
        f"{TK} v1.18.0 cmd/nvidia-ctk-installer/toolkit/installer/executables.go:161-174",
        "a script of any other shape: what it sets is not known",
        lambda t: (on_host(t, {HOOK_PATH: "#!/bin/sh\nexport NVIDIA_CTK_CONFIG_FILE_PATH=$(cat /x)\nexec /y \"$@\"\n"}),
                   UNTRUSTED)),
    "go-wrapper-exports-config-path": (
        f"{GOW}-wrapper/main.go:20-24,57-66,89-102; {GOW}/toolkit/installer/wrappercore/wrappercore.go:29,35-64, "
        "executables.go:66-74,84-96",
        "the installer's Go wrapper (an ELF, its settings in section .nvctkiwc) sets NVIDIA_CTK_CONFIG_FILE_PATH "
        "for <self>.real: its config refuses the unprivileged env request",
        lambda t: (on_go_wrapper(t, GO_WRAPPER_HOOK_JSON), set())),
    "go-wrapper-over-the-runtime-env": (
        f"{GOW}-wrapper/main.go:89-102 (its entries before os.Environ()); Go syscall/env_unix.go copyenv",
        "no env in the entry: the wrapper's variable comes first, and the hook's getenv takes the first",
        lambda t: (on_go_wrapper(t, GO_WRAPPER_HOOK_JSON, hook=entry("prestart", env=None,
                                                                   path=f"{OPERATOR}/nvidia-container-runtime-hook")),
                   set())),
    "go-wrapper-real-is-the-hook": (
        f"{GOW}-wrapper/main.go:57-66 (os.Executable() + \".real\")",
        "the hook that ran is <wrapper>.real: gone, its version is not known",
        lambda t: (on_go_wrapper(t, GO_WRAPPER_HOOK_JSON, real=False), UNTRUSTED)),
    "go-wrapper-config-from-env": (
        f"{GOW}-wrapper/main.go:93-98",
        "a `<NAME` entry prepends to the inherited value: a config path from the runtime's environment",
        lambda t: (on_go_wrapper(t, '{"envm":{"\\u003cNVIDIA_CTK_CONFIG_FILE_PATH":"/x"}}'), UNTRUSTED)),
    "go-wrapper-undecodable": (
        f"{GOW}/toolkit/installer/wrappercore/wrappercore.go:67-80",
        "a section whose length header or JSON is not the installer's: what it sets is not known",
        lambda t: ((on_go_wrapper(t / "a", "{not json"), on_go_wrapper(t / "b", GO_WRAPPER_HOOK_JSON, length=5000),
                    on_go_wrapper(t / "c", GO_WRAPPER_HOOK_JSON.replace('"envm"', '"Envm"')),
                    on_go_wrapper(t / "d", '{"envm":{"NVIDIA_CTK_CONFIG_FILE_PATH":"/a","NVIDIA_CTK_CONFIG_FILE_PATH":"/b"}}'),
                    on_go_wrapper(t / "e", '{"requiresKernelModule":true,"envm":{}}')),
                   (UNTRUSTED,) * 5)),
    "version-unknown-search-differs": (
        f"{TK} v1.17.8 hook_config.go:34 vs v1.18.0 hook_config.go:39-47",
        "no version and a driver-root file: 1.17 and 1.18 read different files",
        lambda t: (on_host(t, {HOOK_PATH: elf(), DRIVER_CFG: REFUSE}), UNTRUSTED)),
    "version-unknown-search-agrees": (
        f"{TK} v1.17.8 hook_config.go:34, v1.18.0 hook_config.go:39-47",
        "no version, only /etc: every release line reads /etc (1.14.0 its defaults, equal here)",
        lambda t: (on_host(t, {HOOK_PATH: elf(), ETC_CFG: "# site config\n"}), BASE | gpus(0))),
    "version-from-build-info": (
        f"{TK} v1.17.8 Makefile (-X .../internal/info.version), Go buildinfo",
        "the binary's linker flags give the version when no package lists it",
        lambda t: (on_host(t, {HOOK_PATH: elf("1.17.8"), DRIVER_CFG: REFUSE}), set())),
    "version-rc-build-info-unknown": (
        f"{TK} v1.17.8 Makefile (-X .../internal/info.version=$(VERSION)); semver.org item 9",
        "1.18.0-rc.1 is a pre-release, not 1.18.0: no version, and 1.17 and 1.18 read different files",
        lambda t: (on_host(t, {HOOK_PATH: elf("1.18.0-rc.1"), DRIVER_CFG: REFUSE}), UNTRUSTED)),
    "version-rc-dpkg-unknown": (
        "deb-version(7): the revision follows the last hyphen; NVIDIA's pre-releases are X.Y.Z~rc.N-1",
        "1.18.0~rc.1-1 and 1.18.0-rc.1-1 are pre-releases: no version",
        lambda t: ((on_host(t / "tilde", {**deb("1.18.0~rc.1-1"), DRIVER_CFG: REFUSE}),
                    on_host(t / "hyphen", {**deb("1.18.0-rc.1-1"), DRIVER_CFG: REFUSE}),
                    on_host(t / "release", {**deb("1.18.0-1"), DRIVER_CFG: REFUSE})), (UNTRUSTED, UNTRUSTED, BASE | gpus(0)))),
    # ---- the hook's own arguments (Go flag)
    "args-first-positional-is-the-command": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/main.go:176-193",
        "only flag.Args()[0] is the command: `poststart prestart` runs poststart (exit 0, nothing granted)",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, hook=entry("poststart", "prestart")), set())),
    "args-flags-before-the-command": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/main.go:22-26,169",
        "-debug before prestart is a flag",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, hook=entry("-debug", "prestart")), BASE | gpus(0))),
    "args-unknown-flag-exits": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/main.go:169 (flag.ExitOnError)",
        "an undefined flag: the hook exits 2, and runc fails the creation: not this spec",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, hook=entry("-foo", "prestart")), UNTRUSTED)),
    "args-version-exits": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/main.go:171-174",
        "-version prints and returns (exit 0) before the command: nothing granted",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, hook=entry("-version", "prestart")), set())),
    "args-bad-bool-exits": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/main.go:23,169",
        "-debug=maybe is not a Go bool: exit 2, the creation fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, hook=entry("-debug=maybe", "prestart")), UNTRUSTED)),
    "args-double-dash": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/main.go:169",
        "`--` ends the flags; prestart follows",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, hook=entry("--", "prestart")), BASE | gpus(0))),
    # ---- the request
    "env-void-past-1024": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:124-154",
        "NVIDIA_VISIBLE_DEVICES has no length limit: `void` anywhere = not a GPU container",
        lambda t: (_from_spec(["NVIDIA_VISIBLE_DEVICES=" + "0," * 600 + "void"]), set())),
    "env-swarm-unset-falls-back": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:148-158",
        "swarm-resource variables unset: NVIDIA_VISIBLE_DEVICES decides",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "1"}, ToolkitConfig(swarm_resource="DOCKER_RESOURCE_GPU")),
                   BASE | gpus(1))),
    "env-swarm-set-wins": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:151-154",
        "a set swarm-resource variable replaces NVIDIA_VISIBLE_DEVICES",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "1", "DOCKER_RESOURCE_GPU": "2"},
                        ToolkitConfig(swarm_resource="DOCKER_RESOURCE_GPU")), BASE | gpus(2))),
    "mount-paths-go-clean": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:247,253",
        "source and destination through filepath.Clean: //dev/null and //var/run/... count",
        lambda t: (_from_spec(["NVIDIA_VISIBLE_DEVICES=all"], accept_mounts=True,
                              mounts=[{"source": "//dev/null", "destination": "//var/run/nvidia-container-devices/2"}]),
                   BASE | gpus(2))),
    # ---- go-toml / BurntSushi key matching
    "toml-go-toml-upper-case": (
        f"{TK} v1.17.8 vendor/github.com/pelletier/go-toml/marshal.go:789-794",
        "go-toml v1 also tries strings.ToTitle(tag): an upper-case key counts",
        lambda t: (on_host(t, {**deb("1.17.8-1"), ETC_CFG: REFUSE.upper().replace("FALSE", "false")}), set())),
    "toml-go-toml-title-case-ignored": (
        f"{TK} v1.17.8 vendor/github.com/pelletier/go-toml/marshal.go:789-794",
        "go-toml v1 does not fold other spellings: `Accept-...` is an unknown key",
        lambda t: (on_host(t, {**deb("1.17.8-1"), ETC_CFG: "A" + REFUSE[1:]}), BASE | gpus(0))),
    "toml-burntsushi-any-case": (
        f"{TK} v1.13.0 vendor/github.com/BurntSushi/toml/decode.go:267-279",
        "1.13's BurntSushi decoder matches strings.EqualFold",
        lambda t: (on_host(t, {**deb("1.13.5-1"), ETC_CFG: "A" + REFUSE[1:]}), set())),
    "toml-burntsushi-ambiguous": (
        f"{TK} v1.13.0 vendor/github.com/BurntSushi/toml/decode.go:267-279",
        "two spellings with different values: Go's map order decides",
        lambda t: (on_host(t, {**deb("1.13.5-1"),
                               ETC_CFG: REFUSE + "A" + REFUSE[1:].replace("false", "true")}), UNTRUSTED)),
    # ---- capabilities and the nodes nvidia-container-cli grants
    "caps-video-implies-compute": (
        f"{LNC} @65822523 src/options.h:90 (video = OPT_VIDEO_LIBS|OPT_COMPUTE_LIBS), @077f498c src/nvc_mount.c "
        "nvc_driver_mount",
        "video pulls the compute libraries, and with them the uvm nodes",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "video"}), BASE | gpus(0))),
    "caps-uvm-whatever-load-kmods": (
        f"{LNC} @00b4b47e src/nvc_info.c lookup_devices -> find_device_node",
        "uvm nodes that exist are listed and granted; load-kmods only loads modules",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(load_kmods=False)), BASE | gpus(0))),
    "caps-modeset-only-if-node-exists": (
        f"{LNC} @00b4b47e src/nvc_info.c lookup_devices (find_device_node NV_MODESET_DEVICE_PATH)",
        "display without /dev/nvidia-modeset: no modeset grant",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,display"}),
                   BASE | gpus(0))),
    "caps-modeset-with-display": (
        f"{LNC} @077f498c src/nvc_mount.c nvc_driver_mount (OPT_DISPLAY)",
        "display and the node exists: c 195:254",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,display"},
                        driver=DriverMap(GPUS, True, "", UVM, False, modeset=True)), BASE | gpus(0) | {MODESET})),
    "cli-root-differs-from-driver-root": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/main.go:92-94; {LNC} @00b4b47e src/nvc_info.c "
        "lookup_devices -> find_device_node (path_resolve_full(root, ...))",
        "uvm and modeset are granted when they exist under the cli's --root, not under nvsymlinkd's driver_root",
        lambda t: ((pure({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(driver_root="/run/nvidia/driver")),
                    pure({"NVIDIA_VISIBLE_DEVICES": "0"}, driver=replace(DRIVER, nodes_root="/run/nvidia/driver"))),
                   (UNTRUSTED, UNTRUSTED))),
    "cli-root-same-as-driver-root": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/main.go:92-94; {LNC} @00b4b47e src/nvc_info.c lookup_devices",
        "the same root (\"\" is the cli's default /): the nodes nvsymlinkd scanned are the cli's",
        lambda t: ((pure({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(driver_root="/run/nvidia/driver/"),
                         driver=replace(DRIVER, nodes_root="/run/nvidia/driver")),
                    pure({"NVIDIA_VISIBLE_DEVICES": "0"}, ToolkitConfig(driver_root="/"))),
                   (BASE | gpus(0), BASE | gpus(0)))),
    "cli-root-utility-only": (
        f"{LNC} @077f498c src/nvc_mount.c nvc_driver_mount (uvm only with OPT_COMPUTE_LIBS, modeset with OPT_DISPLAY)",
        "utility alone grants no uvm or modeset node: the cli's root does not matter",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility"},
                        ToolkitConfig(driver_root="/run/nvidia/driver")), {CTL} | gpus(0))),
    "gpus-excluded-not-in-all": (
        f"{LNC} @00b4b47e src/nvc_info.c nvc_device_info_new (NVML's device count), src/cli/common.c select_all_gpu_devices",
        "a `GPU Excluded: Yes` GPU is not enumerated: `all` leaves it out",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "all"}, driver=_excluded(1)), BASE | gpus(0, 2))),
    "gpus-excluded-shifts-indexes": (
        f"{LNC} @2e347c19 src/cli/common.c select_gpu_device (available->gpus[n])",
        "indexes count only enumerated GPUs: index 1 is the third GPU",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "1"}, driver=_excluded(1)), BASE | gpus(2))),
    # ---- IMEX channels (issue 35 item 3): the request by toolkit version, the cli's parse, the node's device
    "imex-ignored-before-1.15": (
        f"{TK} v1.14.6 cmd/nvidia-container-runtime-hook/main.go (no --imex-channel), v1.15.0 main.go:129-131",
        "1.13-1.14 pass no IMEX channel",
        lambda t: (pure(IMEX0, driver=IMEX_DRIVER, version=(1, 14, 6)), BASE | gpus(0))),
    "imex-env-grants-the-channel-node-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:200-222, main.go:134-136; {LNC} "
        "@63d366e src/cli/configure.c:433-438, src/nvc_mount.c:1101-1147 nvc_imex_channel_mount",
        "NVIDIA_IMEX_CHANNELS=0: the cli mounts channel0 and grants its node's device, c M:0 (M: the imex channels major)",
        lambda t: (pure(IMEX0, driver=IMEX_DRIVER), BASE | gpus(0) | {IMEX_C0})),
    "imex-ignore-feature-1.17.5": (
        f"{TK} v1.17.5 internal/config/features.go:47, v1.17.8 container_config.go:201-203",
        "ignore-imex-channel-requests drops the request (1.17.5+)",
        lambda t: (pure(IMEX0, ToolkitConfig(ignore_imex_requests=True), driver=IMEX_DRIVER), BASE | gpus(0))),
    "imex-ignore-feature-1.20": (
        f"{TK} v1.20.0 cmd/nvidia-container-runtime-hook/container_config.go:250, api/config/v1/features.go:49, "
        "internal/config/image/cuda_image.go:416-419",
        "1.18+ still drop every IMEX request under the feature (ImexChannelRequests)",
        lambda t: (pure(IMEX0, ToolkitConfig(ignore_imex_requests=True, accept_volume_mounts=True), driver=IMEX_DRIVER,
                        version=(1, 20, 0), mounts=(f"{LIST_ROOT}/imex/1",)), BASE | gpus(0))),
    "imex-ignore-feature-absent-1.17.4": (
        f"{TK} v1.17.4 internal/config/features.go:28-30 (no ignore-imex-channel-requests)",
        "the key does nothing before 1.17.5: the channel is granted",
        lambda t: (pure(IMEX0, ToolkitConfig(ignore_imex_requests=True), driver=IMEX_DRIVER, version=(1, 17, 4)),
                   BASE | gpus(0) | {IMEX_C0})),
    "imex-unprivileged-refused-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:212-221",
        "1.17+: an unprivileged env request for channels follows accept-...-envvar-when-unprivileged (the GPU "
        "came by a mount)",
        lambda t: (pure({"NVIDIA_IMEX_CHANNELS": "0"}, REFUSING_MOUNTS, driver=IMEX_DRIVER, mounts=(f"{LIST_ROOT}/0",)),
                   BASE | gpus(0))),
    "imex-privileged-env-accepted-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:217-219",
        "a privileged container's env request is taken under the same refusing config",
        lambda t: (pure({"NVIDIA_IMEX_CHANNELS": "0"}, REFUSING_MOUNTS, driver=IMEX_DRIVER, mounts=(f"{LIST_ROOT}/0",),
                        privileged=True), BASE | gpus(0) | {IMEX_C0})),
    "imex-raw-value-1.16": (
        f"{TK} v1.16.2 cmd/nvidia-container-runtime-hook/container_config.go:279-285,341-344; {LNC} @63d366e "
        "src/cli/common.c:446-496 parse_imex_info",
        "1.15-1.16 pass any set NVIDIA_IMEX_CHANNELS raw: `none` reaches the cli, which fails on it",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "none"}, driver=IMEX_DRIVER,
                        version=(1, 16, 2)), UNTRUSTED)),
    "imex-raw-list-1.16": (
        f"{TK} v1.16.2 cmd/nvidia-container-runtime-hook/main.go:129-131; {LNC} @63d366e src/cli/common.c:446-496",
        "1.15-1.16: the raw list, strtoumax per item (blanks before, a sign): `+1, 2` is channels 1 and 2",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "+1, 2"}, driver=IMEX_DRIVER,
                        version=(1, 16, 2)), BASE | gpus(0) | {IMEX_C1, IMEX_C2})),
    "imex-raw-unprivileged-1.16": (
        f"{TK} v1.16.2 cmd/nvidia-container-runtime-hook/container_config.go:341-344 (no privilege check)",
        "1.15-1.16 take the env's channels from an unprivileged container even under a refusing config",
        lambda t: (pure({"NVIDIA_IMEX_CHANNELS": "1"}, REFUSING_MOUNTS, driver=IMEX_DRIVER, mounts=(f"{LIST_ROOT}/0",),
                        version=(1, 16, 2)), BASE | gpus(0) | {IMEX_C1})),
    "imex-raw-trailing-blank-fails": (
        f"{LNC} @63d366e src/cli/common.c:478-483 (strtoumax must end the item)",
        "`1 ` leaves a blank after the number: unsupported IMEX channel value, the cli fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1 "}, driver=IMEX_DRIVER,
                        version=(1, 16, 2)), UNTRUSTED)),
    "imex-channel-below-2-20": (
        f"{LNC} @63d366e src/cli/common.c:478-483 (id < 1 << 20)",
        "channel 1048576 does not fit a minor: the cli fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1048576"}, driver=IMEX_DRIVER),
                   UNTRUSTED)),
    "imex-name-fails-1.17": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:294-300; {LNC} @63d366e src/cli/common.c:478-483",
        "1.17+ pass items raw to the cli (only all/none/void are words): `channel0` fails it",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "channel0"}, driver=IMEX_DRIVER),
                   UNTRUSTED)),
    "imex-none-no-request-1.17": (
        f"{TK} v1.17.8 internal/config/image/devices.go:36-50,67-69",
        "1.17+: `none` lists one empty channel, joined to nothing: no --imex-channel",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "0,none"}, driver=IMEX_DRIVER),
                   BASE | gpus(0))),
    "imex-all-alone-no-request-1.17": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:294-300",
        "NVIDIA_IMEX_CHANNELS=all alone is no request",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "all"}, driver=IMEX_DRIVER),
                   BASE | gpus(0))),
    "imex-legacy-image-no-request-1.17": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:143-146 (unset with a legacy image: all), :294-300",
        "a legacy CUDA image without NVIDIA_IMEX_CHANNELS lists `all`, which alone is no request",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_VERSION": "11.0"}, driver=IMEX_DRIVER),
                   BASE | gpus(0))),
    "imex-env-1.18": (
        f"{TK} v1.18.0 internal/config/image/cuda_image.go:416-448 ImexChannelRequests, "
        "cmd/nvidia-container-runtime-hook/container_config.go:213",
        "1.18+ keep the 1.17 rules: NVIDIA_IMEX_CHANNELS=1 grants channel1's node",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1"}, driver=IMEX_DRIVER,
                        version=(1, 18, 0)), BASE | gpus(0) | {IMEX_C1})),
    "imex-void-no-request-1.17": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:124-154 (DevicesFromEnvvars: void anywhere)",
        "`0,void` is no request",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "0,void"}, driver=IMEX_DRIVER),
                   BASE | gpus(0))),
    "imex-repeat-once-1.17": (
        f"{TK} v1.17.8 internal/config/image/devices.go:90-116 (a repeated item leaves an empty one); {LNC} "
        "@63d366e src/cli/common.c:473-475 (empty items skipped)",
        "`0,0` is channel 0 once",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "0,0"}, driver=IMEX_DRIVER),
                   BASE | gpus(0) | {IMEX_C0})),
    "imex-mounts-win-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:205-211, "
        "internal/config/image/cuda_image.go:303-311",
        "accepted imex/N mounts win over the env: imex/1 mounted, NVIDIA_IMEX_CHANNELS=0 ignored",
        lambda t: (pure(IMEX0, ToolkitConfig(accept_volume_mounts=True), driver=IMEX_DRIVER,
                        mounts=(f"{LIST_ROOT}/imex/1",)), BASE | gpus(0) | {IMEX_C1})),
    "imex-mounts-need-no-privilege-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:205-211",
        "mounts are taken from an unprivileged container under a refusing config",
        lambda t: (pure({}, REFUSING_MOUNTS, driver=IMEX_DRIVER, mounts=(f"{LIST_ROOT}/0", f"{LIST_ROOT}/imex/2")),
                   BASE | gpus(0) | {IMEX_C2})),
    "imex-mounts-not-accepted-1.17": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:205-211",
        "without accept-nvidia-visible-devices-as-volume-mounts an imex/N mount is nothing: the env decides",
        lambda t: (pure(IMEX0, driver=IMEX_DRIVER, mounts=(f"{LIST_ROOT}/imex/1",)), BASE | gpus(0) | {IMEX_C0})),
    "imex-without-compute-1.17": (
        f"{LNC} @63d366e src/cli/configure.c:433-438 (every channel, whatever the capabilities)",
        "utility alone still mounts and grants the channel (and no uvm)",
        lambda t: (pure({**IMEX0, "NVIDIA_DRIVER_CAPABILITIES": "utility"}, driver=IMEX_DRIVER),
                   {CTL, IMEX_C0} | gpus(0))),
    "imex-no-cgroups": (
        f"{LNC} @63d366e src/nvc_mount.c:1131-1134 (setup_device_cgroup only without --no-cgroups)",
        "no-cgroups: the channel is mounted, no device access written",
        lambda t: (pure(IMEX0, ToolkitConfig(no_cgroups=True), driver=IMEX_DRIVER), set())),
    "imex-node-absent": (
        f"{LNC} @63d366e src/nvc_info.c:313-329 find_device_node, src/nvc.c:294-299 (mknod only with --load-kmods)",
        "channel 3 has no node under the root now: what the cli statted then is not known",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "3"}, driver=IMEX_DRIVER), UNTRUSTED)),
    "imex-node-another-device": (
        f"{LNC} @63d366e src/nvc_info.c:313-329 (st_rdev of the node); nvidia-modprobe 550.54.14 "
        "modprobe-utils/nvidia-modprobe-utils.c:1072-1099",
        "channel5's node is not c M:5: the cli grants whatever it statted, not knowable now",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "5"}, driver=IMEX_DRIVER), UNTRUSTED)),
    "imex-no-major": (
        "nvidia-modprobe 550.54.14 modprobe-utils/nvidia-modprobe-utils.c:1077-1081 (no major: no node made)",
        "/proc/devices lists no nvidia-caps-imex-channels: not trusted",
        lambda t: (pure(IMEX0, driver=replace(IMEX_DRIVER, imex=ImexNodes(None, (), (0,)))), UNTRUSTED)),
    "imex-cli-root-differs": (
        f"{LNC} @63d366e src/nvc_mount.c:1120-1123 (find_device_node(ctx->cfg.root, ...)); {TK} v1.17.8 "
        "cmd/nvidia-container-runtime-hook/main.go:92-94",
        "the cli looks for the channel node under its --root: another root than nvsymlinkd's is not trusted",
        lambda t: (pure({**IMEX0, "NVIDIA_DRIVER_CAPABILITIES": "utility"}, ToolkitConfig(driver_root="/run/nvidia/driver"),
                        driver=IMEX_DRIVER), UNTRUSTED)),
    "imex-version-unknown": (
        f"{TK} v1.14.6 main.go (no --imex-channel), v1.17.8 container_config.go:200-222",
        "no version: 1.14 ignores NVIDIA_IMEX_CHANNELS, 1.15+ pass it: not knowable",
        lambda t: (pure(IMEX0, driver=IMEX_DRIVER, version=None), UNTRUSTED)),
    # ---- what nvidia-container-cli selects (the untrusted-but-knowable cases)
    "select-pci-function-1": (
        f"{LNC} @2e347c19 src/cli/common.c matches_pci_format (sscanf \"%x:%02x:%02x.0\" == 3)",
        "only three conversions are counted: 0000:5e:00.1 selects 0000:5e:00.0",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0000:5e:00.1"}), BASE | gpus(1))),
    "select-ALL-case-insensitive": (
        f"{LNC} @2e347c19 src/cli/common.c select_devices (str_case_equal(dev, \"all\")); {TK} v1.17.8 "
        "internal/config/image/devices.go:36-50",
        "the hook's own `all` test is exact, so ALL reaches the cli raw, which selects every GPU",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "ALL"}), BASE | gpus(0, 1, 2))),
    "select-all-stops": (
        f"{LNC} @2e347c19 src/cli/common.c select_devices (break after `all`)",
        "items after a case-insensitive all are never looked at",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0,All,bogus"}), BASE | gpus(0, 1, 2))),
    "select-index-sign": (
        f"{LNC} @2e347c19 src/cli/common.c select_gpu_device (strtoumax)",
        "strtoumax takes a sign: +1 is index 1",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "+1"}), BASE | gpus(1))),
    "select-index-minus-one": (
        f"{LNC} @2e347c19 src/cli/common.c select_gpu_device (n < UINTMAX_MAX)",
        "-1 wraps to UINTMAX_MAX: no GPU, unknown device, the hook fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "-1"}), UNTRUSTED)),
    "mode-cdi-no-device-1.14": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/main.go:78-87",
        "1.14+: a container with no device returns before the mode check",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "void"}, ToolkitConfig(mode="cdi")), set())),
    "mode-cdi-1.13-fails-first": (
        f"{TK} v1.13.0 cmd/nvidia-container-runtime-hook/main.go:74-86",
        "1.13 checks the mode first: every container fails under mode cdi",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "void"}, ToolkitConfig(mode="cdi"), version=(1, 13, 5)), UNTRUSTED)),
    # ---- MIG devices (issue 35): the H100 of tests/migfixture.py, GPU 0 with gi1/ci0 and gi2/ci0
    "mig-uuid-grants-parent-and-instance-caps": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_device (a full MIG UUID; add_gpu_device of its parent), "
        "@ef9042ca src/nvc_mount.c nvc_mig_device_access_caps_mount -> cap_device_mount",
        "a MIG UUID: its parent GPU, its GPU instance's and its compute instance's access capabilities",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A}, driver=MIG_DRIVER), BASE | gpus(0) | MIG_A_CAPS)),
    "mig-uuid-case-insensitive": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_device (strncasecmp \"MIG-\", strcasecmp, equal lengths)",
        "the UUID is compared without case",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A.lower()}, driver=MIG_DRIVER), BASE | gpus(0) | MIG_A_CAPS)),
    "mig-uuid-ascii-case-only": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_device (strcasecmp: ASCII letters only)",
        "a UUID with a KELVIN SIGN where NVML's has `k` matches nothing: the hook fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "MIG-\u212a"}, driver=replace(MIG_DRIVER, mig_uuids=(
            ("MIG-k", 0, 1, 0),))), UNTRUSTED)),
    "mig-uuid-needs-nvml": (
        f"{LNC} @00b4b47e src/nvc_info.c (MIG UUIDs from NVML)",
        "a MIG UUID is NVML's: without it the instance it named is not known",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A},
                        driver=replace(MIG_DRIVER, mig_uuids=None, mig_uuids_why="pynvml cannot be imported")),
                   UNTRUSTED)),
    "mig-uuid-of-a-destroyed-instance": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_device (UUID match); open-gpu-kernel-modules 595.45.04 "
        "kernel-open/nvidia/nv-caps.c:114-148 (a slot's minor is fixed)",
        "gi1 destroyed and made again (same ids, same minors, a new UUID): the old UUID names no instance now",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A}, driver=replace(MIG_DRIVER, mig_uuids=(
            ("MIG-new-0001", 0, 1, 0), MIG_DRIVER.mig_uuids[1]))), UNTRUSTED)),
    "mig-uuid-not-in-the-drivers-map": (
        "open-gpu-kernel-modules 595.45.04 src/nvidia/arch/nvalloc/unix/src/os.c:4776-4791,4861-4876",
        "NVML names an instance whose access files --root does not show: not the host read",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A}, driver=replace(MIG_DRIVER, mig_uuids=(
            (MIG_A, 0, 5, 0),))), UNTRUSTED)),
    "mig-uuid-parent-excluded": (
        f"{LNC} @00b4b47e src/nvc_info.c nvc_device_info_new (NVML enumerates no excluded GPU, nor its MIG devices)",
        "a MIG device of an excluded GPU is not selectable",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A}, driver=replace(MIG_DRIVER, gpus=_excluded(0).gpus)),
                   UNTRUSTED)),
    "mig-index-order-unknowable": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_device (sscanf \"%lu:%lu\", gpus[i].mig_devices[j])",
        "`0:0` is the j-th MIG device in NVML's order at the hook's run: neither shown by /proc nor fixed",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0:0"}, driver=MIG_DRIVER), UNTRUSTED)),
    "mig-volume-mount-strategy": (
        f"{TK} v1.17.8 internal/config/image/cuda_image.go:247,253 (DevicesFromMounts); {LNC} @1aea9873 "
        "src/cli/common.c select_mig_device",
        "the device plugin's volume-mount strategy: /var/run/nvidia-container-devices/MIG-<uuid> is the same request",
        lambda t: (outcome(reconstruct(HookRequest((entry("prestart"),), {"NVIDIA_VISIBLE_DEVICES": "void"},
                                                   (f"/var/run/nvidia-container-devices/{MIG_A}",)),
                                       HookInputs(ToolkitConfig(accept_volume_mounts=True), MIG_DRIVER, (1, 17, 8),
                                                  "row"))), BASE | gpus(0) | MIG_A_CAPS)),
    "mig-config-unprivileged-fails": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/container_config.go:260-266",
        "NVIDIA_MIG_CONFIG_DEVICES in an unprivileged container: the hook panics, the creation fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"}, driver=MIG_DRIVER),
                   UNTRUSTED)),
    "mig-config-only-all": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_config_devices (\"only 'all' devices are currently supported\")",
        "any item before a case-insensitive `all` fails the cli",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_CONFIG_DEVICES": "0"}, driver=MIG_DRIVER,
                        privileged=True), UNTRUSTED)),
    "mig-monitor-with-a-mig-device-fails": (
        f"{LNC} @1aea9873 src/cli/common.c select_mig_monitor_devices (\"cannot enable mig-monitor with specific "
        "MIG devices selected\")",
        "mig-monitor `all` with MIG devices selected and not all: the cli fails",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": MIG_A, "NVIDIA_MIG_MONITOR_DEVICES": "all"}, driver=MIG_DRIVER,
                        privileged=True), UNTRUSTED)),
    "mig-config-all-grants-the-gpus-slots": (
        f"{LNC} @ef9042ca src/nvc_mount.c nvc_mig_config_global_caps_mount, nvc_device_mig_caps_mount -> "
        "setup_mig_minor_cgroups; src/cli/configure.c configure_command (as @042e7f85 src/cli/list.c: access caps "
        "only without config/monitor all); src/driver.c driver_get_device_mig_capable",
        "privileged `all` + mig-config `all`: every GPU, the config cap and every mig-minors slot of each "
        "MIG-capable GPU (no per-instance access caps)",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "ALL"}, driver=MIG_DRIVER,
                        privileged=True), BASE | gpus(0, 1, 2) | {f"c {CAPS_MAJOR}:1"} | GPU0_SLOTS)),
    "mig-monitor-empty-is-no-request": (
        f"{TK} v1.17.8 cmd/nvidia-container-runtime-hook/main.go:131-133 (len(MigMonitorDevices) > 0)",
        "an empty NVIDIA_MIG_MONITOR_DEVICES passes no --mig-monitor",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_MIG_MONITOR_DEVICES": ""}, driver=MIG_DRIVER),
                   BASE | gpus(1))),
    "mig-all-adds-every-mig-device": (
        f"{LNC} @1aea9873 src/cli/common.c select_all_devices (select_all_mig_devices)",
        "`all` on a MIG host also grants every MIG device's capabilities of the hook's time",
        lambda t: (pure({"NVIDIA_VISIBLE_DEVICES": "all"}, driver=MIG_DRIVER), UNTRUSTED)),
}


def _excluded(index: int) -> DriverMap:
    gs = tuple(GpuEntry(g.pci, g.minor, g.uuid, i == index) for i, g in enumerate(GPUS))
    return DriverMap(gs, True, "", UVM, False)


def _from_spec(process_env: list, accept_mounts: bool = False, mounts=(), version=(1, 17, 8), **hook_env):
    """Through containers.ocispec.parse_spec, as the verifier reads a config.json; hook_env: env=None for a
    hook without `env`, "null" for `env: null`, a list for that env."""
    hook = {"path": HOOK_PATH, "args": ["nvidia-container-runtime-hook", "prestart"]}
    if hook_env.get("env") is not None:
        hook["env"] = None if hook_env["env"] == "null" else hook_env["env"]
    doc = {"process": {"env": process_env}, "mounts": list(mounts), "hooks": {"prestart": [hook]}}
    spec = parse_spec(doc)
    request = HookRequest(spec.hook_entries, spec.env, spec.device_list_mounts, spec.privileged)
    config = ToolkitConfig(accept_volume_mounts=accept_mounts)
    return outcome(reconstruct(request, HookInputs(config, DRIVER, version, "row")))


@pytest.mark.parametrize("row", sorted(ROWS))
def test_upstream_row(row, tmp_path):
    _, _, case = ROWS[row]
    got, want = case(tmp_path)
    assert got == want, f"{row}: {ROWS[row][1]}: {ROWS[row][0]}"


def test_every_row_is_in_the_docs_table():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "hookgrant.md").read_text()
    ids = set(re.findall(r"^\| `([A-Za-z0-9.-]+)` \|", doc, re.M))
    assert ids == set(ROWS), (sorted(set(ROWS) - ids), sorted(ids - set(ROWS)))
