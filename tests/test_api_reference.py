"""The API reference agrees with the code.

The reference pages are generated from each package's declared exports and the
docstrings where the names are defined (docs/hooks/reference.py), so their
signatures are the code's. What can still drift is the prose: a docstring's
`Args:` section naming a parameter that the code no longer takes (renamed or
removed). docs/api.md, which holds what cannot be generated (the command line,
what kdist changes in the process, environment variables, errors), keeps a
table of contents that must list its sections.

Importing kdist's subpackages imports TensorFlow (once); nothing here starts MPI.
"""

import ast
import importlib
import inspect
import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
ARGUMENTS = re.compile(r"^(Args|Arguments|Parameters|Keyword arguments):\s*$")
# An entry: "name: ...", "name (type): ...", "*args: ...", "a, b: ..." or "`name`: ...".
ENTRY = re.compile(r"^([\w*`, ]+?)(?:\s*\([^)]*\))?\s*:(\s|$)")


def _declared_packages():
    """(package, its `_EXPORTS`) for every kdist package that declares its public names."""
    for init in sorted((ROOT / "kdist").rglob("__init__.py")):
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
                yield ".".join(init.parent.relative_to(ROOT).parts), ast.literal_eval(node.value)


def documented_arguments(doc):
    """The parameter names listed in the `Args:` sections of a Google-style docstring."""
    names, lines, index = [], doc.splitlines(), 0
    while index < len(lines):
        if not ARGUMENTS.match(lines[index]):
            index += 1
            continue
        index += 1
        indent = None
        while index < len(lines):
            line = lines[index]
            width = len(line) - len(line.lstrip())
            if line.strip() and width == 0:
                break  # the next section, or prose after the list
            if line.strip() and indent is None:
                indent = width
            entry = ENTRY.match(line.strip()) if line.strip() and width == indent else None
            if entry:
                names += [part.strip().strip("`").lstrip("*")
                          for part in entry.group(1).split(",") if part.strip()]
            index += 1
    return names


def undocumented_in_code(name, target):
    """Each argument that `target`'s docstring documents but its signature lacks."""
    callable_ = target.__init__ if inspect.isclass(target) else target
    try:
        parameters = inspect.signature(callable_).parameters
    except (TypeError, ValueError):
        return []  # a builtin or an object without a signature: nothing to compare
    documented = documented_arguments(inspect.getdoc(target) or "")
    if inspect.isclass(target) and target.__init__.__doc__:
        documented += documented_arguments(inspect.getdoc(target.__init__) or "")
    return [f"{name}: the docstring documents `{argument}`, which the code does not take "
            f"(it takes {', '.join(p for p in parameters if p != 'self') or 'nothing'})"
            for argument in documented if argument not in parameters]


def test_every_documented_argument_is_one_the_code_takes():
    problems, read = [], 0
    for package, exports in _declared_packages():
        module = importlib.import_module(package)
        for name in exports:
            target = getattr(module, name)
            if name.startswith("_") or not callable(target):
                continue
            read += len(documented_arguments(inspect.getdoc(target) or ""))
            problems += undocumented_in_code(f"{package}.{name}", target)
    # The docstrings document hundreds of arguments; fewer means they stopped being read.
    assert read > 300, f"only {read} documented arguments read"
    assert not problems, "\n".join(problems)


def _sample(path, mode="r", *extra, size=1, **options):
    """A function documented in every way the check reads.

    Args:
        path: where.
        mode (str): how; a long description
            that goes on, with a colon: here.
        *extra: more.
        size, options: two at once.

    Returns:
        Nothing: a "Returns:" list is not an argument.
    """


def _renamed(path, how="r"):
    """A function whose docstring still names an argument it lost.

    Args:
        path: where.
        mode: how.
    """


def test_the_argument_check_reads_each_way_of_documenting_and_finds_a_rename():
    assert documented_arguments(inspect.getdoc(_sample)) == [
        "path", "mode", "extra", "size", "options"]
    assert undocumented_in_code("sample", _sample) == []
    assert undocumented_in_code("renamed", _renamed) == [
        "renamed: the docstring documents `mode`, which the code does not take "
        "(it takes path, how)"]


def _headings(level):
    """(line number, heading text) of every heading of `level` ("##", "###") in api.md."""
    prefix = level + " "
    # Code blocks hold `#` comments (shell examples); they are not headings.
    found, fenced = [], False
    for number, line in enumerate(API.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith(prefix):
            found.append((number, line[len(prefix):].strip()))
    return found


def _slug(title):
    """The anchor mkdocs gives a heading (Python-Markdown's toc slugify, markup removed)."""
    text = title.replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_table_of_contents_lists_every_section_in_order():
    text = API.read_text()
    before_sections = text.split("\n## ", 1)[0]
    listed = re.findall(r"^- \[(.+)\]\(#([^)]+)\)$", before_sections, re.M)
    sections = [title for _, title in _headings("##")]
    assert sections, "docs/api.md has no ## sections"
    assert [title for title, _ in listed] == sections, (
        "the contents of docs/api.md should list its sections, in order:\n"
        + "\n".join(f"- [{title}](#{_slug(title)})" for title in sections))
    for title, anchor in listed:
        assert anchor == _slug(title), f"contents entry {title!r} links to #{anchor}, " \
                                       f"not #{_slug(title)}"


@pytest.mark.parametrize("title, anchor", [
    ("Strategies: `kdist.distribute`", "strategies-kdistdistribute"),
    ("`kdist.join(comm=None)`", "kdistjoincommnone"),
    ("What kdist changes in the process", "what-kdist-changes-in-the-process"),
])
def test_slug_matches_the_anchors_mkdocs_makes(title, anchor):
    # Anchors the built site is known to have (links to them pass `mkdocs build --strict`).
    assert _slug(title) == anchor
