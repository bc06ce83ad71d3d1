"""vLLM integration for Mamba-2: MambaMixer2's SSD prefill scan and decode state update on TK's kernels.

Turning it on (opt-in, decided once per MambaMixer2 layer when the model is built):

* `TK_MAMBA=1` turns it on whatever the attention backend; `TK_MAMBA=0` turns it off.
* With TK_MAMBA unset it follows the attention backend: on when `--attention-backend TK` (or CUSTOM resolving
  to the TK backend) is selected, off otherwise. A pure Mamba-2 model has no attention layers, but the choice
  is still read from the engine's config. Then the prefill scan runs on TK, and the decode state update only at
  the shapes where TK's kernel was measured faster (`tk_update_faster`: dstate 256); the rest stays on vLLM's
  Triton kernel, faster at dstate 128 (docs/findings/ssd.md#ssd-update-bulk). TK_MAMBA=1 puts every update on TK.

How it is wired (both steps done by `install`, which `register` runs as soon as vLLM's mixer module is
imported; importing that module costs seconds, so the plugin does not import it itself):

1. `TKMambaMixer2`, a subclass of MambaMixer2, is registered out of tree (`PluggableLayer.register_oot`), so
   every `MambaMixer2(...)` that vLLM's models build (Mamba2, NemotronH, Bamba, Zamba2, FalconH1, ...) is one.
   It decides on/off when built and marks its own `conv_ssm_forward` as running on TK.
2. The two op references in vllm/model_executor/layers/mamba/mamba_mixer2.py, `mamba_chunk_scan_combined_varlen`
   and `selective_state_update`, are replaced by the dispatchers below, with vLLM's exact signatures. Outside a
   TK layer's forward (layers left off, the profile run's Triton warm-up) they call vLLM's functions
   unchanged; inside one they run TK's ops, or fall back to vLLM's for a call TK does not handle, with one
   log line per reason. Nothing else in the mixer changes: conv1d, gating norm, projections, state cache
   layout and its metadata stay vLLM's.

What TK takes, and what falls back:

* Prefill: vLLM packs the prefill requests as x [tokens, heads, headdim] with `cu_seqlens`
  (= query_start_loc_p) and `initial_states` ([num_prefills, ...], already gathered from the state cache
  and zeroed where has_initial_states_p is false, so chunked prefill continues from the cached state).
  TK's varlen scan runs each sequence on its own from its initial state; vLLM's chunk metadata
  (cu_chunk_seqlens, last_chunk_indices, seq_idx) only describes how its Triton kernels split the work,
  and TK's result does not depend on it, so it is not needed. The per-sequence final states are returned
  (0.26: the mixer writes them to the cache) or written to `final_states_out[final_state_indices]` (0.33).
  Falls back: `return_intermediate_states` (prefix caching's per-block states: 0.26 mamba_cache_mode
  "all", 0.33 prefill checkpoints), headdim outside {64, 128} or dstate outside {64, 128, 256}, float32 activations, and
  anything TK's argument checks reject (they run before any launch).
* Decode: one token per request, state slots `state_batch_indices` ([batch] or vLLM's [batch, 1]),
  padded rows marked with vLLM's null block id. Falls back: speculative decoding (several tokens per
  request: num_accepted_tokens / cu_seqlens, [batch, k > 1] slots), and distinct source / destination
  slots (0.26 mamba_cache_mode "all").

vLLM versions (0.26.0 and 0.33.0 read): the mixer's two calls are the same in both, except that 0.33's scan
takes `final_states_out` / `final_state_indices` (and returns None when given them), and 0.33's mixer has no
"all"-mode branches (prefix caching there uses checkpoints, i.e. intermediate states). `VllmMambaAPI` reads
those differences from the installed functions' signatures, in one place; both versions' `null_block_id`
default is 0.
"""
from __future__ import annotations

import contextvars
import importlib.abc
import importlib.machinery
import inspect
import logging
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from tk_backend.mamba import HEAD_DIMS, STATE_DIMS, mamba_chunk_scan_varlen
from tk_backend.mamba import selective_state_update as tk_selective_state_update

ENV_VAR = "TK_MAMBA"
MIXER_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
SCAN_NAME = "mamba_chunk_scan_combined_varlen"
UPDATE_NAME = "selective_state_update"
MIXER_CLASS_NAME = "MambaMixer2"
HALF_DTYPES = (torch.bfloat16, torch.float16)

# Under vLLM's logger tree so the lines appear in vLLM's log at INFO.
logger = logging.getLogger("vllm.tk_backend.mamba")

