"""
The pairs of bench/written_apart.py: Python's library reference against the standard library's docstrings, two texts
about one function, class or method written apart (the reference by the documentation's authors, the docstring by
the code's), never two pieces of one document.

The reference: Debian's python3.11-doc package (from the package registry, `apt-get download`, no root needed), its
reST sources html/_sources/library/*.rst.txt, read out of the .deb with Python alone (an ar archive holding
data.tar.xz). Each `.. function::`, `.. class::`, `.. method::` (also classmethod, staticmethod, decorator, exception)
entry of a page's current module gives the entry's own text: its indented block, without its members' entries, its
version notes and examples (every nested directive but notes and warnings), doctest lines and reST markup.
The docstring: the same name in the module's source (importlib's find_spec, which runs no module code but a package's
__init__; os.path is posixpath here), read with ast: a module-level def or class, or a method of its class. Pairs
whose two sides hardly differ (one copied from the other: difflib's ratio over 0.9) are dropped, and said.
"""
import ast
import difflib
import functools
import importlib.util
import io
import re
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

KINDS = ("function", "class", "method", "classmethod", "staticmethod", "decorator", "exception")
DIRECTIVE = re.compile(r"^(\s*)\.\. ([\w:-]+)::\s*(.*)$")
PROSE = ("note", "warning", "important", "tip", "caution", "hint", "attention")  # nested, and the entry's own text
MOST_WORDS = 150  # each side cut to its first 150 words: a model reads 256 tokens of it, BM25 as much
FEWEST_WORDS = 6  # a side shorter than this says too little to be found by
COPIED = 0.9  # difflib's ratio of two sides above which one was copied from the other


@dataclass
class Pair:
    module: str  # as the reference names it (os.path)
    name: str  # the entry's name within the module (join, Path.read_text)
    reference: str  # the query
    docstring: str  # the target


def reference_sources(deb: Path) -> dict[str, str]:
    """{page name: reST text} of library/*.rst.txt inside python3.x-doc's .deb."""
    data = deb.read_bytes()
    assert data[:8] == b"!<arch>\n", f"{deb}: not a .deb (ar archive)"
    at, pages = 8, {}
    while at < len(data):
        name, size = data[at:at + 16].decode().strip(), int(data[at + 48:at + 58].decode().strip())
        body = data[at + 60:at + 60 + size]
        if name.rstrip("/").startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                for m in tar.getmembers():
                    if m.isfile() and "/_sources/library/" in m.name and m.name.endswith(".rst.txt"):
                        pages[Path(m.name).name[:-len(".rst.txt")]] = tar.extractfile(m).read().decode("utf-8")
        at += 60 + size + size % 2
    return pages


def clean(text: str) -> str:
    """reST as plain text: roles to their text (:func:`~os.path.join` -> join, :ref:`text <label>` -> text),
    ``literals`` and *emphasis* to their words, whitespace runs to one space."""
    def role(m):
        inner = re.sub(r"\s*<[^>]*>$", "", m.group(1)).lstrip("~!")
        return inner.rsplit(".", 1)[-1] if m.group(1).startswith("~") else inner
    text = re.sub(r":[\w:.-]+:`([^`]*)`", role, text)
    text = re.sub(r"``([^`]*)``", r"\1", text)
    text = re.sub(r"\*\*?([^*\s][^*]*)\*\*?", r"\1", text)
    text = re.sub(r"`([^`<]*)(?: <[^>]*>)?`_*", r"\1", text)
    return " ".join(text.split())


