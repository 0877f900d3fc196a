"""The CLI's JSON documents against their schemas (docs/schema/*.schema.json).

Two halves: the schemas' enums are the Python enums (so a new verdict, finding kind, source or
repair status cannot be added without the schema), and real `check --json` / `repair --json`
outputs from real runc containers (lost, denied, at-risk, unknown, ok; repaired, denied, dry-run)
and the error document validate against them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nvsymlinkd.repair.mechanisms import MECHANISMS
from nvsymlinkd.repair.model import TRUSTED_SOURCES, UNTRUSTED_SOURCES, RepairStatus
from nvsymlinkd.verify.kinds import FindingKind, Verdict
from tests.conftest import IN_CI
from tests.runcfixture import device_node, device_rule
from tests.test_hook_trust_runc import fake_driver, hook_granted

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schema"


def load(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def offline(uri: str) -> dict:
    """The one way a schema is fetched here: a name in docs/schema/, nothing else (no network, no other
    directory): what a validator given the schema files has. An absolute `$id` (an https URL) made the
    repair schema's `check.schema.json` reference resolve to that URL (issue 39 item 10)."""
    from urllib.parse import urlsplit

    if urlsplit(uri).scheme or "/" in uri or not (SCHEMAS / uri).is_file():
        raise LookupError(f"{uri}: not a schema file beside the others (refused: offline)")
    return load(uri)


@pytest.fixture(scope="module")
def validators():
    """{"check": validate(doc), "repair": validate(doc)}, every reference resolved offline from docs/schema/."""
    try:
        import jsonschema
    except ImportError:
        if IN_CI:
            pytest.fail("CI must run this test: jsonschema is in pyproject's test extra", pytrace=False)
        pytest.skip("needs jsonschema (pyproject's test extra)")
    check, repair = load("check.schema.json"), load("repair.schema.json")
    for s in (check, repair):
        jsonschema.Draft202012Validator.check_schema(s)
    try:  # jsonschema >= 4.18: an empty registry that fetches through offline() alone
        from referencing import Registry, Resource
        from referencing.exceptions import NoSuchResource

        def retrieve(uri):
            try:
                return Resource.from_contents(offline(uri))
            except LookupError:
                raise NoSuchResource(ref=uri)

        registry = Registry(retrieve=retrieve)

        def make(s):
            return jsonschema.Draft202012Validator(s, registry=registry)
    except ImportError:  # Debian 12's 4.10: a RefResolver whose every scheme goes through offline()
        def make(s):
            handlers = {scheme: offline for scheme in ("", "http", "https", "file")}
            return jsonschema.Draft202012Validator(s, resolver=jsonschema.RefResolver.from_schema(s, handlers=handlers))

    made = {"check": make(check), "repair": make(repair)}

    def validate(which: str, doc: dict) -> None:
        errors = sorted(made[which].iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])

    return validate


# -- the enums are the Python ones --------------------------------------------------------------------

def test_enums_are_the_python_enums():
    check, repair = load("check.schema.json")["$defs"], load("repair.schema.json")["$defs"]
    assert check["verdict"]["enum"] == [v.value for v in Verdict]
    assert check["finding_kind"]["enum"] == [k.value for k in FindingKind]
    assert check["source"]["enum"] == list(TRUSTED_SOURCES + UNTRUSTED_SOURCES)
    assert "nvidia-hook" in check["source"]["enum"] and "denied" in check["finding_kind"]["enum"]
    assert repair["status"]["enum"] == [s.value for s in RepairStatus]
    assert repair["mechanism"]["enum"] == list(MECHANISMS) + [None]
    summary = repair["report"]["properties"]["summary"]
    assert summary["required"][:len(RepairStatus)] == [s.value for s in RepairStatus]
    counts = check["report"]["properties"]["summary"]["required"]
    from nvsymlinkd.verify.kinds import GPU_VERDICTS

    assert [v.value for v in GPU_VERDICTS + (Verdict.NOT_RUNNING,)] == counts[2:8]


