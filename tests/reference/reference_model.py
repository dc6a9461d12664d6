"""PyTorch reference of meshtrain's two model families, written from the papers.

Functional: a model is a dict {Hugging Face parameter name: tensor} in meshtrain's
registry layout, so gradients and optimizer steps line up with the C++ side by name.
- Llama: RMSNorm, RoPE over interleaved pairs (x[2i], x[2i+1]) (Meta / llama2.c),
  grouped-query attention (query head h reads kv head h // (n_heads / n_kv_heads)),
  SwiGLU down(silu(gate x) * up x), optional tied output.
- GPT-2: LayerNorm with bias, learned positions, Conv1D weights [in, out]
  (HF's layout, which meshtrain keeps), GELU with tanh, output tied to wte.
rope="half" gives Hugging Face's rotate_half convention, used to check exported files.
A Llama with a Moe config has mixture-of-experts feed-forwards (moe_ffn), written from
the Switch / Mixtral / DeepSeek-V3 papers and Megatron-Core's loss definitions.
"""
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Moe:
    """meshtrain's [moe] settings (docs/moe.md), field for field."""
    experts: int
    top_k: int
    hidden_dim: int
    score: str = "softmax"
    renormalize: bool = True
    scaling: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    shared_hidden: int = 0
    shared_gate: bool = False
    first_dense: int = 0
    every: int = 1
    aux_loss: float = 0.0
    z_loss: float = 0.0
    capacity_factor: float = 0.0

    def is_moe_layer(self, i):
        return i >= self.first_dense and (i - self.first_dense) % self.every == 0


@dataclass
class Config:
    family: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    moe: Moe = None
    # Attention options of today's families (meshtrain's model.qkv_bias, qk_norm, head_dim):
    # q/k/v biases (Qwen2), RMSNorm of q and k before RoPE per head (Qwen3) or over the
    # whole projection (OLMoE), a head width of its own (0: dim / n_heads).
    qkv_bias: bool = False
    qk_norm: str = "none"
    head_width: int = 0

    @property
    def head_dim(self):
        return self.head_width or self.dim // self.n_heads

    def attention(self):
        """The attention options as a fixture's metadata "attention" (meshtrain's names)."""
        return {"qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm, "head_dim": self.head_width}

    def hf_config(self):
        """config.json as meshtrain's hf.cpp writes and parses it."""
        if self.family == "llama":
            return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                    "hidden_size": self.dim, "intermediate_size": self.hidden_dim,
                    "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
                    "num_key_value_heads": self.n_kv_heads, "vocab_size": self.vocab_size,
                    "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
                    "rope_theta": self.rope_theta, "hidden_act": "silu",
                    "tie_word_embeddings": self.tie_embeddings}
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": self.dim,
                "n_layer": self.n_layers, "n_head": self.n_heads,
                "n_inner": None if self.hidden_dim == 4 * self.dim else self.hidden_dim,
                "n_positions": self.max_seq_len, "vocab_size": self.vocab_size,
                "layer_norm_epsilon": self.norm_eps, "activation_function": "gelu_new",
                "tie_word_embeddings": True}

    @staticmethod
    def from_hf_config(text):
        j = json.loads(text)
        if j["model_type"] == "llama":
            return Config("llama", j["hidden_size"], j["num_hidden_layers"],
                          j["num_attention_heads"], j.get("num_key_value_heads") or j["num_attention_heads"],
                          j["intermediate_size"], j["vocab_size"], j["max_position_embeddings"],
                          j["rms_norm_eps"], j.get("rope_theta", 10000.0),
                          j.get("tie_word_embeddings", False))
        d = j["n_embd"]
        return Config("gpt2", d, j["n_layer"], j["n_head"], j["n_head"], j.get("n_inner") or 4 * d,
                      j["vocab_size"], j["n_positions"], j["layer_norm_epsilon"])


