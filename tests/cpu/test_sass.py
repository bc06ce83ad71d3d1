"""What ptxas made of the built extension's kernels (its SASS; no GPU needed)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import tk_backend

OP = r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T] )?"  # an instruction line's address and optional predicate
GENERIC_ACCESS = re.compile(OP + r"(LD|ST)\.E")


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump") or (shutil.which("nvcc") and str(Path(shutil.which("nvcc")).with_name("cuobjdump")))
    if found and Path(found).exists():
        return found
    try:  # triton ships one
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(bundled) if bundled.exists() else None
    except ImportError:
        return None


@pytest.fixture(scope="module")
def kernels() -> dict[str, list[str]]:
    tool = _cuobjdump()
    ext = sorted(Path(tk_backend.__file__).parent.glob("_C*.so"))
    if tool is None or not ext:
        pytest.skip("needs the built extension and cuobjdump (CUDA toolkit or triton's copy)")
    text = subprocess.run([tool, "-sass", str(ext[0])], capture_output=True, text=True, timeout=600, check=True).stdout
    return {body.split("\n", 1)[0]: body.splitlines() for body in re.split(r"\n\s*Function : ", text)[1:]}


def test_pipeline_kernels_reach_shared_memory_without_generic_loads_and_stores(kernels):
    """lcsf carves its shared memory so that the address space survives: a kernel's plain C++ accesses to its
    scratch compile to LDS/STS. Generic LD/ST (which resolve the space at run time) mean it was lost."""
    pipeline = {name: lines for name, lines in kernels.items() if "lcsf6kernel" in name}
    assert len(pipeline) >= 10, sorted(kernels)[:20]  # gemm, prefill, decode, Based, SSD instantiations
    generic = {name[:120]: sum(bool(GENERIC_ACCESS.match(x)) for x in lines) for name, lines in pipeline.items()}
    assert not any(generic.values()), {k: v for k, v in generic.items() if v}


LOCAL_MEMORY = re.compile(OP + r"(STL|LDL)")


def test_tensor_core_kernels_neither_spill_nor_serialize_their_products(kernels):
    """ptxas's allocation is fragile in the wgmma kernels (docs/findings/prefill.md#colblocks: two more live registers, or a branch around a
    product, and the D=64 prefill consumers spill or serialize). Every kernel that issues wgmma keeps its values in
    registers (no local-memory STL / LDL) and chains a product's k-steps under one WARPGROUP.ARRIVE: a serialized
    pipeline (ptxas C7515) fences every HGMMA with its own."""
    tensor = {name: lines for name, lines in kernels.items() if any("HGMMA" in x for x in lines)}
    assert len(tensor) >= 10, sorted(kernels)[:20]  # gemm, prefill, decode, Based, SSD instantiations
    spills = {name[:120]: sum(bool(LOCAL_MEMORY.match(x)) for x in lines) for name, lines in tensor.items()}
    assert not any(spills.values()), {k: v for k, v in spills.items() if v}
    fences = {name[:120]: (sum("WARPGROUP.ARRIVE" in x for x in lines), sum("HGMMA" in x for x in lines))
              for name, lines in tensor.items()}  # (fences, products)
    serialized = {k: v for k, v in fences.items() if 2 * v[0] > v[1]}
    assert not serialized, serialized


def test_fp8_query_decode_multiplies_in_fp8(kernels):
    """Decode over an fp8 cache with vLLM's e4m3 query computes Q K^T on the cache's own tiles with e4m3 wgmma
    (QGMMA ... E4M3.E4M3): 16 kernels (D = 64, 128 on 64- and 128-key tiles, 256; bf16 / fp16 out; two schedule
    sources), all decode's (docs/findings/decode.md#decode-fp8-query)."""
    fp8 = [name for name, lines in kernels.items() if any("QGMMA" in x and "E4M3.E4M3" in x for x in lines)]
    assert len(fp8) == 16 and all("decode" in name for name in fp8), [name[:120] for name in fp8]


def test_the_mamba_decode_update_moves_its_state_in_16_byte_accesses_without_local_memory(kernels):
    """The decode update is bound by the bytes it streams (docs/findings/ssd.md#ssd-update-vec): its vector kernels read
    and write each state slice as one 128-bit access and keep everything in registers; the old one-element-a-lane
    kernel (0.14 TB/s at batch 128) took every such row."""
    vec = {name: lines for name, lines in kernels.items() if "ssd_update_vec_kernel" in name}
    assert len(vec) >= 12, sorted(k for k in kernels if "ssd_update" in k)  # {bf16, f16} x {T, float} x 64/128/256
    for name, lines in vec.items():
        assert any("LDG.E.128" in x for x in lines) and any("STG.E.128" in x for x in lines), name[:120]
        assert not any(LOCAL_MEMORY.match(x) for x in lines), name[:120]
