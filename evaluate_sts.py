"""
evaluate_sts.py: semantic textual similarity, the evaluation of the paper's Appendix C (via SentEval).

Each task gives sentence pairs with gold similarity scores; a model's score is the Spearman correlation x 100
between the gold scores and the cosine of the two sentences' mean-pooled embeddings (Pearson beside it).
Tasks are found under --data by their original file layouts: the STS Benchmark (sts-dev.csv, sts-test.csv),
SICK-R (SICK_trial.txt, SICK_test_annotated.txt, or SICK.txt) and SemEval STS12-16 (folders STS12 ... or
SentEval's STS12-en-test ..., with STS.input.NAME.txt beside STS.gs.NAME.txt). STS12-16 are reported two
ways: "all", every subset's pairs pooled (as SimCSE reports), and "mean", the mean over subsets (as SentEval
and the DeCLUTR paper report).

    python evaluate_sts.py --model sentence-transformers/all-MiniLM-L6-v2 --data sts/ --split dev
    python evaluate_sts.py --model runs/a/model --model runs/b/model --data SentEval/data/downstream/STS --json out.json
    python evaluate_sts.py --model runs/a/model --split test      # no --data: downloads the STS Benchmark once
"""
import io
import os
import re
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embed import device_and_dtype, encode
from model import load_pretrained
from support.cli import Progress, UserError, bounded, choice, cli, parse_config
from support.device import OnDevice, cpu_threads
from support.files import cache_dir, files_under, make_dirs, offline, write_atomic, write_json

STSB_URL = "https://ixa2.si.ehu.eus/stswiki/images/4/48/Stsbenchmark.tar.gz"


@dataclass
class EvalConfig(OnDevice):  # --dtype, --device and --threads as embed.py's (support.device.OnDevice), then these
    model: list = field(default_factory=list)  # one or more models (hub ids or local directories), side by side
    data: str = ""  # folder holding the task files (searched recursively); empty: download the STS Benchmark
    tasks: list = field(default_factory=list)  # subset of STSB SICKR STS12 STS13 STS14 STS15 STS16 (default: all found)
    split: str = choice("test", "dev")  # STS12-16 have only test data
    json: str = ""  # also write the scores here
    batch_tokens: int = bounded(0, 0)  # embed.py's token budget per batch (0: its default)

    def validate(self):
        if unknown := [t for t in self.tasks if t not in TASKS]:
            raise UserError(f"--tasks {unknown[0]}: not a task (one of {', '.join(TASKS)})", code=2)


TASKS = ("STSB", "SICKR", "STS12", "STS13", "STS14", "STS15", "STS16")


# -----------------------------------------------------------------------------------------------
# Scoring: Spearman of cosine similarities against the gold scores


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks from 1; tied values share the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    xs, ranks = x[order], np.empty(len(x))
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2
    return ranks


def pearson(x, y) -> float:
    """nan where it is undefined (fewer than two pairs, or a constant side), as a correlation should be."""
    x, y = np.asarray(x, float) - np.mean(x), np.asarray(y, float) - np.mean(y)
    den = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if len(x) > 1 and den > 0 else float("nan")


def spearman(x, y) -> float:
    return pearson(rankdata(np.asarray(x, float)), rankdata(np.asarray(y, float)))


def cosines(model, tok, a, b, batch_tokens=0, progress=None, dtype=None) -> np.ndarray:
    uniq = list(dict.fromkeys(a + b))  # each sentence embedded once
    done = [0]

    def report(texts: int, windows: int):
        done[0] += texts
        progress(f"{done[0]:,}/{len(uniq):,} sentences")

    emb = encode(uniq, model, tok, batch_tokens=batch_tokens, normalize=True, dtype=dtype,
                 progress=report if progress else None)
    where = {s: i for i, s in enumerate(uniq)}
    return (emb[[where[s] for s in a]] * emb[[where[s] for s in b]]).sum(1)


def _mean(values) -> float:
    """Mean over the subsets that have a score (a subset of one scored pair has none)."""
    v = [x for x in values if not np.isnan(x)]
    return float(np.mean(v)) if v else float("nan")


FEW = 100  # pairs: below this a correlation is marked, not reported as a result
WHY_FEW = (f"* fewer than {FEW} pairs: over so few pairs one pair more or less moves a correlation by points; "
           f"it is not a score to compare")


