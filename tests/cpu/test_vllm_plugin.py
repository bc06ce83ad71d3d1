"""The vLLM plugin on CPU: registration and name resolution (fork, spawn, CLI), validation hooks and the refusals'
sentences, the KV cache views, metadata building (causal, bidirectional and encoder-only batches) and, with the
float32 references standing in for the kernels, the forward pass of a simulated serving run (prefill, chunked
prefill over a cached prefix, decode, speculative verification, CUDA-graph padding; attention sinks, head sizes
between the kernel tiles, bidirectional decoders, encoder-only layers) and its head slicing under tensor
parallelism.

Runs against whichever vLLM is installed (scripts/install_cpu_vllm.sh installs 0.33.0 without its GPU
libraries); skipped when vLLM is not importable.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_cpu_vllm.sh installs it)")

from vllm.config import AttentionConfig  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import tk_backend.vllm as tk_vllm  # noqa: E402
from tk_backend import attention, reference  # noqa: E402
from tk_backend.vllm import backend as tk_vllm_backend  # noqa: E402
from tk_backend.vllm import compat  # noqa: E402
from tk_backend.vllm import metadata as tk_vllm_metadata  # noqa: E402
from tk_backend.vllm.backend import TKAttentionBackend, TKAttentionImpl, kv_cache_views  # noqa: E402
from tk_backend.vllm.metadata import (  # noqa: E402
    MIN_SPLIT_DECODES,
    TKAttentionMetadataBuilder,
    leading_single_token_requests,
    step_block_table,
    uniform_decode_shape,
)
from tests.vllm_sim import (  # noqa: E402
    FP8_SCALES,
    ServingSimulation,
    builder,
    common_metadata,
    encoder_only_batch,
    vllm_allocated_cache,
)

CPU_ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _run_python(code: str, stdin: bytes = b"", env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, env=env or CPU_ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    return proc.stdout.decode()


# ------------------------------------------------------------------------------------------ registration


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    values = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert values.get("tk_backend") == "tk_backend.vllm:register"


def test_register_is_idempotent_and_makes_tk_an_alias_of_custom():
    AttentionBackendEnum.CUSTOM.clear_override()
    tk_vllm.register()
    tk_vllm.register()
    assert AttentionBackendEnum["TK"] is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_class() is TKAttentionBackend
    assert TKAttentionBackend.get_name() == "TK"
    # The alias adds a name, not a member: iteration and pickling see only CUSTOM.
    assert [m.name for m in AttentionBackendEnum].count("CUSTOM") == 1
    assert "TK" not in [m.name for m in AttentionBackendEnum]
    assert pickle.loads(pickle.dumps(AttentionBackendEnum["TK"])) is AttentionBackendEnum.CUSTOM


@pytest.mark.parametrize("name", ["TK", "tk", "CUSTOM", "custom"])
def test_attention_config_names_select_the_tk_backend(name):
    config = AttentionConfig(backend=name)
    assert config.backend is AttentionBackendEnum.CUSTOM
    assert config.backend.get_class() is TKAttentionBackend
    # What EngineArgs does with LLM(..., attention_backend=name) and --attention-backend name.
    assert AttentionConfig.validate_backend_before(name) is AttentionBackendEnum.CUSTOM


def test_cli_flag_resolves_in_a_fresh_process_through_the_entry_point():
    # No tk_backend import here: vLLM's parser loads general plugins, which is what makes "TK" known.
    out = _run_python(
        # The parser's defaults need a platform; vLLM 0.26 cannot be told it is on a CPU, so set one.
        "import vllm.platforms as platforms\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "platforms._current_platform = CpuPlatform()\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "from vllm.config import AttentionConfig\n"
        "parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        "args = parser.parse_args(['--model', 'm', '--attention-backend', 'TK'])\n"
        "print('RESULT', AttentionConfig.validate_backend_before(args.attention_backend).name)\n"
        "args = parser.parse_args(['--model', 'm', '--attention-config', '{\"backend\": \"tk\"}'])\n"
        "print('RESULT', args.attention_config.backend.get_class().__name__)\n"
    )
    results = [line.split()[1] for line in out.splitlines() if line.startswith("RESULT ")]
    assert results == ["CUSTOM", "TKAttentionBackend"]


def test_selection_survives_a_spawned_process_that_has_not_loaded_plugins_yet():
    """vLLM unpickles its config in a spawned engine/worker before it loads plugins there."""
    payload = pickle.dumps(AttentionConfig(backend="TK"))
    out = _run_python(
        "import pickle, sys\n"
        "config = pickle.loads(sys.stdin.buffer.read())\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "assert config.backend is E.CUSTOM, config.backend\n"
        "assert 'tk_backend' not in sys.modules and 'TK' not in E.__members__\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "assert E['TK'] is E.CUSTOM\n"
        "print('RESULT', config.backend.get_class().__name__)\n",
        stdin=payload,
    )
    assert "RESULT TKAttentionBackend" in out.splitlines()


def _resolve_in_child(queue, payload: bytes) -> None:
    config = pickle.loads(payload)
    queue.put((config.backend.name, config.backend.get_class().__name__))


def test_selection_survives_a_forked_process():
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_resolve_in_child, args=(queue, pickle.dumps(AttentionConfig(backend="TK"))))
    proc.start()
    result = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and result == ("CUSTOM", "TKAttentionBackend")


# ---------------------------------------------------------------------------------------- validation


def _selector(**overrides) -> dict:
    config = dict(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=False,
        has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0), attn_type="decoder", has_sliding_window=False,
    )
    config.update(overrides)
    return config


@pytest.mark.parametrize(
    "overrides",
    [{}, {"head_size": 64}, {"head_size": 256, "dtype": torch.float16}, {"has_sliding_window": True},
     {"block_size": 32}, {"kv_cache_dtype": "bfloat16"},
     {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3", "head_size": 64},  # FP8 (e4m3) KV caches
     {"head_size": 96}, {"head_size": 8}, {"head_size": 200},  # Phi-3's 96: every multiple of 8 up to 256
     {"has_sink": True, "head_size": 64, "has_sliding_window": True},  # gpt-oss
     {"has_sink": True, "head_size": 128}, {"has_sink": True, "head_size": 256},
     {"use_non_causal": True}, {"use_non_causal": True, "has_sliding_window": True},
     {"attn_type": "encoder_only", "head_size": 64},  # BERT-like embedding models
     {"attn_type": "encoder_only", "head_size": 96, "has_sliding_window": True}],
)
def test_validation_accepts_supported_configurations(overrides):
    assert TKAttentionBackend.validate_configuration(**_selector(**overrides)) == []
    assert TKAttentionBackend.configuration_refusals(**_selector(**overrides)) == []


@pytest.mark.parametrize(
    "overrides,reason",
    [
        ({"head_size": 100}, "head_size 100 is not supported (TK: multiples of 8 up to 256)"),
        ({"head_size": 264}, "head_size 264 is not supported (TK: multiples of 8 up to 256)"),
        ({"dtype": torch.float32}, "dtype float32 is not supported (TK: bfloat16, float16)"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype fp8_e5m2 is not supported (TK reads "
                                         "auto/bfloat16/float16/fp8/fp8_e4m3 caches: e5m2 is refused, as FLASH_ATTN "
                                         "(FA3) refuses it; use --kv-cache-dtype fp8)"),
        ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype fp8_inc is not supported"),
        ({"block_size": 8}, "block_size 8 is not supported (TK pages: 16, 32, 64, 128, 256 tokens)"),
        ({"device_capability": DeviceCapability(10, 0)},
         "compute capability sm_100 is not supported (TK kernels: sm_90, Hopper)"),
        ({"device_capability": DeviceCapability(8, 0)}, "compute capability sm_80 is not supported"),
        ({"attn_type": "encoder_decoder"},
         "attention type encoder_decoder is not supported (TK: decoder self-attention and encoder-only attention; "
         "no encoder-decoder cross attention)"),
        ({"attn_type": "encoder"}, "attention type encoder is not supported"),
        ({"use_mla": True}, "MLA (use_mla=True) is not supported (TK: multi-head, grouped-query and multi-query "
                            "attention)"),
        ({"has_sink": True, "head_size": 96},
         "attention sinks at head_size 96 are not supported (TK's sink kernels: head sizes 64, 128, 256)"),
        ({"has_sink": True, "head_size": 80}, "attention sinks at head_size 80 are not supported"),
        ({"use_sparse": True}, "sparse attention (use_sparse=True) is not supported (TK: dense attention)"),
        ({"use_mm_prefix": True}, "bidirectional attention over multimodal prefix tokens (use_mm_prefix=True)"),
        ({"use_per_head_quant_scales": True}, "per-head quantization scales (use_per_head_quant_scales=True)"),
        ({"use_batch_invariant": True}, "batch-invariant mode (VLLM_BATCH_INVARIANT=1) is not supported"),
        ({"use_pcp": True}, "prefill context parallelism (prefill_context_parallel_size > 1) is not supported (TK: "
                            "tensor parallelism only)"),
    ],
)
def test_validation_refuses_with_a_reason(overrides, reason):
    reasons = TKAttentionBackend.configuration_refusals(**_selector(**overrides))
    assert any(reason in r for r in reasons), reasons


def test_a_refusal_is_one_sentence_that_names_tk_not_custom():
    """vLLM's selector would say "Selected backend AttentionBackendEnum.CUSTOM is not valid" (the member TK is
    registered as): validate_configuration raises TK's own sentence instead, which vLLM lets through."""
    with pytest.raises(tk_vllm_backend.TKUnsupportedError) as refused:
        TKAttentionBackend.validate_configuration(**_selector(head_size=100, kv_cache_dtype="fp8_e5m2"))
    assert str(refused.value) == (
        "the TK attention backend (--attention-backend TK) cannot run this model: head_size 100 is not supported "
        "(TK: multiples of 8 up to 256); kv_cache_dtype fp8_e5m2 is not supported (TK reads "
        "auto/bfloat16/float16/fp8/fp8_e4m3 caches: e5m2 is refused, as FLASH_ATTN (FA3) refuses it; use "
        "--kv-cache-dtype fp8); choose another backend, for example --attention-backend FLASH_ATTN"
    )
    assert isinstance(refused.value, ValueError)  # what vLLM's own refusal raises
    assert "CUSTOM" not in str(refused.value) and str(refused.value).count(". ") == 0
    # Positional arguments too (vLLM passes keywords today).
    with pytest.raises(tk_vllm_backend.TKUnsupportedError, match="attention sinks at head_size 96"):
        TKAttentionBackend.validate_configuration(*_selector(head_size=96, has_sink=True).values())