# Calls per path in this process: tk_* ran TK's op, fallback_* were declined by TK inside a TK layer, vllm_*
# came from layers (or warm-ups) that are not on TK. Read by the end-to-end test; plain ints, no syncs.
STATS: Counter = Counter()

_active_layer: contextvars.ContextVar[str | None] = contextvars.ContextVar("tk_mamba_active_layer", default=None)
_active_update: contextvars.ContextVar[bool] = contextvars.ContextVar("tk_mamba_active_update", default=False)
_logged: set[str] = set()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


# -------------------------------------------------------------------------------------------- opt-in


def wanted(env_value: str | None, attention_backend_is_tk: bool) -> bool:
    """TK_MAMBA=1 forces TK's Mamba-2 ops on, TK_MAMBA=0 off; unset (or empty) follows the attention backend."""
    if env_value is None or not env_value.strip():
        return attention_backend_is_tk
    value = env_value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR} must be 0 or 1, got {env_value!r}")


def attention_backend_is_tk(vllm_config) -> bool:
    """Whether the engine's config selects the TK attention backend (CUSTOM resolving to our class)."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is None:
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tk_backend.vllm import BACKEND_CLASS_PATH

    custom = AttentionBackendEnum.CUSTOM
    return backend is custom and custom.is_overridden() and custom.get_path() == BACKEND_CLASS_PATH


def layer_unsupported_reason(head_dim: int, state_size: int, dtype: torch.dtype | None, heads_per_rank: int,
                             groups_per_rank: int) -> str | None:
    """Why TK's kernels cannot serve a MambaMixer2 of this shape (None: they can)."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (TK's SSD kernels take {' or '.join(map(str, HEAD_DIMS))})"
    if state_size not in STATE_DIMS:
        return f"ssm_state_size {state_size} (TK's SSD kernels take {' or '.join(map(str, STATE_DIMS))})"
    if dtype is not None and dtype not in HALF_DTYPES:
        return f"activations in {str(dtype).replace('torch.', '')} (TK's SSD kernels take bfloat16 or float16)"
    if groups_per_rank < 1 or heads_per_rank % groups_per_rank:
        return f"{heads_per_rank} heads per rank are not a multiple of {groups_per_rank} groups"
    return None


def device_unsupported_reason() -> str | None:
    from tk_backend._library import extension_available

    if not extension_available():
        return "tk_backend._C is not built"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU, found {torch.cuda.get_device_name()}"
    return None


def _decide_for_layer(layer) -> bool:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if not wanted(os.environ.get(ENV_VAR), attention_backend_is_tk(config)):
        return False
    model_config = getattr(layer, "model_config", None) or getattr(config, "model_config", None)
    shape = (layer.head_dim, layer.ssm_state_size, getattr(model_config, "dtype", None),
             layer.num_heads // layer.tp_size, layer.n_groups // layer.tp_size)
    device_reason = device_unsupported_reason()
    reason = device_reason or layer_unsupported_reason(*shape)
    if reason is not None:
        _log_once(f"layer:{reason}", logging.WARNING,
                  "tk_backend: MambaMixer2 layers with %s stay on vLLM's Triton SSD kernels", reason)
        return False
    if update_wanted(os.environ.get(ENV_VAR)):
        _log_once("on", logging.INFO, "tk_backend: MambaMixer2 SSD scan and state update run on TK's kernels (%s=%s)",
                  ENV_VAR, os.environ[ENV_VAR])
    else:
        _log_once("on", logging.INFO, "tk_backend: MambaMixer2 SSD scan runs on TK's kernels (attention backend TK); "
                  "the decode state update runs on TK's kernel only where it is faster (dstate 256), otherwise on "
                  "vLLM's Triton kernel (%s=1 puts every update on TK)", ENV_VAR)
    return True


def update_wanted(env_value: str | None) -> bool:
    """Whether every decode state update of a TK layer runs on TK: only when TK_MAMBA=1 asks. Otherwise a TK layer
    takes only the updates tk_update_faster names and leaves the rest to vLLM's Triton kernel, faster at dstate 128
    (docs/findings/ssd.md#ssd-update-bulk)."""
    return wanted(env_value, False)


# Where TK's update (the bulk kernel) was measured faster than vLLM's Triton one: dstate 256, head dim 64, the state
# in x's 16-bit dtype (Falcon-H1's layer), 1.82x at batch 32 and 2.31x at 128, but 0.57x at batch 1 (between: not
# measured); at dstate 128 TK's is 0.52x at batch 1 and 0.85-0.97x at 32-256 (docs/findings/ssd.md#ssd-update-bulk).
FASTER_UPDATE_MIN_BATCH = 32


def tk_update_faster(state, x) -> bool:
    """Whether a TK layer's decode state update (state [slots, heads, headdim, dstate], x [batch, heads, headdim])
    is one where TK's kernel beats vLLM's (the measured shapes above); shapes only, so a graph replays the choice."""
    return (state.dim() == 4 and x.dim() == 3 and state.shape[-1] == 256 and state.shape[-2] == 64
            and state.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] >= FASTER_UPDATE_MIN_BATCH)


