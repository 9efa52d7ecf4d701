"""embed.py against sentence-transformers on the same model and texts, a naive loop, and bad input."""
import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import embed as E
import model as M
from conftest import ROOT, WORDS, from_scratch, minilm, oracle, run_here, stsb_sentences
from support import cpu_layers, embedding, threads
from support.device import device_and_dtype
from support.threads import across_cores, cpu_threads


def naive(texts, model, tok):
    """One text at a time, no padding, no sorting: the definition of a mean-pooled embedding."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tok.encode(t).ids
            ids = ids if len(ids) <= model.config.max_tokens else ids[:model.config.max_tokens - 1] + ids[-1:]
            x = torch.tensor([ids])
            out.append(model(x, torch.ones_like(x)).mean(1)[0].numpy())
    return np.array(out)


def test_encode_equals_one_at_a_time_in_input_order():
    model, tok = from_scratch("tiny", ["alpha beta gamma delta"] * 30)
    model.eval()
    texts = ["alpha", "", "beta gamma " * 40, "delta alpha beta", "gamma " * 700, "alpha"]
    emb = E.encode(texts, model, tok, batch_tokens=64)
    np.testing.assert_allclose(emb, naive(texts, model, tok), atol=1e-5)
    unit = E.encode(texts, model, tok, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1, atol=1e-6)


def test_encode_turns_dropout_off_and_gives_the_mode_back():
    """A model left in training mode (dropout 0.1, as a scratch or just-trained one is) embeds as the naive loop
    does in eval mode, the same each call, and is in training mode again afterwards."""
    model, tok = from_scratch("tiny", ["alpha beta gamma delta"] * 30)
    texts = ["alpha beta", "gamma delta alpha", "delta " * 20]
    model.train()
    emb = E.encode(texts, model, tok)
    assert model.training
    np.testing.assert_allclose(emb, naive(texts, model.eval(), tok), atol=1e-5)


def test_long_chunk_is_the_mean_of_overlapping_windows():
    model, tok = from_scratch("tiny", ["one two three four five six"] * 30, max_position_embeddings=22)
    model.eval()
    text = " ".join(["one two three four five six"] * 6)  # ~36 tokens; the model takes 20 with <s> and </s>
    ids = tok.encode(text).ids
    body, w = ids[1:-1], 18
    starts = list(range(0, len(body) - w, w // 2)) + [len(body) - w]
    assert len(starts) >= 3 and starts[-1] + w == len(body)
    with torch.no_grad():
        want = np.mean([model(torch.tensor([[ids[0]] + body[s:s + w] + [ids[-1]]]),
                              torch.ones(1, w + 2, dtype=torch.long)).mean(1)[0].numpy() for s in starts], axis=0)
    got = E.encode([text, "one"], model, tok, long="chunk")
    np.testing.assert_allclose(got[0], want, atol=1e-5)
    trunc = E.encode([text], model, tok, long="truncate")
    assert np.abs(trunc[0] - want).max() > 1e-3


@pytest.mark.slow
def test_cli_matches_sentence_transformers(tmp_path):
    model = minilm()
    st = oracle("sentence_transformers")
    texts = stsb_sentences(400)
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    r = subprocess.run([sys.executable, str(ROOT / "embed.py"), "--model", str(model), str(tmp_path / "in.txt"),
                        "--output", str(tmp_path / "out.npy"), "--dtype", "fp32"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    emb = np.load(tmp_path / "out.npy")
    ref = st.SentenceTransformer(str(model), device="cpu").encode(texts)
    assert emb.dtype == np.float32 and emb.shape == ref.shape
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999


def test_auto_dtype_on_a_cpu_is_what_the_processor_multiplies(monkeypatch, capsys):
    """--dtype auto on a CPU (embed.py, evaluate_sts.py): bf16 where torch reports AMX or AVX512-BF16, fp32
    elsewhere (both faked here); training's auto stays fp32 on any CPU. bf16 by hand on a CPU with neither runs, with
    one line saying it is emulated; fp16 is a GPU's."""
    from support import device
    from support.cli import UserError

    cpu = torch.device("cpu")
    # the faked processor decides, not a cap the suite runs under
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for amx, avx512_bf16, want in ((True, True, torch.bfloat16), (True, False, torch.bfloat16),
                                   (False, True, torch.bfloat16), (False, False, None)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert device_and_dtype("cpu", "auto") == (cpu, want)
        assert device_and_dtype("cpu", "fp32") == (cpu, None)
        assert device.autocast_dtype("auto", cpu) is None  # train.py's
    assert capsys.readouterr().err == ""
    assert device_and_dtype("cpu", "bf16") == (cpu, torch.bfloat16)  # by hand, without the hardware
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: --dtype bf16: this CPU has neither AMX nor AVX512-BF16")
    assert "emulated, about 400x slower than fp32" in err
    with pytest.raises(UserError, match="--dtype fp16 is for GPUs"):
        device_and_dtype("cpu", "fp16")


def test_bf16_rows_are_fp32_and_near_the_naive_fp32_ones(tiny):
    """bf16 on any CPU (emulated where it lacks the hardware: a tiny model keeps it quick): float32 rows whose cosine
    to the one-at-a-time fp32 loop is at least 0.9999, the long and short texts of one call batched together."""
    model, tok = M.load_pretrained(str(tiny))
    texts = ["the cat sat", "a dog barked at the moon " * 9, "", "the mat " * 30, "moon"] * 3
    emb = E.encode(texts, model, tok, dtype=torch.bfloat16, batch_tokens=256)
    ref = naive(texts, model, tok)
    assert emb.dtype == np.float32 and emb.shape == ref.shape
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos.min()


@pytest.mark.slow
def test_bf16_casts_each_weight_once_a_call_not_once_a_batch(tiny):
    """Autocast keeps one bf16 copy of each weight for all of a call's batches; under inference_mode it would cast
    every weight again for every batch (its cache skips such calls): the casts of the up-projections' weights,
    counted by torch.profiler over a call of many batches, one after another as on a GPU, are one per layer. With
    oneDNN's layers swapped in (support/cpu_layers.py), on two threads at once: no weight cast or laid out during the
    call (once, at the swap), the GELU inside the product (no aten::gelu), four products a layer a batch."""
    model, tok = M.load_pretrained(str(tiny))
    c = model.config
    texts = [f"the cat sat on mat {i} " * (1 + i % 7) for i in range(60)]

    def ops(model, **kw):
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the workers' too
        with torch.profiler.profile(record_shapes=True, experimental_config=every_thread) as prof:
            E.encode(texts, model, tok, dtype=torch.bfloat16, batch_tokens=128)
        return {e.key: e.count for e in prof.key_averages(**kw) if not kw or e.input_shapes[:1] == [
            [c.intermediate_size, c.hidden_size]]}

    with cpu_threads(1):  # one batch after another, model.py's own layers
        assert ops(model)["aten::gelu"] == (batches := ops(model)["aten::gelu"] // c.num_hidden_layers) * \
            c.num_hidden_layers and batches >= 5
        assert ops(model, group_by_input_shape=True)["aten::_to_copy"] == c.num_hidden_layers
    swapped = cpu_layers.swap_in(copy.deepcopy(model), torch.bfloat16)
    if not cpu_layers.runs_bf16():  # an AVX2-only processor: nothing swapped, and nothing more to count
        assert not cpu_layers.swapped(swapped)
        return
    with cpu_threads(2):
        packed = ops(swapped)
    assert packed["mkldnn::_linear_pointwise"] == 4 * c.num_hidden_layers * batches
    assert "mkldnn::_reorder_linear_weight" not in packed and "aten::gelu" not in packed


def test_across_cores_runs_items_in_order_on_threads_of_their_own(monkeypatch):
    """support.threads.across_cores: the results of map(work, items) in order, though the work ends out of order;
    each item on one of min(threads, items, AT_ONCE) threads other than the caller's, each with its share of torch's
    threads and the caller's grad mode; at most one item waiting per thread; torch's threads as they were afterwards;
    after an error the items not started never start. One thread, or not a CPU: the caller's own thread."""
    started, seen = [], set()

    def work(i):
        started.append(i)
        time.sleep(0.02 * (i % 3))  # later items finish first
        seen.add((threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled()))
        if i == 5:
            raise ValueError("item 5")
        return i * i

    monkeypatch.setattr(threads, "AT_ONCE", 2)
    with cpu_threads(4), torch.no_grad():
        assert list(across_cores(list(range(5)), work)) == [i * i for i in range(5)]
        assert len(seen) == 2 and threading.get_ident() not in {t for t, _, _ in seen}
        assert {(n, grad) for _, n, grad in seen} == {(2, False)} and torch.get_num_threads() == 4
        started.clear()
        with pytest.raises(ValueError, match="item 5"):
            list(across_cores(list(range(40)), work))
        assert max(started) <= 5 + 2 + 1 and torch.get_num_threads() == 4
        for one in ({"cpu": False}, {}):
            seen.clear()
            with cpu_threads(1 if one == {} else 4):
                assert list(across_cores([0, 1, 2], work, **one)) == [0, 1, 4]
            assert {t for t, _, _ in seen} == {threading.get_ident()}


def test_a_cpu_embeds_several_batches_at_once_as_one_at_a_time(tiny, monkeypatch):
    """On a CPU embed_tokenized runs several batches at once (as many as torch has threads), a thread each; the
    embeddings those of one batch at a time, whatever order the batches end in: fp32 and bf16, with oneDNN's layers
    swapped in and without them (where each thread must run in the autocast asked for: bf16 and fp32 are 3e-4 apart)."""
    plain, tok = M.load_pretrained(str(tiny))
    texts = [f"the cat sat on mat {i} " * (1 + i % 9) for i in range(80)]
    ran_on = []

    def spy(items, work, cpu):
        ran_on.append(set())
        return across_cores(items, lambda item: ran_on[-1].add(threading.get_ident()) or work(item), cpu)

    monkeypatch.setattr(E, "across_cores", spy)
    for onednn, dtype in itertools.product((True, False), (None, torch.bfloat16)):
        model = cpu_layers.swap_in(copy.deepcopy(plain), dtype) if onednn else plain
        with cpu_threads(1):
            one = E.encode(texts, model, tok, dtype=dtype, batch_tokens=128)
        with cpu_threads(2):
            two = E.encode(texts, model, tok, dtype=dtype, batch_tokens=128)
        np.testing.assert_allclose(two, one, rtol=0, atol=1e-6)
    assert [len(t) for t in ran_on] == [1, 2] * 4 and threading.get_ident() in ran_on[0] - ran_on[1]


def test_cpu_layers_are_model_pys_layers(tiny, monkeypatch, capsys):
    """support/cpu_layers.py against model.py's own layers on the same weights. fp32: a swapped layer's output and
    a whole model's embeddings are the naive loop's, for BERT's GELU, its tanh form (both inside the up product) and
    ReLU (after it); the product with GELU inside is GELU of nn.Linear's. bf16: a swapped layer is at least as near
    the fp32 layer as model.py's layer under autocast. ModernBERT: its linears swapped, its gated GELU its own. A
    GPU's or fp16's model, and a torch without oneDNN's products: nothing swapped, the latter said once."""
    plain, tok = M.load_pretrained(str(tiny))
    texts = ["the cat sat", "a dog barked at the moon " * 9, "", "the mat " * 30, "moon"] * 3
    g = torch.Generator().manual_seed(0)
    x, lengths = torch.randn(3 * 20, plain.config.hidden_size, generator=g), torch.tensor([20, 7, 13])
    mask = (torch.arange(20)[None] < lengths[:, None]).long()
    packing = M.Packing(3, 20, mask.flatten().nonzero().squeeze(1), mask)
    x = x[:int(lengths.sum())]
    for act in ("gelu", "gelu_new", "relu"):
        model = copy.deepcopy(plain)
        for layer in model.layers:
            layer.ffn.act = M.ACTIVATIONS[act]
        layer, want = model.layers[1], naive(texts, model, tok)
        with torch.no_grad():
            fp32 = layer(x, packing)
        cpu_layers.swap_in(model, None)
        assert all(isinstance(linear, cpu_layers.PackedLinear) for linear in (layer.attn.qkv, layer.attn.out))
        assert isinstance(layer.ffn, cpu_layers.PackedFeedForward) == (act != "relu")
        np.testing.assert_allclose(E.encode(texts, model, tok, batch_tokens=100), want, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(layer(x, packing), fp32, rtol=0, atol=1e-5)
    linear, h = torch.nn.Linear(64, 96), torch.randn(50, 64, generator=g)  # pre-activations ~ N(0, 1/3)
    for act in ("gelu", "gelu_new"):  # where erf's and tanh's GELU differ by up to 1e-4
        inside = cpu_layers.PackedLinear(linear, torch.float32, cpu_layers.fused(M.ACTIVATIONS[act]))
        torch.testing.assert_close(inside(h), M.ACTIVATIONS[act](linear(h)), rtol=0, atol=2e-6)
    with torch.no_grad():
        fp32 = plain.layers[0](x, packing)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = plain.layers[0](x, packing)
            in_bf16 = cpu_layers.swap_in(copy.deepcopy(plain), torch.bfloat16)
            swapped = in_bf16.layers[0](x, packing)
    assert swapped.dtype == torch.float32 and (swapped - fp32).abs().mean() <= (autocast - fp32).abs().mean()
    # bf16's products swapped in where this processor's oneDNN runs them, as torch itself tells (an AVX2-only
    # processor raised "bf16 path needs the cpu support avx_ne_convert or avx512bw, ...")
    assert cpu_layers.swapped(in_bf16) == cpu_layers.runs_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    modern = M.Encoder(M.ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, model_type="modernbert", local_attention=8,
                                     global_attn_every_n_layers=2, global_rope_theta=1e4, local_rope_theta=1e4)).eval()
    ids = torch.randint(5, 300, (3, 20), generator=g)
    with torch.no_grad():
        want = modern(ids, mask)
        cpu_layers.swap_in(modern, None)
        torch.testing.assert_close(modern(ids, mask), want, rtol=0, atol=1e-5)
    assert isinstance(modern.layers[0].mlp.up, cpu_layers.PackedLinear) and modern.layers[0].mlp.act is F.gelu
    for model, dtype in ((copy.deepcopy(plain), torch.float16), (copy.deepcopy(plain).to("meta"), None)):
        assert type(cpu_layers.swap_in(model, dtype).layers[0].ffn.up) is torch.nn.Linear  # fp16; not a CPU
    monkeypatch.setattr(cpu_layers, "OPS", ("_linear_pointwise", "_not_in_this_torch"))
    cpu_layers.available.cache_clear()
    for _ in range(2):
        assert type(cpu_layers.swap_in(copy.deepcopy(plain), None).layers[0].ffn.up) is torch.nn.Linear
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks oneDNN's products" in err and "model.py's own layers run" in err
    cpu_layers.available.cache_clear()


def test_embed_and_evaluate_swap_in_the_cpu_layers_in_one_line_unless_told_not_to(tmp_path, tiny, monkeypatch):
    """embed.py and evaluate_sts.py swap oneDNN's layers in once, after loading, where cpu_layers.chosen says they
    pay (made to say so here in fp32, whatever the processor, so that the rows compare with the naive loop's);
    --no-onednn runs model.py's own; the rows are the naive loop's either way."""
    import evaluate_sts

    (tmp_path / "in.txt").write_text("a man plays a guitar\nthe cat sat on the mat\n\n" + "a dog barked " * 30 + "\n")
    (tmp_path / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{i}\t{i % 5}.0\tthe cat sat {'on ' * i}\ta dog "
                                                  f"barked {'at ' * (i % 3)}\n" for i in range(12)))
    swaps, real = [], cpu_layers.swap_in
    monkeypatch.setattr(cpu_layers, "swap_in", lambda model, dtype: swaps.append(dtype) or real(model, dtype))
    monkeypatch.setattr(cpu_layers, "chosen", lambda device, dtype: (True, ""))
    model, tok = M.load_pretrained(str(tiny))
    want = naive(["a man plays a guitar", "the cat sat on the mat", "", "a dog barked " * 30], model, tok)
    for flags, swapped in (([], [None]), (["--no-onednn"], [])):
        swaps.clear()
        E.main(["--model", str(tiny), str(tmp_path / "in.txt"), "--output", str(tmp_path / "o.npy"), "--overwrite",
                "--dtype", "fp32", "--threads", "1", *flags])
        assert swaps == swapped
        np.testing.assert_allclose(np.load(tmp_path / "o.npy"), want, atol=1e-5)
        swaps.clear()
        evaluate_sts.main(["--model", str(tiny), "--data", str(tmp_path), "--split", "dev",
                           "--dtype", "fp32", "--threads", "1", "--json", str(tmp_path / f"s{len(flags)}.json"),
                           *flags])
        assert swaps == swapped
    scores = [json.loads((tmp_path / f"s{k}.json").read_text())["STSB"] for k in (0, 1)]
    assert scores[0]["n"] == 12 and scores[0]["spearman"] == pytest.approx(scores[1]["spearman"])


def test_the_cpu_layers_are_swapped_in_where_they_run_and_pay(tmp_path, tiny, monkeypatch):
    """cpu_layers.chosen: on a CPU in bf16 where this processor's oneDNN runs bf16 products (as torch itself tells),
    never in fp32 (on an AVX2-only EPYC a whole embed.py process ran 12% slower with them) nor on a GPU. Then, as an
    AVX2-only processor runs (oneDNN and ATen capped to AVX2, whatever this one has; issue 81 found a traceback
    there): embed.py --dtype bf16, evaluate_sts.py --dtype bf16 and embed.py's auto run model.py's layers, say why in
    their first line, and write bf16 rows near the fp32 ones and fp32 rows equal to the naive loop's."""
    cpu = torch.device("cpu")
    assert cpu_layers.chosen(cpu, None) == (False, "oneDNN's products pay in bf16 only")
    assert cpu_layers.chosen(torch.device("cuda"), torch.bfloat16) == (False, "")
    assert cpu_layers.chosen(cpu, torch.bfloat16)[0] == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    texts = ["a man plays a guitar", "the cat sat on the mat", "a dog barked " * 30]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{i}\t{i % 5}.0\tthe cat sat {'on ' * i}\ta dog "
                                                  f"barked {'at ' * (i % 3)}\n" for i in range(12)))
    out = str(tmp_path / "o")
    code = f"""import sys; sys.path.insert(0, {str(ROOT)!r})
import embed, evaluate_sts
embed.main(["--model", {str(tiny)!r}, {str(tmp_path / "in.txt")!r}, "--output", {out!r} + ".bf16.npy",
            "--dtype", "bf16"])
embed.main(["--model", {str(tiny)!r}, {str(tmp_path / "in.txt")!r}, "--output", {out!r} + ".auto.npy"])
evaluate_sts.main(["--model", {str(tiny)!r}, "--data", {str(tmp_path)!r}, "--split", "dev", "--dtype", "bf16"])
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    runs = [line for line in done.stderr.splitlines() if " on the CPU in " in line]
    layers = "model.py's layers as written (oneDNN's bf16 products need AVX-512 or AVX-NE-CONVERT, not available here)"
    assert len(runs) == 3 and all(layers in line for line in (runs[0], runs[2])), runs
    assert ("in fp32 (--dtype auto: ONEDNN_MAX_CPU_ISA=AVX2 leaves oneDNN no bf16 instructions), model.py's layers "
            "as written (oneDNN's products pay in bf16 only)") in runs[1], runs
    model, tok = M.load_pretrained(str(tiny))
    want = naive(texts, model, tok)
    np.testing.assert_allclose(np.load(out + ".auto.npy"), want, atol=1e-5)
    bf16 = np.load(out + ".bf16.npy")
    cos = (bf16 * want).sum(1) / np.linalg.norm(bf16, axis=1) / np.linalg.norm(want, axis=1)
    assert bf16.dtype == np.float32 and cos.min() >= 0.999, cos


def test_a_batch_packed_or_not_changes_no_embedding(tiny, monkeypatch):
    """A batch whose padding is over PACK_ABOVE of it runs its token-wise layers on the real tokens alone, one with
    less as it is, one without any padding without a mask: every batch with padding packed, and none, gives the
    naive loop's embeddings."""
    cpu = torch.device("cpu")
    ids, mask, positions, attend = embedding.padded_batch([[5] * 8] * 3 + [[5] * 7], 0, 8, cpu)
    assert positions is None and attend is mask and mask.sum() == 31  # 1 padding place in 32: run as it is
    assert embedding.padded_batch([[5] * 8] * 4, 0, 8, cpu)[2:] == (None, None)  # no padding: no mask either
    ids, mask, positions, attend = embedding.padded_batch([[5] * 8, [5] * 2], 0, 8, cpu)
    assert positions.tolist() == [*range(8), 8, 9] and attend is mask  # 6 in 16: packed
    model, tok = M.load_pretrained(str(tiny))
    texts = ["the cat sat", "a dog barked at the moon " * 9, "the mat " * 30, "moon", "sat on the mat"] * 4
    for share in (0.0, 1.0):  # every batch with padding packed; none
        monkeypatch.setattr(embedding, "PACK_ABOVE", share)
        np.testing.assert_allclose(E.encode(texts, model, tok, batch_tokens=200), naive(texts, model, tok), atol=1e-5)


