"""
hub.py: Hugging Face files: the hub client, tokenizer formats, safetensors shards, pytorch_model.bin conversion.
A reader does not need this file to understand DeCLUTR; model.py uses it to read and write checkpoints. It imports
no other file of the project but common.py.

- The hub: plain HTTPS into $HF_HOME/hub in huggingface_hub's folder layout (refs/REV -> snapshots/COMMIT), so a
  cache it filled is reused; HF_ENDPOINT and HF_HUB_OFFLINE are honoured; every file is checked (size, and sha256
  or git blob id) before it gets its real name.
- Tokenizers: tokenizer.json, vocab.json + merges.txt (RoBERTa), or vocab.txt (BERT), always without padding or
  truncation; a byte-level BPE trained on the user's documents for models trained from scratch.
"""
import hashlib
import http.client
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from common import Progress, UserError, make_dirs, offline, pad_rows, read_json, write_atomic

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
        raise UserError(f"{path}: not a readable tokenizer file ({str(e).splitlines()[0][:200]})") from None


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
    progress.done(f"{tok.get_vocab_size():,} tokens ({time.time() - progress.t0:.1f}s)")
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


def batch_encode(tok: Tokenizer, texts: list[str], max_tokens: int, pad_id: int):
    """Texts -> (B, T) ids and mask, padded to the longest; over-long texts keep their final special token."""
    rows = [e.ids if len(e.ids) <= max_tokens else e.ids[:max_tokens - 1] + e.ids[-1:]
            for e in tok.encode_batch(texts)]
    ids, mask = pad_rows(rows, pad_id)
    return torch.from_numpy(ids), torch.from_numpy(mask)


def tokenizer_files(tok: Tokenizer, max_tokens: int) -> dict:
    """tokenizer_config.json, so that transformers' AutoTokenizer finds the special tokens by name."""
    names = {k: tok.id_to_token(v) for k, v in special_ids(tok).items()}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_tokens,
            "bos_token": names["cls"], "eos_token": names["sep"], **{f"{k}_token": v for k, v in names.items()}}


def sentence_transformers_files(hidden_size: int, max_tokens: int) -> dict[str, object]:
    """The files that tell sentence-transformers to mean-pool (DeCLUTR §3.1), by path inside the checkpoint."""
    return {"modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
        "sentence_bert_config.json": {"max_seq_length": max_tokens, "do_lower_case": False},
        "1_Pooling/config.json": {"word_embedding_dimension": hidden_size, "pooling_mode_mean_tokens": True}}


# -----------------------------------------------------------------------------------------------
# config.json


def read_hf_config(path: Path, names: list[str]) -> dict:
    """The fields `names` of a Hugging Face config.json, with BERT's defaults where a BERT config leaves them out."""
    if not path.exists():
        raise UserError(f"{path.parent}: no config.json")
    d = read_json(path)
    kind = d.get("model_type")
    if kind not in ("roberta", "bert"):
        raise UserError(f"{path}: model_type {kind!r} is not supported (roberta or bert)")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{path}: position_embedding_type {d['position_embedding_type']!r} is not supported")
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    if missing := [k for k in need if k not in d]:
        raise UserError(f"{path}: missing {', '.join(missing)}")
    base = {} if kind == "roberta" else dict(pad_token_id=0, type_vocab_size=2, layer_norm_eps=1e-12,
                                             max_position_embeddings=512, bos_token_id=None, eos_token_id=None)
    return {**base, **{k: d[k] for k in names if k in d}}


def hf_config(fields: dict) -> dict:
    """config.json for transformers' AutoModel and AutoModelForMaskedLM (None fields left out)."""
    arch = "RobertaForMaskedLM" if fields["model_type"] == "roberta" else "BertForMaskedLM"
    return {"architectures": [arch], **{k: v for k, v in fields.items() if v is not None},
            "position_embedding_type": "absolute"}


# -----------------------------------------------------------------------------------------------
# Weights on disk: safetensors (one file or shards) in, safetensors out; pytorch_model.bin only when asked.