def test_sinks_head_sizes_are_refused_through_supports_combination():
    """Both vLLM releases ask supports_sink() and then supports_combination(..., has_sink, ...)."""
    assert TKAttentionBackend.supports_sink() and TKAttentionBackend.supports_non_causal()
    args = dict(dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=False, use_sparse=False,
                use_mm_prefix=False, device_capability=DeviceCapability(9, 0))
    for head_size in (64, 128, 256):
        assert TKAttentionBackend.supports_combination(head_size=head_size, has_sink=True, **args) is None
    assert "head_size 96" in TKAttentionBackend.supports_combination(head_size=96, has_sink=True, **args)
    assert TKAttentionBackend.supports_combination(head_size=96, has_sink=False, **args) is None
    assert [t for t in ("decoder", "encoder_only", "encoder", "encoder_decoder")
            if TKAttentionBackend.supports_attn_type(t)] == ["decoder", "encoder_only"]


def test_validation_refuses_what_only_newer_vllm_asks_about():
    base = _selector()
    for key, says in [("use_dcp", "decode context parallelism (decode_context_parallel_size > 1) is not supported"),
                      ("use_adaptive_verification", "adaptive speculative verification "
                                                    "(enable_adaptive_verification=True) is not supported"),
                      ("use_rswa", "R-SWA (a model rswa_window) is not supported (TK: plain sliding windows)")]:
        try:
            reasons = TKAttentionBackend.configuration_refusals(**base, **{key: True})
        except TypeError:  # vLLM 0.26 has no such argument; the impl refuses DCP itself (below)
            continue
        assert any(says in r for r in reasons), reasons


def _impl_args(**overrides) -> dict:
    args = dict(num_heads=8, head_size=128, scale=0.1, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto")
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"head_size": 100}, "head_size 100 is not supported (TK: multiples of 8 up to 256)"),
        ({"alibi_slopes": [0.5] * 8}, "ALiBi position biases (8 slopes) are not supported"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype fp8_e5m2 is not supported"),
        ({"attn_type": "encoder"}, "attention type encoder is not supported"),
        ({"attn_type": "encoder_decoder"}, "attention type encoder_decoder is not supported"),
        ({"sinks": torch.zeros(4)}, "attention sinks of shape (4,) are not supported (TK: one per query head, "
                                    "shape (8,))"),
        ({"sinks": torch.zeros(8), "head_size": 96}, "attention sinks at head_size 96 are not supported"),
        ({"use_alibi_sqrt": True}, "layer option use_alibi_sqrt=True is not supported"),
    ],
)
def test_impl_refuses_unsupported_layers(kwargs, reason):
    with pytest.raises(tk_vllm_backend.TKUnsupportedError) as refused:
        TKAttentionImpl(**_impl_args(**kwargs))
    message = str(refused.value)
    assert message.startswith("the TK attention backend (--attention-backend TK) cannot run this model: ")
    assert reason in message
    assert message.endswith("; choose another backend, for example --attention-backend FLASH_ATTN")


