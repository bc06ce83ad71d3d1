"""scripts/sanitize.py without a GPU: its parsers on outputs shaped like compute-sanitizer's over pytest (clean, errors,
racecheck hazards, a timeout, a crash, a refused device), the results merge, the time budget (a fake runner and
clock), the command line, the kill on timeout (a stand-in sanitizer) and gpu_check.sh's sanitize:TOOL:FILES step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import sanitize  # noqa: E402

BT = "=========     Saved host backtrace up to driver entry point at kernel launch time\n" + "".join(
    f"=========         Host Frame: [0x{0x1000 + i:x}] in libtorch_cuda.so\n" for i in range(40))


def out_of_bounds_write(thread: int, after: int, backtrace: str = "") -> str:
    """memcheck's report of one thread's write past the end of an allocation (its backtrace optional)."""
    return f"""\
========= Invalid __global__ write of size 16 bytes
=========     at void tk::attn_prefill_kernel<tk::PrefillPolicy<128, true>>(tk::PrefillArgs)+0x2a70 in \
/work/main/csrc/kernels/prefill/kernel.cuh:141
=========     by thread ({thread},0,0) in block (7,3,0)
=========     Address 0x{0x7f0c3a000000 + 2097152 + after:x} is out of bounds
=========     and is {after:,} bytes after the nearest allocation at 0x7f0c3a000000 of size 2,097,152 bytes
{backtrace}=========
"""


MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
........................................................s.....           [100%]
=========================== short test summary info ============================
SKIPPED [1] tests/gpu/test_gemm.py:97: needs nvcc
61 passed, 1 skipped in 412.38s (0:06:52)
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_ERRORS = f"""\
========= COMPUTE-SANITIZER
..
{out_of_bounds_write(128, 4096, BT)}\
{out_of_bounds_write(129, 4112)}\
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to \
cudaStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2f2d1f] in libcuda.so.1
=========
F.F
=================================== FAILURES ===================================
______________________________ test_varlen[hd128-causal] ______________________________
E   RuntimeError: CUDA error: unspecified launch failure
=========================== short test summary info ============================
FAILED tests/gpu/test_attention.py::test_varlen[hd128-causal] - RuntimeError: CUDA error: unspecified launch failure
FAILED tests/gpu/test_attention.py::test_varlen[hd64-causal] - RuntimeError: CUDA error: unspecified launch failure
2 failed, 30 passed in 300.12s (0:05:00)
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""

RACECHECK_ANALYSIS = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at \
void tk::decode_split_kernel<tk::DecodePolicy<64>>(tk::DecodeArgs)+0x1b30 in \
/work/main/csrc/kernels/decode/kernel.cuh:212
=========     and Read access at void tk::decode_split_kernel<tk::DecodePolicy<64>>(tk::DecodeArgs)+0x1c80 in \
/work/main/csrc/kernels/decode/kernel.cuh:230 [256 hazards]
=========
========= Warning: Race reported between Read access at void tk::decode_combine_kernel(tk::CombineArgs)+0x900 in \
/work/main/csrc/kernels/decode/combine.cuh:40
=========     and Write access at void tk::decode_combine_kernel(tk::CombineArgs)+0x980 in \
/work/main/csrc/kernels/decode/combine.cuh:44 [32 hazards]
=========
..............                                                           [100%]
14 passed in 95.20s (0:01:35)
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
........                                                                 [100%]
8 passed in 61.02s (0:01:01)
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

def waw_hazard(address: int, block: str, thread: int) -> str:
    """racecheck's --racecheck-report hazard report of two threads writing one shared-memory word."""
    at = "at void tk::gemm_kernel(tk::GemmArgs)+0x170 in /work/main/csrc/kernels/gemm/kernel.cuh:18"
    return f"""\
========= Error: Potential WAW hazard detected at __shared__ 0x{address:x} in block ({block}) :
=========     Write Thread ({thread},0,0) {at}
=========     Write Thread ({thread - 32},0,0) {at}
=========     Current Value : 0, Incoming Value : {thread - 1}
=========
"""