# ------------------------------------------------------------------------------------ vLLM differences


@dataclass(frozen=True)
class VllmMambaAPI:
    """What differs between vLLM releases in the two functions we replace, read from the originals."""

    scan: Callable
    update: Callable
    scan_takes_final_states_out: bool  # 0.33: the scan writes final states into the cache itself
    null_block_id: int                 # default marker of padded decode rows (0 in 0.26 and 0.33)

    @classmethod
    def of(cls, scan: Callable, update: Callable) -> "VllmMambaAPI":
        scan_params = inspect.signature(scan).parameters
        update_params = inspect.signature(update).parameters
        null = update_params["null_block_id"].default if "null_block_id" in update_params else 0
        return cls(scan, update, "final_states_out" in scan_params, int(null))


_api: VllmMambaAPI | None = None


# ------------------------------------------------------------------------------- vLLM -> TK mapping


def scan_unsupported_reason(x: torch.Tensor, B: torch.Tensor, return_intermediate_states: bool) -> str | None:
    """Static reasons a prefill scan call goes to vLLM (TK's own argument checks come after)."""
    if return_intermediate_states:
        return "per-chunk intermediate states (Mamba prefix caching)"
    if x.dtype not in HALF_DTYPES:
        return f"x in {str(x.dtype).replace('torch.', '')}"
    if x.shape[-1] not in HEAD_DIMS:
        return f"headdim {x.shape[-1]}"
    if B.shape[-1] not in STATE_DIMS:
        return f"dstate {B.shape[-1]}"
    return None


def store_final_states(final_states: torch.Tensor, state_dtype: torch.dtype | None, C_dtype: torch.dtype,
                       final_states_out: torch.Tensor | None,
                       final_state_indices: torch.Tensor | None) -> torch.Tensor | None:
    """Hand TK's per-sequence float32 final states back the way vLLM's scan does: returned in state_dtype
    (C's dtype if None; the 0.26 mixer then writes them to its cache slots), or written to
    final_states_out[final_state_indices] and None returned (0.33)."""
    if final_states_out is None:
        return final_states.to(state_dtype if state_dtype is not None else C_dtype)
    if final_state_indices is None:
        raise ValueError("final_states_out needs final_state_indices")
    final_states_out[final_state_indices] = final_states.to(final_states_out.dtype)
    return None


def _same_slots(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def decode_slots(state_batch_indices: torch.Tensor | None, dst_state_batch_indices: torch.Tensor | None,
                 num_accepted_tokens: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor | None, str | None]:
    """vLLM's decode slot arguments -> (TK's state_batch_indices [batch], None) or (None, why not)."""
    if num_accepted_tokens is not None or cu_seqlens is not None:
        return None, "speculative decoding (several tokens per request)"
    if state_batch_indices is None:
        return (None, None) if dst_state_batch_indices is None else (None, "destination slots without sources")
    if dst_state_batch_indices is not None and not _same_slots(dst_state_batch_indices, state_batch_indices):
        return None, "distinct source and destination state slots (Mamba prefix caching 'all' mode)"
    slots = state_batch_indices
    if slots.dim() == 2:
        if slots.shape[1] != 1:
            return None, f"{slots.shape[1]} state slots per request (speculative decoding)"
        slots = slots[:, 0]
    if slots.dim() != 1:
        return None, f"state_batch_indices of shape {tuple(state_batch_indices.shape)}"
    return slots, None


# ----------------------------------------------------------------------------------------- dispatchers


def _require_api() -> VllmMambaAPI:
    if _api is None:
        raise RuntimeError("tk_backend.vllm.mamba is not installed (call install())")
    return _api


def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices,
                                     seq_idx, out, D=None, z=None, dt_bias=None, initial_states=None,
                                     dt_softplus=False, dt_limit=(0.0, math.inf), return_intermediate_states=False,
                                     state_dtype=None, final_states_out=None, final_state_indices=None):
    """vLLM's varlen SSD scan (its signature), on TK inside a TK layer's forward when TK takes the call."""
    api = _require_api()
    layer = _active_layer.get()
    if layer is None:
        STATS["vllm_scan"] += 1
    else:
        reason = scan_unsupported_reason(x, B, return_intermediate_states)
        if reason is None:
            try:
                _, final_states = mamba_chunk_scan_varlen(
                    x, dt, A, B, C, cu_seqlens, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                    initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit, out=out)
            except (TypeError, ValueError) as exc:  # TK's argument checks, raised before any launch
                reason = str(exc)
            else:
                STATS["tk_scan"] += 1
                return store_final_states(final_states, state_dtype, C.dtype, final_states_out, final_state_indices)
        STATS["fallback_scan"] += 1
        _log_once(f"scan:{reason}", logging.WARNING,
                  "tk_backend: Mamba-2 prefill scan falls back to vLLM's Triton kernels for %s", reason)
    extra = {}
    if final_states_out is not None or final_state_indices is not None:
        if not api.scan_takes_final_states_out:
            raise TypeError(f"this vLLM's {SCAN_NAME} takes no final_states_out")
        extra = dict(final_states_out=final_states_out, final_state_indices=final_state_indices)
    return api.scan(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx, out,
                    D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, dt_softplus=dt_softplus,
                    dt_limit=dt_limit, return_intermediate_states=return_intermediate_states,
                    state_dtype=state_dtype, **extra)


