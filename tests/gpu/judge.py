"""The GPU smoke suite's judge: observations in, agreements, disagreements and the table out.

Pure: no I/O, no clock, no subprocess. tests/gpu/smoke.py gathers the observations on a machine
with a real NVIDIA driver (what a container sees from inside, what `nvsymlinkd check` and
`nvsymlinkd repair` say about it); this module decides, for each row, whether they agree.

The ground truth is what the kernel and the driver let a process do: `nvidia-smi -L`, NVML's init
and cuInit, run inside the container. nvsymlinkd's answers are judged against it and against what
the scenario was built to be (its `expect`). Three outcomes per row:

  agree      every rule holds
  DISAGREE   nvsymlinkd and the kernel (or the scenario's intent) say different things
  ERROR      a step of the suite itself failed, so the row says nothing either way

Observation shapes (plain JSON values; every key optional, a missing one is "not observed"):

  inside     {"smi_rc": int|None, "smi_text": str, "nvml": "ok"|error text|None, "nvml_count": int,
              "cuinit": int|None, "opens": {path: "ok"|"EPERM"|...}, "error": str|None}
  check      {"rc": int, "verdict": str, "kinds": [str], "devices": [str], "error": str|None}
  repair     {"rc": int, "status": str|None, "text": str, "error": str|None}   (also dry_run)
  container  {"name", "id", "expect": {"verdict", "inside", "repair"}, "inside", "check",
              "dry_run", "repair", "after", "after_check", "error"}
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# inside states
WORKS = "works"          # nvidia-smi, NVML and cuInit all succeed
NO_CUDA = "no-cuda"      # NVML works, cuInit does not (nvidia-uvm missing: cuInit 999)
FAILS = "fails"          # NVML cannot initialise (or nvidia-smi fails): the GPU nodes are denied
UNKNOWN = "unknown"      # not observed, or the probe itself failed

AGREE, DISAGREE, ERROR = "agree", "DISAGREE", "ERROR"

CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_UNKNOWN = 999
CU_NAMES = {0: "0", 100: "100 NO_DEVICE", 999: "999 UNKNOWN", 3: "3 NOT_INITIALIZED", 35: "35 INSUFFICIENT_DRIVER"}

# repair expectations
REPAIRED = "repaired"    # repair must give the devices back, and inside must work after it
NOT_REPAIRED = "not-repaired"  # repair must not claim it repaired anything
NOTHING = "nothing"      # no findings: repair has nothing to do (exit 0)

Obs = Dict[str, Any]


def inside_state(inside: Optional[Obs]) -> str:
    """What a container can do with its GPUs, from the probes run inside it."""
    if not inside or inside.get("error"):
        return UNKNOWN
    smi_rc, nvml, cu = inside.get("smi_rc"), inside.get("nvml"), inside.get("cuinit")
    if smi_rc is None and nvml is None and cu is None:
        return _state_from_opens(inside.get("opens") or {})
    nvml_ok = nvml == "ok"
    smi_ok = smi_rc == 0 if smi_rc is not None else nvml_ok
    if nvml is None:
        nvml_ok = smi_ok
    if smi_ok and nvml_ok:
        if cu is None or cu == CUDA_SUCCESS:
            return WORKS
        return NO_CUDA
    if smi_rc is None and nvml is None:
        return UNKNOWN
    return FAILS


def _from_opens(inside: Optional[Obs]) -> bool:
    return bool(inside) and all(inside.get(k) is None for k in ("smi_rc", "nvml", "cuinit"))  # type: ignore[union-attr]


def _state_from_opens(opens: dict) -> str:
    """No driver tools in the container (a host without a GPU): the open() of each node decides.

    "ok" and "ENXIO" (past the device cgroup, no driver behind a mknod'ed node) are allowed; EPERM is
    denied. A container whose every NVIDIA node opens works; one with a denied node fails."""
    if not opens:
        return UNKNOWN
    results = set(opens.values())
    if "EPERM" in results:
        return FAILS
    if results <= {"ok", "ENXIO"}:
        return WORKS
    return UNKNOWN


def cu_name(code: Any) -> str:
    if code is None:
        return "-"
    return CU_NAMES.get(code, str(code))


def inside_cell(inside: Optional[Obs]) -> str:
    if not inside:
        return "-"
    if inside.get("error"):
        return "probe error"
    smi_rc, nvml, cu = inside.get("smi_rc"), inside.get("nvml"), inside.get("cuinit")
    if smi_rc is None and nvml is None and cu is None:
        opens = inside.get("opens") or {}
        denied = sum(1 for v in opens.values() if v == "EPERM")
        return f"opens {len(opens) - denied}/{len(opens)} (no driver)"
    smi = "-" if smi_rc is None else str(smi_rc)
    if nvml == "ok":
        nv = f"ok({inside.get('nvml_count', '?')})"
    elif nvml is None:
        nv = "-"
    else:
        nv = "err"
    return f"{smi} / {nv} / {cu_name(cu)}"


def _verdict_matches(check: Obs, wanted: str) -> bool:
    """`wanted` is a verdict (ok, lost, denied, unknown, at-risk) or a finding kind (at-risk-uvm-missing)."""
    verdict = check.get("verdict")
    if verdict == wanted:
        return True
    return wanted.startswith("at-risk-") and verdict == "at-risk" and wanted in (check.get("kinds") or [])


def check_cell(check: Optional[Obs]) -> str:
    if not check:
        return "-"
    if check.get("error") and check.get("verdict") is None:
        return f"error (rc {check.get('rc')})"
    verdict = str(check.get("verdict"))
    if verdict == "at-risk":
        kinds = [k for k in check.get("kinds") or [] if k.startswith("at-risk")]
        verdict = kinds[0] if kinds else verdict
    return f"{verdict} (rc {check.get('rc')})"


def repair_cell(dry: Optional[Obs], repair: Optional[Obs]) -> str:
    parts = []
    if dry:
        parts.append("dry:" + _status_text(dry))
    if repair:
        parts.append(_status_text(repair))
    return " ".join(parts) or "-"


def _status_text(r: Obs) -> str:
    if r.get("error") and r.get("status") is None and r.get("rc") is None:
        return "error"
    status = r.get("status") or "none"
    if r.get("by") == "daemon":
        return f"daemon:{status}"
    return f"{status}({r.get('rc')})"


def after_cell(after: Optional[Obs], after_check: Optional[Obs]) -> str:
    if not after and not after_check:
        return "-"
    text = inside_cell(after) if after else "-"
    if after_check:
        text += "; " + check_cell(after_check)
    return text


def judge_container(c: Obs) -> Obs:
    """One container scenario: {"outcome", "reasons": [...], "cells": [...]}."""
    reasons: List[str] = []
    errors: List[str] = []
    expect = c.get("expect") or {}
    if c.get("error"):
        errors.append(str(c["error"]))
    inside = c.get("inside")
    state = inside_state(inside)
    check = c.get("check") or {}
    verdict = check.get("verdict")

    if inside and inside.get("error"):
        errors.append(f"probe inside failed: {inside['error']}")
    if check.get("error") and verdict is None:
        errors.append(f"check: {check['error']}")

    # the scenario itself: did the suite build what it meant to?
    want_inside = expect.get("inside")
    if want_inside == NO_CUDA and state == WORKS and _from_opens(inside):
        want_inside = WORKS  # no driver tools (open() decides): the nodes it has open, CUDA is not asked
    if want_inside and state not in (UNKNOWN, want_inside):
        errors.append(f"scenario not reproduced: inside {state}, the scenario wanted {want_inside}")

    # a loss scenario: before the loss the container must work, and check must not say it lost anything
    before = c.get("before")
    if before is not None:
        before_state = inside_state(before)
        if before_state not in (UNKNOWN, WORKS):
            errors.append(f"scenario not reproduced: before the loss inside was {before_state}, not works")
        before_verdict = (c.get("before_check") or {}).get("verdict")
        if before_state == WORKS and before_verdict in ("lost", "denied", "unknown"):
            reasons.append(f"before the loss the container uses its GPUs but check said {before_verdict}")

    # nvsymlinkd against the kernel
    if verdict is not None:
        if state in (FAILS, NO_CUDA) and verdict == "ok":
            reasons.append(f"check says ok but the container cannot use its GPUs (inside: {state})")
        if state == WORKS and verdict in ("lost", "denied"):
            reasons.append(f"check says {verdict} but the container uses its GPUs")
        want = expect.get("verdict")
        if want and not _verdict_matches(check, want):
            reasons.append(f"expected verdict {want}, check said {check_cell(check)}")
        rc = check.get("rc")
        if rc is not None and verdict != "ok" and rc == 0:
            reasons.append(f"check says {verdict} but exits 0")
        if rc is not None and verdict == "ok" and rc != 0:
            reasons.append(f"check says ok but exits {rc}")

    _judge_repair(c, expect.get("repair"), reasons, errors)

    if reasons:
        outcome = DISAGREE
    elif errors:
        outcome = ERROR
    else:
        outcome = AGREE
    cells = [str(c.get("name", "?")), inside_cell(inside), check_cell(c.get("check")),
             repair_cell(c.get("dry_run"), c.get("repair")), after_cell(c.get("after"), c.get("after_check"))]
    return {"outcome": outcome, "reasons": reasons, "errors": errors, "cells": cells, "inside_state": state}


def _judge_repair(c: Obs, want: Optional[str], reasons: List[str], errors: List[str]) -> None:
    repair, dry, after = c.get("repair"), c.get("dry_run"), c.get("after")
    after_state = inside_state(after) if after else UNKNOWN
    if repair and repair.get("error") and repair.get("status") is None and repair.get("rc") is None:
        errors.append(f"repair: {repair['error']}")
        return
    status = (repair or {}).get("status")
    rc = (repair or {}).get("rc")
    if status == "repaired":
        if after and after_state not in (WORKS, UNKNOWN):
            reasons.append(f"repair says repaired but inside still {after_state}")
        if rc not in (None, 0):
            reasons.append(f"repair says repaired but exits {rc}")
        after_check = c.get("after_check") or {}
        after_verdict = after_check.get("verdict")
        before_verdict = (c.get("before_check") or {}).get("verdict")
        # back where it was before the loss: ok, or the same at-risk as then (a hook's grant stays
        # outside the spec), never a loss
        if after_verdict in ("lost", "denied", "unknown") or \
                (after_verdict not in (None, "ok") and before_verdict is not None and after_verdict != before_verdict):
            reasons.append(f"repair says repaired but check afterwards says {check_cell(after_check)}")
    if dry and dry.get("status") == "repaired":
        reasons.append("repair --dry-run says repaired (a dry run must change nothing)")
    if want == REPAIRED:
        if repair is None:
            errors.append("repair was not run")
        elif status is None and repair.get("by") == "daemon":
            reasons.append("the daemon's first pass gave nothing back: " + str(repair.get("text") or "")[:200])
        elif status is None:
            reasons.append(f"repair found nothing to repair (rc {rc}): the container was not given its devices back")
        elif status != "repaired":
            why = (repair.get("text") or "").strip().splitlines()
            reasons.append(f"repair refused: {status} (rc {rc})" + (f": {why[0][:200]}" if why else ""))
        elif after is not None and after_state == UNKNOWN:
            errors.append("after the repair, the probe inside said nothing")
        if dry is not None and dry.get("status") not in ("would-repair",) and status == "repaired":
            reasons.append(f"repair --dry-run said {_status_text(dry)}, then repair repaired")
    elif want == NOT_REPAIRED:
        if status in ("repaired", "prevented"):
            reasons.append(f"repair claims {status} where nothing trusted says the devices were granted")
        if after is not None and after_state == WORKS and inside_state(c.get("inside")) != WORKS:
            reasons.append("after repair the container can use devices nothing trusted granted")
    elif want == NOTHING:
        if status not in (None, "nothing-to-do"):
            reasons.append(f"repair of a healthy container says {status}")
        if rc not in (None, 0):
            reasons.append(f"repair of a healthy container exits {rc}")


# --- host rows ------------------------------------------------------------------------------

def pct(values: List[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def latency_text(ms: List[float]) -> str:
    if not ms:
        return "no samples"
    return f"p50 {pct(ms, 50):.2f}/p99 {pct(ms, 99):.2f} ms"


def judge_sync(s: Obs) -> Obs:
    reasons, errors = [], []
    if s.get("error"):
        errors.append(str(s["error"]))
    links = s.get("links") or {}
    nodes, exact = links.get("nodes", 0), links.get("exact", 0)
    problems = links.get("problems") or []
    if s.get("rc") not in (None, 0):
        reasons.append(f"nvsymlinkd sync exited {s.get('rc')}")
    if problems:
        reasons.append(f"{len(problems)} link problem(s) after sync: " + "; ".join(problems[:4]))
    if not nodes and not s.get("error"):
        errors.append("no NVIDIA device nodes found on the host")
    inside = f"{exact}/{nodes} nodes linked exactly"
    check = f"sync rc {s.get('rc')}"
    return _row("sync + links", inside, check, "-", "-", reasons, errors)


def judge_nvml(n: Obs) -> Obs:
    reasons, errors = [], []
    truth = n.get("truth") or {}
    finding = n.get("finding")
    if n.get("error"):
        errors.append(str(n["error"]))
    truth_ok = truth.get("ok")
    if finding is None:
        errors.append("check --json gave no nvml host finding")
        check = "-"
    else:
        status = finding.get("status")
        detail = str(finding.get("detail") or "")
        check = f"nvml {status}: {detail[:40]}"
        if "not checked" in detail:
            reasons.append(f"check did not check NVML: {detail[:160]}")
        elif truth_ok is True and status == "warn":
            reasons.append(f"NVML works on the host but check warns: {detail[:160]}")
        elif truth_ok is False and status != "warn":
            reasons.append(f"NVML fails on the host ({truth.get('error')}) but check says {status}")
        count = truth.get("count")
        if truth_ok and count is not None and status != "warn" and f"{count} GPU" not in detail:
            reasons.append(f"NVML counts {count} GPU(s), check's detail says: {detail[:160]}")
    if truth_ok is None:
        inside = "host NVML not probed"
    elif truth_ok:
        inside = f"host: {truth.get('count')} GPU, smi {truth.get('smi_rc')}, cu {cu_name(truth.get('cuinit'))}"
    else:
        inside = f"host NVML fails: {str(truth.get('error'))[:30]}"
    return _row("check: nvml", inside, check, "-", "-", reasons, errors)


def judge_latency(name: str, lat: Obs, tries_wanted: Optional[int] = None) -> Obs:
    reasons, errors = [], []
    if lat.get("error"):
        errors.append(str(lat["error"]))
    ms = [float(x) for x in lat.get("ms") or []]
    fails = int(lat.get("failures") or 0)
    tries = int(lat.get("tries") or 0)
    if fails:
        reasons.append(f"{fails} of {tries} not linked within {lat.get('timeout_ms', '?')} ms")
    if tries_wanted is not None and tries < tries_wanted and not lat.get("error"):
        errors.append(f"only {tries} of {tries_wanted} tries ran")
    for extra in lat.get("problems") or []:
        reasons.append(str(extra))
    inside = f"{len(ms)}/{tries} {latency_text(ms)}"
    if lat.get("removed_ms"):
        inside += f"; unlink {latency_text([float(x) for x in lat['removed_ms']])}"
    return _row(name, inside, "daemon" if not lat.get("error") else "-", "-", "-", reasons, errors)


def _row(name: str, inside: str, check: str, repair: str, after: str, reasons: List[str], errors: List[str]) -> Obs:
    outcome = DISAGREE if reasons else ERROR if errors else AGREE
    return {"outcome": outcome, "reasons": reasons, "errors": errors,
            "cells": [name, inside, check, repair, after]}


# --- the whole run --------------------------------------------------------------------------

HEADER = ["scenario", "inside (smi / NVML / cuInit)", "check verdict", "repair", "after repair (inside; check)", "agree?"]


def judge_all(obs: Obs) -> Obs:
    """Every row judged; -> {"rows": [...], "exit": 0|1|2, "table": text}."""
    rows = []
    host = obs.get("host") or {}
    if "sync" in host:
        rows.append(judge_sync(host["sync"]))
    if "nvml" in host:
        rows.append(judge_nvml(host["nvml"]))
    if "relink" in host:
        rows.append(judge_latency("daemon: relink", host["relink"], host["relink"].get("wanted")))
    if "newnode" in host:
        rows.append(judge_latency("daemon: new node", host["newnode"], host["newnode"].get("wanted")))
    for c in sorted(obs.get("containers") or [], key=lambda c: str(c.get("name"))):
        rows.append(judge_container(c))
    for step in obs.get("skipped") or []:
        rows.append(_row(str(step.get("name")), "-", "-", "-", "-", [], [f"not run: {step.get('why')}"]))
    if any(r["outcome"] == DISAGREE for r in rows):
        code = 1
    elif any(r["outcome"] == ERROR for r in rows) or obs.get("fatal") or not rows:
        code = 2
    else:
        code = 0
    table = render_table(rows, obs.get("fatal"))
    said = smi_lines(obs.get("containers") or [])
    if said:
        table += "\n\nnvidia-smi -L inside (before the loss -> at the check -> after the repair):\n" + "\n".join(said)
    return {"rows": rows, "exit": code, "table": table}


def smi_lines(containers: List[Obs]) -> List[str]:
    """What nvidia-smi printed inside each container (its first line), at each probe."""
    out = []
    for c in containers:
        seen = []
        for key in ("before", "inside", "after"):
            probe = c.get(key) or {}
            if probe.get("smi_rc") is not None:
                first = (str(probe.get("smi_text") or "").strip().splitlines() or [""])[0]
                seen.append(f"{first[:70]} (rc {probe['smi_rc']})")
        if seen:
            out.append(f"  {c.get('name')}: " + " -> ".join(seen))
    return out


def render_table(rows: List[Obs], fatal: Optional[str] = None) -> str:
    notes: List[str] = []
    body = []
    for r in rows:
        marks = []
        for text in r["reasons"] + r["errors"]:
            notes.append(text)
            marks.append(str(len(notes)))
        agree = {"agree": "yes", "DISAGREE": "NO", "ERROR": "ERROR"}[r["outcome"]]
        if marks:
            agree += " [" + ",".join(marks) + "]"
        body.append([_clip(x) for x in r["cells"]] + [agree])
    widths = [max(len(HEADER[i]), *(len(b[i]) for b in body)) if body else len(HEADER[i])
              for i in range(len(HEADER))]
    lines = [" | ".join(h.ljust(w) for h, w in zip(HEADER, widths)).rstrip(),
             "-+-".join("-" * w for w in widths)]
    for b in body:
        lines.append(" | ".join(x.ljust(w) for x, w in zip(b, widths)).rstrip())
    if notes:
        lines.append("")
        lines += [f"[{i}] {text}" for i, text in enumerate(notes, 1)]
    if fatal:
        lines.append(f"suite stopped early: {fatal}")
    counts = {k: sum(1 for r in rows if r["outcome"] == k) for k in (AGREE, DISAGREE, ERROR)}
    lines.append(f"rows: {counts[AGREE]} agree, {counts[DISAGREE]} disagree, {counts[ERROR]} error")
    return "\n".join(lines)


def _clip(text: str, width: int = 56) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."