def score(model, tok, tasks, batch_tokens=0, progress=None, dtype=None) -> dict:
    """{task: scores}; a task or subset of fewer than FEW pairs carries few_pairs: true."""
    out = {}
    for task, subsets in tasks.items():
        cos, per = {}, {}
        for name, (a, b, gold) in subsets.items():
            if progress:
                progress.note(f"{task} {name}".strip() + f", {len(gold):,} pairs")
            cos[name] = cosines(model, tok, a, b, batch_tokens, progress, dtype)
            per[name] = correlations(cos[name], gold)
        if list(per) == [""]:  # one set of pairs (STS-B, SICK-R)
            out[task] = per[""]
            continue
        # STS12-16: every subset's pairs pooled ("all", as SimCSE), and the mean over subsets (as SentEval)
        pooled, gold = np.concatenate(list(cos.values())), np.concatenate([g for *_, g in subsets.values()])
        out[task] = {"all": 100 * spearman(pooled, gold), "mean": _mean(p["spearman"] for p in per.values()),
                     "pearson_all": 100 * pearson(pooled, gold),
                     "pearson_mean": _mean(p["pearson"] for p in per.values()),
                     "n": len(gold), "subsets": per, **({"few_pairs": True} if len(gold) < FEW else {})}
    return out


def correlations(cos: np.ndarray, gold: np.ndarray) -> dict:
    return dict(spearman=100 * spearman(cos, gold), pearson=100 * pearson(cos, gold), n=len(gold),
                **({"few_pairs": True} if len(gold) < FEW else {}))


def spearman_of(model, tok, pairs, dtype=None) -> float:
    a, b, gold = pairs
    return 100 * spearman(cosines(model, tok, a, b, dtype=dtype), gold)


