"""The rendered udev rule, run by the real udevadm against real sysfs module directories.

`udevadm test` runs in a private mount namespace (unshare -m): a tmpfs over /run takes the
udev database it writes, the rule is bind-mounted over /etc/udev/rules.d, and a tmpfs over
/sys/module presents two real sysfs module directories (sd-device refuses anything that is
not sysfs) under the names the test needs: `nvidia_uvm` (this machine has no NVIDIA driver)
and an unrelated module. The host is not touched.
"""

import os
import subprocess
import textwrap

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.systemd.render import RULES, render_all
from tests.conftest import need_tool

UNRELATED = "loop"


def real_modules(count: int) -> list:
    names = sorted(n for n in os.listdir("/sys/module")
                   if not n.startswith("nvidia") and os.path.isdir(f"/sys/module/{n}"))
    if len(names) < count:
        pytest.fail(f"/sys/module has {len(names)} modules; need {count}")
    return names[:count]


@pytest.fixture(scope="module")
def udev_properties(tmp_path_factory, request):
    """{(module name, action): {property: value}} from udevadm test of the rendered rule."""
    if os.geteuid() != 0:
        from tests.conftest import skip_or_fail
        skip_or_fail("needs root (unshare -m, mounts)")
    udevadm = need_tool("udevadm")
    unshare = need_tool("unshare")
    tmp = tmp_path_factory.mktemp("udev")
    (tmp / "rules").mkdir()
    (tmp / "rules" / RULES).write_text(render_all(Config())[RULES])
    (tmp / "realmod").mkdir()
    src_uvm, src_other = real_modules(2)
    cases = [("nvidia_uvm", "add"), ("nvidia_uvm", "remove"), ("nvidia_uvm", "change"), (UNRELATED, "add")]
    script = textwrap.dedent(f"""\
        set -eu
        mount -t tmpfs nvsymlinkd-test /run
        mount --bind {tmp}/rules /etc/udev/rules.d
        mount --bind /sys/module {tmp}/realmod
        mount -t tmpfs nvsymlinkd-test /sys/module
        mkdir /sys/module/nvidia_uvm /sys/module/{UNRELATED}
        mount --bind {tmp}/realmod/{src_uvm} /sys/module/nvidia_uvm
        mount --bind {tmp}/realmod/{src_other} /sys/module/{UNRELATED}
        """)
    for module, action in cases:
        # a fresh udev database per event: each result comes from the rules alone
        script += f"rm -rf /run/udev\necho '@@@ {module} {action}'\n{udevadm} test --action={action} /sys/module/{module} 2>/dev/null\n"
    proc = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("@@@ "):
            _, module, action = line.split()
            current = result.setdefault((module, action), {})
        elif current is not None and "=" in line and line.split("=", 1)[0].isupper():
            key, value = line.split("=", 1)
            current[key] = value
    assert set(result) == set(cases), proc.stdout
    return result


def test_nvidia_uvm_load_pulls_in_the_service(udev_properties):
    props = udev_properties[("nvidia_uvm", "add")]
    assert props["SUBSYSTEM"] == "module" and props["DEVPATH"] == "/module/nvidia_uvm"
    assert "nvsymlinkd.service" in props["SYSTEMD_WANTS"].split()
    assert ":systemd:" in props["TAGS"]


def test_unrelated_module_is_left_alone(udev_properties):
    props = udev_properties[(UNRELATED, "add")]
    assert props["SUBSYSTEM"] == "module"  # the event itself was processed
    assert "nvsymlinkd.service" not in props.get("SYSTEMD_WANTS", "")


@pytest.mark.parametrize("action", ["remove", "change"])
def test_only_add_events_start_it(udev_properties, action):
    props = udev_properties[("nvidia_uvm", action)]
    assert props["ACTION"] == action
    assert "nvsymlinkd.service" not in props.get("SYSTEMD_WANTS", "")


def test_rule_has_no_run_key():
    rule = render_all(Config())[RULES]
    body = [ln for ln in rule.splitlines() if ln and not ln.startswith("#")]
    assert not any("RUN" in ln for ln in body)
    assert any('SUBSYSTEM=="pci", ACTION=="bind", DRIVER=="nvidia"' in ln for ln in body)