@pytest.mark.parametrize(
    "kwargs",
    [{"sinks": torch.zeros(8), "head_size": 64}, {"sinks": torch.zeros(8, dtype=torch.bfloat16), "head_size": 256},
     {"head_size": 96}, {"head_size": 96, "sliding_window": 2047}, {"attn_type": "encoder_only"},
     {"attn_type": "encoder_only", "sinks": torch.zeros(8)}, {"kv_cache_dtype": "fp8"},
     {"kv_cache_dtype": "fp8_e4m3", "sinks": torch.zeros(8), "head_size": 64}],
)
def test_impl_accepts_sinks_head_sizes_and_encoder_only_layers(kwargs):
    impl = TKAttentionImpl(**_impl_args(**kwargs))
    assert impl.encoder_only == (kwargs.get("attn_type") == "encoder_only")
    if "sinks" in kwargs:
        assert impl.kernel_sinks().dtype == torch.float32
        assert torch.equal(impl.kernel_sinks(), kwargs["sinks"].float())


def test_impl_refuses_decode_context_parallelism(monkeypatch):
    def new(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.dcp_world_size, self.pcp_world_size = 2, 1
        return self

    monkeypatch.setattr(TKAttentionImpl, "__new__", new)
    with pytest.raises(NotImplementedError, match=r"decode context parallelism \(decode_context_parallel_size 2\)"):
        TKAttentionImpl(8, 128, 0.1, 2, None, None, "auto")


def test_impl_maps_window_and_softcap():
    impl = TKAttentionImpl(8, 64, 0.1, 2, None, 4096, "auto", 30.0)
    assert impl.window_size == (4095, 0) and impl.softcap == 30.0
    assert impl.bidirectional_window_size == (4095, 4095)  # non-causal batches, as FLASH_ATTN symmetrizes
    impl = TKAttentionImpl(8, 64, 0.1, 2, None, None, "auto", None)
    assert impl.window_size == impl.bidirectional_window_size == (-1, -1) and impl.softcap == 0.0
    impl = TKAttentionImpl(8, 64, 0.1, 2, None, 128, "auto", None, "encoder_only")
    assert impl.window_size == impl.bidirectional_window_size == (127, 127)  # FLASH_ATTN's encoder-only window


def test_kernel_sinks_follow_the_live_parameter():
    """vLLM loads (and may reload) the sinks parameter after the layer is built: no stale copy."""
    sinks = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
    impl = TKAttentionImpl(**_impl_args(head_size=64, sinks=sinks))
    with torch.no_grad():
        sinks.fill_(1.5)
    assert torch.equal(impl.kernel_sinks(), torch.full((8,), 1.5))
    impl.process_weights_after_loading(torch.bfloat16)
    with torch.no_grad():
        sinks.fill_(-2.0)
    assert torch.equal(impl.kernel_sinks(), torch.full((8,), -2.0))


# ------------------------------------------------------------------------------------------ KV layout


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_kv_heads,head_size", [(2, 64), (1, 128), (4, 256)])
def test_kv_cache_views_are_strided_views_of_the_combined_cache(layout, num_kv_heads, head_size):
    num_blocks, block_size = 6, 16
    raw, caches = vllm_allocated_cache(num_blocks, block_size, num_kv_heads, head_size, layout)
    kv = caches[1]
    assert kv.shape == (num_blocks, num_kv_heads, block_size, 2 * head_size)
    k, v = kv_cache_views(kv, head_size)
    assert k.shape == v.shape == (num_blocks, block_size, num_kv_heads, head_size)
    assert k.stride(-1) == v.stride(-1) == 1
    assert v.data_ptr() - k.data_ptr() == head_size * kv.element_size()  # the two halves of each content row
    base, end = raw.data_ptr(), raw.data_ptr() + raw.numel()
    assert base <= k.data_ptr() < end and base <= v.data_ptr() < end  # no copy
    if layout == "NHD":  # [num_blocks, block_size, num_kv_heads, 2*head_size] in memory
        assert k.stride()[:2] == (block_size * num_kv_heads * 2 * head_size, num_kv_heads * 2 * head_size)
    else:  # [num_blocks, num_kv_heads, block_size, 2*head_size]
        assert k.stride(1) == 2 * head_size

    # Writing through the views lands in the combined cache, K in the first half of the content dim.
    k[3, 5, num_kv_heads - 1] = 1.0
    v[3, 5, num_kv_heads - 1] = 2.0
    assert torch.equal(kv[3, num_kv_heads - 1, 5, :head_size], torch.ones(head_size, dtype=kv.dtype))
    assert torch.equal(kv[3, num_kv_heads - 1, 5, head_size:], torch.full((head_size,), 2.0, dtype=kv.dtype))
    assert int(caches[0].count_nonzero()) == 0  # the other layer is untouched

    # The views are what the TK ops accept: paged, unit inner stride, 16-byte aligned offsets and strides.
    assert (v.storage_offset() * v.element_size()) % 16 == 0
    q = torch.empty(3, 2, num_kv_heads * 2, head_size, dtype=kv.dtype, device="meta")
    attention.validate_decode(
        q, _meta_like(k), _meta_like(v), torch.empty(3, dtype=torch.int32, device="meta"),
        torch.empty(3, num_blocks, dtype=torch.int32, device="meta"), None, True, (-1, -1), 0.0, 0, None,
    )


def test_kv_cache_shape_hooks_follow_the_vllm_version():
    if compat.BACKEND_DECLARES_KV_SHAPE:
        from vllm.v1.attention.backends import utils as attn_utils

        assert TKAttentionBackend.get_kv_cache_shape(10, 16, 4, 128) == (10, 4, 16, 256)
        # The same physical orders as vLLM's FlashAttention backend (num_blocks outermost in both layouts).
        for layout, order, layered in [("NHD", (0, 2, 1, 3), (1, 0, 3, 2, 4)), ("HND", (0, 1, 2, 3), (1, 2, 0, 3, 4))]:
            attn_utils.set_kv_cache_layout(layout)
            try:
                assert TKAttentionBackend.get_kv_cache_stride_order() == order
                assert TKAttentionBackend.get_kv_cache_stride_order(True) == layered
            finally:
                attn_utils.set_kv_cache_layout(None)
    else:
        from vllm.v1.attention.backend import AttentionBackend

        assert not hasattr(AttentionBackend, "get_kv_cache_stride_order")
        assert TKAttentionBackend.supported_kv_cache_layouts() is None  # any layout: we read strided views
        with pytest.raises(NotImplementedError):
            TKAttentionBackend.get_kv_cache_stride_order()


# ------------------------------------------------------------------------------------ metadata building


@pytest.mark.parametrize(
    "query_lens,max_query_len,expected",
    [
        ([1, 1, 1], 1, (3, 1)),
        ([4, 4], 4, (2, 4)),
        ([16] * 5, 16, (5, 16)),
        ([1, 1, 0, 0], 1, (4, 1)),  # CUDA-graph padding requests at the end
        ([17, 17], 17, None),  # wider than the decode op
        ([1, 5], 5, None),  # mixed
        ([1, 0, 1], 1, None),  # an empty request in the middle would shift rows
        ([0, 0], 0, None),
        ([37], 37, None),
    ],
)
def test_uniform_decode_shape(query_lens, max_query_len, expected):
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    assert uniform_decode_shape(qsl, max_query_len) == expected


@pytest.mark.parametrize(
    "query_lens,expected",
    [([1, 1, 1], 3), ([1, 1, 5, 1], 2), ([5, 1, 1], 0), ([1, 0], 1), ([2], 0), ([1] * 9 + [300], 9)],
)
def test_leading_single_token_requests(query_lens, expected):
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    assert leading_single_token_requests(qsl) == expected


@pytest.mark.parametrize(
    "query_lens,seq_lens,decode",
    [
        ([1, 1, 1, 1], [9, 30, 1, 100], (4, 1)),  # decode
        ([3, 3], [40, 3], (2, 3)),  # speculative verification
        ([1, 7], [20, 7], None),  # decode + prefill
        ([50, 20], [50, 90], None),  # prefill + chunked prefill over a cached prefix
        ([1, 1, 0], [5, 6, 0], (3, 1)),  # padded for a CUDA graph
    ],
)
def test_builder_chooses_the_decode_op_only_for_uniform_batches(query_lens, seq_lens, decode):
    n = len(query_lens)
    block_table = torch.arange(n * 8, dtype=torch.int32).view(n, 8)
    md = builder().build(0, common_metadata(query_lens, seq_lens, block_table, torch.arange(sum(query_lens))))
    assert md.is_uniform_decode == (decode is not None)
    if decode is not None:
        assert (md.decode_batch, md.decode_query_len) == decode
    assert md.num_actual_tokens == sum(query_lens) and md.max_query_len == max(query_lens)
    assert md.block_table.shape == (n, 8) and md.seq_lens.tolist() == seq_lens
    assert md.query_start_loc.shape == (n + 1,)
    # update_block_table keeps everything else.
    other = builder().update_block_table(md, block_table + 100, torch.zeros(3))
    assert torch.equal(other.block_table, block_table + 100) and other.decode_batch == md.decode_batch
    if decode is not None:  # the same step over the other group's pages
        assert torch.equal(other.decode.block_table, block_table + 100) and other.decode.seq_lens is md.decode.seq_lens
    else:
        assert md.decode is None and other.decode is None


def _layer(sim, md, rows):
    """One more layer of a built step, on fresh queries (the simulation's cache): another decoder layer."""
    q = torch.randn(rows, sim.h, sim.d).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    sim.impl.forward(sim.layer, q, None, None, sim.kv_cache, md, out)
    assert not out.isnan().any()


def test_a_step_plans_once_and_its_layers_reuse_the_schedule(kernels):
    """build() makes the step's DecodeStep; its first layer plans a PagedDecode, whose first run works out the
    schedule, and the step's other layers run that plan, reusing it; the next step plans again. A mixed batch's
    leading decodes alike, and another KV-cache group's metadata (update_block_table) shares the step's plans."""
    sim = ServingSimulation(8, 2, 64, prompt_lens=[20, 30, 40] + [10] * MIN_SPLIT_DECODES)
    n = 3 + MIN_SPLIT_DECODES
    sim.step({r: 10 for r in range(n)})
    kernels.clear()
    md = sim.step({r: 1 for r in range(n)})  # uniform decode
    _layer(sim, md, n)
    _layer(sim, md, n)
    assert kernels.calls == [f"decode({n}, 1)"] * 3 and kernels.reused == [False, True, True]
    assert len(set(map(id, kernels.decode_plans))) == 1
    group = sim.builder.update_block_table(md, md.block_table.clone(), md.slot_mapping)
    _layer(sim, group, n)
    assert kernels.reused[-1] and kernels.decode_plans[-1] is kernels.decode_plans[0]
    kernels.clear()
    md = sim.step({**{r: 1 for r in range(n - 1)}, n - 1: 5})  # mixed: the leading decodes split off
    _layer(sim, md, n - 1 + 5)
    assert kernels.calls == [f"decode({n - 1}, 1)", "varlen"] * 2 and kernels.reused == [False, True]
    assert kernels.decode_plans[0] is kernels.decode_plans[1]


@pytest.mark.parametrize("max_len", [4096, 160])  # a table wider than the contexts; one as wide as they need
def test_warm_up_and_capture_of_one_step_plan_apart(kernels, monkeypatch, max_len):
    """vLLM warms a CUDA graph's batch up eagerly and then captures it with the same metadata: the eager runs read
    step_block_table's columns, the captured ones the whole table, each mode on its own plan, and neither reuses a
    schedule the other mode's runs left in shared buffers (a captured run does not execute at capture)."""
    sim = ServingSimulation(8, 2, 64, prompt_lens=[150, 100], max_len=max_len)
    sim.step({0: 150, 1: 100})
    kernels.clear()
    md = sim.step({0: 1, 1: 1})  # eager warm-up: layer 0
    _layer(sim, md, 2)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    _layer(sim, md, 2)
    _layer(sim, md, 2)
    capturing[0] = False
    _layer(sim, md, 2)
    eager_width = min(16, sim.max_blocks)  # 151 keys: 10 pages, a power of two of them
    assert kernels.decode_table_widths == [eager_width] * 2 + [sim.max_blocks] * 2 + [eager_width]
    eager, captured = kernels.decode_plans[0], kernels.decode_plans[2]
    assert kernels.decode_plans == [eager, eager, captured, captured, eager] and eager is not captured
    # The captured plan of the wide table outgrows the eager plan's buffers: a new buffer set, the eager one untouched.
    shared = eager._pooled is captured._pooled
    assert shared == (max_len == 160)
    assert kernels.reused == [False, True, False, True, not shared]


@pytest.mark.parametrize("decodes,expect_split", [(MIN_SPLIT_DECODES, True), (MIN_SPLIT_DECODES - 1, False)])
def test_builder_splits_mixed_batches_with_enough_leading_decodes(decodes, expect_split):
    query_lens = [1] * decodes + [7, 30]
    seq_lens = [10 + i for i in range(decodes)] + [7, 90]
    n = len(query_lens)
    block_table = torch.arange(n * 8, dtype=torch.int32).view(n, 8)
    md = builder().build(0, common_metadata(query_lens, seq_lens, block_table, torch.arange(sum(query_lens))))
    assert TKAttentionMetadataBuilder.reorder_batch_threshold == 1  # vLLM puts one-token requests first
    assert not md.is_uniform_decode
    if expect_split:
        assert md.num_decodes == decodes
        assert md.prefill_query_start_loc.tolist() == [0, 7, 37]
    else:
        assert md.num_decodes == 0 and md.prefill_query_start_loc is None


def test_cudagraph_support_depends_on_the_decode_width():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = SimpleNamespace(speculative_config=None)
    assert TKAttentionMetadataBuilder.get_cudagraph_support(config, spec) is AttentionCGSupport.UNIFORM_BATCH
    for drafts, support in [(4, AttentionCGSupport.UNIFORM_BATCH),
                            (20, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)]:
        spec_config = SimpleNamespace(num_speculative_tokens=drafts, parallel_drafting=False,
                                      enable_adaptive_verification=False)
        config = SimpleNamespace(speculative_config=spec_config, use_v2_model_runner=True)
        assert TKAttentionMetadataBuilder.get_cudagraph_support(config, spec) is support


def test_cudagraph_support_over_fp8_caches_keeps_wide_verification_eager():
    """Over an FP8 cache, verification steps wider than the decode kernel's 64 rows run on the prefill kernel's
    scratch, which a graph would size for the whole table: they stay eager (q_len 16 x group 8 = 128 rows)."""
    model = SimpleNamespace(get_num_attention_heads=lambda parallel: 16)
    spec_config = SimpleNamespace(num_speculative_tokens=15, parallel_drafting=False,
                                  enable_adaptive_verification=False)
    for drafts, dtype, support in [(15, torch.uint8, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
                                   (15, torch.bfloat16, AttentionCGSupport.UNIFORM_BATCH),
                                   (7, torch.uint8, AttentionCGSupport.UNIFORM_BATCH)]:  # 8 x 8 = 64 rows
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=dtype)
        config = SimpleNamespace(speculative_config=SimpleNamespace(**{**vars(spec_config),
                                                                       "num_speculative_tokens": drafts}),
                                 use_v2_model_runner=True, model_config=model, parallel_config=None)
        assert TKAttentionMetadataBuilder.get_cudagraph_support(config, spec) is support, (drafts, dtype)


@pytest.mark.parametrize("dtype,bounded", [(torch.uint8, True), (torch.bfloat16, False)])
def test_builder_bounds_an_fp8_prefill_scratch_by_the_cpu_lengths(dtype, bounded):
    """FP8 caches: the prefill requests' keys summed from vLLM's CPU lengths size the dequantized scratch."""
    query_lens, seq_lens = [1] * 8 + [7, 30], [10 + i for i in range(8)] + [700, 90]
    n = len(query_lens)
    table = torch.arange(n * 64, dtype=torch.int32).view(n, 64)
    md = builder(dtype=dtype).build(0, common_metadata(query_lens, seq_lens, table, torch.arange(sum(query_lens))))
    assert md.num_decodes == 8 and md.prefill_total_k == (790 if bounded else 0)
    uniform = builder(dtype=dtype).build(0, common_metadata([2] * 3, [9, 40, 2], table[:3], torch.arange(6)))
    assert uniform.decode.total_k_bound == (51 if bounded else 0) and uniform.prefill_total_k == 0


@pytest.mark.parametrize("query_lens,seq_lens,uniform", [([1, 1, 1], [9, 30, 1], True), ([3, 3], [40, 3], True),
                                                     ([1, 7], [20, 7], False)])
def test_builder_keeps_a_bidirectional_batch_bidirectional(query_lens, seq_lens, uniform):
    n = len(query_lens)
    block_table = torch.arange(n * 8, dtype=torch.int32).view(n, 8)
    cm = common_metadata(query_lens, seq_lens, block_table, torch.arange(sum(query_lens)), causal=False)
    md = builder().build(0, cm)
    assert md.causal is False and md.is_uniform_decode == uniform
    assert (md.decode is not None) == uniform and (md.decode is None or md.decode.causal is False)
    assert builder().build(0, common_metadata(query_lens, seq_lens, block_table, torch.arange(sum(query_lens)))).causal
    if uniform:  # another KV-cache group's step stays bidirectional
        other = builder().update_block_table(md, block_table + 1, torch.zeros(3))
        assert other.causal is False and other.decode.causal is False


def test_builder_refuses_per_sequence_causal_tensors():
    cm = common_metadata([4, 4], [4, 4], torch.zeros(2, 1, dtype=torch.int32), torch.arange(8))
    cm.causal = torch.tensor([True, False])
    with pytest.raises(NotImplementedError) as refused:
        builder().build(0, cm)
    assert str(refused.value) == (
        "the TK attention backend takes one causal flag per batch, got a per-sequence causal tensor of shape (2,) "
        "(a batch mixing causal and bidirectional sequences); TK runs a batch either causal or bidirectional: choose "
        "another backend for this model, for example --attention-backend TRITON_ATTN")


@pytest.mark.parametrize("query_lens", [[7, 30, 1], [1, 1, 1], [3, 3]])  # uniform-looking prompts too
def test_builder_of_an_encoder_only_layer_makes_no_decode_plan(query_lens):
    """vLLM's EncoderOnlyAttention wraps the builder (causal False) and gives it the EncoderOnlyAttentionSpec group's
    metadata: a one-column block table of zeros, a slot mapping of zeros, whole prompts."""
    from vllm.model_executor.layers.attention.encoder_only_attention import create_encoder_only_attention_backend
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    backend = create_encoder_only_attention_backend(TKAttentionBackend)
    assert backend.get_name() == "TK" and issubclass(backend, TKAttentionBackend)
    step_builder = builder(spec_cls=EncoderOnlyAttentionSpec, builder_cls=backend.get_builder_cls())
    assert step_builder.encoder_only
    n, total = len(query_lens), sum(query_lens)
    cm = common_metadata(query_lens + [0], query_lens + [0], torch.zeros(n + 1, 1, dtype=torch.int32),
                         torch.zeros(total + 2, dtype=torch.int64), num_tokens=total + 2)
    md = step_builder.build(0, cm)
    assert md.causal is False and md.decode is None and not md.is_uniform_decode and md.num_decodes == 0
    assert md.num_actual_tokens == total + 2 and md.max_query_len == max(query_lens)
    assert md.query_start_loc.tolist() == cm.query_start_loc_cpu.tolist()
    assert cm.causal is True  # the wrapper builds on a copy


# --------------------------------------------------------- forward pass with the references as kernels


class _KernelStandIns:
    """The TK kernels replaced by the float32 references, after the real argument validation (on meta copies):
    varlen in place of flash_attn_varlen_func, and a PagedDecode whose real plan and run go through the ops' fake
    implementations on meta copies before the reference writes out."""

    def __init__(self):
        self.calls: list[str] = []
        self.decode_table_widths: list[int] = []
        self.decode_plans: list[attention.PagedDecode] = []  # each decode run's
        self.reused: list[bool] = []  # each split-kernel launch's reuse_schedule
        self.masks: list[tuple] = []  # each call's (op, causal, window, sinks)
        self.descales: list[tuple] = []  # each call's (op, q_descale, k_descale, v_descale): an FP8 cache's

    def clear(self) -> None:
        for record in (self.calls, self.decode_table_widths, self.decode_plans, self.reused, self.masks,
                       self.descales):
            record.clear()

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, block_table=None, seqused_k=None, out=None,
               return_softmax_lse=False, sinks=None, q_descale=None, k_descale=None, v_descale=None, total_k_bound=0):
        self.descales.append(("varlen", q_descale, k_descale, v_descale))
        meta = [None if t is None else _meta_like(t) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                                                              seqused_k, out, sinks, q_descale, k_descale, v_descale)]
        attention.validate_varlen(meta[0], meta[1], meta[2], meta[3], meta[4], max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, window_size, softcap, meta[5], meta[6], meta[7], *meta[9:])
        attention.validate_sinks(meta[8], meta[0])
        # max_seqlen_* must bound the true lengths: they size the kernel's grid.
        assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
        keys = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        assert int(keys.max()) <= max_seqlen_k
        # An FP8 cache's scratch is sized from total_k_bound: it must bound the keys, and 16-bit caches need none.
        assert (total_k_bound >= int(keys.sum())) if attention.is_fp8_cache(k) else total_k_bound == 0
        self.calls.append("varlen" if block_table is not None else "varlen(no cache)")
        self.masks.append(("varlen", causal, tuple(window_size), sinks))
        o, _ = reference.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                                   softcap, block_table=block_table, seqused_k=seqused_k, sinks=sinks,
                                   q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        out.copy_(o)
        return out

    def paged_decode(self) -> type[attention.PagedDecode]:
        stand_ins = self

        class PagedDecode(attention.PagedDecode):
            def plan(self, cache_seqlens, block_table, **kw):
                self.lengths, self.table = cache_seqlens, block_table
                return super().plan(_meta_like(cache_seqlens), _meta_like(block_table), **kw)

            def run(self, q, k_cache, v_cache, out=None, *, softmax_scale=None, softcap=0.0, block_table=None,
                    return_softmax_lse=False, sinks=None, q_descale=None, k_descale=None, v_descale=None):
                stand_ins.descales.append(("decode", q_descale, k_descale, v_descale))
                table = self.table if block_table is None else block_table
                meta = [None if t is None else _meta_like(t) for t in (q, k_cache, v_cache, out, block_table, sinks,
                                                                      q_descale, k_descale, v_descale)]
                super().run(*meta[:4], softmax_scale=softmax_scale, softcap=softcap, block_table=meta[4],
                            sinks=meta[5], q_descale=meta[6], k_descale=meta[7], v_descale=meta[8])
                stand_ins.calls.append(f"decode{tuple(q.shape[:2])}")
                stand_ins.decode_table_widths.append(table.shape[1])
                stand_ins.decode_plans.append(self)
                stand_ins.masks.append(("decode", self.causal, self.window, sinks))
                o, _ = reference.decode(q, k_cache, v_cache, self.lengths, table, softmax_scale, self.causal,
                                        self.window, softcap, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
                                        v_descale=v_descale)
                out.copy_(o)
                return out

        return PagedDecode

    @staticmethod
    def write_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
        n = slot_mapping.shape[0]  # key/value may carry padding rows past it
        slots = slot_mapping.long()
        keep = slots >= 0
        block_size = key_cache.shape[1]
        blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
        if kv_cache_dtype.startswith("fp8"):  # e4m3 bytes of x / scale, as vLLM's op stores them
            key = (key.float() / k_scale).to(torch.float8_e4m3fn).view(torch.uint8)
            value = (value.float() / v_scale).to(torch.float8_e4m3fn).view(torch.uint8)
        key_cache[blocks, offsets] = key[:n][keep]
        value_cache[blocks, offsets] = value[:n][keep]


