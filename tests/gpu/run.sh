#!/bin/bash
# Entry point of the GPU smoke suite on the GPU machine (as root, from the repository root):
#   bash tests/gpu/run.sh [CARRY_DIR] [smoke.py options...]
# CARRY_DIR (default .gpucarry) is what tests/gpu/prepare-carry made. Installs its wheels into
# /tmp/gpusmoke-site, puts its runc first on PATH (LD_LIBRARY_PATH for its libraries), then runs
# tests/gpu/smoke.py under a deadline, the log tee'd to $OUT/gpu-smoke.log; the table and the
# results JSON go to $OUT (if set). Exit status: smoke.py's (0 agree, 1 disagree, 2 errors only),
# 124 if the outer timeout had to kill it.
set -u
cd "$(dirname "$0")/../.." || exit 2
carry=${1:-.gpucarry}
[ $# -gt 0 ] && shift
py=${PYTHON:-}
if [ -z "$py" ]; then
    for candidate in /opt/torch/.venv/bin/python3 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then py=$(command -v "$candidate"); break; fi
    done
fi
out=${OUT:-}
log=/dev/null
if [ -n "$out" ]; then mkdir -p "$out" && log="$out/gpu-smoke.log"; fi
budget=${GPUSMOKE_BUDGET:-300}
{
    echo "run.sh: python $py ($("$py" --version 2>&1)); carry $carry; budget $budget s; out ${out:-none}"
    site=/tmp/gpusmoke-site
    if [ -d "$carry/whl" ] && ls "$carry"/whl/*.whl >/dev/null 2>&1; then
        # pip where the interpreter has it; a venv made by uv may not: the wheels are pure Python,
        # and unpacking one is installing it for an import path
        if ! timeout 120 "$py" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
                --target "$site" "$carry"/whl/*.whl; then
            echo "run.sh: pip install failed or no pip; unpacking the wheels into $site"
            "$py" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$site" "$carry"/whl/*.whl || echo "run.sh: unpacking failed too (going on)"
        fi
    else
        echo "run.sh: no wheels in $carry/whl (going on without them)"
    fi
    export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
    if [ -x "$carry/bin/runc" ]; then
        # a wrapper: the carried libraries for runc (and its re-exec'd init) only, not for nvidia-smi or python
        mkdir -p /tmp/gpusmoke-bin
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/$carry/lib" "$PWD/$carry/bin/runc" \
            > /tmp/gpusmoke-bin/runc
        chmod 755 /tmp/gpusmoke-bin/runc
        export PATH="/tmp/gpusmoke-bin:$PATH"
    else
        echo "run.sh: no $carry/bin/runc; using runc from PATH: $(command -v runc || echo none)"
    fi
    echo "run.sh: runc $(command -v runc): $(runc --version 2>&1 | head -1)"
    # the outer deadline: smoke.py stops itself at its budget (SIGTERM also makes it print the table)
    timeout -s TERM -k 20 $((budget + 60)) "$py" -u tests/gpu/smoke.py --budget "$budget" "$@"
    rc=$?
    echo "run.sh: smoke.py exited $rc"
    exit $rc
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
