"""Runs the Python code blocks of Markdown pages: `docs_runner.py PAGE` or `--each PAGE:N ...`.

A page's ```python blocks run in order in one namespace, which starts with
the names of `docs_preamble.py`, so that a later block sees what an earlier
one defined. A block of `>>>` lines runs as a doctest (its printed results
are checked). An HTML comment on the line before a block's fence says how
else to treat it (it does not show on the rendered page):

- `<!-- docs: mpi N -->`: the block is a multi-rank script; it runs alone
  (after a fresh preamble) on N ranks under mpiexec, through `--each`, which
  runs several such blocks one after the other in one job;
- `<!-- docs: signature -->`: the block lists calls that show a callable's
  signature; every argument name and default shown must be the real one,
  and all parameters must be shown unless the call ends with `...` (the
  arguments of keras-tuner's base `Oracle`, which every oracle passes on,
  may be left out);
- `<!-- docs: skip REASON -->`: not run; kept for what truly cannot run here.

Exits non-zero, naming the page and line of the failing block.
"""

import argparse
import ast
import doctest
import gc
import importlib
import inspect
import os
import re
import sys
import traceback
import time

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*docs:\s*(mpi|signature|skip)\b\s*(.*?)\s*-->\s*$")


class Block:
    def __init__(self, index, line, code, kind="run", argument=""):
        self.index, self.line, self.code = index, line, code
        self.kind, self.argument = kind, argument

    @property
    def ranks(self):
        return int(self.argument) if self.kind == "mpi" else 1


def blocks(text):
    """The page's python blocks, each with its kind from the marker above it."""
    found = []
    for index, match in enumerate(FENCE.finditer(text)):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        line = text.count("\n", 0, match.start()) + 2  # the block's first code line
        marker = MARKER.search(before)
        kind, argument = (marker.group(1), marker.group(2)) if marker else ("run", "")
        code = match.group(1)
        if kind == "run" and code.lstrip().startswith(">>>"):
            kind = "doctest"
        found.append(Block(index, line, code, kind, argument))
    return found


