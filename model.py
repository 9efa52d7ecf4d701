"""
model.py: the encoder that DeCLUTR trains, a RoBERTa (or BERT) transformer in plain PyTorch.

DeCLUTR (Giorgi et al., ACL 2021) §3: an encoder f maps each span to token states; §3.1 mean-pools
them over the attention mask into one embedding e = g(f(span)); §3.3 adds the encoder's own masked
language modelling head, so the MLM logits come from the same forward pass as the embeddings.
Checkpoints come and go in Hugging Face layout (config.json, model.safetensors, tokenizer.json),
so transformers' AutoModel / RobertaForMaskedLM and sentence-transformers load ours unchanged.

    python model.py info ../shared/models/all-MiniLM-L6-v2     # load a local checkpoint, print its shape
    python model.py info distilroberta-base                    # download into $HF_HOME/hub once, then load
    python model.py convert path/to/checkpoint                 # pytorch_model.bin -> model.safetensors
    python model.py scratch --shape tiny --corpus docs/ --out tiny-model   # random init + BPE on your docs
"""
import argparse
import hashlib
import http.client
import inspect
import json
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers


@dataclass
class ModelConfig:
    model_type: str = "roberta"  # "roberta" or "bert" (BERT/MiniLM: token types, positions from 0)
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
    def position_offset(self) -> int:
        # fairseq's RoBERTa numbers positions from padding_idx+1; BERT from 0.
        return self.pad_token_id + 1 if self.model_type == "roberta" else 0

    @property
    def max_tokens(self) -> int:
        """Longest input, special tokens included, that has a position embedding."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, d: dict, where: str = "config.json") -> "ModelConfig":
        kind = d.get("model_type")
        if kind not in ("roberta", "bert"):
            raise ModelError(f"{where}: model_type {kind!r} is not supported (roberta or bert)")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ModelError(f"{where}: position_embedding_type {d['position_embedding_type']!r} is not supported")
        need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
        if missing := [k for k in need if k not in d]:
            raise ModelError(f"{where}: missing {', '.join(missing)}")
        base = {} if kind == "roberta" else dict(pad_token_id=0, type_vocab_size=2, layer_norm_eps=1e-12,
                                                 max_position_embeddings=512, bos_token_id=None, eos_token_id=None)
        c = cls(**{**base, **{f.name: d[f.name] for f in fields(cls) if f.name in d}})
        if c.hidden_act not in ACTIVATIONS:
            raise ModelError(f"{where}: hidden_act {c.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if c.hidden_size % c.num_attention_heads:
            raise ModelError(f"{where}: hidden_size {c.hidden_size} is not a multiple of {c.num_attention_heads} heads")
        return c

    def to_hf(self) -> dict:
        arch = "RobertaForMaskedLM" if self.model_type == "roberta" else "BertForMaskedLM"
        d = {k: v for k, v in asdict(self).items() if v is not None}
        return {"architectures": [arch], **d, "position_embedding_type": "absolute"}


class ModelError(ValueError):
    """A checkpoint or model name that cannot be used; the message is one line meant for the user."""


ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

# Named random-init shapes for pretraining from scratch (vocab is the size the BPE tokenizer is trained to).
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256, vocab_size=4096),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=16384),
    "distilroberta-base": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                               vocab_size=50265),
    "roberta-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=50265),
}

# -----------------------------------------------------------------------------------------------
# The network


class Embeddings(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.word = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, ids, token_type_ids=None):
        if self.c.model_type == "roberta":
            # Pads keep position padding_idx, real tokens count up from padding_idx+1 (as fairseq does),
            # so a span's positions do not depend on how much padding its batch needed.
            real = ids.ne(self.c.pad_token_id).int()
            pos = torch.cumsum(real, dim=1) * real + self.c.pad_token_id
        else:
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
        types = self.token_type.weight[0] if token_type_ids is None else self.token_type(token_type_ids)
        return self.drop(self.ln(self.word(ids) + self.position(pos) + types))


class SelfAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_head, self.p = c.num_attention_heads, c.attention_probs_dropout_prob
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)  # q, k, v in one matmul
        self.out = nn.Linear(c.hidden_size, c.hidden_size)
        self.ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x, mask, rows, B, T):
        """x: (N, H) the real tokens of a (B, T) batch; rows: their flat positions in it (None: all B*T)."""
        H = x.shape[-1]
        qkv = self.qkv(x)  # (N, 3H)
        if rows is not None:  # attention alone needs the (B, T) layout: scatter in, gather out
            qkv = qkv.new_zeros(B * T, 3 * H).index_copy_(0, rows, qkv)
        q, k, v = qkv.view(B, T, 3, self.n_head, H // self.n_head).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B * T, H)  # (B*T, H)
        if rows is not None:
            y = y[rows]  # (N, H)
        return self.ln(x + self.drop(self.out(y)))  # post-LayerNorm, as in BERT and RoBERTa


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.up = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = ACTIVATIONS[c.hidden_act]
        self.ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x):
        return self.ln(x + self.drop(self.down(self.act(self.up(x)))))


class Layer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn, self.ffn = SelfAttention(c), FeedForward(c)

    def forward(self, x, mask, rows, B, T):
        return self.ffn(self.attn(x, mask, rows, B, T))


class MLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (+ bias), as both papers' models."""

    def __init__(self, c: ModelConfig, word: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.act = F.gelu if c.model_type == "roberta" else ACTIVATIONS[c.hidden_act]
        self.ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.word = [word]  # in a list so the tied weight is registered (and saved) once, by Embeddings

    def forward(self, h):
        return F.linear(self.ln(self.act(self.dense(h))), self.word[0].weight, self.bias)


class Encoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.mlm = MLMHead(c, self.embeddings.word)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        """(B, T) token ids and 0/1 mask -> (B, T, H) last-layer token states (zeros at padding)."""
        B, T = input_ids.shape
        x = self.embeddings(input_ids, token_type_ids).flatten(0, 1)  # (B*T, H)
        mask = rows = None
        if attention_mask is not None and not bool(attention_mask.all()):
            # Spans of 32-512 tokens batched together are often half padding (§3.1's lengths): every
            # token-wise matmul runs on the N real tokens only; padding exists only inside attention.
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T) which keys to attend to
            rows = attention_mask.flatten().nonzero().squeeze(1)  # (N,)
            x = x[rows]  # (N, H)
        for layer in self.layers:
            x = layer(x, mask, rows, B, T)
        if rows is not None:
            x = x.new_zeros(B * T, x.shape[-1]).index_copy_(0, rows, x)
        return x.view(B, T, -1)  # (B, T, H)

    def mlm_logits(self, hidden):
        """(..., H) token states -> (..., V); pass only the masked positions to skip the rest (§3.3)."""
        return self.mlm(hidden)

    def embed(self, input_ids, attention_mask):
        return mean_pool(self(input_ids, attention_mask), attention_mask)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator):
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms, a zero pad embedding."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, self.config.initializer_range, generator=generator)
            if isinstance(m, nn.Linear):
                m.bias.zero_()
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0), m.bias.zero_()
        self.embeddings.word.weight[self.config.pad_token_id].zero_()
        self.mlm.bias.zero_()


