# pyright: reportMissingImports=false
# (torch is the `train` extra, not installed for the tests; ref_numpy is the external spec's reference.)
"""Train the tiny Qwen3-Next that qnpipe ships as its default model (PyTorch on CPU).

The model has the exact Qwen3-Next architecture of docs/model.md, "Forward pass" (Gated DeltaNet and gated
full-attention layers, a sparse MoE with a gated shared expert in every layer, zero-centred norms)
plus one MTP layer ("MTP head"), at tiny sizes. It is trained on the running Python's standard-library
sources (present on every machine) with a byte-level BPE tokenizer trained here by `tokenizers`,
and written in the original Hugging Face layout (per-expert tensors, ``mtp.*``, config.json,
generation_config.json, tokenizer.json, tokenizer_config.json with the Qwen chat template).

Loss = LM cross-entropy (t+1) + λ·MTP cross-entropy (t+2) [+ μ·KL(main model's t+2 prediction ‖ MTP)]
+ α·Switch load-balancing loss (mean over the MoE layers).

Data: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted walk, skipping tests and
site-packages); every 20th file is held out for validation. Training text = the train files plus
chat-formatted examples built from their documented functions (user: a request made from the
docstring, assistant: the function's code), so the chat template of ``qnpipe demo`` gets answers
that look like code.

Determinism: with ``--steps N`` the run is bit-for-bit reproducible given the same seed, thread
count (``--threads``), torch version, CPU instruction set (MKL/oneDNN pick kernels by ISA) and
Python stdlib (the corpus): the tokenizer, the data order, the initial weights and every update are
fixed (``torch.use_deterministic_algorithms(True)``). ``--minutes M`` instead fixes the step count
from the speed measured over the first steps, so it is not reproducible across machines; the
resolved ``--steps`` value is printed so the run can be repeated exactly.

Examples:
  python tools/train_tiny.py --selfcheck                       # torch forward vs the fp64 NumPy reference
  python tools/train_tiny.py --bench                            # seconds per step, torch vs MLX
  python tools/train_tiny.py --steps 50 --out /tmp/t            # a short run
  nice -n 10 python tools/train_tiny.py --seed 0 --steps 1300 --out qnpipe/data/tiny_trained   # the shipped model
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import sysconfig
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(REPO))

import train_tokenizer as tt  # noqa: E402  (tools/train_tokenizer.py: regex, special tokens, template)

# ---------------------------------------------------------------------------------------------
# configuration

VOCAB = 4096
EOT, IM_START, IM_END = 0, 1, 2


def model_config(vocab: int, experts: int, top_k: int, moe_inter: int) -> dict[str, Any]:
    """config.json: the tiny test configuration of docs/model.md with a larger vocabulary and the expert sizes."""
    from qnpipe.convert.tiny import TINY_CONFIG

    c = dict(TINY_CONFIG)
    c.update(vocab_size=vocab, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
             torch_dtype="float32", bos_token_id=IM_START, eos_token_id=IM_END)
    return c


# ---------------------------------------------------------------------------------------------
# corpus and tokenizer


def stdlib_files() -> list[Path]:
    """The stdlib's ``.py`` files in sorted-walk order (tests, site-packages, caches skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in tt.SKIP_DIRS)
        out += [Path(dirpath) / n for n in sorted(filenames) if n.endswith(".py")]
    return out


def read(p: Path) -> str:
    return p.read_bytes().decode("utf-8", errors="ignore")


