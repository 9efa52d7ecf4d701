"""bench/peers.py, the peers beside DeCLUTR (issue 83): its sentences against hand-cut ones, TSDAE's damage against
a binomial bound, the schedule against transformers' own, the weight-decay groups against sentence-transformers' fit
rule, and one short run of each peer from all-MiniLM-L6-v2, read back by model.py."""
import json
import math
import random
import sys

import pytest
import torch

from conftest import ROOT, bench_script, minilm, oracle


@pytest.fixture(scope="module")
def P():
    sys.path.insert(0, str(ROOT / "bench"))
    return bench_script("peers")


def test_sentences_are_cut_at_paragraphs_and_full_stops_each_once(P, tmp_path):
    (tmp_path / "a.txt").write_text("First sentence here. Second one\nwraps a line!\n\nShort. A third sentence?"
                                    "\n  \nFirst sentence here.\n")
    (tmp_path / "b.txt").write_text("x = f(a.b)  # not cut inside a name.b\n")
    assert P.sentences(tmp_path) == ["First sentence here.", "Second one wraps a line!", "A third sentence?",
                                     "x = f(a.b) # not cut inside a name.b"]  # "Short." under 10 characters


def test_tsdae_deletes_six_words_in_ten_and_keeps_one_at_least(P):
    """Over 20,000 words the deleted share is 0.6 within 5 binomial standard deviations (0.017); a one-word sentence
    keeps its word."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(200)]
    kept = sum(len(P.noisy(" ".join(words), rng).split()) for _ in range(100))
    n = 100 * len(words)
    assert abs(1 - kept / n - 0.6) < 5 * math.sqrt(0.6 * 0.4 / n)
    assert all(P.noisy("alone", rng) == "alone" for _ in range(50))


def test_the_schedule_over_the_budget_is_transformers_warmup_then_linear_decay(P):
    """The share of the budget spent stands for the step: transformers' get_linear_schedule_with_warmup (warmup a
    tenth of 1,000 steps) at each step is the multiplier at that share; TSDAE's stays 1."""
    transformers = oracle("transformers")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=100, num_training_steps=1000)
    for step in (0, 1, 50, 99, 100, 101, 500, 999, 1000):
        assert P.rate(P.PEERS["simcse"], step / 1000) == pytest.approx(schedule.lr_lambdas[0](step), abs=1e-12)
        assert P.rate(P.PEERS["tsdae"], step / 1000) == 1.0


def test_no_weight_decay_on_biases_and_layernorm_as_fit_has_it(P):
    """sentence-transformers' fit: no decay where the name holds "bias", "LayerNorm.bias" or "LayerNorm.weight"."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense, self.LayerNorm = torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)
    block = Block()
    groups = P.optimiser(block, P.PEERS["ct"], 5e-5).param_groups
    names = {id(p): n for n, p in block.named_parameters()}
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]  # sentence-transformers' fit, as written there
    for group in groups:
        for p in group["params"]:
            assert group["weight_decay"] == (0.0 if any(k in names[id(p)] for k in no_decay) else 0.01)
    assert sum(len(g["params"]) for g in groups) == 4


@pytest.mark.slow
def test_each_peer_trains_and_its_model_reads_back_as_the_starts_window(P, tmp_path):
    """A few seconds of each peer from all-MiniLM-L6-v2: the weights moved, model.load_pretrained reads the model
    (tied TSDAE's encoder included) with the window and Normalize sentence-transformers 6 reads in its own layout: the
    start's 256 tokens, not the 32 or 75 it trained on."""
    st = oracle("sentence_transformers")
    import model as M
    start = minilm()
    (tmp_path / "train-docs").mkdir()
    (tmp_path / "train-docs" / "d.txt").write_text(" ".join(f"Sentence number {i} says a thing about {i % 7}."
                                                            for i in range(300)))
    before = M.load_pretrained(str(start), quiet=True)[0].state_dict()
    for name in P.PEERS:
        folder = tmp_path / name
        folder.mkdir()
        a = type("A", (), dict(out=str(tmp_path), model=str(start), minutes=0.03, threads=1, lr=0.0))
        P.train_one(name, 0, a, folder)
        done = json.loads((folder / "run.json").read_text())
        assert done["steps"] >= 1 and done["tokens"] > 0
        model, _ = M.load_pretrained(str(folder / "model"), quiet=True)
        after = model.state_dict()
        assert max((after[k] - before[k]).abs().max().item() for k in before) > 0, name
        again = st.SentenceTransformer(str(folder / "model"), device="cpu")  # sentence-transformers' own reading
        assert again.max_seq_length == st.SentenceTransformer(str(start), device="cpu").max_seq_length == 256
        assert model.sentence_transformers == {"max_seq_length": 256, "normalize": True}
