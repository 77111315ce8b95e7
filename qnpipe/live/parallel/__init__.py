"""Pipeline parallel over `mx.distributed` (docs/distributed.md).

Each rank runs a contiguous range of decoder layers (qnpipe.model.stage) with its own pool and
actors; the hidden state goes rank to rank with `mx.distributed.send` / `recv` and the step's
value (a token, logits) comes back to rank 0. Rank 0 runs the ordinary decoding loops with a
ring tail (`lead`); the other ranks serve steps (`follow`) until rank 0 closes.
"""
