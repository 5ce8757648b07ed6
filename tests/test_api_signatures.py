"""docs/api.md agrees with the code: its signature headings and its table of contents.

A heading such as "### `kdist.ps.topology(size, submasters=0, servers=1)`" is read as a
Python parameter list and compared with `inspect.signature` of the object it
names (a class through its `__init__`): the same names, in the same order, of
the same kinds (positional-only, `*args`, keyword-only, `**kwargs`), with the
same defaults. A heading "### `kdist.tune.TESTED_KERAS_TUNER`", without a
parameter list, only has to name something that exists. A heading may hold
several such names, each in its own backticks. Headings for the `kdist`
command ("### `kdist run`") are left to the command's own tests.

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

# One name in backticks: `kdist.a.b`, or `kdist.a.b(parameters)`.
SIGNATURE = re.compile(r"^(?P<name>kdist(?:\.[A-Za-z_]\w*)+)(?:\((?P<parameters>.*)\))?$", re.S)
# `kdist run`, `kdist plan`: subcommands of the command line, not Python names.
COMMAND = re.compile(r"^kdist [a-z]+$")
SPAN = re.compile(r"`([^`]+)`")
KINDS = inspect.Parameter
NO_DEFAULT = inspect.Parameter.empty


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


def _documented(name, text):
    """The heading's parameters as (name, kind, default expression or None), in order."""
    try:
        tree = ast.parse(f"def f({text}): pass")
    except SyntaxError as error:
        raise ValueError(f"`{name}({text})` is not a Python parameter list: {error.msg}")
    arguments = tree.body[0].args
    listed = []
    positional = arguments.posonlyargs + arguments.args
    # Defaults belong to the last positional parameters, in order.
    defaults = [None] * (len(positional) - len(arguments.defaults)) + arguments.defaults
    for index, argument in enumerate(positional):
        kind = KINDS.POSITIONAL_ONLY if index < len(arguments.posonlyargs) \
            else KINDS.POSITIONAL_OR_KEYWORD
        listed.append((argument.arg, kind, defaults[index]))
    if arguments.vararg:
        listed.append((arguments.vararg.arg, KINDS.VAR_POSITIONAL, None))
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        listed.append((argument.arg, KINDS.KEYWORD_ONLY, default))
    if arguments.kwarg:
        listed.append((arguments.kwarg.arg, KINDS.VAR_KEYWORD, None))
    return listed


def _resolve(name):
    """The object a dotted name gives, importing submodules that are not attributes yet."""
    parts = name.split(".")
    target = importlib.import_module(parts[0])
    for index in range(1, len(parts)):
        try:
            target = getattr(target, parts[index])
        except AttributeError:
            # A submodule that its package does not import (kdist.ps.shared, kdist.comm.p2p).
            target = importlib.import_module(".".join(parts[:index + 1]))
    return target


def _actual(target):
    """The code's parameters, as `inspect.Parameter`s; a class's are its `__init__`'s."""
    if inspect.isclass(target):
        parameters = list(inspect.signature(target.__init__).parameters.values())
        return parameters[1:]  # self
    return list(inspect.signature(target).parameters.values())


def _value(expression, target):
    """A documented default as a value: a literal, or an expression over kdist and the names
    of the module that defines the object (`kdist.Average`, `2.0**15`, `DEFAULT_BUCKET_BYTES`)."""
    try:
        return ast.literal_eval(expression)
    except ValueError:
        pass
    import kdist

    module = inspect.getmodule(target.__init__ if inspect.isclass(target) else target)
    names = dict(vars(module)) if module else {}
    names["kdist"] = kdist
    # No builtins: a default is a value, not a call.
    names["__builtins__"] = {}
    return eval(compile(ast.Expression(expression), "<default>", "eval"), names)


def _same(documented, actual):
    # Equal values of different types (1 and 1.0, 0 and False) read differently in the doc.
    return type(documented) is type(actual) and documented == actual


def _kind(kind):
    return {KINDS.POSITIONAL_ONLY: "positional-only", KINDS.POSITIONAL_OR_KEYWORD: "positional",
            KINDS.VAR_POSITIONAL: "*args", KINDS.KEYWORD_ONLY: "keyword-only",
            KINDS.VAR_KEYWORD: "**kwargs"}[kind]