@pytest.fixture
def kernels(monkeypatch) -> _KernelStandIns:
    stand_ins = _KernelStandIns()
    monkeypatch.setattr(tk_vllm_backend, "flash_attn_varlen_func", stand_ins.varlen)
    monkeypatch.setattr(tk_vllm_metadata, "PagedDecode", stand_ins.paged_decode())
    monkeypatch.setattr(tk_vllm_metadata, "DEFAULT_DECODE_WORKSPACES", attention.DecodeWorkspacePool())
    monkeypatch.setattr(tk_vllm_backend, "reshape_and_cache_flash", stand_ins.write_cache)
    monkeypatch.setattr(attention, "_device_info", lambda device: (132, "NVIDIA H200"))
    monkeypatch.setattr(attention, "require_kernels", lambda t: None)
    claim = attention.PagedDecode._claim_schedule
    monkeypatch.setattr(attention.PagedDecode, "_claim_schedule",
                        lambda decode: stand_ins.reused.append(claim(decode)) or stand_ins.reused[-1])
    return stand_ins


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 64), (4, 4, 128), (8, 1, 256)])
def test_forward_serves_prefill_chunks_prefix_hits_decode_and_verification(
    kernels, layout, num_heads, num_kv_heads, head_size
):
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[37, 5, 70], layout=layout)
    sim.prefill_cached_prefix(2, 40)  # request 2's first 40 tokens come from the prefix cache
    kernels.clear()
    sim.step({0: 37, 1: 5, 2: 30})  # prefill, short prefill, chunked prefill over the cached prefix
    sim.step({0: 1, 1: 1, 2: 1})  # decode
    sim.step({0: 4, 1: 4, 2: 4})  # speculative verification: 1 + 3 drafts per request
    sim.step({0: 1, 1: 9})  # mixed decode + prefill
    sim.step({0: 1, 1: 1, 2: 1}, pad_requests=2, pad_tokens=2)  # decode padded for a CUDA graph of 5
    assert kernels.calls == ["varlen", "decode(3, 1)", "decode(3, 4)", "varlen", "decode(5, 1)"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (24, 5.0)])
