"""
bench/_probing_tasks.py: three of Conneau et al. (2018)'s ten probing tasks, built from raw text the way they built
theirs (SentEval's data/probing/README.md), here from Gutenberg books that no model of bench/probing.py trained on
(bench/ablation.py --hold-out):

- SentLen: the sentence's length in tokens, in SentEval's 6 bins: 5-8, 9-12, 13-16, 17-20, 21-25, 26-28.
- WC: which of 1,000 mid-frequency words the sentence holds. The candidates are the lower-cased words of at least 4
  letters in frequency order from rank 1,001 on (Conneau et al. start at 2,001, in a corpus of about a billion words;
  these books hold under a million), and the first 1,000 of them that each have enough sentences holding that word
  once and no other of the 1,000 (a word short of them gives its place to the next candidate).
- BShift: whether two adjacent tokens were swapped: tokens that are words, not the sentence's first, and not equal;
  sentences with double quotes are left out, as SentEval leaves them out.

Every class gets the same number of sentences in each split (train / dev / test), drawn with a fixed seed, and a
sentence appears once in a task. Sentences: each book's text between Gutenberg's START and END lines, its
paragraphs joined into lines and cut after . ! ? where a capital follows (not after Mr., Mrs., Dr., St. and the
like), then split into words and punctuation marks, as SentEval's Moses-tokenised files are; an encoder sees the
tokens joined by single spaces, as SentEval's batcher gives them. Kept: 5 to 28 tokens, a lower-case letter, the
sentence's end a . ! or ?; each sentence once over all the books.

The other seven need what cannot be had here: a constituency parser (TreeDepth, TopConst), a tagger and parser for
the main verb's tense and the subject's and object's number (Tense, SubjNum, ObjNum), the coordinated clauses of a
sentence (CoordInv), and part-of-speech tags with bigram counts to pick a replacement word (SOMO). No parser or
tagger is installed, and none can be downloaded.

    python bench/probing.py --tasks-only ../shared/data/corpus/gutenberg/Austen_*.txt    # the tasks' sizes, balance
"""
import collections
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.cli import UserError  # noqa: E402

TOKEN = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")  # words (with their apostrophes) and punctuation marks, one each
END = re.compile(r"[.!?][\"'”’)\]]*\s+(?=[\"'“‘(\[]*[A-Z])")  # a sentence's end: a capital follows
ABBREVIATIONS = {"mr", "mrs", "dr", "st", "mme", "mlle", "messrs", "prof", "rev", "capt", "col", "gen", "lieut",
                 "sgt", "hon", "jr", "sr", "vs", "no", "vol", "ch", "p"}
BINS = [(5, 8), (9, 12), (13, 16), (17, 20), (21, 25), (26, 28)]  # SentEval's SentLen bins, in tokens
SPLITS = ("train", "dev", "test")


def book_text(path: Path) -> str:
    """The book without Gutenberg's header and licence, and without the underscores that mark italics."""
    text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if start >= 0:
        text = text[text.find("\n", start) + 1:]
    if end >= 0:
        text = text[:text.find("*** END OF")]
    return text.replace("_", "")


def split_sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences: cut after . ! ? (and closing quotes) where a capital follows, not after a title."""
    out, start = [], 0
    for m in END.finditer(paragraph):
        words = paragraph[start:m.start()].split()
        if words and m.group()[0] == "." and words[-1].lower().strip("\"'“‘(") in ABBREVIATIONS:
            continue
        out.append(paragraph[start:m.end()].strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


def sentences(books) -> list[list[str]]:
    """Every kept sentence of the books, as tokens, each once, in the books' order."""
    seen, out = set(), []
    for book in books:
        for paragraph in re.split(r"\n\s*\n", book_text(Path(book))):
            for sentence in split_sentences(" ".join(paragraph.split())):
                tokens = TOKEN.findall(sentence)
                key = " ".join(tokens)
                ends = tokens[-1] in ".!?" or (len(tokens) >= 2 and tokens[-2] in ".!?" and tokens[-1] in "\"'”’)")
                if 5 <= len(tokens) <= 28 and ends and re.search("[a-z]", key) and key not in seen:
                    seen.add(key)
                    out.append(tokens)
    return out


