"""
The peers (issue 83): what a sentence-transformers user runs instead of DeCLUTR to adapt an encoder to their own
documents without labels, each from the same start (all-MiniLM-L6-v2, its mean pooling kept), on the same documents
(bench/written_apart.py's OUT/train-docs), for the same minutes as a DeCLUTR run, at the settings of
sentence-transformers' examples (examples/unsupervised_learning/*/train_*_from_file.py):

- simcse: unsupervised SimCSE, MultipleNegativesRankingLoss on (s, s), dropout the only difference between the two;
  batch 128, 32 tokens, lr 5e-5, warmed up over the first 10% then decayed linearly, weight decay 0.01
- ct: Contrastive Tension with in-batch negatives, ContrastiveTensionLossInBatchNegatives (its second model kept);
  batch 128, 75 tokens, lr 5e-5, the same schedule and weight decay
- tsdae: DenoisingAutoEncoderLoss, a decoder tied to the encoder, 60% of each sentence's words deleted (the TSDAE
  paper's ratio, as DenoisingAutoEncoderDataset deletes them: a word goes where a draw falls under 0.6; the loss
  class's docstring example keeps 60% instead); batch 8, lr 3e-5 constant, no weight decay; the model's own length

The budget is time, so the schedule runs over the minutes, not the steps (fit's WarmupLinear over the fraction of the
budget spent). Sentences: each training document cut at blank lines, each paragraph's lines joined and cut after a
full stop, question or exclamation mark followed by a space; as the examples, those of 10 characters and more, each
once. Each run, one process with one thread (as bench/domain.py's runs, two at a time on 2 cores): OUT/peers/
NAME-seedS/model (sentence-transformers layout, which model.load_pretrained reads) and run.json (steps, sentences,
tokens the encoder read, minutes). bench/written_apart.py --peers scores them beside DeCLUTR's runs.

    python bench/peers.py --out runs/written-apart --minutes 10        # 3 peers x 3 seeds, 10 minutes a run
    python bench/peers.py --out runs/written-apart --peers simcse --lr 1e-5 --minutes 10   # a lower learning rate
"""
import argparse
import json
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import _jobs as jobs  # noqa: E402 (bench/_jobs.py)

from support import corpus  # noqa: E402
from support.cli import UserError, bench, shared_assets  # noqa: E402


@dataclass
class Peer:
    what: str
    batch: int
    max_length: int  # 0: the model's own
    lr: float
    warmup: float  # the share of the budget warmed up over; -1: constant
    weight_decay: float


PEERS = {
    "simcse": Peer("unsupervised SimCSE (MultipleNegativesRankingLoss on (s, s))", 128, 32, 5e-5, 0.1, 0.01),
    "ct": Peer("CT, in-batch negatives (ContrastiveTensionLossInBatchNegatives)", 128, 75, 5e-5, 0.1, 0.01),
    "tsdae": Peer("TSDAE (DenoisingAutoEncoderLoss, tied decoder, 60% deleted)", 8, 0, 3e-5, -1, 0.0),
}
DELETE = 0.6  # TSDAE's deletion ratio
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(folder: Path) -> list[str]:
    """Every training document's sentences (see the docstring), each once, in the documents' order."""
    seen = {}
    for f in corpus.list_files([str(folder)]):
        for paragraph in re.split(r"\n\s*\n", Path(f).read_text(errors="replace")):
            for s in SENTENCE_END.split(" ".join(paragraph.split())):
                if len(s) >= 10:
                    seen.setdefault(s, None)
    return list(seen)


def noisy(text: str, rng: random.Random) -> str:
    """TSDAE's damage: each word deleted with probability DELETE, at least one kept (words: split at spaces)."""
    words = text.split()
    kept = [w for w in words if rng.random() >= DELETE]
    return " ".join(kept or [rng.choice(words)])


def loss_of(name: str, model, start: str):
    from sentence_transformers import losses
    if name == "simcse":
        return losses.MultipleNegativesRankingLoss(model)
    if name == "ct":
        return losses.ContrastiveTensionLossInBatchNegatives(model)
    return losses.DenoisingAutoEncoderLoss(model, decoder_name_or_path=start, tie_encoder_decoder=True)


def features(name: str, model, batch: list[str], rng: random.Random) -> list[dict]:
    """The loss's inputs: (s, s) for SimCSE; s once for CT (its loss runs both models on it); (damaged, s)."""
    if name == "simcse":
        return [model.preprocess(batch), model.preprocess(batch)]
    if name == "ct":
        return [model.preprocess(batch)]
    return [model.preprocess([noisy(s, rng) for s in batch]), model.preprocess(batch)]


