"""train.py: the step's gradient against a naive padded step, across ranks and nodes, GradCache, resuming."""
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import loss as L
import model as M
import train as T
from conftest import DDP_BATCH, DDP_CONFIGS, ROOT, SHARED, half_batch, masks, need, synthetic_batch, tiny_encoder
from support import device, runs, threads
from support.chunks import length_groups
from support.sts_files import load_stsb_dev

GUTENBERG = SHARED / "data" / "corpus" / "gutenberg"


def pooled(h, mask):
    """Mean over the real tokens, written out here: the reference shares no code with what it checks."""
    return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def naive_grads(model, batch, tau=0.05, A=2, P=2):
    """The original's step: every field padded to its batch maximum, MLM logits for every anchor token."""
    model.zero_grad()
    anchor_mask, positive_mask = masks(batch)
    h = model(batch["mlm_inputs"], anchor_mask)
    logits = model.mlm_logits(h)  # (B, T, V)
    mlm = F.cross_entropy(logits.flatten(0, 1), batch["mlm_labels"].flatten(), ignore_index=-100)
    a = pooled(h, anchor_mask)
    p = pooled(model(batch["positives"], positive_mask), positive_mask)
    (L.nt_xent(a, p.view(len(a), P, -1), tau) + mlm).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def step_grads(model, batch, **kw):
    model.zero_grad()
    T.train_step(T.ChunkedEncoder(model), batch, T.TrainConfig(**kw))
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same(g1, g2, atol=1e-5):
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=atol, msg=n)


def test_length_groups():
    lengths = np.array([5, 40, 7, 33, 12, 40, 3])
    groups = length_groups(lengths, 90)
    flat = np.concatenate(groups)
    assert sorted(flat.tolist()) == list(range(7))
    assert (np.diff(lengths[flat]) <= 0).all()  # longest first
    assert all(len(g) * lengths[g].max() <= 90 for g in groups)
    # spans longer than the budget still run, two to a chunk: a chunk of one would be a graph of its own (--compile)
    assert [lengths[g].tolist() for g in length_groups(lengths, 9)] == [[40, 40], [33, 12], [7, 5, 3]]
    rng = np.random.default_rng(0)
    for _ in range(200):  # never a chunk of one span, whatever the lengths, budget and spread
        lengths = rng.integers(3, 512, rng.integers(2, 40))
        groups = length_groups(lengths, int(rng.integers(1, 4000)), spread=float(rng.choice([0.0, 0.8])))
        assert min(map(len, groups)) >= 2 and sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))


@pytest.mark.parametrize("chunk", [100_000, 150])
def test_step_gradient_equals_the_naive_padded_step(chunk):
    batch = synthetic_batch(4)
    ref = naive_grads(tiny_encoder(), batch)
    assert_same(step_grads(tiny_encoder(), batch, chunk_tokens=chunk), ref)


def test_grad_cache_equals_the_unchunked_batch():
    batch = synthetic_batch(4, seed=3)
    ref = naive_grads(tiny_encoder(), batch)
    assert_same(step_grads(tiny_encoder(), batch, chunk_tokens=120, grad_cache=True), ref)


def test_grad_cache_replays_dropout():
    """With dropout on, the second pass of each chunk must see the masks of the first: GradCache's gradient then
    equals the plain step's, which draws the same masks in the same order in its one pass."""
    batch = synthetic_batch(4, seed=4, anchor_len=(25, 41), positive_len=(3, 12))
    torch.manual_seed(7)
    plain = step_grads(tiny_encoder(dropout=0.1), batch, chunk_tokens=120)
    torch.manual_seed(7)
    cached = step_grads(tiny_encoder(dropout=0.1), batch, chunk_tokens=120, grad_cache=True)
    assert_same(cached, plain)
    torch.manual_seed(7)  # and dropout was on: the gradient without it differs
    off = step_grads(tiny_encoder(), batch, chunk_tokens=120)
    assert max((plain[n] - off[n]).abs().max() for n in plain) > 1e-3


def test_ablations_drop_their_term():
    batch = synthetic_batch(4, seed=5)
    g = step_grads(tiny_encoder(), batch, mlm=False)
    assert g["mlm.dense.weight"].abs().max() == 0  # the MLM head gets no gradient without MLM
    g = step_grads(tiny_encoder(), batch, contrastive=False, chunk_tokens=100)
    model = tiny_encoder()  # MLM alone, written out: the masked anchors' cross-entropy, nothing else
    h = model(batch["mlm_inputs"], masks(batch)[0])
    F.cross_entropy(model.mlm_logits(h).flatten(0, 1), batch["mlm_labels"].flatten(), ignore_index=-100).backward()
    assert_same(g, {n: p.grad for n, p in model.named_parameters()})