def param_shapes(c):
    """Name -> (shape, kind) in meshtrain's registry order; kind: matrix | norm | bias."""
    out = {}
    if c.family == "llama":
        hd = c.head_dim
        out["model.embed_tokens.weight"] = ((c.vocab_size, c.dim), "matrix")
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = ((c.dim,), "norm")
            out[p + "self_attn.q_proj.weight"] = ((c.n_heads * hd, c.dim), "matrix")
            out[p + "self_attn.k_proj.weight"] = ((c.n_kv_heads * hd, c.dim), "matrix")
            out[p + "self_attn.v_proj.weight"] = ((c.n_kv_heads * hd, c.dim), "matrix")
            if c.qkv_bias:
                for m, rows in (("q", c.n_heads * hd), ("k", c.n_kv_heads * hd), ("v", c.n_kv_heads * hd)):
                    out[p + f"self_attn.{m}_proj.bias"] = ((rows,), "bias")
            if c.qk_norm != "none":
                head = c.qk_norm == "head"
                out[p + "self_attn.q_norm.weight"] = ((hd if head else c.n_heads * hd,), "norm")
                out[p + "self_attn.k_norm.weight"] = ((hd if head else c.n_kv_heads * hd,), "norm")
            out[p + "self_attn.o_proj.weight"] = ((c.dim, c.n_heads * hd), "matrix")
            out[p + "post_attention_layernorm.weight"] = ((c.dim,), "norm")
            if c.moe is not None and c.moe.is_moe_layer(i):
                out.update(moe_shapes(c, p))
                continue
            out[p + "mlp.gate_proj.weight"] = ((c.hidden_dim, c.dim), "matrix")
            out[p + "mlp.up_proj.weight"] = ((c.hidden_dim, c.dim), "matrix")
            out[p + "mlp.down_proj.weight"] = ((c.dim, c.hidden_dim), "matrix")
        out["model.norm.weight"] = ((c.dim,), "norm")
        if not c.tie_embeddings:
            out["lm_head.weight"] = ((c.vocab_size, c.dim), "matrix")
        return out
    d, h = c.dim, c.hidden_dim
    out["transformer.wte.weight"] = ((c.vocab_size, d), "matrix")
    out["transformer.wpe.weight"] = ((c.max_seq_len, d), "matrix")
    for i in range(c.n_layers):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + ln + ".weight"] = ((d,), "norm")
            out[p + ln + ".bias"] = ((d,), "bias")
        out[p + "attn.c_attn.weight"] = ((d, 3 * d), "matrix")
        out[p + "attn.c_attn.bias"] = ((3 * d,), "bias")
        out[p + "attn.c_proj.weight"] = ((d, d), "matrix")
        out[p + "attn.c_proj.bias"] = ((d,), "bias")
        out[p + "mlp.c_fc.weight"] = ((d, h), "matrix")
        out[p + "mlp.c_fc.bias"] = ((h,), "bias")
        out[p + "mlp.c_proj.weight"] = ((h, d), "matrix")
        out[p + "mlp.c_proj.bias"] = ((d,), "bias")
    out["transformer.ln_f.weight"] = ((d,), "norm")
    out["transformer.ln_f.bias"] = ((d,), "bias")
    return out


def lora(h, P, module, scale, dropout=None):
    """LoRA's term of `module` (Hu et al. 2021; PEFT's shapes whatever the base's layout):
    scale * (dropout(h) A^T) B^T with A [r, in] = P[module.lora_A.weight], B [out, r]; 0
    without one. dropout: None or fn(module, h) -> h with the adapter's mask applied."""
    a = P.get(module + ".lora_A.weight")
    if a is None:
        return 0
    if dropout is not None:
        h = dropout(module, h)
    return scale * F.linear(F.linear(h, a), P[module + ".lora_B.weight"])


M64 = (1 << 64) - 1


def mix64(x):
    """meshtrain's util/rng.h SplitMix64 finaliser, on Python ints."""
    x = (x + 0x9e3779b97f4a7c15) & M64
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & M64
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & M64
    return x ^ (x >> 31)


def stream_key(seed, purpose):
    h = 0xcbf29ce484222325
    for c in purpose.encode():
        h = ((h ^ c) * 0x100000001b3) & M64
    return mix64(h ^ mix64(seed))


def uniform_at(key, index):
    return (mix64(key ^ mix64(index)) >> 40) * (1.0 / 16777216.0)