RACECHECK_HAZARDS = f"""\
========= COMPUTE-SANITIZER
{waw_hazard(0x400, "3,0,0", 32)}{waw_hazard(0x480, "5,1,0", 33)}\
......                                                                   [100%]
6 passed in 40.00s
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""

# SIGINT at --timeout: pytest prints its summary, the sanitizer was killed before its own
TIMED_OUT = """\
========= COMPUTE-SANITIZER
............
=========================== short test summary info ============================
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
/usr/local/lib/python3.12/dist-packages/torch/cuda/__init__.py:1001: KeyboardInterrupt
(to show a full traceback on KeyboardInterrupt use --full-trace)
12 passed in 290.04s (0:04:50)
"""

CRASHED = """\
========= COMPUTE-SANITIZER
....Fatal Python error: Segmentation fault

Current thread 0x00007f6e5d2c1740 (most recent call first):
  File "/work/main/tk_backend/ops.py", line 88 in flash_attn_with_kvcache
  File "/work/main/tests/gpu/test_decode.py", line 120 in test_paged_decode
========= Error: process didn't terminate successfully
========= Target application returned an error
========= ERROR SUMMARY: 1 error
"""

REFUSED = """\
========= COMPUTE-SANITIZER
========= Error: Device not supported. Please refer to the "Supported Devices" section of the sanitizer documentation
E   RuntimeError: CUDA error: unknown error (999)
1 failed in 3.10s
========= ERROR SUMMARY: 1 error
"""


def parse(text: str, returncode: int | None = 0, timed_out: bool = False) -> dict:
    return sanitize.parse_run(text, returncode, timed_out)


# -- parsers -------------------------------------------------------------------------------------------------

def test_a_clean_memcheck_run():
    r = parse(MEMCHECK_CLEAN)
    assert (r["errors"], r["hazards"], r["passed"], r["failed"], r["skipped"]) == (0, None, 61, 0, 1)
    assert r["clean"] and not r["crashed"] and not r["timed_out"] and r["first_errors"] == []


def test_memcheck_errors_are_counted_and_grouped():
    r = parse(MEMCHECK_ERRORS, returncode=1)
    assert (r["errors"], r["passed"], r["failed"]) == (3, 30, 2) and not r["clean"]
    # two threads at one instruction are one report; the API error its own; pytest's '=====' bars and the
    # sanitizer's trailer are none
    (write, api) = r["first_errors"]
    assert write["count"] == 2 and api["count"] == 1
    assert write["lines"][0] == "========= Invalid __global__ write of size 16 bytes"
    assert "thread (128,0,0)" in write["lines"][2]  # the first report's own lines are kept
    assert len(write["lines"]) == sanitize.REPORT_LINES  # 6 lines + 40 host frames, cut at 40
    assert api["lines"][0].startswith("========= Program hit cudaErrorLaunchFailure")


def test_racecheck_analysis_reports_hazards_errors_and_warnings():
    r = parse(RACECHECK_ANALYSIS)
    assert r["hazards"] == {"displayed": 2, "errors": 1, "warnings": 1}
    assert r["errors"] == 1 and r["passed"] == 14 and not r["clean"]
    error, warning = r["first_errors"]
    assert error["lines"][0].startswith("========= Error: Race reported between Write access")
    assert error["lines"][1].endswith("[256 hazards]")
    assert warning["lines"][0].startswith("========= Warning: Race reported")


def test_a_clean_racecheck_run():
    r = parse(RACECHECK_CLEAN)
    assert r["hazards"] == {"displayed": 0, "errors": 0, "warnings": 0} and r["errors"] == 0 and r["clean"]


def test_racecheck_hazard_reports_of_one_instruction_are_one():
    r = parse(RACECHECK_HAZARDS)
    assert r["errors"] == 2 and r["hazards"]["displayed"] == 2
    (only,) = r["first_errors"]
    assert only["count"] == 2 and "block (3,0,0)" in only["lines"][0]


def test_a_timed_out_run_keeps_what_pytest_printed():
    r = parse(TIMED_OUT, returncode=-2, timed_out=True)
    assert r["timed_out"] and not r["crashed"] and not r["clean"]
    assert (r["errors"], r["passed"], r["failed"]) == (None, 12, 0)
    assert sanitize.summary_line({**r, "tool": "memcheck", "file": "f.py", "selection": "", "seconds": 300.4}) \
        == "memcheck  TIMEOUT errors ?  12 passed 0 failed 0 skipped  300s  f.py"


def test_a_crashed_pytest():
    r = parse(CRASHED, returncode=139)
    assert r["crashed"] and not r["clean"] and r["errors"] == 1
    assert (r["passed"], r["failed"], r["skipped"]) == (None, None, None)
    assert [e["lines"][0] for e in r["first_errors"]] == ["========= Error: process didn't terminate successfully"]


def test_a_refused_device_is_noted():
    r = parse(REFUSED, returncode=1)
    assert r["note"] == sanitize.REFUSED and not r["clean"]
    assert "note" not in parse(MEMCHECK_CLEAN)


def test_summaries_of_several_processes_add_up():
    # --target-processes all: the vLLM tests' worker processes report too
    text = MEMCHECK_CLEAN.replace("========= ERROR SUMMARY: 0 errors", "========= ERROR SUMMARY: 2 errors\n"
                                  "========= ERROR SUMMARY: 1 error\n========= ERROR SUMMARY: 0 errors")
    assert parse(text)["errors"] == 3
    assert sanitize.sanitizer_summary("no sanitizer here\n") == (None, None)
    # a racecheck that also printed an ERROR SUMMARY: its hazards' errors are not lost under a 0
    both = RACECHECK_ANALYSIS + "========= ERROR SUMMARY: 0 errors\n"
    assert sanitize.sanitizer_summary(both) == (1, {"displayed": 2, "errors": 1, "warnings": 1})


@pytest.mark.parametrize("line,counts", [
    ("61 passed, 1 skipped in 412.38s (0:06:52)", (61, 0, 1)),
    ("============ 3 failed, 10 passed, 2 skipped, 4 warnings in 12.34s ============", (10, 3, 2)),
    ("1 error in 0.73s", (0, 1, 0)),
    ("2 passed, 1 xfailed, 5 deselected in 1.00s", (2, 0, 1)),
    ("no tests ran in 0.84s", (0, 0, 0)),
])
def test_pytest_summary_lines(line, counts):
    c = sanitize.pytest_counts(f"....\nDecoded 64 prompts in 2.5s\n{line}\n========= ERROR SUMMARY: 0 errors\n")
    assert (c["passed"], c["failed"], c["skipped"]) == counts


def test_no_pytest_summary_and_the_report_cap():
    assert sanitize.pytest_counts("64 prompts in 2.5s\n") is None  # an application's line is no pytest summary
    many = "".join(f"========= Invalid __shared__ read of size 4 bytes\n=========     at k{i}()+0x10 in a.cuh:{i}\n"
                   "=========\n" for i in range(12))
    assert len(sanitize.error_reports(many)) == sanitize.MAX_REPORTS


# -- what --files selects ------------------------------------------------------------------------------------

def test_lists_split_outside_brackets():
    assert sanitize.split_list("gemm, decode::test_x[a,b],,") == ["gemm", "decode::test_x[a,b]"]


def test_targets_groups_names_and_node_ids():
    files = sanitize.gpu_test_files()
    fast, vllm = sanitize.group("fast"), sanitize.group("vllm")
    assert fast and vllm and sorted(fast + vllm) == files and all("/test_vllm_" in f for f in vllm)
    assert [t.file for t in sanitize.targets(["all"])] == files
    got = sanitize.targets(["gemm,tests/gpu/test_decode.py::test_a", "test_decode.py::test_b[x,y]", "decode::test_a"])
    assert got == [sanitize.Target("tests/gpu/test_gemm.py"),
                   sanitize.Target("tests/gpu/test_decode.py", ("test_a", "test_b[x,y]"))]
    assert got[1].pytest_args() == ["tests/gpu/test_decode.py::test_a", "tests/gpu/test_decode.py::test_b[x,y]"]
    with pytest.raises(ValueError, match=r"--files: 'gemmm' names no file under tests/gpu \(known: .*gemm"):
        sanitize.targets(["gemmm"])


def test_selection_words_and_whole_files():
    t = sanitize.Target("tests/gpu/test_decode.py", ("test_a[x]",))
    assert sanitize.selection_of(sanitize.Target(t.file), None, False, []) == ""
    assert sanitize.selection_of(t, "not graph", True, ["--maxfail=1"]) == \
        "'::test_a[x]' -k 'not graph' --quick --maxfail=1"
    assert sanitize.whole_file("") and sanitize.whole_file("--quick")
    assert not sanitize.whole_file("'::test_a[x]'") and not sanitize.whole_file("-k 'not graph'")


# -- the budget -----------------------------------------------------------------------------------------------

class FakeRuns:
    """A runner that takes `seconds[file]` of a fake clock (at most the timeout it is given) and prints `text[file]`."""

    def __init__(self, seconds: dict, text: dict | None = None):
        self.seconds, self.text, self.now, self.calls = seconds, text or {}, 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, tool, target, left):
        self.calls.append((tool, target.file, left))
        took = min(self.seconds[target.file], left)
        self.now += took
        return sanitize.Outcome(self.text.get(target.file, MEMCHECK_CLEAN), 0, took, took < self.seconds[target.file])


def plan(*files, tool="memcheck"):
    return [(tool, sanitize.Target(f), "") for f in files]


def test_the_budget_stops_new_runs_and_lists_them():
    fake = FakeRuns({"a": 100, "b": 900, "c": 10, "d": 10})
    seen = []
    records, not_run = sanitize.sanitize(plan("a", "b", "c", "d"), fake, 500, seen.append, fake.clock)
    # each run is offered what is left less the kill's time; b times out there (380 s), leaving 20 s: fewer than
    # MIN_RUN_SECONDS, so c and d are not started
    assert fake.calls == [("memcheck", "a", 480), ("memcheck", "b", 380)]
    assert [r["file"] for r in records] == ["a", "b"] and seen == records
    assert [r["timed_out"] for r in records] == [False, True]
    assert [(r["file"], r["reason"]) for r in not_run] == [("c", "budget: 20s of --max-seconds 500 left"),
                                                          ("d", "budget: 20s of --max-seconds 500 left")]
    assert list(records[0]) == ["tool", "file", "selection", "errors", "hazards", "passed", "failed", "skipped",
                                "timed_out", "crashed", "returncode", "clean", "seconds", "first_errors"]


def test_a_refused_device_stops_the_call():
    fake = FakeRuns({"a": 5, "b": 5}, {"a": REFUSED})
    records, not_run = sanitize.sanitize(plan("a", "b"), fake, 500, clock=fake.clock)
    assert [r["file"] for r in records] == ["a"] and records[0]["note"] == sanitize.REFUSED
    assert not_run == [{"tool": "memcheck", "file": "b", "selection": "", "reason": sanitize.REFUSED}]


# -- the results file -----------------------------------------------------------------------------------------

def entry(tool, file, selection="", commit="new", **kw):
    return {"commit": commit, "tool": tool, "file": file, "selection": selection, **kw}


def test_merge_replaces_the_same_key_and_keeps_the_rest():
    old = {"runs": [entry("memcheck", "t/b.py", commit="old", errors=5), entry("racecheck", "t/b.py", commit="old"),
                    entry("memcheck", "t/b.py", "-k x", commit="old"), entry("memcheck", "t/a.py", commit="old")],
           "not_run": [entry("memcheck", "t/c.py", commit="old"), entry("initcheck", "t/a.py", commit="old"),
                       entry("memcheck", "t/d.py", commit="old")]}
    doc = sanitize.merge(old, [entry("memcheck", "t/b.py", errors=0), entry("memcheck", "t/c.py", errors=0)],
                         [entry("initcheck", "t/a.py")])
    assert [(r["tool"], r["file"], r["selection"], r["commit"]) for r in doc["runs"]] == [
        ("memcheck", "t/a.py", "", "old"), ("memcheck", "t/b.py", "", "new"), ("memcheck", "t/b.py", "-k x", "old"),
        ("racecheck", "t/b.py", "", "old"), ("memcheck", "t/c.py", "", "new")]
    # c ran: no longer listed as not run; a's initcheck is listed anew; d stays
    assert [(r["tool"], r["file"], r["commit"]) for r in doc["not_run"]] == [("initcheck", "t/a.py", "new"),
                                                                           ("memcheck", "t/d.py", "old")]
    assert old["runs"][0]["errors"] == 5  # input untouched


def test_still_to_run_counts_whole_file_runs_at_this_commit():
    files = sanitize.gpu_test_files()
    doc = {"runs": [entry("memcheck", files[0]), entry("memcheck", files[1], "--quick"),
                    entry("memcheck", files[2], "-k x"), entry("memcheck", files[3], commit="old")]}
    assert sanitize.still_to_run(doc, ["memcheck", "racecheck"], "new") == {"memcheck": files[2:],
                                                                           "racecheck": files}


# -- the command line -----------------------------------------------------------------------------------------

@pytest.fixture
def cli(tmp_path, monkeypatch):
    """main() with a fake runner: the output of each file's run from `outputs` (default clean), no nvidia-smi."""
    monkeypatch.setattr(sanitize, "commit_of_tree", lambda: "c0ffee")
    monkeypatch.setattr(sanitize, "device_name", lambda: "NVIDIA H200")
    results = tmp_path / "sanitizer.json"
    calls = []

    def run(argv, outputs=None):
        def runner(command, env, timeout, log):
            calls.append((command, env, timeout))
            name = next(Path(a.split("::")[0]).name for a in command if a.startswith("tests/gpu/"))
            return sanitize.Outcome((outputs or {}).get(name, MEMCHECK_CLEAN), 0, 12.0, False)
        rc = sanitize.main(["--sanitizer", sys.executable, "--results", str(results), *argv], runner)
        return rc, json.loads(results.read_text())

    run.calls = calls
    return run