def balanced(groups: dict, sizes: tuple, rng: np.random.Generator, task: str = "") -> dict:
    """{split: (texts, labels)}: from each class's sentences (label -> list of texts), sizes[i] for split i, drawn
    without replacement; a class with too few is an error (the caller picks only classes that have enough)."""
    out = {split: ([], []) for split in SPLITS}
    for label, texts in groups.items():
        need = sum(sizes)
        if len(texts) < need:  # too few books: one line, not a traceback
            raise UserError(f"{task}: class {label!r} has {len(texts):,} sentences in these books, {need:,} needed "
                            f"(train, dev and test: {', '.join(f'{n:,}' for n in sizes)}); give more books")
        picked = [texts[i] for i in rng.choice(len(texts), need, replace=False)]
        for split, lo, hi in zip(SPLITS, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
            out[split][0].extend(picked[lo:hi])
            out[split][1].extend([label] * (hi - lo))
    for split, (texts, labels) in out.items():  # classes mixed within each split, as SentEval's files are
        order = rng.permutation(len(texts))
        out[split] = ([texts[i] for i in order], [labels[i] for i in order])
    return out


def sentence_length(sents, rng, sizes=(3000, 600, 600)) -> dict:
    """SentLen: the bin of the sentence's token count."""
    groups = collections.defaultdict(list)
    for tokens in sents:
        label = next(i for i, (lo, hi) in enumerate(BINS) if lo <= len(tokens) <= hi)
        groups[label].append(" ".join(tokens))
    return balanced(dict(sorted(groups.items())), sizes, rng, "SentLen")


def word_content(sents, rng, words=1000, sizes=(8, 2, 2), from_rank=1000) -> tuple[dict, list[str]]:
    """WC: (the task, its target words): the label is the one target word the sentence holds, once."""
    counts = collections.Counter(t.lower() for tokens in sents for t in tokens if t.isalpha())
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    candidates = [w for w in ranked[from_rank:] if len(w) >= 4]
    targets, tried = candidates[:words], words
    while True:
        # The sentences that hold exactly one target, once: by target
        chosen, holding = set(targets), collections.defaultdict(list)
        for tokens in sents:
            hits = [t.lower() for t in tokens if t.lower() in chosen]
            if len(hits) == 1:
                holding[hits[0]].append(" ".join(tokens))
        short = [w for w in targets if len(holding[w]) < sum(sizes)]
        if not short:
            break
        # Each word short of sentences gives its place to the next candidate; the others' counts are then recounted
        if tried + len(short) > len(candidates):
            raise ValueError(f"only {words - len(short)} words of at least 4 letters from rank {from_rank + 1} have "
                             f"{sum(sizes)} sentences each: give more books")
        targets = [w for w in targets if w not in short] + candidates[tried:tried + len(short)]
        tried += len(short)
    return balanced({w: holding[w] for w in targets}, sizes, rng, "WC"), targets


def bigram_shift(sents, rng, sizes=(6000, 1500, 1500)) -> dict:
    """BShift: "I" (two adjacent words inverted) or "O" (the original), each sentence in one of the two."""
    usable = [t for t in sents if not {'"', "“", "”"} & set(t)]
    order = rng.permutation(len(usable))
    per_class = sum(sizes)
    inverted, original = [], []
    for i in order:
        tokens = usable[i]
        if len(original) < per_class:
            original.append(" ".join(tokens))
            continue
        # Two adjacent words, neither the first token nor a punctuation mark, and not the same word twice
        places = [j for j in range(1, len(tokens) - 1) if tokens[j].isalnum() and tokens[j + 1].isalnum()
                  and tokens[j] != tokens[j + 1]]
        if places:
            j = places[rng.integers(len(places))]
            inverted.append(" ".join(tokens[:j] + [tokens[j + 1], tokens[j]] + tokens[j + 2:]))
        if len(inverted) == per_class:
            break
    return balanced({"O": original, "I": inverted}, sizes, rng, "BShift")


def build(books, seed: int = 0) -> dict:
    """{"SentLen": task, "WC": task, "BShift": task}, each {split: (texts, labels)}, from the books' sentences."""
    sents = sentences(books)
    rng = np.random.default_rng(seed)
    return {"SentLen": sentence_length(sents, rng), "WC": word_content(sents, rng)[0],
            "BShift": bigram_shift(sents, rng)}


def describe(name: str, task: dict) -> str:
    """A task's sizes and class balance, in one line."""
    parts = []
    for split, (texts, labels) in task.items():
        counts = collections.Counter(labels)
        low, high = min(counts.values()), max(counts.values())
        parts.append(f"{split} {len(texts):,} ({len(counts)} classes of {low}" + (f"-{high})" if high != low else ")"))
    return f"{name}: " + ", ".join(parts)

