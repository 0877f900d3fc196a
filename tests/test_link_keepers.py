"""`nvsymlinkd check` says once, as info, when another /dev/char link keeper is installed:
nvidia-ctk's create-dev-char-symlinks in a udev rule or a unit, or the GPU Operator's validator."""

import json

CTK_RULE = ('ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
            'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"\n')


def ready_host(fakehost, nvsymlinkd_cli):
    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    fakehost.node("/dev/nvidiactl", 195, 255)
    nvsymlinkd_cli("--root", fakehost.root, "sync", check=0)


def keeper_lines(proc):
    return [line.strip() for line in proc.stdout.splitlines() if "link-keepers" in line]


def test_no_other_keeper_no_line(fakehost, nvsymlinkd_cli):
    ready_host(fakehost, nvsymlinkd_cli)
    fakehost.write("/lib/udev/rules.d/71-nvsymlinkd.rules", 'ACTION=="add", TAG+="systemd"\n')
    fakehost.write("/etc/udev/rules.d/99-other.rules", '# create-dev-char-symlinks used to run here\n')
    proc = nvsymlinkd_cli("--root", fakehost.root, "check", "--no-bus", check=0)
    assert keeper_lines(proc) == []


def test_nvidia_ctk_rule_and_unit_said_once_as_info(fakehost, nvsymlinkd_cli):
    ready_host(fakehost, nvsymlinkd_cli)
    fakehost.write("/lib/udev/rules.d/71-nvidia-dev-char.rules", CTK_RULE)
    fakehost.write("/etc/systemd/system/nvidia-dev-char.service",
                   "[Service]\nType=oneshot\nExecStart=/usr/bin/nvidia-ctk system create-dev-char-symlinks "
                   "--create-all\n")
    proc = nvsymlinkd_cli("--root", fakehost.root, "check", "--no-bus", check=0)  # info: exit stays 0
    lines = keeper_lines(proc)
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("info link-keepers: nvidia-ctk system create-dev-char-symlinks runs from "
                               "/lib/udev/rules.d/71-nvidia-dev-char.rules, "
                               "/etc/systemd/system/nvidia-dev-char.service")
    doc = json.loads(nvsymlinkd_cli("--root", fakehost.root, "check", "--no-bus", "--json", check=0).stdout)
    keepers = [h for h in doc["host"] if h["kind"] == "link-keepers"]
    assert len(keepers) == 1 and keepers[0]["status"] == "info"


def test_rule_in_etc_masks_the_packaged_one(fakehost, nvsymlinkd_cli):
    """udev reads one file per name, /etc first: an emptied /etc copy disables nvidia-ctk's rule."""
    ready_host(fakehost, nvsymlinkd_cli)
    fakehost.write("/lib/udev/rules.d/71-nvidia-dev-char.rules", CTK_RULE)
    fakehost.write("/etc/udev/rules.d/71-nvidia-dev-char.rules", "")
    proc = nvsymlinkd_cli("--root", fakehost.root, "check", "--no-bus", check=0)
    assert keeper_lines(proc) == []


def test_gpu_operator_validator(fakehost, nvsymlinkd_cli):
    ready_host(fakehost, nvsymlinkd_cli)
    fakehost.path("/run/nvidia/validations").mkdir(parents=True)
    proc = nvsymlinkd_cli("--root", fakehost.root, "check", "--no-bus", check=0)
    lines = keeper_lines(proc)
    assert len(lines) == 1 and "GPU Operator's validator" in lines[0]
    assert "DISABLE_DEV_CHAR_SYMLINK_CREATION" in lines[0]