def test_a_document_that_drifts_is_refused(validators):
    """The validation can fail: a verdict or status the schema does not know is an error."""
    doc = {"schema_version": 1, "ok": False, "containers": [], "host": [], "seconds": 0.1,
           "summary": {"gpu_containers": 0, "not_gpu_containers": 0, "lost": 0, "denied": 0, "at-risk": 0,
                       "unknown": 0, "ok": 0, "not-running": 0, "verdicts": {"gone": 1},
                       "containers": {"gpu": 0, "gpu_running": 0, "not_gpu": 0}}}
    with pytest.raises(AssertionError, match="gone"):
        validators("check", doc)
    err = {"schema_version": 1, "ok": False, "error": "x", "exit_code": 2}
    validators("check", err)
    validators("repair", err)
    with pytest.raises(AssertionError):
        validators("repair", {**err, "exit_code": "2"})


# -- real outputs ------------------------------------------------------------------------------------

def _cli_json(cli, *argv, code):
    proc = cli(*argv, check=code)
    return json.loads(proc.stdout)


def test_real_check_and_repair_documents_validate(runc_host, nvsymlinkd_cli, validators, monkeypatch):
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)  # the fake tree is not this host
    root = str(runc_host.root)
    fake_driver(runc_host)
    gpu0 = dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"])
    runc_host.run("gpu-ok", **gpu0)
    runc_host.run("gpu-lost", **gpu0).deny("c 195:0 rw")
    runc_host.run("gpu-never", nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    hook_granted(runc_host, "gpu-hook", "1", ("c 195:255 rw", "c 195:1 rw"))
    runc_host.run("cpu", env=[])

    doc = _cli_json(nvsymlinkd_cli, "--root", root, "check", "--json", "--no-bus", code=1)
    validators("check", doc)
    verdicts = {c["id"]: c["verdict"] for c in doc["containers"]}
    assert verdicts == {"gpu-ok": "ok", "gpu-lost": "lost", "gpu-never": "denied", "gpu-hook": "at-risk"}, verdicts
    hook = next(c for c in doc["containers"] if c["id"] == "gpu-hook")
    assert {s for e in hook["expected"].values() for s in e["sources"]} == {"nvidia-hook"}
    assert doc["host"], "the host findings are part of what is validated"

    dry = _cli_json(nvsymlinkd_cli, "--root", root, "repair", "--json", "--dry-run", code=1)
    validators("repair", dry)
    dry_statuses = {r["container"]: r["status"] for r in dry["containers"]}
    assert dry_statuses["gpu-lost"] == "would-repair" and dry["dry_run"] is True, dry_statuses
    done = _cli_json(nvsymlinkd_cli, "--root", root, "repair", "--json", code=1)
    validators("repair", done)
    statuses = {r["container"]: r["status"] for r in done["containers"]}
    assert statuses["gpu-lost"] == "repaired", statuses
    assert [d["container"] for d in done["denied"]] == ["gpu-never"]

    # unknown: a state.json runc wrote without its config (issue 24 item 3)
    c = next(c for c in runc_host.containers if c.id == "gpu-lost")
    path = runc_host.state_root / c.id / "state.json"
    original = path.read_text()
    path.write_text(json.dumps({**json.loads(original), "config": None}))
    try:
        doc = _cli_json(nvsymlinkd_cli, "--root", root, "check", "--json", "--no-bus", "gpu-lost", code=1)
        validators("check", doc)
        assert [c["verdict"] for c in doc["containers"]] == ["unknown"]
        rep = _cli_json(nvsymlinkd_cli, "--root", root, "repair", "--json", "gpu-lost", code=1)
        validators("repair", rep)
        assert [u["container"] for u in rep["unknown"]] == ["gpu-lost"]
    finally:
        path.write_text(original)  # runc needs it to kill and delete the container


def test_error_document_validates(tmp_path, nvsymlinkd_cli, validators):
    bad = tmp_path / "bad.toml"
    bad.write_text("repair = [\n")
    for command, schema in (("check", "check"), ("repair", "repair")):
        proc = nvsymlinkd_cli("--config", bad, command, "--json")
        assert proc.returncode != 0
        doc = json.loads(proc.stdout)
        validators(schema, doc)
        assert doc["ok"] is False and doc["exit_code"] == proc.returncode


SCOPE_KEEP = [("/dev/char/1:3", "rwm"), ("/dev/char/1:5", "rwm"), ("/dev/char/10:200", "rwm")]


def _transient(runc_host, scope: str) -> None:
    """systemd's unit file for a scope that lacks the GPU (what the verifier reads when the bus does not know it)."""
    runc_host.fake.write(f"/run/systemd/transient/{scope}", "# transient\n[Scope]\nDevicePolicy=strict\nDeviceAllow=\n"
                         + "".join(f"DeviceAllow={p} {a}\n" for p, a in SCOPE_KEEP))


def test_every_repair_status_validates(runc_host, nvsymlinkd_cli, validators, tmp_path, monkeypatch):
    """Real `repair --json` documents holding every status (repaired, prevented, nothing-to-do, would-repair,
    cannot-repair, failed) and a refused grant of source `unexpected`, which the schema refused though its
    own docs example showed it (issue 39 item 10); python-dbusmock is systemd on a private bus."""
    from tests.privatebus import need_dbusmock
    from tests.test_repair_dbus import SystemdMock

    need_dbusmock()
    gpu = dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
               env=["NVIDIA_VISIBLE_DEVICES=0"])
    mock = SystemdMock(tmp_path / "sdbus-schema")
    try:
        mock.start()
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", mock.address)
        root = str(runc_host.root)
        runc_host.run("gpu-s-lost", **gpu).deny("c 195:0 rw")  # cgroupfs: repaired
        for cid, known in (("gpu-s-prev", True), ("gpu-s-fail", False)):
            scope = f"runc-{cid}.scope"  # at risk: its scope lacks the GPU
            _transient(runc_host, scope)
            c = runc_host.run(cid, driver="systemd", **gpu)
            if known:  # prevented through SetUnitProperties; the other one systemd does not know: failed
                freezer = f"/sys/fs/cgroup/freezer/{c.cgroups_path.lstrip('/')}/freezer.state"
                mock.add_scope(scope, SCOPE_KEEP, root=root, devices=str(c.devices_dir()), freezer=freezer)
        # lost again right after a repair: the rate limit refuses a repair loop: cannot-repair
        cant = runc_host.run("gpu-s-cant", **gpu)
        cant.deny("c 195:0 rw")
        _cli_json(nvsymlinkd_cli, "--root", root, "repair", "--json", "gpu-s-cant", code=0)
        cant.deny("c 195:0 rw")
        # granted by something outside the spec, no baseline: nothing trusted expects it: nothing-to-do
        _transient(runc_host, "runc-gpu-s-hook.scope")
        runc_host.run("gpu-s-hook", driver="systemd", nodes=[device_node("/dev/nvidia0", 195, 0)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"]).allow("c 195:0 rw")

        dry = _cli_json(nvsymlinkd_cli, "--root", root, "repair", "--json", "--dry-run", code=1)
        validators("repair", dry)
        done = _cli_json(nvsymlinkd_cli, "--root", root, "repair", "--json", code=1)
        validators("repair", done)
    finally:
        mock.close()
    statuses = {r["container"]: r["status"] for r in done["containers"]}
    assert statuses == {"gpu-s-lost": "repaired", "gpu-s-prev": "prevented", "gpu-s-fail": "failed",
                        "gpu-s-cant": "cannot-repair", "gpu-s-hook": "nothing-to-do"}, statuses
    assert {r["status"] for r in dry["containers"]} >= {"would-repair"}
    hook = next(r for r in done["containers"] if r["container"] == "gpu-s-hook")
    assert [x["grant"]["source"] for x in hook["refused"]] == ["unexpected"], hook


def test_the_docs_examples_validate(validators):
    """The JSON examples docs/repair.md and docs/check.md show are documents the schemas accept (repair.md's
    showed a source the schema refused)."""
    docs = Path(__file__).resolve().parent.parent / "docs"
    for name, which in (("repair.md", "repair"), ("check.md", "check")):
        text = (docs / name).read_text()
        blocks = re.findall(r"^```json\n(.*?)^```", text, re.M | re.S)
        docs_ = [json.loads(b) for b in blocks if b.lstrip().startswith("{") and '"schema_version"' in b]
        assert docs_, name
        for doc in docs_:
            validators(which, doc)
