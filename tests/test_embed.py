"""embed.py against sentence-transformers on the same model and texts, a naive loop, and bad input."""
import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import embed as E
import model as M
from conftest import ROOT, minilm, oracle, stsb_sentences
from support import device as D
from support import embedding, threads
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
    model, tok = M.from_scratch("tiny", ["alpha beta gamma delta"] * 30)
    model.eval()
    texts = ["alpha", "", "beta gamma " * 40, "delta alpha beta", "gamma " * 700, "alpha"]
    emb = E.encode(texts, model, tok, batch_tokens=64)
    np.testing.assert_allclose(emb, naive(texts, model, tok), atol=1e-5)
    unit = E.encode(texts, model, tok, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1, atol=1e-6)


def test_encode_turns_dropout_off_and_gives_the_mode_back():
    """A model left in training mode (dropout 0.1, as a scratch or just-trained one is) embeds as the naive loop
    does in eval mode, the same each call, and is in training mode again afterwards."""
    model, tok = M.from_scratch("tiny", ["alpha beta gamma delta"] * 30)
    texts = ["alpha beta", "gamma delta alpha", "delta " * 20]
    model.train()
    emb = E.encode(texts, model, tok)
    assert model.training
    np.testing.assert_allclose(emb, naive(texts, model.eval(), tok), atol=1e-5)


def test_long_chunk_is_the_mean_of_overlapping_windows():
    model, tok = M.from_scratch("tiny", ["one two three four five six"] * 30, max_position_embeddings=22)
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