def test_cli_runs_each_file_and_writes_the_results(cli, capsys, tmp_path):
    rc, doc = cli(["--tool", "memcheck,racecheck", "--files", "gemm,decode::test_a", "-k", "not graph", "--quick",
                   "--racecheck-report", "all", "--log", str(tmp_path / "s.log"), "--", "--maxfail=2"])
    assert rc == 0
    commands = [c for c, _, _ in cli.calls]
    assert [c[2] for c in commands] == ["memcheck", "memcheck", "racecheck", "racecheck"]
    assert commands[0][:5] == [sys.executable, "--tool", "memcheck", "--target-processes", "all"]
    assert commands[0][5:9] == [sys.executable, "-m", "pytest", "-q"]
    assert commands[0][-4:] == ["tests/gpu/test_gemm.py", "-k", "not graph", "--maxfail=2"]
    assert commands[3][5:7] == ["--racecheck-report", "all"] and "--racecheck-report" not in commands[1]
    assert "tests/gpu/test_decode.py::test_a" in commands[1]
    env = cli.calls[0][1]
    assert env["TK_SANITIZE_QUICK"] == "1" and env["TK_SANITIZER"] == "memcheck"
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in env
    assert [(r["tool"], r["file"], r["selection"]) for r in doc["runs"]] == [
        ("memcheck", "tests/gpu/test_decode.py", "::test_a -k 'not graph' --quick --maxfail=2"),
        ("racecheck", "tests/gpu/test_decode.py", "::test_a -k 'not graph' --quick --maxfail=2"),
        ("memcheck", "tests/gpu/test_gemm.py", "-k 'not graph' --quick --maxfail=2"),
        ("racecheck", "tests/gpu/test_gemm.py", "-k 'not graph' --quick --maxfail=2")]
    assert all(r["commit"] == "c0ffee" and r["device"] == "NVIDIA H200" and r["date"].endswith("Z")
               for r in doc["runs"])
    out = capsys.readouterr().out
    assert "== sanitize at c0ffee on NVIDIA H200: 4 runs, 0 not run" in out
    assert "memcheck  clean   errors 0  61 passed 0 failed 1 skipped  12s  tests/gpu/test_gemm.py -k" in out
    assert (tmp_path / "s.log").read_text().count("##### ") == 4


