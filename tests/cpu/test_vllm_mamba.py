"""tk_backend.vllm.mamba on CPU: the swap of MambaMixer2's two SSD ops installs and uninstalls (in this process
and, through the import hook, in a fresh one), the opt-in rules, vLLM -> TK argument mapping on hand-made
examples, the fallbacks, and a simulated serving run with vLLM's exact call shapes (chunked prefill
continuing from cached states, decode with padded rows) where the float32 references stand in for the
kernels after TK's real argument checks have passed. Also: examples/build_tiny_mamba2.py writes a model
that transformers runs and vLLM's config accepts.

Runs against whichever vLLM is installed (0.33.0 here); skipped when vLLM is not importable.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_cpu_vllm.sh installs it)")

import tk_backend.mamba as tk_mamba  # noqa: E402
import tk_backend.vllm  # noqa: E402,F401 (registers the plugin)
from tk_backend import reference  # noqa: E402
from tk_backend.vllm import mamba as tkm  # noqa: E402
from tests.accuracy import assert_close  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CPU_ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def mixer_module():
    import vllm.model_executor.layers.mamba.mamba_mixer2 as module  # the import hook installs on import

    return module


@pytest.fixture
def installed(mixer_module):
    tkm.install(mixer_module)
    yield mixer_module
    tkm.install(mixer_module)  # leave it installed, as the plugin would


class _Validated(Exception):
    """Raised where the kernels would launch: TK's argument checks have all passed."""


def _raise_validated(t):
    raise _Validated


def _meta(v):
    """The same shape, strides and dtype on the meta device, where TK's checks run without a GPU."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


@pytest.fixture
def kernels(monkeypatch):
    """Stand-ins for TK's two ops: the real functions check meta copies of the arguments (same shapes, strides,
    dtypes), then the float32 references compute."""
    monkeypatch.setattr(tk_mamba, "require_kernels", _raise_validated)
    calls = {"scan": 0, "update": 0}

    def scan(x, dt, A, B, C, cu_seqlens, **kw):
        with pytest.raises(_Validated):
            tk_mamba.mamba_chunk_scan_varlen(*map(_meta, (x, dt, A, B, C, cu_seqlens)),
                                             **{k: _meta(v) for k, v in kw.items()})
        calls["scan"] += 1
        y, final = reference.mamba_chunk_scan(
            x[None], dt[None], A, B[None], C[None], D=kw["D"], z=None if kw["z"] is None else kw["z"][None],
            dt_bias=kw["dt_bias"], initial_states=kw["initial_states"], dt_softplus=kw["dt_softplus"],
            dt_limit=kw["dt_limit"], cu_seqlens=cu_seqlens)
        kw["out"].copy_(y[0])
        return kw["out"], final

    def update(state, x, dt, A, B, C, **kw):
        with pytest.raises(_Validated):
            tk_mamba.selective_state_update(*map(_meta, (state, x, dt, A, B, C)), **{k: _meta(v) for k, v in kw.items()})
        calls["update"] += 1
        out = kw.pop("out")
        out.copy_(reference.selective_state_update(state, x, dt, A, B, C, **kw))
        return out

    monkeypatch.setattr(tkm, "mamba_chunk_scan_varlen", scan)
    monkeypatch.setattr(tkm, "tk_selective_state_update", update)
    return calls


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines(monkeypatch):
    handler = _Records()
    tkm.logger.addHandler(handler)
    monkeypatch.setattr(tkm, "_logged", set())
    yield handler.lines
    tkm.logger.removeHandler(handler)


@pytest.fixture
def vllm_ops(installed, monkeypatch):
    """vLLM's own two functions replaced by recorders (what the dispatchers fall back to)."""
    seen = []
    api = tkm._api
    monkeypatch.setattr(tkm, "_api", tkm.VllmMambaAPI(
        scan=lambda *a, **k: seen.append(("scan", a, k)) or "vllm-scan",
        update=lambda *a, **k: seen.append(("update", a, k)),
        scan_takes_final_states_out=api.scan_takes_final_states_out, null_block_id=api.null_block_id))
    return seen


# ---------------------------------------------------------------------------------------- install


