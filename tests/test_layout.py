"""The project's shape, read from its source with ast: the six method files alone at the top, the machinery in
support/, other encoders in encoders/, imports that run one way (the method files down their own order, support and
encoders never into a method file), no
one-letter module aliases in the method files, the sampler's settings written once, and a README that stays a
tutorial whose docs are all linked."""
import ast
import re
from dataclasses import fields

from conftest import ROOT

METHOD = ("sampler", "model", "loss", "train", "embed", "evaluate_sts")
# What each method file may import of the others: train -> evaluate_sts -> embed -> model; train -> sampler -> model;
# evaluate_sts -> sampler (held-out span retrieval's pairs, drawn as the sampler draws spans); train -> loss
METHOD_IMPORTS = {"model": set(), "loss": set(), "sampler": {"model"}, "embed": {"model"},
                  "evaluate_sts": {"embed", "sampler", "model"},
                  "train": {"evaluate_sts", "embed", "sampler", "model", "loss"}}


def modules() -> dict[str, object]:
    """{name: path} of the project's modules: the top level's by stem, support's as support.NAME, encoders' as
    encoders.NAME."""
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for package in ("support", "encoders"):
        found.update({f"{package}.{p.stem}": p for p in (ROOT / package).glob("*.py") if p.stem != "__init__"})
    return found


def project_imports() -> dict[str, set[str]]:
    """{module: the project modules it imports}, counting imports inside functions too."""
    paths = modules()
    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in paths} - {name}
    return graph


def layout_problems(graph: dict[str, set[str]]) -> list[str]:
    """What breaks the house's rules in an import graph."""
    problems = [f"{m} imports the method file(s) {sorted(graph[m] & set(METHOD))}" for m in graph
                if m.startswith(("support.", "encoders.")) and graph[m] & set(METHOD)]
    problems += [f"{m} imports {sorted(graph[m] & set(METHOD) - METHOD_IMPORTS[m])}" for m in METHOD
                 if graph[m] & set(METHOD) - METHOD_IMPORTS[m]]
    return problems


