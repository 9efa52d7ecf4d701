"""bench/_written_apart.py, the second yardstick's pairs (issue 83), against hand-written reST, a .deb built here by
hand (ar + tar.xz, as Debian builds them), and docstrings read back from the standard library's own sources."""
import io
import tarfile

import pytest

from conftest import ROOT, bench_script

PAGE = """\
:mod:`demo.mod` --- A demonstration
===================================

.. module:: demo.mod
   :synopsis: Nothing.

Some text about the module.

.. function:: join(a, *paths)
              join(a)

   Join *a* and :func:`~os.path.split`'s parts with ``sep``, as :ref:`the rules <rules>` say.

   .. versionchanged:: 3.6
      Accepts a path-like object.

   >>> join("a", "b")

.. class:: Thing(x, \\
                 y=None)

   A thing of *x*.

   .. method:: grow(n)

      Grow by n.

   .. attribute:: size

      Its size.

.. method:: Thing.shrink()

   Shrink it.
"""


@pytest.fixture(scope="module")
def W():
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    return bench_script("_written_apart")


def test_an_entrys_text_is_its_own_block_as_plain_text(W):
    """Each entry's own words, markup gone: not its other signature, its version note, its doctest, its members'
    entries or the lines of a signature continued with a backslash; a method named with its class, inside the
    class's block or outside it."""
    got = {name: (module, kind, text) for module, kind, name, text in W.entries(PAGE)}
    assert got == {"join": ("demo.mod", "function", "Join a and split's parts with sep, as the rules say."),
                   "Thing": ("demo.mod", "class", "A thing of x."),
                   "Thing.grow": ("demo.mod", "method", "Grow by n."),
                   "Thing.shrink": ("demo.mod", "method", "Shrink it.")}


def test_the_reference_is_read_out_of_the_deb_with_python_alone(W, tmp_path):
    """A .deb as Debian writes one (an ar archive: debian-binary, control.tar.xz, data.tar.xz, members padded to
    even sizes): only the library pages' reST comes out, named by page."""
    def tar(files: dict) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as t:
            for name, text in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(text)
                t.addfile(info, io.BytesIO(text))
        return buf.getvalue()

    members = {"debian-binary": b"2.0\n", "control.tar.xz": tar({"./control": b"Package: x\n"}),
               "data.tar.xz": tar({"./usr/share/doc/python3.11/html/_sources/library/demo.rst.txt": PAGE.encode(),
                                   "./usr/share/doc/python3.11/html/_sources/howto/other.rst.txt": b"no",
                                   "./usr/share/doc/python3.11/html/library/demo.html": b"<html>"})}
    data = b"!<arch>\n"
    for name, body in members.items():
        data += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode() + body
        data += b"\n" * (len(body) % 2)
    (tmp_path / "x.deb").write_bytes(data)
    assert W.reference_sources(tmp_path / "x.deb") == {"demo": PAGE}


def test_docstrings_come_from_the_module_source_without_running_it(W):
    """os.path is posixpath here: join's docstring as the source has it; a method through its class; a C function
    (math.sqrt) and a name the module lacks have none; a pair copied from its docstring is dropped, and said."""
    import inspect
    import posixpath
    import string

    assert W.docstring("os.path", "join") == inspect.cleandoc(posixpath.join.__doc__)
    assert W.docstring("string", "Formatter.format") == string.Formatter.format.__doc__
    assert W.docstring("math", "sqrt") is None and W.docstring("os.path", "no_such_name") is None
    copied = (".. module:: string\n\n.. function:: capwords(s, sep=None)\n\n   "
              + " ".join(string.capwords.__doc__.split()) + "\n")
    pairs, left = W.pairs({"string": copied})
    assert pairs == [] and left["copied"] == 1


def test_the_table_has_each_arm_and_peer_over_its_seeds_and_the_minutes_it_trained(tmp_path):
    """bench/written_apart.py's table from hand-made runs: a DeCLUTR arm's minutes are its steps' tokens over the
    median of their tokens a second (a rate an evaluation slowed left out), a peer's its own; each row's mean and
    paired difference by hand."""
    import json
    import sys
    import types
    sys.path.insert(0, str(ROOT / "bench"))  # its own imports: _written_apart, _report
    wa = bench_script("written_apart")
    f = {"mrr": 70.0, "recall_at_1": 60.0, "recall_at_10": 90.0}
    start = {"forward": f, "back": f}
    words = {k: start for k in ("bm25", "tfidf")}
    for s, (mrr, spans, stsb) in enumerate([(72.0, 30.0, 80.0), (74.0, 32.0, 81.0)]):
        run = tmp_path / "runs" / f"adjacent-seed{s}"
        run.mkdir(parents=True)
        records = [{"step": 0, "spans_mrr": 25.0, "stsb_dev_spearman": 82.0, "bm25_spans_mrr": 20.0,
                    "tfidf_spans_mrr": 19.0},
                   {"step": 1, "tokens": 6000, "tokens_per_s": 100}, {"step": 2, "tokens": 3000, "tokens_per_s": 50},
                   {"step": 3, "tokens": 3000, "tokens_per_s": 100},
                   {"step": 2, "spans_mrr": spans, "stsb_dev_spearman": stsb}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (tmp_path / f"scores-adjacent-seed{s}.json").write_text(json.dumps({"forward": dict(f, mrr=mrr), "back": f}))
        peer = tmp_path / "peers" / f"simcse-seed{s}"
        peer.mkdir(parents=True)
        (peer / "run.json").write_text(json.dumps({"minutes": 2.0 + s, "steps": 10, "tokens": 1e6}))
        (peer / "scores.json").write_text(json.dumps({"forward": dict(f, mrr=mrr - 4), "back": f}))
        (peer / "eval.json").write_text(json.dumps({str(peer / "model"): {"SPANS": {"mrr": spans - 5},
                                                                          "STSB": {"spearman": stsb - 1}}}))
    (tmp_path / "peers" / "start-eval.json").write_text(json.dumps({"start": {"SPANS": {"mrr": 25.0},
                                                                              "STSB": {"spearman": 82.0}}}))
    assert wa.training_minutes(tmp_path, "adjacent-seed0") == (2.0, 3, 12000)  # 12,000 tokens at 100 a second
    a = types.SimpleNamespace(arms=["adjacent"], seeds=[0, 1], shared="", span_pairs=10, model="start")
    rows = {line.split(" | ")[0]: line.split(" | ") for line in
            wa.report(a, tmp_path, (5, 9), {}, start, words).splitlines() if line.startswith("| ")}
    declutr, simcse = rows["| DeCLUTR, adjacent (2 seeds)"], rows["| simcse (2 seeds)"]
    assert declutr[1] == "73.00" and declutr[5:7] == ["31.00 ± 1.41", "80.50 ± 0.71"]
    assert declutr[7] == "**+3.00 ± 1.41**" and declutr[8] == "**+6.00 ± 1.41**" and declutr[-1] == "2.0, 3, 0.01M |"
    assert simcse[1] == "69.00" and simcse[5] == "26.00 ± 1.41" and simcse[-1] == "2.5, 10, 1.00M |"
    assert rows["| the start"][5:7] == ["25.00", "82.00"] and rows["| BM25 (words)"][5] == "20.00"
    against = [line for line in wa.report(a, tmp_path, (5, 9), {}, start, words).splitlines() if "best peer" in line]
    assert against == ["DeCLUTR, adjacent against the best peer, simcse, paired over seeds 0, 1: entry → docstring "
                       "MRR **+4.00 ± 0.00**; held-out spans MRR **+5.00 ± 0.00**; STS-B dev **+1.00 ± 0.00**"]
