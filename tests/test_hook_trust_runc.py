"""`check` and `repair` on real runc containers whose NVIDIA access no daemon watched (issue 24).

The kernel is the judge: inside the container an open() of the mknod'ed node gives ENXIO when the
device cgroup lets it through (no driver behind it) and EPERM when it denies it. A fake
`nvidia-container-runtime-hook prestart` grants what the real hook would (devices.allow), so the
reconstruction (containers.hookgrant) must arrive at the same devices on its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.runcfixture import device_node, device_rule

FAKE_HOOK = """#!{python}
import json, os, sys
json.load(sys.stdin)  # the container's state, as runc gives it to every hook
assert sys.argv[1:] == ["prestart"], sys.argv
for rule in os.environ["TEST_ALLOW"].split(";"):
    with open(os.environ["TEST_DEVICES_DIR"] + "/devices.allow", "w") as f:
        f.write(rule + "\\n")
"""


def hook_binary(version: str = "1.17.8") -> bytes:
    """What nvsymlinkd reads at the hook's path in the host tree: an ELF file whose Go build info carries the
    toolkit's version (-X .../internal/info.version), as a real build does (runc runs the Python fake)."""
    return (b"\x7fELF\x02\x01\x01" + b"\x00" * 64 + b"build\t-ldflags=\"-X github.com/NVIDIA/"
            b"nvidia-container-toolkit/internal/info.version=" + version.encode() + b"\"\n")


def host_file(runc_host, real_path, content: bytes | str, mode: int = 0o755):
    """The same absolute path inside the host tree (--root) that runc uses on the real host."""
    p = runc_host.root / str(real_path).lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    p.chmod(mode)
    return p


def fake_driver(runc_host, gpus=4) -> None:
    for m in range(gpus):
        runc_host.fake.write(f"/proc/driver/nvidia/gpus/0000:0{m + 1}:00.0/information",
                             f"Model:\t\t Fake GPU\nGPU UUID:\t GPU-fake-{m}\nDevice Minor:\t {m}\n")


def fake_hook(runc_host) -> Path:
    """The fake legacy hook (FAKE_HOOK) outside the tree, made once per host, and the hook binary as the tree
    shows it: a build whose version nvsymlinkd reads (an absent hook is not trusted)."""
    hook = runc_host.base / "bin" / "nvidia-container-runtime-hook"
    if not hook.exists():
        hook.parent.mkdir(parents=True, exist_ok=True)
        hook.write_text(FAKE_HOOK.format(python=sys.executable))
        hook.chmod(0o755)
        host_file(runc_host, hook, hook_binary())
    return hook


def hook_granted(runc_host, cid: str, visible: str, allow: tuple, nodes=(("/dev/nvidia1", 1),), driver="cgroupfs",
                 extra_env=()):
    """A container as Docker --gpus makes it: NVIDIA_VISIBLE_DEVICES and the legacy hook in the spec, the
    devices granted by the hook (here: `allow`), none of them in the spec's rules. driver="systemd": a
    systemd stand-in in runc-<cid>.scope (tests/runcfixture.py)."""
    hook = fake_hook(runc_host)
    cgroups_path = f"{runc_host.parent}/{f'runc-{cid}.scope' if driver == 'systemd' else cid}"
    hooks = {"prestart": [{"path": str(hook), "args": ["nvidia-container-runtime-hook", "prestart"],
                           "env": [f"TEST_DEVICES_DIR=/sys/fs/cgroup/devices{cgroups_path}",
                                   "TEST_ALLOW=" + ";".join(allow)]}]}
    spec_nodes = [device_node(p, 195, m) for p, m in nodes]
    spec_nodes += [device_node("/dev/nvidiactl", 195, 255)] if nodes else []
    return runc_host.run(cid, nodes=spec_nodes, env=[f"NVIDIA_VISIBLE_DEVICES={visible}", *extra_env], hooks=hooks,
                         driver=driver)


def check_json(cli, root, *extra, code=1) -> dict:
    return json.loads(cli("--root", root, "check", "--json", "--no-bus", "--no-host", *extra, check=code).stdout)


def one(doc: dict) -> dict:
    (c,) = doc["containers"]
    return c


