"""A/B of kernel variants in one GPU call: the tree as it is (base) against copies with patches applied.

    python3 scripts/ab.py --family attn_decode [--family ...] [--test tests/gpu/test_decode.py] ab/NAME.patch ...
    python3 scripts/ab.py --rounds 2 ab/NAME.patch=attn_decode ab/OTHER.patch=based \
        --test-for NAME=tests/gpu/test_decode.py --test-for OTHER=tests/gpu/test_based.py
    python3 scripts/ab.py --incremental ...   (variants built in place, one after another: see --incremental)

Make a patch with `git diff main...BRANCH > ab/NAME.patch` (ab/ is not ignored, so it travels with the device
call; ab/README.md has the rules). On the GPU host each variant is copied to /tmp/ab/NAME, patched and built next
to the base (the CPU cores split between the builds); then each variant's --test files run, and each family's
bench runs once per tree, in turn (base, variants, then base again, so that drift shows; --rounds N repeats
variants and base N times and reports medians; --peers-in-base-only times the variants' tk alone and rates them
on the base runs' peers). PATCH=fam1,fam2 times that variant on those families
only (the families run are the union of --family and these); A.patch+B.patch is one variant with both applied. Prints, per case, every
variant's tk time over base's (< 1: the variant is faster) and tk / best peer for each. $OUT/ab/ gets few files
(a device call brings back at most 8): report.txt and runs.json, rewritten after every bench run so that a call
stopped at its limit keeps what finished; build and test logs and each run's own JSON and log stay under --root/runs
(a failure's lines are printed). The bench table of bench/results is not touched.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns("build", "*.so", "__pycache__", ".offline-vllm", ".whl", ".git", "out", "*.egg-info")


def prepare(name: str, patches: list[Path], root: Path) -> Path:
    tree = root / name
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(REPO, tree, ignore=IGNORE)
    for patch in patches:
        subprocess.run(["patch", "-p1", "-s", "-i", str(patch.resolve())], cwd=tree, check=True)
    return tree


def build(tree: Path, jobs: int, log: Path, force: bool = False) -> bool:
    if tree == REPO and not force and any(REPO.glob("tk_backend/_C*.so")):
        return True  # the base is already built (e.g. by this call's editable install)
    env = {**os.environ, "MAX_JOBS": str(jobs)}
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    return proc.returncode == 0


def touches_native(patch: Path) -> bool:
    """Whether a patch changes what the extension is built from (csrc/, setup.py, pyproject.toml)."""
    for line in patch.read_text().splitlines():
        if line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t")[0].strip()
            path = path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path
            if path.startswith("csrc/") or path in ("setup.py", "pyproject.toml"):
                return True
    return False


def build_in_place(patches: list[Path], tree: Path, jobs: int, log: Path) -> bool:
    """--incremental: the variant's extension built in this tree, with its patches applied and then reverted (also
    on failure), so ninja recompiles only the objects the patches touch (setup.py keeps them in build/), with
    every core; the extension lands in `tree`. The caller restores the base's extension afterwards."""
    applied: list[Path] = []
    try:
        for patch in patches:
            subprocess.run(["patch", "-p1", "-s", "-i", str(patch.resolve())], cwd=REPO, check=True)
            applied.append(patch)
        ok = build(REPO, jobs, log, force=True)
        if ok:
            for lib in REPO.glob("tk_backend/_C*.so"):
                shutil.copy2(lib, tree / "tk_backend" / lib.name)
        return ok
    finally:
        for patch in reversed(applied):
            subprocess.run(["patch", "-R", "-p1", "-s", "-i", str(patch.resolve())], cwd=REPO, check=True)


def reuse_extension(tree: Path) -> bool:
    libs = list(REPO.glob("tk_backend/_C*.so"))
    for lib in libs:
        shutil.copy2(lib, tree / "tk_backend" / lib.name)
    return bool(libs)


