"""bench/results merging: a run replaces the cases it measured (all their impls) and keeps every other row."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchlib import Row, merged_rows  # noqa: E402


def test_a_run_replaces_its_cases_and_keeps_the_others():
    old = {"commit": "old", "results": [
        {"kernel": "serve", "case": "offline_a", "impl": "tk", "median_ms": 1.0, "commit": "c1"},
        {"kernel": "serve", "case": "offline_a", "impl": "flash_attn", "median_ms": 2.0, "commit": "c1"},
        {"kernel": "serve", "case": "offline_a_tp2", "impl": "tk", "median_ms": 3.0, "commit": "c2"},
        {"kernel": "serve", "case": "offline_a_tp2", "impl": "triton", "median_ms": 3.5, "commit": "c2"},
        {"kernel": "gemm", "case": "4096", "impl": "tk", "median_ms": 0.2},
    ]}
    rows = [Row("serve", "offline_a_tp2", "tk", 4.0), Row("serve", "offline_a_tp2", "flash_attn", 5.0)]
    merged = merged_rows(old, rows, "new")
    by_key = {(r["kernel"], r["case"], r["impl"]): r for r in merged}
    # the tp1 case (same family, not re-run) is kept with its own commit
    assert by_key[("serve", "offline_a", "tk")]["commit"] == "c1"
    assert by_key[("serve", "offline_a", "flash_attn")]["median_ms"] == 2.0
    # the re-run case holds exactly this run's impls: the old triton row of that case is gone
    assert ("serve", "offline_a_tp2", "triton") not in by_key
    assert by_key[("serve", "offline_a_tp2", "tk")] == {"kernel": "serve", "case": "offline_a_tp2", "impl": "tk",
                                                       "median_ms": 4.0, "commit": "new"}
    # a row written before per-row commits takes the file's commit
    assert by_key[("gemm", "4096", "tk")]["commit"] == "old"
    assert old["results"][4] == {"kernel": "gemm", "case": "4096", "impl": "tk", "median_ms": 0.2}  # input untouched
    assert len(merged) == 5


def test_ab_report_gives_variant_over_base_and_the_base_drift():
    import ab

    base = [{("k", "c1"): {"tk": 1.0, "fa3": 0.8}, ("k", "c2"): {"tk": 2.0, "fa3": 2.2}},
            {("k", "c1"): {"tk": 1.02, "fa3": 0.8}, ("k", "c2"): {"tk": 2.0, "fa3": 2.2}}]
    variants = {"pdl": [{("k", "c1"): {"tk": 0.9, "fa3": 0.81}}]}
    header, c1, c2 = ab.compare(base, variants)
    assert "pdl / base" in header
    # median base, drift, ratio, peer / tk (the median over the base runs: 0.8 and 0.784), the variant's
    assert c1.split()[1:6] == ["1.0100", "1.020", "0.891", "0.792", "0.900"]
    assert c2.split()[1:4] == ["2.0000", "1.000", "-"]  # a case the variant did not run


def test_ab_report_lists_cases_only_a_variant_runs():
    import ab

    base = [{("k", "c1"): {"tk": 1.0, "fa3": 0.8}}, {("k", "c1"): {"tk": 1.0, "fa3": 0.8}}]
    variants = {"n256": [{("k", "c1"): {"tk": 1.0}, ("k", "new"): {"tk": 0.17, "triton": 0.34}},
                         {("k", "c1"): {"tk": 1.0}, ("k", "new"): {"tk": 0.19, "triton": 0.36}}],
                "other": [{("k", "c1"): {"tk": 0.9}}]}
    _, c1, new = ab.compare(base, variants)
    assert c1.split()[0] == "k:c1"
    # no base time, no drift; n256's median tk ms, none for other; no base peer; n256's own peer / tk (2.0, 1.895)
    assert new.split() == ["k:new", "-", "-", "0.1800", "ms", "-", "-", "1.947", "-"]
    # the base's peers ran the case but its tk refused it; the variant timed tk alone: rated on the base's peers
    base = [{("k", "c1"): {"tk": 1.0}, ("k", "new"): {"triton": 0.36}},
            {("k", "c1"): {"tk": 1.0}, ("k", "new"): {"triton": 0.34}}]
    _, _, new = ab.compare(base, {"n256": [{("k", "c1"): {"tk": 1.0}, ("k", "new"): {"tk": 0.175}}]})
    assert new.split() == ["k:new", "-", "-", "0.1750", "ms", "-", "2.000"]


def test_ab_report_takes_medians_over_rounds():
    import ab

    base = [{("k", "c"): {"tk": t}} for t in (1.0, 1.1, 0.9)]
    variants = {"v": [{("k", "c"): {"tk": t}} for t in (0.8, 1.2, 0.85)]}
    _, row = ab.compare(base, variants)
    assert row.split()[1:4] == ["1.0000", "1.222", "0.850"]  # median base, slowest / fastest base, median variant


def _write_bench_rows(args: list[str], ms: float) -> None:
    """What a faked `scripts/bench.py --family FAM --out PATH` run writes: one tk row of case "c"."""
    import json

    Path(args[4]).write_text(json.dumps({"results": [{"kernel": args[2], "case": "c", "impl": "tk", "median_ms": ms}]}))


def _ab_with_fake_builds(monkeypatch, tmp_path: Path):
    """scripts/ab.py with $OUT in tmp_path and every build (and reuse of the base's extension) a success."""
    import ab

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(ab, "build", lambda tree, jobs, log: True)
    monkeypatch.setattr(ab, "reuse_extension", lambda tree: True)
    return ab


def _patches_adding_a_file_each(folder: Path, names: tuple[str, ...]) -> None:
    """Patches NAME.patch that each add NAME.txt (the repo's ab/ patches come and go)."""
    folder.mkdir()
    for name in names:
        (folder / f"{name}.patch").write_text(f"--- /dev/null\n+++ b/{name}.txt\n@@ -0,0 +1 @@\n+{name}\n")


def _ab_argv(monkeypatch, tmp_path: Path, variants: dict[str, str], *extra: str) -> None:
    """ab.py's command line for patches NAME=FAMILY (each adding NAME.txt), the extra arguments, and --root
    tmp_path/trees."""
    patches = tmp_path / "patches"
    _patches_adding_a_file_each(patches, tuple(variants))
    monkeypatch.setattr(sys, "argv", ["ab.py", *(f"{patches / name}.patch={fam}" for name, fam in variants.items()),
                                      *extra, "--root", str(tmp_path / "trees")])


def test_ab_builds_only_variants_that_change_the_extension(tmp_path):
    import ab

    python_only = tmp_path / "py.patch"
    python_only.write_text("--- a/tk_backend/schedule.py\n+++ b/tk_backend/schedule.py\n@@ -1 +1 @@\n-a\n+b\n")
    kernel = tmp_path / "k.patch"
    kernel.write_text("diff --git a/csrc/kernels/decode.cu b/csrc/kernels/decode.cu\n"
                      "--- a/csrc/kernels/decode.cu\n+++ b/csrc/kernels/decode.cu\n@@ -1 +1 @@\n-a\n+b\n")
    new_header = tmp_path / "h.patch"
    new_header.write_text("--- /dev/null\n+++ b/csrc/kittens/new.cuh\n@@ -0,0 +1 @@\n+a\n")
    assert not ab.touches_native(python_only)
    assert ab.touches_native(kernel) and ab.touches_native(new_header)
    assert all(ab.touches_native(p) for p in Path(ab.REPO, "ab").glob("*.patch")
               if "+++ b/csrc/" in p.read_text())


def test_ab_runs_each_variant_on_its_families_even_when_named_like_the_base(tmp_path, monkeypatch):
    """Orchestration with the builds and benches faked: a variant whose name starts with "base" is still a variant."""
    ab = _ab_with_fake_builds(monkeypatch, tmp_path)
    ran = []

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        ran.append((tree.name if tree != ab.REPO else "BASE", args[0], args[2] if len(args) > 2 else ""))
        if args[0] == "scripts/bench.py":
            _write_bench_rows(args, 1.0 if tree == ab.REPO else 0.8)
        return 0

    monkeypatch.setattr(ab, "run_in", fake_run)
    _ab_argv(monkeypatch, tmp_path, {"based-step-pipelined": "based", "mask-branchless": "attn_decode"},
             "--test-for", "based-step-pipelined=tests/gpu/test_based.py")
    assert ab.main() == 0
    benches = [(tree, fam) for tree, what, fam in ran if what == "scripts/bench.py"]
    assert benches == [("BASE", "based"), ("based-step-pipelined", "based"), ("BASE", "based"),
                       ("BASE", "attn_decode"), ("mask-branchless", "attn_decode"), ("BASE", "attn_decode")]
    assert ("based-step-pipelined", "-m", "-q") in ran  # its test ran before its bench
    root = tmp_path / "trees"
    assert (root / "mask-branchless" / "mask-branchless.txt").exists()  # each variant's tree has its patch
    assert not (root / "mask-branchless" / "based-step-pipelined.txt").exists()
    report = (tmp_path / "ab" / "report.txt").read_text().splitlines()
    assert "based-step-pipelined / base" in report[0] and "mask-branchless / base" in report[0]
    assert report[1].split()[:4] == ["based:c", "1.0000", "1.000", "0.800"]
    assert report[2].split()[:5] == ["attn_decode:c", "1.0000", "1.000", "-", "0.800"]


def test_ab_peers_in_base_only_times_variants_alone_and_rates_them_on_the_base_peers(tmp_path, monkeypatch):
    """--peers-in-base-only: each variant run sees TK_BENCH_IMPLS=tk, the base runs everything; a variant's tk / peer
    is the base runs' median best peer over the variant's median tk."""
    import json

    ab = _ab_with_fake_builds(monkeypatch, tmp_path)
    envs = []

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        if args[0] == "scripts/bench.py":
            envs.append((tree == ab.REPO, env_extra))
            alone = (env_extra or {}).get("TK_BENCH_IMPLS") == "tk"
            rows = [{"kernel": args[2], "case": "c", "impl": "tk", "median_ms": 1.0 if tree == ab.REPO else 0.8}]
            if not alone:
                rows.append({"kernel": args[2], "case": "c", "impl": "vllm_fa3", "median_ms": 0.9})
            Path(args[4]).write_text(json.dumps({"results": rows}))
        return 0

    monkeypatch.setattr(ab, "run_in", fake_run)
    _ab_argv(monkeypatch, tmp_path, {"v": "attn_decode"}, "--peers-in-base-only")
    assert ab.main() == 0
    assert envs == [(True, None), (False, {"TK_BENCH_IMPLS": "tk"}), (True, None)]
    row = (tmp_path / "ab" / "report.txt").read_text().splitlines()[1].split()
    assert row == ["attn_decode:c", "1.0000", "1.000", "0.800", "0.900", "1.125"]  # 0.9 / 0.8: the base's peer


def test_ab_incremental_builds_each_variant_in_place_then_restores_the_base(tmp_path, monkeypatch):
    """--incremental: each native variant's patch is applied to the tree, built there (ninja's objects reused),
    its extension copied to the variant's copy, the patch reverted; the base's extension is back at the end."""
    import ab

    repo = tmp_path / "repo"
    (repo / "tk_backend").mkdir(parents=True)
    (repo / "csrc").mkdir()
    lib = repo / "tk_backend" / "_C.so"
    lib.write_text("base")
    monkeypatch.setattr(ab, "REPO", repo)
    monkeypatch.setenv("OUT", str(tmp_path))
    seen = []

    def fake_build(tree, jobs, log, force=False):
        assert tree == repo, "an incremental build runs in the tree itself"
        if force:  # a variant: the tree holds its patch (and no other) while it builds
            present = sorted(f.name for f in (repo / "csrc").glob("*.txt"))
            seen.append(present)
            lib.write_text("built with " + ",".join(present))
        return True

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        if args[0] == "scripts/bench.py":
            _write_bench_rows(args, 1.0)
        return 0

    monkeypatch.setattr(ab, "build", fake_build)
    monkeypatch.setattr(ab, "run_in", fake_run)
    patches = tmp_path / "patches"
    patches.mkdir()
    for name in ("one", "two"):
        (patches / f"{name}.patch").write_text(f"--- /dev/null\n+++ b/csrc/{name}.txt\n@@ -0,0 +1 @@\n+{name}\n")
    root = tmp_path / "trees"
    monkeypatch.setattr(sys, "argv", ["ab.py", f"{patches / 'one.patch'}=gemm", f"{patches / 'two.patch'}=gemm",
                                      "--incremental", "--root", str(root)])
    assert ab.main() == 0
    assert seen == [["one.txt"], ["two.txt"]]
    assert (root / "one" / "tk_backend" / "_C.so").read_text() == "built with one.txt"
    assert (root / "two" / "tk_backend" / "_C.so").read_text() == "built with two.txt"
    assert lib.read_text() == "base" and not list((repo / "csrc").glob("*.txt"))


def test_ab_rounds_interleave_variants_and_base(tmp_path, monkeypatch):
    ab = _ab_with_fake_builds(monkeypatch, tmp_path)
    ran, variant_ms = [], iter([0.7, 0.9, 0.8])

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        if args[0] == "scripts/bench.py":
            ran.append(tree.name if tree != ab.REPO else "BASE")
            _write_bench_rows(args, 1.0 if tree == ab.REPO else next(variant_ms))
        return 0

    monkeypatch.setattr(ab, "run_in", fake_run)
    _ab_argv(monkeypatch, tmp_path, {"v": "gemm"}, "--rounds", "3")
    assert ab.main() == 0
    assert ran == ["BASE", "v", "BASE", "v", "BASE", "v", "BASE"]
    report = (tmp_path / "ab" / "report.txt").read_text().splitlines()
    assert report[1].split()[:4] == ["gemm:c", "1.0000", "1.000", "0.800"]  # the median of 0.7, 0.9, 0.8


def test_ab_report_holds_the_families_finished_before_a_stop(tmp_path, monkeypatch):
    """A call stopped at its limit mid-way (here: the second family's variant bench blows up) keeps the report of
    every run already timed."""
    ab = _ab_with_fake_builds(monkeypatch, tmp_path)

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        if args[0] == "scripts/bench.py":
            if args[2] == "attn_decode" and tree != ab.REPO:
                raise subprocess.TimeoutExpired(args, timeout)
            _write_bench_rows(args, 1.0 if tree == ab.REPO else 0.9)
        return 0

    monkeypatch.setattr(ab, "run_in", fake_run)
    _ab_argv(monkeypatch, tmp_path, {"first": "based", "second": "attn_decode"})
    with pytest.raises(subprocess.TimeoutExpired):
        ab.main()
    report = (tmp_path / "ab" / "report.txt").read_text().splitlines()
    assert report[1].split()[:4] == ["based:c", "1.0000", "1.000", "0.900"]
    assert report[2].split()[:4] == ["attn_decode:c", "1.0000", "1.000", "-"]  # its base ran, its variant did not
    assert len(report) == 3


def test_ab_keeps_its_out_folder_small_and_its_report_current_after_every_run(tmp_path, monkeypatch):
    """A device call brings back only so many files: $OUT/ab holds the report and runs.json (rewritten after every
    run, so a stop mid-family keeps the finished runs), no per-run JSON, log or picture; bench.py is told not to
    draw."""
    import json

    ab = _ab_with_fake_builds(monkeypatch, tmp_path)
    calls = []

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        if args[0] == "scripts/bench.py":
            calls.append(args)
            if len(calls) == 4:  # the second round's variant run: the call is stopped there
                raise subprocess.TimeoutExpired(args, timeout)
            _write_bench_rows(args, 1.0 if tree == ab.REPO else 0.5)
        return 0

    monkeypatch.setattr(ab, "run_in", fake_run)
    _ab_argv(monkeypatch, tmp_path, {"v": "gemm"}, "--rounds", "2")
    with pytest.raises(subprocess.TimeoutExpired):
        ab.main()
    assert all("--no-picture" in args for args in calls)
    assert sorted(f.name for f in (tmp_path / "ab").iterdir()) == ["report.txt", "runs.json"]
    runs = json.loads((tmp_path / "ab" / "runs.json").read_text())
    assert runs == {"base": [{"gemm:c": {"tk": 1.0}}, {"gemm:c": {"tk": 1.0}}], "variants": {"v": [{"gemm:c": {"tk": 0.5}}]}}
    assert (tmp_path / "ab" / "report.txt").read_text().splitlines()[1].split()[:4] == ["gemm:c", "1.0000", "1.000",
                                                                                       "0.500"]


def test_ab_run_in_kills_a_command_past_its_timeout(tmp_path):
    """A hung test (a kernel waiting on a semaphore forever) must not take the whole GPU call with it."""
    import ab

    log = tmp_path / "t.log"
    assert ab.run_in(tmp_path, ["-c", "import time; time.sleep(30)"], log, timeout=1) == 124
    assert "killed after 1 s" in log.read_text()
    assert ab.run_in(tmp_path, ["-c", "raise SystemExit(3)"], log, timeout=30) == 3


def test_ab_drops_a_variant_whose_test_times_out(tmp_path, monkeypatch):
    ab = _ab_with_fake_builds(monkeypatch, tmp_path)
    benched, timeouts = [], []

    def fake_run(tree, args, log, timeout=900, env_extra=None):
        if args[0] == "-m":  # pytest: the "hung" variant's test runs past its limit
            timeouts.append(timeout)
            log.write_text(f"killed after {timeout} s\n" if tree.name == "hung" else "1 passed\n")
            return 124 if tree.name == "hung" else 0
        benched.append(tree.name if tree != ab.REPO else "BASE")
        _write_bench_rows(args, 1.0 if tree == ab.REPO else 0.9)
        return 0

    monkeypatch.setattr(ab, "run_in", fake_run)
    _ab_argv(monkeypatch, tmp_path, {"hung": "gemm", "fine": "gemm"}, "--test", "tests/gpu/test_gemm.py",
             "--test-timeout", "77")
    assert ab.main() == 0
    assert timeouts == [77, 77]
    assert benched == ["BASE", "fine", "BASE"]


def test_profile_serve_summary_splits_gpu_time(tmp_path):
    """scripts/profile_serve.py's reading of a torch-profiler trace: busy = union of kernel intervals."""
    import json

    import profile_serve

    events = [{"cat": "kernel", "name": "void kittens::lcsf::kernel<attn_prefill<bf16, 128>>", "ts": 0, "dur": 10},
              {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 5, "dur": 20},  # overlaps the first
              {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 40, "dur": 10},
              {"cat": "kernel", "name": "flash::FlashAttnFwdSm90", "ts": 60, "dur": 5},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 2},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 3, "dur": 1},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 7, "dur": 1},
              {"cat": "gpu_user_annotation", "name": "execute_context_0(0)_generation_8(8)", "ts": 0, "dur": 30},
              {"cat": "gpu_user_annotation", "name": "execute_context_2(2048)_generation_6(6)", "ts": 40, "dur": 25}]
    import os

    rank0 = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json"
    rank1 = tmp_path / "dp0_pp0_tp1_dcp0_ep0_rank1.2.pt.trace.json"
    rank0.write_text(json.dumps({"traceEvents": events}))
    rank1.write_text(json.dumps({"traceEvents": events[:1]}))
    os.utime(rank1, (rank0.stat().st_mtime + 5, rank0.stat().st_mtime + 5))
    assert profile_serve._rank_traces(tmp_path) == {0: rank0, 1: rank1}
    summary = profile_serve.summarize(rank0, 0.001)
    assert summary["wall_ms"] == 1.0 and summary["kernels"] == 4
    assert summary["launches"] == {"cudaGraphLaunch": 1, "cudaLaunchKernel": 2}
    assert summary["kernel_span_ms"] == 0.065 and summary["gpu_busy_ms"] == 0.04
    assert abs(summary["gpu_idle_ms"] - 0.025) < 1e-12
    assert summary["attention_ms"] == 0.015 and summary["other_kernels_ms"] == 0.03
    assert summary["top"][0] == ("sm90_xmma_gemm_bf16", 0.03, 2, [10, 20, 20])
    assert summary["steps"] == {"decode": (1, 0.0, [30, 30, 30]), "mixed": (1, 0.0, [25, 25, 25])}
    assert profile_serve.summarize(rank1, 0.001)["kernels"] == 1


