"""The benchmarks as a new user meets them (round seven): every script in bench/ answers --help; one without its
optional package, or given an --out that holds nothing or is a file, says so in one line; a benchmark writes under
its --out, and a figure the docs show changes only when its path is named."""
import hashlib
import json
import subprocess
import sys

import pytest

from conftest import ROOT, bench_script

BENCH = sorted(p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))  # _NAME.py: a module


def run(*args, blocked: str = "", cwd=ROOT, timeout=120):
    """A real process: python bench/..., with `blocked` packages made unimportable (as if not installed)."""
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    if blocked:
        env["PYTHONPATH"] = str(ROOT / "tests" / "blocked")
        env["BLOCKED_MODULES"] = blocked
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def one_line(r) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    [line] = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    return line


# What the README's install (requirements.txt) does not bring: a script's --help must not need any of them
NOT_INSTALLED = "pytest,transformers,sentence_transformers,mteb,matplotlib,pyarrow,tensorboard"


@pytest.fixture(scope="module")
def helps():
    """Every script's --help, run in one process (tests/help_all.py) with the optional packages unimportable."""
    r = run(ROOT / "tests" / "help_all.py", *BENCH, blocked=NOT_INSTALLED)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", BENCH)
def test_every_bench_script_answers_help(script, helps):
    """With the README's install alone: no test helper (tests/ imports pytest), no optional package."""
    r = helps[script]
    assert r["returncode"] == 0 and r["stdout"].startswith("usage: ") and "Traceback" not in r["stderr"], r["stderr"]


def test_st_encode_reads_the_int8_model_its_prepare_wrote(tmp_path, monkeypatch):
    """bench/st_encode.py --int8 looked for model_qint8_avx2.onnx where sentence-transformers had written
    model_quint8_avx2.onnx (its name carries the weights' type, which it picks per instruction set): prepare now
    names the file (file_suffix, as sentence-transformers 5.7 and 6.2 take it: onnx/model_{suffix}.onnx) and encode
    reads that name, on whatever processor. sentence-transformers played by a stand-in that records both."""
    import types

    st_encode, seen = bench_script("st_encode"), {}

    class Model:
        def __init__(self, path, backend="torch", device="cpu", model_kwargs=None):
            seen.setdefault("loaded", []).append((backend, (model_kwargs or {}).get("file_name")))

        def save_pretrained(self, path):
            pass

        def encode(self, lines):
            return __import__("numpy").zeros((len(lines), 4))

    def export(model, config, path, file_suffix=None):
        seen["written"] = f"onnx/model_{file_suffix or 'quint8_' + config}.onnx"

    fake = types.SimpleNamespace(SentenceTransformer=Model, export_dynamic_quantized_onnx_model=export)
    monkeypatch.setitem(sys.modules, "sentence_transformers", fake)
    st_encode.prepare(tmp_path)
    (tmp_path / "in.txt").write_text("a line\n")
    st_encode.encode(types.SimpleNamespace(model=str(tmp_path), backend="onnx", bf16=False, int8=True,
                                           input=str(tmp_path / "in.txt"), output=str(tmp_path / "o.npy")))
    assert seen["loaded"][-1] == ("onnx", seen["written"]) and st_encode.int8_config() in seen["written"]


def test_every_benchs_shared_assets_default_to_declutr_shared(monkeypatch):
    """A benchmark's --shared is DECLUTR_SHARED where it is set, as the tests' assets are (issue 81: bench/domain.py
    looked under ../shared whatever it said), else ../shared beside the checkout; no script spells its own default."""
    from support.cli import shared_assets

    monkeypatch.setenv("DECLUTR_SHARED", "/somewhere/assets")
    assert shared_assets(ROOT) == "/somewhere/assets"
    monkeypatch.delenv("DECLUTR_SHARED")
    assert shared_assets(ROOT) == str(ROOT.parent / "shared")
    for script in BENCH:
        text = (ROOT / "bench" / script).read_text()
        assert "--shared" not in text or "default=shared_assets(ROOT)" in text, script


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_env_dry_run.sh"])
def test_every_bench_shell_script_answers_help_before_doing_anything(script, tmp_path):
    """--help prints the script's usage and exits 0 at once: no venv built, no check run (from a folder it could
    write into, nothing written)."""
    r = subprocess.run(["bash", str(ROOT / "bench" / script), "--help"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=20, env={**__import__("os").environ, "OUT": str(tmp_path / "out")})
    assert r.returncode == 0 and r.stdout.startswith("usage: "), r.stdout[-1000:] + r.stderr[-1000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, args, blocked, install", [
    ("mteb_stsb.py", ["runs/demo/model"], "mteb", "pip install mteb"),
    ("model_forward.py", [], "transformers", "pip install -r requirements-dev.txt"),
    ("train_step.py", [], "transformers", "pip install -r requirements-dev.txt"),
    ("st_encode.py", ["prepare", "some-model"], "sentence_transformers", "pip install -r requirements-dev.txt"),
])
def test_a_benchmark_without_its_optional_package_names_what_to_install(script, args, blocked, install):
    line = one_line(run(ROOT / "bench" / script, *args, blocked=blocked))
    assert line.startswith(f"error: this needs {blocked}, which is not installed: {install}"), line


