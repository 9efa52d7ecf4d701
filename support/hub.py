"""
support/hub.py: Hugging Face files: downloads, tokenizer formats, safetensors shards, pytorch_model.bin conversion
(config.json: support/configs.py). A reader does not need this file to understand DeCLUTR; model.py uses it to read
and write checkpoints.

- The hub, through huggingface_hub: only the files a checkpoint needs, into its cache ($HF_HOME/hub); HF_TOKEN,
  HF_ENDPOINT, HF_HUB_OFFLINE and `org/name@revision` honoured; each file checked against its hash (sha256 or git
  blob id) when it arrives; every failure one line naming the repo and what to do.
- Tokenizers: tokenizer.json, vocab.json + merges.txt (RoBERTa), or vocab.txt (BERT), always without padding or
  truncation; a byte-level BPE trained on the user's documents for models trained from scratch.
"""
import hashlib
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import huggingface_hub
import huggingface_hub.errors as hf_errors
import safetensors.torch
import torch
from safetensors import SafetensorError
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from support.cli import Progress, UserError, first_line
from support.files import make_dirs, offline, read_json, write_atomic, write_json

# -----------------------------------------------------------------------------------------------
# Tokenizers: whatever files a checkpoint ships, as a `tokenizers.Tokenizer` with no padding or truncation.

ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "vocab.txt")


def load_tokenizer(d: Path) -> Tokenizer:
    if (d / "tokenizer.json").exists():
        tok = _readable(d / "tokenizer.json", lambda: Tokenizer.from_file(str(d / "tokenizer.json")))
    elif (d / "vocab.json").exists() and (d / "merges.txt").exists():  # GPT-2 style files, as RoBERTa ships
        tok = Tokenizer(_readable(d / "vocab.json", lambda: models.BPE.from_file(str(d / "vocab.json"),
                                                                              str(d / "merges.txt"))))
        _byte_level(tok)
    elif (d / "vocab.txt").exists():  # WordPiece, as BERT ships
        tok = _wordpiece(d)
    elif (d / "sentencepiece.bpe.model").exists():  # XLM-R's and CamemBERT's SentencePiece file, without its JSON
        convert = f"AutoTokenizer.from_pretrained('{d}').save_pretrained('{d}')"
        raise UserError(f"{d}: only sentencepiece.bpe.model, and this project reads SentencePiece tokenizers from "
                        f"tokenizer.json; write one once with transformers (needs sentencepiece): python -c \"from "
                        f"transformers import AutoTokenizer; {convert}\"")
    else:
        raise UserError(f"{d}: no tokenizer.json, vocab.json + merges.txt, or vocab.txt")
    # all-MiniLM-L6-v2's tokenizer.json pads everything to 128 and truncates at 128: batching is ours to do.
    tok.no_padding()
    tok.no_truncation()
    return tok


def _readable(path: Path, load):
    """load(), or one line naming the file: the tokenizers library raises a bare Exception on a bad file."""
    try:
        return load()
    except Exception as e:
        raise UserError(f"{path}: not a readable tokenizer file ({first_line(e)})") from None


def _wordpiece(d: Path) -> Tokenizer:
    lower = read_json(d / "tokenizer_config.json", {}).get("do_lower_case", True)
    tok = Tokenizer(_readable(d / "vocab.txt", lambda: models.WordPiece.from_file(str(d / "vocab.txt"),
                                                                                  unk_token="[UNK]")))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return tok


def _byte_level(tok: Tokenizer):
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(ROBERTA_SPECIALS[:4] + [AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))


def train_tokenizer(texts, vocab_size: int, quiet: bool = True) -> Tokenizer:
    """A byte-level BPE (RoBERTa's kind) trained on the user's own documents, for pretraining from scratch."""
    progress = Progress("tokenizer", f"training a byte-level BPE of {vocab_size:,} tokens on the documents", quiet)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=ROBERTA_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    status = ["reading the documents"]
    with progress.ticking(lambda: status[0]):  # the trainer itself says nothing, for tens of seconds
        tok.train_from_iterator(_counted(texts, status), trainer)
    _byte_level(tok)
    progress.note(f"{tok.get_vocab_size():,} tokens ({time.time() - progress.t0:.1f}s)")
    return tok