def _run_snippet_on_cpu(snippet: str, entry_points: list[str], monkeypatch) -> list[tuple[str, tuple]]:
    """Run an ncu_pair snippet on the CPU with tk_backend's named entry points replaced by checks that the call
    binds to the real signature; returns (entry point, shape of the first argument) per call."""
    import inspect
    import types

    import torch

    import tk_backend

    calls = []

    def checked(real):
        def call(*args, **kwargs):
            inspect.signature(real).bind(*args, **kwargs)
            calls.append((real.__name__, tuple(args[0].shape)))
        return call

    fake = types.SimpleNamespace(**{name: checked(getattr(tk_backend, name)) for name in entry_points})
    monkeypatch.setitem(sys.modules, "tk_backend", fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    exec(snippet.replace('"cuda"', '"cpu"'), {})
    return calls


@pytest.mark.parametrize("side", ["paper", "serving"])
def test_ncu_pair_ssd_snippet_calls_the_scan_as_its_signature_allows(side, monkeypatch):
    """The ncu driver's SSD snippet, run on the CPU with the two scan entry points replaced by signature checks."""
    import ncu_pair

    calls = _run_snippet_on_cpu(ncu_pair.SSD.format(repo=".", side=side),
                                ["mamba_chunk_scan_combined", "mamba_chunk_scan_varlen"], monkeypatch)
    assert [name for name, _ in calls] == [("mamba_chunk_scan_combined" if side == "paper"
                                            else "mamba_chunk_scan_varlen")] * 4


def test_ncu_pair_gemm_snippet_calls_gemm_as_its_signature_allows(monkeypatch):
    import ncu_pair

    calls = _run_snippet_on_cpu(ncu_pair.GEMM.format(repo=".", side="tk", shape=(64, 32, 16)), ["gemm"], monkeypatch)
    assert calls == [("gemm", (64, 16))] * 4


# A stand-in for serve.py's worker, with its protocol: a "ready" reply, then a reply a case line; "quit" ends.
# argv: ORDER_LOG IMPL FAIL_AT --replies PATH. It appends "IMPL CASE" to ORDER_LOG as it runs a case, and
# crashes at its FAIL_AT-th case (0: never).
_FAKE_SERVE_WORKER = """
import json, sys, time
order_log, impl, fail_at, replies = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
print("a vLLM log line on stdout", flush=True)
with open(replies, "a") as f:
    f.write(json.dumps({"ready": True}) + "\\n")
n = 0
for line in sys.stdin:
    case = line.strip()
    if case == "quit":
        break
    n += 1
    if n == fail_at:
        sys.exit(3)
    with open(order_log, "a") as f:
        f.write(f"{impl} {case}\\n")
    time.sleep(0.01)
    with open(replies, "a") as f:
        f.write(json.dumps({"case": case, "seconds": 0.5 + n / 100, "tokens": 7}) + "\\n")
"""


def test_serve_bench_interleaves_the_engines_runs(tmp_path):
    """One engine at a time, every case once per engine a round, the order rotating; a crashed engine is left
    out and the others carry on."""
    import os

    from benches import serve

    script, order_log = tmp_path / "fake_worker.py", tmp_path / "order.log"
    script.write_text(_FAKE_SERVE_WORKER)
    engines = [serve.Engine(impl, [sys.executable, str(script), str(order_log), impl, str(fail_at)],
                            dict(os.environ), tmp_path) for impl, fail_at in (("a", 0), ("b", 0), ("c", 4))]
    try:
        runs = serve.interleaved_runs(engines, ["x", "y"], repeats=3)
    finally:
        for e in engines:
            e.close()
    order = order_log.read_text().splitlines()
    assert order[:6] == ["a x", "b x", "c x", "a y", "b y", "c y"]  # round 0
    assert order[6:9] == ["b x", "c x", "a x"]  # round 1 starts at b; c crashes at its 4th case (y)
    assert order[9:11] == ["b y", "a y"]  # c is out
    assert order[11:] == ["a x", "b x", "a y", "b y"]  # round 2 of the two left
    assert sorted(runs) == ["a", "b"]
    assert all(len(runs[impl][case]) == 3 for impl in runs for case in ("x", "y"))
    assert runs["a"]["x"][0] == (0.51, 7)
    assert all(e.proc.poll() is not None for e in engines)


def test_tune_gemm_labels_name_the_three_knobs():
    import tune_gemm

    assert tune_gemm.parse("s3l0g8") == {"TK_GEMM_STAGES": 3, "TK_GEMM_LAG": 0, "TK_GEMM_GROUP_ROWS": 8}
    with pytest.raises(SystemExit, match="s4l1g16"):
        tune_gemm.parse("stages3")


def test_tune_gemm_rounds_report_medians_per_variant(monkeypatch, capsys):
    import json as json_module

    import tune_gemm

    runs = iter([1.0, 1.3, 1.1, 1.2, 1.2, 1.4])  # tk / cublas of (round, variant): s4 1.0 1.1 1.2, s3 1.3 1.2 1.4
    env_seen = []

    def fake_run(cmd, env, check, stdout):
        env_seen.append((env["TK_GEMM_STAGES"], env.get("TK_GEMM_CASES")))
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json_module.dumps({"results": [
            {"case": "4096x4096x64", "impl": "tk", "tflops": next(runs)},
            {"case": "4096x4096x64", "impl": "cublas", "tflops": 1.0}]}))

    monkeypatch.setattr(tune_gemm.subprocess, "run", fake_run)
    monkeypatch.setenv("TK_GEMM_CASES", "4096x4096x64")
    monkeypatch.setattr(sys, "argv", ["tune_gemm.py", "s4l1g16", "s3l1g16", "--rounds", "3"])
    assert tune_gemm.main() == 0
    assert env_seen == [("4", "4096x4096x64"), ("3", "4096x4096x64")] * 3  # interleaved, the case filter passed on
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["4096x4096x64", "1.100", "1.300"]  # medians
    assert table[3].split() == ["4096x4096x64", "0.200", "0.200"]  # ranges


