"""Builds the API reference from the packages' declared exports (mkdocs hook).

A reference page holds `::: kdist.<package>`. This hook reads that package's
`_EXPORTS` (see kdist/_exports.py) from its source, without importing kdist,
and puts in the directive's place the package's description followed by one
entry per public name, documented where it is defined and titled with the name
users write (`kdist.sparsity.prune`, not `kdist.sparsity.pruning.prune`).
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^::: (kdist(?:\.\w+)*)\s*$")


def declared_exports(package):
    """The `_EXPORTS` mapping of `package`'s `__init__.py`, or None if it has none."""
    path = ROOT.joinpath(*package.split("."), "__init__.py")
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return ast.literal_eval(node.value)
    return None


def reference(package, exports):
    """The directives documenting `package` and each of its public names. A name defined
    in another package that has its own page is listed with a link to its entry there."""
    lines = [f"::: {package}", "    options:", "      show_root_heading: false",
             "      members: false", ""]
    names = sorted((name for name, module in exports.items()
                    if module != f"{package}.{name}" and not name.startswith("_")),
                   key=lambda name: (name.lower(), name))
    elsewhere = []
    for name in names:
        module = defining_module(exports[name], name)
        home = _documenting_package(module)
        if home not in (None, package):
            elsewhere.append(f"- [](){{#{package}.{name}}}`{package}.{name}`: "
                             f"[`{home}.{name}`][{module}.{name}]")
            continue
        # The anchor users link to is the name they write; the entry's own is its home.
        lines += [f"[](){{#{package}.{name}}}", "",
                  f"::: {module}.{name}", "    options:",
                  f"      heading: \"{package}.{name}\"", f"      toc_label: \"{name}\"",
                  "      heading_level: 2", "      show_root_heading: true", ""]
    if elsewhere:
        lines += ["## Documented with their packages", ""] + elsewhere + [""]
    return lines


def defining_module(source, name):
    """The module that defines `name`, following packages that export it from another
    (`kdist` takes `allreduce` from `kdist.comm`, which takes it from its collectives)."""
    while True:
        exports = declared_exports(source)
        if exports is None or exports.get(name) in (None, source):
            return source
        source = exports[name]


def _documenting_package(module):
    """The package with its own reference page whose exports hold `module`'s names."""
    parts = module.split(".")
    for length in range(len(parts), 1, -1):
        candidate = ".".join(parts[:length])
        if declared_exports(candidate) is not None and any(
                source == module for source in declared_exports(candidate).values()):
            return candidate
    return None


def on_page_markdown(markdown, **_):
    lines, out, index = markdown.splitlines(), [], 0
    while index < len(lines):
        match = DIRECTIVE.match(lines[index])
        exports = declared_exports(match.group(1)) if match else None
        if exports is None:
            out.append(lines[index])
            index += 1
            continue
        index += 1
        while index < len(lines) and lines[index].startswith("    "):
            index += 1  # the directive's own options
        out += reference(match.group(1), exports)
    return "\n".join(out) + "\n"
