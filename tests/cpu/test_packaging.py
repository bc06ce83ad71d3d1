"""The package as pip installs it: a wheel of the tree holds the extension, the tuned decode configs and py.typed,
and an installed copy (not the source tree) reads its own configs.

Building the wheel links the objects that the in-place build (scripts/setup_env.sh: `pip install -e .`) left in
build/temp.* (setup.py keeps them there), so it takes seconds; without them it would compile tk_backend._C from
scratch, and the tests skip instead.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _skip_reason() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if shutil.which("nvcc") is None and not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return "nvcc not found: building a wheel builds tk_backend._C"
    if not list((ROOT / "tk_backend").glob("_C*.so")):
        return "tk_backend._C is not built in place (scripts/setup_env.sh builds it)"
    if not list(ROOT.glob("build/temp.*/csrc")):
        return ("no compiled objects in build/temp.* to link (`pip install --no-build-isolation --no-deps -e .` "
                "leaves them); the wheel would compile tk_backend._C from scratch")
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("tk_backend-*.whl")
    return built


def test_the_wheel_holds_the_extension_configs_and_type_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("tk_backend/_C") and n.endswith(".so")], names
    for path in ("tk_backend/configs/h200.json", "tk_backend/py.typed"):
        assert path in names, f"{path} is not in {wheel.name}"


def test_an_installed_copy_reads_its_own_configs(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "import tk_backend\n"
        "from tk_backend import _C, decode_plan\n"
        "print(json.dumps({'package': tk_backend.__file__, 'extension': _C.__file__,\n"
        "                  'configs': str(decode_plan.CONFIG_DIR),\n"
        "                  'buckets': len(decode_plan.device_config('NVIDIA H200'))}))\n"
    )
    cwd = tmp_path / "elsewhere"  # not the source tree, whose tk_backend/ would shadow the installed one
    cwd.mkdir()
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("package", "extension", "configs"):
        assert Path(found[key]).resolve().is_relative_to(target.resolve()), found
    assert found["buckets"] > 0, found