def test_install_swaps_both_op_references_and_registers_the_layer(installed):
    from vllm.model_executor.custom_op import op_registry_oot

    module = installed
    assert module.mamba_chunk_scan_combined_varlen is tkm.mamba_chunk_scan_combined_varlen
    assert module.selective_state_update is tkm.selective_state_update
    assert op_registry_oot["MambaMixer2"] is tkm.TKMambaMixer2
    assert issubclass(tkm.TKMambaMixer2, module.MambaMixer2)
    # What every model's MambaMixer2(...) now builds (PluggableLayer.__new__ resolves out-of-tree classes).
    assert type(module.MambaMixer2.__new__(module.MambaMixer2)) is tkm.TKMambaMixer2
    # vLLM's originals are kept, with their signatures read.
    assert tkm._api.scan.__module__.endswith("ssd_combined") and tkm._api.update.__module__.endswith("ssu_dispatch")
    assert tkm._api.null_block_id == 0
    tkm.install(module)  # idempotent: the originals stay vLLM's, not our dispatchers
    assert tkm._api.scan is not tkm.mamba_chunk_scan_combined_varlen


def test_uninstall_restores_vllm(installed):
    from vllm.model_executor.custom_op import op_registry_oot

    module = installed
    scan, update = tkm._api.scan, tkm._api.update
    tkm.uninstall()
    assert module.mamba_chunk_scan_combined_varlen is scan and module.selective_state_update is update
    assert "MambaMixer2" not in op_registry_oot
    assert type(module.MambaMixer2.__new__(module.MambaMixer2)) is module.MambaMixer2
    assert not tkm.installed()
    tkm.register()  # module loaded: installs at once
    assert tkm.installed()


