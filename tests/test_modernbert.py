"""model.py's ModernBERT against transformers' ModernBertForMaskedLM on the same random weights (fp32): hidden states
and MLM logits of texts longer than the local window, a training step's loss and gradients, saving back, and
sentence-transformers loading what we save; train.py, embed.py and evaluate_sts.py on it; its config refusals."""
import json

import numpy as np
import pytest
import torch

import embed as E
import model as M
import train as T
from conftest import WORDS, oracle, synthetic_batch
from loss import nt_xent

transformers = oracle("transformers")

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # ModernBERT's names, as its tokenizer.json has them
WINDOW = 16  # local_attention: layers 1, 2, 4 attend within 8 tokens either side; 0 and 3 globally


def modernbert_tokenizer():
    """A byte-level BPE laid out as ModernBERT's: [CLS] text [SEP], its specials under its own names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(0)
    texts = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 200)) for _ in range(20)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def hf_modernbert(seed=0, vocab=300, layers=5, **overrides):
    """transformers' ModernBertForMaskedLM, tiny, every weight randomised (its norms start at 1, its decoder bias at
    0: a swap would not show), with [UNK] [CLS] [SEP] [PAD] [MASK] at ids 0-4 as modernbert_tokenizer() has them."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                 num_attention_heads=4,
                 local_attention=WINDOW, global_attn_every_n_layers=3, max_position_embeddings=512)
    ids = dict(pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    cfg = transformers.ModernBertConfig(**{**shape, **ids, **overrides})
    m = transformers.ModernBertForMaskedLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def saved(hf, d):
    hf.save_pretrained(d)
    modernbert_tokenizer().save(str(d / "tokenizer.json"))
    return d


def padded(lengths, pad=3, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids, mask = torch.full((len(lengths), max(lengths)), pad), torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.randint(5, vocab, (n,), generator=g), 1
    return ids, mask


@pytest.mark.parametrize("lengths", [[70, 9, 33, 2], [40, 40]])  # padded, and a batch with none
def test_hidden_states_and_mlm_logits_match_transformers(tmp_path, lengths):
    hf = hf_modernbert()
    ours, _ = M.load_pretrained(str(saved(hf, tmp_path)))
    ids, mask = padded(lengths)
    assert max(lengths) > WINDOW  # the local layers' window cuts the longer texts
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        h = ours(ids, mask)
    r = mask.bool()
    torch.testing.assert_close(h[r], ref.hidden_states[-1][r], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.mlm_logits(h[r]), ref.logits[r], rtol=0, atol=1e-5)
    assert not h[~r].any()  # padding is zeros, as on every other encoder here


def test_a_train_step_gives_transformers_loss_and_gradients(tmp_path):
    """train.train_step (chunks, packing, mean pooling, NT-Xent, MLM) against the same objective written on
    transformers' model, span by span: every loss and every weight's gradient."""
    hf = hf_modernbert(seed=2)
    ours, _ = M.load_pretrained(str(saved(hf, tmp_path)))
    batch = synthetic_batch(3, pad=3, cls=1, sep=2, mask=4, anchor_len=(20, 60), positive_len=(5, 30))
    cfg = T.TrainConfig(chunk_tokens=300)
    stats = T.train_step(T.ChunkedEncoder(ours.train()), batch, cfg)
    hf.train()
    n = len(batch["anchors"])

    def embed(ids, lengths):
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        out = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return M.mean_pool(out.hidden_states[-1], mask), out.logits

    anchors, logits = embed(batch["mlm_inputs"], batch["anchor_lengths"])
    positives, _ = embed(batch["positives"], batch["positive_lengths"])
    contrastive = nt_xent(anchors, positives.view(n, cfg.num_positives, -1), cfg.temperature)
    masked = batch["mlm_labels"] != -100
    mlm = torch.nn.functional.cross_entropy(logits[masked], batch["mlm_labels"][masked])
    (contrastive + mlm).backward()
    assert float(stats["contrastive"]) == pytest.approx(contrastive.item(), abs=1e-5)
    assert float(stats["mlm"]) == pytest.approx(mlm.item(), abs=1e-5)
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        (source,) = M.hf_key_map(ours.config)[name]
        torch.testing.assert_close(p.grad, theirs[source].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_saved_loads_in_transformers_and_sentence_transformers_unchanged(tmp_path):
    st = oracle("sentence_transformers")
    ours, tok = M.load_pretrained(str(saved(hf_modernbert(seed=3), tmp_path / "a")))
    with torch.no_grad():  # away from the source weights, so that what is checked is our saving
        for p in ours.parameters():
            p.mul_(1.5)
    M.save_pretrained(ours, tok, tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["architectures"] == ["ModernBertForMaskedLM"] and config["global_attn_every_n_layers"] == 3
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "b").eval()
    ids, mask = padded([70, 9, 33])
    with torch.no_grad():
        h, ref = ours(ids, mask), back(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    r = mask.bool()
    torch.testing.assert_close(h[r], ref.hidden_states[-1][r], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.mlm_logits(h[r]), ref.logits[r], rtol=0, atol=1e-5)
    again, _ = M.load_pretrained(str(tmp_path / "b"))
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    texts = [" ".join(WORDS * 3), "the lazy dog", "seven wizards judge boxing matches while the quick fox jumps"]
    theirs = st.SentenceTransformer(str(tmp_path / "b"), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(torch.from_numpy(E.encode(texts, ours, tok)), theirs, rtol=0, atol=1e-5)


def test_train_embed_and_spans_past_512_tokens(tmp_path, docs):
    """train.py continues a ModernBERT with anchors of up to 1,024 tokens, a length no 512-position encoder takes;
    embed.py cuts a text at the model's own maximum."""
    src = saved(hf_modernbert(layers=2, max_position_embeddings=2048), tmp_path / "src")
    long_docs = tmp_path / "docs"
    long_docs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        (long_docs / f"{i}.txt").write_text(" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 5000)))
    T.main(["--model", str(src), "--data", str(long_docs), "--out", str(tmp_path / "run"), "--steps", "2",
            "--docs-per-step", "2", "--min-span", "600", "--max-span", "1024", "--workers", "0",
            "--cache-dir", str(tmp_path / "cache"), "--chunk-tokens", "2048"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(np.isfinite(r["contrastive"] + r["mlm"]) for r in records)
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "run" / "model")
    assert type(back).__name__ == "ModernBertForMaskedLM"
    ours, tok = M.load_pretrained(str(tmp_path / "run" / "model"))
    text = " ".join(WORDS * 400)  # ~6,000 tokens
    assert len(tok.encode(text).ids) > 2048
    cut = tok.decode(tok.encode(text).ids[1:2047])
    np.testing.assert_allclose(E.encode([text], ours, tok), E.encode([cut], ours, tok), rtol=0, atol=1e-6)
    # evaluate_sts.py scores it: the Spearman of the cosines embed.encode gives, worked out here with scipy's rank
    rng = np.random.default_rng(1)
    rows = [(" ".join(rng.choice(WORDS, 6)), " ".join(rng.choice(WORDS, 9)), rng.uniform(0, 5)) for _ in range(30)]
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{i}\t{s:.2f}\t{a}\t{b}\n"
                                                          for i, (a, b, s) in enumerate(rows)))
    import evaluate_sts
    spearmanr = oracle("scipy.stats").stats.spearmanr  # __import__ gives the package

    evaluate_sts.main(["--model", str(tmp_path / "run" / "model"), "--data", str(tmp_path / "sts"), "--split", "dev",
                       "--dtype", "fp32", "--json", str(tmp_path / "sts.json")])
    a, b = E.encode([r[0] for r in rows], ours, tok), E.encode([r[1] for r in rows], ours, tok)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    want = 100 * spearmanr(cos, [round(r[2], 2) for r in rows]).statistic
    assert json.loads((tmp_path / "sts.json").read_text())["STSB"]["spearman"] == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("change, says", [
    ({"mlp_bias": True}, "mlp_bias True is not supported"),
    ({"classifier_activation": "silu"}, "classifier_activation 'silu' is not supported"),
    ({"layer_types": ["full_attention", "full_attention", "sliding_attention"]}, "layer_types is not every n-th"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}}, "rope_type 'yarn'"),
])
def test_a_modernbert_variant_it_does_not_build_is_one_line(tmp_path, capsys, change, says):
    d = saved(hf_modernbert(layers=3), tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        M.main(["info", str(d)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and says in err and err.count("\n") == 1 and err.startswith(f"error: {d}"), err


def test_transformers_4_config_names_load_the_same(tmp_path):
    """A config.json as transformers 4 wrote it (global_attn_every_n_layers and the two rope thetas, no layer_types
    or rope_parameters), as the hub's ModernBERT checkpoints have it, gives the same model."""
    hf = hf_modernbert(global_rope_theta=1000.0, local_rope_theta=50.0)  # not the defaults: a miss would show
    d = saved(hf, tmp_path)
    config = json.loads((d / "config.json").read_text())
    thetas = {k: config["rope_parameters"][v]["rope_theta"] for k, v in
              (("global_rope_theta", "full_attention"), ("local_rope_theta", "sliding_attention"))}
    old = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    (d / "config.json").write_text(json.dumps({**old, **thetas, "global_attn_every_n_layers": 3}))
    ours, _ = M.load_pretrained(str(d))
    ids, mask = padded([70, 9])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(ours(ids, mask)[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-5)
