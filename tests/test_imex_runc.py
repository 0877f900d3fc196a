"""IMEX channels in real runc, the kernel as the judge (issue 35 item 3): a container the NVIDIA hook gave IMEX
channel 0 (NVIDIA_IMEX_CHANNELS=0: the cli grants channel0's node, c <nvidia-caps-imex-channels major>:0) that
lost it while no daemon watched is `lost`, and `repair` gives back exactly that channel: channel 1 stays
EPERM. A request the hook's config refuses (an unprivileged env request under
accept-nvidia-visible-devices-envvar-when-unprivileged = false) got nothing and gets nothing.

The host's channel nodes are mknod'ed under the tree with the major of a real H100 host (tests/migfixture.py);
inside, the container's own mknod'ed nodes open with ENXIO when the device cgroup lets them through (no
driver behind them) and EPERM when it denies them.
"""

from __future__ import annotations

import sys

from tests.migfixture import IMEX_MAJOR
from tests.runcfixture import device_node
from tests.test_hook_trust_runc import (
    FAKE_HOOK,
    check_json,
    fake_driver,
    hook_binary,
    hook_granted,
    host_file,
    kinds,
    one,
)
from tests.test_json_schema import validators  # noqa: F401 (a fixture)

CH0, CH1 = f"c {IMEX_MAJOR}:0", f"c {IMEX_MAJOR}:1"
REFUSE = "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"


def imex_host(runc_host) -> None:
    fake_driver(runc_host)
    runc_host.fake.proc_devices({"nvidia": 195, "nvidiactl": 195, "nvidia-caps": 241,
                                 "nvidia-caps-imex-channels": IMEX_MAJOR})
    for n in (0, 1):  # what nvidia-modprobe made for the hook (c M:N), and a second channel of the host
        runc_host.fake.node(f"/dev/nvidia-caps-imex-channels/channel{n}", IMEX_MAJOR, n)


def channel_nodes(c) -> None:
    for n in (0, 1):  # the nodes as the container sees them (mknod'ed: it may make any)
        c.exec("mknod", f"/dev/channel{n}", "c", str(IMEX_MAJOR), str(n))


def opens(c) -> tuple:
    return c.open_error("/dev/channel0", rw=True), c.open_error("/dev/channel1", rw=True)


def test_imex_channel_lost_with_no_daemon_is_lost_and_repair_gives_back_exactly_it(runc_host, nvsymlinkd_cli,
                                                                                   validators):  # noqa: F811
    imex_host(runc_host)
    root = str(runc_host.root)
    c = hook_granted(runc_host, "imex-lost", "0", ("c 195:255 rw", "c 195:0 rw", f"{CH0} rw"),
                     nodes=(("/dev/nvidia0", 0),), extra_env=("NVIDIA_IMEX_CHANNELS=0",))
    channel_nodes(c)
    assert opens(c) == ("ENXIO", "EPERM")
    doc = check_json(nvsymlinkd_cli, root)
    validators("check", doc)  # imex_channels as docs/schema/check.schema.json says
    got = one(doc)
    assert got["nvidia_hook"]["trusted"] is True, got["nvidia_hook"]
    assert set(got["nvidia_hook"]["devices"]) == {"c 195:255", "c 195:0", CH0}
    assert got["nvidia_hook"]["imex_channels"] == [
        {"channel": 0, "path": "/dev/nvidia-caps-imex-channels/channel0", "device": CH0}]

    c.deny(f"{CH0} rw")  # the loss, with nothing watching
    assert opens(c) == ("EPERM", "EPERM")
    got = one(check_json(nvsymlinkd_cli, root))
    assert got["verdict"] == "lost" and kinds(got)["lost"] == [CH0], got["findings"]
    out = nvsymlinkd_cli("--root", root, "check", "--no-bus", "--no-host", check=1).stdout
    assert "IMEX channel 0 (/dev/nvidia-caps-imex-channels/channel0)" in out, out  # named by its number and node

    out = nvsymlinkd_cli("--root", root, "repair", check=None).stdout
    assert f"{CH0} rw" in out and "repaired" in out, out
    assert opens(c) == ("ENXIO", "EPERM")  # exactly channel 0
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"
    assert "lost" not in kinds(one(check_json(nvsymlinkd_cli, root, code=None)))


