"""
model.py: the encoder that DeCLUTR trains, a RoBERTa or BERT transformer, in plain PyTorch
(ModernBERT's own layers: encoders/modernbert.py).

DeCLUTR (Giorgi et al., ACL 2021) §3: an encoder f maps each span to token states; §3.1 mean-pools
them over the attention mask into one embedding e = g(f(span)); §3.3 adds the encoder's own masked
language modelling head, so the MLM logits come from the same forward pass as the embeddings.
Weights come and go as Hugging Face safetensors through an explicit name map, so transformers and
sentence-transformers load ours unchanged (hub downloads and file formats: support/hub.py).

The forward below is what runs, in fp32 and in bf16. Two swaps on a CPU, each made in one visible
line, nowhere else (support/cpu_layers.py): attention over rows of up to 64 tokens written out, as
two matmuls around a softmax (train.py, embed.py, evaluate_sts.py); and for inference in bf16, where
the processor runs them, the layers' linear products as oneDNN's, their weights laid out once and
BERT's GELU applied inside the up product (embed.py, evaluate_sts.py; `--no-onednn` keeps ours).

    python model.py info distilroberta-base   # download to $HF_HOME/hub once, load, print its shape
    python model.py info path/to/checkpoint   # the same for a local Hugging Face folder
    python model.py convert johngiorgi/declutr-small --out declutr-small   # .bin -> .safetensors
    python model.py scratch --shape tiny --corpus docs/ --out tiny-model   # random init + BPE
"""
import functools
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from encoders import modernbert
from support import configs, demo, hub, model_tools
from support.cli import UserError, cli, say


@dataclass
class ModelConfig(modernbert.Fields):  # what this encoder reads of a Hugging Face config.json
    # roberta, xlm-roberta, camembert (RoBERTa's), bert (and MiniLM) or modernbert
    model_type: str = "roberta"
    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    pad_token_id: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2

    @property
    def roberta(self) -> bool:
        """RoBERTa's architecture: RoBERTa itself, XLM-R, CamemBERT (configs.MODEL_TYPES)."""
        return self.model_type not in ("bert", "modernbert")

    @property
    def modern(self) -> bool:
        """ModernBERT (Warner et al., 2024): its own layers, in encoders/modernbert.py."""
        return self.model_type == "modernbert"

    @property
    def prefix(self) -> str:
        """The prefix of its tensor names in a Hugging Face checkpoint: `roberta.` for the whole
        RoBERTa family."""
        return configs.MODEL_TYPES[self.model_type][0]

    @property
    def position_offset(self) -> int:
        # fairseq's RoBERTa numbers positions from padding_idx+1; BERT from 0.
        return self.pad_token_id + 1 if self.roberta else 0

    @property
    def max_tokens(self) -> int:
        """Longest input, special tokens included, that has a position embedding."""
        return self.max_position_embeddings - self.position_offset


GELU_TANH = functools.partial(F.gelu, approximate="tanh")
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": GELU_TANH,
               "gelu_pytorch_tanh": GELU_TANH}

# -----------------------------------------------------------------------------------------------
# The network


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.word = nn.Embedding(config.vocab_size, config.hidden_size,
                                 padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, ids):
        if self.config.roberta:
            # Pads keep position padding_idx, real tokens count up from padding_idx+1 (as fairseq
            # does), so a span's positions do not depend on how much padding its batch needed.
            real = ids.ne(self.config.pad_token_id).int()
            pos = torch.cumsum(real, dim=1) * real + self.config.pad_token_id
        else:
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
        # Every span is one segment: token type 0 (BERT's second segment never occurs)
        return self.drop(self.ln(self.word(ids) + self.position(pos) + self.token_type.weight[0]))


class Packing:
    """A (B, T) batch padded on the right, as the (N, H) list of the places the token-wise layers
    run on. Spans of 32-512 tokens batched together are often half padding (§3.2's lengths): every
    token-wise matmul runs on the real tokens only, and padding exists only inside attention, masked
    there. positions None: the batch left as it is, attending without a mask unless one is given
    (embed.py's batches of texts of near-equal lengths, whose few padding places cost less to run
    than to take out)."""

    def __init__(self, B: int, T: int, positions=None, attention_mask=None):
        self.B, self.T = B, T
        self.positions = positions  # (N,) flat places in (B*T), or None: all of them
        # (B, 1, 1, T): True at the real keys
        self.key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        # What a layer makes once a forward for the others (ModernBERT's masks and rotations)
        self.made = {}

    @classmethod
    def of(cls, B: int, T: int, attention_mask=None):
        """The real tokens, found from the mask. On a GPU, nonzero() makes the host wait for all the
        GPU was given: callers that know the lengths (train.py's chunks, embed.py's batches) work
        the places out on the host."""
        if attention_mask is None or bool(attention_mask.all()):
            return cls(B, T)
        return cls(B, T, attention_mask.flatten().nonzero().squeeze(1), attention_mask)

    def pack(self, x):
        """(B, T, ...) -> (N, ...)"""
        x = x.flatten(0, 1)
        return x if self.positions is None else x[self.positions]

    def unpack(self, x):
        """(N, ...) -> (B, T, ...), with zeros at padding where there are positions"""
        if self.positions is not None:
            x = x.new_zeros(self.B * self.T, *x.shape[1:]).index_copy_(0, self.positions, x)
        return x.view(self.B, self.T, *x.shape[1:])