def test_cli_exit_codes_and_resume(cli, capsys):
    rc, doc = cli(["--tool", "memcheck", "--files", "gemm,decode"])
    assert rc == 0 and len(doc["runs"]) == 2
    rc, doc = cli(["--tool", "memcheck", "--files", "gemm,decode,mamba", "--resume"],
                  {"test_mamba.py": MEMCHECK_ERRORS})
    assert rc == 1 and len(cli.calls) == 3  # gemm and decode were done at this commit
    assert [r["errors"] for r in doc["runs"]] == [0, 0, 3]
    still = capsys.readouterr().out.splitlines()[-1]  # "memcheck: tests/gpu files without ...: attention, ..."
    names = still.split(": ")[-1].split(", ")
    assert "attention" in names and not {"gemm", "decode", "mamba"} & set(names)
    rc, _ = cli(["--tool", "memcheck", "--files", "gemm", "--max-seconds", "10"])
    assert rc == 3  # nothing ran: the budget was below MIN_RUN_SECONDS
    rc, _ = cli(["--tool", "memcheck", "--files", "gemm"], {"test_gemm.py": REFUSED})
    assert rc == 2


def test_cli_refuses_bad_arguments(capsys, tmp_path):
    for argv, message in ([["--tool", "memchek"], "--tool must be among memcheck, racecheck, initcheck, synccheck"],
                          [["--tool", "memcheck", "--files", "nope"], "--files: 'nope' names no file under tests/gpu"],
                          [["--files", "gemm"], "the following arguments are required: --tool"]):
        with pytest.raises(SystemExit) as e:
            sanitize.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert sanitize.main(["--tool", "memcheck", "--sanitizer", str(tmp_path / "none")]) == 2
    assert "sanitize: no compute-sanitizer at" in capsys.readouterr().err
    args = sanitize.parse_args(["--tool", "initcheck", "--no-caching-allocator", "--sanitizer-arg=--print-limit=5"])
    assert [t.file for t in args.targets] == sanitize.group("fast") and args.pytest_extra == []
    assert sanitize.run_environment("initcheck", args)["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
    command = sanitize.sanitizer_command("cs", "initcheck", args.targets[0], args)
    assert command[:6] == ["cs", "--tool", "initcheck", "--target-processes", "all", "--print-limit=5"]


# -- the real runner, against a stand-in sanitizer ------------------------------------------------------------

STAND_IN = """\
#!{python}
import signal, sys, time
def interrupted(*_):
    print("12 passed in 1.00s")
    print("========= ERROR SUMMARY: 0 errors", flush=True)
    sys.exit(2)
if "{mode}" == "ignore":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
else:
    signal.signal(signal.SIGINT, interrupted)
print("========= COMPUTE-SANITIZER", flush=True)
time.sleep(0 if "{mode}" == "quick" else 60)
print("3 passed in 0.10s")
print("========= ERROR SUMMARY: 0 errors")
"""


def stand_in(tmp_path: Path, mode: str) -> Path:
    path = tmp_path / f"compute-sanitizer-{mode}"
    path.write_text(STAND_IN.format(python=sys.executable, mode=mode))
    path.chmod(0o755)
    return path


def test_run_with_timeout_interrupts_then_kills(tmp_path, monkeypatch):
    monkeypatch.setattr(sanitize, "GRACE_SECONDS", 1)
    quick = sanitize.run_with_timeout([str(stand_in(tmp_path, "quick"))], dict(os.environ), 30, tmp_path / "q.log")
    assert (quick.returncode, quick.timed_out) == (0, False) and "3 passed" in quick.text
    # past its time the run gets SIGINT: pytest and the sanitizer print their summaries
    late = sanitize.run_with_timeout([str(stand_in(tmp_path, "late"))], dict(os.environ), 1, tmp_path / "l.log")
    assert late.timed_out and late.returncode == 2 and late.seconds < 10
    assert sanitize.parse_run(late.text, late.returncode, True)["passed"] == 12
    # one that ignores SIGINT is killed GRACE_SECONDS later
    stuck = sanitize.run_with_timeout([str(stand_in(tmp_path, "ignore"))], dict(os.environ), 1, tmp_path / "s.log")
    assert stuck.timed_out and stuck.returncode == -9 and stuck.seconds < 10


def test_gpu_check_step_calls_the_runner(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    os.symlink(stand_in(tmp_path, "quick"), fake_bin / "compute-sanitizer")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    step = f"sanitize:memcheck:gemm,based --results {tmp_path / 'r.json'} --max-seconds 100"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), step], env=env, capture_output=True,
                          text=True, timeout=300)
    assert "-> memcheck tests/gpu/test_gemm.py (timeout 80s)" in done.stdout, done.stdout + done.stderr
    assert f"== summary: {step} rc=0" in done.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [(r["file"], r["passed"], r["clean"]) for r in doc["runs"]] == [("tests/gpu/test_based.py", 3, True),
                                                                          ("tests/gpu/test_gemm.py", 3, True)]
    assert (out / "sanitizer.log").read_text().count("##### ") == 2
    assert (out / "sanitizer.json").exists() == (REPO / "bench" / "results" / "sanitizer.json").exists()
