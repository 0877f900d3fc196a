"""The README's two commands: scripts/setup installs only what nvsymlinkd needs to run
(.ci/apt.d/runtime.txt), scripts/test (scripts/setup --test) everything the tests need.

The scripts run for real with a PATH where `dpkg-query` reports every package missing and `id`
says "not root", so they stop at the package step and name exactly what they would install.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
APT = REPO / ".ci" / "apt.d"


def packages(path: Path) -> set:
    text = re.sub(r"#.*", "", path.read_text())
    return set(text.split())


def would_install(tmp_path, *args) -> set:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dpkg-query").write_text("#!/bin/sh\nexit 1\n")
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:/usr/bin:/bin")
    proc = subprocess.run([str(REPO / "scripts" / "setup"), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    m = re.search(r"missing Debian packages:(.*); run as root", proc.stderr)
    assert m, proc.stderr
    return set(m.group(1).split())


def test_setup_installs_only_the_runtime_list(tmp_path):
    runtime = packages(APT / "runtime.txt")
    assert would_install(tmp_path) == runtime
    # no test tool sneaks into the main job's set-up
    assert not runtime & {"runc", "qemu-system-x86", "mmdebstrap", "lintian", "rpm", "linux-headers-amd64",
                          "python3-dbusmock", "umockdev"}


def test_setup_for_tests_installs_every_list(tmp_path):
    union = set()
    for f in APT.glob("*.txt"):
        union |= packages(f)
    got = would_install(tmp_path, "--test")
    assert got == union
    assert packages(APT / "runtime.txt") <= got


def test_setup_for_building_installs_only_the_build_list(tmp_path):
    """scripts/setup --build: what scripts/build-packages (and --repo) needs, nothing of the tests."""
    build = packages(APT / "build.txt")
    assert would_install(tmp_path, "--build") == build
    # every tool build-packages and make-repos call, and none that only the tests use
    assert {"dpkg-dev", "debhelper", "dh-python", "pybuild-plugin-pyproject", "python3-build", "rpm",
            "apt-utils", "createrepo-c"} <= build
    assert not build & {"lintian", "rpm2cpio", "runc", "qemu-system-x86", "mmdebstrap", "linux-headers-amd64",
                        "python3-dbusmock", "umockdev", "python3-pytest"}
    # the Build-Depends of debian/control, each in the list
    text = (REPO / "debian" / "control").read_text()
    bdeps = re.search(r"^Build-Depends:(.*?)^\S", text, re.M | re.S).group(1)
    names = {d.strip().split()[0] for d in bdeps.split(",") if d.strip()}
    assert names - {"debhelper-compat"} <= build, names - build


def test_setup_for_building_makes_no_venv(tmp_path):
    """The build runs /usr/bin/python3: on a machine with build.txt installed, --build makes no .venv."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup", tree / "scripts" / "setup")
    shutil.copytree(APT, tree / ".ci" / "apt.d")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dpkg-query").write_text("#!/bin/sh\necho 'install ok installed'\n")
    (fake / "dpkg-query").chmod(0o755)
    proc = subprocess.run([str(tree / "scripts" / "setup"), "--build"], env=dict(os.environ, PATH=f"{fake}:/usr/bin:/bin"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ready to build" in proc.stdout and not (tree / ".venv").exists()


def test_test_command_and_ci_use_the_full_set_up():
    assert "scripts/setup --test" in (REPO / "scripts" / "test").read_text()
    assert re.search(r"^scripts/test\b", (REPO / ".ci" / "run").read_text(), re.M)


def control_depends() -> set:
    text = (REPO / "debian" / "control").read_text()
    binary = text.split("\nPackage: nvsymlinkd\n", 1)[1]
    m = re.search(r"^Depends:(.*?)^\S", binary, re.M | re.S)
    return {d.strip().split()[0] for d in m.group(1).split(",") if d.strip() and not d.strip().startswith("$")}


def test_runtime_list_holds_the_package_depends():
    """What the .deb needs on a host is what scripts/setup installs for the checkout."""
    missing = control_depends() - packages(APT / "runtime.txt")
    assert not missing, f".ci/apt.d/runtime.txt lacks the .deb's Depends: {sorted(missing)}"


@pytest.mark.parametrize("arg", ["--bogus"])
def test_setup_rejects_unknown_arguments(arg):
    proc = subprocess.run([str(REPO / "scripts" / "setup"), arg], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: scripts/setup [--test | --build]" in proc.stderr


FAKE_PYTEST = r'''#!/bin/sh
# stands in for .venv/bin/python -m pytest ARGS: logs who ran with what, and exits as told
shift 2
tag=${NVSYMLINKD_VM_SHARD:-all}
echo "$tag $*" >>"$FAKE_DIR/runs"
touch "$FAKE_DIR/started.$(echo "$tag" | tr / -)"
echo "output of $tag"
sleep "${FAKE_SLEEP:-0}"
echo "$tag" >>"$FAKE_DIR/ended"
case "$tag $*" in
*"$FAKE_FAIL"*) exit 1 ;;
*"$FAKE_EMPTY"*) exit 5 ;;
esac
'''

# scripts/py39 stand-in: it only passes when every VM run started before it (beside lint, mypy and py39)
FAKE_PY39 = r'''#!/bin/sh
[ "${FAKE_SHARDS-}" = none ] && exit 0
for i in $(seq 50); do
    all=1
    for shard in ${FAKE_SHARDS:-1-1}; do [ -e "$FAKE_DIR/started.$shard" ] || all=""; done
    [ -n "$all" ] && exit "${FAKE_PY39_RC:-0}"
    sleep 0.1
done
exit 9
'''


def run_test_script(tmp_path, *args, **env):
    """scripts/test in a scratch tree whose setup, linters, py39 and pytest are stand-ins."""
    tree = tmp_path / "tree"
    if not tree.exists():
        (tree / "scripts").mkdir(parents=True)
        (tree / ".venv" / "bin").mkdir(parents=True)
        shutil.copy(REPO / "scripts" / "test", tree / "scripts" / "test")
        stubs = {"scripts/setup": "#!/bin/sh\n", "scripts/py39": FAKE_PY39, ".venv/bin/python": FAKE_PYTEST}
        for tool in ("ruff", "vermin", "mypy"):
            stubs[f".venv/bin/{tool}"] = "#!/bin/sh\nexit ${FAKE_LINT_RC:-0}\n"
        for rel, text in stubs.items():
            (tree / rel).write_text(text)
            (tree / rel).chmod(0o755)
    fake = tmp_path / "fake"
    shutil.rmtree(fake, ignore_errors=True)
    fake.mkdir()
    env = dict(os.environ, **dict(dict(FAKE_FAIL="no such run", FAKE_EMPTY="no such run"), **env), FAKE_DIR=str(fake))
    proc = subprocess.run([str(tree / "scripts" / "test"), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    runs = (fake / "runs").read_text().splitlines() if (fake / "runs").exists() else []
    ended = (fake / "ended").read_text().split() if (fake / "ended").exists() else []
    return proc, sorted(runs), ended


def test_test_command_runs_the_vm_cells_from_the_start_and_the_rest_after_the_checks(tmp_path):
    """scripts/test by default: one VM run (tests/vm, every cell: NVSYMLINKD_VM_SHARD=1/1) started before
    lint, mypy and py39, the rest after them, outputs in that order (two guests at once ran 2-2.5x slower
    each on CI's two cores); a shard count that is not a whole number >= 1 is refused."""
    proc, runs, _ = run_test_script(tmp_path, "-k", "x")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert runs == ["1/1 tests/vm -k x", "all --ignore=tests/vm -k x"]
    out = proc.stdout
    assert out.index("done at") < out.index("test: tests/vm:") < out.index("output of 1/1") < out.index("output of all")
    assert "test: pytest (tests/vm exit 0, the rest exit 0)" in out
    proc, _, _ = run_test_script(tmp_path, FAKE_FAIL="1/1")
    assert proc.returncode == 1 and "output of all" in proc.stdout, proc.stdout
    for bad in ("0", "two", "-1"):
        proc, runs, _ = run_test_script(tmp_path, NVSYMLINKD_VM_SHARDS=bad)
        assert proc.returncode == 2 and runs == [] and "NVSYMLINKD_VM_SHARDS" in proc.stderr, (bad, proc.stderr)


def test_test_command_runs_two_vm_shards_from_the_start_and_the_rest_after_the_checks(tmp_path):
    """NVSYMLINKD_VM_SHARDS=2: tests/vm as NVSYMLINKD_VM_SHARD=1/2 (with the harness's unit tests) and 2/2
    (the cells only), started before lint, mypy and py39; the rest after them; outputs in that order; any
    run failing fails the whole; a run that collects nothing (exit 5) is fine when another ran some."""
    two = dict(NVSYMLINKD_VM_SHARDS="2", FAKE_SHARDS="1-2 2-2")
    proc, runs, _ = run_test_script(tmp_path, "-k", "x", **two)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert runs == ["1/2 tests/vm -k x", "2/2 tests/vm/test_vm_e2e.py::test_scenario -k x",
                    "all --ignore=tests/vm -k x"]
    out = proc.stdout
    assert out.index("done at") < out.index("output of 1/2") < out.index("output of 2/2") < out.index("output of all")
    assert "test: pytest (tests/vm shard 1 exit 0, shard 2 exit 0, the rest exit 0)" in out
    proc, _, _ = run_test_script(tmp_path, FAKE_FAIL="2/2", **two)
    assert proc.returncode == 1 and "output of all" in proc.stdout, proc.stdout
    proc, _, _ = run_test_script(tmp_path, FAKE_EMPTY="2/2", **two)
    assert proc.returncode == 0 and "shard 2 exit 5" in proc.stdout, proc.stdout
    proc, _, _ = run_test_script(tmp_path, FAKE_EMPTY=" ", **two)
    assert proc.returncode == 5, proc.stdout


def test_test_command_stops_the_shards_when_a_check_fails_and_names_tests_in_one_run(tmp_path):
    proc, runs, ended = run_test_script(tmp_path, FAKE_SLEEP="30", FAKE_PY39_RC="3", NVSYMLINKD_VM_SHARDS="2",
                                        FAKE_SHARDS="1-2 2-2")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "lint, mypy or py39 failed (exit 3); the VM runs were stopped" in proc.stdout
    assert [r.split()[0] for r in runs] == ["1/2", "2/2"] and ended == [], "stopped, not waited for"
    proc, runs, _ = run_test_script(tmp_path, FAKE_LINT_RC="1")
    assert proc.returncode == 1 and "py39" not in proc.stdout.split("lint, mypy")[0]
    proc, runs, _ = run_test_script(tmp_path, "tests/test_setup.py", "-x", FAKE_SHARDS="none")
    assert proc.returncode == 0 and runs == ["all tests/test_setup.py -x"], (proc.stdout, runs)