def test_forward_splits_mixed_batches_between_the_decode_and_prefill_ops(kernels, layout, sliding_window, softcap):
    n = MIN_SPLIT_DECODES + 2
    sim = ServingSimulation(8, 2, 64, prompt_lens=[40] * n + [90], layout=layout, sliding_window=sliding_window,
                             softcap=softcap)
    sim.step({r: 17 + r for r in range(n)})  # prefills
    kernels.clear()
    mixed = {r: 1 for r in range(n)}
    sim.step({**mixed, n: 33})  # n decodes first (as vLLM reorders), then a prefill: split
    sim.step({**mixed, n: 20})  # a chunk over the prefill's first chunk: split again
    sim.step({n: 5, **mixed})  # not reordered (a prefill first): all through the prefill op
    sim.step({0: 1, 1: 1, n: 7})  # too few decodes to split
    assert kernels.calls == [f"decode({n}, 1)", "varlen", f"decode({n}, 1)", "varlen", "varlen", "varlen"]


def test_decode_reads_only_the_columns_the_step_needs_of_a_wide_table(kernels):
    """vLLM's block table is max_model_len wide; an eager step's decode gets the columns max_seq_len needs (a power
    of two of pages), uniform and mixed batches alike, with the same outputs (the simulation checks them)."""
    n = MIN_SPLIT_DECODES + 1
    sim = ServingSimulation(8, 2, 64, prompt_lens=[40] * n + [90], max_len=4096)
    assert sim.max_blocks == 256
    sim.step({r: 30 + r for r in range(n)})  # prefills: contexts up to 30 + n - 1
    kernels.clear()
    sim.step({r: 1 for r in range(n)})  # uniform decode
    sim.step({**{r: 1 for r in range(n)}, n: 40})  # mixed: n decodes, then a 40-token prefill
    assert kernels.calls[-3:] == [f"decode({n}, 1)", f"decode({n}, 1)", "varlen"]
    assert kernels.decode_table_widths == [4, 4]  # max_seq_len 30 + n <= 64 keys: 4 pages of 16 (a power of two)


