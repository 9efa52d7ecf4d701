"""Shared test helpers. Assets are read in place from ../shared (override with DECLUTR_SHARED)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))
MINILM = SHARED / "models" / "all-MiniLM-L6-v2"
STSB_DEV = SHARED / "data" / "sts" / "stsbenchmark" / "sts-dev.csv"


def need(path: Path):
    """Skip, saying which shared asset is missing and how to point at it."""
    if not path.exists():
        pytest.skip(f"needs {path} (set DECLUTR_SHARED to the shared/ folder)")
    return path


def stsb_sentences(limit=None):
    """Unique STS-B dev sentences, in file order (columns 6 and 7, tab-separated, no CSV quoting)."""
    seen = {}
    for line in need(STSB_DEV).read_text(encoding="utf-8").splitlines():
        cols = line.split("\t")
        for s in cols[5:7]:
            seen.setdefault(s, None)
    out = list(seen)
    return out[:limit] if limit else out