# Tensors a checkpoint may carry that this encoder does not use: the pooler and NSP heads (DeCLUTR pools
# by mean, §3.1), position-id buffers, and the decoder copies that are tied to the embeddings anyway.
IGNORED = re.compile(r"^(pooler\.|cls\.seq_relationship\.|embeddings\.(position_ids|token_type_ids)$|"
                     r"lm_head\.decoder\.|cls\.predictions\.decoder\.)")


def _hf_name(key: str, kind: str) -> str:
    """Checkpoint key in the ForMaskedLM layout, whatever layout (bare encoder, old gamma/beta) it came in."""
    key = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", key))
    return key if key.startswith((f"{kind}.", "lm_head.", "cls.")) else f"{kind}.{key}"


def read_safetensors(d: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint under its ForMaskedLM name (`kind`: roberta or bert), the unused ones left out."""
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
            with safe_open(str(f), framework="pt") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})
        except (SafetensorError, OSError, RuntimeError) as e:
            raise UserError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    named = {_hf_name(k, kind): v for k, v in out.items()}
    return {k: v for k, v in named.items() if not IGNORED.match(k.removeprefix(f"{kind}."))}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]):
    def write(tmp: Path):
        try:
            save_file(tensors, str(tmp), {"format": "pt"})
        except SafetensorError as e:  # an I/O error (a full disk) comes back as this; write_atomic names the file
            raise OSError(re.sub(r"^.*I/O error: (.*?)( \(os error \d+\))?$", r"\1", str(e))) from None

    write_atomic(path, write)


def convert_bin(name: str, out: str | None) -> Path:
    """`python model.py convert`: pytorch_model.bin (a local folder or a hub repo) -> model.safetensors, unpickled
    once with weights_only=True (tensors only, no code); config and tokenizer files are copied beside it."""
    src = Path(name)
    if not src.is_dir():
        src = hub_download(name, files=HUB_FILES[:2] + (("pytorch_model.bin",),))
    dst = Path(out or src)
    if (dst / "model.safetensors").exists():
        raise UserError(f"{dst / 'model.safetensors'} exists already; remove it first or pass --out")
    try:
        sd = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler raises many kinds; all mean "not a plain tensor file"
        raise UserError(f"{src / 'pytorch_model.bin'}: cannot load with weights_only=True "
                        f"({str(e).splitlines()[0]})") from None
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json",) + TOKENIZER_FILES:
        if dst != src and (src / f).exists():
            shutil.copyfile(src / f, dst / f)
    write_safetensors(dst / "model.safetensors",
                      {k: v.contiguous().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)})
    return dst


# -----------------------------------------------------------------------------------------------
# The hub: plain HTTPS into $HF_HOME/hub, in huggingface_hub's folder layout (refs/REV -> snapshots/COMMIT).

# What a checkpoint needs, each group satisfied by the first alternative the repo has.
HUB_FILES = (("config.json",), ("tokenizer.json", "vocab.txt", ("vocab.json", "merges.txt")),
             ("model.safetensors", "model.safetensors.index.json"))


def resolve(name: str, weights: bool = True) -> Path:
    """A local directory as it is, or a hub id downloaded (config and tokenizer, plus weights if asked)."""
    d = Path(name).expanduser()
    if d.is_dir():
        return d
    if d.exists():
        raise UserError(f"{name}: not a directory (a model is a folder holding config.json and its weights)")
    # A hub id is `name` or `org/name`; anything else, or a path under a folder that exists here, is local
    hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) and not name.startswith(".")
    if not hub_id or (len(d.parts) > 1 and d.parent.is_dir()):
        raise UserError(f"{name}: no such folder")
    return hub_download(name, files=HUB_FILES if weights else HUB_FILES[:2])


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the first answer carries the file's size and sha256; the redirect target does not


def _head(url: str):
    try:
        req = urllib.request.Request(url, method="HEAD")
        return urllib.request.build_opener(_NoRedirect).open(req, timeout=30).headers
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            return e.headers
        raise


def _git_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repo:
    """One hub repo at one revision, in the local cache."""

    def __init__(self, repo: str, revision: str):
        self.repo, self.revision = repo, revision
        self.endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
        self.root = home / "hub" / f"models--{repo.replace('/', '--')}"
        self.ref = self.root / "refs" / revision
        self.snap = self.root / "snapshots" / (self.ref.read_text().strip() if self.ref.exists() else revision)
        self.instead = f"pass a local directory holding config.json, model.safetensors and tokenizer.json " \
                       f"instead of {repo!r}"

    def fetch(self, name: str) -> bool:
        """The file in the snapshot, downloaded if need be; False if the repo does not have it (or offline)."""
        if (self.snap / name).exists():
            return True
        if offline():
            return False
        url = f"{self.endpoint}/{self.repo}/resolve/{self.revision}/{name}"
        try:
            head = _head(url)
            if commit := head.get("X-Repo-Commit"):
                self.snap = self.root / "snapshots" / commit
                if (self.snap / name).exists():
                    return True
            resp = urllib.request.urlopen(url, timeout=60)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise UserError(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"cannot reach {self.endpoint} ({getattr(e, 'reason', e)}); {self.instead}") from None
        size = int(head.get("X-Linked-Size") or head.get("Content-Length") or -1)
        etag = (head.get("X-Linked-Etag") or head.get("ETag") or "").removeprefix("W/").strip('"')
        make_dirs((self.snap / name).parent, "set HF_HOME to a folder you can write")
        # only a complete, verified file ever gets its real name
        write_atomic(self.snap / name, lambda tmp: self._receive(resp, tmp, name, size, etag))
        if self.snap.name != self.revision:
            self.ref.parent.mkdir(parents=True, exist_ok=True)
            self.ref.write_text(self.snap.name)
        return True

    def _receive(self, resp, tmp: Path, name: str, size: int, etag: str):
        h, n, url = hashlib.sha256(), 0, f"{self.endpoint}/{self.repo}/resolve/{self.revision}/{name}"
        progress = None
        if size > 1 << 22:  # the weights: worth saying
            progress = Progress("download", f"{self.repo}/{name}, {size / 2**20:,.0f} MiB, into {self.snap}")
        with resp, open(tmp, "wb") as f:
            while chunk := _read(resp, url):
                f.write(chunk)
                h.update(chunk)
                n += len(chunk)
                if progress:
                    progress(f"{n / 2**20:,.0f} of {size / 2**20:,.0f} MiB")
        if progress:
            progress.done(f"{n / 2**20:,.0f} MiB in {time.time() - progress.t0:.0f}s")
        if size >= 0 and n != size:
            raise UserError(f"{url}: got {n} of {size} bytes")
        if re.fullmatch(r"[0-9a-f]{64}", etag) and h.hexdigest() != etag:  # LFS files: sha256
            raise UserError(f"{url}: sha256 {h.hexdigest()} differs from the server's {etag}")
        if re.fullmatch(r"[0-9a-f]{40}", etag) and _git_sha1(tmp) != etag:  # small files: git's blob id
            raise UserError(f"{url}: content differs from the server's git blob id {etag}")


def _read(resp, url: str) -> bytes:
    try:
        return resp.read(1 << 20)
    except (OSError, http.client.HTTPException) as e:
        raise UserError(f"{url}: download failed ({e!r})") from None


def hub_download(repo: str, revision: str = "main", files: tuple = ()) -> Path:
    """The snapshot folder holding, for each group of `files`, the first alternative the repo has."""
    r = _Repo(repo, revision)
    for group in files or HUB_FILES:
        for alt in group:
            if all(r.fetch(f) for f in ((alt,) if isinstance(alt, str) else alt)):
                if alt == "model.safetensors.index.json":
                    for shard in sorted(set(read_json(r.snap / alt).get("weight_map", {}).values())):
                        if not r.fetch(shard):
                            raise UserError(f"{repo}: shard {shard} is missing")
                break
        else:
            why = "HF_HUB_OFFLINE is set and it is not in the cache" if offline() else f"the hub has none of {group}"
            raise UserError(f"{repo}: {why}; {r.instead}")
    return r.snap
