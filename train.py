"""
train.py: DeCLUTR's training loop. Contrastive loss on sampled spans plus MLM, on a CPU, a GPU, or many.

Paper §3 and §4: continue pretraining an encoder on unlabelled documents with NT-Xent over anchors and
positives (loss.py) sampled from the same documents (sampler.py), plus masked language modelling on the
anchors in the same forward pass; AdamW (lr 5e-5, weight decay 0.1 except biases and LayerNorms, eps 1e-6),
a slanted triangular schedule (cut_frac 0.1, ratio 32), gradients clipped to norm 1.0, N=16 documents a step.

    python train.py                                   # the demo: a tiny model learns from Python's own docs, ~3 min
    python train.py --model scratch:tiny --data ../shared/data/corpus/gutenberg --steps 200 --lr 1e-3 --out runs/tiny
    python train.py --model distilroberta-base --data docs/ --out runs/declutr-small
    torchrun --nproc_per_node=4 train.py --model distilroberta-base --data owt/ --out runs/declutr-small
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=run1 \\
        train.py --model roberta-base --data owt/ --out runs/declutr-base
    python train.py --out runs/declutr-small --resume          # continue from the newest checkpoint
"""
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loss as L
import model as M
import sampler as S


@dataclass
class TrainConfig:
    model: str = ""  # hub id, local directory, or scratch:SHAPE (tiny, small, ...); empty: distilroberta-base
    data: list = field(default_factory=list)  # .txt / .jsonl (optionally .gz) files and directories; none: the demo
    out: str = ""  # checkpoints, metrics.jsonl, and the final model in out/model; empty: runs/declutr (runs/demo)
    resume: bool = False  # continue from the newest checkpoint in out (with its stored configuration)
    overwrite: bool = False  # start afresh in an out that holds an earlier run
    docs_per_step: int = 16  # N, over all ranks together
    num_anchors: int = 2  # A
    num_positives: int = 2  # P
    min_span: int = 32  # l_min, tokens
    max_span: int = 512  # l_max, tokens (lowered to fit the model's positions)
    scale_short_docs: bool = False  # sample documents shorter than 2*A*l_max with a smaller l_max
    temperature: float = 0.05  # tau of NT-Xent
    mlm_probability: float = 0.15
    mlm: bool = True  # --no-mlm: contrastive only (the paper's Fig. 3 ablation)
    contrastive: bool = True  # --no-contrastive: MLM only
    lr: float = 5e-5
    weight_decay: float = 0.1
    warmup_frac: float = 0.1  # slanted triangular cut_frac
    lr_ratio: float = 32.0  # slanted triangular: lowest lr is lr / ratio
    max_grad_norm: float = 1.0
    steps: int = 0  # optimiser steps; 0: --epochs passes over the documents
    epochs: int = 1
    seed: int = 0
    chunk_tokens: int = 16384  # spans run in length-sorted chunks of at most this many padded tokens
    grad_cache: bool = False  # GradCache: chunks forward without a graph, then backward chunk by chunk
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16
    compile: bool = False  # torch.compile the encoder
    log_every: int = 10
    eval_data: str = ""  # STS-B folder or sts-dev.csv: dev Spearman at every eval, best model kept in out/best
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    ckpt_every: int = 500
    keep_ckpts: int = 2
    workers: int = 2  # DataLoader workers per rank
    cache_dir: str = ""  # tokenised corpus cache (default ~/.cache/declutr)


# `python train.py` with no data: a demo that needs nothing but Python. These replace the fields left at default.
DEMO = dict(model="scratch:tiny", out="runs/demo", steps=600, lr=1e-3, min_span=16, max_span=64, log_every=50,
            ckpt_every=200)


def demo_corpus(cache_dir: str) -> Path:
    """Text that every Python installation carries, one document per file: the language reference's help
    topics (pydoc_data) and the docstrings of each standard-library module, read with ast (nothing imported)."""
    import ast
    import sysconfig
    from pydoc_data.topics import topics

    root = Path(cache_dir or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "declutr") / "demo-corpus"
    if (root / "done").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    docs = {f"topic-{k}": v for k, v in topics.items()}
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "tests", "idlelib", "site-packages"} & set(f.parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs["module-" + "-".join(f.with_suffix("").parts[-2:])] = "\n\n".join(
            d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n)))
    for name, text in docs.items():
        if len(text) > 2000:
            (root / f"{name}.txt").write_text(text, encoding="utf-8")
    (root / "done").write_text("")
    return root