def kinds(c: dict) -> dict:
    return {f["kind"]: f["devices"] for f in c["findings"]}


def test_hook_grant_lost_with_no_daemon_is_lost_and_repair_gives_it_back(runc_host, nvsymlinkd_cli):
    fake_driver(runc_host)
    root = str(runc_host.root)
    c = hook_granted(runc_host, "gpu-hook", "1", ("c 195:255 rw", "c 195:1 rw"))
    assert c.open_error("/dev/nvidia1", rw=True) == "ENXIO"
    # no baseline, no daemon: the hook's grant is trusted from the spec, the toolkit defaults and the driver
    doc = check_json(nvsymlinkd_cli, root)
    got = one(doc)
    assert got["verdict"] == "at-risk" and kinds(got) == {"at-risk-not-in-spec": ["c 195:1", "c 195:255"]}
    assert got["expected"]["c 195:1"] == {"access": "rw", "sources": ["nvidia-hook"]}
    assert got["nvidia_hook"]["trusted"] is True
    assert got["nvidia_hook"]["devices"] == {"c 195:1": "rw", "c 195:255": "rw"}
    assert got["baseline"] is None
    # cgroupfs driver: the fix says what works there (no scope to keep it in)
    assert "cgroupfs" in got["findings"][0]["fix"]
    assert not (runc_host.root / "run/nvsymlinkd/baselines").exists()

    c.deny("c 195:1 rw")  # the loss, with nothing watching
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"
    out = nvsymlinkd_cli("--root", root, "check", "--no-bus", "--no-host", check=1)
    assert "lost" in out.stdout and "c 195:1" in out.stdout, out.stdout
    got = one(check_json(nvsymlinkd_cli, root))
    assert got["verdict"] == "lost" and kinds(got)["lost"] == ["c 195:1"]

    out = nvsymlinkd_cli("--root", root, "repair", check=0)
    assert "repaired" in out.stdout, out.stdout
    assert c.open_error("/dev/nvidia1", rw=True) == "ENXIO"  # the kernel lets it through again
    got = one(check_json(nvsymlinkd_cli, root))
    assert "lost" not in kinds(got)


