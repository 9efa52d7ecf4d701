"""
support/sts_files.py: the STS tasks' files, which evaluate_sts.py scores. Each in its original layout (the STS
Benchmark, SICK-R, SemEval STS12-16), found under a folder, read into (sentences a, sentences b, gold scores) with
every bad row named; the STS Benchmark downloaded once where no folder is given; the scores as a table and as JSON.
"""
import io
import os
import re
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from support.cli import UserError
from support.files import cache_dir, files_under, make_dirs, offline, write_atomic

STSB_URL = "https://ixa2.si.ehu.eus/stswiki/images/4/48/Stsbenchmark.tar.gz"

FEW = 100  # pairs: below this a figure (a correlation, an MRR) is marked, not reported as a result


def why_few(figures: str) -> str:
    """The footnote of a table with marked rows, `figures` naming what those rows hold."""
    return (f"* fewer than {FEW} pairs: over so few pairs one pair more or less moves {figures} by points; it is not "
            f"a score to compare")



def table(results: dict) -> str:
    """Models side by side, a row per task (STS12-16: two, "all" and "mean"); SPANS (held-out span retrieval) a row
    per figure; a model without a task (TF-IDF has SPANS alone) is blank there."""
    models = list(results)
    rows = []
    tasks = list(dict.fromkeys(t for r in results.values() for t in r))
    for task in tasks:
        first = next(r[task] for r in results.values() if task in r)
        aggs = SPAN_ROWS if task == "SPANS" else ("all", "mean") if "all" in first else ("",)
        for agg in aggs:
            cells = [cell(results[m].get(task), agg) for m in models]
            rows.append([f"{task} {SPAN_ROWS.get(agg, agg)}".strip(), f"{first['n']}" + ("*" if first["n"] < FEW else
                                                                                            "")] + cells)
    head = ["task", "pairs"] + models
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [head, ["-" * w for w in widths]] + rows
    few = {r[0].startswith("SPANS") for r in rows if r[1].endswith("*")}  # marked: STS rows (False), SPANS (True)
    figures = " or ".join(["a correlation"] * (False in few) + ["an MRR or a recall"] * (True in few))
    spans = any("SPANS" in r for r in results.values())
    return "\n".join(["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines] +
                     ["Spearman x 100 of cosine similarity (Pearson x 100)"] * any(t != "SPANS" for t in tasks) +
                     ([why_few(figures)] if few else []) +
                     ([SPANS_SAY] if spans else []))


SPAN_ROWS = {"mrr": "MRR", "recall_at_1": "R@1", "recall_at_10": "R@10"}
SPANS_SAY = ("SPANS: held-out span retrieval on --docs, x 100: each query's target among every target (pairs), by "
             "cosine")


def cell(r: dict | None, agg: str) -> str:
    if r is None:
        return ""
    if agg in SPAN_ROWS:
        return f"{r[agg]:6.2f}"
    sp, pe = (r["spearman"], r["pearson"]) if not agg else (r[agg], r[f"pearson_{agg}"])
    return "   n/a" if np.isnan(sp) else f"{sp:6.2f} ({pe:6.2f})"


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
        tasks["STSB"] = {split: read_stsb(stsb)}
    if sick := named(SICK_FILES[split]) or named("SICK.txt"):
        tasks["SICKR"] = {split: read_sick(sick, split)}
    for year in range(12, 17) if split == "test" else ():  # STS12-16 have only test data
        if subsets := semeval_subsets(files, year):
            tasks[f"STS{year}"] = subsets
    return tasks


def tasks_to_score(data: str, split: str, wanted: list) -> dict[str, dict[str, tuple]]:
    """evaluate_sts.py's tasks: find_tasks' under --data (the STS Benchmark downloaded where none is given), those
    asked for by name or all, each one there; else one line naming the files missing."""
    root = Path(data) if data else download_stsb(split)
    if not root.is_dir():
        raise UserError(f"{root}: not a directory")
    found = find_tasks(root, split)
    if missing := [t for t in wanted if t not in found]:  # the tasks asked for by name, each one there
        raise UserError(f"{root}: no {split} files of " + "; ".join(f"{t} ({task_files(t, split)})" for t in missing)
                        + (f"; it has {', '.join(found)}" if found else ""))
    tasks = {t: v for t, v in found.items() if t in wanted or not wanted}
    if not tasks:
        raise UserError(f"{root}: no {split} files of STSB, SICK-R or STS12-16 found"
                        + ("" if split == "dev" else " (for STS-B dev or SICK trial pass --split dev)"))
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