def test_imex_request_the_config_refuses_gets_nothing(runc_host, nvsymlinkd_cli):
    """Under a config refusing unprivileged env requests (1.17+: the IMEX channels follow the same rule,
    container_config.go getImexChannels) the unprivileged container got no channel and `repair` gives it
    none; the privileged one beside it got channel 0 and gets it back."""
    imex_host(runc_host)
    runc_host.fake.write("/etc/nvidia-container-runtime/config.toml", REFUSE)
    root = str(runc_host.root)
    hook = runc_host.base / "bin" / "nvidia-container-runtime-hook"  # the fake, and toolkit 1.17.8's binary in the tree
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(FAKE_HOOK.format(python=sys.executable))
    hook.chmod(0o755)
    host_file(runc_host, hook, hook_binary())
    env = ("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=0")
    pod = _container(runc_host, str(hook), "imex-unpriv", ("c 1:3 rw",), env, privileged=False)
    priv = _container(runc_host, str(hook), "imex-priv", ("c 195:255 rw", "c 195:0 rw", f"{CH0} rw"), env,
                      privileged=True)
    for c in (pod, priv):
        channel_nodes(c)
    assert opens(pod) == ("EPERM", "EPERM") and opens(priv) == ("ENXIO", "EPERM")
    priv.deny(f"{CH0} rw")  # the privileged container's loss, with nothing watching

    doc = check_json(nvsymlinkd_cli, root, code=None)
    by_id = {c["id"]: c for c in doc["containers"]}
    assert by_id["imex-unpriv"]["nvidia_hook"]["trusted"] is True, by_id["imex-unpriv"]["nvidia_hook"]
    assert by_id["imex-unpriv"]["nvidia_hook"]["devices"] == {}
    assert by_id["imex-priv"]["nvidia_hook"]["trusted"] is True, by_id["imex-priv"]["nvidia_hook"]
    assert CH0 in by_id["imex-priv"]["nvidia_hook"]["devices"]
    assert by_id["imex-priv"]["verdict"] == "lost", by_id["imex-priv"]["findings"]

    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert opens(pod) == ("EPERM", "EPERM")  # the hook refused it: never granted by us
    assert opens(priv) == ("ENXIO", "EPERM")  # the hook granted channel 0: given back, and only it


def _container(runc_host, hook: str, cid: str, allow: tuple, env: tuple, privileged: bool):
    cgroups_path = f"{runc_host.parent}/{cid}"
    hooks = {"prestart": [{"path": hook, "args": ["nvidia-container-runtime-hook", "prestart"],
                           "env": [f"TEST_DEVICES_DIR=/sys/fs/cgroup/devices{cgroups_path}",
                                   "TEST_ALLOW=" + ";".join(allow)]}]}
    nodes = [device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidiactl", 195, 255)]
    return runc_host.run(cid, nodes=nodes, env=list(env), hooks=hooks, caps=("CAP_SYS_ADMIN",) if privileged else ())


def test_imex_channel_recorded_at_first_sight_holds_while_its_major_does(runc_host, nvsymlinkd_cli):
    """The daemon's record of the hook's inputs (issue 34 item 4) keeps channel0's node as the hook found it:
    a node removed from the host later changes nothing (lost, given back); a driver loaded again under another
    `nvidia-caps-imex-channels` major makes c 242:0 possibly another device: not trusted, nothing given."""
    from tests.test_hook_record_runc import daemon_pass

    imex_host(runc_host)
    root = str(runc_host.root)
    c = hook_granted(runc_host, "imex-rec", "0", ("c 195:255 rw", "c 195:0 rw", f"{CH0} rw"),
                     nodes=(("/dev/nvidia0", 0),), extra_env=("NVIDIA_IMEX_CHANNELS=0",))
    channel_nodes(c)
    first = daemon_pass(root)[c.id]
    assert first["inputs"]["recorded"] is True and CH0 in first["devices"], first
    runc_host.fake.path("/dev/nvidia-caps-imex-channels/channel0").unlink()  # gone from the host since
    c.deny(f"{CH0} rw")
    got = one(check_json(nvsymlinkd_cli, root))
    assert got["nvidia_hook"]["trusted"] is True and got["verdict"] == "lost", got["nvidia_hook"]
    assert any("IMEX channel nodes" in d for d in got["nvidia_hook"]["inputs"]["differences"]), got["nvidia_hook"]
    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert opens(c) == ("ENXIO", "EPERM")

    c.deny(f"{CH0} rw")  # lost again, after the driver came back with another major for the channels
    runc_host.fake.proc_devices({"nvidia": 195, "nvidiactl": 195, "nvidia-caps": 241,
                                 "nvidia-caps-imex-channels": IMEX_MAJOR + 1})
    got = one(check_json(nvsymlinkd_cli, root, code=None))
    assert got["nvidia_hook"]["trusted"] is False and "major" in got["nvidia_hook"]["detail"], got["nvidia_hook"]
    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert opens(c) == ("EPERM", "EPERM")