def lora_dropout(p, seed, step, samples, seq):
    """meshtrain's adapter dropout (model/block.cpp): element (row, j) of module m's input is
    kept iff uniform_at(stream_key(seed, "lora_dropout.<step>.<m>"), (samples[b] * seq + t) *
    in + j) >= p (row = b * seq + t), and scaled by 1 / (1 - p)."""
    def apply(module, h):
        B, T, n = h.shape
        key = stream_key(seed, f"lora_dropout.{step}.{module}")
        keep = torch.tensor([[[uniform_at(key, (samples[b] * seq + t) * n + j) >= p
                               for j in range(n)] for t in range(T)] for b in range(B)])
        return h * keep.to(h.dtype) / (1.0 - p)
    return apply


def lora_shapes(c, rank, targets):
    """Adapter name -> shape, for the modules named by `targets` (short names)."""
    out = {}
    hd = c.head_dim
    if c.family == "llama":
        mods = {"q_proj": ("self_attn", c.dim, c.n_heads * hd),
                "k_proj": ("self_attn", c.dim, c.n_kv_heads * hd),
                "v_proj": ("self_attn", c.dim, c.n_kv_heads * hd),
                "o_proj": ("self_attn", c.n_heads * hd, c.dim),
                "gate_proj": ("mlp", c.dim, c.hidden_dim), "up_proj": ("mlp", c.dim, c.hidden_dim),
                "down_proj": ("mlp", c.hidden_dim, c.dim)}
        for i in range(c.n_layers):
            for t in targets:
                part, n_in, n_out = mods[t]
                m = f"model.layers.{i}.{part}.{t}"
                out[m + ".lora_A.weight"] = (rank, n_in)
                out[m + ".lora_B.weight"] = (n_out, rank)
        return out
    d, h = c.dim, c.hidden_dim
    for i in range(c.n_layers):
        p = f"transformer.h.{i}."
        mods = {"c_attn": [("attn.c_attn", d, 3 * d)],
                "c_proj": [("attn.c_proj", d, d), ("mlp.c_proj", h, d)],
                "c_fc": [("mlp.c_fc", d, h)]}
        for t in targets:
            for m, n_in, n_out in mods[t]:
                out[p + m + ".lora_A.weight"] = (rank, n_in)
                out[p + m + ".lora_B.weight"] = (n_out, rank)
    return out


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_angles(c, positions, dtype):
    """positions [T] (every row) or [B, T] (packed records): cos, sin [(B,) T, hd/2]."""
    i = torch.arange(c.head_dim // 2, dtype=torch.float64)
    inv_freq = c.rope_theta ** (-2.0 * i / c.head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _per_row(t):
    """[T, n] or [B, T, n] -> broadcastable over [B, T, H, n]."""
    return t[None, :, None, :] if t.dim() == 2 else t[:, :, None, :]


def rope_interleaved(x, cos, sin):
    """x [B, T, H, hd]: rotates pairs (x[2i], x[2i+1]) by angle pos * theta^(-2i/hd)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = _per_row(cos), _per_row(sin)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def rope_half(x, cos, sin):
    """Hugging Face's rotate_half: pairs (x[i], x[i + hd/2])."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    cos, sin = _per_row(cos), _per_row(sin)
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


def causal_attention(q, k, v, positions=None):
    """q [B, T, H, hd], k/v [B, T, KV, hd] -> [B, T, H*hd]; head h reads kv head h // (H/KV).
    positions [B, T] (packed records, restarting at 0): query t sees keys [t - pos, t] only."""
    B, T, H, hd = q.shape
    rep = H // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    if positions is not None:
        t = torch.arange(T)
        first = t[None, :] - positions  # [B, T]: each query's record start
        mask = mask[None] | (t[None, None, :] < first[:, :, None])  # [B, T, T]
        mask = mask[:, None]  # over heads
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores.float() if scores.dtype == torch.bfloat16 else scores,
                                     dim=-1).to(v.dtype), v)
    return out.transpose(1, 2).reshape(B, T, H * hd)