def test_fresh_process_installs_when_vllm_imports_the_mixer():
    code = (
        "import sys, tk_backend.vllm\n"
        "from tk_backend.vllm import mamba as m\n"
        "assert m.MIXER_MODULE not in sys.modules, 'the plugin must not import the mixer module itself'\n"
        "import vllm.model_executor.layers.mamba.mamba_mixer2 as mm\n"
        "from vllm.model_executor.custom_op import op_registry_oot\n"
        "assert mm.mamba_chunk_scan_combined_varlen is m.mamba_chunk_scan_combined_varlen\n"
        "assert mm.selective_state_update is m.selective_state_update\n"
        "assert op_registry_oot['MambaMixer2'] is m.TKMambaMixer2\n"
        "import inspect; assert 'class MambaMixer2' in inspect.getsource(mm)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=CPU_ENV, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.decode().strip().endswith("ok"), proc.stderr.decode()[-4000:]


def test_dispatchers_keep_vllms_signatures(installed):
    import inspect

    for ours, theirs in ((tkm.mamba_chunk_scan_combined_varlen, tkm._api.scan),
                         (tkm.selective_state_update, tkm._api.update)):
        ours_params = list(inspect.signature(ours).parameters)
        theirs_params = list(inspect.signature(theirs).parameters)
        assert ours_params[:len(theirs_params)] == theirs_params, (ours.__name__, theirs_params)


# ----------------------------------------------------------------------------------------- opt-in


@pytest.mark.parametrize("env, backend_is_tk, expected", [
    (None, False, False), (None, True, True), ("", True, True), ("1", False, True), ("true", False, True),
    ("0", True, False), ("off", True, False),
])
def test_opt_in_rules(env, backend_is_tk, expected):
    assert tkm.wanted(env, backend_is_tk) is expected


def test_opt_in_rejects_unclear_values():
    with pytest.raises(ValueError, match="TK_MAMBA must be 0 or 1"):
        tkm.wanted("maybe", False)


def test_attention_backend_choice_is_read_from_the_engine_config():
    from vllm.config import AttentionConfig

    assert tkm.attention_backend_is_tk(SimpleNamespace(attention_config=AttentionConfig(backend="TK")))
    assert tkm.attention_backend_is_tk(SimpleNamespace(attention_config=AttentionConfig(backend="CUSTOM")))
    assert not tkm.attention_backend_is_tk(SimpleNamespace(attention_config=AttentionConfig(backend="TRITON_ATTN")))
    assert not tkm.attention_backend_is_tk(SimpleNamespace(attention_config=AttentionConfig()))
    assert not tkm.attention_backend_is_tk(None)


def test_layer_shapes_tk_does_not_serve():
    ok = dict(head_dim=64, state_size=128, dtype=torch.bfloat16, heads_per_rank=32, groups_per_rank=8)
    assert tkm.layer_unsupported_reason(**ok) is None
    assert tkm.layer_unsupported_reason(**{**ok, "head_dim": 128, "state_size": 64, "dtype": torch.float16}) is None
    assert "head_dim 96" in tkm.layer_unsupported_reason(**{**ok, "head_dim": 96})
    assert "ssm_state_size 16" in tkm.layer_unsupported_reason(**{**ok, "state_size": 16})
    assert "float32" in tkm.layer_unsupported_reason(**{**ok, "dtype": torch.float32})
    assert "multiple" in tkm.layer_unsupported_reason(**{**ok, "heads_per_rank": 12})


@pytest.mark.parametrize("state_size, head_dim, device_reason, expected", [
    (128, 64, None, True),               # a whole TK layer
    (256, 64, None, True),               # Falcon-H1's: a whole TK layer too (the update on TK's where faster)
    (256, 128, None, True),              # the scan on TK's; without TK_MAMBA=1 every update on vLLM's (no bulk kernel)
    (16, 64, None, False),
    (128, 64, "no CUDA device", False),  # the device decides first
    (256, 64, "no CUDA device", False),
])
def test_which_mixer_layers_go_on_tk(monkeypatch, log_lines, state_size, head_dim, device_reason, expected):
    import vllm.config

    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    monkeypatch.setattr(tkm, "attention_backend_is_tk", lambda config: True)
    monkeypatch.setattr(tkm, "device_unsupported_reason", lambda: device_reason)
    monkeypatch.delenv(tkm.ENV_VAR, raising=False)
    layer = SimpleNamespace(head_dim=head_dim, ssm_state_size=state_size, num_heads=48, n_groups=1, tp_size=1,
                            model_config=SimpleNamespace(dtype=torch.bfloat16))
    assert tkm._decide_for_layer(layer) is expected
    if not expected:
        assert any("stay on vLLM's Triton SSD kernels" in line for line in log_lines)


# ----------------------------------------------------------------------------------- the mapping


def test_decode_slots_from_vllms_metadata():
    idx2d = torch.tensor([[5], [0], [7]], dtype=torch.int32)  # vLLM's [num_decodes, 1 + num_spec] (no spec)
    slots, why = tkm.decode_slots(idx2d, idx2d, None, None)
    assert why is None and slots.tolist() == [5, 0, 7] and slots.dim() == 1
    idx1d = torch.tensor([3, 4], dtype=torch.int32)
    slots, why = tkm.decode_slots(idx1d, idx1d, None, None)
    assert why is None and slots is idx1d
    # The same buffer seen through another view object is still "in place".
    assert tkm.decode_slots(idx2d, idx2d[:, :], None, None)[1] is None
    assert tkm.decode_slots(None, None, None, None) == (None, None)
    # Falls back: speculative decoding, distinct destinations (0.26 prefix caching "all" mode).
    spec = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)
    assert "speculative" in tkm.decode_slots(spec, spec, None, None)[1]
    assert "speculative" in tkm.decode_slots(idx1d, idx1d, torch.ones(2, dtype=torch.int32), None)[1]
    assert "speculative" in tkm.decode_slots(idx1d, idx1d, None, torch.tensor([0, 1, 2]))[1]
    assert "destination" in tkm.decode_slots(idx1d, idx1d.clone(), None, None)[1]


def test_final_states_go_where_each_vllm_version_expects():
    final = torch.arange(2 * 2 * 1 * 3, dtype=torch.float32).view(2, 2, 1, 3) + 0.25
    # 0.26: returned in the state cache dtype; the mixer writes ssm_state[state_indices_tensor_p] = them.
    got = tkm.store_final_states(final, torch.bfloat16, torch.bfloat16, None, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, final.to(torch.bfloat16))
    assert tkm.store_final_states(final, None, torch.float16, None, None).dtype == torch.float16
    # 0.33: written into the cache slots, None returned.
    cache = torch.zeros(5, 2, 1, 3)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    assert tkm.store_final_states(final, torch.float32, torch.bfloat16, cache, slots) is None
    assert torch.equal(cache[4], final[0]) and torch.equal(cache[1], final[1]) and not cache[[0, 2, 3]].any()


def test_scan_reasons():
    x = torch.empty(10, 4, 64, dtype=torch.bfloat16)
    B = torch.empty(10, 1, 128, dtype=torch.bfloat16)
    assert tkm.scan_unsupported_reason(x, B, False) is None
    assert "intermediate" in tkm.scan_unsupported_reason(x, B, True)
    assert "float32" in tkm.scan_unsupported_reason(x.float(), B, False)
    assert "headdim 80" in tkm.scan_unsupported_reason(torch.empty(10, 4, 80, dtype=torch.bfloat16), B, False)
    assert "dstate 16" in tkm.scan_unsupported_reason(x, torch.empty(10, 1, 16, dtype=torch.bfloat16), False)