def run_in(tree: Path, args: list[str], log: Path, timeout: int = 900, env_extra: dict | None = None) -> int:
    """The command's exit status; 124 (as timeout(1) gives) when it ran past `timeout` seconds and was killed."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env_extra or {})}
    with open(log, "a") as f:
        try:
            return subprocess.run([sys.executable, *args], cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nkilled after {timeout} s\n")
            return 124


def rows(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in json.loads(path.read_text())["results"]:
        out.setdefault((r["kernel"], r["case"]), {})[r["impl"]] = r["median_ms"]
    return out


def median_of(runs: list[dict], key: tuple[str, str], impl: str = "tk") -> float | None:
    values = [run[key][impl] for run in runs if key in run and impl in run[key]]
    return statistics.median(values) if values else None


def best_peer(impls: dict[str, float]) -> float | None:
    """The fastest peer's time among a case's impls, or None without a peer."""
    peers = [ms for impl, ms in impls.items() if impl != "tk"]
    return min(peers) if peers else None


def peer_ratio(runs: list[dict], key: tuple[str, str], base_runs: list[dict] | None = None) -> str:
    """Best peer's time over tk's, the median over the runs (each run's ratio from its own peers). Runs that timed
    tk alone (--peers-in-base-only) take the base runs' peers: their median best time over the runs' median tk."""
    ratios = [best_peer(run[key]) / run[key]["tk"] for run in runs
              if key in run and "tk" in run[key] and best_peer(run[key]) is not None]
    if not ratios and base_runs:
        tk = median_of(runs, key)
        best = [ms for run in base_runs if key in run and (ms := best_peer(run[key])) is not None]
        if tk is not None and best:
            return f"{statistics.median(best) / tk:.3f}"
    return f"{statistics.median(ratios):.3f}" if ratios else "-"


def compare(base_runs: list[dict], variants: dict[str, list[dict]]) -> list[str]:
    """base_runs: every base run (before, between rounds, after); variants: each variant's runs (one a round).
    Ratios are medians over the runs; drift is the base's slowest run over its fastest. Cases no base run has come
    last, with the variants' own times."""
    lines = [f"{'case':<46}{'base tk ms':>11}{'drift':>7}  " + "  ".join(f"{n + ' / base':>16}" for n in variants)
             + f"{'tk/peer base':>14}  " + "  ".join(f"{'tk/peer ' + n:>16}" for n in variants)]
    keys = list(dict.fromkeys(k for run in base_runs for k in run if "tk" in run[k]))  # cases the base's tk ran
    for key in keys:
        tks = [run[key]["tk"] for run in base_runs if key in run and "tk" in run[key]]
        if not tks:
            continue
        base_tk = statistics.median(tks)
        drift = max(tks) / min(tks)
        ratio = []
        for n in variants:
            v = median_of(variants[n], key)
            ratio.append(f"{v / base_tk:.3f}" if v is not None else "-")
        lines.append(f"{key[0] + ':' + key[1]:<46}{base_tk:>11.4f}{drift:>7.3f}  " + "  ".join(f"{r:>16}" for r in ratio)
                     + f"{peer_ratio(base_runs, key):>14}  "
                     + "  ".join(f"{peer_ratio(variants[n], key, base_runs):>16}" for n in variants))
    # Cases only a variant's tk runs (a shape the base refuses; the base's peers may have run it): its median tk ms
    # in place of the ratio, and its tk / peer from its own runs' peers, or the base runs' when it timed tk alone.
    for key in dict.fromkeys(k for runs in variants.values() for run in runs for k in run if k not in keys):
        ms = [median_of(variants[n], key) for n in variants]
        if all(v is None for v in ms):
            continue
        lines.append(f"{key[0] + ':' + key[1]:<46}{'-':>11}{'-':>7}  "
                     + "  ".join(f"{f'{v:.4f} ms' if v is not None else '-':>16}" for v in ms)
                     + f"{peer_ratio(base_runs, key):>14}  "
                     + "  ".join(f"{peer_ratio(variants[n], key, base_runs):>16}" for n in variants))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patches", nargs="+", help="PATCH, PATCH+PATCH (both applied), each optionally =family1,family2")
    parser.add_argument("--family", action="append", default=[])
    parser.add_argument("--test", action="append", default=[], help="pytest files each variant must pass first")
    parser.add_argument("--test-for", action="append", default=[], metavar="NAME=PYTEST_FILE",
                        help="a pytest file only variant NAME must pass first")
    parser.add_argument("--test-timeout", type=int, default=120,
                        help="seconds a variant's test file may run: past it (a kernel that hangs, e.g. on a "
                             "semaphore) the variant counts as failed and the others go on, within the call's limit "
                             "(test_attention / test_decode take ~10 s; a hung variant would otherwise spend the whole call)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/ab"))
    parser.add_argument("--incremental", action="store_true",
                        help="build the native variants one after another in this tree (each patch applied, "
                             "built, reverted: ninja recompiles only what it touches, with every core) instead of "
                             "each in its own copy from scratch, the cores split between them")
    parser.add_argument("--peers-in-base-only", action="store_true",
                        help="variants time tk alone (TK_BENCH_IMPLS=tk; the decode bench then skips its read "
                             "ceiling): their tk / peer uses the base runs' peers, interleaved with them in the "
                             "same call. About a third less bench time a round where the peers cost what tk does")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time base, variants, base ... this many times over (short kernels whose time is "
                             "bimodal from process to process); the ratios are medians over the rounds")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp")) / "ab"
    out.mkdir(parents=True, exist_ok=True)
    run_dir = args.root / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    patches, families_of = {}, {}
    for spec in args.patches:
        paths, _, fams = spec.partition("=")
        files = [Path(p) for p in paths.split("+")]  # a+b: one variant with both patches applied
        name = "+".join(f.name.removesuffix(".patch") for f in files)
        patches[name] = files
        families_of[name] = fams.split(",") if fams else list(args.family)
    families = list(dict.fromkeys(args.family + [f for fams in families_of.values() for f in fams]))
    if not families:
        parser.error("no family to time: give --family or PATCH=family")
    tests_of = {n: list(args.test) for n in patches}
    for spec in args.test_for:
        name, _, test = spec.partition("=")
        tests_of.setdefault(name, []).append(test)
    trees = {n: prepare(n, p, args.root) for n, p in patches.items()}
    native = [n for n in trees if any(touches_native(p) for p in patches[n])]
    base_built = any(REPO.glob("tk_backend/_C*.so"))  # then build() returns at once for the base
    jobs = max(1, (os.cpu_count() or 16) // max(1, len(native) + (0 if base_built else 1)))
    if args.incremental:
        cores = os.cpu_count() or 16
        built = {"base": build(REPO, cores, run_dir / "build_base.log")}
        saved = args.root / "_base_extension"
        if saved.exists():
            shutil.rmtree(saved)
        saved.mkdir(parents=True)
        libs = list(REPO.glob("tk_backend/_C*.so")) if built["base"] else []
        for lib in libs:
            shutil.copy2(lib, saved / lib.name)
        try:
            for n in native:
                built[n] = built["base"] and build_in_place(patches[n], trees[n], cores, run_dir / f"build_{n}.log")
        finally:  # the base's own extension back in place (its sources are back already)
            for lib in libs:
                shutil.copy2(saved / lib.name, lib)
    else:
        with ThreadPoolExecutor(len(native) + 1) as pool:
            names = ["base", *native]
            built = dict(zip(names, pool.map(lambda n: build(REPO if n == "base" else trees[n], jobs,
                                                             run_dir / f"build_{n}.log"), names)))
    for n in trees:  # a Python-only variant imports the base's extension: no second build
        if n not in native:
            built[n] = built["base"] and reuse_extension(trees[n])
    print("built:", built, flush=True)
    for n, ok in built.items():  # the why, here: only report.txt and runs.json come back from the call
        log = run_dir / f"build_{n}.log"
        if not ok and log.exists():
            errors = [x for x in log.read_text().splitlines() if "error" in x.lower()][:12]
            print(f"{n}: build failed" + "".join(f"\n  | {x[:300]}" for x in errors), flush=True)
    trees = {n: t for n, t in trees.items() if built[n]}
    if not built["base"]:
        print("the base does not build: see", run_dir / "build_base.log")
        return 1
    for n, tree in [("base", REPO), *trees.items()]:  # each tree imports its own build
        found = subprocess.run([sys.executable, "-c", "import tk_backend; print(tk_backend.__file__)"], cwd=tree,
                               env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
        print(f"{n}: tk_backend from {found.stdout.strip() or found.stderr[-300:]}", flush=True)
    for n, tree in list(trees.items()):
        for test in tests_of.get(n, []):
            rc = run_in(tree, ["-m", "pytest", "-q", "-x", test], run_dir / f"test_{n}.log", timeout=args.test_timeout)
            print(f"{n}: {test} rc={rc}", flush=True)
            if rc != 0:  # the why, here: the device call may not bring every log back
                failed = [x for x in (run_dir / f"test_{n}.log").read_text().splitlines() if x.strip()]
                print("\n".join(f"  | {x[:300]}" for x in failed[-12:]), flush=True)
                trees.pop(n)  # a variant that fails its tests is not timed
                break
    # base_slots[i]: the i-th base run of every family (families merged); variant_slots[n][r]: round r of n.
    base_slots: list[dict] = []
    variant_slots: dict[str, list[dict]] = {}
    report: list[str] = []
    for fam in families:
        runs = [(n, t) for n, t in trees.items() if fam in families_of[n]]
        if not runs:
            continue
        order = [("base", REPO, None)]
        for r in range(args.rounds):
            order += [(n, t, r) for n, t in runs] + [("base", REPO, None)]
        base_index = 0
        for label, tree, round_ in order:
            is_base = round_ is None
            index = base_index if is_base else round_  # the base run's number, or the variant's round
            base_index += is_base
            tag = f"{label}{index}"
            path = run_dir / f"{fam}_{'' if is_base else 'variant_'}{tag}.json"
            log = run_dir / f"bench_{'' if is_base else 'variant_'}{tag}.log"
            rc = run_in(tree, ["scripts/bench.py", "--family", fam, "--out", str(path), "--no-picture"], log,
                        env_extra={"TK_BENCH_IMPLS": "tk"} if args.peers_in_base_only and not is_base else None)
            if rc != 0 or not path.exists():
                tail = [x for x in log.read_text().splitlines() if x.strip()][-12:] if log.exists() else []
                print(f"{fam} {tag}: bench failed (rc {rc})" + "".join(f"\n  | {x[:300]}" for x in tail), flush=True)
                continue
            _slot(base_slots if is_base else variant_slots.setdefault(label, []), index).update(rows(path))
            print(f"{fam} {tag}: timed", flush=True)
            if base_slots:  # after every run, so that a call stopped at its limit keeps what finished
                report = compare(base_slots, variant_slots)
                (out / "report.txt").write_text("\n".join(report) + "\n")
                (out / "runs.json").write_text(json.dumps(
                    {"base": _plain(base_slots), "variants": {n: _plain(v) for n, v in variant_slots.items()}}))
    if not base_slots:
        return 1
    print("\n".join(report))
    return 0


def _plain(runs: list[dict]) -> list[dict]:
    """runs as JSON takes them: "kernel:case" -> {impl: ms}."""
    return [{f"{k[0]}:{k[1]}": v for k, v in run.items()} for run in runs]


def _slot(runs: list[dict], i: int) -> dict:
    """runs[i], the list grown with empty runs up to it (a failed bench leaves its slot empty)."""
    runs.extend({} for _ in range(i + 1 - len(runs)))
    return runs[i]


if __name__ == "__main__":
    sys.exit(main())