def table(results: dict) -> str:
    models = list(results)
    rows = []
    for task in dict.fromkeys(t for r in results.values() for t in r):
        first = results[models[0]][task]
        for agg in (("all", "mean") if "all" in first else ("",)):
            cells = []
            for m in models:
                r = results[m][task]
                sp, pe = (r["spearman"], r["pearson"]) if not agg else (r[agg], r[f"pearson_{agg}"])
                cells.append("   n/a" if np.isnan(sp) else f"{sp:6.2f} ({pe:6.2f})")
            rows.append([f"{task} {agg}".strip(), f"{first['n']}" + ("*" if first["n"] < FEW else "")] + cells)
    head = ["task", "pairs"] + models
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [head, ["-" * w for w in widths]] + rows
    few = any(r[1].endswith("*") for r in rows)
    return "\n".join(["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines] +
                     ["Spearman x 100 of cosine similarity (Pearson x 100)"] + ([WHY_FEW] if few else []))


# -----------------------------------------------------------------------------------------------
# Reading the tasks, in their original layouts. Each reader returns (sentences a, sentences b, gold scores).


SICK_FILES = {"dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}  # SICK.txt holds every split


def task_files(task: str, split: str) -> str:
    """The files find_tasks looks for, for a task and split: what a missing task's line asks for."""
    if task == "STSB":
        return f"sts-{split}.csv"
    if task == "SICKR":
        return f"{SICK_FILES[split]} or SICK.txt"
    return f"a folder {task} holding STS.input.NAME.txt and STS.gs.NAME.txt" + (", test data only" if split == "dev"
                                                                                  else "")


def _lines(path: Path) -> list[str]:
    """A file's lines; a byte that is not UTF-8 is refused, naming its line, as embed.py refuses it (a replaced
    character would be scored as if it were the text)."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark is not text
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        n, at = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start) - 1
        raise UserError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {at} of the line)") from None


def read_stsb(path: Path):
    """genre, file, year, id, score, sentence 1, sentence 2 [, extra columns]; tab-separated, no quoting."""
    a, b, gold = [], [], []
    for n, line in enumerate(_lines(path), 1):
        cols = line.split("\t")
        if len(cols) < 7:
            raise UserError(f"{path}:{n}: expected 7 tab-separated columns, found {len(cols)}")
        gold.append(_score(cols[4], f"{path}:{n}"))
        a.append(cols[5])
        b.append(cols[6])
    return _pairs(path, a, b, gold)


def read_sick(path: Path, split: str):
    """SICK files carry a header; the full SICK.txt names each pair's split in SemEval_set."""
    rows = [(n, line.split("\t")) for n, line in enumerate(_lines(path), 1) if line.strip()]
    head = rows[0][1] if rows else []
    try:
        ia, ib, ig = head.index("sentence_A"), head.index("sentence_B"), head.index("relatedness_score")
    except ValueError:
        raise UserError(f"{path}: no sentence_A, sentence_B and relatedness_score columns in the header") from None
    keep = {"dev": "TRIAL", "test": "TEST"}[split]
    iset = head.index("SemEval_set") if "SemEval_set" in head else None
    a, b, gold = [], [], []
    for n, r in rows[1:]:
        if len(r) < len(head):
            raise UserError(f"{path}:{n}: expected {len(head)} tab-separated columns, found {len(r)}")
        if iset is None or r[iset].strip() == keep:
            a.append(r[ia])
            b.append(r[ib])
            gold.append(_score(r[ig], f"{path}:{n}", low=1))
    return _pairs(path, a, b, gold)


def read_semeval(inp: Path, gs: Path):
    """STS.input.NAME.txt (two sentences, maybe more columns) beside STS.gs.NAME.txt; an empty gold line
    marks a pair without a score, which is left out."""
    pairs, golds = _lines(inp), _lines(gs)
    if len(pairs) != len(golds):
        raise UserError(f"{gs}: {len(golds)} scores for the {len(pairs)} pairs of {inp.name}")
    a, b, gold = [], [], []
    for n, (p, g) in enumerate(zip(pairs, golds, strict=True), 1):
        if not g.strip():
            continue
        cols = p.split("\t")
        if len(cols) < 2:
            raise UserError(f"{inp}:{n}: expected two tab-separated sentences")
        a.append(cols[0])
        b.append(cols[1])
        gold.append(_score(g, f"{gs}:{n}"))
    return _pairs(gs, a, b, gold)


def _score(text: str, where: str, low: float = 0, high: float = 5) -> float:
    """A gold score on its task's scale: 0-5 (STS-B, STS12-16), 1-5 (SICK's relatedness)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not np.isfinite(x):
        raise UserError(f"{where}: gold score {text.strip()!r} is not a number")
    if not low <= x <= high:
        raise UserError(f"{where}: gold score {x:g} is outside the task's scale of {low:g} to {high:g}")
    return x


def _pairs(path: Path, a, b, gold):
    """A task's (sentences a, sentences b, gold scores); a file with no scored pair is not a task to score."""
    if not gold:
        raise UserError(f"{path}: no sentence pairs with gold scores")
    return a, b, np.array(gold)


def find_tasks(root: Path, split: str) -> dict[str, dict[str, tuple]]:
    """{task: {subset: (a, b, gold)}} for every task whose files are under root."""
    files = files_under(root)

    def named(name):
        return one_file(root, [p for p in files if p.name == name])

    tasks = {}
    if stsb := named(f"sts-{split}.csv"):
        tasks["STSB"] = {"": read_stsb(stsb)}
    if sick := named(SICK_FILES[split]) or named("SICK.txt"):
        tasks["SICKR"] = {"": read_sick(sick, split)}
    for year in range(12, 17) if split == "test" else ():  # STS12-16 have only test data
        if subsets := semeval_subsets(files, year):
            tasks[f"STS{year}"] = subsets
    return tasks


def semeval_subsets(files: list[Path], year: int) -> dict[str, tuple]:
    """{subset: (a, b, gold)} of SemEval STS 20`year`: STS.input.NAME.txt beside STS.gs.NAME.txt (2016: STS2016.*)
    in a folder STSyy or SentEval's STSyy-en-test; an input without gold scores cannot be scored."""
    subsets, where = {}, {}
    for inp in files:
        m = re.fullmatch(r"(STS(?:20\d\d)?)\.input\.(.+)\.txt", inp.name)
        in_year = inp.parent.name == f"STS{year}" or inp.parent.name.startswith(f"STS{year}-")
        if m and in_year and (gs := inp.with_name(f"{m[1]}.gs.{m[2]}.txt")).exists():
            if m[2] in where:  # two copies of a subset (STS12/ and STS12-en-test/): which one is meant?
                raise UserError(f"STS{year} subset {m[2]} is in two folders ({where[m[2]]}, {inp.parent}); keep one, "
                                f"or pass --data a folder that holds only one")
            subsets[m[2]], where[m[2]] = read_semeval(inp, gs), inp.parent
    return subsets


def one_file(root: Path, found: list[Path]) -> Path | None:
    """The one file a task reads, of those of its name under root; two are refused, naming both: only one would be
    scored, and which is not the user's choice."""
    if len(found) > 1:
        raise UserError(f"{root}: {len(found)} files named {found[0].name} ({', '.join(map(str, found))}); pass "
                        f"--data the folder of the one to score")
    return found[0] if found else None


def download_stsb(split: str = "test") -> Path:
    """The STS Benchmark's three files, fetched once into the cache ($DECLUTR_STSB_URL overrides the source); what
    fails names the file the split needs."""
    url = os.environ.get("DECLUTR_STSB_URL", STSB_URL)
    d = cache_dir() / "stsbenchmark"
    if (d / "sts-test.csv").exists():
        return d
    how = f"pass --data with a folder holding sts-{split}.csv"
    if offline():
        raise UserError(f"offline (HF_HUB_OFFLINE is set) and the STS Benchmark is not in {d}; {how}")
    try:
        data = urllib.request.urlopen(url, timeout=60).read()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            found = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            want = ("sts-train.csv", "sts-dev.csv", "sts-test.csv")
            if not all(w in found for w in want):
                raise UserError(f"{url}: no {', '.join(want)} in the archive; {how}")
            make_dirs(d, "pass --data with a copy of the STS Benchmark")
            for w in want:  # by name only: nothing in the archive chooses where a file lands
                data = tar.extractfile(found[w]).read()
                write_atomic(d / w, lambda tmp, data=data: tmp.write_bytes(data))
    except (urllib.error.URLError, OSError, tarfile.TarError) as e:
        raise UserError(f"cannot download the STS Benchmark from {url} ({getattr(e, 'reason', e)}); {how}") from None
    return d


def load_stsb_dev(path):
    """STS-B dev pairs from sts-dev.csv or a folder holding it (train.py's --eval-data)."""
    p = Path(path)
    found = p if p.is_file() else one_file(p, [f for f in files_under(p) if f.name == "sts-dev.csv"])
    if found is None:
        raise UserError(f"{path}: no sts-dev.csv")
    return read_stsb(found)


def no_nan(v):
    """JSON has no NaN: an undefined correlation (one scored pair) is written as null."""
    if isinstance(v, dict):
        return {k: no_nan(x) for k, x in v.items()}
    return None if v != v else v


@cli
def main(argv=None):
    cfg = parse_config(EvalConfig, argv, __doc__.split("\n\n")[0])
    with cpu_threads(cfg.threads):
        evaluate(cfg)


def evaluate(cfg: EvalConfig):
    """`python evaluate_sts.py`: every model on every task found, side by side."""
    if not cfg.model:
        raise UserError("no --model given")
    if cfg.json and not Path(cfg.json).resolve().parent.is_dir():
        raise UserError(f"--json {cfg.json}: no folder {Path(cfg.json).parent} to write it into")
    root = Path(cfg.data) if cfg.data else download_stsb(cfg.split)
    if not root.is_dir():
        raise UserError(f"{root}: not a directory")
    found = find_tasks(root, cfg.split)
    if missing := [t for t in cfg.tasks if t not in found]:  # the tasks asked for by name, each one there
        raise UserError(f"{root}: no {cfg.split} files of " + "; ".join(f"{t} ({task_files(t, cfg.split)})"
                                                                       for t in missing)
                        + (f"; it has {', '.join(found)}" if found else ""))
    tasks = {t: v for t, v in found.items() if t in cfg.tasks or not cfg.tasks}
    if not tasks:
        raise UserError(f"{root}: no {cfg.split} files of STSB, SICK-R or STS12-16 found"
                        + ("" if cfg.split == "dev" else " (for STS-B dev or SICK trial pass --split dev)"))
    device, dtype = device_and_dtype(cfg.device, cfg.dtype)
    results = {}
    for name in cfg.model:
        progress = Progress("evaluate", f"{name} on {', '.join(tasks)}")
        model, tok = load_pretrained(name, quiet=True)
        results[name] = score(model.to(device), tok, tasks, cfg.batch_tokens, progress, dtype)
        progress.note(f"{name}: {len(tasks)} tasks in {time.time() - progress.t0:.0f}s")
    print(table(results))
    if cfg.json:
        write_json(Path(cfg.json), no_nan(results if len(results) > 1 else results[cfg.model[0]]))


if __name__ == "__main__":
    main()