class TrainError(RuntimeError):
    """A run that cannot go on; the message is one line meant for the user."""


# -----------------------------------------------------------------------------------------------
# One step


def length_groups(lengths: np.ndarray, budget: int, spread: float = 0.8) -> list[np.ndarray]:
    """Span indices sorted by length, cut into chunks whose padded size stays within `budget` tokens and
    whose shortest span is at least `spread` of the longest: token-wise layers skip padding anyway
    (model.py), attention and its dropout cost T^2 per span, so a 40-token positive never waits on a
    500-token anchor."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        top = lengths[order[start]]
        if i == len(order) or (i - start + 1) * top > budget or lengths[order[i]] < spread * top:
            groups.append(order[start:i])
            start = i
    return groups


def rng_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def train_step(model, batch, cfg: TrainConfig, world: int = 1) -> dict:
    """Forward and backward of one batch; leaves this rank's share of the global gradient in .grad."""
    device = next(model.parameters()).device
    n_a, pad = len(batch["anchors"]), model.config.pad_token_id
    anchors = batch["mlm_inputs"] if cfg.mlm else batch["anchors"]
    ids = [anchors, batch["positives"]]
    lengths = torch.cat([batch["anchor_lengths"], batch["positive_lengths"]]).numpy()
    if not cfg.contrastive:  # MLM alone (Fig. 3's ablation) has no use for the positives
        lengths = lengths[:n_a]
    labels = batch["mlm_labels"].to(device)
    n_masked = (labels != -100).sum().float()
    if world > 1:
        dist.all_reduce(n_masked)
    # MLM is a mean over the masked tokens of the whole global batch; gradients are averaged over ranks, so
    # each rank's share is its sum divided by the global count over world.
    mlm_scale = world / n_masked.clamp(min=1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16" or
                              (cfg.dtype == "auto" and device.type == "cuda"))

    def run(group, grad: bool):
        """One length group -> (embeddings (g, d), this rank's MLM loss share)."""
        T = int(lengths[group].max())
        rows = [ids[0][i, :T] if i < n_a else ids[1][i - n_a, :T] for i in group]
        x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad).to(device)  # (g, T)
        mask = (torch.arange(T, device=device)[None] < torch.as_tensor(lengths[group], device=device)[:, None]).long()
        with autocast:
            h = model(x, mask)  # (g, T, H)
            emb = M.mean_pool(h, mask)
            mlm = h.new_zeros(())
            is_anchor = torch.as_tensor(group < n_a, device=device)
            if cfg.mlm and grad and is_anchor.any():
                lab = labels[torch.as_tensor(group[group < n_a], device=device), :T]  # (ga, <=T)
                lab = F.pad(lab, (0, T - lab.shape[1]), value=-100)  # a positive may be longer than every anchor
                pick = lab != -100
                logits = model.mlm_logits(h[is_anchor][pick])  # (K, V): only the masked tokens (§3.3)
                mlm = F.cross_entropy(logits.float(), lab[pick], reduction="sum") * mlm_scale
        return emb.float(), mlm

    groups = length_groups(lengths, cfg.chunk_tokens)
    back = torch.as_tensor(np.argsort(np.concatenate(groups)), device=device)  # sorted order -> batch order
    stats = dict(tokens=int(lengths.sum()), contrastive=0.0, mlm=0.0)
    if not cfg.grad_cache:
        outs = [run(g, True) for g in groups]
        emb = torch.cat([e for e, _ in outs])[back]
        mlm = sum(m for _, m in outs)
        lc = contrastive_loss(emb, n_a, cfg) if cfg.contrastive else emb.new_zeros(())
        (lc + mlm).backward()
    else:
        # GradCache (Gao et al., 2021): embeddings of every chunk without a graph, the loss on all of them,
        # its gradient w.r.t. each embedding, then each chunk again with a graph, backpropagating that
        # gradient. The same dropout masks both times, so the result is the gradient of the whole batch.
        states = []
        with torch.no_grad():
            embs = []
            for g in groups:
                states.append(rng_state(device))
                embs.append(run(g, False)[0])
        emb = torch.cat(embs)[back].requires_grad_()
        lc = contrastive_loss(emb, n_a, cfg) if cfg.contrastive else emb.new_zeros(())
        if cfg.contrastive:
            lc.backward()
        grad = emb.grad if cfg.contrastive else torch.zeros_like(emb)
        grad = grad[torch.as_tensor(np.concatenate(groups), device=device)]  # back to the chunks' order
        mlm, at = 0.0, 0
        for g, state in zip(groups, states):
            set_rng_state(state, device)
            e, m = run(g, True)
            ((e * grad[at:at + len(g)]).sum() + m).backward()
            mlm, at = mlm + m.detach(), at + len(g)
    stats["contrastive"] = float(lc.detach())
    mlm_log = torch.as_tensor(mlm, device=device).detach() / world
    if world > 1:
        dist.all_reduce(mlm_log)  # the global mean, for the log
    stats["mlm"] = float(mlm_log) if cfg.mlm else 0.0
    return stats


