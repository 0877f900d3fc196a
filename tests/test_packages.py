"""The .deb and the .rpm, built for real from a temporary copy of the tree (each once per session).

- .deb: dpkg-buildpackage -us -uc -b (debhelper 13, dh-python, pybuild-plugin-pyproject), lintian,
  then a real `dpkg -i` into a throwaway root: an overlayfs over / in a private mount namespace,
  with a fake NVIDIA /proc/devices and real mknod'ed nodes, so the postinst's sync must make links.
- .rpm: rpmbuild -ta --nodeps on the sdist (Debian has no rpm database for BuildRequires) for RHEL 9
  and Fedora 42 (the target's Python named, as scripts/build-packages does: Debian has no Python rpm
  macros), then its file list against the target's layout, Requires, scriptlets and payload. Nothing
  here installs it on Fedora or RHEL (docs/packaging.md says what was and was not tried).
"""

import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

import nvsymlinkd
from nvsymlinkd.config import Config
from nvsymlinkd.systemd.render import render_all
from tests.conftest import need_tool, skip_or_fail
from tests.debbuild import build_deb, copy_tree, run
from tests.runcfixture import device_node, device_rule

REPO = Path(__file__).resolve().parent.parent
VERSION = nvsymlinkd.__version__
HAS_CATALOG = (REPO / "catalog" / "nvsymlinkd.catalog").is_file()
RENDERED = render_all(Config())
DEB = {  # Debian bookworm paths (dh_installsystemd and dh_installudev still use /lib)
    "unit": "lib/systemd/system/nvsymlinkd.service",
    "sync_unit": "lib/systemd/system/nvsymlinkd-sync.service",
    "rules": "lib/udev/rules.d/71-nvsymlinkd.rules",
    "man": "usr/share/man/man8/nvsymlinkd.8.gz",
    "config": "etc/nvsymlinkd/nvsymlinkd.toml",
    "entry_point": "usr/bin/nvsymlinkd",
    "catalog": "usr/lib/systemd/catalog/nvsymlinkd.catalog",
    "templates": "usr/lib/python3/dist-packages/nvsymlinkd/templates/nvsymlinkd.service.j2",
    "completion": "usr/share/bash-completion/completions/nvsymlinkd",
    "zsh_completion": "usr/share/zsh/vendor-completions/_nvsymlinkd",
    "fish_completion": "usr/share/fish/vendor_completions.d/nvsymlinkd.fish",
}
RPM = {  # Fedora/RHEL paths
    "unit": "/usr/lib/systemd/system/nvsymlinkd.service",
    "sync_unit": "/usr/lib/systemd/system/nvsymlinkd-sync.service",
    "rules": "/usr/lib/udev/rules.d/71-nvsymlinkd.rules",
    "man": "/usr/share/man/man8/nvsymlinkd.8",
    "config": "/etc/nvsymlinkd/nvsymlinkd.toml",
    "entry_point": "/usr/bin/nvsymlinkd",
    "catalog": "/usr/lib/systemd/catalog/nvsymlinkd.catalog",
    "completion": "/usr/share/bash-completion/completions/nvsymlinkd",
    "zsh_completion": "/usr/share/zsh/site-functions/_nvsymlinkd",
    "fish_completion": "/usr/share/fish/vendor_completions.d/nvsymlinkd.fish",
}
# every module of the package, subpackages included (setuptools finds them through packages.find)
MODULES = sorted(str(p.relative_to(REPO)) for p in (REPO / "nvsymlinkd").rglob("*.py"))
# man/NAME.SECTION.rst: every page ships, in its section
MAN_PAGES = sorted(p.name[:-len(".rst")] for p in (REPO / "man").glob("*.rst"))


@pytest.fixture(scope="module")
def deb_build(tmp_path_factory):
    for tool in ("dpkg-buildpackage", "dh", "pybuild", "dpkg-deb"):
        need_tool(tool)
    work = tmp_path_factory.mktemp("deb")
    deb = build_deb(work)
    assert deb.name == f"nvsymlinkd_{VERSION}_all.deb"
    changes = next(work.glob(f"nvsymlinkd_{VERSION}_*.changes"))
    tree = work / "extracted"
    run(["dpkg-deb", "-x", deb, tree])
    ctrl = work / "control"
    run(["dpkg-deb", "-e", deb, ctrl])
    return {"deb": deb, "changes": changes, "tree": tree, "control": ctrl, "work": work}


# target -> (its python3, dist tag): RHEL 9 and Fedora 41/42 (scripts/build-packages' RPM_TARGETS)
RPM_TARGETS = {"el9": ("3.9", ".el9"), "fc42": ("3.13", ".fc42")}


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    for tool in ("rpmbuild", "rpm", "rpm2cpio", "cpio"):
        need_tool(tool)
    work = tmp_path_factory.mktemp("sdist")
    src = copy_tree(work / "src")
    run(["/usr/bin/python3", "-m", "build", "--sdist", "--no-isolation", "--outdir", work / "dist", "."], cwd=src)
    return work / "dist" / f"nvsymlinkd-{VERSION}.tar.gz"


def rpmbuild(sdist: Path, work: Path, *defines, check=True):
    argv = ["rpmbuild", "-ta", "--nodeps", "--define", f"_topdir {work / 'top'}"]
    for d in defines:
        argv += ["--define", d]
    return run([*argv, sdist], cwd=work, check=check)


@pytest.fixture(scope="module", params=sorted(RPM_TARGETS))
def rpm_build(request, sdist, tmp_path_factory):
    target = request.param
    python, dist = RPM_TARGETS[target]
    work = tmp_path_factory.mktemp(f"rpm-{target}")
    rpmbuild(sdist, work, f"python3_version {python}", f"dist {dist}")
    rpm = next((work / "top" / "RPMS" / "noarch").glob(f"nvsymlinkd-{VERSION}-*.noarch.rpm"))
    assert rpm.name == f"nvsymlinkd-{VERSION}-1{dist}.noarch.rpm"
    tree = work / "extracted"
    tree.mkdir()
    run(["sh", "-c", f"rpm2cpio '{rpm}' | cpio -idm --quiet"], cwd=tree)
    return {"rpm": rpm, "sdist": sdist, "tree": tree, "work": work, "target": target, "python": python}


# -- .deb -------------------------------------------------------------------------------------------


def test_deb_puts_files_where_debian_expects_them(deb_build):
    tree = deb_build["tree"]
    for what, rel in DEB.items():
        if what == "catalog" and not HAS_CATALOG:
            assert not (tree / rel).exists()
            continue
        assert (tree / rel).is_file(), f"{what}: {rel} missing from the .deb"
    assert os.access(tree / DEB["entry_point"], os.X_OK)
    assert (deb_build["control"] / "conffiles").read_text().split() == ["/" + DEB["config"]]
    for page in MAN_PAGES:
        assert (tree / f"usr/share/man/man{page.rsplit('.', 1)[1]}/{page}.gz").is_file(), page
    missing = [m for m in MODULES if not (tree / "usr/lib/python3/dist-packages" / m).is_file()]
    assert not missing, f"modules missing from the .deb: {missing}"
    assert (tree / "usr/share/doc/nvsymlinkd/docs/troubleshooting.md").is_file() or \
        (tree / "usr/share/doc/nvsymlinkd/docs/troubleshooting.md.gz").is_file()


