"""Pure, synchronous decision logic of the pipeline: slot tables, eviction, the read queue.

Nothing here imports trio, MLX or the I/O layer (tests/test_layering.py checks it), so
every decision can be driven and checked directly, without a clock or a device.
"""