def mean_pool(hidden, attention_mask):
    """§3.1: the span embedding is the mean of its token states over the attention mask."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


# -----------------------------------------------------------------------------------------------
# Hugging Face names <-> ours: an explicit map, checked both ways on load.


def hf_key_map(c: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensor(s) it is made of (q, k, v are concatenated)."""
    p = c.model_type
    m = {"embeddings.word.weight": [f"{p}.embeddings.word_embeddings.weight"],
         "embeddings.position.weight": [f"{p}.embeddings.position_embeddings.weight"],
         "embeddings.token_type.weight": [f"{p}.embeddings.token_type_embeddings.weight"]}
    for wb in ("weight", "bias"):
        m[f"embeddings.ln.{wb}"] = [f"{p}.embeddings.LayerNorm.{wb}"]
        for i in range(c.num_hidden_layers):
            hf, me = f"{p}.encoder.layer.{i}.", f"layers.{i}."
            m[me + f"attn.qkv.{wb}"] = [hf + f"attention.self.{n}.{wb}" for n in ("query", "key", "value")]
            m[me + f"attn.out.{wb}"] = [hf + f"attention.output.dense.{wb}"]
            m[me + f"attn.ln.{wb}"] = [hf + f"attention.output.LayerNorm.{wb}"]
            m[me + f"ffn.up.{wb}"] = [hf + f"intermediate.dense.{wb}"]
            m[me + f"ffn.down.{wb}"] = [hf + f"output.dense.{wb}"]
            m[me + f"ffn.ln.{wb}"] = [hf + f"output.LayerNorm.{wb}"]
        head = "lm_head." if p == "roberta" else "cls.predictions.transform."
        m[f"mlm.dense.{wb}"] = [head + f"dense.{wb}"]
        m[f"mlm.ln.{wb}"] = [head + ("layer_norm" if p == "roberta" else "LayerNorm") + f".{wb}"]
    m["mlm.bias"] = ["lm_head.bias" if p == "roberta" else "cls.predictions.bias"]
    return m


