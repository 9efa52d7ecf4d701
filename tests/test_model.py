"""model.py against transformers and sentence-transformers on the same weights, plus loading, saving and errors."""
import copy
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import embed as E
import model as M
from conftest import from_scratch, minilm, oracle, stsb_sentences
from support import cpu_layers
from support import hub as H
from support.cli import UserError

transformers = oracle("transformers")

TINY = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


ROBERTA_FAMILY = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}  # transformers' names


def hf_tiny(kind: str, seed=0):
    torch.manual_seed(seed)
    if kind in ROBERTA_FAMILY:
        name = ROBERTA_FAMILY[kind]
        cfg = getattr(transformers, f"{name}Config")(**TINY, max_position_embeddings=40, pad_token_id=1,
                                                     bos_token_id=0, eos_token_id=2)
        m = getattr(transformers, f"{name}ForMaskedLM")(cfg)
    else:
        cfg = transformers.BertConfig(**TINY, max_position_embeddings=40, pad_token_id=0, type_vocab_size=2)
        m = transformers.BertForMaskedLM(cfg)
    with torch.no_grad():  # transformers zero-inits biases and unit-inits LayerNorms: randomise all, so a swap shows
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def padded_batch(pad_id, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = [13, 5, 9, 2]
    ids = torch.full((4, 13), pad_id)
    mask = torch.zeros(4, 13, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(3, 300, (n,), generator=g)
        row[row == pad_id] = 5
        ids[i, :n], mask[i, :n] = row, 1
    return ids, mask


def save_with_tokenizer(hf_model, d: Path):
    """An HF checkpoint directory with a small tokenizer beside it: a SentencePiece-style Unigram for XLM-R and
    CamemBERT (as theirs), a byte-level BPE otherwise."""
    hf_model.save_pretrained(d)
    texts = ["hello world, a small text for a small tokenizer."] * 20
    sentencepiece = hf_model.config.model_type in ("xlm-roberta", "camembert")
    tok = unigram(texts) if sentencepiece else H.train_tokenizer(texts, 300)
    tok.save(str(d / "tokenizer.json"))
    return d


def unigram(texts):
    """A SentencePiece Unigram tokenizer.json trained on the spot, laid out as XLM-R's: <s> <pad> </s> <unk> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=120, special_tokens=specials, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return tok


KINDS = ["roberta", "xlm-roberta", "camembert", "bert"]


@pytest.mark.parametrize("kind", KINDS)
def test_parity_with_transformers(kind, tmp_path):
    hf = hf_tiny(kind)
    ours, _ = M.load_pretrained(str(save_with_tokenizer(hf, tmp_path)))
    ids, mask = padded_batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        h = ours(ids, mask)
        logits = ours.mlm_logits(h)
    real = mask.bool()
    assert (h - ref.hidden_states[-1])[real].abs().max() <= 1e-5
    assert (logits - ref.logits)[real].abs().max() <= 1e-4
    assert (h[~real] == 0).all()  # padding is never computed
    with torch.no_grad():  # a batch without padding takes the plain path
        full = ours(ids[:1], mask[:1])
    torch.testing.assert_close(full, ref.hidden_states[-1][:1], rtol=0, atol=1e-5)


def short(q, k, v, mask, dropout_p):  # the written-out attention, around model.py's
    return cpu_layers.short_row_attention(M.attention, q, k, v, mask, dropout_p)


def test_short_rows_attend_as_the_fused_kernel_does(monkeypatch):
    """support/cpu_layers.short_row_attention, which a CPU swaps in for rows of up to SHORT_ROWS tokens without
    dropout, computes what scaled_dot_product_attention does: against SDPA in float64 for key masks, ModernBERT's bands
    and no mask; in bf16 within 3x the fused kernel's own error; a query that may see no key comes out finite; the
    fused kernel still runs for longer rows and under dropout; and a whole encoder, swapped, gives the same states as
    model.py's own, its every layer swapped once however often short_rows is called."""
    g = torch.Generator().manual_seed(0)
    for T in (1, 3, 8, 13, cpu_layers.SHORT_ROWS):
        q, k, v = (torch.randn(5, 3, T, 8, generator=g) for _ in range(3))
        lengths = torch.tensor([T, 1, max(1, T // 2), T, 2])
        keys = (torch.arange(T)[None] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
        band = (torch.arange(T)[:, None] - torch.arange(T)[None]).abs() <= 2
        for mask in (keys, keys & band, None):
            seen = slice(None) if mask is None else mask.expand(5, 3, T, T).any(-1)  # queries that see a key
            exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)[seen]
            torch.testing.assert_close(short(q, k, v, mask, 0.0).double()[seen], exact, rtol=0, atol=1e-6)
            fused = (F.scaled_dot_product_attention(*(x.bfloat16() for x in (q, k, v)), attn_mask=mask).double()[seen]
                     - exact).abs().max()  # bf16's own error, in the fused kernel
            ours = (short(*(x.bfloat16() for x in (q, k, v)), mask, 0.0).double()[seen] - exact).abs().max()
            assert ours <= 3 * fused + 1e-2, (T, ours, fused)
    nobody = torch.zeros(1, 1, 1, 4, dtype=torch.bool)  # a row of padding alone
    assert torch.isfinite(short(*(torch.randn(1, 2, 4, 8) for _ in range(3)), nobody, 0.0)).all()
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape[-2]) or a[0])
    for T, p in ((cpu_layers.SHORT_ROWS, 0.0), (cpu_layers.SHORT_ROWS + 1, 0.0), (8, 0.1)):
        short(*(torch.randn(2, 2, T, 8) for _ in range(3)), None, p)
    assert calls == [cpu_layers.SHORT_ROWS + 1, 8]
    monkeypatch.undo()
    plain = M.Encoder(M.ModelConfig(**TINY, max_position_embeddings=100)).eval()
    swapped = cpu_layers.short_rows(cpu_layers.short_rows(copy.deepcopy(plain)))
    assert all(layer.attn.attention.func is cpu_layers.short_row_attention for layer in swapped.layers)
    assert all(layer.attn.attention.args == (M.attention,) for layer in swapped.layers)  # once, around model.py's
    ids, mask = torch.randint(3, 300, (3, 40), generator=g), torch.ones(3, 40, dtype=torch.long)
    mask[1, 20:], mask[2, 7:] = 0, 0
    with torch.no_grad():  # 40 tokens: written out in the swapped one, the fused kernel in model.py's
        torch.testing.assert_close(swapped(ids, mask), plain(ids, mask), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_short_rows_compile_for_rows_padded_and_not():
    """torch.compile(dynamic=True) of the written-out attention, as the GPU check's dry run compiles the encoder
    (aot_eager): one graph, traced on rows whose keys are padded to 8, then given rows of 8 and 16 tokens that need
    none. F.pad by nothing copied k in k's own strides, which that graph read as the padded copy's: "view size is not
    compatible with input tensor's size and stride" (issue 81). Each call equals eager's on the same rows."""
    compiled = torch.compile(short, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for B, T in ((6, 13), (5, 8), (3, 21), (4, 16)):
        qkv = torch.randn(B, T, 3, 2, 8, generator=g)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # as SelfAttention makes them: views across the heads
        mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g))[:, None, None, :]
        torch.testing.assert_close(compiled(q, k, v, mask, 0.0), short(q, k, v, mask, 0.0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["roberta", "bert"])
def test_gradients_match_transformers(kind, tmp_path):
    """Training runs the unpadded path backwards: every weight's gradient equals transformers' (dropout off)."""
    hf = hf_tiny(kind)
    ours, _ = M.load_pretrained(str(save_with_tokenizer(hf, tmp_path)))
    for m in (hf, ours):
        m.train()
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
            if isinstance(mod, M.SelfAttention):  # ours keeps attention dropout as a float
                mod.dropout_p = 0.0
    ids, mask = padded_batch(hf.config.pad_token_id)
    pick = mask.bool() & (torch.arange(ids.shape[1]) % 3 == 0)  # some "masked" positions for the MLM term
    ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    loss_ref = M.mean_pool(ref.hidden_states[-1], mask).pow(2).sum() + ref.logits[pick].logsumexp(-1).sum()
    h = ours(ids, mask)
    loss = M.mean_pool(h, mask).pow(2).sum() + ours.mlm_logits(h[pick]).logsumexp(-1).sum()
    loss_ref.backward()
    loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        sources = M.hf_key_map(ours.config)[name]
        g = torch.cat([hf_grads[s] for s in sources])
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_save_then_transformers_loads_identical(kind, tmp_path):
    hf = hf_tiny(kind, seed=3)
    ours, tok = M.load_pretrained(str(save_with_tokenizer(hf, tmp_path / "a")))
    with torch.no_grad():  # move away from the source weights so the check is of our saving, not theirs
        for p in ours.parameters():
            p.mul_(1.5)
    M.save_pretrained(ours, tok, tmp_path / "b")
    ids, mask = padded_batch(hf.config.pad_token_id)
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "b").eval()
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert type(back) is type(hf) and saved["model_type"] == kind and saved["architectures"] == [type(hf).__name__]
    bare = transformers.AutoModel.from_pretrained(tmp_path / "b").eval()
    with torch.no_grad():
        h = ours(ids, mask)
        ref = back(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        r = mask.bool()
        torch.testing.assert_close(ref.hidden_states[-1][r], h[r], rtol=0, atol=1e-5)
        torch.testing.assert_close(ref.logits[r], ours.mlm_logits(h)[r], rtol=0, atol=1e-4)
        torch.testing.assert_close(bare(input_ids=ids, attention_mask=mask).last_hidden_state[r], h[r],
                                   rtol=0, atol=1e-5)
    ours2, _ = M.load_pretrained(str(tmp_path / "b"))
    for (n, a), b in zip(ours.state_dict().items(), ours2.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("kind", ["xlm-roberta", "camembert"])
def test_roberta_family_loads_in_sentence_transformers_and_trains(kind, tmp_path, docs):
    """XLM-R and CamemBERT, RoBERTa under other names: saved, sentence-transformers embeds as we do; train.py runs
    two steps on them and the model it writes keeps its model_type and transformers class."""
    import train

    st = oracle("sentence_transformers")
    ours, tok = M.load_pretrained(str(save_with_tokenizer(hf_tiny(kind), tmp_path / "src")))
    M.save_pretrained(ours, tok, tmp_path / "saved")
    sent = ["hello world", "a small text for a small tokenizer"]
    ref = st.SentenceTransformer(str(tmp_path / "saved"), device="cpu").encode(sent, convert_to_tensor=True)
    torch.testing.assert_close(torch.from_numpy(E.encode(sent, ours, tok)), ref, rtol=0, atol=1e-5)
    train.main(["--model", str(tmp_path / "src"), "--data", str(docs), "--out", str(tmp_path / "run"), "--steps", "2",
                "--docs-per-step", "4", "--min-span", "4", "--max-span", "16", "--workers", "0",
                "--cache-dir", str(tmp_path / "cache")])
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "run" / "model")
    assert back.config.model_type == kind and type(back).__name__ == f"{ROBERTA_FAMILY[kind]}ForMaskedLM"
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_sentencepiece_model_alone_says_how_to_convert(tmp_path, capsys):
    d = save_with_tokenizer(hf_tiny("xlm-roberta"), tmp_path / "m")
    (d / "tokenizer.json").rename(d / "sentencepiece.bpe.model")  # what some repos ship without tokenizer.json
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        M.main(["info", str(d)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert "only sentencepiece.bpe.model" in err and "save_pretrained" in err


def test_key_map_names_every_parameter():
    """load_pretrained initialises only a missing MLM head: a parameter the key map missed would keep the modules'
    default draws, not BERT's initialisation, unnoticed."""
    for c in [M.ModelConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, model_type=kind) for kind in ("roberta", "bert")] + \
             [M.ModelConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                            intermediate_size=32, model_type="modernbert", local_attention=8,
                            global_attn_every_n_layers=3, global_rope_theta=1e4, local_rope_theta=1e4)]:
        assert set(M.hf_key_map(c)) == set(M.Encoder(c).state_dict()), c.model_type


def test_bare_encoder_gets_fresh_head(tmp_path, capsys):
    hf = hf_tiny("roberta")
    save_with_tokenizer(hf.roberta, tmp_path)  # RobertaModel: no lm_head.*, keys without the roberta. prefix
    ours, _ = M.load_pretrained(str(tmp_path))
    assert "no MLM head" in capsys.readouterr().err
    # The fresh head is BERT's initialisation, the same at every load: N(0, 0.02) weights, zero biases, unit LayerNorm
    head = ours.mlm
    assert 0.015 < head.dense.weight.std() < 0.025 and abs(head.dense.weight.mean()) < 0.005
    assert not head.dense.bias.any() and not head.bias.any() and not head.ln.bias.any() and (head.ln.weight == 1).all()
    assert torch.equal(M.load_pretrained(str(tmp_path), quiet=True)[0].mlm.dense.weight, head.dense.weight)
    ids, mask = padded_batch(1)
    with torch.no_grad():
        r = mask.bool()
        ref = hf.roberta(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(ours(ids, mask)[r], ref[r], rtol=0, atol=1e-5)


def test_sharded_and_old_names(tmp_path):
    hf = hf_tiny("bert")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (tmp_path / "old").mkdir()
    sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v.contiguous()
          for k, v in hf.state_dict().items() if "decoder" not in k}
    save_file(sd, str(tmp_path / "old" / "model.safetensors"))
    (tmp_path / "old" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    ids, mask = padded_batch(0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    for d in ("sharded", "old"):
        (tmp_path / d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
        ours, _ = M.load_pretrained(str(tmp_path / d))
        with torch.no_grad():
            got = ours.mlm_logits(ours(ids, mask))
            torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_minilm_matches_sentence_transformers():
    """Every third of STS-B dev's 2,900 sentences (test_evaluate_sts scores all of them, against sentence-transformers'
    own score): our embeddings are sentence-transformers'."""
    path = minilm()
    st = oracle("sentence_transformers")
    sents = stsb_sentences()[::3]
    assert len(sents) > 900
    ref = st.SentenceTransformer(str(path), device="cpu").encode(sents, batch_size=64, convert_to_numpy=True)
    ours, tok = M.load_pretrained(str(path))
    emb = E.encode(sents, ours, tok)  # none of them is over the 256 tokens sentence-transformers keeps
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos.min()


def test_tokenizer_files_agree_and_do_not_pad(tmp_path):
    path = minilm()
    full = H.load_tokenizer(path)  # tokenizer.json pads to 128 on disk; that must not leak
    (tmp_path / "vocab.txt").write_bytes((path / "vocab.txt").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    wp = H.load_tokenizer(tmp_path)
    sents = stsb_sentences(300)
    a, b = full.encode_batch(sents), wp.encode_batch(sents)
    assert [e.ids for e in a] == [e.ids for e in b]
    assert min(len(e.ids) for e in a) < 20 and a[0].ids[0] == 101 and a[0].ids[-1] == 102

    bpe = H.train_tokenizer(sents * 3, 600)
    bpe.model.save(str(tmp_path))  # vocab.json + merges.txt, as roberta-base ships
    (tmp_path / "vocab.txt").unlink()
    gpt2 = H.load_tokenizer(tmp_path)
    texts = sents[:50] + ["a <mask> here", "  spaced   out  ", "naïve café"]
    assert [e.ids for e in bpe.encode_batch(texts)] == [e.ids for e in gpt2.encode_batch(texts)]


def test_truncation_keeps_the_end_token():
    tok = H.load_tokenizer(minilm())
    long, short = E.tokenize(["word " * 50, "short"], tok, 16).pieces
    assert len(long) == 16 and long[-1] == 102 and long[0] == 101
    assert len(short) == 3 and short[2] == 102


def test_scratch_saves_a_checkpoint_transformers_and_sentence_transformers_load(tmp_path):
    texts = [" ".join(f"w{i % 97} x{(i * 7) % 13}" for i in range(j, j + 300)) for j in range(40)]
    model, tok = from_scratch("tiny", texts, seed=0)
    assert model.config.vocab_size == tok.get_vocab_size() <= 4096
    sp = H.special_ids(tok)
    assert (sp["cls"], sp["pad"], sp["sep"]) == (0, 1, 2)
    M.save_pretrained(model, tok, tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    sent = ["w1 x7 w2", "w3 <mask> w4 x1 x2"]
    assert hf_tok(sent)["input_ids"] == [e.ids for e in tok.encode_batch(sent)]
    assert hf_tok.mask_token_id == sp["mask"] and hf_tok.pad_token_id == 1
    st = oracle("sentence_transformers")
    ref = st.SentenceTransformer(str(tmp_path), device="cpu").encode(sent, convert_to_tensor=True)
    torch.testing.assert_close(torch.from_numpy(E.encode(sent, model.eval(), tok)), ref, rtol=0, atol=1e-5)


def test_scratch_cli(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the cat sat on the mat. " * 200)
    M.main(["scratch", "--shape", "tiny", "--corpus", str(tmp_path / "docs"), "--out", str(tmp_path / "m")])
    m, tok = M.load_pretrained(str(tmp_path / "m"))
    assert m.config.num_hidden_layers == 2 and tok.token_to_id("<mask>") == 4


def test_convert_bin(tmp_path, capsys):
    hf = hf_tiny("roberta")
    save_with_tokenizer(hf, tmp_path / "m")
    sd = load_file(str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(sd, tmp_path / "m" / "pytorch_model.bin")  # what johngiorgi/declutr-small ships
    with pytest.raises(UserError, match="python model.py convert"):
        M.load_pretrained(str(tmp_path / "m"))
    M.main(["convert", str(tmp_path / "m")])
    ours, _ = M.load_pretrained(str(tmp_path / "m"))
    ids, mask = padded_batch(1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(ours(ids, mask)[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-5)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/declutr-pwned",))


def test_convert_refuses_code_in_pickles(tmp_path, capsys):
    save_with_tokenizer(hf_tiny("roberta"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}, protocol=2))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        M.main(["convert", str(tmp_path)])
    assert e.value.code == 1 and "weights_only" in capsys.readouterr().err
    assert not Path("/tmp/declutr-pwned").exists()


# --- bad input: one line on stderr, non-zero exit ----------------------------------------------------------


def bad(tmp_path, what):
    d = tmp_path / "m"
    if what == "missing-dir":
        return str(tmp_path / "nope/"), "no such folder"
    save_with_tokenizer(hf_tiny("roberta"), d)
    f = d / "model.safetensors"
    if what == "no-config":
        (d / "config.json").unlink()
        return str(d), "no config.json"
    if what == "no-weights":
        f.unlink()
        return str(d), "no model.safetensors"
    if what == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif what == "corrupt":
        f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(100))
    elif what == "shapes":
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "intermediate_size": 48}))
        return str(d), "has shape"
    elif what == "model-type":
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "model_type": "gpt2"}))
        return str(d), "model_type 'gpt2' is not supported (roberta, xlm-roberta, camembert, bert, modernbert)"
    return str(d), "not a readable safetensors file"


@pytest.mark.parametrize("what", ["missing-dir", "no-config", "no-weights", "truncated", "corrupt", "shapes",
                                  "model-type"])
def test_bad_checkpoints_give_one_line(tmp_path, capsys, what):
    path, expect = bad(tmp_path, what)
    capsys.readouterr()  # forget what building the checkpoint printed
    with pytest.raises(SystemExit) as e:
        M.main(["info", path])
    err = capsys.readouterr().err
    assert e.value.code == 1 and expect in err and err.count("\n") == 1 and err.startswith("error: "), err
