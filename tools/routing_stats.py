"""Routing and MTP statistics of a Qwen3-Next model directory on held-out text; prints JSON.

The main model runs in MLX through qnpipe's loader (``qnpipe.model.load.load_model``); the routed
experts of every MoE layer are recorded by wrapping its expert source. The MTP head (see
docs/model.md, "MTP head") is computed here in NumPy (float64) from the checkpoint's ``mtp.*`` tensors and the model's
``embed_tokens`` / ``lm_head``.

Per MoE layer:
  * ``top10_share``: share of all routings taken by the most popular 10% of experts (ceil(E/10));
    uniform routing gives ceil(E/10)/E.
  * ``norm_entropy``: entropy of the expert popularity / log(E) (1.0 = uniform).
  * ``reuse4``: fraction of (token, layer) expert picks that one of the previous 4 tokens of the same
    sequence also picked in that layer (tokens with 4 predecessors only). ``reuse4_uniform`` is the
    value for uniformly random top-k routing, 1 - (1 - k/E)^4; ``reuse4_independent`` the value if each
    token drew its experts independently with the measured popularity (locality beyond popularity
    shows as reuse4 > reuse4_independent).
MTP: ``mtp_accept_greedy`` = fraction of rows t where argmax of the MTP logits (hidden at t, true
token t+1) equals the main model's argmax at t+1, i.e. greedy first-draft acceptance;
``mtp_top1_vs_text`` its accuracy against the true token t+2; ``main_top1`` the model's next-token
accuracy.

Held-out text (default): the stdlib files that tools/train_tiny.py holds out (every 20th file),
cut into windows of --seq-len tokens taken round-robin over the files (so no single file dominates),
each run from a fresh state.

Usage: python tools/routing_stats.py [MODEL_DIR] [--tokens 16384] [--seq-len 512] [--text FILE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

TOOLS = Path(__file__).resolve().parent
DEFAULT_MODEL = TOOLS.parent / "qnpipe" / "data" / "tiny_trained"


# --------------------------------------------------------------------------- MTP in NumPy (docs/model.md, "MTP head")

def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class NumpyMTP:
    """One MTP layer from HF-named ``mtp.*`` tensors (zero-centred norms stored as w, applied as 1 + w)."""

    def __init__(self, mtp: dict[str, np.ndarray], embed: np.ndarray, head: np.ndarray, cfg: dict[str, Any]):
        self.W = {k: v.astype(np.float64) for k, v in mtp.items()}
        self.embed, self.head, self.c = embed.astype(np.float64), head.astype(np.float64), cfg
        self.eps = cfg["rms_norm_eps"]

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return _rms(x, self.eps) * (1.0 + self.W[name])

    def attention(self, x: np.ndarray, p: str, pos: np.ndarray) -> np.ndarray:
        c, W = self.c, self.W
        T = x.shape[0]
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        y = (x @ W[p + "q_proj.weight"].T).reshape(T, nh, 2 * hd)
        q, gate = y[..., :hd], y[..., hd:].reshape(T, nh * hd)  # per head [query | gate]
        k = (x @ W[p + "k_proj.weight"].T).reshape(T, nkv, hd)
        v = (x @ W[p + "v_proj.weight"].T).reshape(T, nkv, hd)
        q, k = self.norm(q, p + "q_norm.weight"), self.norm(k, p + "k_norm.weight")
        rot = int(hd * c["partial_rotary_factor"])
        half = rot // 2
        ang = pos[:, None] * float(c["rope_theta"]) ** (-np.arange(half) * 2.0 / rot)[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        for t in (q, k):  # rotate-half pairing on the first `rot` dims, in place
            a, b = t[..., :half].copy(), t[..., half:rot].copy()
            t[..., :half], t[..., half:rot] = a * cos - b * sin, b * cos + a * sin
        mask = np.tril(np.ones((T, T), dtype=bool))
        out = np.empty((T, nh, hd))
        for h in range(nh):
            j = h // (nh // nkv)
            s = np.where(mask, q[:, h] @ k[:, j].T / math.sqrt(hd), -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, j]
        return (out.reshape(T, nh * hd) * _sigmoid(gate)) @ W[p + "o_proj.weight"].T

    def moe(self, x: np.ndarray, p: str) -> np.ndarray:
        c, W = self.c, self.W
        logits = x @ W[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        k = c["num_experts_per_tok"]
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, idx, -1)
        if c["norm_topk_prob"]:
            w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            q = p + f"experts.{e}."
            xe = x[rows]
            h = _silu(xe @ W[q + "gate_proj.weight"].T) * (xe @ W[q + "up_proj.weight"].T)
            out[rows] += w[rows, slot][:, None] * (h @ W[q + "down_proj.weight"].T)
        q = p + "shared_expert."
        sh = (_silu(x @ W[q + "gate_proj.weight"].T) * (x @ W[q + "up_proj.weight"].T)) @ W[q + "down_proj.weight"].T
        return out + _sigmoid(x @ W[p + "shared_expert_gate.weight"].T) * sh

    def __call__(self, hidden: np.ndarray, next_tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Draft logits for t+2 of rows t: hidden = main post-norm hidden at t, next_tokens = token t+1."""
        e = self.norm(self.embed[next_tokens], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden.astype(np.float64), "mtp.pre_fc_norm_hidden.weight")
        x = np.concatenate([e, h], axis=-1) @ self.W["mtp.fc.weight"].T  # embedding half first
        p = "mtp.layers.0."
        x = x + self.attention(self.norm(x, p + "input_layernorm.weight"), p + "self_attn.", pos)
        x = x + self.moe(self.norm(x, p + "post_attention_layernorm.weight"), p + "mlp.")
        return self.norm(x, "mtp.norm.weight") @ self.head.T


