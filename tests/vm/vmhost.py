#!/usr/bin/python3
"""Host side of the VM harness: build the guest image and fake modules, boot scenarios.

    python3 tests/vm/vmhost.py build                 # guest image (cached, keyed on its inputs)
    python3 tests/vm/vmhost.py modules               # fake NVIDIA modules for the guest kernel
    python3 tests/vm/vmhost.py deb [--upgrade]       # the project's .deb (cached, keyed on the source)
    python3 tests/vm/vmhost.py run s01_reload_loses_gpu [...]   # one fresh boot per scenario

The guest is Debian 12 (systemd, udev, D-Bus, runc) under qemu TCG. Two 9p shares: the
project tree read-only at /mnt/src, a run directory (modules, the .deb, scenario list in;
results out) at /mnt/run. Each scenario is a script in tests/vm/scenarios/ that writes a JSON verdict.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

VM_DIR = Path(__file__).resolve().parent
REPO = VM_DIR.parent.parent
IMAGE_DIR = VM_DIR / "image"
MODULES_SRC = VM_DIR / "modules"
POLLER_SRC = VM_DIR / "poller"
SCENARIOS_DIR = VM_DIR / "scenarios"
# each cell's seconds in CI, by which scripts/test splits the cells into shards (shard_cells)
CELL_COSTS = VM_DIR / "cell-costs.txt"
UNKNOWN_COST_S = 60.0   # a cell not in CELL_COSTS (most default cells take 10-90 s)
KUBE_DIR = REPO / "deploy" / "kubernetes"
# kustomize directories a pod scenario gets rendered (run dir kube/<name>.json)
KUBE_TREES = {"base": KUBE_DIR / "base", "report-only": KUBE_DIR / "overlays" / "report-only",
              "driver-container": KUBE_DIR / "overlays" / "driver-container"}
# static programs built beside the modules: the in-container poller, the pod infra's pause
STATIC_PROGRAMS = ("gpupoll", "pause")
# the fake driver's NVML (modules/libnvidia-ml.c) and the real pynvml that loads it (s28: a MIG node has both)
NVML_FILES = ("libnvidia-ml.so.1", "pynvml.py")
PYNVML = ("nvidia-ml-py==13.615.71", "2828e66b483bec218f461314f6da96c1e56330ed4b297a20b3444b4c43cdd14e")
CACHE = Path(os.environ.get("NVSYMLINKD_VM_CACHE", REPO / ".cache" / "vm"))
SUITE = "bookworm"
# Bump when the build recipe below changes in a way the hashed files do not show.
RECIPE = 1
IMAGE_SIZE = "2G"
BOOT_BUDGET_S = 150     # qemu start to the runner starting; measured 16-45 s under TCG
BOOT_ATTEMPTS = 2       # a boot that hangs before any scenario code ran is retried once
KEEP_RUNS = 100         # run directories (console, journal, results) kept under CACHE/runs
KEEP_PREVIOUS = 3       # previous cache entries of a kind kept (parallel branches boot different images)
# Base snapshots (docs/vm.md, "How a run starts"): a guest booted and saved once per base, restored
# per scenario. Bump SNAPSHOT_RECIPE when the save/restore steps change in a way the key does not show.
SNAPSHOT_RECIPE = 2
KEEP_BASES = 1          # previous bases kept per variant: they are large (RAM state plus disk)
BASE_READY_BUDGET_S = 300   # runner start to base-ready.json (boot done; a dpkg -i takes 10-20 s)
MIGRATE_BUDGET_S = 120  # base-ready.json to the state saved (retried while a 9p share blocks it)
RESTORE_BUDGET_S = 90   # qemu -incoming start to the restored runner's marker
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SECURITY = "http://deb.debian.org/debian-security"


class VmError(Exception):
    """A harness step failed; the message says which and what to do."""


def log(msg: str) -> None:
    print(f"vm: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- inputs

@dataclass(frozen=True)
class GuestKernel:
    abi: str        # 6.1.0-56-amd64
    version: str    # 6.1.192-2 (Debian package version)

    @property
    def image_package(self) -> str:
        return f"linux-image-{self.abi}={self.version}"

    @property
    def headers(self) -> Path:
        return Path("/usr/src") / f"linux-headers-{self.abi}"


def guest_kernel() -> GuestKernel:
    """The guest runs exactly the kernel whose headers the host has (linux-headers-amd64).

    Pinning the image to the host's headers (not the other way round) keeps the fake modules
    loadable: same ABI, same vermagic, same Module.symvers."""
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Depends}", "linux-headers-amd64"],
                          capture_output=True, text=True)
    m = re.search(r"linux-headers-(\S+-amd64) \(= ([^)]+)\)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise VmError("linux-headers-amd64 is not installed on the host: "
                      "apt-get install linux-headers-amd64 (listed in .ci/apt.d/vm.txt)")
    kernel = GuestKernel(m.group(1), m.group(2))
    if not (kernel.headers / "Makefile").exists():
        raise VmError(f"{kernel.headers} is missing: apt-get install --reinstall linux-headers-{kernel.abi}")
    return kernel


def _deb822_and_list_entries() -> List[tuple]:
    """(uri, suite, components) of every 'deb' source apt on this host uses."""
    entries = []
    paths = ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*"))
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields: Dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    for suite in fields.get("suites", "").split():
                        entries.append((uri, suite, fields.get("components", "main")))
        elif path.endswith(".list"):
            for line in text.splitlines():
                line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(line) >= 3 and line[0] == "deb":
                    entries.append((line[1], line[2], " ".join(line[3:]) or "main"))
    return entries


def apt_sources() -> List[str]:
    """Bookworm sources for mmdebstrap: the mirror this host's apt uses (only package
    registries are reachable from CI), overridable with NVSYMLINKD_VM_MIRROR."""
    main = os.environ.get("NVSYMLINKD_VM_MIRROR")
    security = os.environ.get("NVSYMLINKD_VM_SECURITY_MIRROR")
    for uri, suite, _ in _deb822_and_list_entries():
        if suite == SUITE and not main:
            main = uri
        elif suite == f"{SUITE}-security" and not security:
            security = uri
    main = (main or DEFAULT_MIRROR).rstrip("/")
    security = (security or DEFAULT_SECURITY).rstrip("/")
    return [f"deb {main} {SUITE} main", f"deb {main} {SUITE}-updates main",
            f"deb {security} {SUITE}-security main"]


def image_packages(kernel: GuestKernel) -> List[str]:
    lines = (IMAGE_DIR / "packages.txt").read_text().splitlines()
    pkgs = [w for line in lines for w in line.split("#", 1)[0].split()]
    return pkgs + [kernel.image_package]


def _hash_tree(h, root: Path) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(oct(path.stat().st_mode & 0o777).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")


def mmdebstrap_argv(kernel: GuestKernel, target: str) -> List[str]:
    excludes = ["/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*",
                "/usr/share/info/*", "/usr/share/lintian/*"]
    return (["mmdebstrap", "--variant=minbase", "--mode=root", "--format=directory",
             "--include=" + ",".join(image_packages(kernel))]
            + [f"--dpkgopt=path-exclude={p}" for p in excludes]
            + ["--setup-hook=mkdir -p \"$1/etc/initramfs-tools/conf.d\" && "
               "echo MODULES=list > \"$1/etc/initramfs-tools/conf.d/vm\"",
               f"--customize-hook={IMAGE_DIR / 'customize.sh'} \"$1\"",
               SUITE, target] + apt_sources())


def image_key(kernel: GuestKernel) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE, "size": IMAGE_SIZE,
                         "argv": mmdebstrap_argv(kernel, "TARGET")}).encode())
    _hash_tree(h, IMAGE_DIR)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- cache

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(directory: Path, files: List[str], extra: dict) -> None:
    manifest = dict(extra, files={name: {"size": (directory / name).stat().st_size,
                                         "sha256": _sha256(directory / name)} for name in files})
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


def cache_entry_ok(directory: Path) -> bool:
    """A cache entry counts only if its manifest (written last) matches every file."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        for name, want in manifest["files"].items():
            path = directory / name
            if path.stat().st_size != want["size"] or _sha256(path) != want["sha256"]:
                return False
        return bool(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


class _CacheLock:
    def __init__(self, name: str = ".lock"):
        self.name = name    # a base build (a boot) holds its own lock, not the one image lookups take

    def __enter__(self):
        CACHE.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(CACHE / self.name, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _publish(tmp: Path, final: Path, prefix: str, keep: int = KEEP_PREVIOUS) -> None:
    """Atomic: a half-written entry is never found under its final name."""
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    # Keep the newest previous entries: other sessions may be booting them right now (qemu opens
    # the image at each boot), e.g. ones still running a tree from before an image input changed.
    stale = sorted((p for p in CACHE.glob(prefix + "*") if p != final), key=lambda p: p.stat().st_mtime)
    for old in stale[:max(0, len(stale) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_tmp(kind: str) -> None:
    # Called under the cache lock: any temp build left over is from a build that died.
    for stale in CACHE.glob(f".tmp-{kind}-*"):
        shutil.rmtree(stale, ignore_errors=True)


@dataclass
class Image:
    directory: Path
    kernel: GuestKernel
    built: bool = False
    build_s: float = 0.0

    @property
    def rootfs(self) -> Path:
        return self.directory / "rootfs.img"

    @property
    def vmlinuz(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"


def build_image(force: bool = False) -> Image:
    for tool in ("mmdebstrap", "mkfs.ext4", "e2fsck"):
        if shutil.which(tool) is None:
            raise VmError(f"'{tool}' is missing: apt-get install the packages in .ci/apt.d/vm.txt")
    kernel = guest_kernel()
    key = image_key(kernel)
    final = CACHE / f"image-{key}"
    with _CacheLock():
        if not force and cache_entry_ok(final):
            log(f"image {final} is cached (key {key})")
            return Image(final, kernel)
        if final.exists():
            log(f"image {final} is incomplete or corrupt: rebuilding")
        start = time.monotonic()
        _remove_stale_tmp("image")
        tmp = CACHE / f".tmp-image-{key}-{os.getpid()}"
        tmp.mkdir(parents=True)
        tree = tmp / "tree"
        argv = mmdebstrap_argv(kernel, str(tree))
        log(f"building image {key}: guest kernel {kernel.abi} {kernel.version}; sources {apt_sources()}")
        with open(tmp / "mmdebstrap.log", "w") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            text = (tmp / "mmdebstrap.log").read_text(errors="replace")
            shutil.rmtree(tree, ignore_errors=True)
            if f"linux-image-{kernel.abi}" in text and ("not found" in text or "candidate" in text):
                hint = (f"the mirror no longer has linux-image-{kernel.abi}={kernel.version} that "
                        "this host's headers pin: apt-get update && apt-get install linux-headers-amd64")
            else:
                hint = f"is the Debian mirror reachable? sources: {apt_sources()}"
            raise VmError(f"guest image build failed (mmdebstrap exit {proc.returncode}): {hint}; "
                          f"log {tmp / 'mmdebstrap.log'}:\n{text[-3000:]}")
        shutil.copy(tree / "boot" / f"vmlinuz-{kernel.abi}", tmp / "vmlinuz")
        shutil.copy(tree / "boot" / f"initrd.img-{kernel.abi}", tmp / "initrd.img")
        subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "nvsvm-root", "-d", str(tree),
                        str(tmp / "rootfs.img"), IMAGE_SIZE], check=True)
        shutil.rmtree(tree)
        fsck = subprocess.run(["e2fsck", "-fn", str(tmp / "rootfs.img")], capture_output=True, text=True)
        if fsck.returncode != 0:
            raise VmError(f"fresh guest image fails e2fsck:\n{fsck.stdout[-2000:]}")
        elapsed = time.monotonic() - start
        _write_manifest(tmp, ["rootfs.img", "vmlinuz", "initrd.img"],
                        {"key": key, "kernel_abi": kernel.abi, "kernel_version": kernel.version,
                         "sources": apt_sources(), "build_s": round(elapsed, 1),
                         "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        if not cache_entry_ok(tmp):
            raise VmError(f"guest image in {tmp} does not verify against its own manifest")
        _publish(tmp, final, "image-")
        log(f"image {final} built in {elapsed:.0f} s")
        return Image(final, kernel, built=True, build_s=elapsed)


def build_modules(kernel: Optional[GuestKernel] = None) -> Path:
    """Fake nvidia.ko / nvidia-uvm.ko for the guest kernel, the static in-container poller
    (gpupoll, tests/vm/poller) and the fake driver's NVML with the real pynvml (NVML_FILES), cached like the image."""
    kernel = kernel or guest_kernel()
    h = hashlib.sha256(f"{kernel.abi} {kernel.version} {PYNVML[1]}".encode())
    _hash_tree(h, MODULES_SRC)
    _hash_tree(h, POLLER_SRC)
    key = h.hexdigest()[:16]
    final = CACHE / f"modules-{key}"
    with _CacheLock():
        if cache_entry_ok(final):
            return final
        _remove_stale_tmp("modules")
        tmp = CACHE / f".tmp-modules-{key}-{os.getpid()}"
        shutil.copytree(MODULES_SRC, tmp)
        proc = subprocess.run(["make", "-C", str(kernel.headers), f"M={tmp}", "modules"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise VmError(f"building the fake modules against {kernel.headers} failed "
                          f"(gcc, make, linux-headers-{kernel.abi} installed?):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        names = ["nvidia.ko", "nvidia-uvm.ko"]
        for prog in STATIC_PROGRAMS:
            proc = subprocess.run(["gcc", "-static", "-O2", "-Wall", "-Werror", "-o", str(tmp / prog),
                                   str(POLLER_SRC / f"{prog}.c")], capture_output=True, text=True)
            if proc.returncode != 0:
                raise VmError(f"building the static {prog} failed (gcc, libc6-dev installed?):\n{proc.stderr[-2000:]}")
        proc = subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1",
                               "-o", str(tmp / NVML_FILES[0]), str(MODULES_SRC / "libnvidia-ml.c")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise VmError(f"building the fake libnvidia-ml.so.1 failed:\n{proc.stderr[-2000:]}")
        fetch_pynvml(tmp / NVML_FILES[1])
        for name in names:
            vermagic = subprocess.run(["modinfo", "-F", "vermagic", str(tmp / name)],
                                      capture_output=True, text=True).stdout
            if not vermagic.startswith(kernel.abi + " "):
                raise VmError(f"{name} has vermagic {vermagic!r}, guest kernel is {kernel.abi}")
        _write_manifest(tmp, names + list(STATIC_PROGRAMS) + list(NVML_FILES), {"kernel_abi": kernel.abi})
        _publish(tmp, final, "modules-")
        return final


def fetch_pynvml(dest: Path, tmp_dir: Optional[Path] = None) -> None:
    """pynvml.py of the pinned nvidia-ml-py wheel (pure Python; pip download, checked against its sha256)."""
    with tempfile.TemporaryDirectory(dir=tmp_dir or CACHE) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "-d", tmp, PYNVML[0]], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise VmError(f"pip download {PYNVML[0]} failed (network, pip?): {proc.stderr.strip()[-600:]}")
        with zipfile.ZipFile(wheels[0]) as whl:
            text = whl.read("pynvml.py")
    if hashlib.sha256(text).hexdigest() != PYNVML[1]:
        raise VmError(f"pynvml.py of {PYNVML[0]} is not the one pinned (sha256 {PYNVML[1]})")
    dest.write_bytes(text)


@dataclass
class Package:
    deb: Path
    built: bool = False
    build_s: float = 0.0


def upgrade_version() -> str:
    """The rebuilt higher version 'packages=upgrade' scenarios upgrade to: the tree's version with
    its last number plus one (0.1.0 -> 0.1.1)."""
    current = re.search(r'^__version__ = "([^"]+)"$', (REPO / "nvsymlinkd" / "__init__.py").read_text(), re.M).group(1)
    head, last = re.match(r"(.*?)(\d+)$", current).groups()
    return f"{head}{int(last) + 1}"


def build_package(version: Optional[str] = None) -> Package:
    """The project's .deb (dpkg-buildpackage in a copy of the tree, tests/debbuild.py), cached
    under CACHE/deb-<hash of the tree's files outside tests/>: rebuilt when the source changes.
    version: the same source built as that (higher) version, cached under CACHE/debup-VERSION-<hash>."""
    for tool in ("dpkg-buildpackage", "dh", "pybuild", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise VmError(f"'{tool}' is missing: apt-get install the packages in .ci/apt.d/build.txt (scripts/setup --build)")
    from tests import debbuild

    key = debbuild.source_key() or f"nogit{os.getpid()}"   # no git: no file list to key on
    kind = f"debup-{version}" if version else "deb"
    final = CACHE / f"{kind}-{key}"
    with _CacheLock():
        if cache_entry_ok(final):
            manifest = json.loads((final / "manifest.json").read_text())
            log(f"package {final} is cached (key {key})")
            return Package(final / next(iter(manifest["files"])))
        _remove_stale_tmp(kind)
        start = time.monotonic()
        tmp = CACHE / f".tmp-{kind}-{key}-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            deb = debbuild.build_deb(tmp / "work", version=version)
        except (AssertionError, OSError, subprocess.SubprocessError) as e:
            raise VmError(f"building the .deb (dpkg-buildpackage -us -uc -b) failed: {e}") from e
        os.rename(deb, tmp / deb.name)
        shutil.rmtree(tmp / "work")
        elapsed = time.monotonic() - start
        _write_manifest(tmp, [deb.name], {"key": key, "build_s": round(elapsed, 1)})
        _publish(tmp, final, f"{kind}-")
        log(f"package {final / deb.name} built in {elapsed:.0f} s")
        return Package(final / deb.name, built=True, build_s=elapsed)


def package_repos(top: Path, deb: Path, newer: Path) -> None:
    """The apt repository a fleet installs from, as scripts/make-repos (the step of build-packages --repo)
    makes it, in two releases: top/first/deb/ with deb, top/second/deb/ with newer added next to it."""
    for name, debs in (("first", [deb]), ("second", [newer])):
        if name == "second":
            shutil.copytree(top / "first", top / name)
        proc = subprocess.run([str(REPO / "scripts" / "make-repos"), str(top / name), *map(str, debs)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise VmError(f"scripts/make-repos {top / name} failed (exit {proc.returncode}): {proc.stderr.strip()}")


# ---------------------------------------------------------------- the DaemonSet's image and YAML

# The Dockerfile's build argument BASE in the guest: a bookworm minbase made here, imported there.
POD_BASE_TAG = "localhost/nvsymlinkd-base:bookworm"
# what the image is built from: the Dockerfile and what it COPYs from the repository root
IMAGE_INPUTS = ("deploy/kubernetes/Dockerfile", "deploy/kubernetes/nvsymlinkd.sh", "nvsymlinkd", "rules", "units")


def dockerfile_apt_packages() -> List[str]:
    """The packages the Dockerfile's `apt-get install` line names."""
    text = (KUBE_DIR / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "apt-get install" in ln)
    return [w for w in line.split("apt-get install", 1)[1].split("&&")[0].split() if not w.startswith("-")]


def pod_base_argv(target: str) -> List[str]:
    """A bookworm minbase as the Dockerfile's BASE, with the packages its apt-get line installs
    already in it and no apt sources: the guest has no network, so the build's `apt-get update`
    reads no list and `apt-get install` finds each package installed (dpkg's status is its
    candidate). Documentation trimmed like debian:12-slim's."""
    excludes = ["/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*", "/usr/share/info/*"]
    return (["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar",
             "--include=" + ",".join(dockerfile_apt_packages())]
            + [f"--dpkgopt=path-exclude={p}" for p in excludes]
            + ['--customize-hook=rm -f "$1/etc/apt/sources.list"; rm -rf "$1"/var/lib/apt/lists/* '
               '"$1"/var/cache/apt/*.bin',
               SUITE, target] + apt_sources())


def pod_base_key() -> str:
    return hashlib.sha256(json.dumps({"recipe": RECIPE, "argv": pod_base_argv("TARGET")}).encode()).hexdigest()[:16]


def pod_image_key() -> str:
    """The built image's cache key: its base and every file the build reads (bytecode caches
    left by test runs excluded)."""
    h = hashlib.sha256(pod_base_key().encode())
    for rel in IMAGE_INPUTS:
        path = REPO / rel
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
        for f in files:
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + oct(f.stat().st_mode & 0o777).encode()
                     + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_pod_base() -> Path:
    """The BASE rootfs tarball (mmdebstrap on this host, cached under CACHE/podbase-<key>)."""
    key = pod_base_key()
    final = CACHE / f"podbase-{key}"
    with _CacheLock():
        if cache_entry_ok(final):
            return final / "base.tar"
        _remove_stale_tmp("podbase")
        tmp = CACHE / f".tmp-podbase-{key}-{os.getpid()}"
        tmp.mkdir(parents=True)
        start = time.monotonic()
        with open(tmp / "mmdebstrap.log", "w") as out:
            proc = subprocess.run(pod_base_argv(str(tmp / "base.tar")), stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise VmError(f"the image base (mmdebstrap) failed with exit {proc.returncode}: is the Debian "
                          f"mirror reachable? log {tmp / 'mmdebstrap.log'}")
        _write_manifest(tmp, ["base.tar"], {"key": key, "build_s": round(time.monotonic() - start, 1)})
        _publish(tmp, final, "podbase-")
        log(f"image base {final} made in {time.monotonic() - start:.0f} s")
        return final / "base.tar"


def render_kube(out: Path) -> Dict[str, str]:
    """`kubectl kustomize` of base and each overlay, as the cluster would get them, into
    out/<name>.json (the rendered documents as a JSON list: the guest has no YAML parser).
    Returns the image reference the rendered DaemonSet runs."""
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise VmError("kubectl is missing (its built-in kustomize renders deploy/kubernetes)")
    out.mkdir(parents=True, exist_ok=True)
    images = {}
    for name, tree in KUBE_TREES.items():
        proc = subprocess.run([kubectl, "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise VmError(f"kubectl kustomize {tree} failed: {proc.stderr.strip()}")
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        (out / f"{name}.yaml").write_text(proc.stdout)
        (out / f"{name}.json").write_text(json.dumps(docs, indent=1))
        for d in docs:
            if d.get("kind") == "DaemonSet":
                images[name] = d["spec"]["template"]["spec"]["containers"][0]["image"]
    return images


def pod_image_kept() -> bool:
    """Whether a guest that builds the pod image saves it for the host's cache: not in a CI default
    run, whose cache dies with the machine and whose one pod cell (s20) is the only one to use it
    (the `podman save` cost 60-120 s of TCG time there; docs/vm.md, "CI time"). The full matrix keeps
    it: s20@v1 and s21 load it."""
    return os.environ.get("CI") != "true" or os.environ.get("NVSYMLINKD_VM_MATRIX", "") == "full"


def stage_pod(run_dir: Path) -> dict:
    """What a pod scenario gets in its run dir: the rendered YAML, and the image: the cached
    build (podimage.tar, `podman load`) or the base to build it from (podbase.tar)."""
    images = render_kube(run_dir / "kube")
    key = pod_image_key()
    cached = CACHE / f"podimage-{key}"
    info = {"image": images["base"], "images": images, "key": key, "base_tag": POD_BASE_TAG,
            "cached": cache_entry_ok(cached), "save": pod_image_kept()}
    if info["cached"]:
        os.link(cached / "image.tar", run_dir / "podimage.tar")
    else:
        os.link(build_pod_base(), run_dir / "podbase.tar")
    (run_dir / "pod.json").write_text(json.dumps(info, indent=1))
    return info


def keep_pod_image(run_dir: Path, info: dict) -> None:
    """The image the guest built (run dir podimage-built/image.tar), cached under its inputs' key."""
    built = run_dir / "podimage-built" / "image.tar"
    if info.get("cached") or not built.is_file():
        return
    final = CACHE / f"podimage-{info['key']}"
    with _CacheLock():
        _remove_stale_tmp("podimage")
        tmp = CACHE / f".tmp-podimage-{info['key']}-{os.getpid()}"
        tmp.mkdir(parents=True)
        os.rename(built, tmp / "image.tar")
        _write_manifest(tmp, ["image.tar"], {"key": info["key"], "image": info["image"]})
        _publish(tmp, final, "podimage-")
    log(f"pod image cached in {final}")


# ---------------------------------------------------------------- run

def scenario_options(name: str) -> Dict[str, str]:
    """'# vm: key=value ...' lines at the top of a scenario script. nvsymlinkd=off|deb|source:
    not installed, the freshly built .deb installed with dpkg -i, or run from the 9p source tree
    with its rendered units (quick iteration: no package build). hierarchies=v2,v1: the cgroup
    hierarchies the scenario runs on (default v2; v1 boots systemd.unified_cgroup_hierarchy=0,
    listed as NAME@v1). pod=yes: the run dir gets deploy/kubernetes rendered and the DaemonSet's
    image (stage_pod). matrix=full: only with NVSYMLINKD_VM_MATRIX=full (the default run keeps a
    representative subset); full=v1: hierarchies added only with NVSYMLINKD_VM_MATRIX=full.
    packages=upgrade: the .deb and the same source rebuilt as a higher version are put, under their
    real file names, in /mnt/run/debs for the scenario to install itself (with nvsymlinkd=off);
    upgrade_version(); and as apt repositories (package_repos) in /mnt/run/repos/first/deb (the .deb)
    and /mnt/run/repos/second/deb (the higher version added next to it)."""
    opts = {"nvsymlinkd": "off", "timeout": "300", "hierarchies": "v2", "matrix": "default", "full": "",
            "pod": "no", "packages": ""}
    for line in scenario_path(name).read_text().splitlines()[:20]:
        if line.startswith("# vm:"):
            for word in line[len("# vm:"):].split():
                key, _, value = word.partition("=")
                opts[key] = value
    return opts


def scenario_path(name: str) -> Path:
    path = SCENARIOS_DIR / f"{name.split('@', 1)[0]}.py"
    if not path.is_file():
        raise VmError(f"no scenario {path}; available: {', '.join(list_scenarios())}")
    return path


def scenario_hierarchy(name: str) -> str:
    """v2 (unified, the default boot) or v1 (NAME@v1: legacy, systemd.unified_cgroup_hierarchy=0)."""
    hierarchy = name.split("@", 1)[1] if "@" in name else "v2"
    if hierarchy not in ("v1", "v2"):
        raise VmError(f"{name}: the cgroup hierarchy after '@' must be v1 or v2")
    return hierarchy


def guest_cmdline(name: str, nvsymlinkd: str) -> str:
    """Kernel command line words for a scenario: how the runner installs nvsymlinkd and the
    legacy (v1) hierarchy for NAME@v1. Both shape a base snapshot; anything that differs per run
    goes into the run dir (guest_options), since a restored guest keeps the base's command line."""
    words = [f"nvsymlinkd.vm={nvsymlinkd}"]
    if scenario_hierarchy(name) == "v1":
        words.append("systemd.unified_cgroup_hierarchy=0")
    return " ".join(words)


def guest_options() -> Dict[str, str]:
    """The run dir's options.json: the chaos soak's re-run of one seed or one printed sequence
    (NVSYMLINKD_CHAOS_SEEDS / NVSYMLINKD_CHAOS_STEPS, docs/vm.md "Chaos soak"), and
    NVSYMLINKD_CHAOS_DEBUG=1 (the daemon journals its debug entries: each pass and why), read by
    chaosrun.cmdline_option; matrix=full with NVSYMLINKD_VM_MATRIX=full (vmguest.full_matrix: the
    full counts of reloads, re-execs and updates; the default run does fewer of each)."""
    options = {}
    if os.environ.get("NVSYMLINKD_VM_MATRIX", "") == "full":
        options["matrix"] = "full"
    for env, key in (("NVSYMLINKD_CHAOS_SEEDS", "chaos_seeds"), ("NVSYMLINKD_CHAOS_STEPS", "chaos_steps"),
                     ("NVSYMLINKD_CHAOS_DEBUG", "chaos_debug")):
        value = os.environ.get(env, "").strip()
        if value:
            options[key] = value
    return options


def list_scenarios(matrix: Optional[str] = None) -> List[str]:
    """Scenario names, one per hierarchy each runs on; matrix 'full' (default: the environment's
    NVSYMLINKD_VM_MATRIX) includes the ones marked matrix=full."""
    full = (matrix or os.environ.get("NVSYMLINKD_VM_MATRIX", "")) == "full"
    names = []
    for stem in sorted(p.stem for p in SCENARIOS_DIR.glob("s*.py")):
        opts = scenario_options(stem)
        if opts["matrix"] == "full" and not full:
            continue
        hierarchies = opts["hierarchies"].split(",") + (opts["full"].split(",") if full and opts["full"] else [])
        for hierarchy in hierarchies:
            names.append(stem if hierarchy == "v2" else f"{stem}@{hierarchy}")
    return names


def cell_costs(path: Optional[Path] = None) -> Dict[str, float]:
    """CELL_COSTS: 'CELL SECONDS' per line, '#' comments."""
    path = path or CELL_COSTS
    costs = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            name, seconds = words
            costs[name] = float(seconds)
        except ValueError:
            raise VmError(f"{path}:{number}: {line.strip()!r} is not 'CELL SECONDS' (e.g. s01_reload_loses_gpu 68)") \
                from None
    return costs


def split_cells(names: List[str], count: int, costs: Dict[str, float]) -> List[List[str]]:
    """names into count shards of about equal cost: longest first, each to the lighter shard (the
    first on a tie); the cells without a cost after them, as UNKNOWN_COST_S each. A shard lists its
    cells longest first, so two shards starting together need different base snapshots at first
    (s20 an 'off' one, s30 a 'deb' one) and build them at the same time."""
    order = sorted((n for n in names if n in costs), key=lambda n: (-costs[n], n))
    order += [n for n in names if n not in costs]
    shards: List[List[str]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for name in order:
        lighter = min(range(count), key=lambda i: (loads[i], i))
        shards[lighter].append(name)
        loads[lighter] += costs.get(name, UNKNOWN_COST_S)
    return shards


def shard_spec(value: str) -> Optional[Tuple[int, int]]:
    """NVSYMLINKD_VM_SHARD's 'I/N' (the I-th of N shards) as (I, N); None when empty: every cell."""
    if not value.strip():
        return None
    m = re.fullmatch(r"\s*(\d+)/(\d+)\s*", value)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise VmError(f"NVSYMLINKD_VM_SHARD={value!r} must be I/N with 1 <= I <= N (scripts/test runs 1/N to N/N, N from NVSYMLINKD_VM_SHARDS); "
                      "unset it to run every cell")
    return int(m.group(1)), int(m.group(2))


def shard_cells(names: List[str], spec: Optional[str] = None) -> List[str]:
    """The cells of names this process runs: all of them, or with NVSYMLINKD_VM_SHARD=I/N (spec, when
    given) the I-th of split_cells' N shards, each cell in exactly one."""
    parsed = shard_spec(os.environ.get("NVSYMLINKD_VM_SHARD", "") if spec is None else spec)
    if parsed is None:
        return list(names)
    index, count = parsed
    return split_cells(list(names), count, cell_costs())[index - 1]


@dataclass
class RunResult:
    scenario: str
    run_dir: Path
    wall_s: float
    timed_out: bool
    exit_code: object      # qemu's exit status, or "results": killed once runner.json was there
    runner: dict = field(default_factory=dict)
    result: Optional[dict] = None
    boot_attempts: int = 1
    restore_s: Optional[float] = None   # qemu start to the restored runner's marker; None: booted
    base: Optional[str] = None          # the base snapshot's cache entry it was restored from
    fallback: str = ""                  # why a restore fell back to a fresh boot

    @property
    def console(self) -> Path:
        return self.run_dir / "console.log"

    def start_text(self) -> str:
        if self.restore_s is not None:
            return (f"restored in {self.restore_s:.1f} s from {self.base} "
                    f"(base boot {self.runner.get('boot_s', '?')} s)")
        return f"booted in {self.runner.get('boot_s', '?')} s" + (
            f" (restore failed: {self.fallback})" if self.fallback else "")

    def summary(self) -> str:
        lines = [f"scenario {self.scenario}: wall {self.wall_s:.1f} s, {self.start_text()}, "
                 + ("qemu stopped once runner.json was written" if self.exit_code == "results"
                    else f"qemu exit {self.exit_code}")
                 + (f", nvsymlinkd ({self.runner['nvsymlinkd']}) installed and active in "
                    f"{self.runner['nvsymlinkd_start_s']} s" if "nvsymlinkd_start_s" in self.runner else "")
                 + (f", nvsymlinkd install FAILED: {self.runner['nvsymlinkd_error']}"
                    if "nvsymlinkd_error" in self.runner else "")
                 + (f", {self.boot_attempts} boots (hung boot retried)" if self.boot_attempts > 1 else "")
                 + (" TIMED OUT" if self.timed_out else "")]
        if self.result:
            lines.append(f"  verdict: {'PASS' if self.result.get('ok') else 'FAIL'} "
                         f"(scenario {self.result.get('elapsed_s', '?')} s)")
            for check in self.result.get("checks", []):
                lines.append(f"  [{'ok' if check['ok'] else 'FAIL'}] {check['what']}"
                             + (f": {check['detail']}" if check.get("detail") else ""))
            for key, value in self.result.get("timings", {}).items():
                lines.append(f"  timing {key}: {value}")
            for key, value in self.result.get("facts", {}).items():
                if len(str(value)) <= 300:  # long ones (journal excerpts) stay in the JSON
                    lines.append(f"  fact {key}: {value}")
            if self.result.get("error"):
                lines.append(f"  error: {self.result['error']}")
        else:
            lines.append(f"  no result written; console: {self.console}")
        return "\n".join(lines)


def qemu_argv(image: Image, run_dir: Path, cmdline_extra: str, disk: Optional[Path] = None,
              qmp: Optional[Path] = None, incoming: Optional[Path] = None) -> List[str]:
    """The guest machine. Fresh boot: the raw rootfs opened -snapshot. Base snapshot: disk, a
    qcow2 overlay backed by the rootfs, and a QMP socket to save the machine through. Restore:
    the same machine (a migration needs the same devices, RAM and ROMs: the kernel is passed
    as for the base although it never runs) on a new overlay, its RAM and devices loaded from
    the base's state file; the 9p 'run' share and the console are this run's."""
    append = ("console=ttyS0 root=/dev/vda rw panic=-1 loglevel=4 "
              "systemd.show_status=auto " + cmdline_extra)
    drive = (f"file={disk},format=qcow2,if=virtio" if disk is not None
             else f"file={image.rootfs},format=raw,if=virtio")
    argv = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-smp", "2", "-m", "2048",
            "-nographic", "-monitor", "none", "-serial", f"file:{run_dir / 'console.log'}",
            "-no-reboot"] + (["-snapshot"] if disk is None else []) + [
            "-nic", "none",
            "-kernel", str(image.vmlinuz), "-initrd", str(image.initrd), "-append", append,
            "-drive", drive,
            "-virtfs", f"local,path={REPO},mount_tag=src,security_model=none,readonly=on",
            "-virtfs", f"local,path={run_dir},mount_tag=run,security_model=none"]
    if qmp is not None:
        argv += ["-qmp", f"unix:{qmp},server=on,wait=off"]
    if incoming is not None:
        argv += ["-incoming", f"exec:cat {shlex.quote(str(incoming))}"]
    return argv


def snapshot_wanted(opts: Dict[str, str]) -> bool:
    """Whether a scenario starts from a base snapshot: not with NVSYMLINKD_VM_SNAPSHOT=0, and
    not for 'source' (its daemon runs from the 9p tree, which must be unmounted for the save)."""
    return os.environ.get("NVSYMLINKD_VM_SNAPSHOT", "1") != "0" and opts["nvsymlinkd"] in ("off", "deb")


def _image_rootfs_sha(image: Image) -> str:
    try:
        return json.loads((image.directory / "manifest.json").read_text())["files"]["rootfs.img"]["sha256"]
    except (OSError, ValueError, KeyError):
        raise VmError(f"{image.directory} has no manifest: build the image first (vmhost.py build)") from None


def base_key(image: Image, hierarchy: str, mode: str, deb: Optional[Path]) -> str:
    """Every input that shapes the saved machine: the image (its rootfs, by content and by the
    path the base's overlay names), the hierarchy and install mode (the kernel command line), the
    .deb installed, the guest code that runs before the save and the qemu argv's shape."""
    cmdline = guest_cmdline("x@" + hierarchy, mode)
    shape = qemu_argv(Image(Path("/IMAGE"), image.kernel), Path("/RUN"), cmdline,
                      disk=Path("/DISK"), qmp=Path("/QMP"))
    h = hashlib.sha256(json.dumps({
        "recipe": SNAPSHOT_RECIPE, "image": image.directory.name, "rootfs": str(image.rootfs),
        "rootfs_sha256": _image_rootfs_sha(image), "hierarchy": hierarchy, "mode": mode,
        "deb": _sha256(deb) if mode == "deb" else None, "argv": shape}).encode())
    for code in ("runner.py", "vmguest.py"):
        h.update(code.encode() + b"\0" + (VM_DIR / "guest" / code).read_bytes() + b"\0")
    return h.hexdigest()[:16]


@dataclass
class Base:
    directory: Path
    info: dict
    built: bool = False

    @property
    def disk(self) -> Path:
        return self.directory / "base.qcow2"

    @property
    def state(self) -> Path:
        return self.directory / "state"


_VERIFIED_BASES: Dict[str, float] = {}


def _base_ok(directory: Path) -> bool:
    """cache_entry_ok, once per process and manifest (the state file is hundreds of MB)."""
    try:
        stamp = (directory / "manifest.json").stat().st_mtime
    except OSError:
        return False
    if _VERIFIED_BASES.get(str(directory)) == stamp:
        return True
    if cache_entry_ok(directory):
        _VERIFIED_BASES[str(directory)] = stamp
        return True
    return False


class Qmp:
    """The smallest QMP client: one command at a time, events skipped."""

    def __init__(self, path: Path, proc: subprocess.Popen, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise VmError(f"no QMP socket {path} (qemu exit {proc.poll()})") from None
                time.sleep(0.1)
        self.sock.settimeout(60)
        self.file = self.sock.makefile("rb")
        self._read()    # the greeting
        self.command("qmp_capabilities")

    def _read(self) -> dict:
        line = self.file.readline()
        if not line:
            raise VmError("qemu closed its QMP socket")
        return json.loads(line)

    def command(self, name: str, fd: Optional[int] = None, **arguments) -> dict:
        """fd: a file descriptor passed along (SCM_RIGHTS), as 'getfd' wants."""
        message = json.dumps({"execute": name, "arguments": arguments}).encode() + b"\n"
        if fd is None:
            self.sock.sendall(message)
        else:
            socket.send_fds(self.sock, [message], [fd])
        while True:
            reply = self._read()
            if "event" not in reply:
                return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def _save_machine(qmp: Qmp, state: Path, proc: subprocess.Popen) -> float:
    """Migrate the running guest into the state file (live: qemu stops it at the end and records
    it as running, so a restore starts it; one stopped first would stay paused after -incoming).
    A 9p share the guest still has mounted blocks the migration: try again (the guest unmounts
    both after base-ready, and its restore poll mounts 'run' only for a moment; a mount during
    the migration is refused). Returns seconds spent."""
    start = time.monotonic()
    qmp.command("migrate-set-parameters", **{"max-bandwidth": 1 << 40})   # default: 32 MiB/s
    with open(state, "wb") as out:
        while True:
            if proc.poll() is not None:
                raise VmError(f"qemu exited ({proc.returncode}) before the base was saved")
            # fd: a file qemu writes itself (exec:cat may be killed before it has written all)
            reply = qmp.command("getfd", fd=out.fileno(), fdname="state")
            if "error" in reply:
                raise VmError(f"passing the state file to qemu failed: {reply['error']}")
            reply = qmp.command("migrate", uri="fd:state")
            if "error" not in reply:
                break
            qmp.command("closefd", fdname="state")
            if time.monotonic() > start + MIGRATE_BUDGET_S:
                raise VmError(f"the base's migration stayed refused for {MIGRATE_BUDGET_S} s: "
                              f"{reply['error'].get('desc')} (a 9p share still mounted in the guest?)")
            time.sleep(0.3)
        while True:
            status = qmp.command("query-migrate").get("return", {})
            if status.get("status") == "completed":
                break
            if status.get("status") in ("failed", "cancelled"):
                raise VmError(f"saving the base failed: {status}")
            if time.monotonic() > start + MIGRATE_BUDGET_S + 300:
                raise VmError(f"saving the base did not finish: {status}")
            time.sleep(0.2)
    return time.monotonic() - start


def ensure_base(image: Image, hierarchy: str, mode: str, deb: Optional[Path]) -> Base:
    """The base snapshot for (image, hierarchy, mode, .deb): cached under
    CACHE/base-<hierarchy>-<mode>-<key>, else built: one boot with the runner doing what precedes
    a scenario (for deb: dpkg -i, the daemon active), then the machine saved (RAM and devices to
    'state', the disk in 'base.qcow2' over the image's rootfs). A build that fails raises."""
    key = base_key(image, hierarchy, mode, deb)
    prefix = f"base-{hierarchy}-{mode}-"
    final = CACHE / f"{prefix}{key}"
    if _base_ok(final):
        return Base(final, json.loads((final / "base.json").read_text()))
    with _CacheLock(f".lock-base-{key}"):
        if _base_ok(final):
            return Base(final, json.loads((final / "base.json").read_text()))
        _remove_stale_tmp(f"base-{key}")
        tmp = CACHE / f".tmp-base-{key}-{os.getpid()}"
        tmp.mkdir(parents=True)
        run_root = CACHE / "runs"
        run_root.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%dT%H%M%S')}-{prefix}{key}-", dir=run_root))
        (run_dir / "snapshot-base").write_text(key)
        if mode == "deb":
            shutil.copy(deb, run_dir / "nvsymlinkd.deb")
        qmp_dir = Path(tempfile.mkdtemp(prefix="nvsvm-"))    # a unix socket path has 108 bytes
        argv = qemu_argv(image, run_dir, guest_cmdline("x@" + hierarchy, mode), disk=tmp / "base.qcow2",
                         qmp=qmp_dir / "qmp")
        (run_dir / "qemu.argv").write_text(json.dumps(argv))
        log(f"building base snapshot {final.name} ({hierarchy}, nvsymlinkd={mode}); run dir {run_dir}")
        start = time.monotonic()
        try:
            for attempt in range(1, BOOT_ATTEMPTS + 1):
                shutil.rmtree(run_dir / "results", ignore_errors=True)
                (run_dir / "results").mkdir()
                _create_overlay(tmp / "base.qcow2", image.rootfs, "raw")
                info = _boot_and_save(argv, run_dir, qmp_dir / "qmp", tmp / "state")
                if info is not None:
                    break
                if attempt == BOOT_ATTEMPTS:
                    raise VmError(f"base {final.name}: the boot hung {BOOT_ATTEMPTS} times; console {run_dir}")
                os.rename(run_dir / "console.log", run_dir / f"console.hung-{attempt}.log")
                log(f"base {final.name}: boot hung (no runner after {BOOT_BUDGET_S} s), attempt {attempt} of {BOOT_ATTEMPTS}")
        finally:
            shutil.rmtree(qmp_dir, ignore_errors=True)
        if info.get("nvsymlinkd_error"):
            raise VmError(f"base {final.name}: installing nvsymlinkd failed in the guest: "
                          f"{info['nvsymlinkd_error']}; run dir {run_dir}")
        info.update(key=key, hierarchy=hierarchy, mode=mode, image=image.directory.name,
                    boot_attempts=attempt, build_s=round(time.monotonic() - start, 1), run_dir=str(run_dir),
                    built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tmp / "base.json").write_text(json.dumps(info, indent=1))
        _write_manifest(tmp, ["state", "base.qcow2", "base.json"], {"key": key})
        _publish(tmp, final, prefix, keep=KEEP_BASES)
        _VERIFIED_BASES[str(final)] = (final / "manifest.json").stat().st_mtime
        log(f"base {final.name} built in {info['build_s']} s (state {(final / 'state').stat().st_size >> 20} MiB, "
            f"saved in {info['save_s']} s)")
        return Base(final, info, built=True)


def _create_overlay(path: Path, backing: Path, backing_format: str) -> None:
    path.unlink(missing_ok=True)
    proc = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", backing_format,
                           str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise VmError(f"qemu-img create {path} over {backing} failed: {proc.stderr.strip()}")


def _boot_and_save(argv: List[str], run_dir: Path, qmp_path: Path, state: Path) -> Optional[dict]:
    """One base boot: the runner's base-ready.json (what it did before the save), or None when the
    boot hung before the runner started (retried like a scenario's boot)."""
    results = run_dir / "results"
    start = time.monotonic()
    with open(run_dir / "qemu.log", "a") as qlog:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qlog, stderr=subprocess.STDOUT)
        try:
            qmp = Qmp(qmp_path, proc)
            while not (results / "base-ready.json").exists():
                now = time.monotonic()
                if proc.poll() is not None:
                    raise VmError(f"the base boot ended (qemu exit {proc.returncode}) before the runner was "
                                  f"ready; console {run_dir / 'console.log'}")
                if not (results / "started").exists() and now > start + BOOT_BUDGET_S:
                    return None
                if now > start + BOOT_BUDGET_S + BASE_READY_BUDGET_S:
                    raise VmError(f"the base's runner was not ready after {now - start:.0f} s; "
                                  f"console {run_dir / 'console.log'}")
                time.sleep(0.2)
            info = json.loads((results / "base-ready.json").read_text())
            info["save_s"] = round(_save_machine(qmp, state, proc), 1)
            qmp.command("quit")
            qmp.close()
            proc.wait(timeout=60)
            return info
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_scenario(name: str, image: Image, modules: Path, timeout: Optional[float] = None,
                 out_root: Optional[Path] = None, deb: Optional[Path] = None,
                 install: Optional[str] = None) -> RunResult:
    """Run one scenario in a guest of its own and collect its verdict: restored from the base
    snapshot for its hierarchy and install mode (ensure_base; built on first use), else (or
    when NVSYMLINKD_VM_SNAPSHOT=0) a fresh boot (-snapshot). deb: the package the guest installs
    for 'nvsymlinkd=deb' scenarios (build_package()). install: 'deb' or 'source' overrides how a
    scenario that wants nvsymlinkd gets it (never turns it on)."""
    if shutil.which("qemu-system-x86_64") is None:
        raise VmError("qemu-system-x86_64 is missing: apt-get install qemu-system-x86")
    opts = scenario_options(name)
    if install and opts["nvsymlinkd"] != "off":
        opts["nvsymlinkd"] = install
    if opts["nvsymlinkd"] not in ("off", "deb", "source"):
        raise VmError(f"{scenario_path(name)}: '# vm: nvsymlinkd={opts['nvsymlinkd']}' must be off, deb or source")
    if opts["packages"] not in ("", "upgrade"):
        raise VmError(f"{scenario_path(name)}: '# vm: packages={opts['packages']}' must be upgrade or absent")
    if (opts["nvsymlinkd"] == "deb" or opts["packages"]) and deb is None:
        raise VmError(f"{name} installs the .deb: pass deb=build_package().deb")
    timeout = timeout or float(opts["timeout"])
    # A base that cannot be built fails here, loudly: CI must not hide it behind fresh boots.
    base = (ensure_base(image, scenario_hierarchy(name), opts["nvsymlinkd"], deb)
            if snapshot_wanted(opts) else None)
    out_root = out_root or CACHE / "runs"
    out_root.mkdir(parents=True, exist_ok=True)
    for stale in sorted(out_root.iterdir())[:-KEEP_RUNS]:
        shutil.rmtree(stale, ignore_errors=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%dT%H%M%S')}-{name.replace('@', '-')}-",
                                    dir=out_root))
    (run_dir / "modules").mkdir()
    for ko in list(modules.glob("*.ko")) + [modules / prog for prog in STATIC_PROGRAMS + NVML_FILES]:
        shutil.copy(ko, run_dir / "modules" / ko.name)
    if opts["nvsymlinkd"] == "deb":
        shutil.copy(deb, run_dir / "nvsymlinkd.deb")
    if opts["packages"] == "upgrade":
        (run_dir / "debs").mkdir()
        newer = build_package(upgrade_version()).deb
        for package in (deb, newer):
            shutil.copy(package, run_dir / "debs" / package.name)
        package_repos(run_dir / "repos", deb, newer)
    (run_dir / "timeout").write_text(str(int(timeout)))
    (run_dir / "options.json").write_text(json.dumps(guest_options()))
    pod = stage_pod(run_dir) if opts["pod"] == "yes" else None
    cmdline = guest_cmdline(name, opts["nvsymlinkd"])
    start = time.monotonic()
    outcome, code, restore_s, fallback = None, None, None, ""
    if base is not None:
        argv = qemu_argv(image, run_dir, cmdline, disk=run_dir / "disk.qcow2", incoming=base.state)
        (run_dir / "qemu.argv").write_text(json.dumps(argv))
        (run_dir / "results").mkdir()
        try:
            _create_overlay(run_dir / "disk.qcow2", base.disk, "qcow2")
        except VmError as e:
            outcome, fallback = "restore failed", str(e)
        # the restored runner polls the share for this: it is the last thing in
        (run_dir / "scenarios.txt").write_text(name + "\n")
        if outcome is None:
            outcome, code, restore_s = _boot_once(argv, run_dir, timeout, budget=RESTORE_BUDGET_S)
        if outcome != "done" and restore_s is None and not fallback:
            # nothing of the scenario ran: qemu refused the state, or the guest never woke up
            fallback = (f"no runner within {RESTORE_BUDGET_S} s of qemu -incoming (qemu exit {code}; "
                        f"{(run_dir / 'qemu.log').read_text(errors='replace').strip()[-300:]})")
        if fallback:
            log(f"{name}: restoring {base.directory.name} failed ({fallback}); booting it fresh instead")
            for leftover in ("console.log", "results", "disk.qcow2"):
                if (run_dir / leftover).exists():
                    os.rename(run_dir / leftover, run_dir / f"restore-failed.{leftover}")
            outcome, restore_s = None, None
    else:
        (run_dir / "scenarios.txt").write_text(name + "\n")
    attempt = 1
    if outcome is None:
        argv = qemu_argv(image, run_dir, cmdline)
        (run_dir / "qemu.argv").write_text(json.dumps(argv))
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            shutil.rmtree(run_dir / "results", ignore_errors=True)
            (run_dir / "results").mkdir()
            outcome, code, _ = _boot_once(argv, run_dir, timeout)
            if outcome != "boot hung" or attempt == BOOT_ATTEMPTS:
                break
            # A TCG guest occasionally stalls early in boot (lost timer interrupts, RCU stall
            # warnings, runner never starts): nothing of the scenario ran, so boot it again.
            os.rename(run_dir / "console.log", run_dir / f"console.hung-{attempt}.log")
            log(f"{name}: boot hung (no runner after {BOOT_BUDGET_S} s), attempt {attempt} of {BOOT_ATTEMPTS}")
    wall = time.monotonic() - start
    (run_dir / "disk.qcow2").unlink(missing_ok=True)
    if pod is not None:
        keep_pod_image(run_dir, pod)
        for staged in ("podimage.tar", "podbase.tar"):
            (run_dir / staged).unlink(missing_ok=True)
    result = RunResult(name, run_dir, wall, outcome != "done", code, boot_attempts=attempt,
                       restore_s=restore_s, base=base.directory.name if base and restore_s is not None else None,
                       fallback=fallback)
    results = run_dir / "results"
    try:
        result.runner = json.loads((results / "runner.json").read_text())
    except (OSError, ValueError):
        pass
    if restore_s is not None and result.runner:
        # what only the host knows, kept with the guest's figures
        result.runner.update(restore_s=round(restore_s, 1), base=result.base)
        (results / "runner.json").write_text(json.dumps(result.runner, indent=1))
    try:
        result.result = json.loads((results / f"{name}.json").read_text())
    except (OSError, ValueError):
        pass
    return result


def _boot_once(argv: List[str], run_dir: Path, timeout: float, budget: float = BOOT_BUDGET_S):
    """One qemu run: ("done" | "boot hung" | "timed out", qemu exit code or "results", seconds from
    qemu start to the runner's marker). qemu is killed as soon as runner.json is there: the runner
    writes it last, by a rename, after journal.txt, and the share is synchronous, so nothing is
    left to wait for (the guest's poweroff took up to 30 s more)."""
    results = run_dir / "results"
    start = time.monotonic()
    outcome = "timed out"
    started_s = None
    with open(run_dir / "qemu.log", "a") as qlog:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qlog, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            now = time.monotonic()
            if started_s is None and (results / "started").exists():
                started_s = now - start
            if (results / "runner.json").exists():
                break
            if started_s is None and now > start + budget:
                outcome = "boot hung"
                break
            if now > start + budget + timeout + 60:
                break
            time.sleep(0.1 if started_s is None else 0.5)
        code = proc.poll()
        if code is None:
            proc.kill()
            proc.wait()
            code = proc.returncode
    if (results / "runner.json").exists():
        outcome = "done"
        if code == -9:
            code = "results"
    return outcome, code, started_s


def console_tail(result: RunResult, chars: int = 4000) -> str:
    try:
        return result.console.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no console log)"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="vmhost.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) the guest image")
    b.add_argument("--force", action="store_true", help="rebuild even if the cache verifies")
    sub.add_parser("modules", help="build (or reuse) the fake NVIDIA modules")
    d = sub.add_parser("deb", help="build (or reuse) the project's .deb that 'nvsymlinkd=deb' scenarios install")
    d.add_argument("--upgrade", action="store_true", help="build the same source as the next higher version, as "
                   "'packages=upgrade' scenarios do")
    lst = sub.add_parser("list", help="list scenarios")
    lst.add_argument("--shard", default="", metavar="I/N", help="only the I-th of N shards (scripts/test's "
                     "NVSYMLINKD_VM_SHARD)")
    r = sub.add_parser("run", help="boot one fresh guest per scenario and print the verdicts")
    r.add_argument("scenarios", nargs="*", help="scenario names (default: all)")
    r.add_argument("--timeout", type=float, help="seconds per scenario (default: the script's own)")
    r.add_argument("--nvsymlinkd", choices=("deb", "source"),
                   help="install nvsymlinkd this way in scenarios that use it (default: the script's "
                        "'# vm:' line); 'source' skips the package build, for quick iteration")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            print("\n".join(shard_cells(list_scenarios(), args.shard)))
            return 0
        if args.cmd == "modules":
            print(build_modules())
            return 0
        if args.cmd == "deb":
            print(build_package(upgrade_version() if args.upgrade else None).deb)
            return 0
        image = build_image(force=getattr(args, "force", False))
        if args.cmd == "build":
            print(image.directory)
            return 0
        modules = build_modules(image.kernel)
        names = args.scenarios or list_scenarios()
        deb = None
        if any(scenario_options(n)["nvsymlinkd"] == "deb" or scenario_options(n)["packages"] for n in names) \
                and args.nvsymlinkd != "source":
            deb = build_package().deb
        failed = 0
        for name in names:
            result = run_scenario(name, image, modules, timeout=args.timeout, deb=deb, install=args.nvsymlinkd)
            print(result.summary(), flush=True)
            print(f"  run dir: {result.run_dir}")
            if not (result.result and result.result.get("ok")):
                failed += 1
                print(console_tail(result, 2000))
        return 1 if failed else 0
    except VmError as e:
        print(f"vm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # run as `python3 tests/vm/vmhost.py ...`: the checkout's root on the path, for tests.debbuild
    sys.path.insert(0, str(REPO))
    sys.exit(main())