def attention(q, k, v, mask, dropout_p: float):
    """softmax(q k^T / sqrt(hd), where mask) v for q, k, v (B, nh, T, hd) and a bool mask broadcast
    to (B, nh, T, T) (None: every key): torch's fused kernel. Each layer holds it as `attention`,
    which on a CPU support/cpu_layers.short_rows swaps for one written out for short rows."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.dropout_p = config.attention_probs_dropout_prob
        self.attention = attention  # swapped on a CPU by support/cpu_layers.short_rows
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)  # q, k, v in one matmul
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, packing):
        """x: (N, H), the real tokens of a (B, T) batch (Packing, above); attention alone needs the
        (B, T) layout."""
        B, T, H = packing.B, packing.T, x.shape[-1]
        qkv = packing.unpack(self.qkv(x))  # (B, T, 3H); padding masked in attention
        heads = qkv.view(B, T, 3, self.n_head, H // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hd)
        y = self.attention(q, k, v, packing.key_mask, self.dropout_p if self.training else 0.0)
        y = packing.pack(y.transpose(1, 2).reshape(B, T, H))  # (N, H)
        return self.ln(x + self.drop(self.out(y)))  # post-LayerNorm, as in BERT and RoBERTa


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x):
        return self.ln(x + self.drop(self.down(self.act(self.up(x)))))


class Layer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn, self.ffn = SelfAttention(config), FeedForward(config)

    def forward(self, x, packing):
        return self.ffn(self.attn(x, packing))


class MLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (+ bias), as both papers'
    models."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # ModernBERT's head has no bias but the decoder's
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=not config.modern)
        # RoBERTa's head applies exact GELU whatever hidden_act says (fairseq's, and transformers'
        # RobertaLMHead); BERT's applies hidden_act
        self.act = F.gelu if config.roberta else ACTIVATIONS[config.hidden_act]
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                               bias=not config.modern)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h, word_weight):
        return F.linear(self.ln(self.act(self.dense(h))), word_weight, self.bias)


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # ModernBERT's embeddings and layers are its own (encoders/modernbert.py); the packing, the
        # attention, the MLM head and the pooling are shared
        if config.modern:
            parts = modernbert.parts(config, ACTIVATIONS[config.hidden_act], attention)
            self.embeddings, self.layers, self.final = parts
        else:
            self.embeddings = Embeddings(config)
            self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
            self.final = nn.Identity()
        self.mlm = MLMHead(config)
        # load_pretrained's: the folder it came from, its sentence-transformers settings
        self.source, self.sentence_transformers = None, {}

    def forward(self, input_ids, attention_mask=None, packing: Packing | None = None):
        """(B, T) token ids and 0/1 mask -> (B, T, H) last-layer token states (zeros at packed
        padding). Token-wise layers run on the real tokens only: `packing` says where they are,
        found from the mask where it is not given."""
        packing = packing or Packing.of(*input_ids.shape, attention_mask)
        x = packing.pack(self.embeddings(input_ids))  # (N, H)
        for layer in self.layers:
            x = layer(x, packing)
        return packing.unpack(self.final(x))  # (B, T, H)

    def mlm_logits(self, hidden):
        """(..., H) token states -> (..., V); pass only the masked positions to skip the rest
        (§3.3)."""
        return self.mlm(hidden, self.embeddings.word.weight)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, head_only: bool = False):
        """BERT's initialisation: N(0, 0.02) weights, zero biases and pad row, unit LayerNorms; or
        the MLM head's alone."""
        for m in (self.mlm if head_only else self).modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, self.config.initializer_range, generator=generator)
            if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is not None:
                m.bias.zero_()
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
        if not head_only:
            self.embeddings.word.weight[self.config.pad_token_id].zero_()
        self.mlm.bias.zero_()


