"""
support/configs.py: config.json, read into model.ModelConfig's fields and written back for transformers. RoBERTa,
XLM-R, CamemBERT and BERT use the names ModelConfig does; ModernBERT's own names (as transformers 4 and 5 write them)
are translated both ways here, and a variant model.py does not build is refused in one line.
"""
from pathlib import Path

from support.cli import UserError
from support.files import read_json

# model_type -> (the prefix of its tensor names, its transformers class). XLM-R and CamemBERT are RoBERTa's
# architecture and tensor names under another model_type; BERT (and MiniLM) differs in token types, positions, eps.
MODEL_TYPES = {"roberta": ("roberta", "RobertaForMaskedLM"), "xlm-roberta": ("roberta", "XLMRobertaForMaskedLM"),
               "camembert": ("roberta", "CamembertForMaskedLM"), "bert": ("bert", "BertForMaskedLM"),
               "modernbert": ("model", "ModernBertForMaskedLM")}

# ModernBERT's config.json names for what model.ModelConfig calls otherwise (theirs -> ours), and what it must say
# of what model.py does not build (biases, an untied or biasless decoder, a head with its own activation)
MODERNBERT_NAMES = {"hidden_activation": "hidden_act", "norm_eps": "layer_norm_eps",
                    "mlp_dropout": "hidden_dropout_prob", "attention_dropout": "attention_probs_dropout_prob"}
MODERNBERT_FIXED = {"attention_bias": False, "mlp_bias": False, "norm_bias": False, "classifier_bias": False,
                    "decoder_bias": True, "tie_word_embeddings": True}
MODERNBERT_DEFAULTS = dict(pad_token_id=50283, bos_token_id=50281, eos_token_id=50282, max_position_embeddings=8192,
                           layer_norm_eps=1e-5, hidden_act="gelu", hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, embedding_dropout=0.0, local_attention=128,
                           global_attn_every_n_layers=3, global_rope_theta=160_000.0, local_rope_theta=10_000.0)


def read_hf_config(path: Path, names: list[str], activations: list[str]) -> dict:
    """The fields `names` of a Hugging Face config.json, with BERT's defaults where a BERT config leaves them out;
    one line for a shape model.py does not build (an activation not among `activations`, heads that do not divide
    the hidden size)."""
    fields = _read_hf_config(path, names)
    if fields.get("hidden_act", "gelu") not in activations:
        raise UserError(f"{path}: hidden_act {fields['hidden_act']!r} is not supported ({', '.join(activations)})")
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise UserError(f"{path}: hidden_size {fields['hidden_size']} is not a multiple of "
                        f"{fields['num_attention_heads']} heads")
    return fields


def _read_hf_config(path: Path, names: list[str]) -> dict:
    if not path.exists():
        raise UserError(f"{path.parent}: no config.json")
    d = read_json(path)
    kind = d.get("model_type")
    if kind not in MODEL_TYPES:
        raise UserError(f"{path}: model_type {kind!r} is not supported ({', '.join(MODEL_TYPES)})")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{path}: position_embedding_type {d['position_embedding_type']!r} is not supported")
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    if missing := [k for k in need if k not in d]:
        raise UserError(f"{path}: missing {', '.join(missing)}")
    if kind == "modernbert":
        return _modernbert_config(path, d, names)
    base = {} if kind != "bert" else dict(pad_token_id=0, type_vocab_size=2, layer_norm_eps=1e-12,
                                           max_position_embeddings=512, bos_token_id=None, eos_token_id=None)
    return {**base, **{k: d[k] for k in names if k in d}}


def _modernbert_config(path: Path, d: dict, names: list[str]) -> dict:
    """A ModernBERT config.json under our names: transformers 4's keys (global_attn_every_n_layers, the two rope
    thetas) or transformers 5's (layer_types, rope_parameters); one line for a variant model.py does not build."""
    for key, value in {**MODERNBERT_FIXED, "classifier_activation": d.get("hidden_activation", "gelu")}.items():
        if d.get(key, value) != value:
            raise UserError(f"{path}: {key} {d[key]!r} is not supported (ModernBERT's own is {value!r})")
    ours = {**MODERNBERT_DEFAULTS, **{MODERNBERT_NAMES.get(k, k): v for k, v in d.items()}}
    ours["layer_norm_eps"] = d.get("norm_eps", MODERNBERT_DEFAULTS["layer_norm_eps"])  # not BERT's layer_norm_eps
    rope = d.get("rope_parameters") or {}
    for kind, key in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
        if kind in rope:
            if rope[kind].get("rope_type", "default") != "default":
                raise UserError(f"{path}: rope_type {rope[kind]['rope_type']!r} is not supported (only 'default')")
            ours[key] = rope[kind].get("rope_theta", ours[key])
    if types := d.get("layer_types"):  # every n-th layer global, from layer 0: the only pattern ModernBERT has
        n = next((i for i, kind in enumerate(types) if i and kind == "full_attention"), len(types))
        if types != ["full_attention" if i % n == 0 else "sliding_attention" for i in range(len(types))]:
            raise UserError(f"{path}: layer_types is not every n-th layer global from layer 0, which model.py builds")
        ours["global_attn_every_n_layers"] = n
    return {k: ours[k] for k in names if k in ours}


def hf_config(fields: dict) -> dict:
    """config.json for transformers' AutoModel and AutoModelForMaskedLM (None fields left out)."""
    arch = MODEL_TYPES[fields["model_type"]][1]
    if fields["model_type"] == "modernbert":  # its own names, and [CLS] and [SEP] as its bos and eos
        theirs = {ours: name for name, ours in MODERNBERT_NAMES.items()}
        fields = {theirs.get(k, k): v for k, v in fields.items() if k != "type_vocab_size"}
        return {"architectures": [arch], **{k: v for k, v in fields.items() if v is not None}, **MODERNBERT_FIXED,
                "classifier_activation": fields["hidden_activation"], "cls_token_id": fields["bos_token_id"],
                "sep_token_id": fields["eos_token_id"]}
    return {"architectures": [arch], **{k: v for k, v in fields.items() if v is not None},
            "position_embedding_type": "absolute"}