def run(*args, stdin=None):
    """`python embed.py ARGS`, in this process (conftest.run_here); tests/test_user_edges.py and
    test_cli_matches_sentence_transformers run real processes."""
    return run_here(E.main, *args, stdin=stdin)


def test_inputs_rows_formats_and_blocks(tmp_path, tiny):
    (tmp_path / "a.txt").write_text("first\n\nthird line\r\nfourth\n")  # the empty line is a row; CRLF is a line end
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "fifth"}) + "\n\n" + json.dumps({"text": "sixth", "id": 6})
                                      + "\n")
    r = run("--model", tiny, tmp_path / "a.txt", tmp_path / "b.jsonl", "-", "--output", tmp_path / "o.npy",
            "--block", "2", "--dtype", "fp32", stdin="seventh\n")
    assert r.returncode == 0, r.stderr
    emb = np.load(tmp_path / "o.npy")
    model, tok = M.load_pretrained(str(tiny))
    texts = ["first", "", "third line", "fourth", "fifth", "sixth", "seventh"]
    np.testing.assert_allclose(emb, naive(texts, model, tok), atol=1e-5)
    r = run("--model", tiny, tmp_path / "a.txt", "--output", tmp_path / "o.jsonl", "--format", "jsonl", "--normalize",
            "--dtype", "fp32")
    rows = [json.loads(line)["embedding"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and abs(np.linalg.norm(rows[2]) - 1) < 1e-5
    np.testing.assert_allclose(rows[3], emb[3] / np.linalg.norm(emb[3]), atol=1e-6)


def test_json_lines_through_a_pipe_are_read_as_json_lines(tmp_path, tiny):
    """A pipe or standard input has no name to say its format (`<(zcat x.jsonl.gz)` is /dev/fd/63): a first line that
    is a JSON object makes it JSON lines, said in one line, and the rows are those of the same .jsonl file, not of its
    markup as text; JSON objects without the text field are one line naming the field; plain text stays text."""
    import threading

    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(["a cat sat", "a dog barked", "the moon"])]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    r = run("--model", tiny, tmp_path / "t.jsonl", "--output", tmp_path / "file.npy", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("\n".join(lines) + "\n"))
    writer.start()
    r = run("--model", tiny, fifo, "--output", tmp_path / "pipe.npy", "--dtype", "fp32")
    writer.join()
    assert r.returncode == 0 and f"{fifo}: its first line is a JSON object: read as JSON lines" in r.stderr, r.stderr
    r = run("--model", tiny, "-", "--output", tmp_path / "stdin.npy", "--dtype", "fp32", stdin="\n".join(lines))
    assert r.returncode == 0 and "-: its first line is a JSON object" in r.stderr, r.stderr
    for name in ("pipe.npy", "stdin.npy"):
        assert np.load(tmp_path / name).tobytes() == np.load(tmp_path / "file.npy").tobytes()
    r = run("--model", tiny, "-", "--output", tmp_path / "body.npy", stdin='{"body": "a cat"}\n')
    assert r.returncode == 1 and r.stderr.endswith("error: stdin:1: not a JSON object with a string field 'text'\n")
    r = run("--model", tiny, "-", "--output", tmp_path / "plain.npy", stdin="{a cat}\nsat\n")
    assert r.returncode == 0 and np.load(tmp_path / "plain.npy").shape[0] == 2 and "JSON" not in r.stderr


@pytest.mark.slow
def test_a_long_text_is_tokenised_only_as_far_as_the_model_reads_it(tiny, monkeypatch):
    """--long truncate: a long text's ids come from a prefix cut at a space, and are the whole text's first ones, for a
    byte-level BPE, WordPiece (all-MiniLM-L6-v2's: lower-cased, accents stripped) and a SentencePiece Unigram, on text
    with runs of spaces, newlines, punctuation, accents and digits; a text whose prefix holds too few tokens (one long
    word) is tokenised whole; the tokenizer is given at most GROUP_CHARS characters at a time (or one text); --long
    chunk still sees every token."""
    from test_model import unigram

    from support.hub import load_tokenizer

    rng = np.random.default_rng(0)
    pieces = [*WORDS, "café", "naïve", "1984", "--", "(it's)", "\n\n", "   ", "don't!", "U.S.A.", "x" * 30]
    texts = ["".join(rng.choice(pieces) + rng.choice([" ", "", "\n", ", "]) for _ in range(3000)) for _ in range(6)]
    texts += ["y" * 120 + " " + "y" * 20_000 + " end", "short text"]  # long words: their prefix holds few tokens
    sizes = []

    class Spy:  # the tokenizer, each call's characters counted
        def __init__(self, tok):
            self.tok = tok

        def encode_batch_fast(self, batch):
            sizes.append((len(batch), sum(map(len, batch))))
            return self.tok.encode_batch_fast(batch)

        encode_batch = encode_batch_fast

    monkeypatch.setattr(embedding, "GROUP_CHARS", 30_000)
    for tok in (load_tokenizer(tiny), load_tokenizer(minilm()), unigram(texts)):
        for keep in (16, 128):
            whole = [E._segments(np.asarray(tok.encode(t).ids), keep, "truncate")[0] for t in texts]
            sizes.clear()
            got = E.tokenize(texts, Spy(tok), keep).pieces
            assert [g.tolist() for g in got] == [w.tolist() for w in whole], keep
            assert all(n == 1 or chars <= 30_000 for n, chars in sizes) and len(sizes) > 1
        windows = E.tokenize(texts, Spy(tok), 16, long="chunk")
        assert sum(len(p) - 2 for p in windows.pieces) >= sum(len(tok.encode(t).ids) - 2 for t in texts)


def test_a_block_of_long_texts_holds_fewer_of_them(tmp_path, tiny, monkeypatch):
    """A block is --block texts, or as many as come to BLOCK_CHARS characters on average where the texts are long:
    the job cuts its blocks so, and writes the bytes of the same job cut by --block alone."""
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(60 + 40 * (i % 3))) for i in range(30)]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    chars = sum(map(len, texts))
    assert embedding.block_rows(16384, 30, chars) == 16384 and embedding.block_rows(16384, 30, 10**12) == 1
    monkeypatch.setattr(embedding, "BLOCK_CHARS", chars // 5)  # about 6 texts a block
    sizes, real = [], embedding.blocks
    monkeypatch.setattr(embedding, "blocks", lambda inputs, copies, size, *a: sizes.append(size) or real(
        inputs, copies, size, *a))
    E.main(["--model", str(tiny), str(tmp_path / "in.txt"), "--output", str(tmp_path / "long.npy"), "--threads", "1"])
    assert sizes == [embedding.block_rows(16384, 30, chars)] and 4 <= sizes[0] <= 8
    E.main(["--model", str(tiny), str(tmp_path / "in.txt"), "--output", str(tmp_path / "by-block.npy"), "--block",
            str(sizes[0]), "--threads", "1"])
    assert (tmp_path / "long.npy").read_bytes() == (tmp_path / "by-block.npy").read_bytes()


def test_gzipped_inputs_read_as_train_py_reads_them(tmp_path, tiny):
    """.txt.gz and .jsonl.gz, as train.py takes its documents: the same rows as the plain files (and a .gz cut short
    is one line)."""
    import gzip

    lines, docs = "first\n\nthird line\n", json.dumps({"text": "fifth"}) + "\n" + json.dumps({"text": "sixth"}) + "\n"
    for name, text in (("a.txt", lines), ("b.jsonl", docs)):
        (tmp_path / name).write_text(text)
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(text.encode()))
    for plain, zipped in (("a.txt", "a.txt.gz"), ("b.jsonl", "b.jsonl.gz")):
        for f, out in ((plain, "p.npy"), (zipped, "z.npy")):
            r = run("--model", tiny, tmp_path / f, "--output", tmp_path / out, "--overwrite", "--dtype", "fp32")
            assert r.returncode == 0, r.stderr
        assert np.load(tmp_path / "z.npy").shape[0] == (3 if plain == "a.txt" else 2)
        np.testing.assert_array_equal(np.load(tmp_path / "z.npy"), np.load(tmp_path / "p.npy"))
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(lines.encode() * 100)[:40])
    r = run("--model", tiny, tmp_path / "cut.txt.gz", "--output", tmp_path / "c.npy")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cut.txt.gz: cannot read" in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["missing", "empty", "utf8", "jsonl", "unwritable"])
