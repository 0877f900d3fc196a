"""`nvsymlinkd sync` against fake host trees with real mknod'ed nodes (needs root)."""

import json
import os
import stat

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.devchar.reconcile import reconcile
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import FakeHost, standard_host

pytestmark = pytest.mark.root


def sync(host, dry_run=False, **cfg):
    return reconcile(HostRoot(str(host.root)), Config(**cfg), dry_run=dry_run)


def kinds(result):
    return {a.link or a.target: a.action for a in result.plan.actions}


def tree(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_rdev, os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
    return out


@pytest.mark.parametrize("names", [("nvidia-frontend",), ("nvidia", "nvidiactl", "nvidia-modeset")])
def test_creates_relative_links_for_both_major_names(tmp_path, need_root, names):
    host = standard_host(tmp_path, uvm_major=511, names=names)
    result = sync(host)
    assert result.as_desired and not result.errors
    assert host.links() == {
        "195:0": "../nvidia0", "195:1": "../nvidia1", "195:254": "../nvidia-modeset",
        "195:255": "../nvidiactl", "511:0": "../nvidia-uvm", "511:1": "../nvidia-uvm-tools",
    }
    # links really resolve to the right devices
    st = os.stat(host.path("/dev/char/195:1"))
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 1)


def test_second_sync_plans_only_keep(tmp_path, need_root):
    host = standard_host(tmp_path)
    sync(host)
    again = sync(host)
    assert {a.action for a in again.plan.actions} == {"keep"}
    assert again.summary()["keep"] == 6


def test_dry_run_changes_nothing(tmp_path, need_root):
    host = standard_host(tmp_path)
    host.symlink("/dev/char/510:0", "../nvidia-gone")  # stale: would be replaced
    before = tree(host.root)
    result = sync(host, dry_run=True, create_nodes=True)
    assert result.plan.changes and not result.as_desired
    assert tree(host.root) == before


