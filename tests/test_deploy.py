"""deploy/kubernetes: manifests valid against the Kubernetes API schemas (offline), kustomize renders,
the DaemonSet mounts what the daemon reads and writes, the image's Dockerfile lints and its layout runs."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nvsymlinkd.config import parse_config
from tests.conftest import need_tool

REPO = Path(__file__).parent.parent
# Debian 12's python3 is 3.11 (the image's and CI's); the module list arrived in 3.10
STDLIB = getattr(sys, "stdlib_module_names", None)
KUBE = REPO / "deploy/kubernetes"
BASE = KUBE / "base"
OVERLAYS = {"base": BASE, "driver-container": KUBE / "overlays/driver-container",
            "report-only": KUBE / "overlays/report-only"}
# recursiveReadOnly needs 1.30+ (IfPossible falls back to plain read-only where the runtime cannot)
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
HOST = "/host"


def validate(doc: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: "
                                 f"{exc.message} at {'/'.join(map(str, exc.path))}")


def tool(name: str) -> str:
    """A tool from the test extra lives beside the venv's python, which may not be on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else need_tool(name)


def render(directory: Path) -> list:
    kubectl = need_tool("kubectl")  # kustomize is built into kubectl
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list) -> dict:
    out = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def daemonset(docs: list) -> dict:
    (ds,) = by_kind(docs)["DaemonSet"]
    return ds


def config_of(docs: list):
    (cm,) = by_kind(docs)["ConfigMap"]
    return parse_config(cm["data"]["nvsymlinkd.toml"].encode(), cm["metadata"]["name"])


# -- offline: the raw files, no kustomize needed ---------------------------------------------


def base_docs() -> list:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def test_base_resources_validate_offline():
    docs = base_docs()
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "Namespace", "ServiceAccount"]
    for d in docs:
        validate(d)


def test_schema_validation_catches_a_mistake():
    ds = daemonset(base_docs())
    ds["spec"]["template"]["spec"]["hostPid"] = True  # the real field is hostPID
    with pytest.raises(AssertionError, match="hostPid"):
        validate(ds)


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_config_files_parse_with_the_daemons_own_parser(name):
    kust = yaml.safe_load((OVERLAYS[name] / "kustomization.yaml").read_text())
    (gen,) = kust["configMapGenerator"]
    (f,) = gen["files"]
    config = parse_config((OVERLAYS[name] / f).read_bytes(), f)
    assert config.metrics_textfile  # the probes read it
    want = {"base": ("/", "auto"), "driver-container": ("/run/nvidia/driver", "auto"),
            "report-only": ("/", "report")}[name]
    assert (config.driver_root, config.repair) == want


def test_daemonset_shape():
    ds = daemonset(base_docs())
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is False
    # udevd's events (module loads, GPU bind/unbind) reach only the host's network namespace
    assert pod["hostNetwork"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    argv = c["command"]
    assert argv[:3] == ["nvsymlinkd", "--root", HOST] and argv[-1] == "run"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    res = c["resources"]
    assert res["requests"]["memory"] == "64Mi" and res["limits"]["memory"] == "256Mi"


def mounts(docs: list) -> dict:
    """mountPath -> (host path, read-only, propagation) for hostPath volumes."""
    pod = daemonset(docs)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for m in pod["containers"][0]["volumeMounts"]:
        v = vols[m["name"]]
        if "hostPath" in v:
            out[m["mountPath"]] = (v["hostPath"]["path"], bool(m.get("readOnly")), m.get("mountPropagation"))
    return out


def writable(docs: list, inside: str) -> bool:
    """Is the host path `inside` writable for the daemon (the deepest mount covering /host+inside)?"""
    real = HOST + inside
    best = max((p for p in mounts(docs) if real == p or real.startswith(p.rstrip("/") + "/")), key=len)
    return not mounts(docs)[best][1]


EXPECTED_MOUNTS = {
    "/host": ("/", True, None),
    "/host/dev": ("/dev", False, None),
    "/host/sys/fs/cgroup": ("/sys/fs/cgroup", False, None),
    "/host/run/systemd": ("/run/systemd", False, None),
    "/run/systemd/journal": ("/run/systemd/journal", False, None),
    # libudev subscribes to udevd's events only where /run/udev/control exists (a pod's /run has none)
    "/run/udev": ("/run/udev", True, None),
    "/host/run/dbus/system_bus_socket": ("/run/dbus/system_bus_socket", False, None),
    "/host/run/nvsymlinkd": ("/run/nvsymlinkd", False, None),
    "/host/var/lib/node_exporter/textfile_collector": ("/var/lib/node_exporter/textfile_collector", False, None),
}


def test_exactly_the_host_mounts_the_daemon_needs():
    docs = base_docs()
    assert mounts(docs) == EXPECTED_MOUNTS
    # every host mount but the journal socket's and udev's (where the libraries look for them) is
    # the host path under --root: one view of the host
    for path, (host_path, _, _) in mounts(docs).items():
        assert path == HOST + host_path.rstrip("/") or path == HOST or path == host_path
    (c,) = daemonset(docs)["spec"]["template"]["spec"]["containers"]
    root_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == HOST)
    assert root_mount["recursiveReadOnly"] == "IfPossible"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["DBUS_SYSTEM_BUS_ADDRESS"] == "unix:path=/host/run/dbus/system_bus_socket"