def contrastive_loss(emb, n_a, cfg):
    a, p = emb[:n_a], emb[n_a:]
    return L.nt_xent(a, p.view(n_a, cfg.num_positives, -1), cfg.temperature)  # (M, d), (M, P, d)


def average_gradients(model, world):
    """What DDP does, once per step: DeCLUTR's step runs several forwards (length groups, GradCache) and
    backwards, which DDP's one-forward-one-backward hooks do not allow."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Slanted triangular (Howard & Ruder, 2018): a short linear rise over cut_frac of the steps, a long fall."""
    cut = max(1, math.floor(total * cfg.warmup_frac))
    p = step / cut if step < cut else 1 - (step - cut) / max(1, total - cut)
    return cfg.lr * (1 + p * (cfg.lr_ratio - 1)) / cfg.lr_ratio


def make_optimizer(model, cfg: TrainConfig, fused: bool):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]  # biases and LayerNorms: no decay
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, eps=1e-6, fused=fused or None)


# -----------------------------------------------------------------------------------------------
# Checkpoints: out/checkpoints/step-00000500/{model.safetensors, config.json, tokenizer.json, train_state.pt}


def checkpoints(out: Path) -> list[Path]:
    d = out / "checkpoints"
    return sorted(p for p in d.glob("step-*") if re.fullmatch(r"step-\d{8}", p.name) and (p / "train_state.pt").exists()) \
        if d.exists() else []


def save_checkpoint(out: Path, model, tok, opt, step: int, cfg: TrainConfig, extra: dict):
    final = out / "checkpoints" / f"step-{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_pretrained(model, tok, tmp)
    torch.save({"optimizer": opt.state_dict(), "step": step, "config": asdict(cfg), **extra}, tmp / "train_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a checkpoint exists whole or not at all; a crash mid-write leaves only .tmp
    for old in checkpoints(out)[:-cfg.keep_ckpts]:
        shutil.rmtree(old)
    return final


def read_train_state(path: Path) -> dict:
    return torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)  # tensors and plain data only


def load_checkpoint(path: Path, model, opt, state: dict | None = None):
    state = state or read_train_state(path)
    loaded, _ = M.load_pretrained(str(path), verbose=False)
    model.load_state_dict(loaded.state_dict())
    opt.load_state_dict(state["optimizer"])
    return state


# -----------------------------------------------------------------------------------------------