# ------------------------------------------------------------------------------------ the fallbacks


def _scan_args(T=12, h=4, p=64, g=1, n=64, dtype=torch.bfloat16):
    return dict(x=torch.randn(T, h, p).to(dtype), dt=torch.randn(T, h).to(dtype), A=-torch.rand(h),
                B=torch.randn(T, g, n).to(dtype), C=torch.randn(T, g, n).to(dtype), chunk_size=256,
                cu_seqlens=torch.tensor([0, 5, T], dtype=torch.int32),
                cu_chunk_seqlens=torch.tensor([0, 5, T], dtype=torch.int32),
                last_chunk_indices=torch.tensor([0, 1], dtype=torch.int32),
                seq_idx=torch.tensor([0, 1], dtype=torch.int32), out=torch.empty(T, h, p, dtype=dtype),
                D=torch.randn(h), dt_bias=torch.randn(h), dt_softplus=True)


@pytest.mark.parametrize("case", ["headdim 96", "float32", "dstate 16", "intermediate", "layout"])
def test_unsupported_scans_fall_back_once_logged(case, vllm_ops, kernels, log_lines):
    kw = {"headdim 96": dict(p=96), "float32": dict(dtype=torch.float32), "dstate 16": dict(n=16),
          "intermediate": {}, "layout": {}}[case]
    args = _scan_args(**kw)
    if case == "intermediate":
        args["return_intermediate_states"] = True
    if case == "layout":  # x not TMA-addressable: caught by TK's own checks, before any launch
        args["x"] = torch.randn(12, 64, 4, dtype=torch.bfloat16).transpose(1, 2)
    with tkm.tk_layer("model.layers.0.mixer"):
        for _ in range(3):
            assert tkm.mamba_chunk_scan_combined_varlen(**args) == "vllm-scan"
    assert [s[0] for s in vllm_ops] == ["scan"] * 3 and kernels["scan"] == 0
    assert len(log_lines) == 1 and "falls back to vLLM" in log_lines[0], log_lines
    # vLLM's function gets exactly what the mixer passed.
    name, a, k = vllm_ops[0]
    assert a[0] is args["x"] and k["return_intermediate_states"] == args.get("return_intermediate_states", False)


def test_unsupported_decodes_fall_back(vllm_ops, kernels, log_lines):
    b, h, p, n = 2, 4, 64, 64
    state = torch.zeros(6, h, p, n)
    spec = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    with tkm.tk_layer("model.layers.0.mixer"):
        tkm.selective_state_update(state, torch.randn(4, h, p).bfloat16(), torch.randn(4, h, p), -torch.rand(h, p, n),
                                   torch.randn(4, 1, n).bfloat16(), torch.randn(4, 1, n).bfloat16(), torch.randn(h, p),
                                   torch.randn(h, p), dt_softplus=True, state_batch_indices=spec,
                                   dst_state_batch_indices=spec, num_accepted_tokens=torch.ones(b, dtype=torch.int32),
                                   cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))
    assert [s[0] for s in vllm_ops] == ["update"] and kernels["update"] == 0
    assert vllm_ops[0][2]["null_block_id"] == 0 and vllm_ops[0][2]["num_accepted_tokens"] is not None
    assert "speculative" in log_lines[0]


@pytest.mark.parametrize("env, expected", [(None, False), ("", False), ("1", True), ("on", True), ("0", False)])
def test_the_decode_update_is_on_tk_only_when_tk_mamba_asks(env, expected):
    # Following the attention backend puts the scan on TK but leaves the update to vLLM's faster Triton kernel.
    assert tkm.update_wanted(env) is expected