def _counted(texts, status: list):
    """The texts, with status[0] saying how many characters the trainer has read, then that it learns merges."""
    chars = 0
    for text in texts:
        chars += len(text)
        status[0] = f"read {chars / 1e6:,.1f}M characters"
        yield text
    status[0] = f"read {chars / 1e6:,.1f}M characters; learning the merges"


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """cls/sep/pad/mask/unk ids under RoBERTa's or BERT's names."""
    names = {"cls": ("<s>", "[CLS]"), "sep": ("</s>", "[SEP]"), "pad": ("<pad>", "[PAD]"),
             "mask": ("<mask>", "[MASK]"), "unk": ("<unk>", "[UNK]")}
    out = {}
    for k, cands in names.items():
        ids = [tok.token_to_id(n) for n in cands if tok.token_to_id(n) is not None]
        if not ids:
            raise UserError(f"tokenizer has no {k} token ({' or '.join(cands)})")
        out[k] = ids[0]
    return out


def tokenizer_files(tok: Tokenizer, max_tokens: int) -> dict:
    """tokenizer_config.json, so that transformers' AutoTokenizer finds the special tokens by name."""
    names = {k: tok.id_to_token(v) for k, v in special_ids(tok).items()}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_tokens,
            "bos_token": names["cls"], "eos_token": names["sep"], **{f"{k}_token": v for k, v in names.items()}}


# sentence-transformers' files, fetched where a repo has them: before its version 6 the settings file holds
# max_seq_length; from 6 on the tokenizer's model_max_length holds it (and the module types moved)
ST_FILES = ("sentence_bert_config.json", "modules.json", "tokenizer_config.json")
NORMALIZE = "sentence_transformers.models.Normalize"
NO_LIMIT = 10**9  # transformers' model_max_length for "none set" is int(1e30)