def cycle(graph: dict[str, set[str]]):
    """A list of modules that import each other in a circle, or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_top_level_holds_the_six_method_files_and_support_the_rest():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(METHOD)
    assert {p.name for p in (ROOT / "support").glob("*.py")} >= {"__init__.py", "cli.py", "runs.py", "hub.py"}
    assert {p.name for p in (ROOT / "encoders").glob("*.py")} == {"__init__.py", "modernbert.py"}


def test_imports_run_one_way():
    graph = project_imports()
    assert set(METHOD) <= set(graph) and any(m.startswith("support.") for m in graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert layout_problems(graph) == []
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and the search finds a circle
    # and the rules would tell: support importing a method file, a method file importing against the order
    assert layout_problems({**graph, "support.runs": graph["support.runs"] | {"train"}}) == [
        "support.runs imports the method file(s) ['train']"]
    assert layout_problems({**graph, "encoders.modernbert": {"model"}}) == [
        "encoders.modernbert imports the method file(s) ['model']"]
    assert layout_problems({**graph, "model": {"sampler"}}) == ["model imports ['sampler']"]


def test_no_one_letter_module_aliases_in_the_method_files():
    for name in METHOD:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        aliases = [a.asname for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                   if a.asname and len(a.asname) == 1 and (a.name in METHOD or a.name.startswith("support"))]
        assert not aliases, (name, aliases)


def test_the_samplers_settings_are_written_once():
    import sampler
    import train

    tree = ast.parse((ROOT / "train.py").read_text())
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    own = {n.target.id for n in config.body if isinstance(n, ast.AnnAssign)}
    shared = {f.name for f in fields(sampler.SamplerConfig)}
    assert not own & shared, own & shared  # TrainConfig extends SamplerConfig instead of repeating its fields
    assert shared <= {f.name for f in fields(train.TrainConfig)}
    assert "def sampler_config" not in (ROOT / "train.py").read_text()


def test_readme_is_a_tutorial_that_links_every_doc():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 220, len(readme)
    assert any(line.startswith("## Read the code") for line in readme[:80])
    links = set(re.findall(r"\((docs/[\w.-]+\.md)\)", "\n".join(readme)))
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert docs and docs <= links, docs - links
    for doc in docs:  # each doc opens by saying what it is for
        first = (ROOT / doc).read_text().split("\n\n")[1]
        assert len(first) > 40 and not first.startswith("#"), doc


def test_the_reference_names_every_flag():
    import embed
    import evaluate_sts
    import sampler
    import train

    reference = (ROOT / "docs" / "reference.md").read_text()
    for config in (sampler.SamplerCommand, train.TrainConfig, embed.EmbedConfig, evaluate_sts.EvalConfig):
        for f in fields(config):
            flag = f.name.upper() if f.name == "inputs" else "--" + f.name.replace("_", "-")
            assert f"`{flag}" in reference, (config.__name__, flag)


def bench_names_missing(source: str) -> list[str]:
    """The names a bench/ script takes from the project's modules (`import train` then `train.X`, `from support.device
    import X`, inside functions too) that those modules do not have. A name is read as the module's wherever the
    script has not bound it to something else."""
    import importlib
    import sys

    sys.path[:0] = [str(ROOT / "bench")]
    try:
        project = set(modules()) | {p.stem for p in (ROOT / "bench").glob("*.py")} | {"support"}
        tree, aliases, missing = ast.parse(source), {}, []
        rebound = {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.For, ast.With))
                   for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in project})
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in project:
                module = importlib.import_module(node.module)
                for a in node.names:
                    if not hasattr(module, a.name) and f"{node.module}.{a.name}" not in project:
                        missing.append(f"{node.module}.{a.name}")
                    elif f"{node.module}.{a.name}" in project:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.value.id not in rebound):
                if not hasattr(importlib.import_module(aliases[node.value.id]), node.attr):
                    missing.append(f"{aliases[node.value.id]}.{node.attr}")
        return sorted(set(missing))
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_bench_scripts_take_only_names_that_exist():
    """A name moved out of a method file (train.compiled_graphs went to support/device.py) breaks the bench/ scripts
    that used it, most of which CI never runs: each script's names from the project exist. And the check sees a
    broken one."""
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert len(scripts) >= 10
    assert {p.name: bench_names_missing(p.read_text()) for p in scripts} == {p.name: [] for p in scripts}
    broken = ("import train\nfrom support import chunks\nfrom support.device import compiled_graphs\n"
              "train.compiled_graphs()\nchunks.length_groups\ntrain.train_step\n")
    assert bench_names_missing(broken) == ["train.compiled_graphs"]
    assert bench_names_missing("from support.device import no_such_name\n") == ["support.device.no_such_name"]


def test_every_link_between_the_docs_reaches_a_file_and_its_heading():
    """A relative link in README.md, docs/ or bench/README.md names a file that exists and, after '#', a heading of it
    (GitHub's anchors: lower case, punctuation but hyphens dropped, spaces made hyphens)."""
    def anchors(path) -> set[str]:
        heads = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}

    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(\s*([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # http(s): and mailto: are not ours to check
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_method_files_read_in_100_columns_and_a_call_takes_keywords():
    """The six method files, read as a tutorial: no line over 100 characters, counted in UTF-8 bytes as awk counts
    them (a § is two: the before-stop check is `awk 'length > 100'`), none over 400 lines and the six at most 1,500
    together (issue 82), no function over 50 lines, and no call with more than five positional arguments (a tensor's
    shape aside: view, reshape, permute, expand): keywords say what each is."""
    shapes = {"view", "reshape", "permute", "expand"}
    problems, total = [], 0
    for name in METHOD:
        text = (ROOT / f"{name}.py").read_text(encoding="utf-8")
        lines = text.split("\n")
        problems += [f"{name}.py:{i}: {len(line.encode())} bytes" for i, line in enumerate(lines, 1)
                     if len(line.encode()) > 100]
        total += len(lines) - 1  # the text ends in a newline: its last "line" is empty
        if len(lines) - 1 > 400:
            problems.append(f"{name}.py: {len(lines) - 1} lines")
        problems += [f"{name}.py:{node.lineno}: {node.name}, {node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef)
                     and node.end_lineno - node.lineno + 1 > 50]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and len(node.args) > 5:
                called = node.func.attr if isinstance(node.func, ast.Attribute) else ast.unparse(node.func)
                if called not in shapes:
                    problems.append(f"{name}.py:{node.lineno}: {called}(...) with {len(node.args)} positional")
    assert problems == [] and total <= 1500, (problems, total)
