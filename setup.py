"""Build tk_backend._C: the kittens kernels for sm_90a, compiled against the installed torch.

    pip install --no-build-isolation -e .

A machine without nvcc, or with a torch that has no CUDA, gets one sentence saying so.
"""
from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _fail(msg: str) -> None:
    sys.stderr.write(f"\ntk_backend: {msg}\n\n")
    sys.exit(1)


def _find_cuda_home() -> None:
    """Point CUDA_HOME at a toolkit that has headers (an `nvcc` on PATH may be a wrapper script)."""
    if os.environ.get("CUDA_HOME"):
        return
    candidates = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")) and os.path.exists(
            os.path.join(home, "bin", "nvcc")
        ):
            os.environ["CUDA_HOME"] = home
            return


def _shared_libstdcxx() -> list[str]:
    """Link flags that keep libstdc++ a shared library. A compiler whose libstdc++.so development link is missing or
    dangling (the GPU host's /opt/gcc wrapper: libstdc++.so -> a libstdc++.so.6 that is not there) links libstdc++.a
    into the extension instead: a second copy of the C++ runtime in torch's process, whose stream facets are never
    set up, so the first error message that formats a number kills the process with SIGSEGV
    (docs/findings/serving.md#fp8-binding-segv). Then name the runtime's shared object itself."""
    cxx = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "g++")
    try:
        found = subprocess.run([*cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):  # exists() follows the link: the driver links it shared
        return []
    sys.stderr.write(f"tk_backend: {cxx[0]} has no usable libstdc++.so (found {found!r}); linking -l:libstdc++.so.6 "
                     "so that libstdc++ stays shared\n")
    return ["-l:libstdc++.so.6"]


def _extension():
    _find_cuda_home()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _fail("PyTorch (>= 2.11, a CUDA build) must be installed before building; then run "
              "`pip install --no-build-isolation -e .`.")
    if torch.version.cuda is None:
        _fail(f"the installed torch {torch.__version__} has no CUDA support; install a CUDA build of torch >= 2.11.")
    if cpp_extension.CUDA_HOME is None or not (
        shutil.which("nvcc") or os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    ):
        _fail("nvcc was not found (set CUDA_HOME or put the CUDA 12.4+ toolkit's bin/ on PATH) "
              "and it is needed to compile the sm_90a kernels.")
    # Only Hopper's arch-specific target: wgmma and setmaxnreg exist on sm_90a alone.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    sources = sorted(glob.glob("csrc/bindings/*.cpp")) + sorted(glob.glob("csrc/kernels/*.cu"))
    nvcc_flags = [
        "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DNDEBUG",
        "-gencode=arch=compute_90a,code=sm_90a", "-diag-suppress=186,177",
    ]
    if os.environ.get("TK_PTXAS_VERBOSE"):
        nvcc_flags.append("-Xptxas=-v")
    ninja_build = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExtension(ninja_build):
        """Objects always in build/temp.<platform>-<python> (pip's editable builds would use a throwaway directory),
        so ninja recompiles only what changed: a wheel built after `pip install -e .` only links."""

        def finalize_options(self) -> None:
            super().finalize_options()
            plat = self.get_finalized_command("build").plat_name
            self.build_temp = os.path.join(HERE, "build", f"temp.{plat}-{sys.implementation.cache_tag}")

    return cpp_extension.CUDAExtension(
        name="tk_backend._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": ["-std=c++20", "-O3", "-DNDEBUG"], "nvcc": nvcc_flags},
        extra_link_args=_shared_libstdcxx(),
    ), BuildExtension


if __name__ == "__main__":  # pip's build backend runs it as __main__; tests import its helpers
    _ext, _build = _extension()
    setup(ext_modules=[_ext], cmdclass={"build_ext": _build})