def test_bf16_casts_each_weight_once_a_call_not_once_a_batch(tiny, monkeypatch):
    """Autocast keeps one bf16 copy of each weight for all of a call's batches; under inference_mode it would cast
    every weight again for every batch (its cache skips such calls): the casts of the up-projections' weights,
    counted by torch.profiler over a call of many batches, one after another as on a GPU, are one per layer. On a
    CPU, oneDNN's packed weights likewise, with the batches on two threads at once: laid out once a call, the GELU
    inside the product (no aten::gelu), four products a layer a batch."""
    model, tok = M.load_pretrained(str(tiny))
    c = model.config
    texts = [f"the cat sat on mat {i} " * (1 + i % 7) for i in range(60)]

    def ops(**kw):
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the workers' too
        with torch.profiler.profile(record_shapes=True, experimental_config=every_thread) as prof:
            E.encode(texts, model, tok, dtype=torch.bfloat16, batch_tokens=128)
        return {e.key: e.count for e in prof.key_averages(**kw) if not kw or e.input_shapes[:1] == [
            [c.intermediate_size, c.hidden_size]]}

    monkeypatch.setattr(D, "PACK_FROM_TOKENS", 0)  # whatever the call's tokens
    with cpu_threads(2):
        packed = ops()
    batches = packed["mkldnn::_linear_pointwise"] // (4 * c.num_hidden_layers)
    assert packed["mkldnn::_reorder_linear_weight"] == 4 * c.num_hidden_layers and "aten::gelu" not in packed
    monkeypatch.setattr(E, "packed_linears", lambda *args: contextlib.nullcontext())  # as on a GPU: no packing,
    with cpu_threads(1):  # and one batch after another
        assert ops()["aten::gelu"] == batches * c.num_hidden_layers and batches >= 5
        assert ops(group_by_input_shape=True)["aten::_to_copy"] == c.num_hidden_layers


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
    embeddings those of one batch at a time, whatever order the batches end in: fp32 and bf16, with oneDNN's packed
    layers and without them (where each thread must run in the autocast asked for: bf16 and fp32 are 3e-4 apart)."""
    model, tok = M.load_pretrained(str(tiny))
    texts = [f"the cat sat on mat {i} " * (1 + i % 9) for i in range(80)]
    ran_on = []

    def spy(items, work, cpu):
        ran_on.append(set())
        return across_cores(items, lambda item: ran_on[-1].add(threading.get_ident()) or work(item), cpu)

    monkeypatch.setattr(E, "across_cores", spy)
    for pack_from, dtype in itertools.product((0, 10**9), (None, torch.bfloat16)):
        monkeypatch.setattr(D, "PACK_FROM_TOKENS", pack_from)
        with cpu_threads(1):
            one = E.encode(texts, model, tok, dtype=dtype, batch_tokens=128)
        with cpu_threads(2):
            two = E.encode(texts, model, tok, dtype=dtype, batch_tokens=128)
        np.testing.assert_allclose(two, one, rtol=0, atol=1e-6)
    assert [len(t) for t in ran_on] == [1, 2] * 4 and threading.get_ident() in ran_on[0] - ran_on[1]


def test_packed_linears_embed_as_plain_ones_and_put_the_model_back(tiny, monkeypatch):
    """support.device.packed_linears: in fp32 the naive loop's embeddings, for BERT's GELU, its tanh form (fused
    too) and ReLU (not fused); the model's own modules back afterwards, after an error too; ModernBERT's gated
    activation is left to the model."""
    model, tok = M.load_pretrained(str(tiny))
    texts = ["the cat sat", "a dog barked at the moon " * 9, "", "the mat " * 30, "moon"] * 3
    monkeypatch.setattr(D, "PACK_FROM_TOKENS", 0)  # however few the tokens
    for act in ("gelu", "gelu_new", "relu"):
        for layer in model.layers:
            layer.ffn.act = M.ACTIVATIONS[act]
        np.testing.assert_allclose(E.encode(texts, model, tok, batch_tokens=100), naive(texts, model, tok), atol=1e-5)
    g = torch.Generator().manual_seed(0)
    linear, x = torch.nn.Linear(64, 96), torch.randn(50, 64, generator=g)  # pre-activations ~ N(0, 1/3)
    for act in ("gelu", "gelu_new"):  # where erf's and tanh's GELU differ by up to 1e-4
        fused = D.PackedLinear(linear, torch.float32, D.fusable(M.ACTIVATIONS[act]))
        torch.testing.assert_close(fused(x), M.ACTIVATIONS[act](linear(x)), rtol=0, atol=2e-6)
    model.layers[1].ffn.act = M.ACTIVATIONS["gelu"]
    before = [(name, type(m), getattr(m, "act", None)) for name, m in model.named_modules()]
    with pytest.raises(RuntimeError, match="stop"), D.packed_linears(model.eval(), None):
        assert isinstance(model.layers[1].ffn.up, D.PackedLinear) and model.layers[1].ffn.up.attr == "gelu"
        assert model.layers[0].ffn.up.attr == "none" and isinstance(model.layers[0].attn.qkv, D.PackedLinear)
        raise RuntimeError("stop")  # as an error inside a call
    assert [(name, type(m), getattr(m, "act", None)) for name, m in model.named_modules()] == before
    modern = M.Encoder(M.ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, model_type="modernbert", local_attention=8,
                                     global_attn_every_n_layers=2, global_rope_theta=1e4, local_rope_theta=1e4)).eval()
    with D.packed_linears(modern, None):
        assert modern.layers[0].ffn.act is M.ACTIVATIONS["gelu"] and modern.layers[0].ffn.up.attr == "none"
    with D.packed_linears(model, torch.float16), D.packed_linears(model.train(), None):  # left as they are
        assert type(model.layers[0].ffn.up) is torch.nn.Linear


def test_a_call_of_few_tokens_runs_the_layers_as_they_are(tiny, monkeypatch):
    """Laying the weights out for oneDNN pays from about 1,000 tokens a call (support.device.PACK_FROM_TOKENS): one
    sentence, or a call one token short of the threshold, runs the layers as they are; a call that reaches it lays
    each weight out once."""
    model, tok = M.load_pretrained(str(tiny))
    texts = ["the cat sat on the mat"] * 8
    tokens = sum(map(len, E.tokenize(texts, tok, E.max_tokens(model)).pieces))

    def layouts(texts):
        with torch.profiler.profile() as prof:
            E.encode(texts, model, tok)
        return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_reorder_linear_weight")

    assert layouts(texts[:1]) == 0 and tokens < 1000
    monkeypatch.setattr(D, "PACK_FROM_TOKENS", tokens + 1)
    assert layouts(texts) == 0
    monkeypatch.setattr(D, "PACK_FROM_TOKENS", tokens)
    assert layouts(texts) == 4 * model.config.num_hidden_layers


def test_shapes_rounded_up_change_no_embedding(tiny, monkeypatch):
    """Packed token counts a multiple of 64 (a CPU's bf16 shapes), here in fp32, every batch with padding packed and
    none: the naive loop's embeddings; the extra positions are padding, and every real one is among them."""
    lengths, T = np.array([5, 3, 8, 1]), 8
    for multiple in (1, 4, 16, 64):
        positions = embedding.token_positions(lengths, T, multiple)
        real = np.flatnonzero(np.arange(T)[None] < lengths[:, None])  # by hand
        assert set(real) <= set(positions) and len(set(positions)) == len(positions)
        assert len(positions) % multiple == 0 or len(positions) == len(real)  # too little padding to round up
        assert (np.sort(positions) == positions).all()
    assert len(embedding.token_positions(lengths, T, 4)) == 20 and len(embedding.token_positions(lengths, T, 64)) == 17
    cpu = torch.device("cpu")
    ids, mask, positions, attend = embedding.padded_batch([[5] * 8] * 3 + [[5] * 7], 0, 8, cpu, None)
    assert positions is None and attend is mask and mask.sum() == 31  # 1 padding place in 32: run as it is
    assert embedding.padded_batch([[5] * 8] * 4, 0, 8, cpu, None)[2:] == (None, None)  # no padding: no mask either
    ids, mask, positions, attend = embedding.padded_batch([[5] * 8, [5] * 2], 0, 8, cpu, None)
    assert positions.tolist() == [*range(8), 8, 9] and attend is mask  # 6 in 16: packed
    model, tok = M.load_pretrained(str(tiny))
    texts = ["the cat sat", "a dog barked at the moon " * 9, "the mat " * 30, "moon", "sat on the mat"] * 4
    monkeypatch.setattr(embedding, "token_multiple", lambda device, dtype: 64)
    for share in (0.0, 1.0):  # every batch with padding packed; none
        monkeypatch.setattr(embedding, "PACK_ABOVE", share)
        np.testing.assert_allclose(E.encode(texts, model, tok, batch_tokens=200), naive(texts, model, tok), atol=1e-5)


def run(*args, stdin=None):
    return subprocess.run([sys.executable, str(ROOT / "embed.py"), *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=300)


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