def test_driver_root_links_point_into_it(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({"nvidia": 195, "nvidia-uvm": 500})
    host.node("/run/nvidia/driver/dev/nvidia0", 195, 0)
    host.node("/run/nvidia/driver/dev/nvidiactl", 195, 255)
    host.node("/run/nvidia/driver/dev/nvidia-uvm", 500, 0)
    host.node("/dev/nvidia7", 195, 7)  # on the host's /dev, not in the driver root: not searched
    sync(host, driver_root="/run/nvidia/driver")
    assert host.links() == {
        "195:0": "../../run/nvidia/driver/dev/nvidia0",
        "195:255": "../../run/nvidia/driver/dev/nvidiactl",
        "500:0": "../../run/nvidia/driver/dev/nvidia-uvm",
    }
    assert os.path.exists(host.path("/dev/char/195:0"))


def test_mig_caps_nvswitch_imex_nvlink(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({"nvidia": 195, "nvidia-caps": 235, "nvidia-caps-imex-channels": 234,
                       "nvidia-nvswitch": 240, "nvidia-nvlink": 241})
    host.node("/dev/nvidia-caps/nvidia-cap1", 235, 1)
    host.node("/dev/nvidia-caps/nvidia-cap2", 235, 2)
    host.node("/dev/nvidia-caps-imex-channels/channel0", 234, 0)
    host.node("/dev/nvidia-nvswitch0", 240, 0)
    host.node("/dev/nvidia-nvswitchctl", 240, 255)
    host.node("/dev/nvidia-nvlink", 241, 0)
    sync(host)
    assert host.links() == {
        "235:1": "../nvidia-caps/nvidia-cap1", "235:2": "../nvidia-caps/nvidia-cap2",
        "234:0": "../nvidia-caps-imex-channels/channel0",
        "240:0": "../nvidia-nvswitch0", "240:255": "../nvidia-nvswitchctl", "241:0": "../nvidia-nvlink",
    }


def test_stale_links_after_uvm_major_change(tmp_path, need_root):
    host = standard_host(tmp_path, uvm_major=511)
    host.symlink("/dev/char/237:0", "../nvidia-uvm")      # old major, now gone
    host.symlink("/dev/char/237:1", "../nvidia-uvm-tools")
    host.symlink("/dev/char/511:0", "../nvidia-old-name")  # dangling NVIDIA link at a desired path
    result = sync(host)
    k = kinds(result)
    assert k["/dev/char/237:0"] == k["/dev/char/237:1"] == "remove"
    assert k["/dev/char/511:0"] == "replace"
    assert k["/dev/char/511:1"] == "create"
    assert "237:0" not in host.links() and host.links()["511:0"] == "../nvidia-uvm"


def test_link_to_wrong_nvidia_device_is_replaced(tmp_path, need_root):
    host = standard_host(tmp_path)
    host.symlink("/dev/char/195:0", "../nvidia1")  # resolves to 195:1
    result = sync(host)
    assert kinds(result)["/dev/char/195:0"] == "replace"
    assert host.links()["195:0"] == "../nvidia0"


def test_foreign_links_and_conflicts_are_never_touched(tmp_path, need_root):
    host = standard_host(tmp_path)
    host.node("/dev/null", 1, 3)
    host.symlink("/dev/char/1:3", "../null")
    host.symlink("/dev/char/195:0", "../sda")          # foreign symlink at a desired path
    host.write("/dev/char/195:1", "not a link\n")       # a regular file
    host.path("/dev/char/195:255").mkdir()              # a directory
    host.node("/dev/char/195:254", 195, 254)            # a node
    before = tree(host.root / "dev" / "char")
    result = sync(host)
    k = kinds(result)
    for link in ("195:0", "195:1", "195:255", "195:254"):
        assert k[f"/dev/char/{link}"] == "conflict"
    assert "/dev/char/1:3" not in k
    after = tree(host.root / "dev" / "char")
    for p, v in before.items():
        assert after[p] == v
    assert not result.as_desired  # exit 1


def test_valid_absolute_ctk_style_link_is_kept(tmp_path, need_root):
    host = standard_host(tmp_path)
    host.symlink("/dev/char/195:0", "/dev/nvidia0")  # nvidia-ctk makes absolute links
    result = sync(host)
    assert kinds(result)["/dev/char/195:0"] == "keep"
    assert host.links()["195:0"] == "/dev/nvidia0"


def test_absolute_link_resolves_inside_the_root_not_on_the_real_host(tmp_path, need_root):
    host = standard_host(tmp_path)
    os.unlink(host.path("/dev/nvidia1"))
    host.symlink("/dev/char/195:1", "/dev/nvidia1")  # dangling inside the root
    result = sync(host)
    assert kinds(result)["/dev/char/195:1"] == "remove"


def test_stale_node_with_foreign_major_is_ignored(tmp_path, need_root):
    host = standard_host(tmp_path, uvm_major=511)
    os.unlink(host.path("/dev/nvidia-uvm"))
    host.node("/dev/nvidia-uvm", 195, 9)  # uvm node carrying the frontend major: stale
    host.node("/dev/nvidia-fake", 195, 5)  # not an NVIDIA node name
    host.write("/dev/nvidia3", "")  # not a char device
    result = sync(host)
    assert "195:9" not in host.links() and "195:5" not in host.links() and "195:3" not in host.links()
    assert any("nvidia-uvm" in n and "stale" in n for n in result.plan.notes)


def test_read_only_dev_char_reports_errors_not_crash(tmp_path, need_root):
    host = standard_host(tmp_path)
    d = host.path("/dev/char")
    d.mkdir()
    os.system(f"mount -t tmpfs -o ro tmpfs {d}")
    try:
        if not os.path.ismount(d):
            pytest.skip("cannot mount a read-only tmpfs here")
        result = sync(host)
    finally:
        os.system(f"umount {d}")
    assert result.errors and all(o.error == "read-only file system" for o in result.errors)
    assert not result.as_desired


def test_dev_char_is_a_file(tmp_path, need_root):
    host = standard_host(tmp_path)
    host.write("/dev/char", "")
    result = sync(host)
    assert {a.action for a in result.plan.actions} == {"conflict"}


def test_create_nodes_with_owner_and_mode_from_params(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({"nvidia": 195, "nvidia-modeset": 195, "nvidia-uvm": 509, "nvidia-caps": 236})
    host.gpu("0000:3b:00.0", 0)
    host.gpu("0000:86:00.0", 2)
    host.params(uid=0, gid=44, mode=0o660)
    host.mig_minors({"config": 1, "monitor": 2, "gpu0/gi1/access": 12})
    host.write("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: 1\nDeviceFileMode: 256\n")
    host.write("/proc/driver/nvidia/capabilities/mig/monitor", "DeviceFileMinor: 2\nDeviceFileMode: 292\n")
    host.write("/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access", "DeviceFileMinor: 12\nDeviceFileMode: 292\n")
    result = sync(host, create_nodes=True)
    assert not result.errors, result.errors
    expected = {"/dev/nvidiactl": (195, 255), "/dev/nvidia-modeset": (195, 254), "/dev/nvidia0": (195, 0),
                "/dev/nvidia2": (195, 2), "/dev/nvidia-uvm": (509, 0), "/dev/nvidia-uvm-tools": (509, 1),
                "/dev/nvidia-caps/nvidia-cap1": (236, 1), "/dev/nvidia-caps/nvidia-cap2": (236, 2),
                "/dev/nvidia-caps/nvidia-cap12": (236, 12)}
    for inside, rdev in expected.items():
        st = os.lstat(host.path(inside))
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev
    assert stat.S_IMODE(os.lstat(host.path("/dev/nvidia0")).st_mode) == 0o660
    assert os.lstat(host.path("/dev/nvidia0")).st_gid == 44
    assert stat.S_IMODE(os.lstat(host.path("/dev/nvidia-caps/nvidia-cap1")).st_mode) == 0o400
    assert host.links()["236:12"] == "../nvidia-caps/nvidia-cap12"
    assert not [p for p in os.listdir(host.path("/dev")) if p.startswith(".nvsymlinkd")]
    again = sync(host, create_nodes=True)
    assert {a.action for a in again.plan.actions} == {"keep"}


def test_create_nodes_without_driver_names_the_module(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({})
    host.gpu("0000:3b:00.0", 0)
    result = sync(host, create_nodes=True)
    assert any("modprobe nvidia" in n for n in result.plan.notes)
    host.proc_devices({"nvidia": 195})
    result = sync(host, create_nodes=True)
    assert any("modprobe nvidia-uvm" in n for n in result.plan.notes)
    assert os.path.exists(host.path("/dev/nvidia0"))


def test_create_nodes_never_clobbers(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({"nvidia": 195})
    host.write("/dev/nvidiactl", "a regular file someone left")
    result = sync(host, create_nodes=True)
    assert kinds(result)["/dev/nvidiactl"] == "conflict"
    assert host.path("/dev/nvidiactl").read_text() == "a regular file someone left"


def test_cli_json_schema_and_exit_codes(tmp_path, need_root, nvsymlinkd_cli):
    host = standard_host(tmp_path)
    proc = nvsymlinkd_cli("--root", host.root, "sync", "--json", check=0)
    doc = json.loads(proc.stdout)
    assert set(doc) == {"schema_version", "dry_run", "actions", "summary", "notes", "warnings"}
    assert doc["summary"]["create"] == 6 and doc["summary"]["error"] == 0
    a = next(x for x in doc["actions"] if x["link"] == "/dev/char/195:0")
    assert a == {"action": "create", "link": "/dev/char/195:0", "target": "../nvidia0",
                 "device": "c 195:0", "reason": "no link for /dev/nvidia0"}
    # output never shows the fake root's real location
    assert str(host.root) not in proc.stdout
    host.write("/dev/char/195:0.tmp", "")
    os.unlink(host.path("/dev/char/195:0"))
    host.write("/dev/char/195:0", "")
    human = nvsymlinkd_cli("--root", host.root, "sync", check=1)
    assert "conflict /dev/char/195:0" in human.stdout
    assert str(host.root) not in human.stdout


def test_cli_human_output(tmp_path, need_root, nvsymlinkd_cli):
    host = standard_host(tmp_path, gpus=1)
    out = nvsymlinkd_cli("--root", host.root, "sync", "--dry-run", check=1).stdout.splitlines()
    assert out[0] == "would create /dev/char/195:0 -> ../nvidia0 (c 195:0): no link for /dev/nvidia0"
    assert out[-1].startswith("sync (dry run): 5 NVIDIA nodes; ")
    nvsymlinkd_cli("--root", host.root, "sync", check=0)
    out = nvsymlinkd_cli("--root", host.root, "sync", check=0).stdout.splitlines()
    assert out == ["sync: 5 NVIDIA nodes; 0 links created, 5 kept"]