def test_step_block_table_bounds_every_context():
    table = torch.arange(4 * 300, dtype=torch.int32).view(4, 300)
    for max_seq_len, width in [(0, 1), (1, 1), (16, 1), (17, 2), (1152, 128), (4096, 256), (4800, 300)]:
        got = step_block_table(table, max_seq_len, 16)
        assert got.shape == (4, width) and got.stride() == table.stride(), max_seq_len
        assert got.shape[1] * 16 >= min(max_seq_len, 300 * 16)
        assert torch.equal(got, table[:, :width])


@pytest.mark.parametrize("sliding_window,softcap", [(24, None), (None, 20.0), (9, 5.0)])
def test_forward_applies_sliding_window_and_softcap(kernels, sliding_window, softcap):
    sim = ServingSimulation(8, 2, 64, prompt_lens=[60, 33], sliding_window=sliding_window, softcap=softcap)
    sim.step({0: 60, 1: 20})
    sim.step({0: 1, 1: 1})
    sim.step({0: 2, 1: 13})
    assert kernels.calls == ["varlen", "decode(2, 1)", "varlen"]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,sliding_window", [(8, 1, 64, None), (8, 1, 64, 24),
                                                                         (4, 4, 128, 9), (8, 2, 256, None)])
def test_forward_passes_the_sinks_to_every_op(kernels, num_heads, num_kv_heads, head_size, sliding_window):
    """gpt-oss: vLLM's sinks parameter (bf16) reaches the decode and prefill ops as float32, in every kind of step."""
    n = MIN_SPLIT_DECODES + 1
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[40] * n + [70], max_len=200,
                            sliding_window=sliding_window, sinks=True)
    sim.prefill_cached_prefix(n, 30)
    kernels.clear()
    sim.step({r: 20 + r for r in range(n)} | {n: 25})  # prefills, a chunk over a cached prefix
    sim.step({r: 1 for r in range(n + 1)})  # decode
    sim.step({r: 3 for r in range(n + 1)})  # verification
    sim.step({r: 1 for r in range(n)} | {n: 9})  # mixed: split
    sim.step({r: 1 for r in range(n)}, pad_requests=2, pad_tokens=2)  # graph padding
    assert kernels.calls == ["varlen", f"decode({n + 1}, 1)", f"decode({n + 1}, 3)", f"decode({n}, 1)", "varlen",
                             f"decode({n + 2}, 1)"]
    want = sim.sinks.float()
    for _, _, _, sinks in kernels.masks:
        assert sinks.dtype == torch.float32 and torch.equal(sinks, want)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_forward_of_a_bidirectional_decoder_passes_causal_false_and_a_symmetric_window(kernels, sliding_window):
    n = MIN_SPLIT_DECODES + 1
    sim = ServingSimulation(8, 2, 64, prompt_lens=[40] * n + [90], sliding_window=sliding_window, causal=False)
    sim.prefill_cached_prefix(n, 30)
    kernels.clear()
    sim.step({r: 20 + r for r in range(n)} | {n: 30})  # prefills, a chunk over a cached prefix
    sim.step({r: 1 for r in range(n + 1)})  # decode
    sim.step({r: 4 for r in range(n + 1)})  # verification (DFlash-style blocks of drafts)
    sim.step({r: 1 for r in range(n)} | {n: 9})  # mixed: split
    assert kernels.calls == ["varlen", f"decode({n + 1}, 1)", f"decode({n + 1}, 4)", f"decode({n}, 1)", "varlen"]
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    assert {(causal, w) for _, causal, w, _ in kernels.masks} == {(False, window)}


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(32, 32, 96), (8, 2, 40), (4, 1, 200)])
def test_forward_serves_head_sizes_between_the_kernel_tiles(kernels, num_heads, num_kv_heads, head_size):
    """Phi-3's 96 and other multiples of 8: the ops take them (run on the next tile up, on the GPU)."""
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[37, 5, 70], sliding_window=32)
    sim.step({0: 37, 1: 5, 2: 40})
    sim.step({0: 1, 1: 1, 2: 1})
    sim.step({0: 4, 1: 4, 2: 4})
    sim.step({0: 1, 1: 9})
    assert kernels.calls == ["varlen", "decode(3, 1)", "decode(3, 4)", "varlen"]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,prompt_lens,sliding_window,sinks",
    [(12, 12, 64, [7, 30, 1, 64], None, False), (12, 12, 64, [1, 1, 1], None, False),
     (8, 2, 128, [50, 17], 16, False), (16, 16, 96, [33, 8], None, False), (8, 2, 64, [40, 9], 8, True)],
)
def test_forward_of_an_encoder_only_layer_attends_within_each_prompt_without_a_cache(
    kernels, monkeypatch, num_heads, num_kv_heads, head_size, prompt_lens, sliding_window, sinks
):
    monkeypatch.setattr(tk_vllm_backend, "reshape_and_cache_flash", lambda *args: pytest.fail("wrote a KV cache"))
    md = encoder_only_batch(num_heads, num_kv_heads, head_size, prompt_lens, sliding_window=sliding_window,
                            sinks=sinks, pad_requests=1, pad_tokens=3)
    assert md.decode is None
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    assert kernels.calls == ["varlen(no cache)"]
    assert [m[:3] for m in kernels.masks] == [("varlen", False, window)]
    assert (kernels.masks[0][3] is not None) == sinks


