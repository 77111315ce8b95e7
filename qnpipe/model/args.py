"""ModelArgs: the foreign `config.json` of a Qwen3-Next checkpoint, read leniently (known keys only)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.errors import CheckpointError, StoreError
from qnpipe.io.files import CONFIG_CAP, read_capped

MODEL_TYPE = "qwen3_next"


class ModelArgs(msgspec.Struct, frozen=True, kw_only=True):
    """Shape and numerics of one Qwen3-Next model (docs/model.md, "Configuration")."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int = 262144
    intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    full_attention_interval: int = 4
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def is_linear(self, layer: int) -> bool:
        """True for Gated DeltaNet layers, False for gated full attention."""
        return (layer + 1) % self.full_attention_interval != 0

    def is_moe(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_dims(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each routed-expert projection: gate/up [I, H], down [H, I]."""
        hidden, inter = self.hidden_size, self.moe_intermediate_size
        return {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_hidden_layers) if self.is_moe(layer))


_FIELDS = set(ModelArgs.__struct_fields__)


def _required() -> set[str]:
    n_defaults = len(ModelArgs.__struct_defaults__)
    return set(ModelArgs.__struct_fields__[: len(ModelArgs.__struct_fields__) - n_defaults])


def args_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Build ModelArgs from a config dict, keeping known keys (as mlx-lm does).

    Raises CheckpointError naming `source` and the key when the model type is not
    qwen3_next, a required key is missing, or a value has the wrong type.
    """
    if "model_type" not in raw:
        raise CheckpointError(f"{source}: model_type is missing; qnpipe runs only {MODEL_TYPE!r} models")
    mt = raw.get("model_type")
    if mt != MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type is {mt!r}; qnpipe runs only {MODEL_TYPE!r} models")
    params = dict(raw)
    # transformers >= 5 may fold rope settings into rope_parameters; accept both forms.
    rp = raw.get("rope_parameters") or {}
    for k in ("rope_theta", "partial_rotary_factor"):
        if k not in params and k in rp:
            params[k] = rp[k]
    missing = sorted(_required() - params.keys())
    if missing:
        raise CheckpointError(f"{source}: missing required key(s) {', '.join(missing)}")
    kept = {k: v for k, v in params.items() if k in _FIELDS}
    if isinstance(kept.get("eos_token_id"), list):
        kept["eos_token_id"] = tuple(kept["eos_token_id"])
    try:
        args = msgspec.convert(kept, ModelArgs)
    except msgspec.ValidationError as e:
        raise CheckpointError(f"{source}: {e}") from None
    _check_ranges(args, source)
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise CheckpointError(
            f"{source}: linear_num_value_heads ({args.linear_num_value_heads}) must be a multiple "
            f"of linear_num_key_heads ({args.linear_num_key_heads})"
        )
    if args.num_attention_heads % args.num_key_value_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({args.num_attention_heads}) must be a multiple "
            f"of num_key_value_heads ({args.num_key_value_heads})"
        )
    return args


# Sizes that must be >= 1 (0 would divide by zero or build an empty model).
_POSITIVE = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "vocab_size", "max_position_embeddings", "full_attention_interval",
    "decoder_sparse_step",
)
_NON_NEGATIVE = ("num_experts", "shared_expert_intermediate_size", "intermediate_size")

# Upper bounds, checked before anything is sized from them: each far above any real model (the
# 80B: hidden 2048, 48 layers, 512 experts, vocab 151,936; the largest open models stay within a
# tenth of these) and small enough that no array dimension or product of two overflows MLX's
# int32 shapes, so a config.json of 10**12 experts is an error naming the key, not an allocation.
_AT_MOST = {
    "hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
    "head_dim": 4096, "linear_num_value_heads": 1024, "linear_num_key_heads": 1024, "linear_key_head_dim": 4096,
    "linear_value_head_dim": 4096, "linear_conv_kernel_dim": 1024, "num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16, "moe_intermediate_size": 1 << 18, "shared_expert_intermediate_size": 1 << 18,
    "intermediate_size": 1 << 18, "vocab_size": 1 << 22, "max_position_embeddings": 1 << 31,
    "full_attention_interval": 1024, "decoder_sparse_step": 1024,
}