def test_deb_units_and_rule_are_the_rendered_templates(deb_build):
    tree = deb_build["tree"]
    assert (tree / DEB["unit"]).read_text() == RENDERED["nvsymlinkd.service"]
    assert (tree / DEB["sync_unit"]).read_text() == RENDERED["nvsymlinkd-sync.service"]
    assert (tree / DEB["rules"]).read_text() == RENDERED["71-nvsymlinkd.rules"]
    assert (tree / DEB["config"]).read_text() == (REPO / "examples" / "nvsymlinkd.toml").read_text()


def test_deb_dependencies(deb_build):
    fields = run(["dpkg-deb", "-f", deb_build["deb"], "Depends", "Recommends", "Suggests"]).stdout
    depends = re.search(r"^Depends: (.*)$", fields, re.M).group(1)
    # procps: /bin/kill of ExecReload=
    for pkg in ("python3-pyudev", "python3-dbus-next", "python3-jinja2", "python3-systemd", "procps"):
        assert re.search(rf"(^|, ){pkg}(,|$| )", depends), f"{pkg} not in Depends: {depends}"
    assert "pynvml" not in depends and "nvidia" not in fields.split("Suggests")[0]
    assert re.search(r"^Suggests: .*python3-pynvml", fields, re.M)


def test_deb_postinst_enables_starts_reloads_and_syncs(deb_build):
    postinst = (deb_build["control"] / "postinst").read_text()
    assert "deb-systemd-helper enable 'nvsymlinkd.service'" in postinst
    assert "deb-systemd-invoke $_dh_action 'nvsymlinkd.service'" in postinst
    assert "deb-systemd-helper enable 'nvsymlinkd-sync.service'" in postinst  # enabled for boot ...
    assert "deb-systemd-invoke $_dh_action 'nvsymlinkd-sync.service'" not in postinst  # ... not started here
    assert "udevadm control --reload-rules" in postinst
    assert re.search(r"^\s+if ! nvsymlinkd sync; then", postinst, re.M)


def test_lintian_has_no_errors_or_warnings(deb_build):
    need_tool("lintian")
    proc = run(["lintian", "--display-level", ">=warning", deb_build["changes"]], check=False)
    tags = [ln for ln in proc.stdout.splitlines() if re.match(r"^[EW]: ", ln)]
    assert tags == [], "\n".join(tags)
    overrides = (REPO / "debian" / "nvsymlinkd.lintian-overrides").read_text().splitlines()
    for i, line in enumerate(overrides):  # every override has its one-line reason just above it
        if line.startswith("nvsymlinkd:"):
            assert any(prev.startswith("# ") for prev in overrides[max(0, i - 2):i]), line


INSTALL_SCRIPT = textwrap.dedent("""\
    set -eu
    T={tmp}
    mount -t tmpfs nvsymlinkd-test $T
    mkdir -p $T/upper $T/work $T/root $T/fake/driver/nvidia/gpus/0000:01:00.0
    mount -t overlay overlay -o lowerdir=/,upperdir=$T/upper,workdir=$T/work $T/root
    R=$T/root
    mount -t proc proc $R/proc
    # an NVIDIA host as far as nvsymlinkd sync can tell: /proc/devices, the GPU's minor, real nodes
    printf 'Character devices:\\n  1 mem\\n195 nvidia-frontend\\n\\nBlock devices:\\n  7 loop\\n' > $T/fake/devices
    printf 'Device Minor: \\t 0\\n' > $T/fake/driver/nvidia/gpus/0000:01:00.0/information
    mount --bind $T/fake/devices $R/proc/devices
    mount --bind $T/fake/driver $R/proc/driver
    mount -t tmpfs tmpfs $R/run
    mount -t tmpfs tmpfs $R/tmp
    mount -t tmpfs tmpfs $R/dev
    mknod -m 666 $R/dev/null c 1 3
    mknod -m 666 $R/dev/nvidia0 c 195 0
    mknod -m 666 $R/dev/nvidiactl c 195 255
    cp {deb} $R/tmp/nvsymlinkd.deb
    echo '@@@ dpkg'
    chroot $R dpkg -i /tmp/nvsymlinkd.deb
    echo '@@@ status'
    chroot $R dpkg-query -W -f='${{Status}}\\n' nvsymlinkd
    echo '@@@ version'
    chroot $R nvsymlinkd --version
    echo '@@@ module'
    chroot $R /usr/bin/python3 -c 'import nvsymlinkd; print(nvsymlinkd.__file__)'
    echo '@@@ links'
    for l in $R/dev/char/*; do echo "$(basename $l) -> $(readlink $l)"; done
    echo '@@@ wants'
    ls $R/etc/systemd/system/multi-user.target.wants $R/etc/systemd/system/sysinit.target.wants
    echo '@@@ render'
    chroot $R nvsymlinkd --config /dev/null render --output /tmp/rendered
    cmp $R/tmp/rendered/nvsymlinkd.service $R/lib/systemd/system/nvsymlinkd.service && echo same
    echo '@@@ verify'
    chroot $R systemd-analyze verify /lib/systemd/system/nvsymlinkd.service /lib/systemd/system/nvsymlinkd-sync.service 2>&1
    # what the daemon leaves in its default state_dir
    mkdir -p $R/run/nvsymlinkd/baselines && echo '{{}}' > $R/run/nvsymlinkd/baselines/c1.json
    echo '@@@ remove'
    chroot $R dpkg --remove nvsymlinkd
    echo '@@@ removeleft'
    cd $R && find usr lib etc var run -xdev -name '*nvsymlinkd*' | sort; cd /
    echo '@@@ purge'
    chroot $R dpkg --purge nvsymlinkd
    echo '@@@ purgeleft'
    cd $R && find usr lib etc var run -xdev -name '*nvsymlinkd*' | sort; cd /
    echo '@@@ purgelinks'
    for l in $R/dev/char/*; do echo "$(basename $l) -> $(readlink $l)"; done
    echo '@@@ end'
    """)


def test_deb_installs_and_runs_in_a_throwaway_root(deb_build, need_root):
    need_tool("unshare")
    if "overlay" not in Path("/proc/filesystems").read_text():
        skip_or_fail("needs overlayfs for the throwaway root")
    tmp = deb_build["work"] / "root"
    tmp.mkdir()
    script = INSTALL_SCRIPT.format(tmp=tmp, deb=deb_build["deb"])
    proc = run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], timeout=600)
    sections = dict(re.findall(r"^@@@ (\w+)\n(.*?)(?=^@@@ )", proc.stdout, re.M | re.S))
    assert "Setting up nvsymlinkd" in sections["dpkg"]
    assert sections["status"].strip() == "install ok installed"
    assert sections["version"].strip() == f"nvsymlinkd {VERSION}"
    assert sections["module"].strip() == "/usr/lib/python3/dist-packages/nvsymlinkd/__init__.py"
    # the postinst's sync made the links at once
    assert sections["links"].split("\n")[:2] == ["195:0 -> ../nvidia0", "195:255 -> ../nvidiactl"]
    # dh_installsystemd enabled both units
    assert "nvsymlinkd.service" in sections["wants"] and "nvsymlinkd-sync.service" in sections["wants"]
    # the installed package renders from its own templates exactly what it installed
    assert sections["render"].strip() == "same"
    # systemd accepts the installed units, including that man:nvsymlinkd(8) exists
    assert sections["verify"].strip() == "", sections["verify"]
    # remove keeps what Debian policy keeps until purge: the conffile, the units' enablement
    # (dangling *.wants links and deb-systemd-helper's record), dpkg's record, the daemon's state
    kept = sections["removeleft"].split()
    assert "etc/nvsymlinkd/nvsymlinkd.toml" in kept and "run/nvsymlinkd" in kept, kept
    assert not [p for p in kept if p.startswith(("usr/", "lib/"))], kept
    # purge: nothing of the package is left (docs/install.md, Uninstall) but the /dev/char links;
    # man-db's formatted-page cache is man-db's (its daily mandb run drops pages whose source is gone)
    left = [p for p in sections["purgeleft"].split() if not p.startswith("var/cache/man/")]
    assert left == [], sections["purgeleft"]
    assert sections["purgelinks"].split("\n")[:2] == ["195:0 -> ../nvidia0", "195:255 -> ../nvidiactl"]