def test_bad_input_one_line_and_no_output(tmp_path, tiny, case):
    f, out = tmp_path / "in.txt", tmp_path / "out.npy"
    expect = {"missing": "no such file", "empty": "no texts", "utf8": "not UTF-8", "jsonl": "in.jsonl:2:",
              "unwritable": "cannot write"}[case]
    if case == "empty":
        f.write_text("")
    elif case == "utf8":
        f.write_bytes(b"fine\ncaf\xe9\n")
    elif case == "jsonl":
        f = tmp_path / "in.jsonl"
        f.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    elif case == "unwritable":
        f.write_text("a\n")
        out = tmp_path / "no" / "such" / "dir" / "out.npy"
    r = run("--model", tiny, f, "--output", out)
    assert r.returncode == 1 and expect in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_a_failure_midway_keeps_the_blocks_done_and_no_output(tmp_path, tiny, monkeypatch):
    """Ctrl-C midway: exit 130 (support.cli), no --output, the block done kept in the job's folder; --resume embeds
    only the two blocks missing and gives the uninterrupted output (tests/test_embed_job.py: every way of stopping)."""
    (tmp_path / "in.txt").write_text("a\nb\nc\n")
    calls = []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    real = E.embed_tokenized
    monkeypatch.setattr(E, "embed_tokenized", dying)
    flags = ["--model", str(tiny), str(tmp_path / "in.txt"), "--block", "1", "--threads", "1"]
    with pytest.raises(SystemExit) as stopped:
        E.main([*flags, "--output", str(tmp_path / "o.npy")])
    assert stopped.value.code == 130
    assert not (tmp_path / "o.npy").exists() and [p.name for p in tmp_path.glob(".o.npy*")] == [".o.npy.partial"]
    E.main([*flags, "--output", str(tmp_path / "o.npy"), "--resume"])
    assert len(calls) == 2 + 2
    monkeypatch.setattr(E, "embed_tokenized", real)
    E.main([*flags, "--output", str(tmp_path / "whole.npy")])
    assert (tmp_path / "o.npy").read_bytes() == (tmp_path / "whole.npy").read_bytes()
    assert not list(tmp_path.glob(".o.npy*"))