def test_a_tk_layer_without_the_update_calls_vllms(vllm_ops, kernels):
    h, p, n = 4, 64, 64
    state = torch.zeros(3, h, p, n)
    before = dict(tkm.STATS)
    with tkm.tk_layer("model.layers.0.mixer", update=False):
        tkm.selective_state_update(state, torch.randn(2, h, p).bfloat16(), torch.randn(2, h, p), -torch.rand(h, p, n),
                                   torch.randn(2, 1, n).bfloat16(), torch.randn(2, 1, n).bfloat16(), torch.randn(h, p),
                                   torch.randn(h, p), dt_softplus=True,
                                   state_batch_indices=torch.tensor([1, 2], dtype=torch.int32))
        assert tkm.mamba_chunk_scan_combined_varlen(**_scan_args()) is not None
    assert [s[0] for s in vllm_ops] == ["update"] and kernels["update"] == 0 and kernels["scan"] == 1
    grew = {k: v - before.get(k, 0) for k, v in tkm.STATS.items() if v != before.get(k, 0)}
    assert grew == {"vllm_update": 1, "tk_scan": 1}, grew


@pytest.mark.parametrize("batch, n, p, state_dtype, x_dtype, expected", [
    (128, 256, 64, torch.bfloat16, torch.bfloat16, True),  # Falcon-H1's layer, measured 2.3x Triton's
    (256, 256, 64, torch.float16, torch.float16, True),
    (32, 256, 64, torch.bfloat16, torch.bfloat16, True),  # measured 1.8x
    (1, 256, 64, torch.bfloat16, torch.bfloat16, False),  # measured 0.57x (a CTA's round trips)
    (16, 256, 64, torch.bfloat16, torch.bfloat16, False),  # not measured below 32
    (128, 128, 64, torch.bfloat16, torch.bfloat16, False),  # dstate 128: Triton's is faster
    (128, 256, 128, torch.bfloat16, torch.bfloat16, False),  # no bulk kernel (64 KB a block)
    (128, 256, 64, torch.float32, torch.bfloat16, False),  # float32 state: not the bulk kernel's form
])
def test_tk_update_faster_names_the_measured_shapes(batch, n, p, state_dtype, x_dtype, expected):
    state, x = torch.empty(batch + 1, 4, p, n, dtype=state_dtype), torch.empty(batch, 4, p, dtype=x_dtype)
    assert tkm.tk_update_faster(state, x) is expected


# How the slots come: TK's own form (1-D, no destination), and vLLM 0.26 / 0.33 without prefix caching ([batch, 1]
# read and written in place: the same tensor as destination); distinct destinations (prefix caching "all") stay on
# vLLM's kernel, which is not a fallback: the layer never asked TK for that call.
@pytest.mark.parametrize("slots_form, expected", [("1d", "tk_update"), ("vllm_in_place", "tk_update"),
                                                  ("vllm_distinct_dst", "vllm_update")])
def test_a_tk_layer_without_the_update_takes_the_faster_shapes(vllm_ops, kernels, slots_form, expected):
    b, h, p, n = tkm.FASTER_UPDATE_MIN_BATCH, 2, 64, 256
    state = torch.zeros(2 * b + 1, h, p, n, dtype=torch.bfloat16)
    src = torch.arange(1, b + 1, dtype=torch.int32)
    slots = {"1d": dict(state_batch_indices=src)}.get(slots_form)
    if slots is None:
        src = src[:, None]
        dst = src if slots_form == "vllm_in_place" else src + b
        slots = dict(state_batch_indices=src, dst_state_batch_indices=dst, num_accepted_tokens=None, cu_seqlens=None)
    before = dict(tkm.STATS)
    with tkm.tk_layer("model.layers.0.mixer", update=False):
        tkm.selective_state_update(state, torch.randn(b, h, p).bfloat16(), torch.randn(b, h, p).bfloat16(),
                                   -torch.rand(h, p, n), torch.randn(b, 1, n).bfloat16(),
                                   torch.randn(b, 1, n).bfloat16(), torch.randn(h, p), torch.randn(h, p),
                                   dt_softplus=True, out=torch.empty(b, h, p, dtype=torch.bfloat16), **slots)
    assert kernels["update"] == (expected == "tk_update")
    assert [s[0] for s in vllm_ops] == ([] if expected == "tk_update" else ["update"])
    grew = {k: v - before.get(k, 0) for k, v in tkm.STATS.items() if v != before.get(k, 0)}
    assert grew == {expected: 1}, grew


def test_layers_not_on_tk_always_use_vllm(vllm_ops, kernels):
    args = _scan_args()
    assert tkm.mamba_chunk_scan_combined_varlen(**args) == "vllm-scan"  # no tk_layer open
    assert kernels["scan"] == 0 and len(vllm_ops) == 1


# ------------------------------------------------------------------- a simulated serving run (vLLM's calls)


