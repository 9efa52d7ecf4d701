"""What a GPU run meets, proved on a CPU: preparation that outlasts the collectives' timeout, more processes than
GPUs, fp16 with its loss scaler, --compile against eager, the optimizer of the device a run resumes on, one dtype
rule for embed.py and evaluate_sts.py, and the step's host-side plan against the device-side way of finding it."""
import copy as copy_module
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import embed
import evaluate_sts
import model as M
import train as T
from conftest import ROOT, bench_script, from_scratch, step_chunks, synthetic_batch, tiny_encoder
from support import device, processes, runs
from support.chunks import length_groups
from support.cli import UserError
from test_train import assert_same, free_port, run_args, step_grads, torchrun, trace


@pytest.mark.slow
def test_preparation_longer_than_the_collective_timeout_finishes(tmp_path, docs):
    """2 ranks on gloo, --ddp-timeout 3 s, tokenising the corpus takes 5 s more: no collective waits on it."""
    r = subprocess.run(torchrun("--nproc_per_node=2", "--master_port", str(free_port()),
                                str(ROOT / "tests" / "slow_prepare.py"),
                                *run_args(docs, tmp_path / "run", "--steps", "2", "--ddp-timeout", "3")),
                       env={**os.environ, "SLOW_PREPARE_SECONDS": "5", "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s for s, *_ in trace(tmp_path / "run")] == [1, 2]


def test_more_processes_than_gpus_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        T.main(["--data", "whatever"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "error: 4 processes on this machine but 2 GPU(s): start one process per GPU" in err
    assert "--nproc_per_node=2" in err


@pytest.mark.parametrize("rank", ["0", "1"])
def test_out_of_memory_in_a_step_is_one_line_naming_the_way_out(tmp_path, docs, monkeypatch, capsys, rank):
    """torch.OutOfMemoryError from the third step (as a GPU raises it): one line on stderr, from whichever rank met it,
    naming --grad-cache and fewer documents per GPU; exit 1; the checkpoint of step 2 byte for byte as it was."""
    T.main(run_args(docs, tmp_path / "r", "--steps", "2", "--ckpt-every", "2"))
    ckpt = tmp_path / "r" / "checkpoints" / "step-00000002"
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    real_step, calls = T.train_step, []

    def step(*a, **k):
        calls.append(1)
        if len(calls) == 1:  # the first step of the resumed run, step 3
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return real_step(*a, **k)

    monkeypatch.setattr(T, "train_step", step)
    monkeypatch.setenv("RANK", rank)  # what cli reads: a rank other than 0 says this error too
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        T.main(["--out", str(tmp_path / "r"), "--resume", "--steps", "4"])
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert e.value.code == 1 and "Traceback" not in err, err
    assert line.startswith("error: out of memory on cpu in step 3 (4 documents on this rank): pass --grad-cache "
                          "--chunk-tokens 4096") and "fewer documents" in line
    assert line.endswith(f"last checkpoint: {ckpt}")
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    assert runs.checkpoints(tmp_path / "r") == [ckpt]
    assert [s for s, *_ in trace(tmp_path / "r")] == [1, 2]


def test_process_group_set_up_names_the_gpu_by_its_index(monkeypatch):
    """One GPU faked (torch.accelerator and torch.cuda report it; NCCL, which a CPU build lacks, becomes gloo, so that
    torch's own checks of init_process_group's device_id run as on a GPU: a device without an index is refused there).
    train.py's set-up and gpu_check's bind the process group to cuda:0 and give DDP (train.setup's, gpu_check's d) the
    index 0."""
    import dataclasses

    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    real_init, bound, ddp_ids = dist.init_process_group, [], []

    def init(backend, **kw):
        real_init("gloo" if backend == "nccl" else backend, **kw)
        bound.append(dist.distributed_c10d._get_default_group().bound_device_id)

    monkeypatch.setattr(dist, "init_process_group", init)
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    gpu_check = bench_script("gpu_check")
    # train.py's: processes() as under torchrun (here with a store of its own), then the process group and DDP
    def train_set_up():
        proc = dataclasses.replace(processes.processes(), store=dist.HashStore())
        processes.init_process_group(proc, 60)
        return proc

    for set_up in (train_set_up, lambda: gpu_check.one_rank_process_group(gpu_check.device(dry=False))):
        try:
            proc = set_up()
            ddp_ids.append(proc.device_ids)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert bound == [torch.device("cuda", 0)] * 2 and ddp_ids == [[0], [0]]


# --- precision -------------------------------------------------------------------------------------------------


def test_auto_dtype_follows_the_gpu(monkeypatch):
    """bf16 where the GPU has bf16 tensor cores, fp16 (with a loss scaler, in train.py) where it has not, fp32 on a
    CPU; --dtype by hand wins."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for has_bf16, want in ((True, torch.bfloat16), (False, torch.float16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, b=has_bf16: b)
        assert device.autocast_dtype("auto", cuda) == want
    assert device.autocast_dtype("auto", cpu) is None and device.autocast_dtype("fp32", cuda) is None
    assert device.autocast_dtype("fp16", cpu) == torch.float16 and device.autocast_dtype("bf16", cuda) == torch.bfloat16


def test_embed_names_the_gpu_by_its_index_or_says_there_is_none(tmp_path, monkeypatch, capsys):
    """--device cuda is the current GPU with its index; with a torch that sees no GPU it is one line, exit 2."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "t.txt").write_text("a text\n")
    with pytest.raises(SystemExit) as e:
        embed.main(["--model", "whatever", str(tmp_path / "t.txt"), "--output", str(tmp_path / "e.npy"),
                    "--device", "cuda"])
    assert e.value.code == 2 and capsys.readouterr().err == ("error: --device cuda: this torch sees no GPU "
                                                             "(torch.cuda.is_available() is False)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert device.device_and_dtype("cuda", "auto") == (torch.device("cuda", 3), torch.bfloat16)
    assert device.device_and_dtype("auto", "fp32") == (torch.device("cuda", 3), None)
    assert device.device_and_dtype("cuda:1", "auto")[0] == torch.device("cuda", 1)
    for name, why in (("cuda:4", "this machine has 4 GPU(s)"), ("tpu", "not a device this project runs on"),
                      ("bogus", "not a device this project runs on")):
        with pytest.raises(UserError, match=re.escape(f"--device {name}: {why}")) as e:
            device.device_and_dtype(name, "auto")
        assert e.value.code == 2


def test_fp16_step_and_its_loss_scaler_on_a_cpu():
    """fp16 autocast with a GradScaler, on a CPU: the unscaled gradient is close to fp32's; a step whose gradient
    overflowed changes no weight and halves the scale; the next, finite one trains and keeps the scale."""
    batch, cfg = synthetic_batch(4, seed=6), T.TrainConfig(dtype="fp16", chunk_tokens=120)
    fp32 = step_grads(tiny_encoder(), batch, chunk_tokens=120)
    model = tiny_encoder()
    opt = T.make_optimizer(model, cfg.lr, cfg.weight_decay, fused=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    T.train_step(T.ChunkedEncoder(model), batch, cfg, scaler=scaler)
    scaler.unscale_(opt)
    half = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name in ("layers.0.attn.qkv.weight", "layers.1.ffn.up.weight", "embeddings.word.weight", "mlm.dense.weight"):
        rel = (half[name] - fp32[name]).norm() / fp32[name].norm()
        assert rel < 0.05, (name, float(rel))  # fp16 has ~3 significant digits; a wrong scale is off by 1024x
    opt.zero_grad(set_to_none=True)
    scaler.update()  # ends the step above without taking it (as if an overflow check came next)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale = scaler.get_scale()
    T.train_step(T.ChunkedEncoder(model), batch, cfg, scaler=scaler)
    model.layers[0].ffn.up.weight.grad[0, 0] = float("inf")  # a gradient that overflowed in fp16
    T.optimizer_step(opt, scaler, model, cfg.max_grad_norm)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the step was skipped
    assert scaler.get_scale() == scale / 2
    T.train_step(T.ChunkedEncoder(model), batch, cfg, scaler=scaler)
    T.optimizer_step(opt, scaler, model, cfg.max_grad_norm)
    assert not torch.equal(model.layers[0].ffn.up.weight, before["layers.0.ffn.up.weight"])  # this one trained
    assert scaler.get_scale() == scale / 2


def test_fp16_run_keeps_its_scaler_in_the_checkpoint(tmp_path, docs):
    T.main(run_args(docs, tmp_path / "h", "--steps", "3", "--ckpt-every", "3", "--dtype", "fp16"))
    assert all(np.isfinite([c + m for _, c, m in trace(tmp_path / "h")]))
    state = runs.read_train_state(tmp_path / "h" / "checkpoints" / "step-00000003")
    assert state["scaler"]["scale"] > 0 and state["config"]["dtype"] == "fp16"
    T.main(["--out", str(tmp_path / "h"), "--resume", "--steps", "4"])
    assert [s for s, *_ in trace(tmp_path / "h")] == [1, 2, 3, 4]


# --- --compile -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_matches_eager_with_the_mlm_head_in_the_graph():
    """torch.compile (inductor, on the CPU) of each chunk's forward: the same gradient as eager, with no graph break,
    on two batches of different shapes; the MLM head runs inside the compiled graph."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    # spans of 30-36 tokens: one chunk per step, padded and holding anchors, so one graph serves both batches
    batches = [synthetic_batch(n, seed=s, anchor_len=(30, 37), positive_len=(30, 37)) for n, s in ((4, 7), (3, 8))]
    compiled = T.ChunkedEncoder(tiny_encoder(), compile=True)
    for batch in batches:
        eager = step_grads(tiny_encoder(), batch)
        compiled.encoder.zero_grad()
        T.train_step(compiled, batch, T.TrainConfig())
        assert_same({n: p.grad for n, p in compiled.encoder.named_parameters()}, eager)
        assert compiled.encoder.mlm.dense.weight.grad.abs().max() > 0
    assert sum(dynamo.utils.counters["graph_break"].values()) == 0, dict(dynamo.utils.counters["graph_break"])
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1  # dynamic shapes: the second batch recompiles nothing


@pytest.mark.slow
def test_compile_builds_a_bounded_number_of_graphs_over_a_run(tmp_path, docs, monkeypatch, capsys):
    """25 steps of varied spans with --compile, then 25 more with --grad-cache: chunks of one span, chunks without an
    anchor or padding, a single masked token and GradCache's pass without gradients all reuse a graph; two in all,
    never the recompile limit (past which dynamo runs eager, warning once). Dynamo's eager backend keeps this to
    seconds: what is compiled and when is decided above the backend (inductor gives the same counts)."""
    import functools

    import torch._dynamo as dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    dynamo.reset()
    dynamo.utils.counters.clear()
    # One thread for both runs: dynamo guards on torch's thread count, and the default (the cores free at the start)
    # gave the second run another count beside a busy machine, and a third graph
    args = ["--steps", "25", "--compile", "--min-span", "4", "--max-span", "48", "--chunk-tokens", "96",
            "--threads", "1"]
    T.main(run_args(docs, tmp_path / "plain", *args))
    assert device.compiled_graphs() == (1, False)
    T.main(run_args(docs, tmp_path / "gc", *args, "--grad-cache"))
    assert device.compiled_graphs() == (2, False)  # GradCache: the same graph, and one without gradients
    out = capsys.readouterr().out
    assert out.count("--compile: 1 graph(s) compiled\n") == 1 and out.count("--compile: 2 graph(s) compiled\n") == 1
    # and the count would tell: the same chunks given as before (no positions where there is no padding, no targets
    # where there is no anchor) build a graph for each kind
    for old_inputs in (False, True):
        dynamo.reset()
        dynamo.utils.counters.clear()
        compiled = T.ChunkedEncoder(tiny_encoder(), compile=True)
        for seed in range(3):  # padded anchors; positives all of one length, so unpadded and without an anchor
            batch = synthetic_batch(3, seed=seed, anchor_len=(30, 41), positive_len=(3, 4))
            spans = step_chunks(batch, compiled.encoder)
            for chunk in spans.inputs:
                ids, mask, positions, masked_at, targets = chunk
                if old_inputs:
                    positions = None if mask.all() else positions
                    masked_at, targets = (masked_at, targets) if (targets != -100).any() else (None, None)
                compiled.chunk_forward(compiled.encoder, ids, mask, positions, masked_at, targets)
        assert (device.compiled_graphs()[0] > 1) == old_inputs


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--grad-cache", "--chunk-tokens", "64"]], ids=["plain", "grad-cache"])
def test_compile_under_torchrun_gives_eager_ddps_run(tmp_path, docs, extra):
    """--compile inside DistributedDataParallel on 2 ranks (gloo), DDP's buckets small enough that dynamo's
    DDPOptimizer cuts the compiled graph at their edges, as a real model's 25 MB buckets do (tests/compiled_ranks.py,
    aot_eager: dynamo and AOTAutograd as inductor receives them). Over 10 steps of varied spans: one graph, two with
    GradCache (chunks of 2 spans with 2 MLM targets among them, which dynamo's duck sizing once made a graph of their
    own), no graph break, never the recompile limit; the losses and every rank's weights those of eager DDP, bit for
    bit."""
    args = {"eager": run_args(docs, tmp_path / "eager", "--steps", "10", *extra),
            "compiled": run_args(docs, tmp_path / "compiled", "--steps", "10", *extra, "--compile")}
    # one launch, each rank running both (tests/compiled_ranks.py)
    r = subprocess.run(torchrun("--nproc_per_node=2", "--master_port", str(free_port()),
                                str(ROOT / "tests" / "compiled_ranks.py"), *args["eager"], "--then", *args["compiled"]),
                       env={**os.environ, "RANK_WEIGHTS": str(tmp_path / "weights"), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs_ = {kind: (trace(tmp_path / kind), [torch.load(tmp_path / "weights" / kind / f"rank{k}.pt",
                                                        weights_only=True) for k in (0, 1)]) for kind in args}
    (eager_trace, eager), (trace_, ranks) = runs_["eager"], runs_["compiled"]
    assert trace_ == eager_trace
    for rank, ref in zip(ranks, eager, strict=True):
        assert all(torch.equal(rank["weights"][n], w) for n, w in ref["weights"].items())
        assert rank["graphs"] == (2 if extra else 1) and not rank["gave_up"] and rank["graph_breaks"] == 0, rank
        assert rank["splits"] and min(rank["splits"]) > 1  # DDPOptimizer did cut the graph: the case under test
        assert rank["optimize_ddp"] == "True"  # torch's default, which train.py keeps


def test_compile_on_a_torch_that_recompiles_every_chunk_is_one_line(monkeypatch, capsys):
    """torch 2.4's guards fail on every call of the compiled chunk (a graph a chunk, 56 in 10 steps, measured under
    2.4.1): --compile there is refused before anything runs, with one line; 2.5 and later are let through."""
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    with pytest.raises(SystemExit) as e:
        T.main(["--data", "whatever", "--compile"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: --compile needs torch >= 2.5 (this is 2.4.1+cu121, whose compiler builds a graph for every chunk); "
        "leave --compile out, or upgrade torch\n")
    for version in ("2.5.1", "2.11.0+cu130", "2.13.0+cpu"):
        monkeypatch.setattr(torch, "__version__", version)
        device.check_compile()


def cuda_alignment_backend(gm, example_inputs):
    """A dynamo backend that installs the one guard inductor adds on CUDA for the attention mask
    (torch/_inductor/lowering.py, sdpa_constraint's is_aligned: guard_or_false(Eq(Mod(size(-1), 8), 0))), then runs
    the graph as it is: what inductor's CUDA lowering decides about graphs, seen on a CPU."""
    import sympy

    shape_env = torch._guards.TracingContext.try_get().fake_mode.shape_env
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() == 2:  # ids and mask (g, T)
            width = value.shape[-1]
            if isinstance(width, torch.SymInt):
                shape_env.evaluate_expr(sympy.Eq(sympy.Mod(width.node.expr, 8), 0), fallback_value=False)
    return gm.forward


@pytest.mark.slow
def test_chunks_a_multiple_of_8_wide_keep_one_graph_under_cudas_guard_and_change_no_gradient(monkeypatch):
    """On a GPU every chunk is padded to a multiple of 8 tokens. Chunks of widths as they come build two graphs
    under inductor's CUDA guard on the mask's width modulo 8; at multiples of 8, one. The padding changes no
    gradient (it is masked out of attention and skipped by the token-wise layers)."""
    import functools

    import torch._dynamo as dynamo

    batches = [synthetic_batch(3, seed=seed, anchor_len=(30, 41), positive_len=(3, 20)) for seed in range(4)]
    for batch in batches[:2]:
        plain = step_grads(tiny_encoder(), batch)
        monkeypatch.setattr(T.Chunks.__init__, "__defaults__", (8,))  # Chunks(..., multiple=8), as on a GPU
        assert step_chunks(batch, tiny_encoder()).inputs[0][0].shape[1] % 8 == 0
        assert_same(step_grads(tiny_encoder(), batch), plain, atol=1e-6)
        monkeypatch.undo()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=cuda_alignment_backend))
    graphs = {}
    for multiple in (1, 8):
        dynamo.reset()
        dynamo.utils.counters.clear()
        compiled = T.ChunkedEncoder(tiny_encoder(), compile=True)
        widths = set()
        for batch in batches:
            spans = step_chunks(batch, compiled.encoder, multiple=multiple)
            for chunk in spans.inputs:
                widths.add(chunk.ids.shape[1] % 8)
                compiled([chunk])
        graphs[multiple] = device.compiled_graphs()[0]
        assert (len(widths) > 1) == (multiple == 1)  # both kinds of width occur, unless padded
    assert graphs == {1: 2, 8: 1}


# --- resuming on another device ----------------------------------------------------------------------------------


@pytest.mark.parametrize("saved_fused, here_fused", [(True, False), (False, True)])
def test_resume_runs_the_adamw_of_its_device(saved_fused, here_fused):
    """A run started on a CPU and resumed on a GPU steps with fused AdamW there, and the other way round: the stored
    `fused` flag does not come back with the state (fused AdamW runs on CPUs too, so both ways are tried here)."""
    cfg, batch = T.TrainConfig(), synthetic_batch(4, seed=9)
    model = tiny_encoder()
    saved = T.make_optimizer(model, cfg.lr, cfg.weight_decay, fused=saved_fused)
    step_grads(model, batch)
    saved.step()
    state = copy_module.deepcopy(saved.state_dict())  # as it comes back from train_state.pt: not shared with `saved`
    copy = tiny_encoder()
    copy.load_state_dict(model.state_dict())
    here = T.make_optimizer(copy, cfg.lr, cfg.weight_decay, fused=here_fused)
    runs.load_optimizer(here, state)
    assert all(bool(g["fused"]) == here_fused for g in here.param_groups)
    for opt, m in ((saved, model), (here, copy)):  # and the next step is the same with either
        step_grads(m, batch)
        opt.step()
    for (n, a), b in zip(model.state_dict().items(), copy.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


# --- the attention kernel, rows per batch, and the loop's one read a step -------------------------------------


def test_every_forward_runs_in_the_attention_kernels_chosen_for_it(monkeypatch):
    """torch's dispatcher picks cuDNN's attention first on some torch versions and GPUs (docs/gpu.md): every forward
    (a training step, GradCache's two passes, embed.encode, evaluate's scoring) runs with cuDNN's kernel left out and
    flash, memory-efficient and math allowed, read inside scaled_dot_product_attention itself; the flags are as they
    were afterwards. A CPU has only flash and math, so it keeps its choice: the same bits as the dispatcher's. (The
    models here are model.py's own, not swapped: every row goes to the kernels, as on a GPU.)"""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention
    flags = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)

    def spy(*args, **kwargs):
        seen.append(tuple(f() for f in flags))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    enc, batch = tiny_encoder(), synthetic_batch(3, seed=5)
    texts = ["a man plays a guitar", "a woman sings", "", "the cat " * 30]
    model, tok = from_scratch("tiny", [" ".join(texts)] * 20)
    for name, run in {"train_step": lambda: step_grads(enc, batch),
                      "grad cache": lambda: step_grads(enc, batch, grad_cache=True, chunk_tokens=60),
                      "embed": lambda: embed.encode(texts, model, tok),
                      "evaluate": lambda: evaluate_sts.spearman_of(model, tok, (texts[:2], texts[2:], [1.0, 2.0]))
                      }.items():
        seen.clear()
        run()
        assert seen and set(seen) == {(False, True, True, True)}, name  # cuDNN's off; the others on
        assert all(f() for f in flags)  # and back on after
    x = torch.tensor([[0, 5, 6, 7, 2], [0, 8, 2, 1, 1]])
    mask = (x != 1).long()
    model.eval()
    for dtype in (None, torch.bfloat16):  # a CPU's kernels are the dispatcher's own: bit for bit
        with torch.no_grad(), device.compute(dtype, torch.device("cpu")):
            chosen = model(x, mask)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            default = model(x, mask)
        assert torch.equal(chosen, default)


@pytest.mark.slow
def test_a_batch_holds_at_most_max_rows_whatever_the_token_budget(monkeypatch):
    """70,000 empty lines (2 tokens each) with --batch-tokens 131072 would be batches of 65,536 rows, past the 65,535
    blocks a GPU's fused attention kernels can put on a grid dimension: each batch holds at most MAX_ROWS rows, every
    text is embedded once, as it is alone."""
    assert embed.MAX_ROWS <= 65535
    model, tok = from_scratch("tiny", ["alpha beta gamma"] * 20)
    rows, real = [], model.forward

    def forward(ids, *args, **kwargs):
        rows.append(ids.shape[0])
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    texts = [""] * 70_000
    out = embed.encode(texts, model, tok, batch_tokens=131072)
    assert max(rows) == embed.MAX_ROWS and sum(rows) == len(texts) == len(out)
    alone = embed.encode([""], model, tok)
    np.testing.assert_allclose(out, np.repeat(alone, len(texts), axis=0), atol=1e-6)


def test_the_loop_reads_each_steps_numbers_after_launching_the_next(tmp_path, docs, monkeypatch):
    """On a GPU reading a step's losses waits for the GPU: the loop reads step k's once step k+1 is launched, except
    where evaluation, a checkpoint or the last step needs step k's weights at once. What metrics.jsonl says of step k
    is step k's own (each step's losses set here to its number)."""
    from support import metrics

    events, real_step, real_read = [], T.train_step, metrics.Figures.read

    def train_step(*args, **kwargs):
        events.append(("launch", sum(kind == "launch" for kind, _ in events) + 1))
        stats = real_step(*args, **kwargs)
        n = float(events[-1][1])
        return {**stats, "contrastive": torch.tensor(n), "mlm": torch.tensor(10 * n)}

    def read(self):
        events.append(("read", self.step))
        return real_read(self)

    monkeypatch.setattr(T, "train_step", train_step)
    monkeypatch.setattr(metrics.Figures, "read", read)
    T.main(run_args(docs, tmp_path / "r", "--steps", "7", "--ckpt-every", "3"))
    launch, read_ = ("launch",), ("read",)
    want = [(*launch, 1), (*launch, 2), (*read_, 1), (*launch, 3), (*read_, 2), (*read_, 3),  # 3: a checkpoint
            (*launch, 4), (*launch, 5), (*read_, 4), (*launch, 6), (*read_, 5), (*read_, 6), (*launch, 7), (*read_, 7)]
    assert events == want
    assert trace(tmp_path / "r") == [(k, float(k), 10.0 * k) for k in range(1, 8)]


# --- embed.py and evaluate_sts.py --------------------------------------------------------------------------------


def test_evaluate_scores_the_embeddings_embed_writes(tmp_path):
    """One --device/--dtype rule for both scripts, and the score evaluate_sts.py prints is the Spearman of the cosines
    of the embeddings embed.py writes with its defaults (worked out here from the .npy by hand)."""
    assert evaluate_sts.device_and_dtype is device.device_and_dtype
    assert embed.EmbedConfig().dtype == evaluate_sts.EvalConfig().dtype == "auto"
    assert embed.EmbedConfig().device == evaluate_sts.EvalConfig().device == "auto"
    texts = ["a man plays a guitar", "a woman sings a song", "the cat sat on the mat", "a dog runs in the park"]
    M.save_pretrained(*from_scratch("tiny", [" ".join(texts)] * 30), tmp_path / "m")
    pairs = [(0, 1, 3.0), (2, 3, 2.5), (0, 2, 0.5), (1, 3, 1.0), (0, 3, 2.0), (1, 2, 4.0)]
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text(
        "".join(f"g\tf\t2012\t{k}\t{g}\t{texts[i]}\t{texts[j]}\n" for k, (i, j, g) in enumerate(pairs)))
    (tmp_path / "t.txt").write_text("\n".join(texts) + "\n")
    embed.main(["--model", str(tmp_path / "m"), str(tmp_path / "t.txt"), "--output", str(tmp_path / "e.npy")])
    e = np.load(tmp_path / "e.npy")
    cos = [e[i] @ e[j] / np.linalg.norm(e[i]) / np.linalg.norm(e[j]) for i, j, _ in pairs]
    ranks = [np.argsort(np.argsort(x)) for x in (cos, [g for *_, g in pairs])]  # no ties here
    want = 100 * np.corrcoef(*ranks)[0, 1]
    evaluate_sts.main(["--model", str(tmp_path / "m"), "--data", str(tmp_path / "sts"), "--split", "dev",
                       "--json", str(tmp_path / "r.json")])
    assert abs(json.loads((tmp_path / "r.json").read_text())["STSB"]["spearman"] - want) < 1e-6


# --- the step's plan, worked out on the host --------------------------------------------------------------------


def test_the_host_side_plan_matches_the_device_side_way():
    """Each chunk's non-pad positions and MLM targets, worked out on the host from the lengths, equal what
    nonzero() over the mask and the labels would find on the device; on a GPU the chunks follow the budget alone."""
    batch, cfg = synthetic_batch(6, seed=11), T.TrainConfig(chunk_tokens=200)
    spans = step_chunks(batch, tiny_encoder(), cfg)
    assert sum(len(g) for g in spans.rows) == len(spans.lengths) > len(spans.rows) > 1
    width = max(batch["anchors"].shape[1], batch["positives"].shape[1])
    rows = torch.cat([torch.nn.functional.pad(batch[k], (0, width - batch[k].shape[1]), value=1)
                      for k in ("mlm_inputs", "positives")])  # every span padded to the longest (pad id 1)
    labels = torch.cat([batch["mlm_labels"], torch.full((len(batch["positives"]), batch["mlm_labels"].shape[1]), -100)])
    for group, (ids, mask, positions, masked_at, masked_ids) in zip(spans.rows, spans.inputs, strict=True):
        T_k = ids.shape[1]
        assert torch.equal(positions, mask.flatten().nonzero().squeeze(1))  # given even where there is no padding
        assert torch.equal(ids, rows[group, :T_k])  # its spans, anchors MLM-corrupted
        chunk_labels = torch.nn.functional.pad(labels, (0, max(0, T_k - labels.shape[1])), value=-100)[group, :T_k]
        picked = (chunk_labels != -100).flatten().nonzero().squeeze(1)
        kept = masked_ids != -100  # at least two targets a chunk, the added ones ignored (one graph under --compile)
        assert len(masked_at) == max(2, len(picked)) and int(kept.sum()) == len(picked)
        assert torch.equal(masked_at[kept], picked) and torch.equal(masked_ids[kept], chunk_labels.flatten()[picked])
    assert spans.n_masked == int((batch["mlm_labels"] != -100).sum())
    assert float(T.mlm_mean_weight(spans.n_masked, 1, spans.device)) == pytest.approx(1 / spans.n_masked)
    # a GPU's rule: one chunk per budget, whatever the spread of lengths (a CPU's cuts at 0.8 of the longest too)
    gpu = length_groups(spans.lengths, 200, spread=0.0)
    assert len(gpu) < len(spans.rows)
    assert all(len(g) * spans.lengths[g].max() <= 200 < (len(g) + 1) * spans.lengths[g].max() for g in gpu[:-1])


def sections_not_passed(summary: dict) -> dict:
    """The sections of a gpu_check summary that neither passed nor were skipped (FAIL, failed: ..., cut short, not
    run): the check is judged by these, not by its exit code, which is 0 whatever a section did."""
    return {k: v for k, v in summary.items() if k != "seconds" and v != "pass" and not v.startswith("skipped")}


@pytest.mark.slow
def test_the_gpu_check_runs_dry_on_a_cpu(tmp_path):
    """bash bench/gpu_check.sh --dry-run, as the lent GPU machine runs it ($OUT set): every section passes, or is
    skipped as GPU-only, by the JSON summary it leaves under $OUT (about two minutes on 2 cores: docs/gpu.md)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # its python3: the tests' own
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=1600, env={**os.environ, "OUT": str(tmp_path), "PATH": path})
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(res["summary"]) == set("abcdefghijk") | {"seconds"}
    assert sections_not_passed(res["summary"]) == {}, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, r.stderr[-2000:]
    assert res["h"]["status"].startswith("skipped") and res["setup"]["compile_backend"] == "aot_eager"
    # what a reader of a GPU's results looks for: i's figures for each attention path, j's against sentence-transformers
    assert set(res["i"]["tokens_per_s"]) == set(res["i"]["mfu"]) == {"padded", "packed", "varlen"}
    assert res["i"]["tokens_per_s"]["packed"] > 0 and res["i"]["tokens_per_s"]["varlen"] == "n/a (CUDA only)"
    assert res["j"]["ratio_vs_sentence_transformers"] > 0 and res["j"]["min_cosine"] >= 0.999
    assert res["e"]["tokens_per_s"] > 0 and res["e"]["timed_steps"] >= 3
    assert res["a"]["train_step_worst_relative_grad_diff"] == 0 and res["a"]["bf16_ok"]
    assert res["d"]["ddp_grad_cache_worst_relative_grad_diff"] < 1e-5 and res["d"]["gather_grad_vs_hand_worked"] < 1e-6
    assert any("scaled_dot_product" in k for k in res["f"]["attention_kernels"])
    assert "section  result" in (tmp_path / "gpu_check.log").read_text()  # the summary as a table too, in the log
    assert sections_not_passed({"a": "pass", "c": "failed: AttributeError: module 'train' has no attribute "
                                "'compiled_graphs'", "h": "skipped: CUDA only", "g": "cut short", "seconds": 9}) == {
        "c": "failed: AttributeError: module 'train' has no attribute 'compiled_graphs'", "g": "cut short"}


@pytest.mark.slow
def test_the_gpu_check_writes_its_summary_whatever_a_section_does(tmp_path, monkeypatch):
    """A section that leaves through SystemExit (train.main's way with a UserError), one past its time limit, one
    whose result is wrong and one right: each is reported, the next runs, the summary says which is which. And the
    sections' limits add up to less than the one gpu_check.sh gives the whole run."""
    import time as time_module

    gpu_check = bench_script("gpu_check")
    limit = int(next(line for line in (ROOT / "bench" / "gpu_check.sh").read_text().splitlines()
                     if line.startswith("limit=")).split("=")[1])
    # and the whole check fits a 15-minute lease with a start (up to 2 minutes) and a rerun of one section (docs/gpu.md)
    assert gpu_check.SETUP_LIMIT + sum(seconds for _, seconds in gpu_check.SECTIONS.values()) < limit <= 9 * 60

    def exits(check):
        """(a) exits"""
        raise SystemExit(2)

    def slow(check):
        """(b) slow"""
        time_module.sleep(3)

    def wrong(check):
        """(c) wrong"""
        check.record("c", passed=False)

    def right(check):
        """(d) right"""
        check.record("d", passed=True)

    def swallows(check):
        """(e) past its limit inside code that catches Exception, as torch's compiler does"""
        try:
            time_module.sleep(3)
        except Exception:
            pass
        check.record("e", passed=True)

    def sigterm_in_train_main(check):
        """(f) train.main met the shell's SIGTERM: its handler made it SystemExit(143)"""
        raise SystemExit(143)

    monkeypatch.setattr(gpu_check, "SECTIONS", {"a": (exits, 5), "b": (slow, 1), "c": (wrong, 5), "d": (right, 5),
                                                "e": (swallows, 1), "f": (sigterm_in_train_main, 5),
                                                "g": (right, 5)})  # g: never reached, after f's SIGTERM
    check = object.__new__(gpu_check.Check)
    check.out, check.results, check.dev = tmp_path / "r.json", {}, torch.device("cpu")
    for key in "abcde":
        gpu_check.run_section(check, key, scale=1)
    with pytest.raises(gpu_check.Terminated):  # the check ends there, as on its own SIGTERM
        gpu_check.run_section(check, "f", scale=1)
    gpu_check.summarise(check, "abcdefg", time_module.time())
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["a"] == "failed: SystemExit: 2" and summary["b"].startswith("failed: TimeLimit")
    assert summary["e"].startswith("failed: TimeLimit")  # the limit was not swallowed
    assert (summary["c"], summary["d"], summary["f"], summary["g"]) == ("FAIL", "pass", "cut short", "not run")


def test_the_gpu_checks_ddp_section_compares_like_with_like(monkeypatch):
    """Section d's reference step and its DDP step run in the same precision (fp32, TF32 off) over the same chunk
    budget, GradCache against GradCache: bf16 or other chunks differ by more than its 1e-4 on a correct GPU. Read
    from train_step's own calls."""
    gpu_check = bench_script("gpu_check")
    check = object.__new__(gpu_check.Check)
    check.out, check.results, check.dev = None, {}, torch.device("cpu")
    check.shape, check.vocab = "tiny", 300
    check.cfg = T.TrainConfig(docs_per_step=4, min_span=3, max_span=40)
    check.batches = {6: synthetic_batch(4, seed=6)}
    monkeypatch.setattr(gpu_check.Check, "record", lambda self, section, **values: self.results.setdefault(
        section, {}).update(values))
    calls, real = [], T.train_step

    def recorded(model, batch, cfg, world=1, scaler=T.NO_SCALING):
        calls.append((type(model).__name__, (cfg.dtype, cfg.chunk_tokens, cfg.grad_cache),
                      torch.backends.cuda.matmul.allow_tf32))
        return real(model, batch, cfg, world, scaler)

    monkeypatch.setattr(T, "train_step", recorded)
    gpu_check.ddp(check)
    bare = [how for kind, how, _ in calls if kind == "ChunkedEncoder"]
    ddp = [how for kind, how, _ in calls if kind == "DistributedDataParallel"]
    assert len(ddp) == 2 and sorted(bare) == sorted(ddp)  # each DDP step has a bare twin, plain and GradCache
    assert {dtype for dtype, _, _ in bare + ddp} == {"fp32"} and not any(tf32 for _, _, tf32 in calls)
    assert check.results["d"]["passed"]


def test_the_gpu_checks_results_go_under_out_where_it_is_set(monkeypatch, tmp_path):
    """On the lent GPU machine only $OUT comes back: the JSON goes there by default, and gpu_check.sh tees the log
    there and runs python3 (the machine's image has no `python`)."""
    gpu_check = bench_script("gpu_check")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.arguments([]).json == str(tmp_path / "gpu_check.json")
    monkeypatch.delenv("OUT")
    assert gpu_check.arguments([]).json == str(ROOT / "runs" / "gpu_check.json")
    shell = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert 'tee -a "$OUT/gpu_check.log"' in shell and "command -v python3" in shell


@pytest.mark.slow
def test_a_rerun_of_some_sections_keeps_the_others_and_an_unwritable_out_is_one_line(tmp_path, monkeypatch):
    """`--sections ij` after a whole run (the documented way to rerun some) keeps a-h's results in the JSON and the
    summary, its own replacing i and j's; the log is appended to; the check's scratch folder is gone after it. $OUT,
    or --json, under a folder that cannot be made (a read-only file system) is one line, exit 1, no traceback."""
    gpu_check = bench_script("gpu_check")
    out = tmp_path / "gpu_check.json"
    before = {k: {"status": "ok", "passed": True, "seconds": 1} for k in gpu_check.SECTIONS} | {"summary": {"a": "x"}}
    before["i"] = {"status": "ok", "passed": False, "seconds": 1}
    out.write_text(json.dumps(before))

    class Light(gpu_check.Check):
        def __init__(self, dry, path):  # none of the real set-up: the sections below need none
            self.dry, self.out, self.results, self.dev, self.shape = dry, path, {}, torch.device("cpu"), "tiny"
            self.tmp = tmp_path / "scratch"
            (self.tmp / "docs").mkdir(parents=True)

    def passes(key):
        def section(check):
            """(x) a section that passes"""
            check.record(key, passed=True)
        return section

    monkeypatch.setattr(gpu_check, "Check", Light)
    monkeypatch.setattr(gpu_check, "SECTIONS", {k: (passes(k), 5) for k in gpu_check.SECTIONS})
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--sections", "ij", "--json", str(out)])
    gpu_check.main()
    assert not (tmp_path / "scratch").exists()
    after = json.loads(out.read_text())
    assert {k: after[k] for k in "abcdefgh"} == {k: before[k] for k in "abcdefgh"}
    assert after["summary"] | {"seconds": 0} == {k: "pass" for k in gpu_check.SECTIONS} | {"seconds": 0}

    def wrong(check):
        """(j) a section whose result is wrong"""
        check.record("j", passed=False)

    def skipped(check):
        """(h) a section this machine cannot run"""
        raise gpu_check.Skipped("CUDA only")

    for sections, says in (("ij", "error: 1 of 2 section(s) did not pass: j FAIL"),  # and the exit code says so
                           ("h", "error: every section was skipped (h): nothing was measured")):
        monkeypatch.setitem(gpu_check.SECTIONS, "j", (wrong, 5))
        monkeypatch.setitem(gpu_check.SECTIONS, "h", (skipped, 5))
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--sections", sections, "--json", str(out)])
        with pytest.raises(SystemExit) as e:
            gpu_check.main()
        assert e.value.code == says
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # its python3: the tests' own
    for out_dir, args in (("/proc/no/such", []), (str(tmp_path), ["--json", "/proc/no/such/r.json"])):
        done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", *args], capture_output=True,
                              text=True, env={**os.environ, "OUT": out_dir, "PATH": path}, timeout=120)
        lines = (done.stdout + done.stderr).strip().splitlines()
        assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, lines
        assert lines[-1].startswith(("error: OUT=/proc/no/such: cannot make", "error: --json /proc/no/such/r.json: "
                                     "cannot make")), lines


def test_the_gpu_checks_peak_is_the_gpus_own_and_its_steps_are_timed_without_host_copies(monkeypatch):
    """MFU divides by the named GPU's own dense bf16 peak (an H200 NVL is not an H200, nor an H100 PCIe an H100 SXM),
    GPU_PEAK_FLOPS for one the table lacks; a section's step time covers train_step alone, the gradients' copy to the
    host after it."""
    gpu_check = bench_script("gpu_check")
    check = object.__new__(gpu_check.Check)
    check.dev = torch.device("cuda", 0)
    monkeypatch.setenv("GPU_PEAK_FLOPS", "1e14")
    for name, peak in (("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA RTX 6000 Ada Generation", 1e14)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert check.peak_flops() == peak, name
    check.dev, check.cfg = torch.device("cpu"), T.TrainConfig(chunk_tokens=120)
    inside, real = [], T.train_step
    copies = []
    monkeypatch.setattr(T, "train_step", lambda *a, **k: inside.append(1) or real(*a, **k))
    monkeypatch.setattr(gpu_check, "grads", lambda enc: copies.append(len(timer.spans)) or {})
    timer = gpu_check.Timer(check.dev)
    gpu_check.step(check, tiny_encoder(), synthetic_batch(3, seed=2), timer)
    assert inside == [1] and len(timer.spans) == 1 and copies == [1]  # the copy came after the timed span had closed


@pytest.mark.slow
def test_gpu_assets_carry_what_the_check_reads_within_what_travels(tmp_path):
    """bench/gpu_assets.py: ../shared's model (in fp16, 45 MB), 16 books, STS-B dev and train, as ../shared lays them
    out, with the repository under the 64 MiB the GPU machine takes; the check's scored model is the fp32 MiniLM
    again, its weights within fp16's rounding of the original; an --out that exists is refused, untouched."""
    import safetensors.torch

    from conftest import SHARED, need

    gpu_assets, gpu_check = bench_script("gpu_assets"), bench_script("gpu_check")
    shared = SHARED
    for path in gpu_assets.FILES.values():
        need(shared / path)
    size = gpu_assets.pack(shared, tmp_path / "a")
    tracked = sum((ROOT / f).stat().st_size for f in subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split() if (ROOT / f).is_file())
    assert size + tracked < 64 * 2**20
    assert len(list((tmp_path / "a" / "data" / "corpus" / "gutenberg").glob("*.txt"))) == gpu_assets.BOOKS
    assert all((tmp_path / "a" / path).exists() for path in gpu_assets.FILES.values())
    check = object.__new__(gpu_check.Check)
    check.scored, check.tmp, check.dry = None, tmp_path / "check", False  # as on the GPU machine
    check.tmp.mkdir()
    gpu_check.SHARED = tmp_path / "a"
    folder, (a, b, gold), what = gpu_check.scored_model(check)
    assert what == "all-MiniLM-L6-v2 on STS-B dev" and len(gold) == 1500
    got, want = (safetensors.torch.load_file(f / "model.safetensors")
                 for f in (folder, shared / gpu_assets.FILES["model"]))
    assert got.keys() == want.keys() and all(got[k].dtype == want[k].dtype for k in want)
    assert all(torch.allclose(got[k], want[k], rtol=1e-3, atol=1e-4) for k in want)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.txt").write_text("kept")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_assets.py"), "--out", str(tmp_path / "b"),
                        "--shared", str(shared)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().endswith("exists; remove it or name another --out")
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["mine.txt"]


@pytest.mark.slow
def test_the_gpu_check_writes_its_summary_when_terminated(tmp_path):
    """gpu_check.sh's timeout sends SIGTERM: the section under way stops and is reported cut short (its start is
    recorded before its header is printed), the ones after it are not run, and the summary is written all the same
    (JSON and table); exit 143."""
    import signal

    p = subprocess.Popen([sys.executable, "-u", str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--sections", "dgf",
                          "--json", str(tmp_path / "r.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines = []
    for line in p.stdout:  # section g takes tens of seconds on a CPU: terminated as it starts
        lines.append(line)
        if line.startswith("(g)"):
            p.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + p.communicate(timeout=120)[0]
    assert p.returncode == 143, out[-3000:]
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert [summary[k] for k in "dgf"] == ["pass", "cut short", "not run"] and "section  result" in out, summary