def split_files(files: list[Path], every: int = 20) -> tuple[list[Path], list[Path]]:
    """(train, val): every `every`-th file (index % every == every // 2) is held out."""
    val = [f for i, f in enumerate(files) if i % every == every // 2]
    train = [f for i, f in enumerate(files) if i % every != every // 2]
    return train, val


_CHAT_FORMS = (
    "Write a Python function `{name}`. {doc}",
    "Write a Python function that does this: {doc}",
    "Implement `{name}` in Python: {doc}",
    "{doc}\nWrite it as a Python function named `{name}`.",
)


def chat_examples(files: list[Path], max_chars: int = 1200) -> list[str]:
    """Chat turns (the chat template of docs/model.md) made from documented functions: docstring request -> code."""
    out: list[str] = []
    for p in files:
        text = read(p)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(text, node, padded=True)
            if not doc or not src or len(src) > max_chars:
                continue
            first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if len(first) < 12:
                continue
            code = textwrap.dedent(src).strip("\n")
            form = _CHAT_FORMS[zlib.crc32(f"{p.name}:{node.name}".encode()) % len(_CHAT_FORMS)]
            user = form.format(name=node.name, doc=first)
            out.append(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{code}<|im_end|>\n")
    return out


def train_tokenizer(texts: list[str], vocab: int) -> Any:
    """Byte-level BPE with Qwen2's pipeline and special-token layout (as tools/train_tokenizer.py)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tt.QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, show_progress=False,
        special_tokens=tt.SPECIAL_TOKENS + tt.ADDED_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    data = tt.tokenizer_json(tok)
    if len(data["model"]["vocab"]) != vocab:
        raise SystemExit(f"trained vocabulary has {len(data['model']['vocab'])} ids, expected {vocab}")
    for i, t in enumerate(tt.SPECIAL_TOKENS + tt.ADDED_TOKENS):
        assert data["model"]["vocab"][t] == i, t
    return Tokenizer.from_str(json.dumps(data)), data


def encode_docs(tok: Any, docs: list[str]) -> np.ndarray:
    """Token ids of the documents, each followed by <|endoftext|>, as one uint16 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids
        ids.append(EOT)
    return np.asarray(ids, dtype=np.uint16)


def interleave(a: list[str], b: list[str], seed: int) -> list[str]:
    """Both lists in one deterministic shuffled order."""
    docs = a + b
    order = np.random.default_rng([seed, 1]).permutation(len(docs))
    return [docs[i] for i in order]


# ---------------------------------------------------------------------------------------------
# the model (PyTorch); parameter names are the HF names except the stacked routed experts

def build_torch_model(cfg: dict[str, Any]):  # noqa: C901 - one closure of module classes
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, Kc = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    E, top_k, inter, Is = (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                       cfg["shared_expert_intermediate_size"])
    r = nv // nk
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    rot = int(hd * cfg["partial_rotary_factor"])
    theta = float(cfg["rope_theta"])

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    class ZCNorm(nn.Module):  # zero-centred RMSNorm: stored w, applied as 1 + w
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return rms(x) * (1.0 + self.weight)

    class GatedNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x, z):
            return rms(x) * self.weight * F.silu(z)

    def lin(i, o):
        return nn.Linear(i, o, bias=False)

    def rope(x, cos, sin):  # x [B, T, heads, hd]; rotate-half pairing on the first `rot` dims
        half = rot // 2
        x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = lin(H, nh * hd * 2), lin(H, nkv * hd), lin(H, nkv * hd)
            self.o_proj = lin(nh * hd, H)
            self.q_norm, self.k_norm = ZCNorm(hd), ZCNorm(hd)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            y = self.q_proj(x).view(B, T, nh, 2 * hd)
            q, gate = y[..., :hd], y[..., hd:].reshape(B, T, nh * hd)  # per head [query | gate]
            k = self.k_norm(self.k_proj(x).view(B, T, nkv, hd))
            v = self.v_proj(x).view(B, T, nkv, hd)
            q = rope(self.q_norm(q), cos, sin)
            k = rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5)
            o = o.transpose(1, 2).reshape(B, T, nh * hd)
            return self.o_proj(o * torch.sigmoid(gate))

    def chunk_delta(q, k, v, g, beta, C=64):
        """Chunked gated delta rule (docs/model.md, "Forward pass"). q,k [B,T,h,dk] (normalised), v [B,T,h,dv], g,beta [B,T,h]."""
        B, T, Hh, _ = q.shape
        pad = (-T) % C
        if pad:  # zero k, v, beta, g: padded steps neither decay nor write the state
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
            g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
        N = (T + pad) // C
        q, k, v = (t.transpose(1, 2).reshape(B, Hh, N, C, -1) for t in (q, k, v))
        g, beta = (t.transpose(1, 2).reshape(B, Hh, N, C) for t in (g, beta))
        G = g.cumsum(-1)
        tril = torch.ones(C, C, dtype=torch.bool).tril()
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~tril, float("-inf")).exp()  # lower incl. diag
        kb = k * beta[..., None]
        A = (kb @ k.transpose(-1, -2)) * D
        A = A.masked_fill(~tril.tril(-1), 0.0) + torch.eye(C)  # I + strict_lower(...)
        rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
        X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        U0, W = X[..., : v.shape[-1]], X[..., v.shape[-1]:]
        P = (q @ k.transpose(-1, -2)) * D
        qg = q * G.exp()[..., None]
        kd = k * (G[..., -1:] - G).exp()[..., None]
        S = q.new_zeros(B, Hh, k.shape[-1], v.shape[-1])
        outs = []
        for n in range(N):
            U = U0[:, :, n] - W[:, :, n] @ S
            outs.append(qg[:, :, n] @ S + P[:, :, n] @ U)
            S = S * G[:, :, n, -1].exp()[..., None, None] + kd[:, :, n].transpose(-1, -2) @ U
        o = torch.stack(outs, dim=2).reshape(B, Hh, N * C, -1)[:, :, :T]
        return o.transpose(1, 2)

    class GatedDeltaNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj_qkvz = lin(H, 2 * key_dim + 2 * value_dim)
            self.in_proj_ba = lin(H, 2 * nv)
            self.conv1d = nn.Conv1d(conv_dim, conv_dim, Kc, groups=conv_dim, bias=False, padding=Kc - 1)
            self.A_log = nn.Parameter(torch.zeros(nv))
            self.dt_bias = nn.Parameter(torch.zeros(nv))
            self.norm = GatedNorm(dv)
            self.out_proj = lin(value_dim, H)

        def forward(self, x):
            B, T, _ = x.shape
            p = self.in_proj_qkvz(x).view(B, T, nk, 2 * dk + 2 * r * dv)  # grouped by key head (docs/model.md)
            q, k = p[..., :dk], p[..., dk:2 * dk]
            v = p[..., 2 * dk:2 * dk + r * dv].reshape(B, T, nv, dv)
            z = p[..., 2 * dk + r * dv:].reshape(B, T, nv, dv)
            ba = self.in_proj_ba(x).view(B, T, nk, 2 * r)
            b, a = ba[..., :r].reshape(B, T, nv), ba[..., r:].reshape(B, T, nv)
            m = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
            c = F.silu(self.conv1d(m.transpose(1, 2))[..., :T]).transpose(1, 2)
            q = c[..., :key_dim].reshape(B, T, nk, dk)
            k = c[..., key_dim:2 * key_dim].reshape(B, T, nk, dk)
            v = c[..., 2 * key_dim:].reshape(B, T, nv, dv)
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
            beta = torch.sigmoid(b)
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # value head h reads key head h // r
            o = chunk_delta(q, k, v, g, beta)
            return self.out_proj(self.norm(o, z).reshape(B, T, value_dim))

    class MLP(nn.Module):
        def __init__(self, inter):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = lin(H, inter), lin(H, inter), lin(inter, H)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class SparseMoe(nn.Module):
        """Router softmax over all experts, top-k, renormalised; routed experts stacked [E, out, in]."""

        def __init__(self):
            super().__init__()
            self.gate = lin(H, E)
            self.experts_gate_proj = nn.Parameter(torch.empty(E, inter, H))
            self.experts_up_proj = nn.Parameter(torch.empty(E, inter, H))
            self.experts_down_proj = nn.Parameter(torch.empty(E, H, inter))
            self.shared_expert = MLP(Is)
            self.shared_expert_gate = lin(H, 1)
            self.last_topk = None

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, H)
            N = x.shape[0]
            probs = torch.softmax(self.gate(x).float(), dim=-1)
            w, idx = torch.topk(probs, top_k, dim=-1)
            if cfg["norm_topk_prob"]:
                w = w / w.sum(-1, keepdim=True)
            self.last_topk = idx.detach()
            # Switch load-balancing loss: E * sum_e (share of routings to e) * (mean prob of e)
            frac = torch.bincount(idx.reshape(-1), minlength=E).to(probs.dtype) / (N * top_k)
            aux = E * (frac * probs.mean(0)).sum()
            flat = idx.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E).tolist()
            xs = torch.index_select(x, 0, order // top_k)
            outs = []
            for e, xe in enumerate(torch.split(xs, counts)):
                if xe.shape[0]:
                    h = F.silu(xe @ self.experts_gate_proj[e].T) * (xe @ self.experts_up_proj[e].T)
                    outs.append(h @ self.experts_down_proj[e].T)
            ys = torch.cat(outs)
            y = torch.empty_like(ys).index_copy(0, order, ys).view(N, top_k, H)
            y = (y * w[..., None].to(y.dtype)).sum(1)
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return y.view(shape), aux

    class DecoderLayer(nn.Module):
        def __init__(self, linear: bool):
            super().__init__()
            self.is_linear = linear
            self.input_layernorm = ZCNorm(H)
            if linear:
                self.linear_attn = GatedDeltaNet()
            else:
                self.self_attn = Attention()
            self.post_attention_layernorm = ZCNorm(H)
            self.mlp = SparseMoe()

        def forward(self, x, cos, sin):
            hN = self.input_layernorm(x)
            h = x + (self.linear_attn(hN) if self.is_linear else self.self_attn(hN, cos, sin))
            y, aux = self.mlp(self.post_attention_layernorm(h))
            return h + y, aux

    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], H)
            L, every = cfg["num_hidden_layers"], cfg["full_attention_interval"]
            self.layers = nn.ModuleList(DecoderLayer((layer + 1) % every != 0) for layer in range(L))
            self.norm = ZCNorm(H)

    class MTP(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre_fc_norm_embedding = ZCNorm(H)
            self.pre_fc_norm_hidden = ZCNorm(H)
            self.fc = lin(2 * H, H)
            self.layers = nn.ModuleList([DecoderLayer(False)])
            self.norm = ZCNorm(H)

    class Qwen3Next(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Backbone()
            self.lm_head = lin(H, cfg["vocab_size"])
            self.mtp = MTP()

        def rope_tables(self, T, pos0=0):
            half = rot // 2
            inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / rot)
            ang = torch.arange(pos0, pos0 + T, dtype=torch.float64)[:, None] * inv[None, :]
            return ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]  # [T, 1, half]

        def forward(self, tokens, mtp_tokens=None):
            """tokens [B, T] -> (logits [B,T,V], post-norm hidden, aux list, mtp logits [B,T,V] or None).

            mtp_tokens [B, T]: the token at t+1 for each row t (MTP row t predicts t+2)."""
            T = tokens.shape[1]
            cos, sin = self.rope_tables(T)
            x = self.model.embed_tokens(tokens)
            auxes = []
            for layer in self.model.layers:
                x, aux = layer(x, cos, sin)
                auxes.append(aux)
            hn = self.model.norm(x)
            logits = self.lm_head(hn)
            mlog = None
            if mtp_tokens is not None:
                mlog, aux = self.mtp_forward(hn, mtp_tokens, cos, sin)
                auxes.append(aux)
            return logits, hn, auxes, mlog

        def mtp_forward(self, hn, next_tokens, cos, sin):
            m = self.mtp
            e = m.pre_fc_norm_embedding(self.model.embed_tokens(next_tokens))
            u = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hn)], dim=-1))  # embedding half first
            u, aux = m.layers[0](u, cos, sin)
            return self.lm_head(m.norm(u)), aux

    return Qwen3Next()


