"""
support/card.py: the model card a run writes beside each model it hands over (out/model/README.md and
out/best/README.md), which a reader of the method can skip. First the YAML front matter the Hugging Face hub reads
(the library, the pipeline, tags, the base model where the run started from a hub model, the STS-B dev score where it
was evaluated; the licence is the user's to add), then what DeCLUTR did to the model, the run's configuration beside
the paper's, what it saw, its losses and scores, where it ran, and how to load it. Everything in it comes from the
run (its config, metrics.jsonl, its checkpoints' record of where it ran) and the model folder's own files; nothing
else is said. `hf upload USER/NAME runs/x/model` publishes the card with the weights.
"""
import json
from dataclasses import asdict, fields
from pathlib import Path

from support.files import write_atomic
from support.retrieval import NAMES

BEST_BY = {"stsb_dev_spearman": "STS-B dev", "spans_mrr": "held-out span retrieval's MRR"}  # cfg.best_key's words

# The method's settings (§3.1-3.3, §4), in the order the card lists them; every other field is how the run ran
METHOD = ("docs_per_step", "num_anchors", "num_positives", "min_span", "max_span", "positive_view", "mlm_probability",
          "temperature", "mlm", "contrastive", "lr", "weight_decay", "warmup_frac", "lr_ratio", "max_grad_norm")
PAPER = "Giorgi et al., DeCLUTR: Deep Contrastive Learning for Unsupervised Textual Representations, ACL 2021"
CITATION = """@inproceedings{giorgi-etal-2021-declutr,
    title = {{D}e{CLUTR}: Deep Contrastive Learning for Unsupervised Textual Representations},
    author = {Giorgi, John and Nitski, Osvald and Wang, Bo and Bader, Gary},
    booktitle = {Proceedings of the 59th Annual Meeting of the Association for Computational Linguistics},
    year = {2021},
    pages = {879--895},
    url = {https://aclanthology.org/2021.acl-long.72}
}"""