def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, state_batch_indices=None,
                           dst_state_batch_indices=None, null_block_id=None, out=None, num_accepted_tokens=None,
                           cu_seqlens=None, is_blackwell=False):
    """vLLM's decode state update (its signature; null_block_id None = vLLM's default), on TK inside a TK
    layer's forward when TK takes the call."""
    api = _require_api()
    if null_block_id is None:
        null_block_id = api.null_block_id
    layer = _active_layer.get()
    # reason None: one token a row, its slot read and written in place (vLLM passes dst = src then, not None)
    slots, reason = (None, "not a TK layer") if layer is None else \
        decode_slots(state_batch_indices, dst_state_batch_indices, num_accepted_tokens, cu_seqlens)
    if layer is None or not (_active_update.get() or (reason is None and tk_update_faster(state, x))):
        STATS["vllm_update"] += 1
    else:
        if reason is None:
            try:
                tk_selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                          dt_softplus=dt_softplus, state_batch_indices=slots,
                                          pad_slot_id=null_block_id, out=out)
            except (TypeError, ValueError) as exc:  # TK's argument checks, raised before any launch
                reason = str(exc)
            else:
                STATS["tk_update"] += 1
                return None
        STATS["fallback_update"] += 1
        _log_once(f"update:{reason}", logging.WARNING,
                  "tk_backend: Mamba-2 decode state update falls back to vLLM's kernels for %s", reason)
    return api.update(state, x, dt, A, B, C, D, dt_bias, z=z, dt_softplus=dt_softplus,
                      state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices,
                      null_block_id=null_block_id, out=out, num_accepted_tokens=num_accepted_tokens,
                      cu_seqlens=cu_seqlens, is_blackwell=is_blackwell)


class tk_layer:
    """Context manager: the dispatchers may use TK's ops while it is open (what TKMambaMixer2's forward does);
    the decode update only if `update`."""

    def __init__(self, name: str, update: bool = True):
        self.name, self.update, self._tokens = name, update, None

    def __enter__(self):
        self._tokens = (_active_layer.set(self.name), _active_update.set(self.update))
        return self

    def __exit__(self, *exc):
        _active_layer.reset(self._tokens[0])
        _active_update.reset(self._tokens[1])
        return False


# ---------------------------------------------------------------------------------------- the layer

TKMambaMixer2 = None  # the registered subclass, built by install() once vLLM's MambaMixer2 exists


def _has_layer_metadata(layer) -> bool:
    """False in the profile run (no metadata), where vLLM warms up and autotunes its own Triton kernels."""
    from vllm.forward_context import get_forward_context

    raw = get_forward_context().attn_metadata
    return isinstance(raw, dict) and raw.get(layer.prefix) is not None


