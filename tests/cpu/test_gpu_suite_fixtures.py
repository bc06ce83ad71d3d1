"""Every GPU test's arguments resolve (a fixture or a parametrize of its own) on this CPU machine too: a GPU test is
skipped here before its fixtures are set up, so a lost @parametrize only showed on the GPU host as a setup error."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_COLLECT = """
import sys, pytest
missing = []
class Check:
    def pytest_collection_modifyitems(self, session, config, items):
        for item in items:
            known = item._fixtureinfo.name2fixturedefs
            missing.extend(f"{item.nodeid}: {name}" for name in item.fixturenames if name not in known and name != "request")
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]], plugins=[Check()])
print("MISSING", *missing, sep="\\n")
sys.exit(rc)
"""


def test_gpu_tests_ask_only_for_fixtures_that_exist():
    proc = subprocess.run([sys.executable, "-c", _COLLECT, "tests/gpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    missing = [x for x in proc.stdout.split("MISSING", 1)[1].splitlines() if x.strip()]
    assert not missing, f"GPU tests whose arguments no fixture or parametrize provides: {missing}"
