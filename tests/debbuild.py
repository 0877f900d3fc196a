"""Build the project's .deb from a temporary copy of the working tree (shared by
tests/test_packages.py and the VM harness tests/vm/vmhost.py).

    from tests.debbuild import build_deb
    deb = build_deb(Path("/tmp/work"))   # /tmp/work/nvsymlinkd_<version>_all.deb
    newer = build_deb(Path("/tmp/up"), version="0.1.1")   # the same source as a higher version (upgrades)

The build runs `dpkg-buildpackage -us -uc -b` with the system toolchain (pyenv shims, venvs and
PYTHONPATH stripped: they break pybuild), in a copy of the tree so no build product lands in the repo.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parent.parent


def build_env() -> dict:
    """The system toolchain: no pyenv shims (they break pybuild), no venv, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    keep = [p for p in env.get("PATH", "").split(":") if p and ".pyenv" not in p and "/.venv" not in p]
    env["PATH"] = ":".join(keep or ["/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    env["LC_ALL"] = "C.UTF-8"
    return env


def run(argv, cwd=None, timeout=900, check=True, **kw):
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=build_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))}: exit {proc.returncode}\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def tree_files() -> Optional[List[str]]:
    """Relative paths of the working tree's files (tracked and untracked, not ignored) that exist,
    or None where the tree is no git checkout."""
    if not ((REPO / ".git").exists() and shutil.which("git")):
        return None
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    return sorted(rel for rel in set(filter(None, files.split("\0"))) if os.path.lexists(REPO / rel))


def copy_tree(dest: Path) -> Path:
    """The working tree (tracked and untracked, not ignored files) copied, so build products never
    land in the repo."""
    dest.mkdir(parents=True)
    files = tree_files()
    if files is not None:
        for rel in files:
            src = REPO / rel
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                os.symlink(os.readlink(src), dest / rel)
            else:
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(REPO, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv*", "*.egg-info", "__pycache__", ".pybuild",
                                                      ".ruff_cache", ".pytest_cache", "build", "dist", ".cache"))
    return dest


def source_key() -> Optional[str]:
    """A hash of every working-tree file that can end up in the package (tests/ excluded): equal
    keys mean an equal .deb, so a cached one may be reused. None without git (no reliable list)."""
    files = tree_files()
    if files is None:
        return None
    h = hashlib.sha256()
    for rel in files:
        if rel.startswith("tests/"):
            continue
        path = REPO / rel
        h.update(rel.encode() + b"\0")
        if path.is_symlink():
            h.update(b"L" + os.readlink(path).encode() + b"\0")
        else:
            h.update(oct(path.stat().st_mode & 0o777).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def bump_version(src: Path, version: str) -> None:
    """Make the copy at src the next release: a new debian/changelog entry (what `dch -v` writes)
    and the same __version__ (pyproject reads it), so the upgraded daemon says which one it is."""
    init = src / "nvsymlinkd" / "__init__.py"
    text, n = re.subn(r'^__version__ = "[^"]*"$', f'__version__ = "{version}"', init.read_text(), flags=re.M)
    assert n == 1, f"{init}: no __version__ line"
    init.write_text(text)
    changelog = src / "debian" / "changelog"
    old = changelog.read_text()
    maintainer = re.search(r"^ -- (.+?>)  ", old, re.M).group(1)
    date = time.strftime("%a, %d %b %Y %H:%M:%S +0000", time.gmtime())
    changelog.write_text(f"nvsymlinkd ({version}) unstable; urgency=medium\n\n  * Rebuilt as a higher version "
                         f"(upgrade test).\n\n -- {maintainer}  {date}\n\n" + old)


def build_deb(work: Path, version: Optional[str] = None) -> Path:
    """dpkg-buildpackage -us -uc -b in work/nvsymlinkd (a copy of the tree); returns the .deb,
    which lands in work/ next to the .changes and .buildinfo. version: build the copy as that
    (higher) version instead (bump_version)."""
    src = copy_tree(work / "nvsymlinkd")
    if version:
        bump_version(src, version)
    run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=src)
    debs = sorted(work.glob("nvsymlinkd_*_all.deb"))
    assert len(debs) == 1, sorted(p.name for p in work.iterdir())
    return debs[0]