def setup_distributed():
    rank, local, world = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torchrun's agent keeps its store across --max-restarts rounds: a prefix per round keeps restarted
        # workers from reading the addresses that the workers before them published.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent, timeout=timedelta(minutes=10))
        store = dist.PrefixStore(f"declutr/round-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
    return rank, local, world, device


def say(rank, *a, **k):
    if rank == 0:
        print(*a, **k, flush=True)


def build_model(cfg: TrainConfig, rank: int, world: int, out: Path):
    """(encoder, tokenizer); a scratch model's BPE is trained on the run's own documents by rank 0."""
    if not cfg.model.startswith("scratch:"):
        return M.load_pretrained(cfg.model, verbose=rank == 0)
    shape = cfg.model.split(":", 1)[1]
    if shape not in M.SHAPES:
        raise M.ModelError(f"unknown shape {shape!r} (one of {', '.join(M.SHAPES)})")
    tok_json = [None]
    if rank == 0:
        stats = dict(empty=0, binary=0, malformed=0, files_repaired=0, bytes_replaced=0)
        texts, budget = [], 64 << 20  # the first 64M characters are plenty for a BPE vocabulary
        for t in S.read_documents(S.list_files(cfg.data), stats):
            texts.append(t[:budget])
            budget -= len(texts[-1])
            if budget <= 0:
                break
        tok_json = [M.train_tokenizer(texts, M.SHAPES[shape]["vocab_size"]).to_str()]
    if world > 1:
        dist.broadcast_object_list(tok_json, src=0)
    tok = M.Tokenizer.from_str(tok_json[0])
    s = {k: v for k, v in M.SHAPES[shape].items() if k != "vocab_size"}
    model = M.Encoder(M.ModelConfig(vocab_size=tok.get_vocab_size(), **s))
    model.init_weights(torch.Generator().manual_seed(cfg.seed))
    return model, tok


def main(argv=None):
    cfg = M.parse_config(TrainConfig, argv, __doc__.split("\n\n")[0])
    rank, local, world, device = setup_distributed()
    try:
        run(cfg, rank, local, world, device)
    except (TrainError, S.SamplerError, M.ModelError) as e:
        say(rank, f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(cfg, rank, local, world, device):
    if not cfg.data and not cfg.resume:  # the demo
        defaults = TrainConfig()
        cfg = replace(cfg, **{k: v for k, v in DEMO.items() if getattr(cfg, k) == getattr(defaults, k)})
        if rank == 0:
            demo_corpus(cfg.cache_dir)  # written once, by one process
        if world > 1:
            dist.barrier()
        cfg = replace(cfg, data=[str(demo_corpus(cfg.cache_dir))])
        say(rank, f"no --data: the demo, {cfg.model} on Python's own documentation ({cfg.data[0]})")
    cfg = replace(cfg, model=cfg.model or "distilroberta-base", out=cfg.out or "runs/declutr")
    out = Path(cfg.out)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun --max-restarts
    newest = (checkpoints(out) or [None])[-1] if cfg.resume or restarted else None
    if newest:
        state = read_train_state(newest)
        cfg = TrainConfig(**{**state["config"], "resume": True})  # the run goes on exactly as it was configured
    elif cfg.resume and not restarted:
        raise TrainError(f"{out}: no checkpoint to resume from")
    elif out.exists() and any(out.iterdir()):
        if not (cfg.overwrite or restarted):  # a restart before the first checkpoint starts over
            raise TrainError(f"{out} holds an earlier run; pass --resume to continue it or --overwrite to replace it")
        if rank == 0:
            for p in ("checkpoints", "model", "best", "metrics.jsonl"):
                shutil.rmtree(out / p, ignore_errors=True) if (out / p).is_dir() else (out / p).unlink(missing_ok=True)
    if cfg.docs_per_step % world:
        raise TrainError(f"--docs-per-step {cfg.docs_per_step} does not split over {world} ranks")
    if not (cfg.mlm or cfg.contrastive):
        raise TrainError("--no-mlm and --no-contrastive together leave nothing to train")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # free on Ampere and later

    model, tok = build_model(cfg, rank, world, out)
    model.to(device).train()
    if local == 0:  # one process per machine tokenises; the others find its cache
        corpus = S.prepare_corpus(cfg.data, tok, cfg.cache_dir, quiet=rank != 0)
    if world > 1:
        dist.barrier()
    if local != 0:
        corpus = S.prepare_corpus(cfg.data, tok, cfg.cache_dir, quiet=True)
    scfg = S.SamplerConfig(num_anchors=cfg.num_anchors, num_positives=cfg.num_positives, min_span=cfg.min_span,
                           max_span=cfg.max_span, docs_per_step=cfg.docs_per_step // world, seed=cfg.seed,
                           mlm_probability=cfg.mlm_probability, scale_short_docs=cfg.scale_short_docs)
    batches = S.SpanBatches(corpus, tok, scfg, model.config.max_tokens, rank, world, quiet=rank != 0)
    total = cfg.steps or cfg.epochs * batches.steps_per_epoch
    opt = make_optimizer(model, cfg, fused=device.type == "cuda")
    step, best = 0, -1.0
    if newest:
        load_checkpoint(newest, model, opt, state)
        step, best = state["step"], state.get("best", -1.0)
        say(rank, f"resuming at step {step} from {newest}")
        if rank == 0 and (out / "metrics.jsonl").exists():  # forget the steps after the checkpoint: they rerun
            lines = (out / "metrics.jsonl").read_text().splitlines()
            (out / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= step))
    out.mkdir(parents=True, exist_ok=True)
    net = torch.compile(model, dynamic=True) if cfg.compile else model
    evaluate = None
    if cfg.eval_data:
        import evaluate_sts
        pairs = evaluate_sts.load_stsb_dev(cfg.eval_data)
        evaluate = lambda: evaluate_sts.spearman_of(model, tok, pairs)
    say(rank, f"training {cfg.model} on {world} process(es), {device.type}: {total} steps of {cfg.docs_per_step} documents")
    t0, tokens, start, last_good = time.time(), 0, step, newest
    for batch in S.make_loader(batches, step, total, cfg.workers):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        # Dropout draws from the global generator, re-seeded from (seed, rank, step): resuming replays exactly.
        torch.manual_seed(int(np.random.SeedSequence([cfg.seed, rank, step]).generate_state(1)[0]))
        s = train_step(net, batch, cfg, world)
        if not math.isfinite(s["contrastive"] + s["mlm"]):
            raise TrainError(f"loss is {s['contrastive'] + s['mlm']} at step {step + 1}; last good checkpoint: "
                             f"{last_good or 'none yet'}")
        if world > 1:
            average_gradients(model, world)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += s["tokens"] * world
        rec = dict(step=step, contrastive=round(s["contrastive"], 6), mlm=round(s["mlm"], 6),
                   lr=opt.param_groups[0]["lr"], grad_norm=round(float(gnorm), 4), tokens_per_s=round(tokens / (time.time() - t0)))
        if evaluate and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total):
            model.eval()
            rec["stsb_dev_spearman"] = evaluate() if rank == 0 else None
            model.train()
            if rank == 0 and rec["stsb_dev_spearman"] > best:
                best = rec["stsb_dev_spearman"]
                M.save_pretrained(model, tok, out / "best")
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if step % cfg.log_every == 0 or step == total:
                el = time.time() - t0
                print(f"step {step}/{total} | contrastive {s['contrastive']:.4f} | mlm {s['mlm']:.4f} | lr {rec['lr']:.2e} | "
                      f"{rec['tokens_per_s']:,} tok/s | {el:.0f}s elapsed | ETA {el / (step - start) * (total - step):.0f}s"
                      + (f" | STS-B dev {rec['stsb_dev_spearman']:.2f}" if "stsb_dev_spearman" in rec else ""), flush=True)
        if step % cfg.ckpt_every == 0 or step == total:
            if rank == 0:
                last_good = save_checkpoint(out, model, tok, opt, step, cfg, {"best": best})
            if world > 1:
                dist.barrier()
    if rank == 0:
        M.save_pretrained(model, tok, out / "model")
        print(f"done: the model is in {out / 'model'}"
              + (f", the best by STS-B dev ({best:.2f}) in {out / 'best'}" if best >= 0 else ""))
        sts = Path("../shared/data/sts")
        print(f"embed text with it:\n  printf 'A man is playing a guitar.\\nA woman is singing.\\n' | "
              f"python embed.py --model {out / 'model'} - --output embeddings.npy")
        print(f"evaluate it on STS-B dev:\n  python evaluate_sts.py --model {out / 'model'} --split dev"
              + (f" --data {sts}" if sts.is_dir() else "   # downloads the STS Benchmark once"))


if __name__ == "__main__":
    main()
