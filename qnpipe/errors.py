"""The few specific exception classes qnpipe raises. Each message names the file, key or value."""

from __future__ import annotations


class QnpipeError(Exception):
    """Base class of every error qnpipe raises on purpose."""


class ConfigError(QnpipeError, ValueError):
    """A configuration key or value is unknown or invalid (message names key, value, what is allowed)."""


class PluginError(ConfigError):
    """A plug-in (`pool.evict_policy = "package.module:Class"`) answered outside its protocol or raised.

    Raised before the answer is used: the message names the setting's value, the class, the
    method and the value it returned (or the error it raised), and what it was offered.
    """


class CheckpointError(QnpipeError):
    """A model directory or checkpoint file is missing, corrupt, or does not match its config."""


class TokenizerError(QnpipeError):
    """The tokenizer or chat template of a model directory cannot be loaded."""


class ChatError(QnpipeError, ValueError):
    """A chat request is malformed: the message names the message or tool (by index) and what is wrong."""


class SnapshotError(QnpipeError):
    """A prefix snapshot file is corrupt, truncated, of another format version or of another model (names the file)."""


class ReadError(QnpipeError):
    """An expert record could not be read intact (I/O error, short read, or checksum mismatch).

    Raised after one retry. The message and the attributes name the expert (`layer`,
    `expert`), the file (`path`) and the byte range (`offset`, `nbytes`); `reason` says
    what went wrong. The destination buffer's contents are undefined after this error.
    """

    def __init__(self, reason: str, *, layer: int, expert: int, path: str, offset: int, nbytes: int) -> None:
        self.reason = reason
        self.layer = layer
        self.expert = expert
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        super().__init__(
            f"cannot read expert {expert} of layer {layer}: {reason} "
            f"(file {path}, offset {offset}, {nbytes} bytes)"
        )


class StoreError(QnpipeError):
    """An expert store (`experts/` of a qnpipe model directory) is missing, corrupt, or from another model.

    The message names the file and, for a bad record, the layer, expert and byte offset.
    """


class CapacityError(QnpipeError, ValueError):
    """A layer's expert pool cannot hold what is asked of it (the message names the layer and the numbers)."""


class RouteError(QnpipeError, AssertionError):
    """Route verification failed: a token read a slot that does not hold the expert it routed to."""


class StallError(QnpipeError, RuntimeError):
    """The pipeline made no progress for `diag.watchdog_s` seconds; the message holds every actor's statistics."""


class PipelineError(QnpipeError, RuntimeError):
    """The expert pipeline stopped (an actor failed); the engine must be reopened."""


class OutputError(QnpipeError):
    """An output directory (`convert --out`, `make-tiny OUT`) cannot be created or written; names path and reason."""


class TraceSchemaError(QnpipeError):
    """An event log is of a newer schema, truncated or corrupt; the message names the file and the record number."""


class DeviceProfileError(QnpipeError):
    """A device profile file (`qnpipe bench io`) is missing, corrupt or invalid; the message names the file."""


class TraceImportError(QnpipeError):
    """Another tool's routing log cannot be imported; the message names the file, the line or record, and what was wrong."""


class InputFileError(QnpipeError):
    """An input file is missing, not a regular file (a FIFO, a device, a directory), too large or unreadable; names the file."""


class DistributedError(QnpipeError, RuntimeError):
    """Pipeline parallel: another rank was lost, hangs, or runs another model or version (names the rank)."""


def root_cause(e: BaseException) -> BaseException:
    """The first real error inside nested exception groups (trio's nurseries wrap what their tasks
    raise, next to the other tasks' Cancelled, which is never the cause)."""
    while isinstance(e, BaseExceptionGroup):
        # trio.Cancelled by name: this module imports nothing (everything imports it)
        real = [x for x in e.exceptions if type(x).__name__ != "Cancelled"]
        e = (real or list(e.exceptions))[0]
    return e
