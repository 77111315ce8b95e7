"""The engine's figures as the lines `qnpipe generate --stats` prints (and `Engine.summary()` returns)."""

from __future__ import annotations

from qnpipe.stats import EngineStats


def engine_lines(st: EngineStats) -> list[str]:
    """BLAS, the expert source, and with a pool its hits, misses by cause, reads, stall and occupancy."""
    out = [f"[{st.cpu_blas.describe()}]"] if st.cpu_blas is not None else []
    p = st.pool
    if p is None:
        return [*out, f"[experts: {st.expert_source}, {st.resident_expert_bytes / 2**20:.1f} MiB in memory]"]
    causes = ", ".join(f"{k} {v}" for k, v in sorted(p.misses_by_cause.items()))
    occ = " ".join(f"{ly.layer}:{ly.occupancy}/{ly.capacity}" for ly in p.layers)
    return [*out,
            f"[experts: pool, {p.slot_bytes / 2**20:.1f} MiB of slots; hits {p.hits}, misses {p.misses} ({causes}), "
            f"hit rate {p.hit_rate:.3f}; {p.reads} reads, {p.bytes_read / 2**20:.1f} MiB read, "
            f"stall {p.stall_s:.3f}s; {p.split_layer_steps} layer-steps in parts; {p.early_grants} early grants]",
            f"[occupancy {occ}]"]


def summary_lines(st: EngineStats) -> list[str]:
    """The totals since the engine opened, then `engine_lines`."""
    prefill = f"{st.prompt_tokens / st.prefill_s:.1f} tok/s" if st.prefill_s > 0 else "-"
    return [f"[loaded in {st.load_s:.2f}s, warm-up {st.warmup_s:.2f}s; {st.requests} requests: "
            f"{st.prompt_tokens} prompt tokens in {st.prefill_s:.2f}s ({prefill}); "
            f"{st.generated_tokens} generated, decode {st.decode_tok_s:.1f} tok/s; "
            f"peak memory {st.peak_memory_bytes / 2**20:.0f} MiB]", *engine_lines(st)]
