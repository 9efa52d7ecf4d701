"""Shared test helpers. Assets are read in place from ../shared (override with DECLUTR_SHARED); where it is absent,
the MiniLM encoder and STS-B dev are downloaded once into the usual caches (the hub's, ~/.cache/declutr), and a
test whose asset cannot be had skips, naming it. DECLUTR_STRICT=1 (set by .ci/run) turns those skips into
failures: CI, which has ../shared and the dev requirements, must skip nothing."""
import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))
STRICT = os.environ.get("DECLUTR_STRICT", "") == "1"
MINILM_HUB = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(autouse=True)
def the_users_shell_does_not_matter(monkeypatch, tmp_path_factory):
    """The suite passes whatever the user's shell holds (HF_HUB_OFFLINE=1 on an offline cluster, an HF_ENDPOINT, an
    HF_TOKEN, `hf auth login`): every variable the code reads is cleared here, and a test sets what it needs. Only
    DECLUTR_SHARED (where the assets are) and DECLUTR_STRICT (CI's) are the user's, read once above."""
    for name in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_TOKEN", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN_PATH",
                 "DECLUTR_PROGRESS_EVERY", "DECLUTR_STSB_URL", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    if "huggingface_hub" in sys.modules:  # it reads these once, when imported
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH",
                            str(tmp_path_factory.getbasetemp() / "no-hf-token"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: over about 1.5 s on 2 cores (end-to-end runs of processes, compiling, "
                                       "real models); the inner loop deselects them: -m 'not slow'")


def missing(what: str):
    """Skip, saying what is missing; under DECLUTR_STRICT=1 fail instead."""
    if STRICT:
        pytest.fail(f"missing {what} (DECLUTR_STRICT=1: a skip is a failure)", pytrace=False)
    pytest.skip(f"needs {what}")


def need(path: Path):
    """A shared asset, or a skip naming it and how to point at it."""
    if not path.exists():
        missing(f"{path} (set DECLUTR_SHARED to the shared/ folder)")
    return path


def oracle(module: str):
    """transformers or sentence-transformers, the tests' references, or a skip naming it."""
    try:
        return __import__(module)
    except ImportError:
        missing(f"{module} (pip install -r requirements-dev.txt)")


def minilm() -> Path:
    """all-MiniLM-L6-v2: the shared copy, or the hub's, downloaded once through hub.py (huggingface_hub)."""
    return _shared_or_fetched(SHARED / "models" / "all-MiniLM-L6-v2", "minilm")


def stsb_dev() -> Path:
    """sts-dev.csv: the shared copy, or the STS Benchmark downloaded once by evaluate_sts.py."""
    return _shared_or_fetched(SHARED / "data" / "sts" / "stsbenchmark" / "sts-dev.csv", "stsb")


def _shared_or_fetched(path: Path, asset: str) -> Path:
    if path.exists():
        return path
    got, why = _fetch(asset)
    if got is None:
        missing(f"{path} (set DECLUTR_SHARED to the shared/ folder), or a network to download it: {why}")
    return got


@functools.cache
def _fetch(asset: str):
    """(path, None) once downloaded into the usual cache, or (None, why not): tried once per test session."""
    from support import hub
    from support.cli import UserError
    from support.sts_files import download_stsb

    extra = (("vocab.txt",), ("tokenizer_config.json",), ("modules.json",), ("sentence_bert_config.json",),
             ("1_Pooling/config.json",))  # what sentence-transformers and the WordPiece test read
    try:
        if asset == "minilm":
            return hub.hub_download(MINILM_HUB, files=hub.HUB_FILES + extra), None
        return download_stsb() / "sts-dev.csv", None
    except UserError as e:
        return None, str(e)


WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """8 documents of 600 random words: a corpus for whole training runs in seconds."""
    import numpy as np

    d = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    for i in range(8):
        (d / f"{i}.txt").write_text(" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 600)))
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random encoder with a real tokenizer, saved, for fast CLI runs."""
    import model as M

    d = tmp_path_factory.mktemp("tiny")
    M.save_pretrained(*from_scratch("tiny", ["the cat sat on the mat while a dog barked at the moon"] * 50), d)
    return d


def stsb_sentences(limit=None):
    """Unique STS-B dev sentences, in file order (columns 6 and 7, tab-separated, no CSV quoting)."""
    seen = {}
    for line in stsb_dev().read_text(encoding="utf-8").splitlines():
        cols = line.split("\t")
        for s in cols[5:7]:
            seen.setdefault(s, None)
    out = list(seen)
    return out[:limit] if limit else out


def synthetic_batch(n_docs, A=2, P=2, vocab=300, seed=0, pad=1, cls=0, sep=2, mask=4, anchor_len=(3, 41),
                    positive_len=(3, 41)):
    """A batch in sampler.py's layout with random token ids: spans of 3-40 tokens, BERT-style MLM."""
    import numpy as np
    import torch

    import sampler as S

    rng = np.random.default_rng(seed)

    def spans(n, low_high):
        lengths = rng.integers(*low_high, n) + 2
        ids = np.full((n, lengths.max()), pad)
        for row, k in zip(ids, lengths, strict=True):
            row[0], row[1:k - 1], row[k - 1] = cls, rng.integers(5, vocab, k - 2), sep
        return ids, lengths

    a, al = spans(n_docs * A, anchor_len)
    p, pl = spans(n_docs * A * P, positive_len)
    m_in, m_lab = S.mask_tokens(a, ~np.isin(a, [pad, cls, sep]), rng, mask, np.arange(5, vocab))
    t = torch.from_numpy

    return dict(anchors=t(a), anchor_lengths=t(al), positives=t(p), positive_lengths=t(pl), mlm_inputs=t(m_in),
                mlm_labels=t(m_lab), anchor_doc=t(np.repeat(np.arange(n_docs), A)))


def masks(batch):
    """(anchor mask, positive mask), 0/1 over each padded row, from the lengths a batch carries."""
    import torch

    def rows(ids, lengths):
        return (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()

    return rows(batch["anchors"], batch["anchor_lengths"]), rows(batch["positives"], batch["positive_lengths"])


def run_here(main, *args, stdin=None):
    """A script's main(ARGS) as a user's command runs it, in this process: its exit code, stdout and stderr, as
    subprocess.run gives them. A process of its own would spend about 2 s importing torch; the tests about processes
    (signals, pipes, torchrun, the exit code a shell sees) start real ones."""
    import contextlib
    import io
    import types

    out, err, code = io.StringIO(), io.StringIO(), 0
    given = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8") if stdin is not None else sys.stdin
    real_stdin, sys.stdin = sys.stdin, given
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.stdin = real_stdin
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def bench_script(name: str):
    """bench/NAME.py imported as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def from_scratch(shape: str, texts, **kwargs):
    """(model.scratch_encoder of a named shape, a BPE trained on `texts`): support.demo.from_scratch."""
    import model as M
    from support import demo
    return demo.from_scratch(M.scratch_encoder, shape, texts, **kwargs)


def tiny_encoder(vocab=300, seed=0, dropout=0.0):
    import torch

    import model as M

    c = M.ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=130, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout)
    m = M.Encoder(c)
    m.init_weights(torch.Generator().manual_seed(seed))
    return m.train()


# The configurations whose gradient through DDP must equal one process's (tests/ddp_grad.py, test_train.py), on a
# batch whose anchors are longer than its positives, as DeCLUTR's are: the last length chunk holds no anchor.
DDP_BATCH = dict(n_docs=6, anchor_len=(25, 41), positive_len=(3, 12))
DDP_CONFIGS = {"plain": {}, "grad-cache": dict(grad_cache=True), "no-mlm": dict(mlm=False),
               "no-mlm-grad-cache": dict(mlm=False, grad_cache=True), "no-contrastive": dict(contrastive=False),
               "no-contrastive-grad-cache": dict(contrastive=False, grad_cache=True)}


def half_batch(batch, rank, world, A=2, P=2):
    """The documents of one rank when the ranks split `batch` in order."""
    n_docs = len(batch["anchors"]) // A
    k = n_docs // world
    out = {}
    for key, v in batch.items():
        per = A * P if key.startswith("positive") else A
        out[key] = v[rank * k * per:(rank + 1) * k * per]
    return out


def step_chunks(batch, encoder, cfg=None, multiple=None):
    """A step's spans cut into chunks as train.train_step cuts them: bench/_spans.py's, shared with the benchmarks."""
    return _spans().step_chunks(batch, encoder, cfg, multiple)


@functools.cache
def _spans():
    return bench_script("_spans")