def _make_mixer_class(base: type) -> type:
    class TKMambaMixer2(base):
        """MambaMixer2 whose SSD scan and decode update run on TK's kernels when enabled (tk_backend.vllm.mamba)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tk_ssd = _decide_for_layer(self)
            self.tk_update = self.tk_ssd and update_wanted(os.environ.get(ENV_VAR))

        def conv_ssm_forward(self, projected_states, output):
            if not (self.tk_ssd and _has_layer_metadata(self)):
                return super().conv_ssm_forward(projected_states=projected_states, output=output)
            with tk_layer(self.prefix, update=self.tk_update):
                return super().conv_ssm_forward(projected_states=projected_states, output=output)

    TKMambaMixer2.__module__ = __name__
    return TKMambaMixer2


# ------------------------------------------------------------------------------------ install / remove


def install(mixer_module=None) -> bool:
    """Swap the mixer module's two op references for the dispatchers and register TKMambaMixer2 (idempotent).
    Returns False, leaving vLLM untouched, when the module does not look like the one we read."""
    global _api, TKMambaMixer2
    module = mixer_module if mixer_module is not None else sys.modules.get(MIXER_MODULE)
    if module is None:
        import importlib

        module = importlib.import_module(MIXER_MODULE)
    scan, update = getattr(module, SCAN_NAME, None), getattr(module, UPDATE_NAME, None)
    base = getattr(module, MIXER_CLASS_NAME, None)
    if scan is None or update is None or base is None or not hasattr(base, "register_oot") \
            or not hasattr(base, "conv_ssm_forward"):
        logger.warning("tk_backend: %s lacks %s / %s / %s.register_oot; Mamba-2 stays on vLLM's kernels",
                       MIXER_MODULE, SCAN_NAME, UPDATE_NAME, MIXER_CLASS_NAME)
        return False
    if scan is not mamba_chunk_scan_combined_varlen or update is not selective_state_update:
        _api = VllmMambaAPI.of(scan, update)
        setattr(module, SCAN_NAME, mamba_chunk_scan_combined_varlen)
        setattr(module, UPDATE_NAME, selective_state_update)

    from vllm.model_executor.custom_op import op_registry_oot

    registered = op_registry_oot.get(MIXER_CLASS_NAME)
    if TKMambaMixer2 is None or TKMambaMixer2.__bases__[0] is not base:
        TKMambaMixer2 = _make_mixer_class(base)
    if registered is None:
        base.register_oot(TKMambaMixer2, name=MIXER_CLASS_NAME)
    elif registered.__name__ != "TKMambaMixer2":
        logger.warning("tk_backend: %s is already replaced out of tree by %s; TK's Mamba-2 ops stay off",
                       MIXER_CLASS_NAME, registered)
    return True


def uninstall() -> None:
    """Undo install(): vLLM's functions back in the mixer module, the out-of-tree registration removed."""
    global _api
    module = sys.modules.get(MIXER_MODULE)
    if module is not None and _api is not None:
        if getattr(module, SCAN_NAME, None) is mamba_chunk_scan_combined_varlen:
            setattr(module, SCAN_NAME, _api.scan)
        if getattr(module, UPDATE_NAME, None) is selective_state_update:
            setattr(module, UPDATE_NAME, _api.update)
    _api = None
    from vllm.model_executor.custom_op import op_registry_oot

    if TKMambaMixer2 is not None and op_registry_oot.get(MIXER_CLASS_NAME) is TKMambaMixer2:
        del op_registry_oot[MIXER_CLASS_NAME]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _InstallAfterImport)]


def installed() -> bool:
    module = sys.modules.get(MIXER_MODULE)
    return module is not None and getattr(module, SCAN_NAME, None) is mamba_chunk_scan_combined_varlen


class _InstallingLoader(importlib.abc.Loader):
    """Runs the mixer module's own loader, then install() on the fresh module."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            install(module)
        except Exception:  # noqa: BLE001 (never break vLLM's import; it then simply runs its own kernels)
            logger.exception("tk_backend: installing TK's Mamba-2 ops failed; vLLM's kernels stay in use")

    def __getattr__(self, name):  # get_source, get_filename, ... for tools that inspect the module
        return getattr(self.inner, name)


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds vLLM's mixer module with the normal path finder and wraps its loader (one module only)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MIXER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _InstallingLoader(spec.loader)
        return spec


def register() -> None:
    """Install now if vLLM's mixer module is loaded, else right after it is imported (cheap, idempotent)."""
    if sys.modules.get(MIXER_MODULE) is not None:
        install(sys.modules[MIXER_MODULE])
    elif not any(isinstance(f, _InstallAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


__all__ = ["ENV_VAR", "STATS", "TKMambaMixer2", "VllmMambaAPI", "decode_slots", "install", "installed",
           "mamba_chunk_scan_combined_varlen", "register", "scan_unsupported_reason", "selective_state_update",
           "store_final_states", "tk_layer", "uninstall", "wanted"]