def test_probing_with_nothing_trained_in_its_out_is_one_line(tmp_path):
    from conftest import SHARED, need

    need(SHARED / "data" / "corpus" / "gutenberg")
    line = one_line(run(ROOT / "bench" / "probing.py", "--no-train", "--out", tmp_path, "--shared", SHARED))
    assert line.startswith(f"error: --out {tmp_path}: no trained model at {tmp_path / 'pretrain' / 'model'}")
    assert "run without --no-train" in line and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ablation_plots_under_its_out_and_writes_over_no_committed_figure(tmp_path, docs):
    """A small ablation (one arm, one seed, 4 steps: seconds): its plot is --out's, the figures the docs show are
    byte for byte what git has; an --out that is a file is one line."""
    figures = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (ROOT / "bench").glob("*.png")}
    words = "the cat sat on a mat while dogs ran in parks".split()
    (tmp_path / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{k}\t{k % 5}\t{' '.join(words[k % 5:])}\t"
                                                  f"{' '.join(words[:k % 7 + 2])}\n" for k in range(12)))
    common = ["--data", docs, "--stsb", tmp_path / "sts-dev.csv", "--sick", tmp_path / "none", "--seeds", "0",
              "--arms", "both", "--steps", "4", "--eval-every", "2", "--jobs", "1", "--docs-per-step", "4",
              "--min-span", "8", "--max-span", "32"]
    r = run(ROOT / "bench" / "ablation.py", *common, "--out", tmp_path / "out", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "ablation.png").stat().st_size > 0 and (tmp_path / "out" / "ablation.md").exists()
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (ROOT / "bench").glob("*.png")} == figures
    (tmp_path / "a-file").write_text("mine")
    line = one_line(run(ROOT / "bench" / "ablation.py", *common, "--out", tmp_path / "a-file"))
    assert line == f"error: {tmp_path / 'a-file'}: is a file, where a folder should be"
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.slow
def test_the_gpu_checks_json_that_cannot_be_written_is_one_line_before_setup(tmp_path):
    (tmp_path / "a-file").write_text("mine")
    for where, why in ((tmp_path / "a-file" / "r.json", f"{tmp_path / 'a-file'} is not a folder"),
                       (tmp_path, "is a folder")):
        r = run(ROOT / "bench" / "gpu_check.py", "--dry-run", "--json", where)
        assert r.returncode == 1 and r.stderr == f"error: --json {where}: {why}\n", r.stderr[-2000:]
    assert (tmp_path / "a-file").read_text() == "mine"


def test_a_failed_step_is_one_line_with_its_cause(capsys):
    """A benchmark's step run as a process of its own, its output captured, that fails: one line with the step's
    name (not the text of an embedded python -c program) and the last line it wrote; a non-zero exit."""
    from support.cli import bench

    program = "import sys\nprint('working')\nsys.exit('ModuleNotFoundError: No module named sentence_transformers')"

    @bench
    def main():
        subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, text=True)

    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code != 0 and err == ("error: a python -c step stopped with exit code 1: ModuleNotFoundError: No "
                                         "module named sentence_transformers\n"), err


def test_probing_tasks_on_too_few_books_is_one_line(tmp_path):
    """Two short books cannot fill a probing task's classes: one line naming the task and what it needs."""
    books = []
    for i in range(2):
        books.append(tmp_path / f"book{i}.txt")
        books[-1].write_text("The cat sat on the mat near the door. " * 40 + "A dog barked at the moon all night.\n")
    line = one_line(run(ROOT / "bench" / "probing.py", "--tasks-only", *books))
    assert line.startswith("error: SentLen: class ") and line.endswith("give more books"), line


def test_no_script_imports_another_or_the_tests():
    """bench/'s scripts stand alone: none imports another script (shared code lives in bench/_NAME.py modules, which
    run nothing) nor anything of tests/ (which needs pytest, not in the README's install)."""
    import ast

    scripts = {name[:-3] for name in BENCH}
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
    problems = []
    for name in BENCH:
        tree = ast.parse((ROOT / "bench" / name).read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            problems += [f"{name} imports {n}" for n in names if n.split(".")[0] in scripts | tests]
    assert problems == []


def test_a_timed_step_is_named_by_the_command_it_timed():
    """bench/_measure.py times a command through a python -c program: the line names that command."""
    from support.cli import step_name

    timer = ["/usr/bin/python3", "-c", "import subprocess ...", "/venv/bin/python", "/repo/embed.py", "--model", "m"]
    assert step_name(timer) == "python embed.py --model ..."
    assert step_name(["/usr/bin/python3", "-c", "print(1)"]) == "a python -c step"
