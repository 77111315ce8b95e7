"""MTP self-speculative decoding: draft with the MTP head, verify with the main model, roll back.

Part of the live engine (it drives the forward and the MLX thread, in trio): `engine` is the
entry (`speculate`), `loop` the draft/verify rounds, `state` the rollback of caches, `tree`
the draft tree, `sampling` the lossless acceptance, `mtp_store` the MTP head's experts.
"""
