"""containers.hookrecord: the NVIDIA hook's inputs recorded at a container's first sight (issue 34 item 4)."""

from __future__ import annotations

import json
from dataclasses import fields, replace

from nvsymlinkd.config import Config
from nvsymlinkd.containers import hookrecord
from nvsymlinkd.containers.hookgrant import DriverMap, GpuEntry, HookInputs, ToolkitConfig, Wrapper
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.imex import ImexNodes
from nvsymlinkd.host.mig import MigDevice, MigMap
from nvsymlinkd.host.root import HostRoot

ENTRY = ("prestart", "/usr/bin/nvidia-container-runtime-hook", ("nvidia-container-runtime-hook", "prestart"), None)


def full_inputs() -> HookInputs:
    """Every field away from its default, so a round trip that dropped one would show."""
    config = ToolkitConfig(True, "", True, False, True, True, False, "/run/nvidia/driver", frozenset({"compute"}),
                           "docker.resource.gpu", "legacy", True, True, "/etc/nvidia-container-runtime/config.toml",
                           "ab" * 32)
    driver = DriverMap((GpuEntry("0000:01:00.0", 0, "GPU-a", False), GpuEntry("0000:02:00.0", 1, None, True)), True,
                       "", (Device.char(508, 0), Device.char(508, 1)), True, True,
                       MigMap(True, "", 241, (MigDevice(0, 1, 0, 12, 13),), 1, 2,
                              (("config", 1), ("monitor", 2), ("gpu0/gi1/access", 12), ("gpu0/gi1/ci0/access", 13))),
                       (("MIG-4d8c-aa", 0, 1, 0),), "", (0,), "/run/nvidia/driver", ImexNodes(242, (0, 3), (1,)))
    wrapper = Wrapper((("NVIDIA_CTK_CONFIG_FILE_PATH", "/usr/local/nvidia/toolkit/.config/c.toml"),),
                      "/usr/local/nvidia/toolkit/nvidia-container-runtime-hook.real", ("-config", "/x.toml"))
    return HookInputs(config, driver, (1, 17, 8), "dpkg", wrapper, "")


def test_every_field_is_recorded_and_read_back(tmp_path):
    inputs = full_inputs()
    for value in (inputs.config, inputs.driver):
        defaults = type(value)() if not isinstance(value, DriverMap) else DriverMap()
        assert all(getattr(value, f.name) != getattr(defaults, f.name) for f in fields(value)
                   if f.name not in ("readable", "why")), f"{type(value).__name__}: set every field in this test"
    root, config = HostRoot(str(tmp_path)), Config()
    hookrecord.record(root, config, "ctr1", 1234, ENTRY, inputs)
    got = hookrecord.load(root, config, "ctr1", 1234, ENTRY)
    assert got is not None and got.inputs == inputs and got.recorded_at > 0
    path = tmp_path / "run/nvsymlinkd/hookinputs/ctr1.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_another_container_or_a_bad_file_is_no_record(tmp_path):
    root, config = HostRoot(str(tmp_path)), Config()
    hookrecord.record(root, config, "ctr1", 1234, ENTRY, full_inputs())
    assert hookrecord.load(root, config, "ctr1", 9999, ENTRY) is None  # the id reused: another init start
    assert hookrecord.load(root, config, "ctr1", None, ENTRY) is None
    assert hookrecord.load(root, config, "ctr1", 1234, ENTRY[:2] + (("other",), None)) is None
    path = tmp_path / "run/nvsymlinkd/hookinputs/ctr1.json"
    doc = json.loads(path.read_text())
    for broken in ("{", json.dumps({**doc, "inputs": {**doc["inputs"], "version": [1, "17", 8]}}),
                   json.dumps({**doc, "inputs": {**doc["inputs"], "config": {"readable": True}}}),
                   json.dumps({**doc, "format": 2}), " " * (hookrecord.MAX_RECORD_BYTES + 1) + "{}"):
        path.write_text(broken)
        assert hookrecord.load(root, config, "ctr1", 1234, ENTRY) is None, broken[:80]


def test_records_of_containers_gone_are_pruned(tmp_path):
    root, config = HostRoot(str(tmp_path)), Config()
    for cid in ("live", "gone"):
        hookrecord.record(root, config, cid, 1, ENTRY, full_inputs())
    assert hookrecord.prune(root, config, ["live"]) == ["gone.json"]
    assert hookrecord.load(root, config, "live", 1, ENTRY) is not None


def test_differences_say_what_changed():
    was = full_inputs()
    now = replace(was, config=replace(was.config, accept_envvar_unprivileged=True, digest="cd" * 32),
                  version=(1, 18, 0), driver=replace(was.driver, gpus=was.driver.gpus[:1]))
    assert hookrecord.differences(was, now) == [
        "config /etc/nvidia-container-runtime/config.toml: edited since",
        "config accept_envvar_unprivileged: False then, True now",
        "toolkit version: 1.17.8 then, 1.18.0 now",
        "driver GPUs: 2 then, 1 now"]
    assert hookrecord.differences(was, was) == []
    moved = replace(was, config=ToolkitConfig())
    assert hookrecord.differences(was, moved)[0] == ("config: /etc/nvidia-container-runtime/config.toml then, "
                                                    "none (defaults) now")


def test_a_long_nvidia_visible_devices_is_shown_bounded_and_decided_whole():
    """check's words about the request show the value bounded (a spec's env can be megabytes); the grant
    and the GPU signs are decided on the whole value (a `void` past any cut)."""
    from nvsymlinkd.containers.discovery import Container
    from nvsymlinkd.containers.expected import Expected
    from nvsymlinkd.containers.hookgrant import HookGrant
    from nvsymlinkd.containers.ocispec import gpu_signs, parse_spec
    from nvsymlinkd.verify.evaluate import request_signs
    from tests.fixtures.runtimes.layouts import oci_spec

    value = "GPU-" + "a" * 5000
    spec = parse_spec(oci_spec(env=[f"NVIDIA_VISIBLE_DEVICES={value}"]))
    assert spec.visible_devices == value
    c = Container("ctr", "runc", spec=spec)
    (sign,) = request_signs(c, Expected(hook=HookGrant(False, {}, "not reconstructed")))
    assert len(sign) < 300 and sign.endswith("... (5004 characters)"), sign
    (sign,) = gpu_signs(spec, None, frozenset({195}))
    assert len(sign) < 300 and sign.endswith("... (5004 characters)"), sign
    void_past_cut = parse_spec(oci_spec(env=["NVIDIA_VISIBLE_DEVICES=" + " " * 3000 + "void"]))
    assert gpu_signs(void_past_cut, None, frozenset({195})) == []
