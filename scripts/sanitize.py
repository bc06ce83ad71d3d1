"""compute-sanitizer over the GPU suite: each tests/gpu file its own sanitizer run, within one device call's time.

    python3 scripts/sanitize.py --tool memcheck [--files fast] [-k EXPR] [--quick] [--timeout 300]
                                [--max-seconds 540] [--resume] [--racecheck-report all] [--no-caching-allocator]
                                [--sanitizer-arg ARG ...] [--log $OUT/sanitizer.log] [-- PYTEST_ARGS]

Each run is `compute-sanitizer --tool TOOL --target-processes all python3 -m pytest -q -rs FILE` (the vLLM tests'
engines run in worker processes, hence `all`). --tool takes memcheck, racecheck, initcheck, synccheck or a comma
list of them; --files takes a group (fast: every tests/gpu file but the vLLM ones; vllm: test_vllm_*; all) or
files and node ids, comma-separated, each as a path, `test_gemm.py` or `gemm` (node ids of one file share its run).
A run stops at --timeout (SIGINT first, so pytest and the sanitizer can print their summaries, then SIGKILL); no run
starts once fewer than 30 s of --max-seconds are left, and those not started are listed as not run. --resume skips
the runs this commit already has in the results, so the same command, repeated, works through the suite.
--quick sets TK_SANITIZE_QUICK=1 for the tests to run fewer cases (every run also sees TK_SANITIZER=TOOL).
Other sanitizer options go through --sanitizer-arg, e.g. --sanitizer-arg=--check-warpgroup-mma=yes for wgmma
operands (compute-sanitizer's own option; whether the host's version has it is not checked here).

Each run's sanitizer and pytest summaries land in bench/results/sanitizer.json, replacing an older entry of the same
(tool, file, selection): {"runs": [{"commit", "date", "device", "tool", "file", "selection", "errors", "hazards",
"passed", "failed", "skipped", "seconds", "timed_out", "crashed", "returncode", "clean", "first_errors"}],
"not_run": [...]}. errors is the sanitizer's ERROR SUMMARY (racecheck: its RACECHECK SUMMARY's errors if more),
None where no summary was printed; hazards is racecheck's {displayed, errors, warnings}; first_errors holds the first
40 lines of each distinct report (at most 8) with how often it came. A run is clean when it printed 0 errors, ran
at least one test, failed none and neither timed out nor crashed. Exit status: 0 every run clean and none left,
1 a run not clean, 2 no sanitizer or a device it refuses, 3 clean so far but runs left for a later call.
Full logs: /tmp/tk_sanitize/; --log appends each run's first and last 200 lines to one file (gpu_check.sh: $OUT).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, commit_of_tree  # noqa: E402

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
GPU_TESTS = ROOT / "tests" / "gpu"
RESULTS = ROOT / "bench" / "results" / "sanitizer.json"
LOG_DIR = Path("/tmp/tk_sanitize")
PREFIX = "========="
# a sanitizer line: the prefix alone or with a space; pytest's '===== FAILURES =====' bars end in '='
SANITIZER_LINE = re.compile(r"^=========(?: (?!.* =+$).*)?$")
REPORT_LINES, MAX_REPORTS, LINE_CHARS = 40, 8, 400
MIN_RUN_SECONDS, GRACE_SECONDS, KILL_SECONDS = 30, 15, 5  # a run past its time: SIGINT, GRACE s, SIGKILL
LOG_HEAD = LOG_TAIL = 200

ERROR_SUMMARY = re.compile(r"^=+ ERROR SUMMARY: (\d+) errors?", re.M)
RACECHECK_SUMMARY = re.compile(
    r"^=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", re.M)
_PYTEST_WORD = r"(?:passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?|rerun)"
PYTEST_SUMMARY = re.compile(rf"^=*\s*((?:\d+ {_PYTEST_WORD}|no tests ran)(?:, \d+ {_PYTEST_WORD})*) in [\d.]+s\b",
                            re.M)
PYTEST_COUNT = re.compile(rf"(\d+) ({_PYTEST_WORD})")
# lines of the sanitizer's own that open no error report
NOT_A_REPORT = re.compile(r"COMPUTE-SANITIZER|(ERROR|RACECHECK|LEAK) SUMMARY|Target application returned an error"
                          r"|print limit", re.I)
UNSUPPORTED = re.compile(r"device not supported", re.I)
REFUSED = "the sanitizer refused the device"


@dataclass(frozen=True)
class Target:
    """One sanitizer run's pytest target: a tests/gpu file and, optionally, node ids inside it."""
    file: str
    nodes: tuple[str, ...] = ()

    def pytest_args(self) -> list[str]:
        return [f"{self.file}::{n}" for n in self.nodes] or [self.file]


