"""Qwen3-Next in MLX: model, experts by slot, checkpoint loading. Never imports trio."""
