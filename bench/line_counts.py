"""
Lines per file, and for each method file the lines that teach DeCLUTR against the machinery around them, counted
the same way at any revision: each top-level function or class (with its decorators and the comments right above
it) is method when its name is in METHOD below, machinery otherwise, as is every other statement (imports,
constants); the module docstring and blank lines are counted apart.

    python bench/line_counts.py                 # the working tree
    python bench/line_counts.py --rev HEAD~3    # a revision, read with git show
"""
import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import bench  # noqa: E402

# The method, by name: what a reader of the paper comes for. Kept as it was when the layout changed (issue 33), so
# that before and after are counted alike, with the new names of the same things (issue 39: Packing, the Fig. 2
# views, mlm_mean_weight; issue 68: attention, ModernBERT's own layers; issue 70:
# held-out span retrieval, which issue 77 moved to evaluate_sts.py); a name not found in a file counts nothing.
METHOD = {
    "sampler": {"SamplerConfig", "span_length", "sample_spans", "positive_span", "mask_tokens", "SpanBatches",
                "subsumed", "adjacent", "overlapping", "POSITIVE_VIEWS", "heldout_pair", "heldout_pairs"},
    "model": {"ModelConfig", "ACTIVATIONS", "GELU_TANH", "Embeddings", "SelfAttention", "FeedForward", "Layer",
              "MLMHead", "Encoder", "mean_pool", "nonpad_positions", "hf_key_map", "Packing", "chunk_forward",
              "ChunkedEncoder", "SHORT_ROWS", "attention", "ModernEmbeddings", "rotary", "ModernAttention", "GeGLU",
              "ModernLayer", "modernbert_key_map"},
    "loss": {"nt_xent", "gather", "_Gather"},
    "train": {"TrainConfig", "train_step", "contrastive_loss", "mlm_scale", "scaled", "step_stats", "chunk_forward",
              "mlm_mean_weight",
              "ChunkedEncoder", "unwrap", "grad_cache_step", "accumulate_locally", "lr_at", "make_optimizer",
              "load_optimizer", "optimizer_step", "Run", "train"},
    "embed": {"_segments", "Tokenized", "tokenize", "encode", "embed_tokenized", "_embed", "length_batches"},
    "evaluate_sts": {"rankdata", "pearson", "spearman", "cosines", "_mean", "score", "correlations", "spearman_of",
                     "SPAN_GAP", "span_texts", "span_retrieval", "heldout_pair", "heldout_pairs", "Span", "Pair",
                     "span_lengths", "character_offsets"},
}


def source(path: str, rev: str) -> str | None:
    if not rev:
        return (ROOT / path).read_text() if (ROOT / path).exists() else None
    out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def count(text: str, method: set) -> dict:
    lines = text.splitlines()
    kind = ["machinery"] * len(lines)
    tree = ast.parse(text)
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        for i in range(body[0].lineno - 1, body[0].end_lineno):
            kind[i] = "docstring"
        body = body[1:]
    for node in body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if not set(names) & method:
            continue
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1
        while start > 0 and lines[start - 1].lstrip().startswith("#"):  # the comment that introduces it
            start -= 1
        for i in range(start, node.end_lineno):
            kind[i] = "method"
    for i, line in enumerate(lines):
        if not line.strip():
            kind[i] = "blank"
    return {k: kind.count(k) for k in ("method", "machinery", "docstring", "blank")} | {"total": len(lines)}


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="", help="a git revision (default: the working tree)")
    a = ap.parse_args()
    files = sorted({f"{m}.py" for m in METHOD} | {"common.py", "hub.py"} |
                   {f"support/{p.name}" for p in (ROOT / "support").glob("*.py")})
    if a.rev:
        listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", a.rev], cwd=ROOT, capture_output=True,
                                text=True).stdout.split()
        files = sorted(set(files) | {f for f in listed if f.startswith("support/") and f.endswith(".py")})
    print("| file | lines | method | machinery | docstring | blank |\n|---|---|---|---|---|---|")
    total = 0
    for f in files:
        text = source(f, a.rev)
        if text is None:
            continue
        c = count(text, METHOD.get(Path(f).stem, set()) if "/" not in f else set())
        total += c["total"]
        print(f"| {f} | {c['total']} | {c['method']} | {c['machinery']} | {c['docstring']} | {c['blank']} |")
    print(f"| all | {total} | | | | |")


if __name__ == "__main__":
    main()