def mean_pool(hidden, attention_mask):
    """§3.1: the span embedding is the mean of its token states over the attention mask."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


# -----------------------------------------------------------------------------------------------
# Hugging Face names <-> ours: an explicit map, checked both ways on load.


def hf_key_map(config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensor(s) it is made of (q, k, v are concatenated)."""
    if config.modern:
        return modernbert.key_map(config)
    prefix = config.prefix
    m = {"embeddings.word.weight": [f"{prefix}.embeddings.word_embeddings.weight"],
         "embeddings.position.weight": [f"{prefix}.embeddings.position_embeddings.weight"],
         "embeddings.token_type.weight": [f"{prefix}.embeddings.token_type_embeddings.weight"]}
    for wb in ("weight", "bias"):
        m[f"embeddings.ln.{wb}"] = [f"{prefix}.embeddings.LayerNorm.{wb}"]
        for i in range(config.num_hidden_layers):
            hf, me = f"{prefix}.encoder.layer.{i}.", f"layers.{i}."
            qkv = ("query", "key", "value")
            m[me + f"attn.qkv.{wb}"] = [hf + f"attention.self.{n}.{wb}" for n in qkv]
            m[me + f"attn.out.{wb}"] = [hf + f"attention.output.dense.{wb}"]
            m[me + f"attn.ln.{wb}"] = [hf + f"attention.output.LayerNorm.{wb}"]
            m[me + f"ffn.up.{wb}"] = [hf + f"intermediate.dense.{wb}"]
            m[me + f"ffn.down.{wb}"] = [hf + f"output.dense.{wb}"]
            m[me + f"ffn.ln.{wb}"] = [hf + f"output.LayerNorm.{wb}"]
        head = "lm_head." if config.roberta else "cls.predictions.transform."
        m[f"mlm.dense.{wb}"] = [head + f"dense.{wb}"]
        m[f"mlm.ln.{wb}"] = [head + ("layer_norm" if config.roberta else "LayerNorm") + f".{wb}"]
    m["mlm.bias"] = ["lm_head.bias" if config.roberta else "cls.predictions.bias"]
    return m


def load_config_and_tokenizer(name: str):
    """What the data side needs of a model (its tokenizer, its longest input) without loading
    weights."""
    path = hub.resolve(name, weights=False) / "config.json"
    read = configs.read_hf_config(path, [f.name for f in fields(ModelConfig)], list(ACTIVATIONS))
    return ModelConfig(**read), hub.load_tokenizer(path.parent)


def load_pretrained(name: str, quiet: bool = False):
    """A local Hugging Face directory or a hub id -> (encoder in eval mode, tokenizer)."""
    d = hub.resolve(name)
    config, tok = load_config_and_tokenizer(str(d))
    model, tensors = Encoder(config), hub.read_safetensors(d, config.prefix)
    head_missing = hub.load_state(model.state_dict(), hf_key_map(config), tensors, str(d),
                                  optional="mlm.")
    model.fresh_head = bool(head_missing)  # train.py says what it costs when MLM is on
    if head_missing:  # a bare encoder (all-MiniLM-L6-v2): §3.3's MLM needs a head, made as BERT's
        model.init_weights(torch.Generator().manual_seed(0), head_only=True)
        if not quiet:
            say(f"{d}: no MLM head in the checkpoint, initialised a fresh one", file=sys.stderr)
    if tok.get_vocab_size() > config.vocab_size:
        raise UserError(f"{d}: tokenizer has {tok.get_vocab_size()} tokens, the model "
                        f"{config.vocab_size}")
    model.source = d  # the folder it came from: for a hub id, the snapshot named by its commit
    # Its max_seq_length and Normalize module, kept when saved
    model.sentence_transformers = hub.read_sentence_transformers(d)
    return model.eval(), tok


def save_pretrained(model: Encoder, tok, out: str | Path):
    """Hugging Face layout, plus sentence-transformers' files saying 'mean pooling' (§3.1), keeping
    what the model came with of theirs (its max_seq_length, a Normalize module)."""
    config = model.config
    tensors = hub.hf_state_dict(model.state_dict(), hf_key_map(config))
    hub.write_model_folder(Path(out), tensors, config=configs.hf_config(asdict(config)), tok=tok,
                           hidden_size=config.hidden_size, max_tokens=config.max_tokens,
                           kept=model.sentence_transformers)


def scratch_encoder(shape: str, vocab_size: int, seed: int = 0,
                    max_position_embeddings: int = 514) -> Encoder:
    """A random-init RoBERTa of a named shape (support/demo.py's SHAPES) for a tokenizer of
    `vocab_size` tokens."""
    sizes = {k: v for k, v in demo.scratch_shape(shape).items() if k != "vocab_size"}
    model = Encoder(ModelConfig(vocab_size=vocab_size,
                                max_position_embeddings=max_position_embeddings, **sizes))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


@cli
def main(argv=None):
    """python model.py info | convert | scratch: the tools in support/model_tools.py"""
    model_tools.run(argv, __doc__.split("\n\n")[0], load_pretrained=load_pretrained,
                    save_pretrained=save_pretrained, scratch_encoder=scratch_encoder)


if __name__ == "__main__":
    main()