def read_sentence_transformers(d: Path) -> dict:
    """What a sentence-transformers checkpoint says of how it embeds: max_seq_length (sentence_bert_config.json's,
    or, saved by sentence-transformers 6, tokenizer_config.json's model_max_length; it truncates there) and whether
    its modules end in Normalize (modules.json, under either version's type name). {} for a folder without them."""
    config, modules = read_json(d / ST_FILES[0], {}), read_json(d / ST_FILES[1], [])
    limit, where = (config.get("max_seq_length") if isinstance(config, dict) else None), d / ST_FILES[0]
    if limit is None and modules:  # sentence-transformers 6's layout
        tokenizer = read_json(d / ST_FILES[2], {})
        limit, where = (tokenizer.get("model_max_length") if isinstance(tokenizer, dict) else None), d / ST_FILES[2]
        limit = None if isinstance(limit, (int, float)) and limit >= NO_LIMIT else limit
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 2):
        raise UserError(f"{where}: max_seq_length {limit!r} is not a number of tokens")
    types = [m.get("type") for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    normalize = any(isinstance(t, str) and t.rsplit(".", 1)[-1] == "Normalize" for t in types)
    return {k: v for k, v in dict(max_seq_length=limit, normalize=normalize or None).items() if v}


def sentence_transformers_files(hidden_size: int, max_tokens: int, kept: dict) -> dict[str, object]:
    """The files that tell sentence-transformers to mean-pool (DeCLUTR §3.1), by path inside the checkpoint; `kept`:
    what the starting checkpoint said (read_sentence_transformers), its max_seq_length and Normalize kept."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if kept.get("normalize"):
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": NORMALIZE})
    return {"modules.json": modules,
            "sentence_bert_config.json": {"max_seq_length": min(max_tokens, kept.get("max_seq_length", max_tokens)),
                                          "do_lower_case": False},
            "1_Pooling/config.json": {"word_embedding_dimension": hidden_size, "pooling_mode_mean_tokens": True}}


# -----------------------------------------------------------------------------------------------
# Weights on disk: safetensors (one file or shards) in, safetensors out; pytorch_model.bin only when asked.


# Tensors a checkpoint may carry that this encoder does not use: the pooler and NSP heads (DeCLUTR pools
# by mean, §3.1), position-id buffers, and the decoder copies that are tied to the embeddings anyway.
IGNORED = re.compile(r"^(pooler\.|cls\.seq_relationship\.|embeddings\.(position_ids|token_type_ids)$|"
                     r"lm_head\.decoder\.|cls\.predictions\.decoder\.|decoder\.weight$)")


def _hf_name(key: str, prefix: str) -> str:
    """Checkpoint key in the ForMaskedLM layout, whatever layout (bare encoder, old gamma/beta) it came in."""
    key = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", key))
    return key if key.startswith((f"{prefix}.", "lm_head.", "cls.", "head.", "decoder.")) else f"{prefix}.{key}"


def read_safetensors(d: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint under its ForMaskedLM name (`prefix`: roberta or bert), the unused ones left out."""
    if (d / "model.safetensors").exists():
        files = [d / "model.safetensors"]
    elif (d / "model.safetensors.index.json").exists():
        index = read_json(d / "model.safetensors.index.json")
        files = [d / f for f in sorted(set(index.get("weight_map", {}).values()))]
    elif (d / "pytorch_model.bin").exists():
        raise UserError(f"{d}: only pytorch_model.bin, which is never unpickled implicitly; convert it once with: "
                        f"python model.py convert {d}")
    else:
        raise UserError(f"{d}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for f in files:
        try:
            out.update(safetensors.torch.load_file(f))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise UserError(f"{f}: not a readable safetensors file ({first_line(e)})") from None
    named = {_hf_name(k, prefix): v for k, v in out.items()}
    return {k: v for k, v in named.items() if not IGNORED.match(k.removeprefix(f"{prefix}."))}


def load_state(ours: dict[str, torch.Tensor], keymap: dict[str, list[str]], tensors: dict[str, torch.Tensor],
               where: str, optional: str) -> bool:
    """Copy a checkpoint's tensors (read_safetensors) into a model's state_dict through model.py's key map, every
    name and shape checked; a head (the names under `optional`) may be missing. Returns whether it was."""
    for name, sources in keymap.items():
        if all(s in tensors for s in sources):
            t = torch.cat([tensors[s] for s in sources]) if len(sources) > 1 else tensors[sources[0]]
            if t.shape != ours[name].shape:
                raise UserError(f"{where}: {sources[0]} has shape {tuple(t.shape)}, config.json implies "
                                f"{tuple(ours[name].shape)}")
            ours[name].copy_(t)
    wanted = {s for sources in keymap.values() for s in sources}
    head = {s for name, sources in keymap.items() if name.startswith(optional) for s in sources}
    missing, unused = wanted - tensors.keys(), tensors.keys() - wanted
    if missing and missing != head:
        raise UserError(f"{where}: missing {len(missing)} tensors, e.g. {', '.join(sorted(missing)[:3])}")
    if unused:
        raise UserError(f"{where}: {len(unused)} unexpected tensors, e.g. {', '.join(sorted(unused)[:3])}")
    return bool(missing)


def hf_state_dict(ours: dict[str, torch.Tensor], keymap: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """A model's weights under the Hugging Face names of model.py's key map, in fp32, ready for safetensors."""
    out = {}
    for name, sources in keymap.items():
        for s, t in zip(sources, ours[name].chunk(len(sources)), strict=True):
            out[s] = t.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def write_model_folder(out: Path, tensors: dict, config: dict, tok: Tokenizer, hidden_size: int, max_tokens: int,
                       kept: dict):
    """A model folder in Hugging Face layout (model.safetensors, config.json, the tokenizer's files) with
    sentence-transformers' files; kept: what the starting checkpoint said of theirs (read_sentence_transformers)."""
    out = make_dirs(out)
    write_safetensors(out / "model.safetensors", tensors)
    write_atomic(out / "tokenizer.json", lambda p: tok.save(str(p)))
    files = {"config.json": config, "tokenizer_config.json": tokenizer_files(tok, max_tokens),
             **sentence_transformers_files(hidden_size, max_tokens, kept)}
    for name, obj in files.items():
        (out / name).parent.mkdir(exist_ok=True)
        write_json(out / name, obj)
    if NORMALIZE in {m["type"] for m in files["modules.json"]}:
        (out / "2_Normalize").mkdir(exist_ok=True)  # sentence-transformers loads the module from its (empty) folder


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]):
    # Serialised in memory, then written by Python: a full disk is then the OSError that says so
    data = safetensors.torch.save(tensors, {"format": "pt"})
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def convert_bin(name: str, out: str | None) -> Path:
    """`python model.py convert`: pytorch_model.bin (a local folder or a hub repo) -> model.safetensors, unpickled
    once with weights_only=True (tensors only, no code); config and tokenizer files are copied beside it."""
    src = Path(name).expanduser()
    if not src.is_dir():
        src = hub_download(*hub_id(name), files=HUB_FILES[:2] + (("pytorch_model.bin",),))
    dst = Path(out or src)
    if not (src / "pytorch_model.bin").exists():
        held = "model.safetensors already, which loads as it is" if (src / "model.safetensors").exists() else "none"
        raise UserError(f"{src}: no pytorch_model.bin to convert (it holds {held})")
    if (dst / "model.safetensors").exists():
        how = "pass another --out, or remove it first" if out else "remove it first, or pass --out"
        raise UserError(f"{dst / 'model.safetensors'} exists already; {how}")
    try:
        sd = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # what weights_only refuses to unpickle: objects other than tensors
        raise UserError(f"{src / 'pytorch_model.bin'}: holds objects other than tensors, which may run code when "
                        f"loaded; refused (weights_only)") from None
    except Exception as e:  # damage: the zip reader and the unpickler raise many kinds
        raise UserError(f"{src / 'pytorch_model.bin'}: not a readable PyTorch file, cut short or damaged "
                        f"({first_line(e)})") from None
    make_dirs(dst)
    for f in ("config.json",) + TOKENIZER_FILES:
        if dst != src and (src / f).exists():
            shutil.copyfile(src / f, dst / f)
    write_safetensors(dst / "model.safetensors",
                      {k: v.contiguous().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)})
    return dst