def test_schedule_and_decay_groups():
    cfg = T.TrainConfig(lr=1.0, warmup_frac=0.1, lr_ratio=32)
    lr = [T.lr_at(s, 100, cfg.lr, cfg.warmup_frac, cfg.lr_ratio) for s in range(100)]
    assert lr[0] == pytest.approx(1 / 32) and lr[10] == pytest.approx(1.0) and max(lr) == lr[10]
    assert lr[5] == pytest.approx((1 + 0.5 * 31) / 32) and lr[55] == pytest.approx(lr[5])  # half-way up, half-way down
    opt = T.make_optimizer(tiny_encoder(), 5e-5, 0.1, fused=False)
    decay, rest = opt.param_groups
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0 and opt.defaults["eps"] == 1e-6
    model = tiny_encoder()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = T.make_optimizer(model, 5e-5, 0.1, fused=False)
    no_decay = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert all(n.endswith("bias") or ".ln." in n for n in no_decay) and "layers.0.attn.ln.weight" in no_decay
    decayed = {names[id(p)] for p in opt.param_groups[0]["params"]}
    assert decayed >= {"layers.0.attn.qkv.weight", "embeddings.word.weight"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.fixture
def reap():
    """Popen in a session of its own; whatever a failed test leaves running is killed with its workers."""
    procs = []

    def start(cmd, **kw):  # SIGINT at its default, as in a terminal, even where this shell's job ignores it
        procs.append(subprocess.Popen(cmd, start_new_session=True, preexec_fn=default_sigint, **kw))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_under_ddp_give_the_gradient_of_one_process(tmp_path, world):
    """train_step through DistributedDataParallel on 2 and 3 ranks (gloo), each with its share of the documents:
    plain and GradCache, with MLM, without (--no-mlm: the MLM head unused) and MLM alone (--no-contrastive)."""
    out = tmp_path / "grads.pt"
    script = str(ROOT / "tests" / "ddp_grad.py")
    r = subprocess.run(torchrun(f"--nproc_per_node={world}", "--master_port", str(free_port()), script),
                       env={**os.environ, "DDP_GRAD_OUT": str(out), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(out, weights_only=True)
    batch = synthetic_batch(**DDP_BATCH)
    for name, kw in DDP_CONFIGS.items():
        ref = step_grads(tiny_encoder(), batch, chunk_tokens=120, **kw)  # one process, the whole batch
        for step in (0, 1):
            assert_same(got[name, step], ref)
    assert_same(step_grads(tiny_encoder(), batch), naive_grads(tiny_encoder(), batch))  # and that is the method's
    half = half_batch(batch, 0, world)  # and the test could tell: one rank's documents alone give another gradient
    assert max((naive_grads(tiny_encoder(), half)[n] - got["plain", 0][n]).abs().max() for n in got["plain", 0]) > 1e-3


# --- whole runs --------------------------------------------------------------------------------------------

def run_args(docs, out, *extra):
    return ["--model", "scratch:tiny", "--data", str(docs), "--out", str(out), "--docs-per-step", "4",
            "--min-span", "8", "--max-span", "32", "--workers", "0", "--log-every", "1",
            "--cache-dir", str(out.parent / "cache"), *extra]


def test_a_bare_encoder_trained_with_mlm_says_what_its_fresh_head_costs(tmp_path, docs, tiny, capsys):
    """A checkpoint with no MLM head, as a sentence encoder ships: with MLM on, one line on stderr says a head was
    made and that --no-mlm did better from a sentence encoder; with --no-mlm, or a checkpoint with its head, none."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    head = load_file(bare / "model.safetensors")
    save_file({k: v for k, v in head.items() if not k.startswith("lm_head.")}, bare / "model.safetensors")
    lines = {}
    for name, model, extra in [("mlm", bare, []), ("no-mlm", bare, ["--no-mlm"]), ("head", tiny, [])]:
        T.main(run_args(docs, tmp_path / name, "--model", str(model), "--steps", "1", *extra))
        lines[name] = [line for line in capsys.readouterr().err.splitlines() if "MLM head" in line]
    assert lines["mlm"] == [f"{bare}: no MLM head in the checkpoint, a fresh one made; from a sentence encoder, "
                            "--no-mlm did better on held-out documents (docs/ablation.md)"]
    assert lines["no-mlm"] == lines["head"] == []


def trace(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["contrastive"], r["mlm"]) for r in recs]


def default_sigint():
    """In a child before it starts Python: SIGINT at its default, so that Python installs KeyboardInterrupt (it does
    not where SIGINT starts ignored, as in a shell script's background job or under nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_after(p, out, steps, sig):
    """Send sig to the training process p once out/metrics.jsonl holds `steps` steps; fail, saying so, if the run
    ends or two minutes pass first."""
    metrics, t0 = out / "metrics.jsonl", time.time()
    while p.poll() is None and time.time() - t0 < 120:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            p.send_signal(sig)
            return
        time.sleep(0.01)
    pytest.fail(f"never signalled: the run {'ended' if p.poll() is not None else 'had not reached'} step {steps} "
                f"after {time.time() - t0:.0f} s")


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_trace(tmp_path, docs):
    # One thread each, whatever else runs: with --threads 0 each run takes the cores free when it starts, and a sum
    # split over two threads rounds otherwise than over one (once 1e-6 apart under load)
    common = ["--steps", "12", "--ckpt-every", "4", "--threads", "1"]
    T.main(run_args(docs, tmp_path / "a", *common))
    full = trace(tmp_path / "a")
    assert [s for s, *_ in full] == list(range(1, 13))
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *run_args(docs, tmp_path / "b", *common)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    signal_after(p, tmp_path / "b", 6, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert [c.name for c in runs.checkpoints(tmp_path / "b")] == ["step-00000004"]
    assert f"pid {p.pid} " in (tmp_path / "b" / runs.LOCK).read_text()  # the killed run's lock file, left behind...
    T.main(["--out", str(tmp_path / "b"), "--resume"])  # ...holds nothing: the next run takes the folder
    assert trace(tmp_path / "b") == full
    assert_same_weights(tmp_path / "a" / "model", tmp_path / "b" / "model")


SLOW_STEPS = ("import sys, time; sys.path.insert(0, sys.argv[1]); import train; step = train.train_step; "
              "train.train_step = lambda *a, **k: (time.sleep(0.2), step(*a, **k))[1]; train.main(sys.argv[2:])")


HELD_STEPS = """import os, sys, time
sys.path.insert(0, sys.argv[1])
import train
step, hold, steps = train.train_step, sys.argv[2], []

def held(*args, **kwargs):  # from its fourth step (step 2's line is written as step 3 starts), the test holds it
    steps.append(1)
    while len(steps) > 3 and os.path.exists(hold):
        time.sleep(0.02)
    return step(*args, **kwargs)

train.train_step = held
train.main(sys.argv[3:])"""


@pytest.mark.slow
def test_a_run_folder_holds_one_run_at_a_time(tmp_path, docs):
    """While a run trains, a second run into its --out (a new one, --overwrite, or --resume of it) is refused at once
    with one line naming the holder, and the first run ends as if it had been alone."""
    args = run_args(docs, tmp_path / "a", "--steps", "12", "--ckpt-every", "4", "--threads", "1")  # whatever else runs
    hold = tmp_path / "hold"
    hold.touch()
    first = subprocess.Popen([sys.executable, "-c", HELD_STEPS, str(ROOT), str(hold), *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, t0 = tmp_path / "a" / "metrics.jsonl", time.time()
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() - t0 < 60:
        time.sleep(0.05)
    others = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *a], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
              for a in (args + ["--seed", "2"], args + ["--seed", "2", "--overwrite"],
                        ["--out", str(tmp_path / "a"), "--resume"])]
    for p in others:
        err = p.communicate(timeout=120)[1]
        assert p.returncode == 1 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: --out {tmp_path / 'a'}: another run is using it (pid {first.pid} on "), err
    assert first.poll() is None, "the first run ended before the others were refused: nothing was tested"
    hold.unlink()
    assert first.wait(timeout=120) == 0
    T.main(run_args(docs, tmp_path / "alone", "--steps", "12", "--ckpt-every", "4", "--threads", "1"))
    assert trace(tmp_path / "a") == trace(tmp_path / "alone")
    assert [c.name for c in runs.checkpoints(tmp_path / "a")] == [c.name for c in runs.checkpoints(tmp_path / "alone")]
    assert_same_weights(tmp_path / "alone" / "model", tmp_path / "a" / "model")
    assert_same_weights(runs.checkpoints(tmp_path / "alone")[-1], runs.checkpoints(tmp_path / "a")[-1])


def assert_same_weights(a, b):
    wa, wb = (load_file(str(d / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_crash_during_checkpoint_write_keeps_the_previous(tmp_path, docs, monkeypatch):
    one = ("--threads", "1")  # both runs alike, however many cores are free when each starts
    T.main(run_args(docs, tmp_path / "r", "--steps", "2", "--ckpt-every", "2", *one))
    model, tok = M.load_pretrained(str(tmp_path / "r" / "checkpoints" / "step-00000002"))
    opt = T.make_optimizer(model, 5e-5, 0.1, fused=False)

    def dying_save(obj, f):
        f.write(b"half a file")
        raise KeyboardInterrupt  # the process dies mid-write

    monkeypatch.setattr(runs.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        T.Run(T.TrainConfig(), tmp_path / "r", T.ChunkedEncoder(model), model, tok, opt, scaler, None, 0,
              M.save_pretrained, step=4).save_checkpoint()
    monkeypatch.undo()
    ck = runs.checkpoints(tmp_path / "r")
    assert [c.name for c in ck] == ["step-00000002"]
    state = runs.read_train_state(ck[-1])
    assert state["step"] == 2
    before = trace(tmp_path / "r")
    T.main(["--out", str(tmp_path / "r"), "--resume", "--steps", "3"])  # and a run resumes from it, as if no crash
    T.main(run_args(docs, tmp_path / "clean", "--steps", "2", "--ckpt-every", "2", *one))
    T.main(["--out", str(tmp_path / "clean"), "--resume", "--steps", "3"])
    assert [s for s, *_ in trace(tmp_path / "r")] == [1, 2, 3] and trace(tmp_path / "r")[:2] == before
    assert trace(tmp_path / "r") == trace(tmp_path / "clean")
    assert_same_weights(tmp_path / "r" / "model", tmp_path / "clean" / "model")


@pytest.mark.slow
def test_losses_fall_on_gutenberg(tmp_path):
    books = sorted(need(GUTENBERG).glob("*.txt"))[:8]
    T.main(["--model", "scratch:tiny", "--data", *map(str, books), "--out", str(tmp_path / "g"), "--docs-per-step", "8",
            "--min-span", "16", "--max-span", "96", "--steps", "50", "--lr", "2e-3", "--warmup-frac", "0.1",
            "--workers", "0", "--log-every", "25", "--cache-dir", str(tmp_path / "cache")])
    t = trace(tmp_path / "g")
    first, last = np.mean([c for _, c, _ in t[:10]]), np.mean([c for _, c, _ in t[-10:]])
    mfirst, mlast = np.mean([m for *_, m in t[:10]]), np.mean([m for *_, m in t[-10:]])
    # contrastive: from ~ln(2*2*8 - 1) = 3.4 for random embeddings; MLM: from ln(vocab) = 8.3 for a uniform guess
    assert last < 0.8 * first and mlast < mfirst - 0.2, (first, last, mfirst, mlast)
    assert (tmp_path / "g" / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_two_nodes_resume_at_rank_0s_step_or_stop_with_one_line(tmp_path, docs, reap):
    """Two torchrun "nodes" on loopback train one run together. Each with its own --out (machines without a shared
    filesystem: only rank 0 wrote a checkpoint): --resume stops before its first step with one line saying so, every
    rank exit 2, nothing of the run changed. With one --out both see: both resume at rank 0's step, and after one more
    step both ranks hold the same weights (the optimizer's state came back on each)."""
    def nodes(outs, *extra):
        port = free_port()
        # c10d numbers the machines in the order of their addresses: node n is 127.0.0.{n + 1}, so machine n. Two
        # threads each, as a machine has (with two, 1 run in 5 once ended with rank 1's word embeddings 1 ulp off rank
        # 0's: every checkpoint now checks the replicas, and gives them rank 0's where they differ)
        procs = [reap(torchrun("--nnodes=2", "--nproc_per_node=1", f"--local_addr=127.0.0.{n + 1}",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=declutr-resume",
                               str(ROOT / "tests" / "rank_weights.py"), *run_args(docs, out, *extra, "--threads", "2")),
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      env={**os.environ, "OMP_NUM_THREADS": "2", "RANK_WEIGHTS": str(tmp_path)})
                 for n, out in enumerate(outs)]
        return [p.communicate(timeout=150)[0] for p in procs], [p.returncode for p in procs]

    shared, own = tmp_path / "shared", tmp_path / "own"
    outs, codes = nodes([shared, shared], "--steps", "2", "--ckpt-every", "2")  # a run over two machines
    assert codes == [0, 0] and "on 2 process(es)" in outs[0], outs
    assert [s for s, *_ in trace(shared)] == [1, 2]
    files = {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    own.mkdir()
    outs, codes = nodes([shared, own], "--resume", "--steps", "3")
    explanation = (f"error: rank 1 on machine 1 cannot resume at step 2 as rank 0 does ({own}/checkpoints/"
                   f"step-00000002: not there): --out must be one folder that every machine sees, or hold a copy of "
                   f"rank 0's checkpoint")
    # each machine's log says it, where the user has to act as much as where rank 0 runs
    assert [[line for line in out.splitlines() if line.startswith("error: ")] for out in outs] == [[explanation]] * 2
    assert all(code != 0 for code in codes) and all("exitcode  : 2" in out for out in outs), outs  # torchrun's report
    assert {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()} == files and not any(own.iterdir())
    outs, codes = nodes([shared, shared], "--resume", "--steps", "3")
    assert codes == [0, 0] and "resuming at step 2 from" in outs[0], outs
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["step"] for r in ranks] == [3, 3] and [s for s, *_ in trace(shared)] == [1, 2, 3]
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])


@pytest.mark.slow
def test_a_replica_that_drifted_is_said_and_made_rank_0s_at_a_checkpoint(tmp_path, docs, reap):
    """Rank 1's weights one unit in the last place apart from rank 0's after DDP has begun (as a CPU's rounding left
    them in issue 78): the checkpoint after step 1 finds it by the weights' bits, says which rank and parameter in one
    line, and gives every rank rank 0's; both end with the same weights. Without it they would end apart."""
    cmd = torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "tests" / "rank_weights.py"),
                   *run_args(docs, tmp_path / "r", "--steps", "2", "--ckpt-every", "1"))
    p = reap(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
             env={**os.environ, "OMP_NUM_THREADS": "1", "RANK_WEIGHTS": str(tmp_path), "NUDGE_RANK": "1"})
    out = p.communicate(timeout=150)[0]
    assert p.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if "held weights that differed" in line]
    assert said == ["warning: step 1: rank(s) 1 held weights that differed from rank 0's (1 parameter(s), the first "
                    "embeddings.word.weight); rank 0's weights and optimizer state now on every rank"], out[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["weights"] for r in (0, 1)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])


@pytest.mark.slow
def test_sigterm_to_both_machines_says_why_on_each(tmp_path, docs, reap):
    """A scheduler's SIGTERM to the torchrun of each of two "machines" (loopback): each machine's log ends with our
    line, the step every rank stopped after and the checkpoint to go on from, not only rank 0's."""
    port, out = free_port(), tmp_path / "run"
    procs = [reap(torchrun("--nnodes=2", "--nproc_per_node=1", f"--local_addr=127.0.0.{n + 1}", "--rdzv_backend=c10d",
                           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=declutr-sigterm", str(ROOT / "train.py"),
                           *run_args(docs, out, "--steps", "200", "--ckpt-every", "1000")),
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
             for n in range(2)]
    t0 = time.time()
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        assert time.time() - t0 < 120 and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    [ckpt] = runs.checkpoints(out)
    line = f"error: terminated (SIGTERM) after step {int(ckpt.name[5:])}; last checkpoint: {ckpt} (continue with: "
    for o in outs:
        ours = [x for x in o.splitlines() if x.startswith("error: ")]
        assert len(ours) == 1 and ours[0].startswith(line), o


@pytest.mark.slow
def test_a_run_resumes_on_the_processes_it_had(tmp_path, docs, reap):
    """A run of 2 processes, killed after its checkpoint at step 4: resumed as one plain process, it is refused with
    one line that gives the command that continues it, nothing written, exit 2; that command gives every loss and
    every weight of the run never stopped; --any-world-size goes on with one process, saying so."""
    from conftest import run_here

    def torchrun_run(out, *extra, wait=True):
        p = reap(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "train.py"),
                          *run_args(docs, out, "--steps", "8", "--ckpt-every", "4", *extra)),
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        return p.communicate(timeout=150)[0] if wait else p

    never_stopped = torchrun_run(tmp_path / "a", wait=False)  # beside the run that is killed: the cores are 2
    p = torchrun_run(tmp_path / "b", wait=False)
    t0 = time.time()
    while not (tmp_path / "b" / "checkpoints" / "step-00000004").exists() and time.time() - t0 < 120:
        time.sleep(0.01)
    # torchrun starts its workers in sessions of their own: each is killed by its pid, then the agent
    for worker in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(worker), signal.SIGKILL)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    text = never_stopped.communicate(timeout=150)[0]
    assert never_stopped.returncode == 0, text[-3000:]
    before = {q: q.read_bytes() for q in (tmp_path / "b").rglob("*") if q.is_file() and q.name != ".declutr.lock"}
    r = run_here(T.main, "--out", tmp_path / "b", "--resume")  # train.py, in this process
    hint = f"torchrun --nproc_per_node=2 train.py --out {tmp_path / 'b'} --resume"
    assert r.returncode == 2 and r.stderr == (
        f"error: {tmp_path / 'b'}: the run was trained by 2 process(es), this is 1, and every later step would differ "
        f"from the run's own; continue it with: {hint} (or pass --any-world-size to go on with 1 all the same)\n"), \
        r.stderr
    assert {q: q.read_bytes() for q in (tmp_path / "b").rglob("*") if q.is_file() and q.name != ".declutr.lock"} \
        == before
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    out = reap(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), *hint.split()[2:]),
               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
               cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}).communicate(timeout=150)[0]
    assert "resuming at step 4" in out, out[-3000:]
    assert trace(tmp_path / "b") == trace(tmp_path / "a")
    assert_same_weights(tmp_path / "a" / "model", tmp_path / "b" / "model")
    r = run_here(T.main, "--out", tmp_path / "c", "--resume", "--any-world-size")
    assert r.returncode == 0 and (f"warning: {tmp_path / 'c'}: the run was trained by 2 process(es) and goes on with 1 "
                                  f"(--any-world-size)") in r.stderr, r.stderr
    assert trace(tmp_path / "c")[:4] == trace(tmp_path / "a")[:4] and trace(tmp_path / "c") != trace(tmp_path / "a")


@pytest.mark.slow
def test_torchrun_restart_resumes_and_finishes(tmp_path, docs, reap):
    p = reap(torchrun("--nproc_per_node=2", "--max-restarts=1", "--rdzv_backend=c10d",
                                  f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=declutr-restart",
                                  str(ROOT / "train.py"),
                                  *run_args(docs, tmp_path / "k", "--steps", "12", "--ckpt-every", "3")),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, t0, killed = tmp_path / "k" / "metrics.jsonl", time.time(), False
    while time.time() - t0 < 200 and not killed:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            os.kill(int(workers[-1]), signal.SIGKILL)
            killed = True
        time.sleep(0.02)
    out = p.communicate(timeout=120)[0]
    assert killed and p.returncode == 0, out[-3000:]
    assert "resuming at step" in out
    assert trace(tmp_path / "k")[-1][0] == 12


# --- bad input ---------------------------------------------------------------------------------------------


def one_line_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        T.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert e.value.code == 1 and len(lines) == 1, err
    return lines[0]


def test_bad_input(tmp_path, docs, capsys):
    assert "no such file" in one_line_error(capsys, run_args(tmp_path / "nope", tmp_path / "o1"))
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("too short")
    assert "no document has" in one_line_error(capsys, run_args(tmp_path / "short", tmp_path / "o2"))
    bad_model = run_args(docs, tmp_path / "o3")
    bad_model[1] = str(tmp_path / "no-model/")
    assert "no such folder" in one_line_error(capsys, bad_model)
    (tmp_path / "o5" / "model").mkdir(parents=True)  # an earlier run: its model and its log
    (tmp_path / "o5" / "model" / "config.json").write_text("{}")
    (tmp_path / "o5" / "metrics.jsonl").write_text("precious\n")
    assert "--overwrite" in one_line_error(capsys, run_args(docs, tmp_path / "o5"))
    assert (tmp_path / "o5" / "metrics.jsonl").read_text() == "precious\n"


@pytest.mark.parametrize("bad_step", [0, 3])
def test_nan_names_the_last_good_checkpoint(tmp_path, docs, capsys, monkeypatch, bad_step):
    real, steps = T.train_step, []

    def step(model, batch, cfg, world=1, scaler=None):
        s = real(model, batch, cfg, world, scaler)
        steps.append(len(steps))  # a run from step 0: the calls count the steps
        return {**s, "mlm": float("inf")} if steps[-1] == bad_step else s

    monkeypatch.setattr(T, "train_step", step)
    msg = one_line_error(capsys, run_args(docs, tmp_path / "o", "--steps", "6", "--ckpt-every", "2"))
    if bad_step == 0:
        assert "loss is inf at step 1" in msg and "none yet" in msg
    else:
        assert "at step 4" in msg and "step-00000002" in msg
        assert [c.name for c in runs.checkpoints(tmp_path / "o")] == ["step-00000002"]


# --- resuming -------------------------------------------------------------------------------------------------


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_extends_with_steps_and_refuses_other_flags(tmp_path, docs, capsys):
    out = tmp_path / "r"
    T.main(run_args(docs, out, "--steps", "4", "--ckpt-every", "2"))
    before = snapshot(out)
    for flag in (["--lr", "1e-3"], ["--num-anchors", "1"], ["--no-mlm"], ["--data", str(tmp_path)], ["--seed", "1"]):
        with pytest.raises(SystemExit) as e:
            T.main(["--out", str(out), "--resume", *flag])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("error: ") == 1 and f"{flag[0]} cannot change when resuming" in err
    assert snapshot(out) == before  # nothing of the run touched
    # Killed after its last checkpoint, before its model was written: --resume finishes it from that checkpoint
    shutil.rmtree(out / "model")
    T.main(["--out", str(out), "--resume"])
    printed = capsys.readouterr().out
    assert "the run trained all its 4 steps; its last checkpoint (step-00000004) is its final model" in printed
    assert (out / "model" / "model.safetensors").read_bytes() == (
        out / "checkpoints" / "step-00000004" / "model.safetensors").read_bytes()
    assert (out / "model" / "README.md").exists() and [s for s, *_ in trace(out)] == [1, 2, 3, 4]
    with pytest.raises(SystemExit) as e:  # fewer steps than it has trained: nothing to finish
        T.main(["--out", str(out), "--resume", "--steps", "3"])
    assert e.value.code == 1 and "is at step 4 of 3; pass --steps" in capsys.readouterr().err
    T.main(["--out", str(out), "--resume", "--steps", "6", "--log-every", "3"])  # today: silently stopped at 4
    printed, cfg = capsys.readouterr().out, T.TrainConfig()  # the run's lr and schedule are the defaults
    lr_at = functools.partial(T.lr_at, lr=cfg.lr, cut_frac=cfg.warmup_frac, ratio=cfg.lr_ratio)
    assert "resuming at step 4" in printed
    assert (f"the run goes on to 6 steps (it was planned for 4): its learning-rate schedule is planned again over 6, "
            f"and step 5 trains at lr {lr_at(4, 6):.2e} (step 4 had {lr_at(3, 4):.2e})\n") in printed
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[4])["lr"] == lr_at(4, 6)
    assert [s for s, *_ in trace(out)] == [1, 2, 3, 4, 5, 6]
    assert [c.name for c in runs.checkpoints(out)] == ["step-00000004", "step-00000006"]
    assert runs.read_train_state(out / "checkpoints" / "step-00000006")["config"]["steps"] == 6


@pytest.mark.parametrize("bad_file", ["train_state.pt", "model.safetensors"])
def test_resume_falls_back_past_an_unreadable_checkpoint(tmp_path, docs, capsys, bad_file):
    """The newest checkpoint cut short: say which file, resume from the one before, end where the full run did.
    Temporaries that a killed run left (a checkpoint, a corpus) are gone after the next run."""
    common = ["--steps", "8", "--ckpt-every", "4"]
    T.main(run_args(docs, tmp_path / "a", *common))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    f = tmp_path / "b" / "checkpoints" / "step-00000008" / bad_file
    f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, as a killed run's
    host = socket.gethostname().split(".")[0]
    stale = [tmp_path / "b" / "checkpoints" / f".step-00000012.{host}.{dead.pid}.tmp",
             tmp_path / "cache" / f".corpus-0123456789abcdef0123.{host}.{dead.pid}.tmp"]
    for d in stale:
        d.mkdir()
        (d / "half").write_text("a half-written file")
    capsys.readouterr()
    T.main(["--out", str(tmp_path / "b"), "--resume"])
    err, printed = capsys.readouterr()[::-1]
    assert f"step-00000008/{bad_file}" in err and "resuming from the checkpoint before it" in err
    assert "resuming at step 4" in printed
    assert trace(tmp_path / "b") == trace(tmp_path / "a")
    assert not any(d.exists() for d in stale)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2, 2, 2])
