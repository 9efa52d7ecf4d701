"""bench/ablation.py --pretrain-steps: how stage 2's books become documents, against the paragraphs written."""
import json
import types

import numpy as np

from conftest import bench_script


def test_stage2_documents_keep_every_paragraph_once(tmp_path):
    """Books written as CRLF paragraphs come back as documents of at least doc_chars characters, made of whole
    paragraphs in their order, none lost or repeated; each share's file is the first p% of the 100% one."""
    rng = np.random.default_rng(0)
    books, written = [], []
    for b in range(3):
        paragraphs = [f"book {b} paragraph {i}" + " word" * int(rng.integers(1, 60)) for i in range(80)]
        written.append(paragraphs)
        (tmp_path / f"book{b}.txt").write_bytes("\r\n\r\n".join(paragraphs).encode())
        books.append(tmp_path / f"book{b}.txt")
    a = types.SimpleNamespace(fractions=[25, 50, 100], doc_chars=500)
    files = bench_script("ablation").stage2_documents(a, tmp_path, books)
    shares = {p: [json.loads(line)["text"] for line in f.read_text().splitlines()] for p, f in files.items()}
    docs = shares[100]
    assert all(len(d) >= 500 for d in docs)
    got = [d.split("\n\n") for d in docs]
    for b, paragraphs in enumerate(written):
        # the book's documents, in the order of their first paragraph, laid end to end: the book itself
        mine = sorted((d for d in got if d[0].startswith(f"book {b} ")), key=lambda d: int(d[0].split()[3]))
        assert [p for d in mine for p in d] == paragraphs
    assert sum(map(len, got)) == sum(map(len, written))
    for p in (25, 50):
        assert shares[p] == docs[:round(len(docs) * p / 100)]
    assert [d.split()[1] for d in docs[:6]] != sorted(d.split()[1] for d in docs[:6])  # shuffled across books