# -----------------------------------------------------------------------------------------------
# The hub, through huggingface_hub: its cache ($HF_HOME/hub), tokens (HF_TOKEN, `hf auth login`) for private and
# gated repos, revisions, resumed downloads, HF_ENDPOINT and HF_HUB_OFFLINE, read when a download starts.

# What a checkpoint needs, each group satisfied by the first alternative the repo has.
HUB_FILES = (("config.json",), ("tokenizer.json", "vocab.txt", ("vocab.json", "merges.txt"), "sentencepiece.bpe.model"),
             ("model.safetensors", "model.safetensors.index.json"))


def resolve(name: str, weights: bool = True) -> Path:
    """A local directory as it is, or a hub id, `org/name` or `org/name@revision` (a branch, tag or commit),
    downloaded: config, tokenizer and sentence-transformers' settings (how many tokens it embeds: what a caller that
    needs no weights may still need), plus weights if asked. Its folder is named by the commit it holds."""
    d = Path(name).expanduser()
    if d.is_dir():
        return d
    if d.exists():
        raise UserError(f"{name}: not a directory (a model is a folder holding config.json and its weights)")
    folder = hub_download(*hub_id(name), files=HUB_FILES if weights else HUB_FILES[:2])
    for optional in ST_FILES:
        _fetch(*hub_id(name), optional)
    return folder


def hub_id(name: str) -> tuple[str, str | None]:
    """(repo, revision) of `name` or `org/name`, maybe @revision; anything else, or a path under a folder that exists
    here, is a local folder that is not there."""
    if name.startswith("scratch:"):  # train.py's random-init shapes have no files of their own
        raise UserError(f"{name}: a random-init shape that only train.py (and `model.py scratch`) makes; pass a model "
                        f"folder or hub id (after `python train.py`: runs/demo/model)", code=2)
    repo, _, revision = name.partition("@")
    is_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo) and not repo.startswith(".")
    is_id = is_id and re.fullmatch(r"[\w./-]*", revision)
    path = Path(name).expanduser()
    if not is_id or (len(path.parts) > 1 and path.parent.is_dir()):
        raise UserError(f"{name}: no such folder")
    return repo, revision or None


