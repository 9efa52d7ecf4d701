"""
encoders/modernbert.py: ModernBERT (Warner et al., 2024), the encoder model.py builds where a config.json says
"modernbert": pre-norm layers without biases, rotary positions, attention within a window on all layers but every
n-th, a gated feed-forward. DeCLUTR trains it as it trains BERT and RoBERTa: model.py's packing, attention, MLM
head and pooling are shared, handed in; what differs is here, with its tensors' names in a Hugging Face checkpoint
(transformers' ModernBertForMaskedLM). It imports nothing of model.py, which names it in one line.

    python train.py --model answerdotai/ModernBERT-base --data docs/ --out runs/modern
"""
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class Fields:
    """The fields of a config.json that ModernBERT alone reads (None elsewhere), which model.ModelConfig extends:
    rotary positions with a global and a local theta, attention within local_attention // 2 tokens either side on all
    layers but every global_attn_every_n_layers-th."""
    embedding_dropout: float | None = None
    local_attention: int | None = None
    global_attn_every_n_layers: int | None = None
    global_rope_theta: float | None = None
    local_rope_theta: float | None = None


def parts(c, activation, attention):
    """(embeddings, layers, final norm) of a ModernBERT of config c (model.ModelConfig), its feed-forward gated by
    `activation` (config's hidden_act), its attention model.attention (on a CPU, cpu_layers.short_rows swaps it)."""
    layers = nn.ModuleList(Layer(c, i, activation, attention) for i in range(c.num_hidden_layers))
    # Its layers are pre-norm: the last one's output is normalised after them
    return Embeddings(c), layers, nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, bias=False)


class Embeddings(nn.Module):
    """The word embeddings alone, normalised: ModernBERT's positions are rotations inside attention."""

    def __init__(self, c):
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, bias=False)
        self.drop = nn.Dropout(c.embedding_dropout or 0.0)

    def forward(self, ids):
        return self.drop(self.ln(self.word(ids)))


def band(packing, window: int | None, device):
    """What a query may attend to: the real keys, on a local layer only those within `window` positions of it;
    (B | 1, 1, T | 1, T), or None for everything. Made once a forward for every local layer (packing.made)."""
    if window is None or packing.T <= window + 1:  # every key within the window anyway
        return packing.key_mask
    if ("band", window) not in packing.made:
        i = torch.arange(packing.T, device=device)
        near = ((i[:, None] - i[None]).abs() <= window)[None, None]  # (1, 1, T, T)
        packing.made["band", window] = near if packing.key_mask is None else near & packing.key_mask
    return packing.made["band", window]


def turns(packing, theta: float, hd: int, device):
    """rotary()'s cos and sin at every position, (T, hd): made once a forward for the layers of one theta."""
    if ("turns", theta, hd) not in packing.made:
        pairs = torch.arange(0, hd, 2, device=device)  # 2i for pair i, the exponent's numerator
        positions = torch.arange(packing.T, device=device)[:, None]  # (T, 1)
        angle = positions / theta ** (pairs / hd)  # (T, hd/2)
        packing.made["turns", theta, hd] = angle.repeat(1, 2).cos(), angle.repeat(1, 2).sin()
    return packing.made["turns", theta, hd]


def rotary(x, cos, sin):
    """Rotary positions (RoPE, Su et al. 2021): each pair of a head's dimensions (i, i + hd/2) of the token at
    position t turned by turns()'s angle t / theta^(2i/hd), so a query-key product depends on their distance."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c, i: int, attention):
        super().__init__()
        self.n_head, self.dropout_p = c.num_attention_heads, c.attention_probs_dropout_prob
        self.attention = attention  # model.attention; on a CPU support/cpu_layers.short_rows swaps it
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.out = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.drop = nn.Dropout(c.attention_probs_dropout_prob)
        # Every n-th layer attends to the whole text; the others within a window, their rotations of another theta
        local = i % c.global_attn_every_n_layers != 0
        self.window = c.local_attention // 2 if local else None
        self.theta = c.local_rope_theta if local else c.global_rope_theta

    def forward(self, x, packing):
        """x: (N, H) normalised; returns what the layer adds to its residual stream, (N, H)."""
        B, T, H = packing.B, packing.T, x.shape[-1]
        qkv = packing.unpack(self.qkv(x))  # (B, T, 3H); padding masked in attention
        heads = qkv.view(B, T, 3, self.n_head, H // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hd)
        cos, sin = turns(packing, self.theta, H // self.n_head, x.device)  # (T, hd) each
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        mask = band(packing, self.window, x.device)
        y = self.attention(q, k, v, mask, self.dropout_p if self.training else 0.0)  # (B, nh, T, hd)
        return self.drop(self.out(packing.pack(y.transpose(1, 2).reshape(B, T, H))))


class GeGLU(nn.Module):
    """The feed-forward: the up product makes two halves, the activation of the first gates the second."""

    def __init__(self, c, activation):
        super().__init__()
        self.up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.act = activation
        self.drop = nn.Dropout(c.hidden_dropout_prob)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        h, gate = self.up(x).chunk(2, dim=-1)  # (N, I) each
        return self.down(self.drop(self.act(h) * gate))


class Layer(nn.Module):
    def __init__(self, c, i: int, activation, attention):
        super().__init__()
        # Pre-norm: each block normalises its own input; all but layer 0's attention, whose input (the embeddings)
        # Embeddings has normalised already
        if i > 0:
            self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, bias=False)
        else:
            self.attn_norm = nn.Identity()
        self.attn = Attention(c, i, attention)
        self.mlp_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, bias=False)
        self.mlp = GeGLU(c, activation)

    def forward(self, x, packing):
        x = x + self.attn(self.attn_norm(x), packing)
        return x + self.mlp(self.mlp_norm(x))


def key_map(c) -> dict[str, list[str]]:
    """Our parameter name -> its tensor in transformers' ModernBertForMaskedLM: weights only, q, k, v already one
    tensor."""
    m = {"embeddings.word.weight": ["model.embeddings.tok_embeddings.weight"],
         "embeddings.ln.weight": ["model.embeddings.norm.weight"],
         "final.weight": ["model.final_norm.weight"],
         "mlm.dense.weight": ["head.dense.weight"], "mlm.ln.weight": ["head.norm.weight"],
         "mlm.bias": ["decoder.bias"]}
    for i in range(c.num_hidden_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        m |= {me + "attn.qkv.weight": [hf + "attn.Wqkv.weight"],
              me + "attn.out.weight": [hf + "attn.Wo.weight"],
              me + "mlp_norm.weight": [hf + "mlp_norm.weight"],
              me + "mlp.up.weight": [hf + "mlp.Wi.weight"],
              me + "mlp.down.weight": [hf + "mlp.Wo.weight"]}
        if i > 0:  # layer 0 has no attention norm
            m[me + "attn_norm.weight"] = [hf + "attn_norm.weight"]
    return m