@pytest.mark.slow
def test_long_texts_truncate_where_sentence_transformers_does_and_saving_keeps_its_modules(tmp_path):
    """all-MiniLM-L6-v2 says max_seq_length 256 (sentence_bert_config.json) and ends in a Normalize module: texts of
    300-500 tokens embed as sentence-transformers embeds them (its own truncation), not at the 512 positions; the
    model saved again keeps both, and sentence-transformers embeds the saved copy as it embeds the original."""
    st = oracle("sentence_transformers")
    path = minilm()
    sents = stsb_sentences(400)
    texts = [" ".join(sents[i:i + 50]) for i in range(0, 350, 35)]
    ours, tok = M.load_pretrained(str(path))
    assert ours.sentence_transformers == {"max_seq_length": 256, "normalize": True}
    assert all(300 < len(tok.encode(t).ids) <= 512 for t in texts)
    ref = st.SentenceTransformer(str(path), device="cpu").encode(texts)
    emb = E.encode(texts, ours, tok)
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos.min()
    M.save_pretrained(ours, tok, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
    assert [m["type"].rsplit(".")[-1] for m in json.loads((tmp_path / "saved" / "modules.json").read_text())] == [
        "Transformer", "Pooling", "Normalize"]
    again = st.SentenceTransformer(str(tmp_path / "saved"), device="cpu").encode(texts)
    np.testing.assert_allclose(np.linalg.norm(again, axis=1), 1, atol=1e-5)  # Normalize kept
    assert ((again * ref).sum(1)).min() >= 0.99999


def test_embedding_never_imports_the_compiler(tmp_path, tiny):
    """embed.py's whole path, from its import to the rows written, imports nothing of torch.compile's: torch._dynamo
    alone is 79 modules and about a second of every run's start (issue 77 measured 2.46-2.68 s against 1.43-1.53 for
    2 lines while embed.py had --compile)."""
    (tmp_path / "two.txt").write_text("A man is playing a guitar.\nA woman is singing.\n")
    code = ("import sys, embed; embed.main(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    r = subprocess.run([sys.executable, "-c", code, "--model", str(tiny), str(tmp_path / "two.txt"), "--output",
                        str(tmp_path / "two.npy")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr
    assert np.load(tmp_path / "two.npy").shape[0] == 2


def test_embed_and_evaluate_say_what_runs(tmp_path, tiny, capsys):
    """The job's first line says where it runs, the precision --dtype auto chose and why, and whether oneDNN's
    products were swapped in (--no-onednn named): issue 77 found the bf16 that ran misread as fp32. evaluate_sts.py
    says the same in each model's first line."""
    import evaluate_sts
    from support.device import cpu_has_bf16, onednn_capped

    (tmp_path / "a.txt").write_text("the cat sat\non the mat\n")
    args = ["--model", str(tiny), str(tmp_path / "a.txt"), "--output", str(tmp_path / "a.npy"), "--overwrite"]
    E.main([*args, "--dtype", "fp32", "--no-onednn"])
    assert f"with {tiny} on the CPU in fp32, model.py's layers as written, into" in capsys.readouterr().err
    E.main(args)
    # where the suite runs as a lesser processor (ONEDNN_MAX_CPU_ISA=AVX2 on one with AMX), the cap is the reason
    chose = ("in bf16 (--dtype auto: this CPU multiplies bf16, with AMX or AVX512-BF16)" if cpu_has_bf16() else
             f"in fp32 (--dtype auto: ONEDNN_MAX_CPU_ISA={onednn_capped()} leaves oneDNN no bf16 instructions)"
             if onednn_capped() else "in fp32 (--dtype auto: this CPU has neither AMX nor AVX512-BF16 for bf16)")
    swapped = ("oneDNN's products swapped in (support/cpu_layers.py; --no-onednn: model.py's layers)"
               if cpu_layers.chosen(torch.device("cpu"), device_and_dtype("cpu", "auto")[1])[0] else
               "model.py's layers as written (")
    err = capsys.readouterr().err
    assert f"on the CPU {chose}, {swapped}" in err, err
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "d.txt").write_text(" ".join(WORDS * 60))
    evaluate_sts.main(["--model", str(tiny), "--docs", str(docs), "--span-pairs", "5", "--cache-dir",
                       str(tmp_path / "cache")])
    assert f"evaluate: {tiny} on SPANS, on the CPU {chose}" in capsys.readouterr().err
