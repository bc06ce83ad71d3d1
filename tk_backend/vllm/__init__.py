"""vLLM integration: the TK attention backend, chosen with `--attention-backend TK` (or `CUSTOM`).

vLLM calls `register` (entry point group `vllm.general_plugins`, declared in pyproject.toml) in every process it
starts: the front end, the engine core and each worker. It must therefore be idempotent and cheap.

Why "TK" is an alias of the CUSTOM member rather than a member of its own: vLLM pickles its config, the
chosen backend included, into spawned engine and worker processes and unpickles it *before* those processes
load plugins. A member added at run time (`AttentionBackendEnum.register`, in 0.33, not in 0.26) does not exist
yet at that point, and vLLM 0.26 cannot add members at all. CUSTOM always exists, pickles as itself, and resolves
to our class once the plugin has run, so `TK`, `tk` and `CUSTOM` select the same backend under fork and spawn.

Since TK is CUSTOM to vLLM, vLLM's own "Selected backend AttentionBackendEnum.CUSTOM is not valid" would name the
member, not TK: the backend's validate_configuration raises its own sentence instead (backend.py).

Importing this package registers too, so `LLM(..., attention_config={"backend": "TK"})` works in a script
that imported `tk_backend.vllm` first (vLLM parses that dict before it loads plugins);
`LLM(..., attention_backend="TK")` and `vllm serve --attention-backend TK` need no import.
"""
from __future__ import annotations

import logging

BACKEND_NAME = "TK"
BACKEND_CLASS_PATH = "tk_backend.vllm.backend.TKAttentionBackend"

logger = logging.getLogger(__name__)


def register() -> None:
    """Make CUSTOM resolve to the TK backend and "TK" an alias of CUSTOM (safe to call any number of times)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from tk_backend.vllm import compat

    compat.require_supported_vllm()
    custom = AttentionBackendEnum.CUSTOM
    previous = custom.get_path() if custom.is_overridden() else None
    if previous not in (None, BACKEND_CLASS_PATH):
        logger.warning("tk_backend: AttentionBackendEnum.CUSTOM pointed to %s; it now selects %s",
                       previous, BACKEND_CLASS_PATH)
    register_backend(custom, BACKEND_CLASS_PATH)

    members = AttentionBackendEnum._member_map_
    existing = members.get(BACKEND_NAME)
    if existing is None:
        # An alias: name lookups (AttentionBackendEnum["TK"], what --attention-backend does) find CUSTOM, while
        # iteration and pickling still see only CUSTOM. Set the attribute first: Enum forbids reassigning a name
        # that is already a member.
        type.__setattr__(AttentionBackendEnum, BACKEND_NAME, custom)
        members[BACKEND_NAME] = custom
    elif existing is not custom:
        raise RuntimeError(
            f"AttentionBackendEnum already has a member {BACKEND_NAME!r} ({existing.value!r}) that is not the TK "
            f"backend; another plugin took the name. Select the TK backend with --attention-backend CUSTOM."
        )

    # The optional integrations below must never take the attention backend down with them: a failure is
    # logged with its reason and only that integration is missing.
    # Mamba-2: MambaMixer2's SSD scan on TK's kernels when this backend is selected (the state update too with
    # TK_MAMBA=1); installed once vLLM imports its mixer module. See mamba.py.
    try:
        from tk_backend.vllm import mamba

        mamba.register()
    except Exception as exc:  # noqa: BLE001
        logger.warning("tk_backend: the Mamba-2 mixer integration is unavailable (%s: %s)", type(exc).__name__, exc)

    # Out-of-tree models (Based): registered by path, imported only when vLLM loads one. See model_registry.py.
    try:
        from tk_backend.vllm.model_registry import register_models

        register_models()
    except Exception as exc:  # noqa: BLE001
        logger.warning("tk_backend: out-of-tree models are not registered (%s: %s)", type(exc).__name__, exc)


register()

__all__ = ["BACKEND_CLASS_PATH", "BACKEND_NAME", "register"]
