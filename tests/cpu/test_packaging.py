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


def _setup_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tk_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the helpers, builds nothing
    return module


def _fake_compiler(tmp_path: Path, prints: str) -> str:
    script = tmp_path / "cxx"
    script.write_text(f"#!/bin/sh\necho '{prints}'\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("found", ["bare", "dangling", "present"])
def test_setup_keeps_libstdcxx_shared_when_the_compiler_would_link_it_statically(tmp_path, monkeypatch, found):
    """A compiler with no usable libstdc++.so (the GPU host's: a dangling link) links libstdc++.a into the extension,
    whose second C++ runtime crashes the first error message that prints a number; setup.py then names the shared
    runtime itself, and adds nothing where the driver links it shared anyway."""
    present = tmp_path / "libstdc++.so"
    present.write_text("")
    dangling = tmp_path / "gone" / "libstdc++.so"
    prints = {"bare": "libstdc++.so", "dangling": str(dangling), "present": str(present)}[found]
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, prints))
    flags = _setup_module()._shared_libstdcxx()
    assert flags == ([] if found == "present" else ["-l:libstdc++.so.6"])


def test_the_built_extension_links_the_shared_cxx_runtime():
    """The symptom's check: tk_backend._C needs libstdc++.so.6 rather than carrying a copy of it."""
    built = sorted((ROOT / "tk_backend").glob("_C*.so"))
    if not built:
        pytest.skip("tk_backend._C is not built in place (scripts/setup_env.sh builds it)")
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", str(built[0])], capture_output=True, text=True, timeout=60).stdout
    assert "[libstdc++.so.6]" in dynamic, f"{built[0].name} does not link libstdc++ shared:\n{dynamic}"