class _MixerSim:
    """The state handling of vLLM's MambaMixer2.conv_ssm_forward around the two calls (0.26 and 0.33 forms),
    with vLLM's buffer layouts: x / B / C are column slices of the conv output, dt of the projection."""

    def __init__(self, h=8, p=64, g=2, n=64, slots=8, state_dtype=torch.float32, writes_final_states=False):
        self.h, self.p, self.g, self.n = h, p, g, n
        self.A, self.D, self.dt_bias = -torch.rand(h) * 2 - 0.1, torch.randn(h), torch.randn(h) * 0.3
        self.ssm_state = torch.zeros(slots, h, p, n, dtype=state_dtype)  # slot 0 is vLLM's null block
        self.writes_final_states = writes_final_states

    def split(self, hbc, proj):
        hp, gn = self.h * self.p, self.g * self.n
        T = hbc.shape[0]
        x = hbc[:, :hp].view(T, self.h, self.p)
        B = hbc[:, hp:hp + gn].view(T, self.g, self.n)
        C = hbc[:, hp + gn:].view(T, self.g, self.n)
        return x, B, C, proj[:, -self.h:]

    def prefill(self, hbc, proj, query_start_loc, state_indices, has_initial_states):
        with tkm.tk_layer("model.layers.0.mixer"):  # what TKMambaMixer2.conv_ssm_forward opens
            return self._prefill(hbc, proj, query_start_loc, state_indices, has_initial_states)

    def _prefill(self, hbc, proj, query_start_loc, state_indices, has_initial_states):
        x, B, C, dt = self.split(hbc, proj)
        T = x.shape[0]
        out = torch.empty(T, self.h * self.p, dtype=x.dtype)
        initial = None
        if bool(has_initial_states.any()):  # prep_initial_states
            initial = torch.where(has_initial_states[:, None, None, None], self.ssm_state[state_indices], 0)
        lengths = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        cu_chunks = [0] + torch.tensor(lengths).cumsum(0).tolist()  # one chunk per sequence here
        extra = dict(final_states_out=self.ssm_state, final_state_indices=state_indices) \
            if self.writes_final_states else {}
        states = tkm.mamba_chunk_scan_combined_varlen(
            x, dt, self.A, B, C, chunk_size=256, D=self.D, z=None, dt_bias=self.dt_bias,
            seq_idx=torch.arange(len(lengths), dtype=torch.int32), cu_seqlens=query_start_loc,
            cu_chunk_seqlens=torch.tensor(cu_chunks, dtype=torch.int32),
            last_chunk_indices=torch.arange(len(lengths), dtype=torch.int32), initial_states=initial,
            return_intermediate_states=False, dt_softplus=True, dt_limit=(0.0, float("inf")),
            out=out.view(T, -1, self.p), state_dtype=self.ssm_state.dtype, **extra)
        if self.writes_final_states:
            assert states is None
        else:
            self.ssm_state[state_indices] = states
        return out.view(T, self.h, self.p)

    def decode(self, hbc, proj, state_indices_2d):
        with tkm.tk_layer("model.layers.0.mixer"):
            return self._decode(hbc, proj, state_indices_2d)

    def _decode(self, hbc, proj, state_indices_2d):
        x, B, C, dt = self.split(hbc, proj)
        b = x.shape[0]
        out = torch.empty(b, self.h * self.p, dtype=x.dtype)
        tkm.selective_state_update(
            self.ssm_state, x, dt[:, :, None].expand(-1, -1, self.p),
            self.A[:, None, None].expand(-1, self.p, self.n).to(torch.float32), B, C,
            self.D[:, None].expand(-1, self.p), self.dt_bias[:, None].expand(-1, self.p), dt_softplus=True,
            state_batch_indices=state_indices_2d, dst_state_batch_indices=state_indices_2d,
            out=out.view(b, -1, self.p), num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False)
        return out.view(b, self.h, self.p)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("writes_final_states", [False, True], ids=["vllm026", "vllm033"])
