"""Which of mlx-lm's MoE families qnpipe runs, and what each supports.

Every mlx-lm model file that builds a `SwitchGLU`/`SwitchMLP` is here, either tested (it has a
tiny config in `qnpipe.model.family.tiny.CONFIGS`: the tests build it, find its switches and
run it) or unsupported with the reason. tests/families/test_registry.py scans the installed
mlx-lm, so an upgrade that adds a family fails there until it is listed. Plain data, no MLX:
the CLI lists the families from here without loading MLX.
"""

from __future__ import annotations

__all__ = ["FIRST", "NATIVE_ONLY", "NO_PREDICTIONS", "NO_SNAPSHOTS", "TESTED", "UNSUPPORTED", "family_table", "predictions"]

# The families end-to-end tests come first for (families.md §6), in that order.
FIRST = ("qwen3_moe", "gpt_oss", "glm4_moe", "qwen3_5_moe", "deepseek_v3", "minimax", "llama4", "mixtral")

# model_type of every tiny config (the keys of tiny.CONFIGS; the registry test holds them equal).
TESTED: tuple[str, ...] = FIRST + tuple(sorted((
    "Klear", "afmoe", "bailing_hybrid", "bailing_moe", "bailing_moe_linear", "bailing_moe_v3", "deepseek",
    "deepseek_v2", "deepseek_v32", "deepseek_v41", "dots1", "ernie4_5_moe", "exaone_moe", "gemma4_text",
    "glm4_moe_lite", "granitemoe", "granitemoehybrid", "hunyuan", "jamba", "kimi_k3", "kimi_linear", "laguna",
    "lfm2_moe", "longcat_flash", "mellum", "mimo_v2_flash", "minimax_m3_vl", "mistral4", "nemotron_h", "olmoe",
    "phimoe", "phixtral", "qwen2_moe", "qwen3_next", "step3p5"), key=str.lower))

# mlx-lm model files (mlx_lm/models/<name>.py) qnpipe does not run, and why.
UNSUPPORTED: dict[str, str] = {
    "muse_spark": "its attention runs a Metal kernel (mlx_lm.kernels.qk_norm_rope), so it has no CPU forward "
                  "to test against here",
    "dbrx": "no SwitchGLU/SwitchMLP: its experts are a Python list of per-expert MLPs, run token by token",
}

# Families whose router cannot be applied to a layer's input to predict the next layers' experts.
NO_PREDICTIONS: dict[str, str] = {
    "llama4": "the switch sees x * sigmoid(score), not the block input",
    "gemma4_text": "the router reads another norm of the input than the switch, beside a dense MLP",
    "nemotron_h": "the switch input is latent (fc1_latent_proj)",
    "kimi_k3": "the switch input is latent (routed_expert_down_proj)",
    "deepseek_v41": "the MoE input is mixed from hyper-connection streams, not one residual",
}

# Families whose cache kind has no prefix-snapshot kind (and no planner line): refused by name.
NO_SNAPSHOTS: dict[str, str] = {
    "deepseek_v41": "its LayerCache (a sliding window plus compressed groups and index keys) has no snapshot kind yet",
}

# What runs on the native Qwen3-Next path only: on another family each is a ConfigError.
NATIVE_ONLY = ("MTP", "rotated KV quantization", "--distributed")


def predictions(model_type: str) -> str:
    """"yes", or "no: <why>" (prediction and prefetch off for that family, said once)."""
    why = NO_PREDICTIONS.get(model_type)
    return "yes" if why is None else f"no: {why}"


def family_table() -> str:
    """The markdown table of docs/model.md's "Supported families" (a test holds the two equal)."""
    rows = ["| model_type | Status | Predictions | MTP, rotated KV, --distributed |", "|---|---|---|---|"]
    for t in TESTED:
        native = "yes (native path)" if t == "qwen3_next" else "no"
        status = "tested" if t not in NO_SNAPSHOTS else f"tested; no prefix snapshots: {NO_SNAPSHOTS[t]}"
        rows.append(f"| `{t}` | {status} | {predictions(t)} | {native} |")
    rows += [f"| `{m}` | unsupported: {why} | | |" for m, why in sorted(UNSUPPORTED.items())]
    return "\n".join(rows)