def entries(page: str):
    """(module, kind, name, text) of each entry in a page: the module it documents from `.. module::` or
    `.. currentmodule::`, a method's name with its class's (Path.read_text)."""
    lines, module, classes = page.split("\n"), None, []  # classes: (indent, name) of the enclosing class entries
    for i, line in enumerate(lines):
        m = DIRECTIVE.match(line)
        if not m:
            continue
        indent, kind, arg = len(m.group(1)), m.group(2), m.group(3).strip()
        if kind in ("module", "currentmodule", "py:module", "py:currentmodule"):
            module, classes = arg, []
            continue
        kind = kind.removeprefix("py:")
        if kind not in KINDS or module is None or not arg:
            continue
        classes = [(n, c) for n, c in classes if n < indent]
        name = re.split(r"[(\s\[]", arg, maxsplit=1)[0].removeprefix(module + ".")
        if classes and kind not in ("class", "exception") and "." not in name:
            name = f"{classes[-1][1]}.{name}"
        if kind in ("class", "exception"):
            classes.append((indent, name))
        start = i + 1
        while lines[start - 1].rstrip().endswith("\\") and start < len(lines):  # a signature over several lines
            start += 1
        yield module, kind, name, clean(block(lines, start, indent))


def block(lines: list[str], start: int, indent: int) -> str:
    """An entry's own text: the lines indented past its directive, up to the next line that is not, without more
    signatures, options, doctest lines and nested directives with their blocks (members' entries, version notes,
    examples), but for notes and warnings."""
    out, skip_below, first = [], None, True
    for line in lines[start:]:
        depth = len(line) - len(line.lstrip())
        if line.strip() and depth <= indent:
            break
        if skip_below is not None:
            if not line.strip() or depth > skip_below:
                continue
            skip_below = None
        stripped = line.strip()
        if first and stripped and not stripped.startswith(":") and "(" in stripped and not out:
            continue  # another signature of the same entry
        if stripped.startswith(":") and not out:
            continue  # the directive's options (:noindex:, :module:)
        m = DIRECTIVE.match(line)
        if m:
            if m.group(2) not in PROSE:
                skip_below = depth  # a member's own entry, a version note, an example: not this entry's text
            continue
        if stripped.startswith((">>>", "...")):
            continue
        first = first and not stripped
        out.append(stripped)
    return "\n".join(out)


def source_path(module: str) -> Path | None:
    """The module's .py file (find_spec: no code of it runs but its package's __init__; a frozen module, os and
    posixpath among them, found under the standard library by its name), or None: a C module, or one this Python
    lacks."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or not spec.origin:
        return None
    if spec.origin == "frozen":
        base = Path(sysconfig.get_paths()["stdlib"]) / spec.name.replace(".", "/")
        return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.exists()), None)
    return Path(spec.origin) if spec.origin.endswith(".py") else None


@functools.cache
def source_tree(module: str):
    """The module's source, parsed, or None."""
    path = source_path(module)
    return None if path is None else ast.parse(path.read_text(encoding="utf-8"))


def docstring(module: str, name: str) -> str | None:
    """The docstring of module.name (a def or class at module level, or Class.method) in the module's source."""
    tree = source_tree(module)
    if tree is None:
        return None
    node, kinds = tree, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in name.split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
    return ast.get_docstring(node)


def words(text: str, most: int = MOST_WORDS) -> str:
    return " ".join(text.split()[:most])


def pairs(pages: dict[str, str]) -> tuple[list[Pair], dict]:
    """Every entry with a docstring, each side cut to MOST_WORDS words; and the counts of what was left out."""
    out, seen, left = [], set(), {"entries": 0, "no docstring": 0, "too short": 0, "copied": 0, "repeated": 0}
    for page in sorted(pages):
        for module, _, name, text in entries(pages[page]):
            left["entries"] += 1
            doc = docstring(module, name)
            if doc is None:
                left["no docstring"] += 1
                continue
            reference, target = words(text), words(" ".join(doc.split()))
            if min(len(reference.split()), len(target.split())) < FEWEST_WORDS:
                left["too short"] += 1
            elif difflib.SequenceMatcher(None, reference, target).ratio() > COPIED:
                left["copied"] += 1
            elif (module, name) in seen:
                left["repeated"] += 1
            else:
                seen.add((module, name))
                out.append(Pair(module, name, reference, target))
    return out, left
