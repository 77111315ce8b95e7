"""`qnpipe serve`: an OpenAI-compatible HTTP server on the engine's trio world (docs/server.md).

hypercorn's trio worker runs in the same trio run as the engine's actors; Starlette (on
trio through anyio) routes; msgspec decodes and encodes the bodies. Modules: schemas (the
bodies), jobs (request checks -> a Job), textgate (stop strings, tool-call holdback),
tool_calls (model output -> OpenAI tool calls), scheduling (one at a time, bounded FIFO),
generation (the response that runs a Job), metrics (Prometheus text), app (routes, auth),
run (serve / run_server).
"""