# -- .rpm -------------------------------------------------------------------------------------------


def test_rpm_puts_files_where_fedora_expects_them(rpm_build):
    files = run(["rpm", "-qlp", rpm_build["rpm"]]).stdout.split("\n")
    for what, path in RPM.items():
        if what == "catalog" and not HAS_CATALOG:
            assert path not in files
            continue
        assert path in files, f"{what}: {path} missing from the .rpm"
    assert run(["rpm", "-qpc", rpm_build["rpm"]]).stdout.split() == [RPM["config"]]
    assert "/usr/share/licenses/nvsymlinkd/LICENSE" in files  # %license, unversioned as on Fedora and RHEL
    for page in MAN_PAGES:
        assert f"/usr/share/man/man{page.rsplit('.', 1)[1]}/{page}" in files, page
    # the target's own sitelib (RHEL 9: /usr/lib/python3.9/site-packages), which its python3 has on sys.path;
    # never Debian's /usr/lib/python3/dist-packages, nor any other place
    sitelib = f"/usr/lib/python{rpm_build['python']}/site-packages/"
    assert sitelib + "nvsymlinkd/templates/nvsymlinkd.service.j2" in files
    python_files = [f for f in files if f.endswith(".py")]
    assert python_files and all(f.startswith(sitelib) for f in python_files), python_files[:5]
    assert not [f for f in files if "dist-packages" in f or "__pycache__" in f]
    packaged = {f[len(sitelib):] for f in files if f.startswith(sitelib)}
    missing = [m for m in MODULES if m not in packaged]
    assert not missing, f"modules missing from the .rpm: {missing}"
    # the entry point runs the target's interpreter
    assert (rpm_build["tree"] / "usr/bin/nvsymlinkd").read_text().startswith("#!/usr/bin/python3\n")


def test_rpm_units_requires_and_scripts(rpm_build):
    tree = rpm_build["tree"]
    assert (tree / RPM["unit"].lstrip("/")).read_text() == RENDERED["nvsymlinkd.service"]
    assert (tree / RPM["rules"].lstrip("/")).read_text() == RENDERED["71-nvsymlinkd.rules"]
    requires = run(["rpm", "-qpR", rpm_build["rpm"]]).stdout.split("\n")
    for pkg in ("python3-pyudev", "python3-dbus-next", "python3-jinja2", "python3-systemd", "/usr/bin/kill",
                f"python(abi) = {rpm_build['python']}", "systemd", "util-linux"):
        assert pkg in requires, (pkg, requires)
    # tomllib is in Python's standard library from 3.11: tomli for RHEL 9's 3.9 only
    assert ("python3-tomli" in requires) == (rpm_build["target"] == "el9"), requires