# Tensors a checkpoint may carry that this encoder does not use: the pooler and NSP heads (DeCLUTR pools
# by mean, §3.1), position-id buffers, and the decoder copies that are tied to the embeddings anyway.
IGNORED = re.compile(r"^(pooler\.|cls\.seq_relationship\.|embeddings\.(position_ids|token_type_ids)$|"
                     r"lm_head\.decoder\.|cls\.predictions\.decoder\.)")


def _hf_name(key: str, kind: str) -> str:
    """Checkpoint key in the ForMaskedLM layout, whatever layout (bare encoder, old gamma/beta) it came in."""
    key = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", key))
    return key if key.startswith((f"{kind}.", "lm_head.", "cls.")) else f"{kind}.{key}"


def load_state(model: Encoder, tensors: dict[str, torch.Tensor], where: str) -> list[str]:
    """Copy HF-named tensors into the model; return notes for the user. Raises ModelError on any mismatch."""
    c = model.config
    got = {_hf_name(k, c.model_type): v for k, v in tensors.items()}
    unused = {k for k in got if not IGNORED.match(k.removeprefix(f"{c.model_type}."))}
    ours, notes, missing = model.state_dict(), [], []
    for name, sources in hf_key_map(c).items():
        if not all(s in got for s in sources):
            missing += [s for s in sources if s not in got]
            continue
        unused -= set(sources)
        t = torch.cat([got[s] for s in sources]) if len(sources) > 1 else got[sources[0]]
        if t.shape != ours[name].shape:
            raise ModelError(f"{where}: {sources[0]} has shape {tuple(t.shape)}, config.json implies "
                             f"{tuple(ours[name].shape)}")
        ours[name].copy_(t)
    head = [s for n, ss in hf_key_map(c).items() if n.startswith("mlm.") for s in ss]
    if set(missing) == set(head):  # a bare encoder: keep the fresh head, say so
        notes.append(f"{where}: no MLM head in the checkpoint, initialised a fresh one")
    elif missing:
        raise ModelError(f"{where}: missing {len(missing)} tensors, e.g. {', '.join(sorted(missing)[:3])}")
    if unused:
        raise ModelError(f"{where}: {len(unused)} unexpected tensors, e.g. {', '.join(sorted(unused)[:3])}")
    return notes


def hf_state_dict(model: Encoder) -> dict[str, torch.Tensor]:
    """Our weights under the Hugging Face ForMaskedLM names, ready for safetensors."""
    sd = model.state_dict()
    out = {}
    for name, sources in hf_key_map(model.config).items():
        for s, t in zip(sources, sd[name].chunk(len(sources))):
            out[s] = t.detach().to("cpu", torch.float32).contiguous().clone()
    return out