# --------------------------------------------------------------------------- statistics

def routing_summary(picks: np.ndarray, E: int) -> dict[str, float]:
    """picks [S, T, k] expert ids of one layer for S sequences of T tokens."""
    S, T, k = picks.shape
    counts = np.bincount(picks.reshape(-1), minlength=E).astype(np.float64)
    p = counts / counts.sum()
    top = math.ceil(E / 10)
    nz = p[p > 0]
    hit = []
    for t in range(4, T):
        prev = picks[:, t - 4:t].reshape(S, 1, -1)  # [S, 1, 4k]
        hit.append((picks[:, t, :, None] == prev).any(-1))  # [S, k]
    reuse = float(np.mean(hit)) if hit else float("nan")
    q = np.clip(counts / (S * T), 0.0, 1.0)  # probability a token picks e
    indep = float(np.sum(p * (1.0 - (1.0 - q) ** 4)))
    return {
        "top10_share": round(float(np.sort(p)[::-1][:top].sum()), 4),
        "top10_share_uniform": round(top / E, 4),
        "norm_entropy": round(float(-(nz * np.log(nz)).sum() / math.log(E)), 4),
        "max_share": round(float(p.max()), 4),
        "unused_experts": int((counts == 0).sum()),
        "reuse4": round(reuse, 4),
        "reuse4_uniform": round(1.0 - (1.0 - k / E) ** 4, 4),
        "reuse4_independent": round(indep, 4),
    }