def init_weights(model, cfg: dict[str, Any], seed: int) -> None:
    """GPT-style init: N(0, 0.02), residual outputs scaled by 1/sqrt(2L); GDN gates as in Mamba."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    L = cfg["num_hidden_layers"] + 1
    out_std = 0.02 / math.sqrt(2 * L)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            elif p.ndim == 1:  # norms: zero-centred (applied as 1 + w), the GDN gated norm is a plain weight
                p.copy_(torch.ones_like(p) if ".linear_attn.norm." in name else torch.zeros_like(p))
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 1.0 / math.sqrt(cfg["linear_conv_kernel_dim"]), generator=gen)
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts_down_proj")):
                p.normal_(0.0, out_std, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def hf_state(model, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The model's tensors under the original HF names (docs/model.md, "Checkpoint layouts", "MTP head"), float32, routed experts split."""
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().cpu().numpy()
        stem, sep, proj = name.rpartition(".experts_")
        if sep:
            for e in range(cfg["num_experts"]):
                out[f"{stem}.experts.{e}.{proj}.weight"] = np.ascontiguousarray(a[e])
        else:
            out[name] = np.ascontiguousarray(a)
    return out


# ---------------------------------------------------------------------------------------------
# checks


def selfcheck(seed: int = 0) -> float:
    """Max |torch − fp64 NumPy reference| on random weights (logits and MTP logits), fp32 torch."""
    import torch

    ref_dir = Path(os.environ.get("QWEN3_NEXT_REF", "/work/shared/docs/qwen3-next"))
    sys.path.insert(0, str(ref_dir))
    import ref_numpy as ref

    cfg = model_config(512, 16, 4, 32)
    torch.manual_seed(seed)
    model = build_torch_model(cfg)
    init_weights(model, cfg, seed)
    with torch.no_grad():  # non-trivial norms and larger weights so every path matters
        for name, p in model.named_parameters():
            if p.ndim == 1 and "A_log" not in name and "dt_bias" not in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
            elif p.ndim >= 2:
                p.mul_(5.0)
    T = 150  # > 2 GDN chunks, ragged last chunk
    toks = torch.randint(3, 512, (1, T + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hn, _, mlog = model(toks[:, :T], toks[:, 1:])
    W = {k: v.astype(np.float64) for k, v in hf_state(model, cfg).items()}
    rc = ref.Cfg(cfg)
    rl, _, rhn = ref.forward(toks[0, :T].numpy(), W, rc)
    rm, _ = ref.mtp_forward(rhn, toks[0, 1:].numpy(), W, rc, None, np.arange(T))
    d1 = float(np.abs(logits[0].double().numpy() - rl).max())
    d2 = float(np.abs(mlog[0].double().numpy() - rm).max())
    scale = float(np.abs(rl).max())
    print(f"selfcheck: max|logits - ref| = {d1:.2e}, max|mtp logits - ref| = {d2:.2e} (logit scale {scale:.2f})")
    return max(d1, d2) / max(scale, 1.0)


def verify_export(model, out: Path, tokens: np.ndarray) -> float:
    """Max |torch logits − qnpipe loader (MLX) logits| for `tokens` on the exported directory."""
    import mlx.core as mx
    import torch

    from qnpipe.model.load import load_model

    lm = load_model(out)
    ours = np.array(lm.model(mx.array(tokens.astype(np.int64))[None])[0].astype(mx.float32))
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens.astype(np.int64))[None])[0][0].numpy()
    d = float(np.abs(ours - ref).max())
    print(f"export check: max|torch - qnpipe MLX| = {d:.2e} over {len(tokens)} tokens "
          f"(logit scale {np.abs(ref).max():.1f}; argmax agree {(ours.argmax(-1) == ref.argmax(-1)).mean():.4f})")
    return d


