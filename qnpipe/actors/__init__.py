"""The pipeline's actors: thin trio shells around policy objects (qnpipe.policy).

Each actor is one async function that owns its channel ends, takes its settings as
keyword arguments, and reports `task_status.started()` once it listens. The wiring of
all of them is in qnpipe.engine.
"""