def split_list(text: str) -> list[str]:
    """Comma-separated items; a comma inside a node id's [params] does not split."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [i.strip() for i in items + [current] if i.strip()]


def gpu_test_files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in sorted(GPU_TESTS.glob("test_*.py"))]


def group(name: str) -> list[str] | None:
    files = gpu_test_files()
    vllm = [f for f in files if Path(f).name.startswith("test_vllm_")]
    return {"all": files, "vllm": vllm, "fast": [f for f in files if f not in vllm]}.get(name)


def resolve_file(name: str) -> str:
    """A tests/gpu file, named by path, file name or stem without test_, as a path from the repo root."""
    stem = Path(name).name.removesuffix(".py").removeprefix("test_")
    for candidate in (ROOT / name, GPU_TESTS / f"test_{stem}.py"):
        if candidate.is_file():
            return candidate.resolve().relative_to(ROOT).as_posix()
    raise ValueError(f"--files: {name!r} names no file under tests/gpu (known: "
                     f"{', '.join(Path(f).stem.removeprefix('test_') for f in gpu_test_files())})")


def targets(specs: list[str]) -> list[Target]:
    """The runs --files asks for, in its order: groups expanded, the node ids of one file gathered into one run."""
    nodes: dict[str, list[str]] = {}
    for spec in (item for s in specs for item in split_list(s)):
        members = group(spec)
        if members is not None:
            for f in members:
                nodes.setdefault(f, [])
            continue
        name, _, node = spec.partition("::")
        nodes.setdefault(resolve_file(name), []).extend([node] if node else [])
    return [Target(f, tuple(dict.fromkeys(n))) for f, n in nodes.items()]


def selection_of(target: Target, keyword: str | None, quick: bool, pytest_extra: list[str]) -> str:
    """What of the file a run covers, as words: '' for the whole file with every case."""
    words = [f"::{n}" for n in target.nodes] + (["-k", keyword] if keyword else [])
    return shlex.join(words + (["--quick"] if quick else []) + pytest_extra)


def whole_file(selection: str) -> bool:
    return not any(w.startswith("::") or w == "-k" for w in shlex.split(selection))


# -- parsing a run's output ------------------------------------------------------------------------------------

def sanitizer_summary(text: str) -> tuple[int | None, dict | None]:
    """(errors, hazards): the ERROR SUMMARY counts summed over the processes that printed one, or racecheck's
    RACECHECK SUMMARY errors where those are more (so that neither summary's errors can be missed, nor counted
    twice), and racecheck's hazards; None where no summary was printed."""
    summaries = ERROR_SUMMARY.findall(text)
    races = [tuple(map(int, r)) for r in RACECHECK_SUMMARY.findall(text)]
    hazards = None
    if races:
        hazards = {key: sum(r[i] for r in races) for i, key in enumerate(("displayed", "errors", "warnings"))}
    if not summaries and not races:
        return None, None
    return max(sum(map(int, summaries)), hazards["errors"] if hazards else 0), hazards


