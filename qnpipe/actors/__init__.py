"""The pipeline's actors: thin trio shells around policy objects (qnpipe.policy), and their wiring.

Each actor is one async function that owns its channel ends, takes its settings as keyword
arguments, and reports `task_status.started()` once it listens: `forward` (the step loop),
`pool` (slots), `read_scheduler` (reads), `predictor` (prefetch hints), `recorder` (the routing
log). `pipeline` wires them (`open_pipeline`) and `autopin` keeps the heat file. Actors import
trio, qnpipe.policy, qnpipe.io and qnpipe.messages, never MLX: the model is behind the forward's
`Backend`, so replay's actor driver (qnpipe.replay.actor_driver, `--driver actors`) runs these same
actors without a model; replay's default fast driver runs the policies' cores without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qnpipe.actors.autopin import Autopin
    from qnpipe.actors.forward import Backend, Forward, ForwardStats
    from qnpipe.actors.pipeline import Pipeline, make_policy, open_pipeline
    from qnpipe.actors.recorder import Emitter, RecorderStats, open_recording
    from qnpipe.policy.build import layer_capacities

# Loaded on first use, not here: qnpipe.messages and the policies import nothing of this package,
# but importing it eagerly would start every actor's imports for a caller that wants one.
_LAZY = {
    "Pipeline": "qnpipe.actors.pipeline",
    "open_pipeline": "qnpipe.actors.pipeline",
    "make_policy": "qnpipe.actors.pipeline",
    "layer_capacities": "qnpipe.policy.build",  # the policy's now; kept here for callers of the old path
    "Autopin": "qnpipe.actors.autopin",
    "Backend": "qnpipe.actors.forward",
    "Forward": "qnpipe.actors.forward",
    "ForwardStats": "qnpipe.actors.forward",
    "Emitter": "qnpipe.actors.recorder",
    "RecorderStats": "qnpipe.actors.recorder",
    "open_recording": "qnpipe.actors.recorder",
}
__all__ = [
    "Autopin", "Backend", "Emitter", "Forward", "ForwardStats", "Pipeline", "RecorderStats", "layer_capacities",
    "make_policy", "open_pipeline", "open_recording",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