def _check_ranges(args: ModelArgs, source: str) -> None:
    """Impossible sizes are refused here, naming the key and the value, not deep inside MLX."""
    def bad(key: str, need: str) -> CheckpointError:
        return CheckpointError(f"{source}: {key} is {getattr(args, key)!r}; it must be {need}")

    for key in _POSITIVE:
        if getattr(args, key) < 1:
            raise bad(key, "a positive integer")
    for key in _NON_NEGATIVE:
        if getattr(args, key) < 0:
            raise bad(key, ">= 0")
    for key, most in _AT_MOST.items():
        if getattr(args, key) > most:
            raise bad(key, f"at most {most} (qnpipe's bound for this size)")
    if args.num_experts > 0:
        if not 1 <= args.num_experts_per_tok <= args.num_experts:
            raise bad("num_experts_per_tok", f"in 1..num_experts ({args.num_experts})")
        if args.moe_intermediate_size < 1:
            raise bad("moe_intermediate_size", "a positive integer")
    for key in ("rms_norm_eps", "rope_theta"):
        v = getattr(args, key)
        if not v > 0 or v == float("inf"):
            raise bad(key, "a positive finite number")
    if not 0 < args.partial_rotary_factor <= 1:
        raise bad("partial_rotary_factor", "in (0, 1]")
    bad_layers = [layer for layer in args.mlp_only_layers if not 0 <= layer < args.num_hidden_layers]
    if bad_layers:
        raise CheckpointError(f"{source}: mlp_only_layers has {bad_layers[0]}, not a layer of "
                              f"0..{args.num_hidden_layers - 1}")


def read_config(model_dir: Path) -> dict[str, Any]:
    """Read `model_dir/config.json` as a dict, with errors naming the file."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if model_dir.exists() and not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: is a file, not a model directory (give the directory holding "
                              f"config.json and the weights)")
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: not found (is {model_dir} a model directory?)")
    data = read_capped(path, CONFIG_CAP, error=CheckpointError)
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


# ModelArgs fields that decide the shape of some tensor; their sha256 is the store's model id.
SHAPE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "intermediate_size", "vocab_size", "full_attention_interval",
    "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings",
)


def model_id(config: ModelArgs | Mapping[str, Any] | Any) -> str:
    """sha256 (hex) of the model's shape keys (`SHAPE_KEYS`), from ModelArgs or a config.json dict.

    Two checkpoints of the same architecture and size share it; a store built for a model of
    another shape does not. A generic-tier model's args (qnpipe.model.family.load.FamilyArgs) carry
    their own (the skeleton's: qnpipe.model.family.skeleton.skeleton_id).
    """
    if not isinstance(config, ModelArgs | Mapping):
        return str(config.model_id)
    args = config if isinstance(config, ModelArgs) else args_from_dict(dict(config))
    keys = {k: getattr(args, k) for k in SHAPE_KEYS}
    keys["mlp_only_layers"] = sorted(keys["mlp_only_layers"])
    return hashlib.sha256(json.dumps(keys, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_model_id(model_dir: Path) -> str | None:
    """The model id from `model_dir/config.json`, or None when there is no readable config there."""
    if not os.path.lexists(Path(model_dir) / "config.json"):  # a FIFO or a directory there is read_config's error
        return None
    try:
        return model_id(read_config(Path(model_dir)))
    except CheckpointError as e:
        raise StoreError(str(e)) from None


def store_sha256(config: Mapping[str, Any], config_path: str | Path) -> str | None:
    """The sha256 (hex) of the expert store's `index.json` that `qnpipe convert` wrote with this model
    (config.json `qnpipe.experts.index_sha256`), or None for a directory converted before it was recorded.

    The model id names a shape; this names the store, so another model's store of the same shape
    is refused (docs/store-format.md). CheckpointError naming config.json for a value that is not one."""
    section = config.get("qnpipe")
    experts = section.get("experts") if isinstance(section, dict) else None
    value = experts.get("index_sha256") if isinstance(experts, dict) else None
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise CheckpointError(f"{config_path}: qnpipe.experts.index_sha256 is {json.dumps(value)[:80]}, "
                              f"not a sha256 (64 lowercase hex digits)")
    return value
