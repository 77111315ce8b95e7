"""The few specific exception classes qnpipe raises. Each message names the file, key or value."""

from __future__ import annotations


class QnpipeError(Exception):
    """Base class of every error qnpipe raises on purpose."""


class ConfigError(QnpipeError, ValueError):
    """A configuration key or value is unknown or invalid (message names key, value, what is allowed)."""


class CheckpointError(QnpipeError):
    """A model directory or checkpoint file is missing, corrupt, or does not match its config."""


class TokenizerError(QnpipeError):
    """The tokenizer or chat template of a model directory cannot be loaded."""