# ---------------------------------------------------------------------------------------------
# training


class Batches:
    """Random windows of T+1 tokens from a token stream, deterministic given the seed."""

    def __init__(self, stream: np.ndarray, T: int, B: int, seed: int):
        self.stream, self.T, self.B = stream, T, B
        self.rng = np.random.default_rng([seed, 2])

    def next(self) -> np.ndarray:
        starts = self.rng.integers(0, len(self.stream) - self.T - 1, self.B)
        return np.stack([self.stream[s:s + self.T + 1] for s in starts]).astype(np.int64)


def losses(model, batch, args, with_teacher: bool):
    """(total, lm CE, mtp CE, aux, mtp greedy acceptance) for a [B, T+1] batch."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(batch)
    inp, tgt = x[:, :-1], x[:, 1:]
    logits, hn, auxes, mlog = model(inp, tgt)
    V = logits.shape[-1]
    lm = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
    # MTP row t (hidden h_t, token t+1) predicts token t+2; the last row has no target.
    mlog = mlog[:, :-1]
    mtp = F.cross_entropy(mlog.reshape(-1, V), tgt[:, 1:].reshape(-1))
    total = lm + args.mtp_weight * mtp
    if with_teacher and args.mtp_distill > 0:  # pull the MTP toward the main model's own t+2 prediction
        teacher = F.log_softmax(logits[:, 1:].detach(), dim=-1)
        kl = F.kl_div(F.log_softmax(mlog, dim=-1), teacher, log_target=True, reduction="batchmean") / mlog.shape[1]
        total = total + args.mtp_distill * kl
    aux = torch.stack(auxes).mean()
    total = total + args.aux_weight * aux
    acc = (mlog.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return total, lm, mtp, aux, acc


def evaluate(model, val_batches: list[np.ndarray], args) -> dict[str, float]:
    import torch

    model.eval()
    s = np.zeros(4)
    with torch.no_grad():
        for b in val_batches:
            _, lm, mtp, aux, acc = losses(model, b, args, with_teacher=False)
            s += [lm.item(), mtp.item(), aux.item(), acc.item()]
    model.train()
    s /= len(val_batches)
    return {"val_loss": s[0], "val_mtp_loss": s[1], "val_aux": s[2], "val_mtp_accept": s[3]}


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab: int) -> dict[str, float]:
    """Cross-entropy (nats/token) of val under train unigram frequencies (add-one), and val's own entropy."""
    c = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    p = c / c.sum()
    xent = float(-np.log(p[val]).mean())
    cv = np.bincount(val, minlength=vocab).astype(np.float64)
    pv = cv[cv > 0] / cv.sum()
    return {"unigram_xent_train_freqs": xent, "unigram_entropy_val": float(-(pv * np.log(pv)).sum())}


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def prepare_data(args) -> dict[str, Any]:
    t0 = time.perf_counter()
    files = stdlib_files()
    train_f, val_f = split_files(files)
    train_code = [read(p) for p in train_f]
    val_code = [read(p) for p in val_f]
    chats = chat_examples(train_f)
    tok, tok_data = train_tokenizer(train_code + chats, args.vocab)
    train_ids = encode_docs(tok, interleave(train_code, chats, args.seed))
    val_ids = encode_docs(tok, val_code)
    val_chat_ids = encode_docs(tok, chat_examples(val_f))
    info = {
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "files_train": len(train_f), "files_val": len(val_f), "chat_examples": len(chats),
        "bytes_train_code": sum(len(t.encode()) for t in train_code),
        "bytes_chat": sum(len(t.encode()) for t in chats),
        "bytes_val": sum(len(t.encode()) for t in val_code),
        "tokens_train": int(len(train_ids)), "tokens_val": int(len(val_ids)),
        "tokens_val_chat": int(len(val_chat_ids)),
        "tokenizer_sha": f"{zlib.crc32(tok.to_str().encode()):08x}",
    }
    print(f"data: {json.dumps(info)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return {"tok": tok, "tok_data": tok_data, "train": train_ids, "val": val_ids, "val_chat": val_chat_ids,
            "info": info}