def test_what_the_daemon_writes_is_mounted_writable_and_the_rest_is_not():
    docs = base_docs()
    config = parse_config((BASE / "nvsymlinkd.toml").read_bytes(), "nvsymlinkd.toml")
    for inside in (config.dev_char_path, config.driver_root.rstrip("/") + "/dev", config.state_dir,
                   os.path.dirname(config.metrics_textfile), "/sys/fs/cgroup/devices", "/run/systemd/transient"):
        assert writable(docs, inside), inside
    for inside in ("/etc", "/proc", "/usr", "/run/containerd", "/run/docker", "/run/runc", "/run/crun",
                   "/run/containers", "/var/lib/kubelet"):
        assert not writable(docs, inside), inside


def test_probes_read_the_configured_metrics_file():
    docs = base_docs()
    config = parse_config((BASE / "nvsymlinkd.toml").read_bytes(), "nvsymlinkd.toml")
    (c,) = daemonset(docs)["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        argv = c[probe]["exec"]["command"]
        assert argv[:4] == ["python3", "-m", "nvsymlinkd.metrics", "check"], argv
        assert argv[4] == HOST + config.metrics_textfile
    assert "--max-sync-age" in c["readinessProbe"]["exec"]["command"]
    assert "--max-sync-age" not in c["livenessProbe"]["exec"]["command"]  # a broken host is not a restart


# -- kustomize renders (kubectl's built-in kustomize) ------------------------------------------


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_kustomize_renders_valid_manifests(name):
    docs = render(OVERLAYS[name])
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "DaemonSet", "Namespace", "ServiceAccount"]
    for d in docs:
        validate(d)
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "nvsymlinkd"
    ds = daemonset(docs)
    (cm,) = by_kind(docs)["ConfigMap"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]  # the hashed name, rolled out
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"].startswith("registry.example.com/nvsymlinkd:")
    config = config_of(docs)
    if name == "driver-container":
        assert config.driver_root == "/run/nvidia/driver"
        assert mounts(docs)["/host/run/nvidia/driver"] == ("/run/nvidia/driver", False, "HostToContainer")
        assert writable(docs, config.driver_root + "/dev")
    else:
        assert "/host/run/nvidia/driver" not in mounts(docs)  # no empty /run/nvidia/driver on host-driver nodes
        assert mounts(docs) == EXPECTED_MOUNTS
    assert config.repair == ("report" if name == "report-only" else "auto")


# -- the image ------------------------------------------------------------------------------