# -----------------------------------------------------------------------------------------------
# Tokenizers: whatever files a checkpoint ships, as a `tokenizers.Tokenizer` with no padding or truncation.

ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def load_tokenizer(d: Path) -> Tokenizer:
    if (d / "tokenizer.json").exists():
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    elif (d / "vocab.json").exists() and (d / "merges.txt").exists():  # GPT-2 style files, as RoBERTa ships
        tok = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
        _byte_level(tok)
    elif (d / "vocab.txt").exists():  # WordPiece, as BERT ships
        lower = _read_json(d / "tokenizer_config.json", {}).get("do_lower_case", True)
        tok = Tokenizer(models.WordPiece.from_file(str(d / "vocab.txt"), unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                           special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
        tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    else:
        raise ModelError(f"{d}: no tokenizer.json, vocab.json + merges.txt, or vocab.txt")
    # The shared MiniLM's tokenizer.json pads everything to 128 and truncates at 128: batching is ours to do.
    tok.no_padding()
    tok.no_truncation()
    return tok


def _byte_level(tok: Tokenizer):
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(ROBERTA_SPECIALS[:4] + [AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """cls/sep/pad/mask/unk ids under RoBERTa's or BERT's names."""
    names = {"cls": ("<s>", "[CLS]"), "sep": ("</s>", "[SEP]"), "pad": ("<pad>", "[PAD]"),
             "mask": ("<mask>", "[MASK]"), "unk": ("<unk>", "[UNK]")}
    out = {}
    for k, cands in names.items():
        ids = [tok.token_to_id(n) for n in cands if tok.token_to_id(n) is not None]
        if not ids:
            raise ModelError(f"tokenizer has no {k} token ({' or '.join(cands)})")
        out[k] = ids[0]
    return out


def pad_rows(rows: list[list[int]], pad_id: int):
    """Token id lists -> (B, T) ids and 0/1 mask, padded on the right to the longest."""
    T = max(map(len, rows), default=0)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


def batch_encode(tok: Tokenizer, texts: list[str], max_tokens: int, pad_id: int):
    """Texts -> (B, T) ids and mask, padded to the longest; over-long texts keep their final special token."""
    rows = [e.ids if len(e.ids) <= max_tokens else e.ids[:max_tokens - 1] + e.ids[-1:] for e in tok.encode_batch(texts)]
    return pad_rows(rows, pad_id)


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE (RoBERTa's kind) trained on the user's own documents, for pretraining from scratch."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=ROBERTA_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    _byte_level(tok)
    return tok


# -----------------------------------------------------------------------------------------------
# Loading and saving checkpoints


def _read_json(path: Path, default=None):
    if not path.exists() and default is not None:
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read JSON ({e})") from None


def read_safetensors(d: Path) -> dict[str, torch.Tensor]:
    if (d / "model.safetensors").exists():
        files = [d / "model.safetensors"]
    elif (d / "model.safetensors.index.json").exists():
        index = _read_json(d / "model.safetensors.index.json")
        files = [d / f for f in sorted(set(index.get("weight_map", {}).values()))]
    elif (d / "pytorch_model.bin").exists():
        raise ModelError(f"{d}: only pytorch_model.bin, which is never unpickled implicitly; convert it once with: "
                         f"python model.py convert {d}")
    else:
        raise ModelError(f"{d}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return out


def resolve(name: str, weights: bool = True) -> Path:
    """A local directory as it is, or a hub id downloaded (config and tokenizer, plus weights if asked)."""
    d = Path(name).expanduser()
    if d.is_dir():
        return d
    if d.exists() or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) or name.startswith("."):
        raise ModelError(f"{name}: not a directory")
    return hub_download(name, files=HUB_FILES if weights else HUB_FILES[:2])


def load_config_and_tokenizer(name: str) -> tuple[ModelConfig, Tokenizer]:
    """What the data side needs of a model (its tokenizer, its longest input) without loading weights."""
    d = resolve(name, weights=False)
    if not (d / "config.json").exists():
        raise ModelError(f"{d}: no config.json")
    return ModelConfig.from_hf(_read_json(d / "config.json"), str(d / "config.json")), load_tokenizer(d)


def load_pretrained(name: str, verbose: bool = True) -> tuple[Encoder, Tokenizer]:
    """A local Hugging Face directory or a hub id -> (encoder in eval mode, tokenizer)."""
    d = resolve(name)
    config, tok = load_config_and_tokenizer(str(d))
    model = Encoder(config)
    model.init_weights(torch.Generator().manual_seed(0))  # only a missing MLM head keeps these
    for note in load_state(model, read_safetensors(d), str(d)):
        if verbose:
            print(note, file=sys.stderr)
    if tok.get_vocab_size() > config.vocab_size:
        raise ModelError(f"{d}: tokenizer has {tok.get_vocab_size()} tokens, the model {config.vocab_size}")
    return model.eval(), tok


def parse_config(cls, argv=None, doc: str = "", positional: tuple = ()):
    """A config dataclass from the command line: one flag per field (or a positional list for the fields
    named in `positional`), its comment as help, every default shown."""
    notes = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
    ap, lists = argparse.ArgumentParser(description=doc), set()
    for f in fields(cls):
        if f.name in positional:
            ap.add_argument(f.name, nargs="+", help=notes.get(f.name, ""))
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        kw = dict(default=default, help=(notes.get(f.name, "") + " (default: %(default)s)").strip())
        if f.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, list):  # --data a b, or --model a --model b
            kw.update(nargs="+", type=str, action="extend", default=None)
            lists.add(f.name)
        else:
            kw["type"] = type(default) if default is not None else str
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        ap.add_argument("--" + f.name.replace("_", "-"), **kw)
    args = vars(ap.parse_args(argv))
    return cls(**{k: [] if k in lists and v is None else v for k, v in args.items()})


def _write_atomic(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_pretrained(model: Encoder, tok: Tokenizer, out: str | Path):
    """Hugging Face layout, plus sentence-transformers' files saying 'mean pooling' (§3.1)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c, sp = model.config, special_ids(tok)
    text = lambda obj: (lambda p: p.write_text(json.dumps(obj, indent=2) + "\n"))
    _write_atomic(out / "model.safetensors", lambda p: save_file(hf_state_dict(model), str(p), {"format": "pt"}))
    _write_atomic(out / "config.json", text(c.to_hf()))
    _write_atomic(out / "tokenizer.json", lambda p: tok.save(str(p)))
    names = {k: tok.id_to_token(v) for k, v in sp.items()}
    tconf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": c.max_tokens,
             "bos_token": names["cls"], "eos_token": names["sep"], **{f"{k}_token": v for k, v in names.items()}}
    _write_atomic(out / "tokenizer_config.json", text(tconf))
    _write_atomic(out / "modules.json", text([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    _write_atomic(out / "sentence_bert_config.json", text({"max_seq_length": c.max_tokens, "do_lower_case": False}))
    (out / "1_Pooling").mkdir(exist_ok=True)
    _write_atomic(out / "1_Pooling" / "config.json", text({"word_embedding_dimension": c.hidden_size,
                                                           "pooling_mode_mean_tokens": True}))


def from_scratch(shape: str, texts, seed: int = 0, max_position_embeddings: int = 514) -> tuple[Encoder, Tokenizer]:
    """A random-init RoBERTa of a named shape, with a BPE tokenizer trained on `texts` (an iterable of str)."""
    if shape not in SHAPES:
        raise ModelError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    s = dict(SHAPES[shape])
    tok = train_tokenizer(texts, s.pop("vocab_size"))
    c = ModelConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=max_position_embeddings, **s)
    model = Encoder(c)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model, tok


def convert_bin(src: Path, out: Path):
    """pytorch_model.bin -> model.safetensors, unpickled with weights_only=True (tensors only, no code)."""
    try:
        sd = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler raises many kinds; all mean "not a plain tensor file"
        raise ModelError(f"{src / 'pytorch_model.bin'}: cannot load with weights_only=True ({str(e).splitlines()[0]})")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    _write_atomic(out / "model.safetensors", lambda p: save_file(tensors, str(p), {"format": "pt"}))


# -----------------------------------------------------------------------------------------------
# The hub: plain HTTPS into $HF_HOME/hub, in huggingface_hub's folder layout (refs/REV -> snapshots/COMMIT).


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the first answer carries the file's size and sha256; the redirect target does not


def _head(url: str):
    try:
        return urllib.request.build_opener(_NoRedirect).open(urllib.request.Request(url, method="HEAD"), timeout=30).headers
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            return e.headers
        raise


def _git_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# What a checkpoint needs, each group satisfied by the first alternative the repo has.
HUB_FILES = (("config.json",), ("tokenizer.json", "vocab.txt", ("vocab.json", "merges.txt")),
             ("model.safetensors", "model.safetensors.index.json"))


def hub_download(repo: str, revision: str = "main", files: tuple = ()) -> Path:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    root = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub" / f"models--{repo.replace('/', '--')}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    ref = root / "refs" / revision
    snap = root / "snapshots" / (ref.read_text().strip() if ref.exists() else revision)
    local = f"pass a local directory holding config.json, model.safetensors and tokenizer.json instead of {repo!r}"

    def fetch(name: str) -> bool:
        nonlocal snap
        if (snap / name).exists():
            return True
        if offline:
            return False
        url = f"{endpoint}/{repo}/resolve/{revision}/{name}"
        try:
            head = _head(url)
            if commit := head.get("X-Repo-Commit"):
                snap = root / "snapshots" / commit
                if (snap / name).exists():
                    return True
            size = int(head.get("X-Linked-Size") or head.get("Content-Length") or -1)
            etag = (head.get("X-Linked-Etag") or head.get("ETag") or "").removeprefix("W/").strip('"')
            resp = urllib.request.urlopen(url, timeout=60)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise ModelError(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ModelError(f"cannot reach {endpoint} ({getattr(e, 'reason', e)}); {local}") from None
        snap.mkdir(parents=True, exist_ok=True)
        tmp, h, n = snap / f"{name}.{os.getpid()}.incomplete", hashlib.sha256(), 0
        try:
            with resp, open(tmp, "wb") as f:
                while chunk := resp.read(1 << 20):
                    f.write(chunk), h.update(chunk)
                    n += len(chunk)
                    if size > 1 << 22 and sys.stderr.isatty():
                        print(f"\r{repo}/{name}: {n / 2**20:.0f}/{size / 2**20:.0f} MiB", end="", file=sys.stderr)
            if size >= 0 and n != size:
                raise ModelError(f"{url}: got {n} of {size} bytes")
            if re.fullmatch(r"[0-9a-f]{64}", etag) and h.hexdigest() != etag:  # LFS files: sha256
                raise ModelError(f"{url}: sha256 {h.hexdigest()} differs from the server's {etag}")
            if re.fullmatch(r"[0-9a-f]{40}", etag) and _git_sha1(tmp) != etag:  # small files: git's blob id
                raise ModelError(f"{url}: content differs from the server's git blob id {etag}")
            os.replace(tmp, snap / name)  # only a complete, verified file ever gets its real name
        except (OSError, http.client.HTTPException) as e:
            raise ModelError(f"{url}: download failed ({e!r})") from None
        finally:
            tmp.unlink(missing_ok=True)
        if snap.name != revision:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(snap.name)
        return True

    for group in files or HUB_FILES:
        for alt in group:  # the first alternative the repo has
            if all(fetch(f) for f in ((alt,) if isinstance(alt, str) else alt)):
                if alt == "model.safetensors.index.json":
                    for shard in sorted(set(_read_json(snap / alt).get("weight_map", {}).values())):
                        if not fetch(shard):
                            raise ModelError(f"{repo}: shard {shard} is missing")
                break
        else:
            why = "HF_HUB_OFFLINE is set and it is not in the cache" if offline else f"the hub has none of {group}"
            raise ModelError(f"{repo}: {why}; {local}")
    return snap


# -----------------------------------------------------------------------------------------------


def _read_texts(paths):
    for p in paths:
        for f in sorted(Path(p).rglob("*.txt")) if Path(p).is_dir() else [Path(p)]:
            yield f.read_text(encoding="utf-8", errors="replace")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="load a checkpoint and print its shape").add_argument("model")
    cv = sub.add_parser("convert", help="pytorch_model.bin -> model.safetensors (weights_only unpickling)")
    cv.add_argument("model", help="local directory, or hub id whose repo ships only pytorch_model.bin")
    cv.add_argument("--out", help="output directory (default: the model's own directory)")
    sc = sub.add_parser("scratch", help="random init of a named shape, BPE tokenizer trained on --corpus",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sc.add_argument("--shape", default="tiny", choices=list(SHAPES), help="named random-init shape")
    sc.add_argument("--corpus", nargs="+", required=True, help=".txt files or directories of them")
    sc.add_argument("--out", required=True, help="directory to write the checkpoint into")
    sc.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "info":
            model, tok = load_pretrained(a.model)
            c = model.config
            n = sum(p.numel() for p in model.parameters())
            print(f"{a.model}: {c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                  f"{c.num_attention_heads} heads, vocab {c.vocab_size}, up to {c.max_tokens} tokens, {n / 1e6:.1f}M parameters")
        elif a.cmd == "convert":
            src = Path(a.model)
            if not src.is_dir():
                src = hub_download(a.model, files=HUB_FILES[:2] + (("pytorch_model.bin",),))
            out = Path(a.out or src)
            if out != src:
                out.mkdir(parents=True, exist_ok=True)
                for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "vocab.txt"):
                    if (src / f).exists():
                        (out / f).write_bytes((src / f).read_bytes())
            if (out / "model.safetensors").exists():
                raise ModelError(f"{out / 'model.safetensors'} exists already; remove it first or pass --out")
            convert_bin(src, out)
            load_pretrained(str(out))  # proves the result loads
            print(f"wrote {out / 'model.safetensors'}")
        else:
            for p in a.corpus:
                if not Path(p).exists():
                    raise ModelError(f"{p}: no such file or directory")
            model, tok = from_scratch(a.shape, _read_texts(a.corpus), a.seed)
            save_pretrained(model, tok, a.out)
            print(f"wrote {a.out}: {a.shape}, vocab {model.config.vocab_size}")
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
