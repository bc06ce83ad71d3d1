"""The e2e tests' engine launcher (tests/gpu/vllm_harness.py) with stand-in workers: plain Python processes
that write the JSON a vLLM worker would. No GPU, no vLLM."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.gpu import vllm_harness as harness

# Waits until `count` workers have announced themselves in `meet` (so it only finishes in time if they all run
# at once), then notes how many are there, and leaves.
WORKER = """
import json, sys, time
from pathlib import Path
out, meet, count, fail = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
me = meet / Path(out).name
me.touch()
deadline = time.monotonic() + 20
while len(list(meet.iterdir())) < count and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.3)
present = len(list(meet.iterdir()))
if fail:
    sys.exit(3)
Path(out).write_text(json.dumps({"name": Path(out).stem, "together": present >= count, "present": present}))
time.sleep(0.3)  # until the others have looked
me.unlink()
"""


def _job(tmp: Path, name: str, count: int, fail: bool = False):
    out = tmp / f"{name}.json"
    meet = tmp / "meet"
    meet.mkdir(exist_ok=True)
    return out, [sys.executable, "-c", WORKER, str(out), str(meet), str(count), "1" if fail else "0"], {}


def _request(items):
    module = object()
    return SimpleNamespace(module=module,
                           session=SimpleNamespace(items=[SimpleNamespace(module=module, **i) for i in items]))


def _item(jobs, skipped=False):
    return {"jobs": jobs, "get_closest_marker": lambda name: object() if skipped and name == "skip" else None}


def test_prelaunch_runs_every_selected_tests_engines_at_once(tmp_path):
    a, b, c = (_job(tmp_path, n, count=3) for n in "abc")
    skipped = _job(tmp_path, "skipped", count=3)
    request = _request([_item([a, b]), _item([b, c]), _item([skipped], skipped=True)])
    harness.prelaunch(request, lambda item: item.jobs, tmp_path, timeout_s=60)
    for out, _, _ in (a, b, c):  # b once (same out), all three together
        assert json.loads(out.read_text())["together"], out
    assert not skipped[0].exists()
    # A test then finds its results written and starts nothing.
    assert [r["name"] for r in harness.run_workers([a, c], cwd=tmp_path, timeout_s=60)] == ["a", "c"]


def test_prelaunch_leaves_a_failed_engine_to_its_test(tmp_path, capsys):
    good, bad = _job(tmp_path, "good", count=2), _job(tmp_path, "bad", count=2, fail=True)
    harness.prelaunch(_request([_item([good]), _item([bad])]), lambda item: item.jobs, tmp_path, timeout_s=60)
    assert good[0].exists() and not bad[0].exists()
    assert "bad.json worker failed (rc 3)" in capsys.readouterr().out


def test_prelaunch_caps_the_engines_at_once(tmp_path):
    jobs = [_job(tmp_path, n, count=2) for n in "abcd"]
    harness.prelaunch(_request([_item(jobs)]), lambda item: item.jobs, tmp_path, timeout_s=60, at_once=2)
    assert [json.loads(out.read_text())["present"] for out, _, _ in jobs] == [2, 2, 2, 2]


def test_prelaunch_starts_nothing_for_a_single_engine(tmp_path):
    lone = _job(tmp_path, "lone", count=1)
    harness.prelaunch(_request([_item([lone])]), lambda item: item.jobs, tmp_path, timeout_s=60)
    assert not lone[0].exists()  # the test runs it itself
