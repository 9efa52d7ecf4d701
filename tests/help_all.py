"""Run by tests/test_bench_cli.py, under tests/blocked (the optional packages unimportable): `python bench/S --help`
for each script S named, one after the other in this one process, and their exit codes and outputs as JSON on the
last line. One process, not twelve: each would spend about 1.5 s importing torch to print its usage. Before each
script every module but torch's and numpy's is forgotten, so that a script finds nothing another one imported."""
import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path

import numpy  # noqa: F401
import torch  # noqa: F401

BENCH = Path(__file__).resolve().parents[1] / "bench"
KEPT = set(sys.modules)  # what every bench script imports itself first
PATH = list(sys.path)


def help_of(script: str) -> dict:
    for name in set(sys.modules) - KEPT:
        del sys.modules[name]
    sys.path[:], sys.argv = [str(BENCH), *PATH[1:]], [str(BENCH / script), "--help"]  # its folder first
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(BENCH / script), run_name="__main__")
        except SystemExit as e:  # as Python's exit reports it: a message is printed, and exits 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    print(json.dumps({script: help_of(script) for script in sys.argv[1:]}))
