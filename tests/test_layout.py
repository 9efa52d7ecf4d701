"""The project's shape, read from its source with ast: imports that run one way (no cycle; the support modules
import no method file back), no one-letter module aliases in the method files, the sampler's settings written once,
and a README that stays a tutorial whose docs are all linked."""
import ast
import re
from dataclasses import fields

from conftest import ROOT

METHOD = ("sampler", "model", "loss", "train", "embed", "evaluate_sts")
SUPPORT = ("common", "hub")


def project_imports() -> dict[str, set[str]]:
    """{module: the project modules it imports}, counting imports inside functions too."""
    names = {p.stem for p in ROOT.glob("*.py")}
    graph = {}
    for name in names:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[name] = found & names - {name}
    return graph


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


def test_imports_run_one_way():
    graph = project_imports()
    assert set(METHOD) | set(SUPPORT) <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert graph["common"] == set() and graph["hub"] == {"common"}
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and the search finds a circle


def test_no_one_letter_module_aliases_in_the_method_files():
    for name in METHOD:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        aliases = [a.asname for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                   if a.asname and len(a.asname) == 1 and a.name in METHOD + SUPPORT]
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