def hub_download(repo: str, revision: str | None = None, files: tuple = HUB_FILES) -> Path:
    """The snapshot folder holding, for each group of `files`, the first alternative the repo has (and the shards an
    index names)."""
    folder = None
    for group in files:
        for alt in group:
            names = (alt,) if isinstance(alt, str) else alt
            got = [_fetch(repo, revision, f) for f in names]
            if all(got):
                folder = folder or got[0].parents[len(Path(names[0]).parts) - 1]  # the snapshot, named by its commit
                if alt == "model.safetensors.index.json":
                    for shard in sorted(set(read_json(got[0]).get("weight_map", {}).values())):
                        if not _fetch(repo, revision, shard):
                            raise UserError(f"{repo}: shard {shard} is missing")
                break
        else:
            at = f"{repo}@{revision}" if revision else repo
            if offline():
                raise UserError(f"{at}: not in the cache ({hub_cache()}) and HF_HUB_OFFLINE is set; download it once "
                                f"online, or pass a local folder holding config.json, its tokenizer and weights")
            raise UserError(f"{at}: the repo has none of {', '.join(map(str, group))}")
    return folder


def hub_cache() -> Path:
    """huggingface_hub's cache folder, as the environment says now (HF_HUB_CACHE, else $HF_HOME/hub)."""
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    return Path(os.environ.get("HF_HUB_CACHE") or home / "hub").expanduser()


def _fetch(repo: str, revision: str | None, filename: str) -> Path | None:
    """One file of the repo in the local cache, downloaded if need be; None if the repo does not have it. Every
    failure is one line naming the repo and what to do."""
    at, endpoint = f"{repo}@{revision}" if revision else repo, os.environ.get("HF_ENDPOINT") or None
    where = dict(revision=revision, cache_dir=hub_cache())
    cached = huggingface_hub.try_to_load_from_cache(repo, filename, **where)
    try:
        path = Path(huggingface_hub.hf_hub_download(repo, filename, endpoint=endpoint, local_files_only=offline(),
                                                    **where))
    except hf_errors.LocalEntryNotFoundError:  # offline and not cached, or the hub unreachable and not cached
        if offline():
            return None
        raise UserError(f"{at}: cannot reach {endpoint or 'huggingface.co'} and it is not in the cache; pass a local "
                        f"directory holding config.json, model.safetensors and tokenizer.json instead") from None
    except hf_errors.EntryNotFoundError:
        return None
    except hf_errors.GatedRepoError:
        raise UserError(f"{at}: a gated repo; accept its terms on the hub, then set HF_TOKEN or run "
                        f"`hf auth login`") from None
    except hf_errors.RepositoryNotFoundError:
        raise UserError(f"{at}: no such repo on {endpoint or 'huggingface.co'}, or a private one: set HF_TOKEN or "
                        f"run `hf auth login`") from None
    except hf_errors.RevisionNotFoundError:
        raise UserError(f"{repo}: no revision {revision!r} (a branch, tag or commit of the repo)") from None
    except hf_errors.HfHubHTTPError as e:
        raise UserError(f"{at}: {filename}: {first_line(e)}") from None
    except OSError as e:  # a full disk, a folder that cannot be written, a download that came short
        raise UserError(f"{at}: {filename}: cannot download into {hub_cache()} ({e.strerror or e}); free space "
                        f"there or set HF_HOME to another folder") from None
    if not isinstance(cached, str):  # downloaded just now: check it against its hash
        _verify(path, at)
    return path


def _verify(path: Path, at: str):
    """The file against the name huggingface_hub gives its blob: its sha256 (LFS files) or git's blob id.
    huggingface_hub itself checks only a download's size: bytes changed on the way (a proxy, a mirror) would land."""
    blob = path.resolve()
    data = blob.read_bytes()
    if re.fullmatch(r"[0-9a-f]{64}", blob.name):
        digest = hashlib.sha256(data).hexdigest()
    elif re.fullmatch(r"[0-9a-f]{40}", blob.name):
        digest = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    else:
        return
    if digest != blob.name:
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise UserError(f"{at}: {path.name} differs from the hub's hash {blob.name}; removed, try again")