def test_chunked_prefill_and_decode_match_one_long_scan(state_dtype, writes_final_states, installed, kernels):
    torch.manual_seed(0)
    sim = _MixerSim(state_dtype=state_dtype, writes_final_states=writes_final_states)
    h, p, g, n = sim.h, sim.p, sim.g, sim.n
    conv_dim, z_width = h * p + 2 * g * n, h * p
    lengths = {"r0": 150, "r1": 40, "r2": 6}
    decode_steps = 2
    slot = {"r0": 3, "r1": 6, "r2": 1}
    total = {r: L + decode_steps for r, L in lengths.items()}
    # Each request's whole stream of conv outputs and projections, in vLLM's layouts (bfloat16).
    hbc = {r: torch.randn(T, conv_dim).bfloat16() * 0.5 for r, T in total.items()}
    proj = {r: torch.randn(T, z_width + conv_dim + h).bfloat16() for r, T in total.items()}
    got = {r: [] for r in lengths}

    def step_prefill(parts):  # parts: [(request, start, end)], packed in order
        qsl = [0]
        for _, s, e in parts:
            qsl.append(qsl[-1] + e - s)
        y = sim.prefill(torch.cat([hbc[r][s:e] for r, s, e in parts]), torch.cat([proj[r][s:e] for r, s, e in parts]),
                        torch.tensor(qsl, dtype=torch.int32), torch.tensor([slot[r] for r, _, _ in parts],
                                                                           dtype=torch.int32),
                        torch.tensor([s > 0 for _, s, _ in parts]))
        for (r, _, _), a, b in zip(parts, qsl[:-1], qsl[1:]):
            got[r].append(y[a:b])

    step_prefill([("r0", 0, 100), ("r1", 0, 40)])    # r0's prompt is cut by the token budget
    step_prefill([("r0", 100, 150), ("r2", 0, 6)])   # r0 continues from its cached state
    for t in range(decode_steps):                    # decode: 3 requests and one padded row (null block 0)
        order = ["r1", "r0", "r2"]
        rows = [lengths[r] + t for r in order]
        pad_hbc, pad_proj = torch.randn(1, conv_dim).bfloat16(), torch.randn(1, z_width + conv_dim + h).bfloat16()
        y = sim.decode(torch.cat([hbc[r][i:i + 1] for r, i in zip(order, rows)] + [pad_hbc]),
                       torch.cat([proj[r][i:i + 1] for r, i in zip(order, rows)] + [pad_proj]),
                       torch.tensor([[slot[r]] for r in order] + [[0]], dtype=torch.int32))
        for k, r in enumerate(order):
            got[r].append(y[k:k + 1])
    assert kernels == {"scan": 2, "update": decode_steps}
    assert not sim.ssm_state[0].any(), "the padded decode row touched the null block"

    tol = dict(rel=2e-2, atol=2e-2) if state_dtype == torch.float32 else dict(rel=5e-2, atol=5e-2)
    for r, T in total.items():
        x, B, C, dt = sim.split(hbc[r], proj[r])
        ref_y, ref_state = reference.mamba_chunk_scan(x[None], dt[None], sim.A, B[None], C[None], D=sim.D,
                                                      dt_bias=sim.dt_bias, dt_softplus=True)
        assert_close(torch.cat(got[r]).float(), ref_y[0], **tol, what=f"{r} outputs ({state_dtype})")
        assert_close(sim.ssm_state[slot[r]].float(), ref_state[0], **tol, what=f"{r} cached state ({state_dtype})")


# ----------------------------------------------------------------------------------- model builder


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    spec = importlib.util.spec_from_file_location("build_tiny_mamba2", REPO / "examples" / "build_tiny_mamba2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(tmp_path_factory.mktemp("mamba2") / "n64g1", preset="mamba2-n64-g1", vocab_size=4096)


def test_builder_writes_a_model_transformers_runs(mamba2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((mamba2_dir / "config.json").read_text())
    assert config["architectures"] == ["Mamba2ForCausalLM"] and config["model_type"] == "mamba2"
    assert (config["head_dim"], config["state_size"], config["n_groups"]) == (64, 64, 1)
    assert config["expand"] * config["hidden_size"] == config["num_heads"] * config["head_dim"]
    assert config["chunk_size"] == 256 and config["dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(mamba2_dir)
    model = AutoModelForCausalLM.from_pretrained(mamba2_dir, dtype=torch.float32)
    ids = tokenizer("The kernel reads a tile of the cache", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()
    assert logits.std() > 0.5  # not a degenerate random model


def test_vllm_reads_the_built_model(mamba2_dir):
    from vllm.config import ModelConfig

    config = ModelConfig(model=str(mamba2_dir), max_model_len=2048)
    assert config.architectures == ["Mamba2ForCausalLM"]
    assert config.get_mamba_chunk_size() == 256 and config.dtype == torch.bfloat16