def test_ctrl_c_is_one_line_with_the_checkpoint(tmp_path, docs, reap, workers):
    """SIGINT to the training process alone (not its group): one line and nothing after it, also with DataLoader
    workers, which are stopped before the process ends (a worker that outlived it while taking a batch's memory
    from it printed a traceback of multiprocessing's resource_sharer, once in two tries). Thrice with workers."""
    p = reap([sys.executable, str(ROOT / "train.py"), *run_args(docs, tmp_path / "c", "--steps", "500",
                                                                  "--ckpt-every", "4"), "--workers", str(workers)],
             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    signal_after(p, tmp_path / "c", 6, signal.SIGINT)
    err = p.communicate(timeout=60)[1]  # to the end of stderr: a worker left behind holds it open, and would print
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.count("error: ") == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted after step ") and "step-00000004" in last and "--resume" in last
    step = int(re.match(r"error: interrupted after step (\d+)", last).group(1))
    logged = [json.loads(line)["step"] for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))  # the log ends at the step the line names: one count


@pytest.mark.slow
@pytest.mark.parametrize("whole_group", [False, True])
def test_sigterm_checkpoints_its_step_and_resume_gives_the_uninterrupted_run(tmp_path, docs, reap, whole_group,
                                                                              capsys):
    """SIGTERM, as `timeout` sends it (to the training process) or SLURM (to every process of the job, DataLoader
    workers too): the step under way ends, is checkpointed, one line says where and how to go on, exit 143; resuming
    from that checkpoint gives the loss trace and the weights of a run never stopped."""
    # No checkpoint of its own before the end; one thread in both runs, however many cores are free when each starts
    # (a sum split over another count of threads rounds otherwise: a stranger's run once differed at step 3 by 1e-6)
    common = ["--steps", "12", "--ckpt-every", "100", "--threads", "1"]
    T.main(run_args(docs, tmp_path / "a", *common))
    workers = ["--workers", "2"] if whole_group else []
    p = reap([sys.executable, str(ROOT / "train.py"), *run_args(docs, tmp_path / "b", *common), *workers],
             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics, t0 = tmp_path / "b" / "metrics.jsonl", time.time()
    while p.poll() is None and time.time() - t0 < 120:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            if whole_group:
                os.killpg(p.pid, signal.SIGTERM)
            else:
                p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 143, err[-2000:]
    assert "Traceback" not in err and err.count("error: ") == 1
    [ckpt] = runs.checkpoints(tmp_path / "b")
    step = int(ckpt.name.removeprefix("step-"))
    assert 4 <= step < 12 and [s for s, *_ in trace(tmp_path / "b")] == list(range(1, step + 1))
    assert err.strip().splitlines()[-1] == (f"error: terminated (SIGTERM) after step {step}; last checkpoint: {ckpt} "
                                            f"(continue with: python train.py --out {tmp_path / 'b'} --resume)")
    capsys.readouterr()
    T.main(["--out", str(tmp_path / "b"), "--resume"])
    assert "planned again" not in capsys.readouterr().out  # the same steps: the same schedule, nothing to say
    assert trace(tmp_path / "b") == trace(tmp_path / "a")
    assert_same_weights(tmp_path / "a" / "model", tmp_path / "b" / "model")


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, docs, reap):
    """SIGTERM to one rank of two: both stop after the same step, checkpointed. The run is --no-mlm, so that it also
    shows DDP with the MLM head unused completing every step up to there (no rank waits for that head's gradient)."""
    p = reap(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "train.py"),
                      *run_args(docs, tmp_path / "t", "--steps", "40", "--ckpt-every", "100", "--no-mlm")),
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, t0 = tmp_path / "t" / "metrics.jsonl", time.time()
    while p.poll() is None and time.time() - t0 < 120:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            os.kill(int(workers[-1]), signal.SIGTERM)  # one rank only: the other learns of it in the step's reduction
            break
        time.sleep(0.01)
    out = p.communicate(timeout=120)[0]
    [ckpt] = runs.checkpoints(tmp_path / "t")
    step = int(ckpt.name.removeprefix("step-"))
    assert step < 40 and trace(tmp_path / "t")[-1][0] == step, out[-3000:]  # rank 0 logged up to the same step
    assert [s for s, *_ in trace(tmp_path / "t")] == list(range(1, step + 1)) and step >= 4
    assert runs.read_train_state(ckpt)["step"] == step and "terminated (SIGTERM) after step" in out


