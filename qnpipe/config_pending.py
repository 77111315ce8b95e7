"""Config fields whose feature does not exist yet, each with the feature's name (data only).

``qnpipe.config`` warns once per process (``NotImplementedConfigWarning``) when one of these
is set away from its default, so ``Engine(d, mtp=True)`` says that MTP is not there yet
instead of ignoring it. Whoever wires a field removes its entry here; tests/test_config_consumers.py
fails while a field has neither a consumer in the code nor an entry, or has both.
"""

from __future__ import annotations

from collections.abc import Mapping

# The feature names, shared so that one feature's warnings read the same.
STREAMING_POOL = "the streaming expert pool (issue 9)"
SIDE_REGION = "the pool's side region (speculative slots)"
PREFETCH = "routing prediction and prefetch (predictor, read_scheduler)"
PREFIX = "prefix snapshots"
MTP = "MTP self-speculative decoding"
KV_QUANT = "KV-cache quantization"
PROBES = "the diagnostic probes (recorder's event log)"
MEMORY = "MLX memory limits (the engine does not set them yet)"
LOADER_PATHS = "the loader (it reads <model_dir>/config.json and <model_dir>/mtp.safetensors)"
CHAT_TOOLS = "tool filtering of the chat template"

NOT_YET_IMPLEMENTED: Mapping[str, str] = {
    # -- later features
    "model.config_path": LOADER_PATHS,
    "model.hidden_variant": MTP,
    "memory.mlx_wired_limit_gb": MEMORY,
    "pool.side_region_zerocopy": SIDE_REGION,
    "predict.candidate_mult": PREFETCH,
    "prefix.snapshot_head_tokens": PREFIX,
    "prefix.max_entries": PREFIX,
    "chat.tools_allow": CHAT_TOOLS,
    **{f"kv.{f}": KV_QUANT for f in ("quantize", "k_bits", "v_bits", "group_size", "rotate", "rot_seed")},
    **{f"diag.{f}": PROBES for f in (
        "window_prof", "stream_prof", "prefetch_tprof", "miss_attrib")},
}