def test_forward_profiling_run_without_metadata_zeroes_output():
    impl = TKAttentionImpl(8, 64, 0.125, 2, None, None, "auto")
    out = torch.full((4, 8, 64), float("nan"))
    impl.forward(None, torch.randn(4, 8, 64), None, None, torch.empty(0), None, out)
    assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------------------------ tensor parallelism


def _rank_heads(total_q: int, total_kv: int, tp: int, rank: int) -> tuple[slice, slice]:
    """The q and kv heads rank `rank` holds, as vLLM's QKVParallelLinear shards them (KV replicated when there
    are fewer KV heads than ranks)."""
    q_per_rank = total_q // tp
    if tp >= total_kv:
        kv_per_rank, kv_shard = 1, rank // (tp // total_kv)
    else:
        kv_per_rank, kv_shard = total_kv // tp, rank
    return (slice(rank * q_per_rank, (rank + 1) * q_per_rank),
            slice(kv_shard * kv_per_rank, (kv_shard + 1) * kv_per_rank))


@pytest.mark.parametrize("total_q,total_kv", [(16, 4), (16, 16), (32, 8)])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_ranks_attend_their_head_slices(kernels, total_q, total_kv, tp):
    from vllm.config import ModelConfig

    # vLLM's own per-rank head arithmetic, on a stand-in model config.
    model = SimpleNamespace(use_mla=False, model_arch_config=SimpleNamespace(
        total_num_attention_heads=total_q, total_num_kv_heads=total_kv))
    model.get_total_num_kv_heads = lambda: total_kv
    parallel = SimpleNamespace(tensor_parallel_size=tp)
    heads_per_rank = ModelConfig.get_num_attention_heads(model, parallel)
    kv_heads_per_rank = ModelConfig.get_num_kv_heads(model, parallel)

    gen = torch.Generator().manual_seed(tp * 100 + total_kv)
    lens = [23, 1, 40]
    cu = torch.tensor([0, 23, 24, 64], dtype=torch.int32)
    q = torch.randn(64, total_q, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(64, total_kv, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(64, total_kv, 64, generator=gen).to(torch.bfloat16)
    full, _ = reference.attention(q, k, v, cu, cu, 0.125, True)

    block_size, max_blocks = 16, 3
    block_table = torch.arange(3 * max_blocks, dtype=torch.int32).view(3, max_blocks)
    pos = torch.cat([torch.arange(n) for n in lens])
    req = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    slots = block_table[req, pos // block_size].long() * block_size + pos % block_size
    md = builder(kv_heads_per_rank, 64).build(0, common_metadata(lens, lens, block_table, slots))
    layer = SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    for rank in range(tp):
        q_heads, kv_heads = _rank_heads(total_q, total_kv, tp, rank)
        assert q_heads.stop - q_heads.start == heads_per_rank
        assert kv_heads.stop - kv_heads.start == kv_heads_per_rank
        impl = TKAttentionImpl(heads_per_rank, 64, 0.125, kv_heads_per_rank, None, None, "auto")
        _, (kv_cache, _) = vllm_allocated_cache(3 * max_blocks, block_size, kv_heads_per_rank, 64, "NHD")
        out = torch.full((64, heads_per_rank, 64), float("nan"), dtype=torch.bfloat16)
        impl.do_kv_cache_update(layer, k[:, kv_heads], v[:, kv_heads], kv_cache, slots)
        impl.forward(layer, q[:, q_heads].contiguous(), None, None, kv_cache, md, out)
        err = (out.float() - full[:, q_heads]).norm() / full[:, q_heads].norm()
        assert err < 1e-2, f"rank {rank}/{tp}: relative error {err:.3e}"


def test_an_fp8_cache_reads_the_layers_scales_as_descales():
    """An FP8 (e4m3) cache's layer passes its per-tensor k / v scales to the ops as FLASH_ATTN does: expanded to
    [num_seqs, num_kv_heads] float32 (no copy); a 16-bit cache passes none."""
    layer = types.SimpleNamespace(_k_scale=torch.tensor(0.5), _v_scale=torch.tensor([2.0]))
    impl = TKAttentionImpl(**_impl_args(kv_cache_dtype="fp8"))
    descales = impl._descales(layer, 3)
    assert set(descales) == {"k_descale", "v_descale"}
    assert descales["k_descale"].shape == (3, impl.num_kv_heads) and descales["k_descale"].dtype == torch.float32
    assert torch.equal(descales["k_descale"], torch.full((3, impl.num_kv_heads), 0.5))
    assert torch.equal(descales["v_descale"], torch.full((3, impl.num_kv_heads), 2.0))
    assert TKAttentionImpl(**_impl_args())._descales(layer, 3) == {}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,sliding_window", [(8, 2, 64, None), (4, 4, 128, 24)])
def test_forward_over_an_fp8_cache_serves_every_kind_of_step(kernels, layout, num_heads, num_kv_heads, head_size,
                                                              sliding_window):
    """--kv-cache-dtype fp8 end to end through the backend: the cache written as e4m3 with the layer's scales, the
    query quantized as vLLM does, and every op (decode, split mixed batches, prefill over a cached prefix,
    verification) given the layer's q / k / v scales as descales (outputs checked by the simulation)."""
    n = MIN_SPLIT_DECODES + 1
    sim = ServingSimulation(num_heads, num_kv_heads, head_size, prompt_lens=[40] * n + [70], max_len=200,
                            sliding_window=sliding_window, layout=layout, kv_cache_dtype="fp8")
    sim.prefill_cached_prefix(n, 30)
    kernels.clear()
    sim.step({r: 20 + r for r in range(n)} | {n: 25})  # prefills, a chunk over a cached prefix
    sim.step({r: 1 for r in range(n + 1)})  # decode
    sim.step({**{r: 1 for r in range(n)}, n: 9})  # mixed: split
    sim.step({r: 3 for r in range(n + 1)})  # verification
    assert kernels.calls == ["varlen", f"decode({n + 1}, 1)", f"decode({n}, 1)", "varlen", f"decode({n + 1}, 3)"]
    for op, *scales in kernels.descales:
        assert all(x is not None for x in scales), op
        assert [float(x.flatten()[0]) for x in scales] == [FP8_SCALES["q"], FP8_SCALES["k"], FP8_SCALES["v"]], op


def test_an_fp8_cache_takes_the_query_quantized_as_flash_attn_and_triton_do():
    """vLLM quantizes the query per tensor for backends that say so (FLASH_ATTN and TRITON_ATTN on CUDA): TK says
    so over FP8 caches (not encoder-only layers, which have none), and passes layer._q_scale as q_descale."""
    assert TKAttentionImpl(**_impl_args(kv_cache_dtype="fp8")).supports_quant_query_input
    assert not TKAttentionImpl(**_impl_args()).supports_quant_query_input
    assert not TKAttentionImpl(**_impl_args(kv_cache_dtype="fp8", attn_type="encoder_only")).supports_quant_query_input
    layer = types.SimpleNamespace(_k_scale=torch.tensor(0.5), _v_scale=torch.tensor(2.0), _q_scale=torch.tensor(4.0))
    descales = TKAttentionImpl(**_impl_args(kv_cache_dtype="fp8"))._descales(layer, 2, quantized_query=True)
    assert torch.equal(descales["q_descale"], torch.full((2, 2), 4.0)) and set(descales) == {"q_descale",
                                                                                              "k_descale", "v_descale"}