def write_model(model, cfg: dict[str, Any], tok_data: dict, out: Path) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state(model, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": IM_START, "eos_token_id": [IM_END, EOT], "pad_token_id": EOT}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tok_data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tt.tokenizer_config(tok_data), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    data = prepare_data(args)
    cfg = model_config(args.vocab, args.experts, args.top_k, args.moe_inter)
    model = build_torch_model(cfg)
    init_weights(model, cfg, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    print(f"model: {n_params:,} parameters ({n_mtp:,} in mtp), {n_params * 4 / 2**20:.1f} MiB fp32; "
          f"config {json.dumps({k: cfg[k] for k in ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_experts', 'num_experts_per_tok', 'moe_intermediate_size')})}",
          flush=True)
    base = unigram_baseline(data["train"], data["val"], args.vocab)
    print(f"unigram baseline on val: {json.dumps(base)}", flush=True)

    vrng = Batches(data["val"], args.seq_len, 1, args.seed + 1000)
    val_batches = [np.concatenate([vrng.next() for _ in range(args.batch)]) for _ in range(args.val_batches)]
    batches = Batches(data["train"], args.seq_len, args.batch, args.seed)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            foreach=False)
    steps = args.steps
    budget = args.minutes * 60.0 if args.minutes else None
    warm = args.warmup

    def lr_at(step: int, total: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, total - warm))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    history: list[dict[str, Any]] = []

    def eval_once_at(step: int) -> None:
        """Evaluate at `step` unless the last evaluation was already there."""
        if not history or history[-1]["step"] != step:
            ev = evaluate(model, val_batches, args)
            ev.update(step=step, elapsed_s=round(time.perf_counter() - t_start, 1), train_loss_ema=float(ema[0]) if ema is not None else float("nan"))
            history.append(ev)

    stopped_early = None
    t_train = time.perf_counter()
    step = 0
    ema = None
    while True:
        if steps is None and budget is not None and step == args.calibrate:
            per = (time.perf_counter() - t_train) / step
            steps = max(step + 1, int((budget - (time.perf_counter() - t_start)) / (per * 1.04)) + step)
            print(f"resolved --steps {steps} ({per:.2f} s/step measured over {step} steps)", flush=True)
        total = steps if steps is not None else 10**9
        if step >= total:
            break
        if args.stop_after is not None and step >= args.stop_after:
            print(f"stopping after step {step} (--stop-after; schedule of --steps {steps})", flush=True)
            stopped_early = step
            eval_once_at(step)
            break
        if args.steps is not None and time.perf_counter() - t_start > args.max_minutes * 60:
            print(f"STOPPED EARLY at step {step}: --max-minutes {args.max_minutes} reached; the weights are those "
                  f"of --steps {steps} --stop-after {step}", flush=True)
            stopped_early = step
            eval_once_at(step)
            break
        for gi in opt.param_groups:
            gi["lr"] = lr_at(step, steps if steps is not None else args.calibrate * 100)
        loss, lm, mtp, aux, acc = losses(model, batches.next(), args, with_teacher=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        vals = np.array([lm.item(), mtp.item(), aux.item(), acc.item()])
        ema = vals if ema is None else 0.95 * ema + 0.05 * vals
        if step % args.log_every == 0 or step == total:
            el = time.perf_counter() - t_train
            eta = el / step * (total - step) if steps is not None else float("nan")
            tok_s = step * args.batch * args.seq_len / el
            print(f"step {step}/{steps or '?'} loss {ema[0]:.3f} mtp {ema[1]:.3f} aux {ema[2]:.3f} "
                  f"acc {ema[3]:.3f} |g| {gnorm:.2f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{tok_s:.0f} tok/s elapsed {fmt_time(el)} eta {fmt_time(eta) if eta == eta else '?'}", flush=True)
        if step % args.eval_every == 0 or step == total:
            ev = evaluate(model, val_batches, args)
            ev.update(step=step, elapsed_s=round(time.perf_counter() - t_start, 1), train_loss_ema=float(ema[0]) if ema is not None else float("nan"))
            history.append(ev)
            print(f"eval {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in ev.items()})}",
                  flush=True)
    train_s = time.perf_counter() - t_train

    out = Path(args.out)
    write_model(model, cfg, data["tok_data"], out)
    d = verify_export(model, out, data["val"][:200].astype(np.int64))
    final = history[-1]
    summary = {
        "command": "python tools/train_tiny.py " + " ".join(sys.argv[1:]),
        "seed": args.seed, "threads": args.threads, "steps": steps, "batch": args.batch, "seq_len": args.seq_len,
        "tokens_seen": (stopped_early or steps) * args.batch * args.seq_len, "lr": args.lr, "mtp_weight": args.mtp_weight,
        "mtp_distill": args.mtp_distill, "aux_weight": args.aux_weight,
        "params": n_params, "params_mtp": n_mtp, "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1), "torch": torch.__version__,
        "data": data["info"], "unigram": base, "final": final, "stopped_early_at": stopped_early, "export_max_abs_diff": d, "history": history,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary: {json.dumps({k: v for k, v in summary.items() if k != 'history'})}", flush=True)
    if d > 1e-3:
        print("export check FAILED", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# step-time benchmark: torch vs MLX (mlx-lm's own model in training mode)


def bench(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    cfg = model_config(args.vocab, args.experts, args.top_k, args.moe_inter)
    rng = np.random.default_rng(0)
    batch = rng.integers(3, args.vocab, (args.batch, args.seq_len + 1)).astype(np.int64)
    model = build_torch_model(cfg)
    init_weights(model, cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    times = []
    for _ in range(args.bench_steps + 1):
        t0 = time.perf_counter()
        loss = losses(model, batch, args, with_teacher=True)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    tt_ = float(np.median(times[1:]))
    print(f"torch {torch.__version__} ({args.threads} threads): {tt_:.3f} s/step "
          f"(batch {args.batch} x {args.seq_len}, {args.batch * args.seq_len / tt_:.0f} tok/s, incl. MTP)", flush=True)

    # MLX: mlx-lm's Qwen3-Next (no MTP: mlx-lm has none), value_and_grad + AdamW, fp32 on CPU.
    import mlx.core as mx
    import mlx.nn as mnn
    import mlx.optimizers as optim
    from mlx_lm.models.qwen3_next import Model, ModelArgs

    mb = max(1, args.batch // 4)  # MLX CPU is slow: time a quarter batch and scale per token
    m = Model(ModelArgs.from_dict(cfg))
    m.train()
    x = mx.array(batch[:mb])

    def loss_fn(mm, x):
        logits = mm(x[:, :-1])
        return mnn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    lg = mnn.value_and_grad(m, loss_fn)
    o = optim.AdamW(1e-3)
    mt = []
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            loss, grads = lg(m, x)
            o.update(m, grads)
            mx.eval(m.parameters(), o.state, loss)
            mt.append(time.perf_counter() - t0)
        per_tok = mt[-1] / (mb * args.seq_len)
        print(f"mlx {getattr(mx, '__version__', '?')} (CPU): {mt[-1]:.3f} s/step for batch {mb} x {args.seq_len} without MTP "
              f"-> {per_tok * args.batch * args.seq_len:.3f} s per full step ({1 / per_tok:.0f} tok/s)", flush=True)
    except Exception as e:  # noqa: BLE001 - report and continue
        print(f"mlx: training step failed: {type(e).__name__}: {e}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "qnpipe" / "data" / "tiny_trained"),
                   help="output model directory (default: qnpipe/data/tiny_trained)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the document order and the sampled training/validation windows")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="optimizer steps (deterministic budget)")
    g.add_argument("--minutes", type=float,
                   help="wall-clock budget for the whole run incl. data prep; steps fixed after --calibrate steps")
    p.add_argument("--max-minutes", type=float, default=58.0,
                   help="failsafe wall-clock cap with --steps (a loaded machine): stop early, export, and say so")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N steps while keeping the LR schedule of --steps (reproduces an early stop)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (part of determinism)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine to 10%%)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--mtp-weight", type=float, default=0.5, help="λ: weight of the MTP t+2 cross-entropy")
    p.add_argument("--mtp-distill", type=float, default=0.5,
                   help="μ: weight of KL(main model's t+2 distribution ‖ MTP), raises greedy acceptance")
    p.add_argument("--aux-weight", type=float, default=0.01, help="α: Switch load-balancing loss weight")
    p.add_argument("--vocab", type=int, default=VOCAB, help="BPE vocabulary size")
    p.add_argument("--experts", type=int, default=44, help="routed experts per layer (44: fp32 model.safetensors stays < 30 MB)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=32, help="routed expert width (moe_intermediate_size)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--val-batches", type=int, default=8, help="validation batches (each --batch x --seq-len)")
    p.add_argument("--calibrate", type=int, default=20, help="with --minutes: steps timed before fixing the count")
    p.add_argument("--selfcheck", action="store_true", help="compare the torch forward with ref_numpy.py and exit")
    p.add_argument("--bench", action="store_true", help="time training steps in torch and MLX and exit")
    p.add_argument("--bench-steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.selfcheck:
        import torch

        torch.set_num_threads(args.threads)
        rel = selfcheck(args.seed)
        ok = rel < 1e-4
        print("selfcheck", "OK" if ok else "FAILED", f"(relative {rel:.1e})")
        return 0 if ok else 1
    if args.bench:
        return bench(args)
    if args.steps is None and args.minutes is None:
        p.error("give --steps N or --minutes M")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