def test_nodes_never_allowed_are_denied_and_not_repaired(runc_host, nvsymlinkd_cli):
    """Issue 24 item 1: nodes in linux.devices that no rule allows (a hostPath mount of /dev/nvidia*)."""
    root = str(runc_host.root)
    c = runc_host.run("gpu-never", nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidiactl", 195, 255)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert c.open_error("/dev/nvidia0", rw=True) == "EPERM"
    out = nvsymlinkd_cli("--root", root, "check", "--no-bus", "--no-host", check=1)
    assert "denied" in out.stdout and "recreate" in out.stdout, out.stdout
    doc = check_json(nvsymlinkd_cli, root)
    got = one(doc)
    assert got["verdict"] == "denied" and kinds(got) == {"denied": ["c 195:0", "c 195:255"]}
    assert doc["summary"]["denied"] == 1
    assert got["findings"][0]["message_id"] == "6319b0c3b41544b2abc25c1ebf2c08b0"
    assert "cannot know" in got["findings"][0]["detail"]
    out = nvsymlinkd_cli("--root", root, "repair", check=1)
    assert "denied c 195:0, c 195:255, not repaired" in out.stdout, out.stdout
    rep = json.loads(nvsymlinkd_cli("--root", root, "repair", "--json", check=1).stdout)
    assert [d["container"] for d in rep["denied"]] == ["gpu-never"] and rep["ok"] is False
    assert c.open_error("/dev/nvidia0", rw=True) == "EPERM"  # nothing was granted


def test_hook_request_with_no_node_and_no_access_is_denied(runc_host, nvsymlinkd_cli):
    """Asks for GPUs through the NVIDIA hook (a MIG device: not reconstructed), has no NVIDIA node and no
    access at all: not ok either."""
    fake_driver(runc_host)
    hook_granted(runc_host, "gpu-asks", "MIG-0c7d8f2e", ("c 1:3 rw",), nodes=())
    got = one(check_json(nvsymlinkd_cli, str(runc_host.root)))
    assert got["verdict"] == "denied" and "asks for GPUs" in got["findings"][0]["detail"], got["findings"]
    assert "MIG" in got["findings"][0]["detail"]


def test_cuda_image_env_alone_is_no_request(runc_host, nvsymlinkd_cli):
    """NVIDIA_VISIBLE_DEVICES=all from a CUDA image, no hook, no node: nothing acts on it, nothing denied."""
    runc_host.run("cpu-cuda", env=["NVIDIA_VISIBLE_DEVICES=all"])
    got = one(check_json(nvsymlinkd_cli, str(runc_host.root), code=0))
    assert got["verdict"] == "ok" and got["findings"] == []


def test_hook_that_grants_nothing_by_config_is_no_request(runc_host, nvsymlinkd_cli):
    """The toolkit refuses unprivileged env requests: the hook granted nothing, exactly; not denied."""
    fake_driver(runc_host)
    runc_host.fake.write("/etc/nvidia-container-runtime/config.toml",
                         "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n")
    hook_granted(runc_host, "cpu-pod", "all", ("c 1:3 rw",), nodes=())
    got = one(check_json(nvsymlinkd_cli, str(runc_host.root), code=0))
    assert got["nvidia_hook"] == {"trusted": True, "devices": {}, "detail": got["nvidia_hook"]["detail"],
                                  "inputs": got["nvidia_hook"]["inputs"], "mig_devices": [], "imex_channels": []}
    assert got["nvidia_hook"]["inputs"]["recorded"] is False  # no daemon ran: judged on the current inputs
    assert got["verdict"] == "ok", got["findings"]


@pytest.mark.parametrize("why,setup", [
    ("uuid the driver does not list", lambda h: None),
    ("unparseable toolkit config", lambda h: h.fake.write("/etc/nvidia-container-runtime/config.toml", "[x\n")),
])
def test_hook_grant_that_cannot_be_reconstructed_is_denied_not_lost(runc_host, nvsymlinkd_cli, why, setup):
    fake_driver(runc_host)
    setup(runc_host)
    root = str(runc_host.root)
    visible = "GPU-not-on-this-host" if why.startswith("uuid") else "1"
    c = hook_granted(runc_host, "gpu-guess", visible, ("c 195:255 rw", "c 195:1 rw"))
    c.deny("c 195:1 rw")
    got = one(check_json(nvsymlinkd_cli, root))
    assert got["nvidia_hook"]["trusted"] is False and got["nvidia_hook"]["devices"] == {}
    assert got["verdict"] == "denied" and kinds(got)["denied"] == ["c 195:1"], got["findings"]
    assert "could not be reconstructed" in got["findings"][0]["detail"]
    assert "c 195:1" not in got["expected"]
    nvsymlinkd_cli("--root", root, "repair", check=1)
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"  # never a guess


@pytest.mark.parametrize("variant", ["config null", "config missing", "labels and devices null"])
def test_state_json_without_config_stays_unknown(runc_host, nvsymlinkd_cli, variant):
    """Issue 24 item 3: the container stays in the report as unknown with the reason, never dropped."""
    c = runc_host.run("gpu-noconf", rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"])
    c.deny("c 195:0 rw")  # a GPU container that has lost a device
    path = runc_host.state_root / c.id / "state.json"
    original = path.read_text()
    state = json.loads(original)
    if variant == "config null":
        state["config"] = None
    elif variant == "config missing":
        del state["config"]
    else:
        state["config"]["labels"] = None
        state["config"]["cgroups"]["devices"] = None
    path.write_text(json.dumps(state))
    try:
        doc = check_json(nvsymlinkd_cli, str(runc_host.root))
        got = one(doc)
        assert got["id"] == "gpu-noconf" and got["verdict"] == "unknown", got
        assert doc["summary"]["gpu_containers"] == 1 and doc["summary"]["unknown"] == 1
        detail = got["findings"][0]["detail"]
        assert "state.json" in detail and ("config" in detail), detail
        out = nvsymlinkd_cli("--root", str(runc_host.root), "check", "--no-bus", "--no-host", check=1)
        assert "gpu-noconf" in out.stdout and "unknown" in out.stdout
    finally:
        path.write_text(original)  # runc needs it to kill and delete the container
    assert os.path.exists(path)


def operator_host(runc_host, name: str) -> str:
    """A GPU Operator-shaped host: the hook path is the toolkit installer's 1.18+ wrapper (in the host tree)
    that points NVIDIA_CTK_CONFIG_FILE_PATH at its own config.toml, which refuses NVIDIA_VISIBLE_DEVICES from
    unprivileged containers; /etc has no config (the toolkit's defaults would accept it). runc runs the
    Python fake at the same real path, granting what the real hook grants (TEST_ALLOW)."""
    toolkit = runc_host.base / name
    hook = toolkit / "nvidia-container-runtime-hook"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(FAKE_HOOK.format(python=sys.executable))
    hook.chmod(0o755)
    config = f"{toolkit}/.config/nvidia-container-runtime/config.toml"
    host_file(runc_host, hook, f"#! /bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH={config} \\\nPATH={toolkit}:$PATH \\\n"
                               f"\t{toolkit}/nvidia-container-runtime-hook.real \\\n\t\t\"$@\"\n")
    host_file(runc_host, f"{hook}.real", hook_binary("1.18.0"))
    host_file(runc_host, config, "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n", 0o644)
    return str(hook)


def operator_container(runc_host, hook: str, cid: str, allow: tuple, privileged: bool):
    cgroups_path = f"{runc_host.parent}/{cid}"
    hooks = {"prestart": [{"path": hook, "args": ["nvidia-container-runtime-hook", "prestart"],
                           "env": [f"TEST_DEVICES_DIR=/sys/fs/cgroup/devices{cgroups_path}",
                                   "TEST_ALLOW=" + ";".join(allow)]}]}
    nodes = [device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidiactl", 195, 255)]
    return runc_host.run(cid, nodes=nodes, env=["NVIDIA_VISIBLE_DEVICES=all"], hooks=hooks,
                         caps=("CAP_SYS_ADMIN",) if privileged else ())


def test_gpu_operator_config_refusing_unprivileged_requests_is_what_repair_follows(runc_host, nvsymlinkd_cli):
    """Issue 34: the hook wrapper's own config refuses unprivileged NVIDIA_VISIBLE_DEVICES, so the hook gave
    the unprivileged container nothing: `repair` leaves c 195:0 denied there (EPERM), and gives the privileged
    one back the GPU it lost (ENXIO). Before, /etc was read (absent: the defaults accept the request) and the
    unprivileged container got every GPU "back"."""
    fake_driver(runc_host)
    root = str(runc_host.root)
    hook = operator_host(runc_host, "operator-toolkit")
    everything = ("c 195:255 rw",) + tuple(f"c 195:{m} rw" for m in range(4))
    pod = operator_container(runc_host, hook, "hg-unpriv", ("c 1:3 rw",), privileged=False)
    priv = operator_container(runc_host, hook, "hg-priv", everything, privileged=True)
    assert pod.open_error("/dev/nvidia0", rw=True) == "EPERM"
    assert priv.open_error("/dev/nvidia0", rw=True) == "ENXIO"
    priv.deny("c 195:0 rw")  # the privileged container's loss, with nothing watching
    assert priv.open_error("/dev/nvidia0", rw=True) == "EPERM"

    doc = check_json(nvsymlinkd_cli, root)
    by_id = {c["id"]: c for c in doc["containers"]}
    assert by_id["hg-unpriv"]["nvidia_hook"]["trusted"] is True, by_id["hg-unpriv"]["nvidia_hook"]
    assert by_id["hg-unpriv"]["nvidia_hook"]["devices"] == {}
    assert by_id["hg-priv"]["nvidia_hook"]["trusted"] is True
    assert "c 195:0" in by_id["hg-priv"]["nvidia_hook"]["devices"]
    assert by_id["hg-priv"]["verdict"] == "lost", by_id["hg-priv"]["findings"]

    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert pod.open_error("/dev/nvidia0", rw=True) == "EPERM"  # the hook refused it: never granted by us
    assert priv.open_error("/dev/nvidia0", rw=True) == "ENXIO"  # the hook granted it: given back


def test_hook_file_gone_from_the_host_is_not_trusted(runc_host, nvsymlinkd_cli):
    """The hook's path no longer exists in the host tree: whether it was a wrapper with its own config is
    unknown, so a lost device is denied, never given back."""
    fake_driver(runc_host)
    root = str(runc_host.root)
    c = hook_granted(runc_host, "hg-gone", "1", ("c 195:255 rw", "c 195:1 rw"))
    (runc_host.root / str(runc_host.base / "bin" / "nvidia-container-runtime-hook").lstrip("/")).unlink()
    c.deny("c 195:1 rw")
    got = one(check_json(nvsymlinkd_cli, root))
    assert got["nvidia_hook"]["trusted"] is False and "does not exist" in got["nvidia_hook"]["detail"]
    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"


REFUSE_UNPRIVILEGED = "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"


@pytest.mark.parametrize("case", ["void past 1,024 characters", "driver container's config (toolkit 1.17)",
                                  "display without a modeset node", "excluded GPU shifts the index"])
def test_what_the_hook_refused_stays_denied_through_repair(runc_host, nvsymlinkd_cli, case):
    """Issue 34, each kind of input where the reconstruction used to grant more than the hook: the hook gave
    the container nothing (or not this node), so after `repair` the kernel still says EPERM."""
    fake_driver(runc_host)
    root = str(runc_host.root)
    env, node = ["NVIDIA_VISIBLE_DEVICES=1"], ("/dev/nvidia1", 195, 1)
    allow: tuple = ("c 1:3 rw",)  # what the real hook grants: nothing NVIDIA
    if case.startswith("void"):
        env = ["NVIDIA_VISIBLE_DEVICES=" + "1," * 600 + "void"]
    elif case.startswith("driver container"):
        runc_host.fake.write("/run/nvidia/driver/etc/nvidia-container-runtime/config.toml", REFUSE_UNPRIVILEGED)
    elif case.startswith("display"):
        env += ["NVIDIA_DRIVER_CAPABILITIES=compute,display"]
        allow = ("c 195:255 rw", "c 195:1 rw")  # the GPU, and no modeset: the host has no /dev/nvidia-modeset
        node = ("/dev/nvidia-modeset", 195, 254)
    else:  # GPU 0 is excluded: NVML's index 1 is the GPU at minor 2, so minor 1 was never granted
        runc_host.fake.write("/proc/driver/nvidia/gpus/0000:01:00.0/information",
                             "GPU UUID:\t GPU-fake-0\nDevice Minor:\t 0\nGPU Excluded:\t Yes\n")
        allow = ("c 195:255 rw", "c 195:2 rw")
    c = hook_granted(runc_host, "hg-refused", env[0].split("=", 1)[1], allow, nodes=((node[0], node[2]),),
                     extra_env=env[1:])
    assert c.open_error(node[0], rw=True) == "EPERM"
    got = one(check_json(nvsymlinkd_cli, root, code=None))
    assert got["nvidia_hook"]["trusted"] is True, got["nvidia_hook"]
    assert f"c {node[1]}:{node[2]}" not in got["nvidia_hook"]["devices"], got["nvidia_hook"]
    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert c.open_error(node[0], rw=True) == "EPERM"  # never granted by us


RUNTIME_ENV_HOOK = """#!{python}
import json, os, sys
json.load(sys.stdin)
# no env in the entry: runc ran this hook with its own environment, the installer's runtime wrapper's variable in it
assert os.environ.get("NVIDIA_CTK_CONFIG_FILE_PATH") == os.environ["TEST_CONFIG"], sorted(os.environ)
with open(os.environ["TEST_DEVICES_DIR"] + "/devices.allow", "w") as f:
    f.write("c 1:3 rw\\n")  # what the 1.18 hook grants under that config: nothing NVIDIA
"""


def test_hook_entry_without_env_is_not_trusted_on_1_18(runc_host, nvsymlinkd_cli):
    """Review of issue 34, item 1: nvidia-container-runtime injects the hook with no `env` (stable.go), so runc
    runs it with runc's own environment, where the toolkit installer's runtime wrapper exported
    NVIDIA_CTK_CONFIG_FILE_PATH; the 1.18 hook read that config (refusing unprivileged requests) and granted
    nothing. nvsymlinkd cannot see runc's environment: not trusted, and `repair` leaves c 195:1 denied (EPERM).
    Before, the entry was read as an empty environment, /etc (absent: the defaults) accepted the request, and
    `repair` granted the GPU the hook never gave."""
    fake_driver(runc_host)
    root = str(runc_host.root)
    toolkit = runc_host.base / "fixhook-ctk118"
    hook = toolkit / "nvidia-container-runtime-hook"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(RUNTIME_ENV_HOOK.format(python=sys.executable))
    hook.chmod(0o755)
    host_file(runc_host, hook, hook_binary("1.18.0"))
    config = toolkit / ".config" / "nvidia-container-runtime" / "config.toml"
    host_file(runc_host, config, REFUSE_UNPRIVILEGED, 0o644)
    cid = "hg-fixhook-noenv"
    hooks = {"prestart": [{"path": str(hook), "args": ["nvidia-container-runtime-hook", "prestart"]}]}
    c = runc_host.run(cid, nodes=[device_node("/dev/nvidia1", 195, 1), device_node("/dev/nvidiactl", 195, 255)],
                      env=["NVIDIA_VISIBLE_DEVICES=1"], hooks=hooks,
                      runc_env={"NVIDIA_CTK_CONFIG_FILE_PATH": str(config), "TEST_CONFIG": str(config),
                                "TEST_DEVICES_DIR": f"/sys/fs/cgroup/devices{runc_host.parent}/{cid}"})
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"  # the hook granted nothing
    got = one(check_json(nvsymlinkd_cli, root, code=None))
    assert got["nvidia_hook"]["trusted"] is False, got["nvidia_hook"]
    assert "runtime's environment" in got["nvidia_hook"]["detail"], got["nvidia_hook"]
    nvsymlinkd_cli("--root", root, "repair", check=None)
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"  # never granted by us


@pytest.mark.parametrize("same", [False, True], ids=["roots-differ", "roots-agree"])
def test_cli_root_and_driver_root(runc_host, nvsymlinkd_cli, same):
    """Review of issue 34, item 2: the cli grants the uvm nodes that exist under its own --root
    (nvidia-container-cli.root = /run/nvidia/driver). roots-differ: nvsymlinkd scanned / (driver_root), which has
    /dev/nvidia-uvm while the cli's root has none: not trusted, and `repair` never grants the uvm node the hook
    did not (EPERM); before, the host's uvm node was taken as granted and `repair` gave it to the container.
    roots-agree: driver_root = /run/nvidia/driver (nvsymlinkd.toml) holds the node the cli found and granted:
    trusted, and a lost uvm grant is given back (ENXIO)."""
    runc_host.fake.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 509})
    runc_host.fake.node("/run/nvidia/driver/dev/nvidia-uvm" if same else "/dev/nvidia-uvm", 509, 0)
    runc_host.fake.write("/etc/nvidia-container-runtime/config.toml",
                         "[nvidia-container-cli]\nroot = \"/run/nvidia/driver\"\n")
    if same:
        runc_host.fake.write("/etc/nvsymlinkd/nvsymlinkd.toml", "driver_root = \"/run/nvidia/driver\"\n")
    fake_driver(runc_host)
    root = str(runc_host.root)
    allow = ("c 195:255 rw", "c 195:1 rw") + (("c 509:0 rw",) if same else ())
    c = hook_granted(runc_host, "hg-fixhook-cliroot", "1", allow)
    c.exec("mknod", "/dev/nvidia-uvm", "c", "509", "0")
    assert c.open_error("/dev/nvidia-uvm", rw=True) == ("ENXIO" if same else "EPERM")
    if same:
        c.deny("c 509:0 rw")  # the loss, with nothing watching
    got = one(check_json(nvsymlinkd_cli, root, code=None))
    assert got["nvidia_hook"]["trusted"] is same, got["nvidia_hook"]
    if same:
        assert "c 509:0" in got["nvidia_hook"]["devices"], got["nvidia_hook"]
    else:
        assert "driver_root" in got["nvidia_hook"]["detail"], got["nvidia_hook"]
    nvsymlinkd_cli("--root", root, "repair", check=None)
    # roots-agree: the hook granted it, given back; roots-differ: never granted by us
    assert c.open_error("/dev/nvidia-uvm", rw=True) == ("ENXIO" if same else "EPERM")