def test_gemm_bench_runs_only_the_cases_named(monkeypatch):
    from benches import gemm as gemm_bench

    monkeypatch.setattr(gemm_bench, "copies_to_defeat_l2", lambda per_set: 0)  # no inputs allocated
    monkeypatch.setattr(gemm_bench, "time_per_call", lambda call, sets: 1.0)
    monkeypatch.setattr(gemm_bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("TK_GEMM_CASES", "4096x4096x64,4096x4096x4096_nt")
    rows = gemm_bench.run()
    assert [(r.case, r.impl) for r in rows] == [("4096x4096x64", "tk"), ("4096x4096x64", "cublas"),
                                                ("4096x4096x4096_nt", "tk"), ("4096x4096x4096_nt", "cublas")]
    monkeypatch.setenv("TK_GEMM_CASES", "4096x4096x63")
    with pytest.raises(SystemExit, match="does not have"):
        gemm_bench.run()


def test_mamba2_cases_are_selected_by_kernel_and_case(monkeypatch):
    from benches import mamba2

    monkeypatch.setenv("TK_BENCH_CASES", "mamba2_update:,varlen8")
    assert mamba2._wanted("mamba2_update", "b128_h80_p64_s128_g1")
    assert mamba2._wanted("mamba2_ssd", "varlen8_h80_p64_s128_g1_c256_8k")
    assert not mamba2._wanted("mamba2_ssd", "b16_h16_n1024_p64_s64_g1_c64")
    monkeypatch.delenv("TK_BENCH_CASES")
    assert mamba2._wanted("mamba2_ssd", "b16_h16_n1024_p64_s64_g1_c64")


def test_mamba2_timing_skips_a_failing_peer_but_not_tk(monkeypatch):
    from benches import mamba2

    monkeypatch.setattr(mamba2, "time_per_call", lambda call, sets: 0.5)
    row = mamba2._timed("mamba2_update", "c", "tk", None, 1, 10**9)  # 1 GB in 0.5 ms: 2 TB/s
    assert (row.impl, row.median_ms, row.tbps) == ("tk", 0.5, 2.0)

    def differs():
        raise ValueError("differs from tk's")

    skipped = mamba2._timed("mamba2_update", "c", "vllm_triton", None, 1, 10**6, differs)
    assert isinstance(skipped, str) and "vllm_triton" in skipped and "differs" in skipped
    with pytest.raises(ValueError):
        mamba2._timed("mamba2_update", "c", "tk", None, 1, 10**6, differs)


def test_decode_multi_layer_steps_read_a_cache_a_layer_where_one_would_stay_in_l2():
    import torch

    from benches import decode

    small = torch.zeros(512, 16, 8, 128, dtype=torch.bfloat16)  # 16.8 MB: b8 x 1k tokens
    layers = decode._layer_caches(small, 4)
    assert isinstance(layers, list) and len(layers) == 4 and layers[0] is small
    assert all(c.shape == small.shape and c.dtype == small.dtype for c in layers)
    assert layers[1].data_ptr() != layers[2].data_ptr()
    assert decode._layer_caches(small, 1) is small
    big = torch.zeros(4096, 16, 8, 128, dtype=torch.bfloat16)  # 134 MB (a K and a V: past the 128 MiB bound)
    assert decode._layer_caches(big, 32) is big
    assert decode._per_layer(big) == [big] and decode._per_layer(layers) is layers
    fp8 = decode._layer_caches(small.to(torch.float8_e4m3fn), 2)
    assert [c.dtype for c in fp8] == [torch.float8_e4m3fn] * 2


def test_short_calls_get_interleaved_rounds_and_long_ones_one():
    from benchlib import time_impls

    order = []
    speed = {"tk": [0.010, 0.012, 0.011, 0.030, 0.009], "peer": [0.015, 0.014, 0.016, 0.013, 0.020]}

    def timer(call, sets):
        order.append(call)
        return speed[call].pop(0)

    def broken(call, sets):
        raise RuntimeError("cannot run")

    errors = []
    timed = time_impls({"tk": "tk", "peer": "peer"}, 1, timer=timer)
    # one round each, then four more, each round starting one impl later
    assert order == ["tk", "peer", "peer", "tk", "tk", "peer", "peer", "tk", "tk", "peer"]
    assert timed["tk"].median_ms == 0.011 and timed["tk"].min_ms == 0.009 and timed["tk"].max_ms == 0.030
    assert timed["tk"].extra() == {"rounds": 5, "min_ms": 0.009, "max_ms": 0.030}
    assert timed["peer"].median_ms == 0.015
    order.clear()
    speed = {"tk": [0.5], "peer": [0.6]}
    timed = time_impls({"tk": "tk", "peer": "peer"}, 1, timer=timer)
    assert order == ["tk", "peer"] and timed["tk"].rounds == 1 and timed["tk"].extra() == {}
    timed = time_impls({"tk": "tk"}, 1, timer=broken, on_error=lambda impl, exc: errors.append((impl, str(exc))))
    assert timed == {} and errors == [("tk", "cannot run")]
    # a later round's failure leaves that impl out, the others timed
    speed = {"tk": [0.010, 0.011, 0.012, 0.013, 0.014], "peer": [0.015]}

    def peer_fails_later(call, sets):
        if call == "peer" and not speed["peer"]:
            raise RuntimeError("out of memory")
        return speed[call].pop(0)

    errors.clear()
    timed = time_impls({"tk": "tk", "peer": "peer"}, 1, timer=peer_fails_later,
                       on_error=lambda impl, exc: errors.append((impl, str(exc))))
    assert list(timed) == ["tk"] and timed["tk"].rounds == 5 and errors == [("peer", "out of memory")]