def moe_shapes(c, p):
    """A MoE layer's feed-forward parameters, in meshtrain's registry order and layout."""
    m, d = c.moe, c.dim
    out = {p + "mlp.gate.weight": ((m.experts, d), "matrix"),
           p + "mlp.experts.gate_up_proj": ((m.experts, 2 * m.hidden_dim, d), "matrix"),
           p + "mlp.experts.down_proj": ((m.experts, d, m.hidden_dim), "matrix")}
    if m.shared_hidden:
        hs = m.shared_hidden
        out[p + "mlp.shared_expert.gate_proj.weight"] = ((hs, d), "matrix")
        out[p + "mlp.shared_expert.up_proj.weight"] = ((hs, d), "matrix")
        out[p + "mlp.shared_expert.down_proj.weight"] = ((d, hs), "matrix")
        if m.shared_gate:
            out[p + "mlp.shared_expert_gate.weight"] = ((1, d), "matrix")
    return out


def swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe_ffn(h, P, p, m, aux):
    """A MoE feed-forward of h [..., d]; appends this layer's auxiliary losses to `aux`
    (coefficients applied): aux_loss * E * sum_e P_e f_e (P_e the mean score of expert e,
    f_e its share of the top_k choices, counted without gradient) and
    z_loss * mean(logsumexp(logits)^2)."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    n, E = x.shape[0], m.experts
    logits = F.linear(x, P[p + "mlp.gate.weight"])
    probs = torch.softmax(logits, -1) if m.score == "softmax" else torch.sigmoid(logits)
    select = probs.detach().clone()
    if m.n_groups > 1:  # a group scores its two best; the topk_groups best groups are eligible
        groups = select.view(n, m.n_groups, -1)
        group_score = groups.topk(min(2, groups.shape[-1]), -1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(m.topk_groups, -1).indices, True)
        select = select.masked_fill(~keep.repeat_interleave(E // m.n_groups, 1), float("-inf"))
    chosen = select.topk(m.top_k, -1).indices
    weights = probs.gather(1, chosen)
    if m.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * m.scaling
    if m.capacity_factor > 0:  # each expert keeps its C choices of the highest weight
        capacity = math.ceil(m.capacity_factor * n * m.top_k / E)
        flat_w, flat_e = weights.detach().reshape(-1), chosen.reshape(-1)
        keep = torch.zeros_like(flat_w, dtype=torch.bool)
        for e in range(E):
            mine = [s for s in range(flat_e.numel()) if flat_e[s] == e]
            mine.sort(key=lambda s: (-flat_w[s].item(), s))  # ties: the lower slot
            keep[mine[:capacity]] = True
        weights = weights * keep.view_as(weights)
    gate_up, down = P[p + "mlp.experts.gate_up_proj"], P[p + "mlp.experts.down_proj"]
    out = torch.zeros_like(x)
    for e in range(E):
        w = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 for tokens not routed to e
        g, u = F.linear(x, gate_up[e]).chunk(2, -1)
        out = out + w * F.linear(F.silu(g) * u, down[e])
    if m.shared_hidden:
        shared = swiglu(x, P[p + "mlp.shared_expert.gate_proj.weight"],
                        P[p + "mlp.shared_expert.up_proj.weight"],
                        P[p + "mlp.shared_expert.down_proj.weight"])
        if m.shared_gate:
            shared = torch.sigmoid(F.linear(x, P[p + "mlp.shared_expert_gate.weight"])) * shared
        out = out + shared
    counts = torch.stack([(chosen == e).sum() for e in range(E)]).to(x.dtype)
    if m.aux_loss:
        aux.append(m.aux_loss * E * (probs.mean(0) * counts / (n * m.top_k)).sum())
    if m.z_loss:
        aux.append(m.z_loss * (torch.logsumexp(logits, -1) ** 2).mean())
    return out.reshape(shape)


def llama_logits(P, c, tokens, rope="interleaved", positions=None, lora_scale=0.0, dropout=None,
                 aux=None):
    B, T = tokens.shape
    hd = c.head_dim
    rotate = rope_interleaved if rope == "interleaved" else rope_half
    x = P["model.embed_tokens.weight"][tokens]
    cos, sin = rope_angles(c, torch.arange(T) if positions is None else positions, x.dtype)

    def linear(h, module):
        return F.linear(h, P[module + ".weight"], P.get(module + ".bias")) + lora(h, P, module, lora_scale, dropout)

    def qk(h, module, norm, heads):
        """A projection to [B, T, heads, hd], with its QK-norm (before RoPE)."""
        y = linear(h, module)
        if c.qk_norm == "full":
            y = rms_norm(y, P[norm], c.norm_eps)
        y = y.view(B, T, heads, hd)
        return rms_norm(y, P[norm], c.norm_eps) if c.qk_norm == "head" else y

    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, P[p + "input_layernorm.weight"], c.norm_eps)
        q = qk(h, p + "self_attn.q_proj", p + "self_attn.q_norm.weight", c.n_heads)
        k = qk(h, p + "self_attn.k_proj", p + "self_attn.k_norm.weight", c.n_kv_heads)
        v = linear(h, p + "self_attn.v_proj").view(B, T, c.n_kv_heads, hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        x = x + linear(causal_attention(q, k, v, positions), p + "self_attn.o_proj")
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], c.norm_eps)
        if c.moe is not None and c.moe.is_moe_layer(i):
            x = x + moe_ffn(h, P, p, c.moe, [] if aux is None else aux)
            continue
        gate = linear(h, p + "mlp.gate_proj")
        up = linear(h, p + "mlp.up_proj")
        x = x + linear(F.silu(gate) * up, p + "mlp.down_proj")
    x = rms_norm(x, P["model.norm.weight"], c.norm_eps)
    head = P["model.embed_tokens.weight"] if c.tie_embeddings else P["lm_head.weight"]
    return F.linear(x, head)


def conv1d(x, weight, bias):
    """HF GPT-2's Conv1D: weight [in, out]."""
    return torch.matmul(x, weight) + bias


