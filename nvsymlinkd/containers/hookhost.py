"""The host facts the NVIDIA hook's grant is reconstructed from (containers.hookgrant decides; this reads).

- the hook executable the spec names: a toolkit installer's wrapper script (its variables and -config), its
  Go wrapper (an ELF with a .nvctkiwc section, nvidia-container-toolkit a7b4038b: the same, decoded from that
  section) or the hook binary itself;
- the toolkit's version, without running anything: dpkg's status for the package that lists the binary,
  else the rpm database's header of the package that lists it (host.rpmdb: rpm >= 4.16's rpmdb.sqlite, older rpm's Berkeley DB Packages), else
  the version the Go linker wrote into the binary (`-X .../internal/info.version=X.Y.Z` in its
  build info);
- the config.toml the hook of that version reads (hookgrant.config_search: -config, the hook's env and
  the wrapper's, /run/nvidia/driver/etc/..., $XDG_CONFIG_HOME, /etc/...; absent: its defaults), as the
  host sees it (host.hostview: the daemon's own /tmp, /home and /root are not the hook's);
- /proc/driver/nvidia/gpus/<pci>/information (`Device Minor`, `GPU UUID`, `GPU Excluded`);
- the MIG map (host.driverinfo.read_mig_map: capabilities/gpu*/mig/gi*/ci*/access, mig-minors, the
  `nvidia-caps` major) and, on a host with MIG instances, NVML's MIG UUIDs through pynvml when it is
  importable and works (else none: a MIG UUID request is then not trusted, with that reason);
- the host's nvidia-uvm / nvidia-uvm-tools / nvidia-modeset nodes and IMEX channel nodes (from the pass's node
  scan; the channels with the `nvidia-caps-imex-channels` major of /proc/devices) and the root that scan
  searched (driver_root: the cli finds them under its own --root).

All read under --root, confined (HostRoot).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import replace

from nvsymlinkd.containers.hookgrant import (
    ETC_CONFIG,
    GO_WRAPPER_SECTION,
    VERSION_LINES,
    DriverMap,
    GpuEntry,
    HookEntry,
    HookInputs,
    ToolkitConfig,
    Version,
    Wrapper,
    config_search,
    invocation,
    parse_go_wrapper,
    parse_toolkit_config,
    parse_wrapper,
    toml_dialect,
    unreadable_config,
)
from nvsymlinkd.errors import HostFileError, NvmlError, NvsymlinkdError
from nvsymlinkd.host import rpmdb
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.driverinfo import CAPABILITIES_DIR, GPUS_DIR, parse_key_values, read_mig_map
from nvsymlinkd.host.elf import SHT_PROGBITS, read_section
from nvsymlinkd.host.hostview import host_view
from nvsymlinkd.host.imex import imex_nodes
from nvsymlinkd.host.mig import MigMap
from nvsymlinkd.host.paths import normalize
from nvsymlinkd.host.procdevices import IMEX_CHANNELS, PROC_DEVICES, parse_proc_devices
from nvsymlinkd.host.root import HostRoot, read_at_most

TOOLKIT_CONFIG = ETC_CONFIG
MAX_CONFIG_BYTES = 1 << 20
MAX_SCRIPT_BYTES = 64 << 10
MAX_BINARY_BYTES = 256 << 20  # the hook binary is a few MiB; its build info sits near the start
DPKG_STATUS = "/var/lib/dpkg/status"
DPKG_INFO = "/var/lib/dpkg/info"
# the packages that ship the hook (nvidia-container-toolkit) and nvidia-ctk (-base), in every release line
TOOLKIT_PACKAGES = ("nvidia-container-toolkit", "nvidia-container-toolkit-base")
# the Makefile's ldflags: -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=$(VERSION);
# Go >= 1.18 keeps them in the binary's build info (`build -ldflags=...`)
_LDFLAGS_VERSION = re.compile(rb"nvidia-container-toolkit/internal/info\.version=v?(\d{1,3})\.(\d{1,3})\.(\d{1,3})"
                              rb"([~+.-][0-9A-Za-z.~+-]*)?")
_MOD_VERSION = re.compile(rb"\tgithub\.com/NVIDIA/nvidia-container-toolkit\tv(\d{1,3})\.(\d{1,3})\.(\d{1,3})([-+]\S*)?\t")
# [epoch:]upstream[-revision]: the revision follows the last hyphen (deb-version(7)); only an upstream X.Y.Z (or
# X.Y.Z+build) is the release, a pre-release is X.Y.Z~rc.N (NVIDIA's packages) or X.Y.Z-rc.N
_RPM_VERSION = re.compile(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})")
_DEB_VERSION = re.compile(r"(?:\d+:)?(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?:\+[0-9A-Za-z.+]+)?(?:-[0-9A-Za-z.+~]+)?")


def read_toolkit_config(root: HostRoot, path: str = TOOLKIT_CONFIG, dialect: str | None = "go-toml") -> ToolkitConfig:
    """One config file: absent -> the defaults (path ""), else its fields (hookgrant.parse_toolkit_config)."""
    got = _read_config_file(root, path, dialect)
    return ToolkitConfig() if got is None else got


def _read_config_file(root: HostRoot, path: str, dialect: str | None) -> ToolkitConfig | None:
    try:
        text = root.read_confined(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return unreadable_config(f"{path}: {exc.strerror or exc}")
    if len(text) > MAX_CONFIG_BYTES:
        return unreadable_config(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    from nvsymlinkd.config import toml_module

    tomllib = toml_module()
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError) as exc:
        return unreadable_config(f"{path}: invalid TOML: {str(exc)[:120]}")
    config = parse_toolkit_config(doc, dialect)
    if not config.readable:
        return unreadable_config(f"{path}: {config.why}")
    return replace(config, path=path, digest=hashlib.sha256(text.encode("utf-8", "replace")).hexdigest())


def _searched_config(root: HostRoot, search, dialect: str | None, memo: dict) -> ToolkitConfig:
    if search.why:
        return unreadable_config(search.why)
    for path in search.paths:
        key = (path, dialect)
        if key not in memo:
            memo[key] = _read_config_file(root, path, dialect)
        got = memo[key]
        if got is not None:
            return got
        if search.required:
            return unreadable_config(f"{path} does not exist: the hook fails without the config it is pointed at, "
                                     "so this container was not made under it")
    return ToolkitConfig()  # config.GetDefault()


def read_hook_inputs(root: HostRoot, entry: HookEntry, host_nodes, driver: DriverMap | None = None,
                     memo: dict | None = None, nodes_root: str = "/") -> HookInputs:
    """What the hook of this spec entry read: its wrapper, the toolkit's version, the config it found
    (for an unknown version: the same config under every release line's search, else not readable)."""
    memo = {} if memo is None else memo
    driver = driver if driver is not None else read_driver_map(root, host_nodes, nodes_root)
    path = entry[1]
    try:
        wrapper, binary = read_hook_executable(root, path)
        wrapper_why = ""
    except HookUntrusted as exc:  # the boundary: the reason is kept with the inputs
        wrapper, binary, wrapper_why = None, "", str(exc)
    version: Version | None = None
    version_why = wrapper_why or "no binary"
    if binary:
        try:
            version, version_why = read_toolkit_version(root, binary)
        except VersionUnknown as exc:  # the boundary: the reason is kept with the inputs
            version_why = str(exc)
    inv = invocation(entry, wrapper)
    if not inv.knowable or inv.command is None or wrapper_why:
        return HookInputs(ToolkitConfig(), driver, version, version_why, wrapper, wrapper_why)
    # the hook runs in the host's mount namespace: a config its env points under /tmp, /home or /root (XDG_CONFIG_HOME,
    # NVIDIA_CTK_CONFIG_FILE_PATH) is read as the host sees it, not through the daemon's PrivateTmp/ProtectHome
    view = host_view(root)
    if version is not None:
        config = _searched_config(view, config_search(inv, version), toml_dialect(version), memo)
    else:
        configs = {line: _searched_config(view, config_search(inv, line), toml_dialect(line), memo)
                   for line in VERSION_LINES}
        first = configs[VERSION_LINES[0]]
        if all(_same_fields(c, first) for c in configs.values()):
            config = first
        else:
            shown = ", ".join(f"{'.'.join(map(str, v))}: {c.path or 'defaults'}" for v, c in configs.items())
            config = unreadable_config(f"the toolkit's version is unknown ({version_why}) and the config its hook "
                                       f"reads depends on it ({shown})")
    return HookInputs(config, driver, version, version_why, wrapper, "")


def _same_fields(a: ToolkitConfig, b: ToolkitConfig) -> bool:
    """The same decision inputs, whichever file (or none) they came from."""
    return replace(a, path="", present=False, digest="") == replace(b, path="", present=False, digest="")


class HookUntrusted(NvsymlinkdError):
    """What the hook's path runs cannot be known (not there, unreadable, or a wrapper not read exactly): the
    message says why; read_hook_inputs keeps it as the inputs' wrapper_why (the hook's grant is not trusted)."""


def read_hook_executable(root: HostRoot, path: str) -> tuple[Wrapper | None, str]:
    """(wrapper or None, the binary the version is read from) for the hook's path; HookUntrusted says why
    what the hook ran cannot be known."""
    try:
        fd = root.open_file(path)
    except FileNotFoundError as exc:
        raise HookUntrusted("does not exist on this host: what it was when it ran is not known") from exc
    except OSError as exc:
        raise HookUntrusted(f"cannot be read: {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HookUntrusted("is not a regular file")
        head = os.read(fd, MAX_SCRIPT_BYTES + 1)
    except OSError as exc:
        raise HookUntrusted(f"cannot be read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if head.startswith(b"\x7fELF"):
        return _elf_executable(root, path)
    if not head.startswith(b"#!") or len(head) > MAX_SCRIPT_BYTES:
        raise HookUntrusted("is neither an ELF binary nor the toolkit installer's wrapper")
    got = parse_wrapper(head.decode("utf-8", errors="replace"))
    if isinstance(got, str):
        raise HookUntrusted(got)
    return got, got.target


def _elf_executable(root: HostRoot, path: str) -> tuple[Wrapper | None, str]:
    """An ELF hook path: the hook binary itself, or the installer's Go wrapper around it (hookgrant.parse_go_wrapper:
    a .nvctkiwc section), whose .real binary is the hook; a wrapper, or a section table, that cannot be read
    exactly is not trusted (the wrapper may point the hook at any config)."""
    try:
        fd = root.open_file(path)
    except OSError as exc:
        raise HookUntrusted(f"cannot be read: {exc.strerror or exc}") from exc
    try:
        section = read_section(fd, GO_WRAPPER_SECTION)
    except (OSError, ValueError) as exc:
        raise HookUntrusted(f"is an ELF file whose sections cannot be read ({str(exc)[:80]}): it may be the "
                            "installer's Go wrapper") from exc
    finally:
        os.close(fd)
    if section is None:
        return None, path
    resolved = root.resolve(path)
    if resolved is None:
        raise HookUntrusted("is the installer's Go wrapper and its own path cannot be resolved")
    if section.sh_type != SHT_PROGBITS:
        raise HookUntrusted(f"is the installer's Go wrapper whose {GO_WRAPPER_SECTION} section holds no bytes")
    got = parse_go_wrapper(section.data, section.little, resolved)
    if isinstance(got, str):
        raise HookUntrusted(f"is the installer's Go wrapper (nvidia-container-toolkit a7b4038b) and {got}")
    return got, got.target


class VersionUnknown(NvsymlinkdError):
    """The toolkit's version cannot be told from the host's files; the message names the file and why
    (read_hook_inputs keeps it as the version's reason: the config is then looked for under every
    release line)."""


# read_toolkit_version's answers, by the files it read as they stood (root, path, dev, ino, size, mtime): the
# daemon asks every pass, and the binary is megabytes
_VERSIONS: dict = {}


def _stamp(root: HostRoot, inside: str) -> tuple | None:
    st = root.stat_resolved(inside)
    return None if st is None else (inside, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_toolkit_version(root: HostRoot, binary: str) -> tuple[Version, str]:
    """(version, where it came from), never by running the binary; VersionUnknown says why it cannot be
    told. Kept while the binary, dpkg's status and the packages' file lists are unchanged."""
    key = (root.root, _stamp(root, binary), _stamp(root, DPKG_STATUS),
           *(_stamp(root, f"{DPKG_INFO}/{p}.list") for p in TOOLKIT_PACKAGES),
           *(_stamp(root, p) for p in (rpmdb.RPMDB_SQLITE, rpmdb.RPMDB_SQLITE + "-wal", rpmdb.RPMDB_BDB,
                                       rpmdb.RPMDB_NDB)))
    if key[1] is None:
        return _read_toolkit_version(root, binary)
    if key not in _VERSIONS:
        if len(_VERSIONS) >= 16:
            _VERSIONS.clear()
        try:
            _VERSIONS[key] = _read_toolkit_version(root, binary)
        except VersionUnknown as exc:
            _VERSIONS[key] = str(exc)  # the message, not the exception: raised anew, no traceback kept per pass
    found = _VERSIONS[key]
    if isinstance(found, str):
        raise VersionUnknown(found)
    return found


def _read_toolkit_version(root: HostRoot, binary: str) -> tuple[Version, str]:
    for package in TOOLKIT_PACKAGES:
        try:
            listed = root.read_confined(f"{DPKG_INFO}/{package}.list").split("\n")
        except OSError:
            continue
        if binary in listed:
            return _dpkg_version(root, package)
    try:
        owned, where = rpmdb.owners(root, binary, TOOLKIT_PACKAGES)
        rpm_why = ""
    except rpmdb.RpmdbError as exc:  # the database cannot say: the binary's build info may, and this is said with it
        owned, rpm_why = [], f"; {exc}"
    if owned:
        return _rpm_version(owned, where)
    try:
        fd = root.open_file(binary)
    except OSError as exc:
        raise VersionUnknown(f"{binary}: {exc.strerror or exc}") from exc
    try:
        data = read_at_most(fd, binary, MAX_BINARY_BYTES)
    except OSError as exc:
        raise VersionUnknown(f"{binary}: {exc}") from exc
    finally:
        os.close(fd)
    # semver: X.Y.Z+build is the release, X.Y.Z-rc.1 (any `-` suffix) a pre-release of it, like dpkg's ~rc.1
    found = {m.group(1, 2, 3) for m in _LDFLAGS_VERSION.finditer(data) if not m.group(4) or m.group(4)[:1] == b"+"}
    found |= {m.group(1, 2, 3) for m in _MOD_VERSION.finditer(data) if not m.group(4)}
    odd = any(m.group(4) and m.group(4)[:1] in b"~.-" for m in _LDFLAGS_VERSION.finditer(data))
    if len(found) == 1 and not odd:
        major, minor, patch = (int(x) for x in found.pop())
        return (major, minor, patch), f"{binary}: its build info"
    if len(found) > 1:
        raise VersionUnknown(f"{binary}: its build info names several versions")
    raise VersionUnknown(f"{binary}: no dpkg or rpm package lists it{rpm_why}; its build info names no release version")


def _rpm_version(owned: list, where: str) -> tuple[Version, str]:
    """The version of the rpm packages listing the binary: VERSION is X.Y.Z for a release (NVIDIA's pre-releases
    are X.Y.Z~rc.N, a snapshot X.Y.Z^...); two headers listing it (an upgrade's old and new, or both toolkit
    packages) must agree."""
    shown = ", ".join(f"{n} {v}-{r}" for n, v, r in owned)
    versions = {v for _, v, _ in owned}
    if len(versions) != 1:
        raise VersionUnknown(f"{where}: several installed packages list it ({shown[:120]})")
    m = _RPM_VERSION.fullmatch(versions.pop())
    if m is None:
        raise VersionUnknown(f"{where}: {shown[:120]} is not a release version")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))), f"{where}: {shown[:120]}"


def _dpkg_version(root: HostRoot, package: str) -> tuple[Version, str]:
    try:
        text = root.read_confined(DPKG_STATUS)
    except OSError as exc:
        raise VersionUnknown(f"{DPKG_STATUS}: {exc.strerror or exc}") from exc
    for stanza in text.split("\n\n"):
        fields = parse_key_values(stanza)
        if fields.get("Package") != package or fields.get("Status") != "install ok installed":
            continue
        raw = fields.get("Version", "")
        m = _DEB_VERSION.fullmatch(raw)
        if m is None:  # a pre-release (1.17.0~rc.1, 1.17.0-rc.1-1) is not the release it precedes
            raise VersionUnknown(f"{DPKG_STATUS}: {package} version {raw[:40]!r} is not a release version")
        return (int(m.group(1)), int(m.group(2)), int(m.group(3))), f"{DPKG_STATUS}: {package} {raw}"
    raise VersionUnknown(f"{DPKG_STATUS}: {package} is not installed")


def _list(root: HostRoot, inside: str) -> list | None:
    try:
        fd = root.open_dir(inside)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    try:
        return sorted(os.listdir(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def read_driver_map(root: HostRoot, host_nodes, nodes_root: str = "/") -> DriverMap:
    """host_nodes: the pass's NvidiaNode list (for the uvm and modeset nodes), scanned under nodes_root (the
    daemon's driver_root)."""
    uvm = tuple(sorted(Device.char(n.major, n.minor) for n in host_nodes if n.kind in ("uvm", "uvm-tools")))
    modeset = any(n.kind == "modeset" for n in host_nodes)
    channels = [(n.path, n.major, n.minor) for n in host_nodes if n.kind == "imex-channel"]
    return replace(_read_driver_map(root, uvm, modeset), nodes_root=normalize(nodes_root),
                   imex=imex_nodes(_imex_major(root), channels))


def _imex_major(root: HostRoot) -> int | None:
    """The one `nvidia-caps-imex-channels` major of /proc/devices (exact name), None when absent, listed with
    several majors, or unreadable: nvidia-modprobe makes channel nodes with it (nvidia_get_chardev_major)."""
    try:
        return parse_proc_devices(root.read_confined(PROC_DEVICES)).major(IMEX_CHANNELS)
    except (OSError, HostFileError):
        return None


def _read_driver_map(root: HostRoot, uvm: tuple, modeset: bool) -> DriverMap:
    names = _list(root, GPUS_DIR)
    if not names:  # absent: no driver loaded, so no GPU the hook could have selected is known
        return DriverMap(readable=False, why=f"{GPUS_DIR} lists no GPU" if names is not None else
                         f"cannot list {GPUS_DIR}", uvm=uvm, modeset=modeset)
    gpus = []
    for pci in names:
        path = f"{GPUS_DIR}/{pci}/information"
        try:
            values = parse_key_values(root.read_confined(path))
        except OSError as exc:
            return DriverMap(readable=False, why=f"{path}: {exc.strerror or exc}", uvm=uvm, modeset=modeset)
        minor = values.get("Device Minor", "")
        if not (minor.isascii() and minor.isdigit() and len(minor) <= 3 and int(minor) <= 253):
            return DriverMap(readable=False, why=f"{path}: no valid 'Device Minor'", uvm=uvm, modeset=modeset)
        excluded = values.get("GPU Excluded", "No")
        if excluded not in ("Yes", "No"):
            return DriverMap(readable=False, why=f"{path}: 'GPU Excluded' is {excluded[:20]!r}", uvm=uvm,
                             modeset=modeset)
        uuid = values.get("GPU UUID") or None
        gpus.append(GpuEntry(pci, int(minor), uuid[:128] if uuid else None, excluded == "Yes"))
    mig = False
    for name in _list(root, CAPABILITIES_DIR) or ():
        if name.startswith("gpu") and any(e.startswith("gi") for e in _list(root, f"{CAPABILITIES_DIR}/{name}/mig") or ()):
            mig = True
            break
    mig_map = read_mig_map(root) if mig else MigMap()
    uuids, why, capable = read_nvml_mig() if mig else (None, "the host has no MIG instance", None)
    return DriverMap(tuple(gpus), True, "", uvm, mig, modeset, mig_map, uuids, why, capable)


def read_mig_uuids() -> tuple[tuple[tuple[str, int, int, int], ...] | None, str]:
    """read_nvml_mig without the MIG-capable GPUs."""
    uuids, why, _ = read_nvml_mig()
    return uuids, why


def read_nvml_mig() -> tuple[tuple[tuple[str, int, int, int], ...] | None, str, tuple[int, ...] | None]:
    """(MIG devices, "NVML", MIG-capable minors) from nvml_mig(), or (None, why, None): the boundary where
    NVML's failure (NvmlError) becomes the driver map's data (DriverMap.mig_uuids_why)."""
    try:
        uuids, capable = nvml_mig()
    except NvmlError as exc:
        return None, str(exc), None
    return uuids, "NVML", capable


def nvml_mig() -> tuple[tuple[tuple[str, int, int, int], ...], tuple[int, ...]]:
    """NVML's MIG devices now, as (UUID, parent GPU's device minor, GI id, CI id), the way libnvidia-container
    lists them (src/nvc_info.c @00b4b47e fill_mig_device_info: the MIG handles of a GPU in MIG mode by index
    up to the first index without one, where it stops), and the minors of the MIG-capable GPUs (src/driver.c
    driver_get_device_mig_capable: nvmlDeviceGetMigMode succeeds); NvmlError without a working pynvml.
    NVML talks to the kernel this process runs on: --root must be that host's tree (the pod's /host is)."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        raise NvmlError("pynvml cannot be imported") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and the library's absence (a ctypes OSError)
        raise NvmlError(f"NVML cannot be initialised: {str(exc)[:80]}") from exc
    out = []
    capable = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                current, _ = pynvml.nvmlDeviceGetMigMode(gpu)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                continue
            minor = int(pynvml.nvmlDeviceGetMinorNumber(gpu))
            capable.append(minor)
            if current != pynvml.NVML_DEVICE_MIG_ENABLE:
                continue
            for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
                try:
                    handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j)
                except pynvml.NVMLError_NotFound:
                    break  # fill_mig_device_info: "If no MIG device exists at this index, then we are done"
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                out.append((uuid, minor, int(pynvml.nvmlDeviceGetGpuInstanceId(handle)),
                            int(pynvml.nvmlDeviceGetComputeInstanceId(handle))))
    except Exception as exc:
        raise NvmlError(f"NVML failed listing MIG devices: {str(exc)[:80]}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return tuple(out), tuple(capable)
