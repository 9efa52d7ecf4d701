"""
support/demo.py: `python train.py` with no --data, a demo that needs nothing but Python: a tiny model from scratch
on the documentation every Python installation carries, with settings that train it in a minute or two on a CPU.
And what a model from scratch is (--model scratch:SHAPE): the named shapes and their byte-level BPE.
"""
import time
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer

from support import hub
from support.cli import Progress, UserError, say
from support.corpus import document_texts
from support.files import cache_dir, writable_cache, write_atomic
from support.processes import Process, made_once

# `python train.py` with no data: a demo that needs nothing but Python. These replace the flags not given.
DEMO = dict(model="scratch:tiny", out="runs/demo", steps=600, lr=1e-3, min_span=16, max_span=64, log_every=50,
            ckpt_every=200)


def demo_config(cfg, given: set, proc: Process):
    """`python train.py` with no --data: the demo's settings where no flag says otherwise, on Python's own docs."""
    cfg = replace(cfg, **{k: v for k, v in DEMO.items() if k not in given})  # --lr 5e-5 is 5e-5, the default or not
    folder = made_once(proc, "demo-corpus", lambda: str(demo_corpus(cfg.cache_dir)), per_machine=True)
    say(f"no --data: the demo, {cfg.model} on Python's own documentation ({folder})")
    return replace(cfg, data=[folder])


def demo_corpus(cache: str) -> Path:
    """Text that every Python installation carries, one document per file: the language reference's help
    topics (pydoc_data) and the docstrings of each standard-library module, read with ast (nothing imported)."""
    from pydoc_data.topics import topics

    root = cache_dir(cache) / "demo-corpus"
    if root.exists():
        return root
    progress = Progress("demo", f"collecting Python's help topics and docstrings into {root}")
    docs = {f"topic-{k}": v for k, v in topics.items()}
    for f, text in stdlib_docstrings():
        docs["module-" + "-".join(f.with_suffix("").parts[-2:])] = text

    def write(folder: Path):
        folder.mkdir(parents=True)
        for name, text in docs.items():
            if len(text) > 2000:
                (folder / f"{name}.txt").write_text(text, encoding="utf-8")

    writable_cache(cache)
    write_atomic(root, write, keep_existing=True)  # the folder appears whole, or not at all
    progress.note(f"{len(list(root.glob('*.txt')))} documents ({time.time() - progress.t0:.1f}s)")
    return root


def stdlib_docstrings():
    """(source file, its docstrings joined by blank lines) of each standard-library module but tests and IDLE, read
    with ast (nothing imported): the demo's documents, and bench/written_apart.py's."""
    import ast
    import sysconfig

    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "tests", "idlelib", "site-packages"} & set(f.parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        yield f, "\n\n".join(d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n)))


# Named random-init shapes for pretraining from scratch (vocab is the size the BPE tokenizer is trained to).
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
SHAPES = {name: dict(zip(SHAPE_FIELDS, values, strict=True)) for name, values in {
    "tiny": (64, 2, 2, 256, 4096),  # trains in seconds on a CPU
    "small": (256, 4, 4, 1024, 16384),
    "distilroberta-base": (768, 6, 12, 3072, 50265),
    "roberta-base": (768, 12, 12, 3072, 50265)}.items()}


def scratch_name(model: str) -> str | None:
    """The shape of --model scratch:SHAPE (a random-init encoder), or None for a pretrained model."""
    return model.removeprefix("scratch:") if model.startswith("scratch:") else None


def scratch_shape(name: str, flag: str = "") -> dict:
    """The named shape's sizes (SHAPES), or one line naming the shapes there are."""
    if name not in SHAPES:
        raise UserError(f"{flag}{name}: unknown shape (one of {', '.join(SHAPES)})", code=2)
    return SHAPES[name]


def scratch_tokenizer(shape: str, texts, quiet: bool = True):
    """A byte-level BPE of the named shape's vocabulary size, trained on `texts` (an iterable of str)."""
    return hub.train_tokenizer(texts, scratch_shape(shape)["vocab_size"], quiet)


def from_scratch(make_encoder, shape: str, texts, seed: int = 0, max_position_embeddings: int = 514, quiet=True):
    """(random-init encoder, byte-level BPE trained on `texts`): scratch_tokenizer, then make_encoder(shape,
    vocab_size, seed, max_position_embeddings) (model.scratch_encoder) for it."""
    tok = scratch_tokenizer(shape, texts, quiet)
    return make_encoder(shape, tok.get_vocab_size(), seed, max_position_embeddings), tok


def scratch_model(cfg, proc: Process, make_encoder):
    """(encoder, tokenizer) of --model scratch:SHAPE: a BPE of the shape's vocabulary trained on the run's own
    documents by rank 0 (the others take it from there), and make_encoder(shape, vocab_size, seed)
    (model.scratch_encoder) for it."""
    shape = scratch_name(cfg.model)
    bpe = made_once(proc, "tokenizer", lambda: scratch_tokenizer(
        shape, document_texts(cfg.data, clean=not cfg.keep_whitespace, field=cfg.text_field), quiet=False).to_str())
    tok = Tokenizer.from_str(bpe)
    return make_encoder(shape, tok.get_vocab_size(), cfg.seed), tok