def optimiser(loss, peer: Peer, lr: float) -> torch.optim.AdamW:
    """sentence-transformers' fit: AdamW over the loss's parameters, no weight decay on biases and LayerNorm."""
    named = list(loss.named_parameters())
    plain = [p for n, p in named if not any(k in n for k in ("bias", "LayerNorm.weight"))]
    rest = [p for n, p in named if any(k in n for k in ("bias", "LayerNorm.weight"))]
    return torch.optim.AdamW([{"params": plain, "weight_decay": peer.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr)


def rate(peer: Peer, spent: float) -> float:
    """The learning rate's multiplier at this share of the budget spent: WarmupLinear, or constant."""
    if peer.warmup < 0:
        return 1.0
    return spent / peer.warmup if spent < peer.warmup else max(0.0, (1 - spent) / (1 - peer.warmup))


def train_one(name: str, seed: int, a, folder: Path):
    """One run: the loss at its settings for a.minutes, then the model and run.json into folder."""
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(a.threads)
    torch.manual_seed(seed)
    rng, peer = random.Random(seed), PEERS[name]
    texts = sentences(Path(a.out) / "train-docs")
    model = SentenceTransformer(a.model, device="cpu")
    window = model.max_seq_length  # the start's, saved with the model: it is scored as the start is
    if peer.max_length:
        model.max_seq_length = peer.max_length
    loss = loss_of(name, model, a.model)
    lr = a.lr or peer.lr
    opt = optimiser(loss, peer, lr)
    loss.train()
    order, steps, seen, tokens, t0 = [], 0, 0, 0, time.perf_counter()
    while (spent := (time.perf_counter() - t0) / (60 * a.minutes)) < 1:
        if len(order) < peer.batch:  # another pass over the sentences, shuffled; a batch never repeats one
            order += rng.sample(texts, len(texts))
        batch, order = order[:peer.batch], order[peer.batch:]
        inputs = features(name, model, batch, rng)
        for group in opt.param_groups:
            group["lr"] = lr * rate(peer, spent)
        value = loss(inputs, torch.zeros(0))
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(loss.parameters(), 1.0)  # fit's max_grad_norm
        opt.step()
        steps, seen = steps + 1, seen + len(batch)
        tokens += sum(int(f["attention_mask"].sum()) for f in inputs) * (2 if name == "ct" else 1)
        if steps % 25 == 0:
            print(f"{name}-seed{seed}: step {steps}, loss {value.item():.4f}, {spent:.0%} of the time", flush=True)
    minutes = (time.perf_counter() - t0) / 60
    trained_length, model.max_seq_length = model.max_seq_length, window
    model.save(str(folder / "model"))
    (folder / "run.json").write_text(json.dumps(
        {"peer": name, "seed": seed, "lr": lr, "batch": peer.batch, "max_length": trained_length,
         "steps": steps, "sentences_seen": seen, "sentences": len(texts), "tokens": tokens, "minutes": minutes},
        indent=1))


def run_all(a, out: Path):
    """Every (peer, seed) without a model yet, a.jobs at a time, each a process of its own (bench/_jobs.py)."""
    runs = {f"{p}{a.tag}-seed{s}": (p, s) for s in a.seeds for p in a.peers}

    def start(name: str):
        (out / name).mkdir(parents=True, exist_ok=True)
        peer, seed = runs[name]
        cmd = [sys.executable, __file__, "--one", peer, str(seed), "--out", a.out, "--model", a.model,
               "--minutes", str(a.minutes), "--threads", str(a.threads), "--lr", str(a.lr), f"--tag={a.tag}"]
        log = out / name / "log.txt"
        return log, subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def finished(name: str, seconds: float):
        done = json.loads((out / name / "run.json").read_text())
        print(f"{name}: {done['steps']} steps, {done['sentences_seen']:,} sentences, "
              f"{done['tokens']:,} tokens in {done['minutes']:.1f} min", flush=True)

    jobs.run_all([name for name in runs if not (out / name / "model").exists()], start, finished, a.jobs)


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=shared_assets(ROOT), help="the shared assets folder")
    ap.add_argument("--model", default=None, help="the start (default: the shared all-MiniLM-L6-v2)")
    ap.add_argument("--out", default="runs/written-apart", help="bench/written_apart.py's folder (its train-docs)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, required=True, help="each run's training time (a DeCLUTR run's)")
    ap.add_argument("--lr", type=float, default=0.0, help="instead of each peer's own")
    ap.add_argument("--tag", default="", help="after the peer's name in its runs' folders (a lower --lr's)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument("--threads", type=int, default=1, help="each run's")
    ap.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.model = a.model or str(Path(a.shared) / "models/all-MiniLM-L6-v2")
    try:
        import sentence_transformers  # noqa: F401 (the peers' losses)
    except ImportError:
        raise UserError("bench/peers.py trains through sentence-transformers: pip install -r "
                        "requirements-dev.txt") from None
    if not (Path(a.out) / "train-docs").is_dir():
        raise UserError(f"{a.out}: no train-docs (run bench/written_apart.py --pairs-only first)")
    if a.one:
        return train_one(a.one[0], int(a.one[1]), a, Path(a.out) / "peers" / f"{a.one[0]}{a.tag}-seed{a.one[1]}")
    if a.lr and not a.tag:
        a.tag = f"-lr{a.lr:g}"
    run_all(a, Path(a.out) / "peers")


if __name__ == "__main__":
    main()
