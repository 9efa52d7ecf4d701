"""
bench/mteb_stsb.py: the README's MTEB route checked where MTEB's own data is out of reach. Each model folder is
loaded as a SentenceTransformer and scored by mteb.evaluate on MTEB's STSBenchmark task, whose data is set from a
local sts-dev.csv, beside evaluate_sts.py's score of the same folder in fp32: the two should agree.

    pip install mteb      # not a requirement of this project, nor of its tests
    python bench/mteb_stsb.py runs/demo/model ../shared/models/all-MiniLM-L6-v2 --stsb ../shared/data/sts/stsbenchmark
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import evaluate_sts  # noqa: E402
import model  # noqa: E402
from support.cli import bench, optional  # noqa: E402
from support.sts_files import load_stsb_dev  # noqa: E402


def mteb_scores(folder: str, stsb_dev: Path) -> dict:
    import mteb
    from datasets import Dataset, DatasetDict
    from sentence_transformers import SentenceTransformer

    rows = [line.split("\t") for line in stsb_dev.read_text(encoding="utf-8").splitlines()]
    data = {"sentence1": [r[5] for r in rows], "sentence2": [r[6] for r in rows], "score": [float(r[4]) for r in rows]}
    task = mteb.get_task("STSBenchmark")
    task.dataset, task.data_loaded = DatasetDict({"test": Dataset.from_dict(data)}), True  # the local file, as "test"
    result = mteb.evaluate(SentenceTransformer(folder, device="cpu"), [task], cache=None, show_progress_bar=False)
    return result.task_results[0].scores["test"][0]


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model folders")
    ap.add_argument("--stsb", default="../shared/data/sts/stsbenchmark", help="folder holding sts-dev.csv")
    a = ap.parse_args()
    for module in ("mteb", "datasets", "sentence_transformers"):  # not requirements of this project
        optional(module, module.replace("_", "-"))
    pairs = load_stsb_dev(a.stsb)
    print(f"{'model':40s}  {'MTEB Spearman':>13s}  {'ours':>6s}  {'MTEB Pearson':>12s}")
    for folder in a.models:
        theirs = mteb_scores(folder, Path(a.stsb) / "sts-dev.csv")
        ours = evaluate_sts.spearman_of(*model.load_pretrained(folder, quiet=True), pairs)
        print(f"{folder:40s}  {theirs['cosine_spearman'] * 100:13.2f}  {ours:6.2f}  "
              f"{theirs['cosine_pearson'] * 100:12.2f}", flush=True)


if __name__ == "__main__":
    main()