def preamble():
    """The preamble's names, made afresh: a block must not see another's changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    module = importlib.reload(importlib.import_module("docs_preamble"))
    return {name: value for name, value in vars(module).items() if not name.startswith("__")}


def run(block, namespace, page):
    where = f"{page}:{block.line}"
    if block.kind == "doctest":
        test = doctest.DocTestParser().get_doctest(block.code, namespace, where, page,
                                                   block.line - 1)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS |
                                       doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=sys.stdout.write, clear_globs=False)
        if runner.failures:
            raise AssertionError(f"{where}: {runner.failures} doctest failure(s)")
    elif block.kind == "signature":
        check_signatures(block.code, namespace, where)
    else:
        exec(compile(block.code, where, "exec"), namespace)


def check_signatures(code, namespace, where):
    for statement in ast.parse(code).body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not isinstance(call, ast.Call):
            raise AssertionError(f"{where}: a signature block holds only calls; got "
                                 f"{ast.unparse(statement)!r}")
        name = ast.unparse(call.func)
        parameters = inspect.signature(eval(name, namespace)).parameters
        partial = bool(call.args) and _is_ellipsis(call.args[-1])
        shown = []
        for argument in call.args[:len(call.args) - partial]:
            if not isinstance(argument, ast.Name):
                raise AssertionError(f"{where}: {name}: positional {ast.unparse(argument)!r} "
                                     "should be a parameter's name")
            shown.append(argument.id)
        for keyword in call.keywords:
            if keyword.arg is None:  # **name stands for the callable's **kwargs
                variadic = [p for p in parameters.values() if p.kind is p.VAR_KEYWORD]
                if not variadic:
                    raise AssertionError(f"{where}: {name} takes no **kwargs")
                shown.append(variadic[0].name)
                continue
            shown.append(keyword.arg)
            if keyword.arg not in parameters:
                raise AssertionError(f"{where}: {name} has no parameter {keyword.arg!r}")
            default = parameters[keyword.arg].default
            if "..." in ast.unparse(keyword.value):
                continue  # a placeholder such as [...]: the name is shown, not a value
            try:
                value = ast.literal_eval(keyword.value)
            except ValueError:
                value = _evaluated(keyword.value)
            if value is not ... and value != default:
                raise AssertionError(f"{where}: {name}: {keyword.arg} defaults to {default!r}, "
                                     f"not {value!r}")
        for parameter in shown:
            if parameter not in parameters:
                raise AssertionError(f"{where}: {name} has no parameter {parameter!r}")
        missing = [p for p in parameters
                   if p not in shown and p != "self" and p not in _keras_tuner_oracle_arguments()]
        if missing and not partial:
            raise AssertionError(f"{where}: {name} does not show {', '.join(missing)}")


def _keras_tuner_oracle_arguments():
    try:
        import keras_tuner
    except ImportError:
        return set()
    return set(inspect.signature(keras_tuner.Oracle.__init__).parameters) - {
        "self", "objective", "max_trials", "seed"}


def _is_ellipsis(node):
    return isinstance(node, ast.Constant) and node.value is ...


def _evaluated(node):
    """The value of a small arithmetic default such as `1/3`; `...` otherwise."""
    try:
        return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})
    except Exception:  # noqa: BLE001  (a name: the block shows the parameter, not a value)
        return ...


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", help="run this page's single-process blocks")
    parser.add_argument("--each", nargs="+", default=[], metavar="PAGE:N",
                        help="run block N of PAGE (counted from 0) alone, for each given")
    parser.add_argument("--cwd", help="directory to run in (blocks write files)")
    args = parser.parse_args(argv)
    if args.cwd:
        os.chdir(args.cwd)
    if args.page:
        with open(args.page) as file:
            found = blocks(file.read())
        namespace = preamble()
        _settle_imports()
        chosen = [b for b in found if b.kind in ("run", "doctest", "signature")]
        return 1 if _run_all([(args.page, b) for b in chosen], lambda: namespace, False) else 0
    jobs = []
    for spec in args.each:
        page, index = spec.rsplit(":", 1)
        with open(page) as file:
            jobs.append((page, blocks(file.read())[int(index)]))
    if jobs:
        preamble()  # for its imports, so that they are settled too
    _settle_imports()
    return 1 if _run_all(jobs, preamble, True) else 0


def _settle_imports():
    """Hides what the imports made from the garbage collector, as conftest.py does for
    the test process: keras-tuner collects garbage twice a trial, about 0.3 s each."""
    gc.collect()
    gc.freeze()


def _run_all(jobs, namespace_for, apart):
    """Runs each (page, block) until one fails; returns the failures.

    It stops there: a page's later blocks build on the failed one. With
    `apart` (multi-rank blocks) the error is raised on, since the other
    ranks may wait in one of the block's collectives: kdist then ends the
    job rather than let them wait. Also with `apart`, each block
    runs in a directory of its own, so that no block resumes from another's
    checkpoints.
    """
    failed, home = [], os.getcwd()
    for page, block in jobs:
        name = os.path.basename(page)
        if apart:
            os.chdir(home)
            os.makedirs(f"{name}-{block.line}", exist_ok=True)
            os.chdir(f"{name}-{block.line}")
        started = time.perf_counter()
        try:
            run(block, namespace_for(), name)
        except BaseException:  # noqa: BLE001  (SystemExit too: a block must not end the run)
            traceback.print_exc()
            print(f"FAILED: {name}:{block.line}", flush=True)
            if apart:
                raise  # uncaught, so that kdist ends the whole job instead of a rank waiting
            failed.append(block)
            break
        print(f"ok: {name}:{block.line} ({block.kind}, {time.perf_counter() - started:.1f} s)",
              flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