def rpm_scriptlets(rpm) -> dict:
    """`rpm -qp --scripts`: scriptlet name (postinstall, preuninstall, ...) -> its lines."""
    out, name = {}, None
    for line in run(["rpm", "-qp", "--scripts", rpm]).stdout.splitlines():
        m = re.match(r"^(\w+) scriptlet \(using /bin/sh\):$", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    return out


def test_rpm_scriptlets_prevent_before_systemd_s_reload(rpm_build):
    """rpm's scriptlets reload nothing themselves; systemd's file triggers reload at the end of the
    transaction (%transfiletriggerin, %transfiletriggerpostun). Our last scriptlets before those prevent:
    %post (install, upgrade: after the link pass) and %preun of an erase (after the daemon stopped)."""
    scripts = rpm_scriptlets(rpm_build["rpm"])
    assert sorted(scripts) == ["postinstall", "postuninstall", "preuninstall"]
    helper = "/usr/lib/systemd/systemd-update-helper"  # what systemd-rpm-macros expand to (systemd >= 249)
    post, preun, postun = (scripts[k] for k in ("postinstall", "preuninstall", "postuninstall"))
    assert not [ln for ln in post + preun + postun if re.search(r"systemctl .*(daemon-reload|daemon-reexec)", ln)]

    def index(lines, text):
        return next(i for i, ln in enumerate(lines) if text in ln)

    assert index(post, f"{helper} install-system-units nvsymlinkd.service nvsymlinkd-sync.service") \
        < index(post, "/usr/bin/nvsymlinkd sync") < index(post, "/usr/bin/nvsymlinkd repair --before-reload")
    assert "if [ -d /run/systemd/system ] && ! /usr/bin/nvsymlinkd repair --before-reload; then" in post
    assert index(preun, f"{helper} remove-system-units nvsymlinkd.service nvsymlinkd-sync.service") \
        < index(preun, "if [ $1 -eq 0 ] && [ -d /run/systemd/system ]; then") \
        < index(preun, "PYTHONDONTWRITEBYTECODE=1 /usr/bin/nvsymlinkd repair --before-reload")
    assert f"if [ $1 -ge 1 ] && [ -x \"{helper}\" ]; then {helper} mark-restart-system-units nvsymlinkd.service" \
           in postun[0]
    assert "rm -rf /run/nvsymlinkd" in "\n".join(postun)  # an erase removes the state (rpm has no purge)
    for lines in (post, preun):  # a prevention that cannot finish is reported, never fatal
        text = "\n".join(lines)
        assert "logger -t nvsymlinkd -p daemon.warning" in text and "exit" not in text


def test_rpm_post_enables_both_units_as_the_deb_does(rpm_build, tmp_path):
    """%post's `systemd-update-helper install-system-units` is `systemctl --no-reload preset` on both units
    (systemd's src/rpm/systemd-update-helper.in); Fedora and RHEL preset `disable *` last
    (99-default-disable.preset), which left both disabled (the .deb enables both: issue 39 item 12).
    Real systemctl on a root holding the rpm's files and that distribution preset decides."""
    need_tool("systemctl")
    post = rpm_scriptlets(rpm_build["rpm"])["postinstall"]
    assert any("install-system-units nvsymlinkd.service nvsymlinkd-sync.service" in ln for ln in post), post
    root = tmp_path / "root"
    shutil.copytree(rpm_build["tree"] / "usr/lib/systemd", root / "usr/lib/systemd", symlinks=True)
    presets = root / "usr/lib/systemd/system-preset"
    presets.mkdir(parents=True, exist_ok=True)
    (presets / "99-default-disable.preset").write_text("disable *\n")
    (root / "etc/systemd/system").mkdir(parents=True)
    run(["systemctl", f"--root={root}", "--no-reload", "preset", "nvsymlinkd.service", "nvsymlinkd-sync.service"])
    for unit in ("nvsymlinkd.service", "nvsymlinkd-sync.service"):
        state = subprocess.run(["systemctl", f"--root={root}", "is-enabled", unit], capture_output=True, text=True)
        assert state.stdout.strip() == "enabled", (unit, state.stdout, state.stderr)


def test_rpm_build_without_a_target_refuses(sdist, tmp_path):
    """Debian has no python-rpm-macros: without the target's Python the build stops, naming the fix,
    instead of making a package that installs into a path no Fedora or RHEL Python reads."""
    proc = rpmbuild(sdist, tmp_path, check=False)
    assert proc.returncode != 0
    assert "no python3_sitelib: this is no Fedora/RHEL build host" in proc.stderr
    assert "--rpm-target el9" in proc.stderr
    assert not list(tmp_path.rglob("*.rpm"))


def test_sdist_carries_what_the_package_builds_need(sdist):
    names = run(["tar", "tzf", sdist]).stdout.split()
    prefix = f"nvsymlinkd-{VERSION}/"
    for rel in ("rpm/nvsymlinkd.spec", "man/nvsymlinkd.8.rst", "examples/nvsymlinkd.toml",
                "rules/71-nvsymlinkd.rules.j2", "units/nvsymlinkd.service.j2", "debian/control",
                "nvsymlinkd/templates/nvsymlinkd.service.j2", "LICENSE", "scripts/build-packages",
                "tests/debbuild.py"):
        assert prefix + rel in names, rel
    if HAS_CATALOG:
        assert prefix + "catalog/nvsymlinkd.catalog" in names


# -- scripts/build-packages ------------------------------------------------------------------------


def test_build_packages_with_a_foreign_python3_first_in_path(tmp_path):
    """What a pyenv shim does to a plain `dpkg-buildpackage`: a python3 (and python3.11) first in PATH
    that lacks Debian's python3-build, docutils and jinja2. debian/rules and the spec pin
    /usr/bin/python3, so scripts/build-packages still builds every artefact."""
    for tool in ("dpkg-buildpackage", "dh", "pybuild", "rpmbuild"):
        need_tool(tool)
    foreign = tmp_path / "foreign-python"
    run(["/usr/bin/python3", "-m", "venv", "--without-pip", foreign])
    assert subprocess.run([foreign / "bin" / "python3", "-c", "import build"], capture_output=True).returncode
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{foreign / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin")
    proc = subprocess.run([REPO / "scripts" / "build-packages", out, "--no-image", "--repo", tmp_path / "repo"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # --repo: what it built, in the repositories a fleet installs from (issue 36)
    assert_apt_repo(tmp_path / "repo" / "deb", out / f"nvsymlinkd_{VERSION}_all.deb", VERSION, tmp_path)
    for target, (python, dist) in RPM_TARGETS.items():
        assert_dnf_repo(tmp_path / "repo" / "rpm" / target, out / f"nvsymlinkd-{VERSION}-1{dist}.noarch.rpm", python)
    assert sorted(p.name for p in out.iterdir()) == sorted([
        f"nvsymlinkd_{VERSION}_all.deb", f"nvsymlinkd-{VERSION}.tar.gz", f"nvsymlinkd-{VERSION}-py3-none-any.whl",
        f"nvsymlinkd-{VERSION}-1.el9.noarch.rpm", f"nvsymlinkd-{VERSION}-1.fc42.noarch.rpm"])


@pytest.mark.parametrize("flags, named", [
    ((), ("no .deb: dpkg-buildpackage, dh not found", "no rpm: rpmbuild not found")),
    (("--no-deb",), ("no rpm: rpmbuild not found",)),
    (("--no-rpm",), ("no .deb: dpkg-buildpackage, dh not found",)),
])
def test_build_packages_without_the_package_tools_fails_naming_them(tmp_path, flags, named):
    """No dpkg-buildpackage, dh or rpmbuild in PATH: it exited 0 with a .deb and the rpms quietly missing
    (issue 39 item 11). Now exit 1 before anything is built, each missing tool named with the flag that
    asks for a release without that package."""
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "out"
    proc = subprocess.run([REPO / "scripts" / "build-packages", out, "--no-image", *flags], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PATH=str(empty)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert [line.split(" (", 1)[0] for line in lines] == [f"build-packages: {n}" for n in named], lines
    assert all(f"--no-{'deb' if '.deb' in n else 'rpm'})" in line for n, line in zip(named, lines)), lines
    assert not out.exists() or not list(out.iterdir())  # nothing built


def test_build_packages_usage():
    proc = subprocess.run([REPO / "scripts" / "build-packages"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: scripts/build-packages OUTDIR" in proc.stderr


# -- the repositories a fleet installs from (scripts/make-repos; scripts/build-packages --repo) ------------


def apt_get(root: Path, *args, tool="apt-get", cwd=None, check=True):
    """apt in a throwaway root: the sources.list, lists, cache and dpkg status there, nothing of the host's."""
    opts = [f"-oDir={root}", f"-oDir::State::status={root / 'status'}",
            f"-oDir::Etc::SourceList={root / 'sources.list'}", f"-oDir::Etc::SourceParts={root / 'sources.list.d'}",
            "-oDebug::NoLocking=1"]
    if os.geteuid() == 0:
        opts.append("-oAPT::Sandbox::User=root")  # _apt could not read pytest's 0700 temporary directories
    return run([tool, *opts, *args], cwd=cwd, check=check)


def apt_root(root: Path, repo: Path, status: str = "", options: str = "trusted=yes") -> Path:
    for d in ("var/lib/apt/lists/partial", "var/cache/apt/archives/partial", "etc/apt/preferences.d",
              "etc/apt/apt.conf.d", "sources.list.d"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "sources.list").write_text(f"deb [{options}] file://{repo} ./\n")
    (root / "status").write_text(status)
    return root


def assert_apt_repo(repo: Path, deb: Path, version: str, tmp: Path) -> None:
    """A real apt-get update on the repository, then nvsymlinkd at VERSION resolved and downloaded
    byte for byte: with an empty dpkg status (apt-get download: the package alone), and with this
    host's status, whose installed packages satisfy its Depends (apt-get install --download-only
    and --simulate: every dependency resolved, as on a node with .ci/apt.d/runtime.txt)."""
    root = apt_root(tmp / "aptroot", repo)
    update = apt_get(root, "update")
    assert "Err:" not in update.stdout and "E:" not in update.stderr, update.stdout + update.stderr
    policy = apt_get(root, "policy", "nvsymlinkd", tool="apt-cache").stdout
    assert re.search(rf"^\s+Candidate: {re.escape(version)}$", policy, re.M), policy
    got = tmp / "download"
    got.mkdir()
    apt_get(root, "download", f"nvsymlinkd={version}", cwd=got)
    assert (got / f"nvsymlinkd_{version}_all.deb").read_bytes() == deb.read_bytes()
    (root / "status").write_bytes(Path("/var/lib/dpkg/status").read_bytes())
    fetched = apt_get(root, "install", "--download-only", "-y", "nvsymlinkd")
    assert re.search(rf"^Get:\d+ file:{re.escape(str(repo))} \./ nvsymlinkd {re.escape(version)} ", fetched.stdout,
                     re.M), fetched.stdout
    assert "Download complete and in download only mode" in fetched.stdout, fetched.stdout
    sim = apt_get(root, "--simulate", "install", "nvsymlinkd")
    assert re.search(rf"^Inst nvsymlinkd \({re.escape(version)} ", sim.stdout, re.M), sim.stdout


def assert_dnf_repo(repo: Path, rpm: Path, python: str) -> None:
    """repodata/repomd.xml names the primary metadata, and that lists the rpm: name, version, release,
    its file name and sha256, and the python(abi) it Requires (what dnf resolves from)."""
    import gzip
    import hashlib
    import xml.etree.ElementTree as ET

    ns = {"repo": "http://linux.duke.edu/metadata/repo", "c": "http://linux.duke.edu/metadata/common",
          "rpm": "http://linux.duke.edu/metadata/rpm"}
    repomd = ET.parse(repo / "repodata" / "repomd.xml")
    href = repomd.find("repo:data[@type='primary']/repo:location", ns).get("href")
    primary = ET.fromstring(gzip.decompress((repo / href).read_bytes()))
    pkgs = primary.findall("c:package", ns)
    assert len(pkgs) == 1 and pkgs[0].find("c:name", ns).text == "nvsymlinkd", ET.tostring(primary)[:2000]
    pkg = pkgs[0]
    ver = pkg.find("c:version", ns)
    release = rpm.name[len(f"nvsymlinkd-{VERSION}-"):-len(".noarch.rpm")]
    assert (ver.get("ver"), ver.get("rel"), pkg.find("c:arch", ns).text) == (VERSION, release, "noarch")
    assert pkg.find("c:location", ns).get("href") == rpm.name and (repo / rpm.name).is_file()
    checksum = pkg.find("c:checksum", ns)
    assert (checksum.get("type"), checksum.text) == ("sha256", hashlib.sha256(rpm.read_bytes()).hexdigest())
    requires = {(e.get("name"), e.get("ver")) for e in pkg.findall("c:format/rpm:requires/rpm:entry", ns)}
    assert ("python(abi)", python) in requires, requires


def assert_dnf_reads_repo(repo: Path, rpm: Path, python: str, tmp: Path) -> None:
    """Debian's dnf 4 on the repository alone (a throwaway install root, no other repository): it loads the
    metadata, names the rpm with its release and Requires, and downloads it byte for byte (dnf checks the
    package against the metadata's sha256). Installing needs the target's own repositories (see
    docs/packaging.md)."""
    root = tmp / "dnfroot"
    root.mkdir()

    def dnf(*args, cwd=None):
        return run(["dnf", "-q", "-y", f"--installroot={root}", "--releasever=9", "--setopt=reposdir=/nonexistent",
                    f"--setopt=cachedir={root / 'cache'}", "--disablerepo=*", f"--repofrompath=nvsymlinkd,file://{repo}",
                    "--enablerepo=nvsymlinkd", "--setopt=nvsymlinkd.gpgcheck=0", *args], cwd=cwd)

    listed = dnf("repoquery", "--qf", "%{name} %{version} %{release} %{arch} %{location}", "nvsymlinkd").stdout
    release = rpm.name[len(f"nvsymlinkd-{VERSION}-"):-len(".noarch.rpm")]
    assert listed.split("\n")[0].split() == ["nvsymlinkd", VERSION, release, "noarch", rpm.name], listed
    requires = dnf("repoquery", "--requires", "nvsymlinkd").stdout.splitlines()
    assert f"python(abi) = {python}" in requires and "systemd" in requires, requires
    got = tmp / "dnf-download"
    got.mkdir()
    dnf("download", f"--destdir={got}", "nvsymlinkd")
    assert (got / rpm.name).read_bytes() == rpm.read_bytes()


def make_repos(*args, env=None):
    return subprocess.run([REPO / "scripts" / "make-repos", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_apt_gets_the_built_deb_from_the_repository_and_a_newer_one_added_later(deb_build, tmp_path):
    need_tool("apt-get")
    need_tool("apt-ftparchive")
    repo = tmp_path / "repo"
    proc = make_repos(repo, deb_build["deb"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (repo / "deb").iterdir()) == sorted(
        ["Packages", "Packages.gz", "Release", deb_build["deb"].name])
    assert "Origin: nvsymlinkd" in (repo / "deb" / "Release").read_text()
    assert_apt_repo(repo / "deb", deb_build["deb"], VERSION, tmp_path / "first")
    # the next release added to the same repository: the first stays, apt takes the newer, and an
    # operator's signature over the old Release is gone (apt would refuse the repository with it)
    unpacked = tmp_path / "newer"
    run(["dpkg-deb", "-R", deb_build["deb"], unpacked])
    control = unpacked / "DEBIAN" / "control"
    control.write_text(control.read_text().replace(f"\nVersion: {VERSION}\n", "\nVersion: 99.0\n"))
    newer = tmp_path / "nvsymlinkd_99.0_all.deb"
    run(["dpkg-deb", "-b", unpacked, newer])
    (repo / "deb" / "InRelease").write_text("a signature over the previous Release\n")
    proc = make_repos(repo, newer)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (repo / "deb" / "InRelease").exists()
    packages = (repo / "deb" / "Packages").read_text()
    assert sorted(re.findall(r"^Version: (.*)$", packages, re.M)) == sorted([VERSION, "99.0"])
    assert_apt_repo(repo / "deb", newer, "99.0", tmp_path / "second")


def test_apt_verifies_the_repository_signed_as_the_docs_say(deb_build, tmp_path):
    """docs/packaging.md's signing step with a throwaway key: apt with `signed-by` takes the signed
    repository, and refuses it once make-repos has rewritten the indexes (and removed the signatures)."""
    import shutil
    import tempfile

    for tool in ("apt-get", "apt-ftparchive", "gpg", "gpgv", "gpgconf"):
        need_tool(tool)
    repo = tmp_path / "repo"
    assert make_repos(repo, deb_build["deb"]).returncode == 0
    deb = repo / "deb"
    keyring = tmp_path / "nvsymlinkd.gpg"
    home = Path(tempfile.mkdtemp(prefix="nvsl-repo-gpg-"))  # short: gpg-agent's socket lives in it
    env = dict(os.environ, GNUPGHOME=str(home))
    try:
        def gpg(*args):
            return subprocess.run(["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "", *args],
                                  env=env, capture_output=True, check=True, timeout=60)
        gpg("--quick-gen-key", "nvsymlinkd test <repo-test@example.invalid>", "ed25519", "sign", "1d")
        keyring.write_bytes(gpg("--export", "repo-test@example.invalid").stdout)
        gpg("-u", "repo-test@example.invalid", "--clearsign", "-o", deb / "InRelease", deb / "Release")
        gpg("-u", "repo-test@example.invalid", "-abs", "-o", deb / "Release.gpg", deb / "Release")
    finally:
        subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
    root = apt_root(tmp_path / "aptroot", deb, options=f"signed-by={keyring}")
    update = apt_get(root, "update")
    assert "Err:" not in update.stdout and "W:" not in update.stderr, update.stdout + update.stderr
    policy = apt_get(root, "policy", "nvsymlinkd", tool="apt-cache").stdout
    assert re.search(rf"^\s+Candidate: {re.escape(VERSION)}$", policy, re.M), policy
    assert make_repos(repo, deb_build["deb"]).returncode == 0
    assert not (deb / "InRelease").exists() and not (deb / "Release.gpg").exists()
    refused = apt_get(root, "update", check=False)
    # apt 2.6: "is no longer signed" (it was before); a client that never saw it signed: "is not signed"
    assert refused.returncode != 0 and re.search(r"is (no longer|not) signed", refused.stderr), refused.stderr


def test_dnf_repository_per_target_lists_the_rpm(rpm_build, tmp_path):
    need_tool("createrepo_c")  # Debian's createrepo-c (.ci/apt.d/build.txt)
    repo = tmp_path / "repo"
    proc = make_repos(repo, rpm_build["rpm"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dist = rpm_build["target"]  # el9, fc42: the dist tag of the rpm's release
    assert sorted(p.name for p in (repo / "rpm").iterdir()) == [dist]
    assert_dnf_repo(repo / "rpm" / dist, rpm_build["rpm"], rpm_build["python"])
    need_tool("dnf")  # Debian's dnf and dnf-plugins-core (.ci/apt.d/packaging.txt)
    assert_dnf_reads_repo(repo / "rpm" / dist, rpm_build["rpm"], rpm_build["python"], tmp_path)


def test_make_repos_without_createrepo_c_says_so_and_leaves_the_rpms_out(tmp_path):
    path = tmp_path / "bin"  # a PATH without createrepo_c (make-repos' interpreter is /usr/bin/python3)
    path.mkdir()
    rpm = tmp_path / f"nvsymlinkd-{VERSION}-1.el9.noarch.rpm"
    rpm.write_bytes(b"")
    proc = make_repos(tmp_path / "repo", rpm, env=dict(os.environ, PATH=str(path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no dnf repository: createrepo_c not found (Debian: apt-get install createrepo-c)" in proc.stderr
    assert not (tmp_path / "repo" / "rpm").exists()


@pytest.mark.parametrize("args", [[], ["repo"], ["repo", "nvsymlinkd.tar.gz"]])
def test_make_repos_usage(tmp_path, args):
    (tmp_path / "nvsymlinkd.tar.gz").write_bytes(b"")
    proc = subprocess.run([REPO / "scripts" / "make-repos", *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(("usage: scripts/make-repos", "make-repos: not a .deb"))


def test_build_packages_repo_needs_a_directory(tmp_path):
    proc = subprocess.run([REPO / "scripts" / "build-packages", tmp_path / "out", "--repo"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--repo DIR" in proc.stderr and not (tmp_path / "out").exists()


# -- no build needed ---------------------------------------------------------------------------------


def test_versions_agree():
    changelog = (REPO / "debian" / "changelog").read_text().splitlines()[0]
    assert changelog.startswith(f"nvsymlinkd ({VERSION}) ")
    spec = (REPO / "rpm" / "nvsymlinkd.spec").read_text()
    assert re.search(rf"^Version:\s+{re.escape(VERSION)}$", spec, re.M)


# -- the maintainer scripts: no reload of the package's takes a GPU ---------------------------------
#
# dpkg's call sequences (Debian Policy 6.6, "Details of unpacking, configuring, removing, purging"),
# each step (script, arguments); the old and new package are the same build here.
DPKG_SEQUENCES = {
    "install": [("preinst", "install"), ("postinst", "configure")],
    "upgrade": [("prerm", f"upgrade {VERSION}"), ("preinst", f"upgrade {VERSION}"), ("postrm", f"upgrade {VERSION}"),
                ("postinst", f"configure {VERSION}")],
    "remove": [("prerm", "remove"), ("postrm", "remove")],
    "purge": [("prerm", "remove"), ("postrm", "remove"), ("postrm", "purge")],
}
# Every command the scripts may run, as a stub that logs its argv; `nvsymlinkd` too (the real one is
# tested below, against a real container).
STUBS = ("nvsymlinkd", "systemctl", "deb-systemd-helper", "deb-systemd-invoke", "py3compile", "pypy3compile",
         "py3clean", "udevadm", "logger", "dpkg")
RUN_SCRIPTS = textwrap.dedent("""\
    set -u
    mount -t tmpfs nvsymlinkd-test-run /run
    mkdir -p /run/systemd/system /run/udev
    {setup}
    for step in {steps}; do
        script=${{step%%:*}}; args=$(echo "${{step#*:}}" | tr + ' ')
        echo "== $script $args" >> {log}
        [ -f {ctrl}/$script ] || continue
        sh {ctrl}/$script $args >> {log} 2>&1 || echo "!! $script exit $?" >> {log}
    done
    """)


def run_maintainer_scripts(ctrl: Path, steps, work: Path, stubs: dict = None, setup: str = "") -> list:
    """Run the given maintainer scripts in order under `unshare -m` (a private /run with
    /run/systemd/system: "systemd runs here"), with PATH's first directory holding a stub per command
    of STUBS (each logs `@ NAME ARGV`) unless `stubs` gives one; returns the log's lines."""
    bindir = work / "stubs"
    bindir.mkdir(parents=True, exist_ok=True)
    log = work / "calls.log"
    for name in STUBS:
        body = (stubs or {}).get(name, 'echo "@ $(basename "$0") $*" >> "$STUB_LOG"\n')
        (bindir / name).write_text("#!/bin/sh\n" + body)
        (bindir / name).chmod(0o755)
    script = RUN_SCRIPTS.format(ctrl=ctrl, log=log, setup=setup,
                                steps=" ".join(f"{s}:{a.replace(' ', '+')}" for s, a in steps))
    env = dict(os.environ, PATH=f"{bindir}:/usr/sbin:/usr/bin:/sbin:/bin", STUB_LOG=str(log))
    subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env, check=True,
                   timeout=600)
    return log.read_text().splitlines()


def reloads_systemd(call: str) -> bool:
    """A logged call that makes systemd reload: `systemctl daemon-reload`, and deb-systemd-helper when it
    changes links or masks (it runs `systemctl daemon-reload` itself then: /usr/bin/deb-systemd-helper,
    "If we changed anything and this machine is running systemd, tell systemd to reload")."""
    return call == "@ systemctl --system daemon-reload" or bool(re.match(
        r"@ deb-systemd-helper (enable|disable|purge|mask|unmask|reenable) ", call))


@pytest.mark.parametrize("action", sorted(DPKG_SEQUENCES))
def test_deb_prevents_before_every_reload_it_causes(deb_build, need_root, tmp_path, action):
    """The built .deb's scripts, run in dpkg's order for install, upgrade (reinstall: the same calls),
    remove and purge: every `systemctl daemon-reload` comes after a `nvsymlinkd repair --before-reload`
    with nothing between them that could start the daemon or change units; the removal's prevention runs
    after the daemon stopped, while nvsymlinkd is still installed (prerm), since postrm reloads without it."""
    need_tool("unshare")
    calls = run_maintainer_scripts(deb_build["control"], DPKG_SEQUENCES[action], tmp_path)
    assert not [c for c in calls if c.startswith("!!")], calls
    reloads = [i for i, c in enumerate(calls) if reloads_systemd(c)]
    prevents = [i for i, c in enumerate(calls) if c == "@ nvsymlinkd repair --before-reload"]
    assert reloads, calls  # each of these actions reloads
    for i in reloads:
        before = [p for p in prevents if p < i]
        assert before, f"{action}: a daemon-reload with no prevention before it:\n" + "\n".join(calls)
        between = calls[before[-1] + 1:i]
        assert not [c for c in between if c.startswith(("@ deb-systemd-invoke start", "@ deb-systemd-invoke restart",
                                                         "@ systemctl")) and not reloads_systemd(c)], between
    steps = [c for c in calls if c.startswith("== ")]
    if action in ("install", "upgrade"):
        # the link pass, then the prevention, then the reload and the (re)start
        order = [c for c in calls if c.startswith(("@ nvsymlinkd", "@ systemctl", "@ deb-systemd-invoke"))]
        # (an upgrade's preinst stops the boot one-shot first: dh_installsystemd's --no-start unit)
        first = ["@ deb-systemd-invoke stop nvsymlinkd-sync.service"] if action == "upgrade" else []
        assert order == first + ["@ nvsymlinkd sync", "@ nvsymlinkd repair --before-reload",
                                 "@ systemctl --system daemon-reload",
                                 f"@ deb-systemd-invoke {'start' if action == 'install' else 'restart'} nvsymlinkd.service"]
        assert steps[-1] == f"== postinst configure{' ' + VERSION if action == 'upgrade' else ''}"
    else:
        prerm = calls[calls.index("== prerm remove") + 1:calls.index("== postrm remove")]
        order = [c for c in prerm if c.startswith(("@ nvsymlinkd", "@ deb-systemd-invoke", "@ py3clean"))]
        # stop the daemon (no repair in flight), then prevent, while the package's files are all there
        assert order == ["@ deb-systemd-invoke stop nvsymlinkd.service", "@ py3clean -p nvsymlinkd",
                         "@ nvsymlinkd repair --before-reload"], prerm
        # postrm remove: one daemon-reload (dh_installsystemd adds one section per call, one per unit: two
        # reloads of the same units; debian/one-section-each keeps one)
        assert calls.count("@ systemctl --system daemon-reload") == 1, calls
        assert all(i > calls.index("== postrm remove") for i in reloads)
    if action == "purge":
        # postrm purge: no `systemctl daemon-reload` of debhelper's, but deb-systemd-helper's own when it removes
        # the enablement links; nvsymlinkd is gone by then: prerm's prevention was the last possible
        purge = calls[calls.index("== postrm purge"):]
        assert not [c for c in purge if c == "@ systemctl --system daemon-reload" or c.startswith("@ nvsymlinkd")]
        assert [c for c in purge if reloads_systemd(c)] == ["@ deb-systemd-helper purge nvsymlinkd.service",
                                                            "@ deb-systemd-helper purge nvsymlinkd-sync.service"]


def test_deb_prevention_that_fails_is_reported_and_never_fails_the_script(deb_build, need_root, tmp_path):
    need_tool("unshare")
    failing = {"nvsymlinkd": 'echo "@ nvsymlinkd $*" >> "$STUB_LOG"; [ "$1" != repair ] || exit 1\n'}
    calls = run_maintainer_scripts(deb_build["control"], DPKG_SEQUENCES["purge"][:2] + [("postinst", "configure")],
                                   tmp_path, stubs=failing)
    assert not [c for c in calls if c.startswith("!!")], calls  # every script exited 0
    notes = [c for c in calls if c.startswith("nvsymlinkd: not every GPU container could be kept safe")]
    assert len(notes) == 2, calls  # on stderr, once from prerm, once from postinst ...
    assert len([c for c in calls if c.startswith("@ logger -t nvsymlinkd -p daemon.warning")]) == 2  # ... and journaled
    # the scripts went on: postrm's reload, postinst's reload and start
    assert calls.count("@ systemctl --system daemon-reload") == 2, calls
    assert calls[-1] == "@ deb-systemd-invoke start nvsymlinkd.service", calls


def test_deb_without_systemd_skips_the_prevention(deb_build, need_root, tmp_path):
    """A chroot or an image build: no /run/systemd/system, no reload, nothing to prevent."""
    need_tool("unshare")
    calls = run_maintainer_scripts(deb_build["control"], DPKG_SEQUENCES["install"] + DPKG_SEQUENCES["remove"],
                                   tmp_path, setup="rmdir /run/systemd/system")
    assert "@ nvsymlinkd sync" in calls and not [c for c in calls if "repair" in c or "daemon-reload" in c], calls


def test_deb_purge_keeps_freeze_records_nothing_could_thaw(deb_build, need_root, tmp_path):
    """prerm's repair thaws what a killed repair froze; a record still there at purge names a container that
    stays frozen: it is named and kept, the rest of the state dir goes."""
    need_tool("unshare")
    setup = "mkdir -p /run/nvsymlinkd/frozen /run/nvsymlinkd/baselines; echo '{}' > /run/nvsymlinkd/frozen/a.json; " \
            "echo '{}' > /run/nvsymlinkd/baselines/c.json"
    calls = run_maintainer_scripts(deb_build["control"], [("postrm", "purge")], tmp_path,
                                   setup=setup + f"; trap 'ls -R /run/nvsymlinkd >> {tmp_path}/left' EXIT")
    assert any(c.startswith("nvsymlinkd: /run/nvsymlinkd/frozen/ names container cgroups") for c in calls), calls
    left = (tmp_path / "left").read_text().split()
    assert "a.json" in left and "baselines" not in left and "c.json" not in left, left
    calls = run_maintainer_scripts(deb_build["control"], [("postrm", "purge")], tmp_path / "2",
                                   setup=f"mkdir -p /run/nvsymlinkd/baselines; trap 'ls /run >> {tmp_path}/left2' EXIT")
    assert "nvsymlinkd" not in (tmp_path / "left2").read_text().split()


# A daemon-reload as systemd 252 does it on cgroup v1, for the scopes named in $RELOAD_SCOPES
# ({"scope": "devices cgroup dir"}): deny everything, then allow each DeviceAllow entry of the scope as
# the (mock) systemd has it now. What the scope lacks, the container loses.
RELOAD = r"""
import json, os, sys
import dbus
if sys.argv[1:] == ["--system", "daemon-reload"]:
    bus = dbus.bus.BusConnection(os.environ["DBUS_SYSTEM_BUS_ADDRESS"])
    for scope, devices in json.loads(os.environ["RELOAD_SCOPES"]).items():
        path = "/org/freedesktop/systemd1/unit/" + "".join(c if c.isalnum() else "_%02x" % ord(c) for c in scope)
        allow = bus.get_object("org.freedesktop.systemd1", path).Get(
            "org.freedesktop.systemd1.Scope", "DeviceAllow", dbus_interface="org.freedesktop.DBus.Properties")
        with open(devices + "/devices.deny", "w") as f:
            f.write("a")
        for entry, access in allow:
            if entry.startswith("/dev/char/"):
                with open(devices + "/devices.allow", "w") as f:
                    f.write("c %s %s" % (entry.rsplit("/", 1)[1], access))
"""


def without_prevention(ctrl: Path, dest: Path) -> Path:
    """The built scripts less our prevention step: the .deb as it was before (the control)."""
    dest.mkdir()
    for script in ctrl.iterdir():
        text = script.read_text()
        dropped = re.sub(r"^# nvsymlinkd-prevent:.*?^# end nvsymlinkd-prevent\n", "", text, flags=re.M | re.S)
        (dest / script.name).write_text(dropped)
    return dest


def run_for_real(deb_build, ctrl: Path, steps, work: Path, runc_host, systemd_mock, scopes: dict) -> list:
    """run_maintainer_scripts with the package's own `nvsymlinkd` on the runc host's tree and a
    `systemctl daemon-reload` that re-applies `scopes` ({scope: devices cgroup dir}) from the mock."""
    site = deb_build["tree"] / "usr/lib/python3/dist-packages"
    stubs = {
        "nvsymlinkd": f'echo "@ nvsymlinkd $*" >> "$STUB_LOG"\n'
                      f'PYTHONPATH={site} exec /usr/bin/python3 -m nvsymlinkd --root {runc_host.root} "$@"\n',
        "systemctl": f'echo "@ systemctl $*" >> "$STUB_LOG"\nexec /usr/bin/python3 -c \'{RELOAD}\' "$@"\n',
    }
    os.environ["RELOAD_SCOPES"] = json.dumps(scopes)
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = systemd_mock.address
    try:
        return run_maintainer_scripts(ctrl, steps, work, stubs=stubs)
    finally:
        del os.environ["RELOAD_SCOPES"], os.environ["DBUS_SYSTEM_BUS_ADDRESS"]


SCOPE_KEEP = [("/dev/char/1:3", "rwm"), ("/dev/char/1:5", "rwm"), ("/dev/char/1:8", "rwm"), ("/dev/char/1:9", "rwm"),
              ("/dev/char/5:0", "rwm"), ("/dev/char/5:2", "rwm"), ("/dev/char/10:200", "rwm")]


@pytest.mark.parametrize("control", [False, True], ids=["deb", "control-without-prevention"])
@pytest.mark.parametrize("action", ["install", "upgrade", "remove"])
def test_deb_scripts_keep_a_real_at_risk_container_s_gpu_through_their_reload(
        deb_build, runc_host, systemd_mock, tmp_path, action, control):
    """The built .deb's scripts, run for real in dpkg's order against a real runc container (cgroup v1)
    whose scope lacks its GPU (what runc 1.1.5 leaves out when /dev/char/195:0 was missing at `runc
    create`), with python-dbusmock as systemd on a private bus. `nvsymlinkd` is the package's own code
    (the extracted .deb) on the container's host tree; `systemctl daemon-reload` re-applies the scope's
    DeviceAllow to the container's cgroup as systemd's v1 backend does. The kernel judges: open() of
    /dev/nvidia0 inside the container is ENXIO (allowed, no driver) after the scripts, EPERM in the
    control, which runs the same scripts less the prevention step."""
    need_tool("unshare")
    scope = "runc-gpu-pkg.scope"
    keep = SCOPE_KEEP
    c = runc_host.run("gpu-pkg", driver="systemd", rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    freezer = f"/sys/fs/cgroup/freezer/{c.cgroups_path.lstrip('/')}/freezer.state"
    systemd_mock.add_scope(scope, keep, root=str(runc_host.root), devices=str(c.devices_dir()), freezer=freezer)
    (runc_host.root / "run/systemd/system").mkdir(parents=True)  # systemd runs on this host tree
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"
    ctrl = without_prevention(deb_build["control"], tmp_path / "old") if control else deb_build["control"]
    calls = run_for_real(deb_build, ctrl, DPKG_SEQUENCES[action], tmp_path / "run", runc_host, systemd_mock,
                         {scope: str(c.devices_dir())})
    assert "@ systemctl --system daemon-reload" in calls and not [x for x in calls if x.startswith("!!")], calls
    assert "c 10:200 rwm" in c.devices_list()  # the reload did re-apply DeviceAllow (runc's tun is in it)
    if control:
        assert c.open_error("/dev/nvidia0", rw=True) == "EPERM", c.devices_list()  # the reload took the GPU
        assert ("/dev/char/195:0", "rw") not in systemd_mock.device_allow(scope)
        return
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO", "\n".join(calls) + c.devices_list()
    assert ("/dev/char/195:0", "rw") in systemd_mock.device_allow(scope)
    prevented = calls.index("@ nvsymlinkd repair --before-reload")
    assert prevented < calls.index("@ systemctl --system daemon-reload")
    said = calls[prevented + 1]  # what the step printed, amid dpkg's output
    assert said.startswith("nvsymlinkd: gpu-pkg (runc-gpu-pkg.scope): added to DeviceAllow before a reload took it: "
                           "c 195:0 rw via devices.allow+systemd; verified: prevented"), calls
    (seen,) = systemd_mock.observed()  # one SetUnitProperties, made with the container frozen ...
    assert seen["freezer"] == "FROZEN"
    assert open(freezer).read().strip() == "THAWED"  # ... and nothing left frozen
    assert not list((runc_host.root / "run/nvsymlinkd/frozen").glob("*.json"))


def test_deb_scripts_name_a_hook_granted_container_they_cannot_protect(deb_build, runc_host, systemd_mock, tmp_path):
    """A device the NVIDIA hook granted (outside the spec), on a node with no daemon before the install:
    nothing trusted expects it, so the postinst grants nothing and says so (stderr, logger), the
    installation goes on, and the package's reload takes the device: the limit install.md states."""
    need_tool("unshare")
    scope = "runc-gpu-hook.scope"
    c = runc_host.run("gpu-hook", driver="systemd", nodes=[device_node("/dev/nvidia0", 195, 0)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"])
    c.allow("c 195:0 rw")  # the hook's grant, after runc applied the spec
    freezer = f"/sys/fs/cgroup/freezer/{c.cgroups_path.lstrip('/')}/freezer.state"
    systemd_mock.add_scope(scope, SCOPE_KEEP, root=str(runc_host.root), devices=str(c.devices_dir()), freezer=freezer)
    (runc_host.root / "run/systemd/system").mkdir(parents=True)
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"
    calls = run_for_real(deb_build, deb_build["control"], DPKG_SEQUENCES["install"], tmp_path / "run", runc_host,
                         systemd_mock, {scope: str(c.devices_dir())})
    prevent = calls.index("@ nvsymlinkd repair --before-reload")
    said = calls[prevent + 1:calls.index("@ py3compile -p nvsymlinkd -V 3.9-")]  # up to debhelper's section
    assert said[0] == ("nvsymlinkd: gpu-hook (runc-gpu-hook.scope): left at risk of the reload: nothing trusted "
                       "expects the devices its scope lacks"), calls
    assert any("not granted c 195:0 rw (unexpected)" in line for line in said), said
    # named last by the step itself (and journaled by it), which exits 0: the script's own note and `logger`
    # are for a step that could not run at all
    assert said[-1].startswith("nvsymlinkd: not every GPU container could be kept safe from this daemon-reload "
                               "(gpu-hook)"), said
    assert not [x for x in said if x.startswith("@ logger")], said
    assert calls[-1] == "@ deb-systemd-invoke start nvsymlinkd.service"
    assert systemd_mock.observed() == []  # nothing was granted ...
    assert c.open_error("/dev/nvidia0", rw=True) == "EPERM"  # ... and the reload took the hook's grant