@pytest.mark.parametrize("cores, busy, local_world, want", [
    (2, [0, 0], 1, 2), (2, [1, 0], 1, 1), (2, [1, 1], 1, 1), (1, [0], 1, 1), (2, [0.5, 0], 1, 1),
    (2, [0.2, 0], 1, 2), (16, [0] * 16, 1, 16), (16, [1] + [0] * 15, 4, 3), (16, [0] * 16, 4, 4)])
def test_default_threads_are_the_free_cores(monkeypatch, cores, busy, local_world, want):
    """Each CPU's share of busy ticks (from /proc/stat, faked here) over the moment measured: a core counts as free
    when it was idle at least 3/4 of it; under torchrun each rank takes its share of the free ones."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    reads = iter([{c: (0, 0) for c in range(cores)}, {c: (round(100 * (1 - b)), 100) for c, b in enumerate(busy)}])
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(reads))
    assert threads.default_threads() == want


def test_default_threads_leave_the_core_a_busy_process_holds():
    """Read from this machine's /proc/stat: beside a process that spins on a core, fewer threads than cores (alone,
    as many as the cores that are idle)."""
    cores = len(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert threads.default_threads() <= max(1, cores - 1)
    finally:
        busy.kill()
        busy.wait()
    assert threads.free_cores(list(range(cores)), seconds=0.2) <= cores


@pytest.mark.slow
def test_eval_data_scores_and_keeps_the_best(tmp_path, docs):
    import evaluate_sts as E
    from conftest import stsb_dev

    dev = stsb_dev()
    T.main(run_args(docs, tmp_path / "e", "--steps", "4", "--eval-every", "2", "--eval-data", str(dev)))
    recs = [json.loads(line) for line in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["stsb_dev_spearman"] for r in recs if "stsb_dev_spearman" in r}
    assert sorted(scores) == [0, 2, 4]  # step 0: the model the run starts from, never kept as the best
    best, tok = M.load_pretrained(str(tmp_path / "e" / "best"))
    # Scored as evaluate_sts.py scores it by default on this CPU (bf16 where it has AMX or AVX512-BF16): the
    # training's evaluation follows that rule, and bf16 moves a tiny model's score by ~0.002 from fp32's
    dtype = device.autocast_dtype("auto", torch.device("cpu"), cpu_bf16=True)
    assert abs(E.spearman_of(best, tok, load_stsb_dev(dev), dtype=dtype) - max(scores[2], scores[4])) < 1e-3


@pytest.mark.slow
def test_demo_without_arguments_gives_a_model_embed_and_evaluate_accept(tmp_path, capsys, monkeypatch):
    """`python train.py` alone (here cut to 4 steps): Python's own docs in, a usable model out."""
    import embed
    import evaluate_sts
    from conftest import stsb_dev

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    T.main(["--steps", "4"])
    out = capsys.readouterr().out
    assert "the demo, scratch:tiny" in out and "done: the model is in runs/demo/model" in out
    assert len(list((tmp_path / "cache" / "declutr" / "demo-corpus").glob("*.txt"))) > 100
    embed_cmd = next(line for line in out.splitlines() if "python embed.py" in line)
    assert "--model runs/demo/model - --output runs/demo/embeddings.npy" in embed_cmd  # under the run, not the repo
    (tmp_path / "t.txt").write_text("A man is playing a guitar.\nA woman is singing.\n")
    embed.main(["--model", "runs/demo/model", str(tmp_path / "t.txt"), "--output", "e.npy"])
    assert np.load("e.npy").shape == (2, 64)
    T.main(["--resume", "--steps", "6"])  # no --out: the demo's run is found
    assert "resuming at step 4 from runs/demo/checkpoints/step-00000004" in capsys.readouterr().out
    assert [s for s, *_ in trace(tmp_path / "runs" / "demo")] == [1, 2, 3, 4, 5, 6]
    evaluate_sts.main(["--model", "runs/demo/model", "--split", "dev", "--data", str(stsb_dev().parent)])
    assert "STSB" in capsys.readouterr().out
    # a flag given keeps its value, even the default's: --lr 5e-5 is not the demo's 1e-3 (the schedule is at its top,
    # lr itself, at the second of two steps)
    T.main(["--lr", "5e-5", "--steps", "2", "--out", "runs/lr"])
    assert [json.loads(line)["lr"] for line in open("runs/lr/metrics.jsonl")] == [5e-5 / 32, 5e-5]


