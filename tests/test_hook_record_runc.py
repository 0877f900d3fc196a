"""The NVIDIA hook's inputs recorded at a container's first sight (issue 34 item 4), kernel-judged.

Real runc containers (tests/test_hook_trust_runc.py's fake hook grants what the real one would). The
daemon's pass (verify_all as ContainerWatch calls it, in a process of its own: every pass here is a
daemon started afresh) records the inputs; the site then edits its toolkit config; `repair` (another
process, reading the record) must judge the container on what the hook read when it ran. The kernel
says what was granted: ENXIO through the device cgroup, EPERM denied.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.test_hook_trust_runc import (
    REFUSE_UNPRIVILEGED,
    check_json,
    fake_driver,
    hook_granted,
    one,
)

CONFIG = "/etc/nvidia-container-runtime/config.toml"
ACCEPT_UNPRIVILEGED = "accept-nvidia-visible-devices-envvar-when-unprivileged = true\n"

DAEMON_PASS = r"""
import json, sys
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.verify import verifier
from nvsymlinkd.verify.cache import VerifyCache
report = verifier.verify_all(HostRoot(sys.argv[1]), Config(), use_bus=False, with_host=False, cache=VerifyCache(),
                             record_inputs=True)
print(json.dumps({c.id: c.to_json()["nvidia_hook"] for c in report.containers}))
"""


def daemon_pass(root) -> dict:
    """A daemon's pass (no baseline: only the record may carry the grant), in a new process."""
    ran = subprocess.run([sys.executable, "-c", DAEMON_PASS, str(root)], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).parent.parent))
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def test_a_grant_first_seen_accepted_stays_granted_after_the_config_refuses(runc_host, nvsymlinkd_cli):
    fake_driver(runc_host)
    root = runc_host.root
    runc_host.fake.write(CONFIG, ACCEPT_UNPRIVILEGED)
    c = hook_granted(runc_host, "hr-accepted", "1", ("c 195:255 rw", "c 195:1 rw"))
    first = daemon_pass(root)[c.id]
    assert first["devices"] == {"c 195:1": "rw", "c 195:255": "rw"}, first
    assert first["inputs"]["recorded"] is True
    recorded_at = first["inputs"]["recorded_at"]
    assert (root / f"run/nvsymlinkd/hookinputs/{c.id}.json").is_file()
    # the site refuses unprivileged env requests from now on; a reload takes the hook's grant
    runc_host.fake.write(CONFIG, REFUSE_UNPRIVILEGED)
    c.deny("c 195:1 rw")
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"
    got = one(check_json(nvsymlinkd_cli, root))
    assert got["verdict"] == "lost", got
    inputs = got["nvidia_hook"]["inputs"]
    assert inputs["recorded"] is True and inputs["recorded_at"] == recorded_at
    assert inputs["differences"] == [f"config {CONFIG}: edited since",
                                     "config accept_envvar_unprivileged: True then, False now"], inputs
    human = nvsymlinkd_cli("--root", root, "check", "--no-bus", "--no-host", check=1).stdout
    assert "judged on the inputs recorded at its first sight; the host's differ now" in human, human
    assert "accept_envvar_unprivileged: True then, False now" in human, human
    nvsymlinkd_cli("--root", root, "repair", check=0)
    assert c.open_error("/dev/nvidia1", rw=True) == "ENXIO"  # given back: the hook granted it
    # a restarted daemon keeps the record made at first sight, and judges on it
    again = daemon_pass(root)[c.id]
    assert again["inputs"]["recorded_at"] == recorded_at and again["devices"] == first["devices"], again


def test_a_request_first_seen_refused_stays_refused_after_the_config_accepts(runc_host, nvsymlinkd_cli):
    fake_driver(runc_host)
    root = runc_host.root
    runc_host.fake.write(CONFIG, REFUSE_UNPRIVILEGED)
    c = hook_granted(runc_host, "hr-refused", "1", ("c 1:3 rw",))  # the hook granted nothing NVIDIA
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"
    assert daemon_pass(root)[c.id]["devices"] == {}
    runc_host.fake.write(CONFIG, ACCEPT_UNPRIVILEGED)
    got = one(check_json(nvsymlinkd_cli, root, code=None))
    assert got["nvidia_hook"]["devices"] == {} and got["nvidia_hook"]["inputs"]["recorded"] is True, got
    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"  # never granted by us

    # the id reused by a new container (another init start time): the old record is not its own
    runc_host.runc("kill", c.id, "KILL")
    runc_host.runc("delete", "-f", c.id)
    shutil.rmtree(root / "var/lib/bundles" / c.id)
    c2 = hook_granted(runc_host, "hr-refused", "1", ("c 195:255 rw", "c 195:1 rw"))
    got = one(check_json(nvsymlinkd_cli, root, code=None))
    assert got["nvidia_hook"]["inputs"]["recorded"] is False, got["nvidia_hook"]
    assert got["nvidia_hook"]["devices"] == {"c 195:1": "rw", "c 195:255": "rw"}
    human = nvsymlinkd_cli("--root", root, "check", "--no-bus", "--no-host", check=None).stdout
    assert "judged on the host's current inputs: no record of them from its first sight" in human, human
    assert daemon_pass(root)[c2.id]["inputs"]["differences"] == []  # recorded anew, for this container
    c2.deny("c 195:1 rw")
    nvsymlinkd_cli("--root", root, "repair", check=0)
    assert c2.open_error("/dev/nvidia1", rw=True) == "ENXIO"