def pytest_counts(text: str) -> dict | None:
    """passed / failed (collection errors included) / skipped of the last pytest summary line; None if none came."""
    lines = PYTEST_SUMMARY.findall(text)
    if not lines:
        return None
    counts = {word: int(n) for n, word in PYTEST_COUNT.findall(lines[-1])}
    return {"passed": counts.get("passed", 0) + counts.get("xpassed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "skipped": counts.get("skipped", 0) + counts.get("xfailed", 0)}


def _report_key(lines: list[str]) -> str:
    """Reports of one kind at one place are one report: addresses, thread / block indices and counts aside."""
    text = " ".join(lines[:2])
    text = re.sub(r"0x[0-9a-fA-F]+", "0x_", text)
    text = re.sub(r"\(\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\)", "(_)", text)
    return re.sub(r"\[\d+ hazards?\]", "", text).strip()


def error_reports(text: str) -> list[dict]:
    """The sanitizer's error reports (a '========= Header' line, then its indented lines, up to a bare
    '=========' line), the distinct ones in order, each {"count", "lines"} with its first REPORT_LINES lines."""
    reports: dict[str, dict] = {}
    current: list[str] | None = None

    def close():
        if current:
            entry = reports.setdefault(_report_key(current), {"count": 0, "lines": current[:REPORT_LINES]})
            entry["count"] += 1

    for raw in text.splitlines():
        if not SANITIZER_LINE.match(raw):
            continue  # the application's own output, interleaved
        body = raw[len(PREFIX):]
        line = (PREFIX + body.rstrip())[:LINE_CHARS]
        if not body.strip():
            close()
            current = None
        elif not body.startswith("  "):  # '========= Header', where the report's own lines are indented
            close()
            current = None if NOT_A_REPORT.search(body) else [line]
        elif current is not None:
            current.append(line)
    close()
    return list(reports.values())[:MAX_REPORTS]


def parse_run(text: str, returncode: int | None, timed_out: bool) -> dict:
    """A run's record fields read off its output."""
    errors, hazards = sanitizer_summary(text)
    counts = pytest_counts(text)
    crashed = counts is None and not timed_out
    counts = counts or {"passed": None, "failed": None, "skipped": None}
    refused = any(UNSUPPORTED.search(line) for line in text.splitlines() if SANITIZER_LINE.match(line))
    clean = (errors == 0 and not timed_out and not crashed and (counts["passed"] or 0) > 0
             and counts["failed"] == 0)
    return {"errors": errors, "hazards": hazards, **counts, "timed_out": timed_out, "crashed": crashed,
            "returncode": returncode, "clean": clean, **({"note": REFUSED} if refused else {}),
            "first_errors": error_reports(text)}


# -- running --------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    text: str
    returncode: int | None
    seconds: float
    timed_out: bool


Runner = Callable[[list[str], dict, float, Path], Outcome]


def run_with_timeout(command: list[str], env: dict, timeout: float, log: Path) -> Outcome:
    """Run command in its own process group with its output in log; past timeout, SIGINT the group (pytest and the
    sanitizer then print their summaries), SIGKILL it GRACE_SECONDS later."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("w") as out:
        # SIGINT back to its default: a parent started in the background passes it on ignored
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        timed_out = False
        try:
            proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGINT, GRACE_SECONDS), (signal.SIGKILL, KILL_SECONDS)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    return Outcome(log.read_text(errors="replace"), proc.returncode, time.monotonic() - t0, timed_out)


def find_sanitizer(explicit: str | None) -> str | None:
    candidates = [explicit] if explicit else [
        shutil.which("compute-sanitizer"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
        "/usr/local/cuda/bin/compute-sanitizer"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def sanitizer_command(sanitizer: str, tool: str, target: Target, args: argparse.Namespace) -> list[str]:
    tool_args = ["--racecheck-report", args.racecheck_report] if tool == "racecheck" and args.racecheck_report else []
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *target.pytest_args()]
    return [sanitizer, "--tool", tool, "--target-processes", "all", *tool_args, *args.sanitizer_arg,
            *pytest, *(["-k", args.k] if args.k else []), *args.pytest_extra]


def run_environment(tool: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "TK_SANITIZER": tool, "PYTHONUNBUFFERED": "1"}
    if args.quick:
        env["TK_SANITIZE_QUICK"] = "1"
    if args.no_caching_allocator:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return env


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[0].strip() if out else "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


Plan = list[tuple[str, Target, str]]  # (tool, target, selection) in running order


def sanitize(plan: Plan, run: Callable[[str, Target, float], Outcome], max_seconds: float,
             on_record: Callable[[dict], None] = lambda record: None,
             clock: Callable[[], float] = time.monotonic) -> tuple[list[dict], list[dict]]:
    """Run plan in order within max_seconds: (records, not run). A run gets what is left of the budget, less the
    time a kill takes; none starts with less than MIN_RUN_SECONDS left, nor after the sanitizer refused the device.
    on_record sees each record as it comes (main writes the results then, so a killed call keeps what ran)."""
    start = clock()
    records, not_run, reason = [], [], None
    for tool, target, selection in plan:
        left = max_seconds - (clock() - start)
        if reason is None and left < MIN_RUN_SECONDS:
            reason = f"budget: {max(left, 0):.0f}s of --max-seconds {max_seconds:.0f} left"
        key = {"tool": tool, "file": target.file, "selection": selection}
        if reason:
            not_run.append({**key, "reason": reason})
            continue
        outcome = run(tool, target, left - GRACE_SECONDS - KILL_SECONDS)
        parsed = parse_run(outcome.text, outcome.returncode, outcome.timed_out)
        first_errors = parsed.pop("first_errors")
        record = {**key, **parsed, "seconds": round(outcome.seconds, 1), "first_errors": first_errors}
        if record.get("note") == REFUSED:
            reason = REFUSED
        records.append(record)
        on_record(record)
    return records, not_run


# -- the results file -----------------------------------------------------------------------------------------

def _key(entry: dict) -> tuple[str, str, str]:
    return entry["tool"], entry["file"], entry.get("selection", "")


def _order(entry: dict) -> tuple:
    tool = TOOLS.index(entry["tool"]) if entry["tool"] in TOOLS else len(TOOLS)
    return entry["file"], tool, entry.get("selection", "")


def merge(doc: dict, records: list[dict], not_run: list[dict]) -> dict:
    """doc with records replacing the runs of the same (tool, file, selection) and not_run replacing the earlier
    not-run entry of such a key; a key that ran leaves the not-run list."""
    ran = {_key(r) for r in records}
    runs = [r for r in doc.get("runs", []) if _key(r) not in ran] + records
    listed = ran | {_key(r) for r in not_run}
    left = [r for r in doc.get("not_run", []) if _key(r) not in listed] + not_run
    return {"runs": sorted(runs, key=_order), "not_run": sorted(left, key=_order)}


def still_to_run(doc: dict, tools: list[str], commit: str) -> dict[str, list[str]]:
    """Per tool, the tests/gpu files with no whole-file run at this commit."""
    done = {(r["tool"], r["file"]) for r in doc.get("runs", [])
            if r.get("commit") == commit and whole_file(r.get("selection", ""))}
    return {tool: [f for f in gpu_test_files() if (tool, f) not in done] for tool in tools}


def summary_line(r: dict) -> str:
    verdict = ("TIMEOUT" if r["timed_out"] else "CRASHED" if r["crashed"] else "clean" if r["clean"]
               else "ERRORS" if r["errors"] else "NOSUMM" if r["errors"] is None else "FAILED" if r["failed"]
               else "NOTEST")  # NOSUMM: the sanitizer printed no summary
    errors = "?" if r["errors"] is None else r["errors"]
    hazards = r["hazards"]
    races = f" hazards {hazards['displayed']} ({hazards['warnings']} warnings)" if hazards else ""
    tests = " ".join(f"{'?' if r[k] is None else r[k]} {k}" for k in ("passed", "failed", "skipped"))
    note = f"  [{r['note']}]" if r.get("note") else ""
    return f"{r['tool']:<9} {verdict:<7} errors {errors}{races}  {tests}  {r['seconds']:.0f}s  " \
           f"{r['file']} {r['selection']}".rstrip() + note


def capped(text: str) -> str:
    lines = [line[:1000] for line in text.splitlines()]
    if len(lines) > LOG_HEAD + LOG_TAIL:
        lines = lines[:LOG_HEAD] + [f"[... {len(lines) - LOG_HEAD - LOG_TAIL} lines ...]"] + lines[-LOG_TAIL:]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    pytest_extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tool", required=True, help="memcheck, racecheck, initcheck, synccheck, or a comma list")
    p.add_argument("--files", action="append", help="fast (default), vllm, all, or files / node ids, comma-separated")
    p.add_argument("-k", help="pytest -k expression for every run")
    p.add_argument("--quick", action="store_true", help="TK_SANITIZE_QUICK=1: the tests' smaller case lists")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take (default 300)")
    p.add_argument("--max-seconds", type=float, default=540, help="the whole call's budget (default 540)")
    p.add_argument("--resume", action="store_true", help="skip the runs this commit already has in the results")
    p.add_argument("--racecheck-report", choices=("analysis", "hazard", "all"), help="racecheck's report mode")
    p.add_argument("--no-caching-allocator", action="store_true",
                   help="PYTORCH_NO_CUDA_MEMORY_CACHING=1: memcheck sees overruns into a neighbouring tensor of one "
                        "cached block (slower; CUDA-graph capture may refuse it)")
    p.add_argument("--sanitizer-arg", action="append", default=[],
                   help="one more compute-sanitizer argument, written --sanitizer-arg=--print-limit=20")
    p.add_argument("--sanitizer", help="the compute-sanitizer binary (default: PATH, $CUDA_HOME/bin)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results file (default %(default)s)")
    p.add_argument("--log", type=Path, help="append each run's capped output here")
    args = p.parse_args(argv)
    args.tools = split_list(args.tool)
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown or not args.tools:
        p.error(f"--tool must be among {', '.join(TOOLS)}, got {args.tool!r}")
    try:
        args.targets = targets(args.files or ["fast"])
    except ValueError as e:
        p.error(str(e))
    args.pytest_extra = pytest_extra
    return args


def main(argv: list[str] | None = None, runner: Runner = run_with_timeout) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        where = f"at {args.sanitizer}" if args.sanitizer else "on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin"
        print(f"sanitize: no compute-sanitizer {where}", file=sys.stderr)
        return 2
    commit, device = commit_of_tree(), device_name()
    doc = json.loads(args.results.read_text()) if args.results.exists() else {"runs": [], "not_run": []}
    done = {_key(r) for r in doc.get("runs", []) if r.get("commit") == commit and commit != "unknown"}
    plan = [(tool, t, selection_of(t, args.k, args.quick, args.pytest_extra)) for tool in args.tools
            for t in args.targets]
    plan = [p for p in plan if not (args.resume and (p[0], p[1].file, p[2]) in done)]

    def run(tool: str, target: Target, left: float) -> Outcome:
        command = sanitizer_command(sanitizer, tool, target, args)
        timeout = min(args.timeout, left)
        print(f"-> {tool} {shlex.join(target.pytest_args())} (timeout {timeout:.0f}s)", flush=True)
        log = LOG_DIR / f"{tool}-{Path(target.file).stem}.log"
        outcome = runner(command, run_environment(tool, args), timeout, log)
        if args.log:
            args.log.parent.mkdir(parents=True, exist_ok=True)
            with args.log.open("a") as combined:
                combined.write(f"\n##### {shlex.join(command)}\n{capped(outcome.text)}\n")
        return outcome

    def write(records: list[dict], not_run: list[dict]) -> None:
        nonlocal doc
        stamp = {"commit": commit, "date": now(), "device": device}
        doc = merge(doc, [{**stamp, **r} for r in records], [{**stamp, **r} for r in not_run])
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(doc, indent=1) + "\n")

    def on_record(record: dict) -> None:
        write([record], [])
        print(summary_line(record), flush=True)

    records, not_run = sanitize(plan, run, args.max_seconds, on_record)
    write([], not_run)
    print(f"== sanitize at {commit[:12]} on {device}: {len(records)} runs, {len(not_run)} not run; {args.results}")
    for r in records:
        print(summary_line(r))
    for r in not_run:
        print(f"{r['tool']:<9} NOT RUN {r['file']} {r['selection']}".rstrip() + f"  ({r['reason']})")
    for tool, files in still_to_run(doc, args.tools, commit).items():
        names = ", ".join(Path(f).stem.removeprefix("test_") for f in files) or "none"
        print(f"{tool}: tests/gpu files without a whole-file run at this commit: {names}")
    if any(r.get("note") == REFUSED for r in records):
        return 2
    if not all(r["clean"] for r in records):
        return 1
    return 3 if not_run else 0


if __name__ == "__main__":
    sys.exit(main())
