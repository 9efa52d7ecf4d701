"""
support/plot.py: a picture of training runs without TensorBoard, from their metrics.jsonl: the contrastive and MLM
losses (each step faint, a moving mean over it), the learning rate and STS-B dev (where it was evaluated; step 0 is
the model the run started from) against the steps, in one PNG. matplotlib draws it where it is installed (not a
requirement of this project: pip install matplotlib).

    python -m support.plot runs/demo                            # runs/demo/metrics.png
    python -m support.plot runs/a runs/b --output a-and-b.png   # runs on the same axes
"""
import sys
from dataclasses import dataclass
from pathlib import Path

from support.cli import UserError, cli, flag, parse_config, say
from support.files import write_atomic
from support.metrics import METRICS, read_metrics
from support.retrieval import NAMES


@dataclass
class PlotConfig:
    runs: list = flag(list, "run folders (each holds a metrics.jsonl)")
    output: str = flag("", "the PNG; default: metrics.png in the (first) run folder")
    smooth: int = flag(0, "steps in the moving mean of the losses; 0: a 50th of the run, at least 1", low=0)


def moving_mean(values: list[float], k: int) -> list[float]:
    """The mean of each value and the k - 1 before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def draw(runs: dict[str, list[dict]], output: Path, smooth: int = 0):
    """runs: each run's name and records (support/metrics.py) -> a 2 x 2 figure in `output`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no screen is needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    spans_only = not any(r.get("stsb_dev_spearman") is not None for rs in runs.values() for r in rs)
    panels = [("contrastive", "contrastive loss (NT-Xent)"), ("mlm", "MLM loss"), ("lr", "learning rate"),
              ("spans_mrr", "held-out span retrieval, MRR × 100") if spans_only and any(
                  "spans_mrr" in r for rs in runs.values() for r in rs) else
              ("stsb_dev_spearman", "STS-B dev, Spearman × 100")]
    for (key, title), ax in zip(panels, axes.flat, strict=True):
        for k, (name, records) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            color = f"C{k}"
            if key in ("contrastive", "mlm"):  # one step's loss is noisy: each faint, their moving mean drawn
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                values = moving_mean(list(values), smooth or max(1, len(values) // 50))
            evaluated = key in ("stsb_dev_spearman", "spans_mrr")
            ax.plot(steps, values, color=color, label=name, marker="o" if evaluated else None, linewidth=1.5)
            for r in records if key == "spans_mrr" else []:  # word overlap's, the bars an encoder must clear
                for word, style in (("bm25", "--"), ("tfidf", ":")):
                    if r.get(f"{word}_spans_mrr") is not None:
                        ax.axhline(r[f"{word}_spans_mrr"], color=color, linestyle=style, linewidth=1,
                                   label=f"{name}: {NAMES[word]}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not evaluated (train.py --eval-data, --holdout-docs)" if key == "stsb_dev_spearman"
                    else "no steps",
                    ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
        elif len(runs) > 1 or key == "spans_mrr":
            ax.legend(fontsize=8)
    if len(runs) == 1:
        fig.suptitle(next(iter(runs)))
    write_atomic(output, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


@cli
def main(argv=None):
    cfg = parse_config(PlotConfig, argv, __doc__.split("\n\n")[0], positional=("runs",))
    runs = {}
    for folder in map(Path, cfg.runs):
        if not (folder / METRICS).is_file():
            raise UserError(f"{folder}: no {METRICS} here; name a run folder (train.py's --out)")
        runs[str(folder)] = read_metrics(folder)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("the plot is drawn with matplotlib, which is not installed: pip install matplotlib") from None
    output = Path(cfg.output or Path(cfg.runs[0]) / "metrics.png")
    if not output.parent.is_dir():
        raise UserError(f"--output {output}: its folder {output.parent} is not there")
    draw(runs, output, cfg.smooth)
    say(f"wrote {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