def gpt2_logits(P, c, tokens, positions=None, lora_scale=0.0, dropout=None):
    B, T = tokens.shape
    hd = c.head_dim
    wpe = P["transformer.wpe.weight"]
    x = P["transformer.wte.weight"][tokens] + (wpe[:T][None] if positions is None else wpe[positions])

    def linear(h, module):
        return (conv1d(h, P[module + ".weight"], P[module + ".bias"]) +
                lora(h, P, module, lora_scale, dropout))

    for i in range(c.n_layers):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (c.dim,), P[p + "ln_1.weight"], P[p + "ln_1.bias"], c.norm_eps)
        qkv = linear(h, p + "attn.c_attn")
        q, k, v = (t.reshape(B, T, c.n_heads, hd) for t in qkv.split(c.dim, dim=-1))
        x = x + linear(causal_attention(q, k, v, positions), p + "attn.c_proj")
        h = F.layer_norm(x, (c.dim,), P[p + "ln_2.weight"], P[p + "ln_2.bias"], c.norm_eps)
        h = F.gelu(linear(h, p + "mlp.c_fc"), approximate="tanh")
        x = x + linear(h, p + "mlp.c_proj")
    x = F.layer_norm(x, (c.dim,), P["transformer.ln_f.weight"], P["transformer.ln_f.bias"],
                     c.norm_eps)
    return F.linear(x, P["transformer.wte.weight"])


def logits(P, c, tokens, rope="interleaved", positions=None, lora_scale=0.0, dropout=None,
           aux=None):
    """positions [B, T]: packed records (attention within each, positions restarting at 0);
    lora_scale: alpha / rank of the LoRA adapters P holds (none: no term); dropout: on
    their inputs (lora_dropout); aux: a list the MoE layers append their auxiliary losses to."""
    if c.family == "llama":
        return llama_logits(P, c, tokens, rope, positions, lora_scale, dropout, aux)
    return gpt2_logits(P, c, tokens, positions, lora_scale, dropout)


def mean_loss(P, c, tokens, targets):
    out = logits(P, c, tokens)
    return F.cross_entropy(out.reshape(-1, c.vocab_size).float() if out.dtype == torch.bfloat16
                           else out.reshape(-1, c.vocab_size), targets.reshape(-1))