def test_dockerfile_lints():
    out = subprocess.run([tool("hadolint"), str(KUBE / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _apt_packages() -> set:
    text = (KUBE / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "apt-get install" in ln)
    words = line.split("apt-get install", 1)[1].split("&&")[0].split()
    return {w for w in words if not w.startswith("-")}


# third-party import -> the Debian package that provides it
DEBIAN = {"jinja2": "python3-jinja2", "pyudev": "python3-pyudev", "dbus_next": "python3-dbus-next",
          "systemd": "python3-systemd", "markupsafe": "python3-jinja2"}
OPTIONAL = {"pynvml", "tomli"}  # nvidia-ml-py (extra); tomli only before Python 3.11 (Debian 12 has 3.11)


@pytest.mark.skipif(STDLIB is None, reason="needs Python >= 3.10 (sys.stdlib_module_names)")
def test_image_installs_every_package_the_code_imports():
    apt = _apt_packages()
    needed = set()
    for path in (REPO / "nvsymlinkd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top in STDLIB or top == "nvsymlinkd" or top in OPTIONAL:
                    continue
                assert top in DEBIAN, f"{path.name} imports {top}: add its Debian package to the Dockerfile"
                needed.add(DEBIAN[top])
    assert needed <= apt, needed - apt


def test_image_layout_runs_the_cli_and_the_probe(tmp_path):
    """What the Dockerfile builds, on this Debian 12: the package (links resolved) in a dist-packages
    directory, the shim as `nvsymlinkd`, Debian's python3 without the venv."""
    dist = tmp_path / "dist-packages"
    shutil.copytree(REPO / "nvsymlinkd", dist / "nvsymlinkd", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert not any(p.is_symlink() for p in (dist / "nvsymlinkd").rglob("*"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy2(KUBE / "nvsymlinkd.sh", bindir / "nvsymlinkd")
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "PYTHONPATH": str(dist), "HOME": str(tmp_path)}
    out = subprocess.run(["nvsymlinkd", "--version"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("nvsymlinkd "), out.stderr
    host = tmp_path / "host"
    (host / "proc").mkdir(parents=True)
    (host / "proc/devices").write_text("Character devices:\n  1 mem\n\nBlock devices:\n  8 sd\n")
    out = subprocess.run(["nvsymlinkd", "--root", str(host), "sync", "--dry-run"], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    prom = tmp_path / "nvsymlinkd.prom"
    probe = ["python3", "-m", "nvsymlinkd.metrics", "check", str(prom), "--max-age", "120"]
    assert subprocess.run(probe, env=env, cwd=tmp_path, capture_output=True).returncode == 1  # no file yet
    code = "from nvsymlinkd.metrics import Metrics; print(Metrics().render(), end='')"
    prom.write_text(subprocess.run(["python3", "-c", code], env=env, cwd=tmp_path, capture_output=True,
                                   text=True, check=True).stdout)
    out = subprocess.run(probe, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # the probe stays cheap: the metrics module pulls in nothing beyond the standard library, except the
    # verifier's words (verify/kinds.py, itself standard library only: anything it imported would show here)
    code = ("import sys; before = set(sys.modules); import nvsymlinkd.metrics; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in "
            "getattr(sys, 'stdlib_module_names', ('sys',))))")
    out = subprocess.run(["python3", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("['nvsymlinkd', 'nvsymlinkd.metrics', 'nvsymlinkd.verify', "
                                  "'nvsymlinkd.verify.kinds']")


def test_ctypes_only_in_host_libc():
    # every foreign call in one place to audit (docs/architecture.md): host/libc.py
    import ast

    found = []
    for path in sorted((REPO / "nvsymlinkd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "ctypes" or n.startswith("ctypes.") for n in names):
                found.append(str(path.relative_to(REPO)))
    assert found == ["nvsymlinkd/host/libc.py"]


# The import contract: a pure planner reaches no module that does I/O (no HostRoot, no ctypes, no
# cgroup or systemd client), so it runs, and is table-tested, anywhere. Pure nvsymlinkd modules:
PURE = {"nvsymlinkd", "nvsymlinkd.errors", "nvsymlinkd.host", "nvsymlinkd.host.devices", "nvsymlinkd.host.procdevices",
        "nvsymlinkd.host.paths", "nvsymlinkd.host.nodes",
        "nvsymlinkd.access", "nvsymlinkd.access.rules", "nvsymlinkd.access.bpfeval", "nvsymlinkd.access.bpfgen",
        "nvsymlinkd.access.bpfproof", "nvsymlinkd.verify", "nvsymlinkd.verify.kinds",
        "nvsymlinkd.verify.journaldiff", "nvsymlinkd.verify.evaluate", "nvsymlinkd.messageids", "nvsymlinkd.text",
        "nvsymlinkd.containers.model",
        "nvsymlinkd.repair", "nvsymlinkd.repair.plan", "nvsymlinkd.repair.model", "nvsymlinkd.repair.mechanisms", "nvsymlinkd.repair.keep", "nvsymlinkd.devchar", "nvsymlinkd.devchar.model",
        "nvsymlinkd.devchar.plan", "nvsymlinkd.record", "nvsymlinkd.containers", "nvsymlinkd.containers.hookgrant",
        "nvsymlinkd.containers.early", "nvsymlinkd.containers.runtimes", "nvsymlinkd.host.mig", "nvsymlinkd.host.imex",
        "nvsymlinkd.daemon", "nvsymlinkd.daemon.linknews", "nvsymlinkd.daemon.reasons",
        "nvsymlinkd.systemd", "nvsymlinkd.systemd.deviceallow"}
IO_STDLIB = {"ctypes", "socket", "asyncio", "fcntl", "subprocess", "threading", "select"}


@pytest.mark.parametrize("module", [
    "nvsymlinkd.repair.plan", "nvsymlinkd.host.devices", "nvsymlinkd.verify.kinds",
    "nvsymlinkd.host.paths", "nvsymlinkd.host.nodes", "nvsymlinkd.devchar.model", "nvsymlinkd.devchar.plan",
    "nvsymlinkd.verify.journaldiff", "nvsymlinkd.access.rules", "nvsymlinkd.access.bpfeval", "nvsymlinkd.access.bpfgen",
    "nvsymlinkd.access.bpfproof", "nvsymlinkd.containers.hookgrant", "nvsymlinkd.containers.early",
    "nvsymlinkd.verify.evaluate", "nvsymlinkd.containers.model", "nvsymlinkd.messageids", "nvsymlinkd.text",
    "nvsymlinkd.repair.model", "nvsymlinkd.repair.mechanisms", "nvsymlinkd.containers.runtimes",
    "nvsymlinkd.record", "nvsymlinkd.repair.keep", "nvsymlinkd.errors", "nvsymlinkd.host.procdevices",
    "nvsymlinkd.host.mig", "nvsymlinkd.host.imex", "nvsymlinkd.daemon.linknews", "nvsymlinkd.daemon.reasons",
    "nvsymlinkd.systemd.deviceallow",
])
def test_pure_modules_import_no_io(module):
    code = (f"import sys; before = set(sys.modules); import {module}; new = set(sys.modules) - before; "
            "print(' '.join(sorted(new)))")
    new = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=REPO).stdout.split())
    ours = {m for m in new if m.split(".")[0] == "nvsymlinkd"}
    assert ours <= PURE, f"{module} imports {sorted(ours - PURE)}"
    assert not new & IO_STDLIB, f"{module} imports {sorted(new & IO_STDLIB)}"


def test_every_pure_module_is_strict_typed_and_held_by_the_contract():
    """Issue 27: `--strict` mypy covers every pure module. PURE lists what pure modules may import; each of
    them that is a module (not a package's __init__) is in scripts/test's strict list and in the contract
    test's parameters, so a module added to PURE without either fails here."""
    import re

    script = (REPO / "scripts" / "test").read_text()
    strict_part = script.split("--strict", 1)[1].split(".venv/bin/mypy --ignore-missing-imports nvsymlinkd\n", 1)[0]
    strict = {p[:-3].replace("/", ".") for p in re.findall(r"nvsymlinkd/[\w/]+\.py", strict_part)}
    params = set(test_pure_modules_import_no_io.pytestmark[0].args[1])
    modules = {m for m in PURE if (REPO / (m.replace(".", "/") + ".py")).is_file()}
    assert modules - strict == set(), f"pure modules without --strict mypy in scripts/test: {sorted(modules - strict)}"
    assert modules - params == set(), f"pure modules outside test_pure_modules_import_no_io: {sorted(modules - params)}"



# -- every import names the module where the name lives (issue 37, item 2) ------------------------

def _module_file(base: Path, module: str):
    for candidate in (base / (module.replace(".", "/") + ".py"), base / module.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


PACKAGES = ("nvsymlinkd", "tests")  # the test suite's helpers too (tests.bpfasm re-exported bpfgen's assembler)


def import_desks(files, base: Path = REPO) -> list:
    """'file:line: ...' for every import of a nvsymlinkd or tests name through a module that only imports it (a
    re-export desk: name the module where it lives), every private name (`_x`) imported from another
    module (make it public where it is an API), and every module-level `noqa: F401` in nvsymlinkd/ (a
    re-export block)."""
    imported: dict = {}  # module -> the names its top level binds by importing them from nvsymlinkd

    def imports_of(module: str) -> set:
        if module not in imported:
            path, names = _module_file(base, module), set()
            for node in ast.parse(path.read_text()).body if path else ():
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                    names |= {a.asname or a.name for a in node.names
                              if _module_file(base, f"{node.module}.{a.name}") is None}
            imported[module] = names
        return imported[module]

    found = []
    for path in files:
        rel = path.relative_to(base)
        text = path.read_text()
        if rel.parts[0] == "nvsymlinkd":
            found += [f"{rel}:{i}: a re-export block" for i, line in enumerate(text.splitlines(), 1)
                      if line.startswith(("from ", "import ", ")")) and "noqa: F401" in line]
        own = ".".join(rel.with_suffix("").parts)
        for node in ast.walk(ast.parse(text, str(path))):
            if not (isinstance(node, ast.ImportFrom) and not node.level and node.module
                    and node.module.split(".")[0] in PACKAGES):
                continue
            for alias in node.names:
                if _module_file(base, f"{node.module}.{alias.name}") is not None:
                    continue  # a module
                if alias.name in imports_of(node.module):
                    found.append(f"{rel}:{node.lineno}: {node.module}.{alias.name} only imports it")
                if alias.name.startswith("_") and not alias.name.startswith("__") and node.module != own:
                    found.append(f"{rel}:{node.lineno}: {node.module}.{alias.name} is private")
    return found


def test_every_import_names_the_module_where_the_name_lives():
    files = sorted(p for d in ("nvsymlinkd", "tests", "scripts", "benchmarks") for p in (REPO / d).rglob("*.py")
                   if "__pycache__" not in p.parts)
    assert import_desks(files) == [], "import each name from the module where it lives; no `_x` across modules"


def test_the_desk_rule_sees_a_reexport_and_a_private_import(tmp_path):
    pkg = tmp_path / "nvsymlinkd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\n_y = 2\n")
    (pkg / "b.py").write_text("from nvsymlinkd.a import X  # noqa: F401 - the callers' names\n")
    (pkg / "c.py").write_text("from nvsymlinkd.b import X\nfrom nvsymlinkd.a import _y\nfrom nvsymlinkd import a\n")
    found = import_desks([pkg / "b.py", pkg / "c.py"], tmp_path)
    assert found == ["nvsymlinkd/b.py:1: a re-export block", "nvsymlinkd/c.py:1: nvsymlinkd.b.X only imports it",
                     "nvsymlinkd/c.py:2: nvsymlinkd.a._y is private"]


# -- the house's size limits (issue 37, item 6) -----------------------------------------------------

MAX_FLAT_MODULES = 8  # directly in nvsymlinkd/, besides __init__ and __main__: the others live in their noun's folder
MAX_FUNCTION_LINES = 80
# over the limit and waiting for its split, the list only shrinking (empty: repair_container was the last)
LONG_FUNCTIONS: set = set()


def long_functions(files, base: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> dict:
    """'file:name' -> lines, for every function or method in FILES longer than LIMIT lines."""
    out = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit:
                out[f"{path.relative_to(base)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_at_most_eight_flat_modules():
    flat = sorted(p.name for p in (REPO / "nvsymlinkd").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(flat) <= MAX_FLAT_MODULES, f"move a module into the folder of its noun: {flat}"


def test_no_function_over_80_lines():
    found = long_functions(sorted(p for p in (REPO / "nvsymlinkd").rglob("*.py") if "__pycache__" not in p.parts))
    assert set(found) <= LONG_FUNCTIONS, f"split by what each part decides: {found}"
    assert LONG_FUNCTIONS <= set(found), f"split: take these off LONG_FUNCTIONS: {sorted(LONG_FUNCTIONS - set(found))}"


def test_the_length_rule_counts_every_line(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "m.py").write_text(f"def fits():\n{body}\n\nclass C:\n    def over(self):\n    {body.replace(chr(10), chr(10) + '    ')}    y = 1\n")
    assert long_functions([tmp_path / "m.py"], tmp_path) == {"m.py:over": MAX_FUNCTION_LINES + 1}

# -- the textfile's path, named once (components/textfile-path) ---------------------------------

# Debian's prometheus-node-exporter reads this directory (its /etc/default/prometheus-node-exporter)
DEBIAN_TEXTFILE = "/var/lib/prometheus/node-exporter/nvsymlinkd.prom"


def textfile_references(docs: list) -> dict:
    """Every place the rendered DaemonSet and its config name the metrics textfile or its directory."""
    (c,) = daemonset(docs)["spec"]["template"]["spec"]["containers"]
    pod = daemonset(docs)["spec"]["template"]["spec"]
    mount = next(mt["mountPath"] for mt in c["volumeMounts"] if mt["name"] == "host-textfile")
    volume = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == "host-textfile")
    refs = {probe: c[probe]["exec"]["command"][4] for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
    return {**refs, "mount": mount, "volume": volume, "config": config_of(docs).metrics_textfile}


def follows(refs: dict, textfile: str) -> bool:
    directory = os.path.dirname(textfile)
    return refs == {"startupProbe": HOST + textfile, "livenessProbe": HOST + textfile, "readinessProbe": HOST + textfile,
                    "mount": HOST + directory, "volume": directory, "config": textfile}


@pytest.mark.parametrize("name", sorted(OVERLAYS) + ["site"])
def test_the_textfile_path_is_named_once_and_every_reference_follows(name, tmp_path):
    src = KUBE / "overlays/site" if name == "site" else OVERLAYS[name]
    docs = render(src)
    default = config_of(docs).metrics_textfile
    assert follows(textfile_references(docs), default), textfile_references(docs)
    # an overlay on it changes metrics_textfile in its nvsymlinkd.toml, and nothing else
    toml_dir = BASE if name == "site" else OVERLAYS[name]
    toml = (toml_dir / "nvsymlinkd.toml").read_text()
    assert toml.count(default) == 1 and toml.count("'''") == 2
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "nvsymlinkd.toml").write_text(toml.replace(default, DEBIAN_TEXTFILE))
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(src, overlay)}]\n"
        f"components: [{os.path.relpath(KUBE / 'components/textfile-path', overlay)}]\n"
        "configMapGenerator:\n  - name: nvsymlinkd-config\n    behavior: replace\n    files: [nvsymlinkd.toml]\n")
    changed = render(overlay)
    assert follows(textfile_references(changed), DEBIAN_TEXTFILE), textfile_references(changed)
    old_dir = os.path.dirname(default)
    assert old_dir not in yaml.safe_dump(daemonset(changed))  # no reference left behind
    for d in changed:
        validate(d)
    # the rest of the DaemonSet is as before
    before, after = daemonset(docs), daemonset(changed)
    for ds in (before, after):
        ds["spec"]["template"]["spec"]["volumes"] = [v for v in ds["spec"]["template"]["spec"]["volumes"]
                                                     if v["name"] not in ("host-textfile", "config")]
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        for key in ("startupProbe", "livenessProbe", "readinessProbe", "volumeMounts"):
            c.pop(key)
    assert before == after