class Recorder:
    """Expert source that records each MoE layer's picks, then runs the real experts."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.picks: dict[int, list[np.ndarray]] = {}

    def __call__(self, layer: int, x: Any, experts: Any) -> Any:
        import mlx.core as mx

        mx.eval(experts)
        self.picks.setdefault(layer, []).append(np.array(experts).reshape(-1, experts.shape[-1]))
        return self.inner(layer, x, experts)


def sequences(docs: list[list[int]], n_tokens: int, seq_len: int) -> np.ndarray:
    """[S, seq_len] token windows taken round-robin over the documents (each cut into whole windows)."""
    per_doc = [[d[i:i + seq_len] for i in range(0, len(d) - seq_len + 1, seq_len)] for d in docs]
    out: list[list[int]] = []
    depth = 0
    while len(out) * seq_len < n_tokens and any(depth < len(w) for w in per_doc):
        out += [w[depth] for w in per_doc if depth < len(w)]
        depth += 1
    if not out:
        raise SystemExit(f"no document has {seq_len} tokens; lower --seq-len")
    return np.asarray(out[: max(1, n_tokens // seq_len)], dtype=np.int64)


def held_out_text() -> list[str]:
    sys.path.insert(0, str(TOOLS))
    import train_tiny

    _, val = train_tiny.split_files(train_tiny.stdlib_files())
    return [train_tiny.read(p) for p in val]


def run(model_dir: Path, texts: list[str], n_tokens: int, seq_len: int) -> dict[str, Any]:
    import mlx.core as mx
    from tokenizers import Tokenizer

    from qnpipe.model.load import load_model

    lm = load_model(model_dir)
    cfg = lm.config
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    seqs = sequences([tok.encode(t, add_special_tokens=False).ids for t in texts], n_tokens, seq_len)
    n_seq = len(seqs)

    rec = Recorder(lm.experts)
    lm.model.attach_experts(rec)
    mtp = None
    if lm.mtp_weights:
        # The loader keeps mtp.* aside as MLX arrays; read them in float64 for the NumPy MTP.
        mtp_np = {k: np.array(v.astype(mx.float32)) for k, v in lm.mtp_weights.items()}
        head = lm.model.lm_head.weight if not lm.args.tie_word_embeddings else lm.model.model.embed_tokens.weight
        mtp = NumpyMTP(mtp_np, np.array(lm.model.model.embed_tokens.weight), np.array(head), cfg)
    acc_mtp, acc_mtp_text, acc_main = [], [], []
    for s in seqs:
        hidden = lm.model.model(mx.array(s)[None])
        logits = lm.model.head(hidden)
        mx.eval(logits)
        hid = np.array(hidden[0].astype(mx.float32))
        main = np.array(logits[0].astype(mx.float32)).argmax(-1)
        acc_main.append(main[:-1] == s[1:])
        if mtp is not None:
            draft = mtp(hid[:-1], s[1:], np.arange(seq_len - 1, dtype=np.float64)).argmax(-1)  # rows 0..T-2
            acc_mtp.append(draft == main[1:])
            acc_mtp_text.append(draft[:-1] == s[2:])
    E = lm.args.num_experts
    layers = {}
    for layer, chunks in sorted(rec.picks.items()):
        picks = np.concatenate(chunks).reshape(n_seq, seq_len, -1)
        layers[str(layer)] = routing_summary(picks, E)
    mean = {k: round(float(np.mean([v[k] for v in layers.values()])), 4)
            for k in ("top10_share", "norm_entropy", "reuse4", "reuse4_independent")}
    out: dict[str, Any] = {
        "model": str(model_dir), "tokens": int(seqs.size), "sequences": n_seq, "seq_len": seq_len,
        "num_experts": E, "top_k": lm.args.num_experts_per_tok,
        "main_top1": round(float(np.mean(acc_main)), 4),
    }
    if mtp is not None:
        out["mtp_accept_greedy"] = round(float(np.mean(acc_mtp)), 4)
        out["mtp_top1_vs_text"] = round(float(np.mean(acc_mtp_text)), 4)
    out["routing_mean"] = mean
    out["routing"] = layers
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=str(DEFAULT_MODEL), help="model directory (default: the shipped one)")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to run (default 16384)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence, each from a fresh state")
    p.add_argument("--text", nargs="*", help="text files to use instead of the held-out stdlib files")
    args = p.parse_args(argv)
    texts = [Path(f).read_text(errors="ignore") for f in args.text] if args.text else held_out_text()
    print(json.dumps(run(Path(args.model_dir), texts, args.tokens, args.seq_len), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