def _compare(name, documented, target):
    """Every way the documented parameters differ from the code's, one line each."""
    actual = _actual(target)
    problems = []
    code_names = [p.name for p in actual]
    doc_names = [entry[0] for entry in documented]
    for extra in (n for n in doc_names if n not in code_names):
        problems.append(f"{name}: documents `{extra}`, which the code does not take")
    for missing in (n for n in code_names if n not in doc_names):
        problems.append(f"{name}: leaves out the code's `{missing}`")
    shared_doc = [n for n in doc_names if n in code_names]
    shared_code = [n for n in code_names if n in doc_names]
    if shared_doc != shared_code:
        problems.append(f"{name}: order ({', '.join(shared_doc)}) but the code has "
                        f"({', '.join(shared_code)})")
    by_name = {p.name: p for p in actual}
    for parameter, kind, default in documented:
        real = by_name.get(parameter)
        if real is None:
            continue
        if kind is not real.kind:
            problems.append(f"{name}: `{parameter}` is {_kind(real.kind)} in the code, "
                            f"{_kind(kind)} in the doc")
        if default is None and real.default is not NO_DEFAULT:
            problems.append(f"{name}: `{parameter}` defaults to {real.default!r} in the code; "
                            "the doc gives no default")
        elif default is not None and real.default is NO_DEFAULT:
            problems.append(f"{name}: `{parameter}` has no default in the code; the doc gives "
                            f"{ast.unparse(default)}")
        elif default is not None:
            try:
                value = _value(default, target)
            except Exception as error:  # a name the doc uses that the code does not have
                problems.append(f"{name}: `{parameter}`'s default {ast.unparse(default)} "
                                f"cannot be evaluated ({error!r})")
                continue
            if not _same(value, real.default):
                problems.append(f"{name}: `{parameter}` defaults to {real.default!r} in the "
                                f"code, {ast.unparse(default)} ({value!r}) in the doc")
    return problems


def _signature_problems():
    problems, checked = [], 0
    for line, heading in _headings("###"):
        spans = SPAN.findall(heading)
        if not spans or not heading.startswith("`"):
            continue  # a plain title ("### Helpers")
        for span in spans:
            where = f"docs/api.md:{line}"
            if COMMAND.match(span):
                continue
            match = SIGNATURE.match(span)
            if not match:
                problems.append(f"{where}: `{span}` is neither `kdist.name` nor "
                                "`kdist.name(parameters)`")
                continue
            name, parameters = match.group("name"), match.group("parameters")
            try:
                target = _resolve(name)
            except (ImportError, AttributeError) as error:
                problems.append(f"{where}: {name} cannot be imported ({error!r})")
                continue
            checked += 1
            if parameters is None:
                continue
            try:
                documented = _documented(name, parameters)
            except ValueError as error:
                problems.append(f"{where}: {error}")
                continue
            problems.extend(f"{where}: {problem}"
                            for problem in _compare(name, documented, target))
    return problems, checked


def test_every_signature_heading_matches_the_code():
    problems, checked = _signature_problems()
    # The guide documents far more than this; fewer means the headings stopped being read.
    assert checked > 150, f"only {checked} names read from the headings of docs/api.md"
    assert not problems, "docs/api.md differs from the code:\n" + "\n".join(problems)


def _sample(path, mode="r", *extra, size=1, **options):
    """A callable whose signature has every kind of parameter, for checking the checker."""


@pytest.mark.parametrize("heading, expected", [
    ('path, mode="r", *extra, size=1, **options', []),
    ('path, mode="w", *extra, size=1, **options', ["`mode` defaults to 'r'"]),
    ('path, mode="r", *extra, size=1.0, **options', ["`size` defaults to 1"]),
    ('path, mode="r", *extra, size=1', ["leaves out the code's `options`"]),
    ('path, mode="r", *extra, size=1, flag=False, **options',
     ["documents `flag`, which the code does not take"]),
    ('mode="r", path, *extra, size=1, **options', None),  # not even a parameter list
    ('path, *extra, mode="r", size=1, **options',
     ["order (path, extra, mode, size, options)", "`mode` is positional in the code"]),
    ('path, mode="r", *extra, size, **options', ["`size` defaults to 1 in the code; the doc"]),
    ('path, mode="r", size=1, **options',
     ["leaves out the code's `extra`", "`size` is keyword-only in the code"]),
])
def test_the_comparison_finds_each_kind_of_difference(heading, expected):
    try:
        documented = _documented("sample", heading)
    except ValueError:
        assert expected is None
        return
    problems = _compare("sample", documented, _sample)
    assert len(problems) == len(expected), problems
    for problem, part in zip(problems, expected):
        assert part in problem, problems


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
    ("`kdist.distribute.plan(workload, cluster, micro_batches=8)`",
     "kdistdistributeplanworkload-cluster-micro_batches8"),
    ("What kdist changes in the process", "what-kdist-changes-in-the-process"),
])
def test_slug_matches_the_anchors_mkdocs_makes(title, anchor):
    # Anchors the built site is known to have (links to them pass `mkdocs build --strict`).
    assert _slug(title) == anchor