@pytest.mark.slow
def test_an_out_deleted_while_the_run_trains_is_one_line(tmp_path, docs):
    args = run_args(docs, tmp_path / "a", "--steps", "40", "--ckpt-every", "100")
    p = subprocess.Popen([sys.executable, "-c", SLOW_STEPS, str(ROOT), *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    metrics, t0 = tmp_path / "a" / "metrics.jsonl", time.time()
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() - t0 < 60:
        time.sleep(0.05)
    shutil.rmtree(tmp_path / "a")
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"error: {metrics}: cannot write (No such file or directory); was --out moved or "
                                    f"deleted while the run trained? last checkpoint: none yet")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm to the group", "one rank killed"])
def test_torchrun_stopped_is_one_line_of_ours(tmp_path, docs, reap, how):
    """SLURM's SIGTERM to the whole job, or a rank that dies: one line from this project and no traceback of its
    code. torchrun's own report follows (its SignalException, or its ChildFailedError box), as docs/reference.md
    says."""
    p = reap(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "train.py"),
                      *run_args(docs, tmp_path / "t", "--steps", "40", "--ckpt-every", "100")),
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, t0 = tmp_path / "t" / "metrics.jsonl", time.time()
    while p.poll() is None and time.time() - t0 < 120:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            if how == "one rank killed":
                workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
                os.kill(int(workers[-1]), signal.SIGKILL)
            else:
                os.killpg(p.pid, signal.SIGTERM)
            break
        time.sleep(0.01)
    out = p.communicate(timeout=120)[0]
    ours = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and not re.search(rf'File "{ROOT}/\w+\.py"', out), out[-4000:]  # no frame of ours
    if how == "one rank killed":
        assert ours[0].startswith("error: rank 0: another rank stopped after step ") and "Connection" in ours[0]
        assert "ChildFailedError" in out
        return
    [ckpt] = runs.checkpoints(tmp_path / "t")
    assert ours[0] == (f"error: terminated (SIGTERM) after step {int(ckpt.name[5:])}; last checkpoint: {ckpt} "
                       f"(continue with: torchrun --nproc_per_node=2 train.py --out {tmp_path / 't'} --resume)")
    assert "SignalException" in out  # torchrun's agent, signalled too, raises it after its workers have stopped
