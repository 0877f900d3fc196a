"""End to end on a real systemd host: each scenario boots a fresh Debian 12 guest under qemu
(TCG) and judges container GPU access by open() inside the container. See docs/vm.md.

In CI (CI=true) these must run: a missing tool or an unbuildable image (mirror down) fails.
Elsewhere they skip when qemu/mmdebstrap/headers are absent or when not root.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest
import vmhost
from conftest import IN_CI, need_tool

SCENARIOS = vmhost.list_scenarios()


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"CI must run the VM tests, but: {reason}", pytrace=False)
    pytest.skip(reason)


def _report(capsys, text: str) -> None:
    # Timings are the point of these tests: show them even when pytest captures output.
    with capsys.disabled():
        print("\n" + text, flush=True)


@pytest.fixture(scope="module")
def vm_assets():
    """(image, modules dir, package, seconds spent building): built once, reused from the cache after."""
    if os.geteuid() != 0:
        _unavailable("the VM tests need root (mmdebstrap --mode=root, mkfs.ext4 -d)")
    for tool in ("qemu-system-x86_64", "mmdebstrap", "mkfs.ext4", "make", "gcc", "dpkg-buildpackage",
                 "dh", "pybuild"):
        need_tool(tool)
    try:
        kernel = vmhost.guest_kernel()
    except vmhost.VmError as e:
        _unavailable(str(e))
    start = time.monotonic()
    try:
        image = vmhost.build_image()
        modules = vmhost.build_modules(kernel)
    except vmhost.VmError as e:
        pytest.fail(f"cannot build the VM guest image: {e}", pytrace=False)
    try:
        package = vmhost.build_package()
    except vmhost.VmError as e:
        pytest.fail(f"cannot build the .deb the guest installs: {e}", pytrace=False)
    return image, modules, package, time.monotonic() - start


@pytest.mark.root
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario, vm_assets, capsys):
    image, modules, package, prep_s = vm_assets
    result = vmhost.run_scenario(scenario, image, modules, deb=package.deb)
    header = (f"vm image {image.directory.name}: "
              + (f"built in {image.build_s:.0f} s" if image.built else "cached")
              + f"; {package.deb.name} " + (f"built in {package.build_s:.0f} s" if package.built else "cached")
              + f" (image+modules+deb step {prep_s:.1f} s)")
    _report(capsys, header + "\n" + result.summary() + f"\n  run dir: {result.run_dir}")
    assert result.result is not None, (
        f"{scenario}: no verdict came back (timed out: {result.timed_out}); "
        f"console tail:\n{vmhost.console_tail(result, 1500)}")
    failed = [c for c in result.result["checks"] if not c["ok"]]
    assert result.result["ok"], (
        f"{scenario} failed: {failed or result.result.get('error')}\n"
        f"see {result.run_dir}/results/{scenario}.log and journal.txt")


def test_scenarios_are_present():
    assert "s01_reload_loses_gpu" in SCENARIOS, SCENARIOS
    assert "s06_journal_and_status" in SCENARIOS, SCENARIOS


def test_daemon_scenarios_install_the_deb():
    """What the issue asks to prove runs against the package users install, not the source tree."""
    modes = {name: vmhost.scenario_options(name)["nvsymlinkd"] for name in SCENARIOS}
    for name, mode in modes.items():
        assert mode in ("off", "deb", "source"), (name, mode)
        if name[:3] in ("s02", "s03", "s04", "s05", "s06", "s07", "s08"):
            assert mode == "deb", f"{name} runs nvsymlinkd={mode}, not the .deb"


def test_cache_entry_rejects_partial_and_corrupt(tmp_path, monkeypatch):
    """A cache entry is trusted only if its manifest (written last) matches every file."""
    entry = tmp_path / "image-x"
    entry.mkdir()
    (entry / "rootfs.img").write_bytes(b"\0" * 4096)
    assert not vmhost.cache_entry_ok(entry), "no manifest yet: a partial build"
    vmhost._write_manifest(entry, ["rootfs.img"], {})
    assert vmhost.cache_entry_ok(entry)
    with open(entry / "rootfs.img", "r+b") as f:
        f.write(b"x")
    assert not vmhost.cache_entry_ok(entry), "same size, different content"
    (entry / "rootfs.img").write_bytes(b"\0" * 100)
    assert not vmhost.cache_entry_ok(entry), "truncated"
    (entry / "manifest.json").write_text("{not json")
    assert not vmhost.cache_entry_ok(entry)


def test_image_key_follows_inputs(monkeypatch):
    kernel = vmhost.GuestKernel("6.1.0-99-amd64", "6.1.999-1")
    other = vmhost.GuestKernel("6.1.0-98-amd64", "6.1.998-1")
    assert vmhost.image_key(kernel) == vmhost.image_key(kernel)
    assert vmhost.image_key(kernel) != vmhost.image_key(other)
    monkeypatch.setattr(vmhost, "RECIPE", vmhost.RECIPE + 1)
    changed = vmhost.image_key(kernel)
    monkeypatch.undo()
    assert changed != vmhost.image_key(kernel)


def test_hierarchies_and_matrix_select_scenarios(tmp_path, monkeypatch):
    """'# vm: hierarchies=v2,v1' lists NAME and NAME@v1 (booted systemd.unified_cgroup_hierarchy=0);
    'matrix=full' scenarios, and 'full=v1' hierarchies, run only with NVSYMLINKD_VM_MATRIX=full."""
    (tmp_path / "s90_both.py").write_text("# vm: nvsymlinkd=off hierarchies=v2,v1\n")
    (tmp_path / "s91_full_only.py").write_text("# vm: nvsymlinkd=deb matrix=full hierarchies=v1\n")
    (tmp_path / "s92_plain.py").write_text('"""doc"""\n')
    (tmp_path / "s93_v1_in_full.py").write_text("# vm: nvsymlinkd=deb full=v1\n")
    monkeypatch.setattr(vmhost, "SCENARIOS_DIR", tmp_path)
    monkeypatch.delenv("NVSYMLINKD_VM_MATRIX", raising=False)
    assert vmhost.list_scenarios() == ["s90_both", "s90_both@v1", "s92_plain", "s93_v1_in_full"]
    monkeypatch.setenv("NVSYMLINKD_VM_MATRIX", "full")
    assert vmhost.list_scenarios() == ["s90_both", "s90_both@v1", "s91_full_only@v1", "s92_plain",
                                       "s93_v1_in_full", "s93_v1_in_full@v1"]
    assert vmhost.scenario_path("s90_both@v1") == tmp_path / "s90_both.py"
    assert [vmhost.scenario_hierarchy(n) for n in ("s90_both", "s90_both@v1")] == ["v2", "v1"]
    with pytest.raises(vmhost.VmError):
        vmhost.scenario_hierarchy("s90_both@v3")
    assert vmhost.guest_cmdline("s90_both", "off") == "nvsymlinkd.vm=off"
    assert vmhost.guest_cmdline("s90_both@v1", "deb") == "nvsymlinkd.vm=deb systemd.unified_cgroup_hierarchy=0"


def test_pod_image_key_follows_its_inputs(tmp_path, monkeypatch):
    """The cached DaemonSet image is rebuilt when the Dockerfile, the package or its apt line change,
    not when a test run leaves bytecode behind."""
    import shutil
    for rel in vmhost.IMAGE_INPUTS:
        src = vmhost.REPO / rel
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, tmp_path / rel)
    monkeypatch.setattr(vmhost, "REPO", tmp_path)
    monkeypatch.setattr(vmhost, "KUBE_DIR", tmp_path / "deploy" / "kubernetes")
    key = vmhost.pod_image_key()
    (tmp_path / "nvsymlinkd" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "nvsymlinkd" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    assert vmhost.pod_image_key() == key
    (tmp_path / "nvsymlinkd" / "metrics.py").write_text("# changed\n")
    changed = vmhost.pod_image_key()
    assert changed != key
    dockerfile = tmp_path / "deploy" / "kubernetes" / "Dockerfile"
    base = vmhost.pod_base_key()
    dockerfile.write_text(dockerfile.read_text().replace("python3-pyudev", "python3-pyudev \\\n        kmod"))
    assert "kmod" in vmhost.dockerfile_apt_packages()
    assert vmhost.pod_base_key() != base and vmhost.pod_image_key() != changed


def test_pod_scenarios_default_and_full():
    """Every pod proof runs in the default run on one hierarchy, and on the other in the full matrix:
    the main proof (s20) and rolling + both overlays (s21, one boot)."""
    names = vmhost.list_scenarios("default")
    full = vmhost.list_scenarios("full")
    for stem in ("s20_pod_keeps_gpu", "s21_pod_rolling_and_overlays"):
        assert vmhost.scenario_options(stem)["pod"] == "yes", stem
        cells = [n for n in full if n.split("@")[0] == stem]
        assert sorted(cells) == [stem, stem + "@v1"], cells
        assert any(n in names for n in cells), (stem, names)


def test_upgrade_package_is_a_higher_version_of_the_same_source(tmp_path):
    """'packages=upgrade' scenarios upgrade to the tree rebuilt as upgrade_version(): dpkg must
    see it as higher, and the program inside must say the same version."""
    need_tool("dpkg-parsechangelog")
    import debbuild

    for rel in ("nvsymlinkd/__init__.py", "debian/changelog"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(vmhost.REPO / rel, tmp_path / rel)
    current = re.search(r'__version__ = "(.+)"', (vmhost.REPO / "nvsymlinkd/__init__.py").read_text()).group(1)
    newer = vmhost.upgrade_version()
    debbuild.bump_version(tmp_path, newer)
    parsed = subprocess.run(["dpkg-parsechangelog", "-l", str(tmp_path / "debian/changelog"), "-S", "Version"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert parsed == newer
    assert subprocess.run(["dpkg", "--compare-versions", newer, "gt", current]).returncode == 0, (newer, current)
    assert f'__version__ = "{newer}"' in (tmp_path / "nvsymlinkd/__init__.py").read_text()


def test_packages_option_needs_the_deb(tmp_path, monkeypatch):
    (tmp_path / "s95_upgrade.py").write_text("# vm: nvsymlinkd=off packages=upgrade\n")
    (tmp_path / "s96_typo.py").write_text("# vm: nvsymlinkd=off packages=upgrad\n")
    monkeypatch.setattr(vmhost, "SCENARIOS_DIR", tmp_path)
    monkeypatch.setattr(shutil, "which", lambda tool: "/usr/bin/" + tool)
    assert vmhost.scenario_options("s95_upgrade")["packages"] == "upgrade"
    for name, message in (("s95_upgrade", "pass deb="), ("s96_typo", "must be upgrade")):
        with pytest.raises(vmhost.VmError, match=message):
            vmhost.run_scenario(name, None, tmp_path, out_root=tmp_path / "runs")