def write_card(folder: Path, cfg, records: list[dict], machines: list[dict], documents: int, total: int,
               best: bool = False):
    """README.md in a model folder that save_pretrained has written: cfg the run's config (a dataclass whose field
    defaults are the paper's settings), records its metrics.jsonl up to this model's step, machines where its steps
    ran (support/runs.machines), documents the corpus's count, total the run's planned steps; best: the folder is
    the run's best model by cfg.best_key's figure (--best-by)."""
    steps = [r for r in records if r["step"] > 0 and "contrastive" in r]
    step = steps[-1]["step"] if steps else 0
    model = json.loads((folder / "config.json").read_text())
    sbert = json.loads((folder / "sentence_bert_config.json").read_text())
    scores = {r["step"]: r["stsb_dev_spearman"] for r in records if r.get("stsb_dev_spearman") is not None}
    picked = {r["step"]: r[cfg.best_key] for r in records if r.get(cfg.best_key) is not None} if best else {}
    text = "\n\n".join([front_matter(folder, cfg, scores.get(step)),
                        summary(folder, cfg, model, sbert, step, total, picked),
                        training(cfg, steps, documents, machines),
                        evaluation(folder, cfg, scores, step) + spans(cfg, records, step),
                        usage(folder, sbert), f"## Citation\n\n```bibtex\n{CITATION}\n```"]) + "\n"
    write_atomic(folder / "README.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def base_model(start: str) -> str | None:
    """The hub id a run started from (train.py stores it as id@commit), or None for a local folder or scratch."""
    return start.partition("@")[0] if "@" in start and not Path(start).exists() else None


def front_matter(folder: Path, cfg, score: float | None) -> str:
    lines = ["---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity", "tags:"]
    lines += [f"- {t}" for t in ("declutr", "sentence-transformers", "sentence-similarity", "feature-extraction",
                                 "sentence-embeddings")]
    if base := base_model(cfg.model):
        lines.append(f"base_model: {base}")
    if score is not None:  # the hub's evaluation results: Spearman of cosine on STS-B dev, as sentence-transformers
        lines += ["model-index:", f"- name: {json.dumps(folder.resolve().parent.name + '/' + folder.name)}",
                  "  results:", "  - task:", "      type: semantic-similarity", "      name: Semantic Similarity",
                  "    dataset:", "      name: STS Benchmark (dev)", "      type: sentence-transformers/stsb",
                  "      split: validation", "    metrics:", "    - type: spearman_cosine",
                  f"      value: {score / 100:.4f}", "      name: Spearman Cosine"]
    return "\n".join(lines + ["---"])


def started_from(start: str) -> str:
    if start.startswith("scratch:"):
        return (f"a randomly initialised RoBERTa of the `{start[8:]}` shape (`--model {start}`), with a byte-level BPE "
                f"tokenizer trained on the run's documents")
    if base := base_model(start):
        return f"[`{base}`](https://huggingface.co/{base}) (commit `{start.partition('@')[2][:12]}`)"
    return f"the local model `{start}`"


def summary(folder: Path, cfg, model: dict, sbert: dict, step: int, total: int, scores: dict) -> str:
    best = (f" It is the run's best model by {BEST_BY[cfg.best_key]} ({scores[step]:.2f}), kept at step {step:,} of "
            f"{total:,}." if step in scores else "")  # scores: given for the best model only
    return (f"# {folder.resolve().parent.name}/{folder.name}\n\n"
            f"A sentence encoder trained with DeCLUTR ({PAPER}) for {plural(step, 'step')}, starting from "
            f"{started_from(cfg.model)}.{best} It maps a text of up to {sbert['max_seq_length']} tokens to a "
            f"{model['hidden_size']}-dimensional vector, the mean of its last layer's token states "
            f"({model['model_type']}, {model['num_hidden_layers']} layers), to compare by cosine similarity: "
            f"semantic similarity, search, clustering.\n\n"
            "DeCLUTR continues the pretraining of an encoder on unlabelled documents. From each document it samples "
            "a few long *anchor* spans and, for each anchor, a few shorter *positive* spans that overlap it, adjoin "
            "it or lie inside it. The encoder mean-pools every span into one vector, and a contrastive loss "
            "(NT-Xent) pulls each anchor towards the mean of its positives and away from every other span in the "
            "batch, while masked language modelling on the anchors, in the same forward pass, keeps what the "
            "encoder knows of language. In the paper, roberta-base continued this way on 497,868 OpenWebText "
            "documents went from 58.55 to 72.41 Spearman on STS-B.\n\n"
            "No licence is set here: add `license:` to the front matter before publishing, as the starting model's "
            "and the documents' licences allow.")


def plural(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def value(v) -> str:
    return f"`{v:g}`" if isinstance(v, float) else f"`{v}`"


def training(cfg, steps: list[dict], documents: int, machines: list[dict]) -> str:
    paper = {f.name: f.default for f in fields(cfg)}
    helps = {f.name: f.metadata.get("help", "") for f in fields(cfg)}
    n = len(steps)
    drawn = n * cfg.docs_per_step
    out = ["## Training", "",
           f"- **Documents**: {documents:,} (`--data {' '.join(map(str, cfg.data))}`); {n:,} steps of "
           f"{cfg.docs_per_step} drew {drawn:,} documents and {sum(r.get('tokens', 0) for r in steps):,} tokens "
           f"in spans."]
    if steps:
        last = steps[-min(n, 50):]  # one step's loss is noisy: the mean of the last ones beside it
        mean = {k: sum(r[k] for r in last) / len(last) for k in ("contrastive", "mlm")}
        out.append(f"- **Losses** at step {steps[-1]['step']:,}: contrastive {steps[-1]['contrastive']:.4f}, MLM "
                   f"{steps[-1]['mlm']:.4f} (means over its last {len(last)} steps: {mean['contrastive']:.4f} and "
                   f"{mean['mlm']:.4f}); at step {steps[0]['step']:,}: {steps[0]['contrastive']:.4f} and "
                   f"{steps[0]['mlm']:.4f}.")
    ends = [m["from_step"] for m in machines[1:]] + [steps[-1]["step"] if steps else 0]
    for m, end in zip(machines, ends, strict=True):
        if end > m["from_step"]:
            where = f"{plural(m['world'], 'process', 'processes')} on {plural(m['machines'], 'machine')}"
            out.append(f"- **Steps {m['from_step'] + 1:,}-{end:,}** ran on {where}: {m['device']}, {m['dtype']}.")
    out += ["", "The method's settings (`train.py` flags), the paper's beside them; those this run changed in bold:",
            "", "| flag | this run | the paper | what |", "|---|---|---|---|"]
    for name in METHOD:
        ours, theirs = getattr(cfg, name), paper[name]
        mark = "**" if ours != theirs else ""
        out.append(f"| `--{name.replace('_', '-')}` | {mark}{value(ours)}{mark} | {value(theirs)} | {helps[name]} |")
    out += ["", "<details><summary>The whole configuration, as the checkpoints store it</summary>", "", "```json",
            json.dumps(asdict(cfg), indent=2, default=str), "```", "", "</details>"]
    return "\n".join(out)


def evaluation(folder: Path, cfg, scores: dict, step: int) -> str:
    out = ["## Evaluation", ""]
    if not scores:
        return "\n".join(out + ["Not evaluated during the run (`--eval-data`). To score it on STS-B dev:", "",
                                "```bash", f"python evaluate_sts.py --model {folder} --split dev --data STSB_FOLDER",
                                "```"])
    out.append(f"STS-B dev, Spearman × 100 of the cosine similarity of each pair (`--eval-data {cfg.eval_data}`):")
    out.append("")
    if 0 in scores:
        out.append(f"- the model the run started from: {scores[0]:.2f}")
    if step in scores:
        out.append(f"- this model (step {step:,}): {scores[step]:.2f}")
    later = {s: v for s, v in scores.items() if s > 0}
    if later:
        top = max(later, key=later.get)
        out.append("- every evaluation: " + ", ".join(f"{v:.2f} (step {s:,})" for s, v in sorted(later.items())) +
                   f"; the best {later[top]:.2f}, at step {top:,}")
    return "\n".join(out)


def spans(cfg, records: list[dict], step: int) -> str:
    """Held-out span retrieval (--eval-docs, --holdout-docs): the start's, word overlap's, this model's, and every
    evaluation's MRR."""
    rows = {r["step"]: r for r in records if r.get("spans_mrr") is not None}
    if not rows:
        return ""
    where = f"`--eval-docs {' '.join(cfg.eval_docs)}`" if cfg.eval_docs else f"`--holdout-docs {cfg.holdout_docs}`"
    out = ["", "", f"Held-out span retrieval on the run's own documents ({where}, {cfg.span_pairs:,} pairs at most): "
           "each query span's target, a span near it in the same document sharing no text, among every target, "
           "by cosine; MRR, recall@1 and recall@10 × 100:", ""]

    def figures(r, prefix="spans_"):
        return (f"{r[prefix + 'mrr']:.2f}, {r[prefix + 'recall_at_1']:.2f}, {r[prefix + 'recall_at_10']:.2f} "
                f"({r[prefix + 'n']:,} pairs)")

    if 0 in rows:
        out.append(f"- the model the run started from: {figures(rows[0])}")
        if "bm25_spans_mrr" in rows[0]:
            out.append(f"- word overlap, Okapi BM25 of the spans' words: {figures(rows[0], 'bm25_spans_')}")
        if "tfidf_spans_mrr" in rows[0]:
            out.append(f"- word overlap, TF-IDF cosine of the spans' words: {figures(rows[0], 'tfidf_spans_')}")
        if "spans_bar" in rows[0]:
            bar = rows[0]["spans_bar"]
            out.append(f"- the bar to beat: {NAMES[bar]}, the stronger word baseline (MRR "
                       f"{rows[0][f'{bar}_spans_mrr']:.2f})")
    if step in rows:
        out.append(f"- this model (step {step:,}): {figures(rows[step])}")
    later = {s: r["spans_mrr"] for s, r in rows.items() if s > 0}
    if later:
        out.append("- MRR at every evaluation: " + ", ".join(f"{v:.2f} (step {s:,})" for s, v in sorted(later.items())))
    return "\n".join(out)


def usage(folder: Path, sbert: dict) -> str:
    return f"""## Usage

`MODEL` is this folder (`{folder}`), or its hub id once uploaded. With this project:

```bash
python embed.py --model MODEL sentences.txt --output embeddings.npy --normalize
python evaluate_sts.py --model MODEL --split dev --data STSB_FOLDER
```

With [sentence-transformers](https://www.sbert.net) (mean pooling is in the folder's `modules.json`):

```python
from sentence_transformers import SentenceTransformer

model = SentenceTransformer("MODEL")
embeddings = model.encode(["A man is playing a guitar.", "Someone plays music."])
print(model.similarity(embeddings, embeddings))
```

With [transformers](https://huggingface.co/docs/transformers): the mean of the last layer's token states over the
attention mask, up to {sbert['max_seq_length']} tokens:

```python
import torch
from transformers import AutoModel, AutoTokenizer

tokenizer, model = AutoTokenizer.from_pretrained("MODEL"), AutoModel.from_pretrained("MODEL")
batch = tokenizer(["A man is playing a guitar.", "Someone plays music."], padding=True, truncation=True,
                  max_length={sbert['max_seq_length']}, return_tensors="pt")
with torch.no_grad():
    states = model(**batch).last_hidden_state                      # (texts, tokens, hidden)
mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
embeddings = (states * mask).sum(1) / mask.sum(1)                  # (texts, hidden)
```

With [MTEB](https://github.com/embeddings-benchmark/mteb): `mteb.evaluate(SentenceTransformer("MODEL"), tasks)`."""
