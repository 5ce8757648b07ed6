"""The package's shape: imports point down the layers, MPI stays in comm, the public
API is declared and documented."""

import ast
import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kdist"

# Bottom first. A module may import its own layer and those below it. Mixed
# precision sits below the optimizers: DistributedOptimizer wraps itself in
# precision's loss-scale optimizer when mixed precision is on.
LAYERS = ["comm", "coordination", "distribute", "callbacks", "precision", "optimizers",
          "sparsity", "tfmot",
          "ps", "gossip", "tensor_parallel", "pipeline", "elastic", "gan", "tune", "cli"]
PUBLIC_PACKAGES = ["kdist", "kdist.callbacks", "kdist.comm", "kdist.distribute",
                   "kdist.elastic", "kdist.gan", "kdist.gossip", "kdist.optimizers",
                   "kdist.pipeline", "kdist.precision", "kdist.ps", "kdist.sparsity",
                   "kdist.tensor_parallel",
                   "kdist.tune"]


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path):
    """(imported kdist module, line) for every import in the file, in functions too."""
    return _imports_in(path.read_text())


def _string_import(node):
    """The module a call `importlib.import_module("kdist...")` or `__import__(...)` names."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    first = node.args[0]
    if name in ("import_module", "__import__") and isinstance(first, ast.Constant) \
            and isinstance(first.value, str):
        return first.value
    return None


def _imports_in(source):
    found = []
    for node in ast.walk(ast.parse(source)):
        named = _string_import(node)
        if named is not None:
            found.append((named, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            inner = [f"{node.module}.{alias.name}" for alias in node.names]
            modules = [name for name in inner if name in MODULES]
            # `from package import name` depends on the package unless every name is a module.
            if len(modules) < len(inner):
                modules.append(node.module)
            found += [(name, node.lineno) for name in modules]
    return [(name, line) for name, line in found if name.split(".")[0] == "kdist"]


def _graph():
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for target, _ in _imports(path):
            while target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_package_has_no_import_cycles():
    # A package's __init__ imports its modules; their imports of the package
    # itself are what makes a cycle, so those count too.
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_an_import_by_a_string_counts_as_an_import():
    planted = ("import importlib\n"
               "def later():\n"
               "    importlib.import_module('kdist.callbacks.agreement')\n")
    assert ("kdist.callbacks.agreement", 3) in _imports_in(planted)
    graph = _graph()
    # Planted: the bottom layer reaching a module that imports it.
    graph["kdist.comm.collectives"] |= {"kdist.optimizers.distributed"}
    assert any("kdist.comm.collectives" in cycle for cycle in _cycles(graph))


# Where kdist imports its own modules by name: the registration with Keras, and the
# packages' declared exports (kdist._exports), each loaded downward on first use.
STRING_IMPORTS_ALLOWED = {"kdist._registration", "kdist._exports"}


def test_kdist_imports_its_modules_by_name_only_to_register_and_export_them():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            named = _string_import(node)
            if named is not None and named.startswith("kdist") \
                    and name not in STRING_IMPORTS_ALLOWED:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {named}")
    assert found == []


def test_nothing_in_kdist_assigns_to_another_librarys_class():
    # What kdist still changes in the process is listed, each with its reason, in
    # docs/api.md ("What kdist changes in the process"); none of it is a class.
    pattern = re.compile(r"(keras|tf|tensorflow|keras_tuner)(\.\w+)+\.\w+ *= |"
                         r"setattr\((keras|tf|tensorflow|keras_tuner)\.|"
                         r"__class__ *=|object\.__new__|__dict__ *=")
    found = {}
    for path in MODULES.values():
        for line in path.read_text().splitlines():
            if pattern.search(line) and not line.lstrip().startswith("#"):
                found.setdefault(str(path.relative_to(ROOT)), []).append(line.strip())
    assert found == {}


def test_the_architecture_page_draws_these_layers():
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [line.split()[0].removeprefix("kdist/").rstrip("/").removesuffix(".py")
             for line in block.splitlines() if line.strip()]
    assert drawn[::-1] == LAYERS


def test_imports_point_down_the_layers():
    upward = []
    for name, path in MODULES.items():
        for target, line in _imports(path):
            mine, theirs = _layer(name), _layer(target)
            if mine and theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert upward == []


def test_only_comm_imports_mpi4py():
    outside = [f"{path.relative_to(ROOT)}:{line}" for name, path in MODULES.items()
               if not name.startswith("kdist.comm")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.Import, ast.ImportFrom))
               for line in [node.lineno]
               if any(n.split(".")[0] == "mpi4py" for n in (
                   [a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""]))]
    assert outside == []


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_name_is_declared_and_documented(package):
    module = importlib.import_module(package)
    declared = getattr(module, "__all__", None)
    assert declared, f"{package} declares no __all__"
    assert len(set(declared)) == len(declared), f"{package}.__all__ repeats a name"
    # The reference is generated from docstrings: a function or class documents itself; a
    # constant or an operation object is documented by its package's docstring or a guide.
    docs = "\n".join([module.__doc__ or ""] + [path.read_text()
                                              for path in (ROOT / "docs").glob("*.md")])
    for name in declared:
        assert not name.startswith("_") or name == "__version__", (
            f"{package}.__all__ exports private {name}")
        assert hasattr(module, name), f"{package}.__all__ names {name}, which it lacks"
        value = getattr(module, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert value.__doc__ and value.__doc__.strip(), (
                f"{package}.{name} is public but has no docstring")
        else:
            assert re.search(rf"\b{re.escape(name)}\b", docs), (
                f"{package}.{name} is public but neither its package's docstring nor a "
                "guide in docs/ mentions it")


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_no_module_is_shadowed_by_a_public_name_of_its_package(package):
    # `from kdist.comm import world` would give the function, not a module `world.py`.
    module = importlib.import_module(package)
    folder = ROOT.joinpath(*package.split("."))
    for name in module.__all__:
        if (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists():
            assert getattr(module, name).__name__.endswith(f"{package}.{name}"), (
                f"{package}.{name} is both a module and another public object")


def _variables_read_by_the_code():
    """Every `KDIST_*` name in kdist's sources, less the C/C++ macros they define."""
    names, macros = set(), set()
    for path in PACKAGE.rglob("*"):
        if path.suffix not in (".py", ".cc", ".h", ".sh"):
            continue
        text = path.read_text()
        names |= set(re.findall(r"(?<![A-Z0-9_])KDIST_[A-Z0-9][A-Z0-9_]*", text))
        macros |= set(re.findall(r"#\s*(?:define|ifndef)\s+(KDIST_\w+)", text))
    return names - macros


def test_every_environment_variable_is_in_the_table_and_every_row_is_read():
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("## Environment variables"):]
    documented = set()
    for row in re.findall(r"^\| ([^|]+) \|", table, flags=re.M):
        documented |= set(re.findall(r"`(KDIST_\w+)`", row))
    read = _variables_read_by_the_code()
    assert read, "found no KDIST_ variable in the sources: the scan is broken"
    assert not read - documented, f"read by kdist, missing from docs/api.md's table: " \
                                  f"{sorted(read - documented)}"
    assert not documented - read, f"in docs/api.md's table, read nowhere: " \
                                  f"{sorted(documented - read)}"


def _cpp_enum(text, name):
    """{enumerator: value} of `enum name : int64_t { ... }` in C++ source."""
    body = re.search(rf"enum {name} : int64_t \{{(.*?)\}};", text, re.S)
    assert body, f"enum {name} not found in the C++ engine"
    return {k: int(v) for k, v in re.findall(r"(k\w+) = (\d+)", body.group(1))}


def test_the_python_and_cpp_wire_protocols_agree():
    from kdist.comm import protocol

    header = (PACKAGE / "comm" / "native" / "engine.h").read_text()
    engine = (PACKAGE / "comm" / "native" / "engine.cc").read_text()
    assert int(re.search(r"constexpr int kHeaderSize = (\d+);", engine).group(1)) == \
        protocol.HEADER_SIZE
    kinds = {"kAllreduce": protocol.ALLREDUCE, "kAllgather": protocol.ALLGATHER,
             "kBroadcast": protocol.BROADCAST, "kBarrier": protocol.BARRIER,
             "kObjectAllgather": protocol.OBJECT_ALLGATHER,
             "kObjectBroadcast": protocol.OBJECT_BROADCAST, "kAlltoall": protocol.ALLTOALL}
    # LEAVE is announced from Python only (a process that ends); the C++ ops see it as a
    # kind they did not announce, a mismatch, as they must.
    assert _cpp_enum(header, "Kind") == kinds
    assert protocol.LEAVE not in kinds.values()
    assert _cpp_enum(header, "Op") == {"kSum": protocol.SUM, "kMin": protocol.MIN,
                                       "kMax": protocol.MAX, "kProduct": protocol.PRODUCT}
    cpp_dtypes = _cpp_enum(header, "DType")
    python_dtypes = {"k" + name.replace("bfloat", "BFloat").replace("float", "Float")
                     .replace("uint", "UInt").replace("int", "Int").replace("bool", "Bool"):
                     code for name, code in protocol.DTYPE_CODES.items()}
    assert cpp_dtypes == python_dtypes


FENCES = {"kdist/_tf_private.py", "kdist/_keras_private.py", "kdist/tune/compat.py"}
FENCE_MODULES = {_module_name(ROOT / fence) for fence in FENCES}
LIBRARIES = ("tensorflow", "keras", "tf_keras", "keras_tuner")
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tf_keras.src", "keras_tuner.src")
# Private names of TensorFlow, Keras (tf_keras too) and keras-tuner: those kdist reaches
# through the fences or has replaced by public API. The names the fences reach are added
# (`_known_private_names`), so a new fence function needs no entry here.
PRIVATE_NAMES = {
    # TensorFlow
    "CONVERSION_RULES", "ASYNC_STATEFUL_OPS", "_context_handle", "_in_multi_worker_mode",
    "_get_cross_replica", "_values", "_tape", "_persistent", "_watch_accessed_variables",
    "_watched_variables", "_distribute_strategy",
    # ... and the hooks of its `StrategyExtendedV2` and `ReplicaContext`
    "_num_replicas_in_sync", "_get_local_replica_id", "_call_for_each_replica",
    "_create_variable", "_local_results", "_reduce_to", "_batch_reduce_to",
    "_gather_to_implementation", "_experimental_distribute_dataset",
    "_distribute_datasets_from_function", "_experimental_distribute_values_from_function",
    "_global_batch_size", "_container_strategy", "_input_workers_with_options", "_device",
    "_strategy",
    # Keras
    "_flatten_layers", "_compile_config", "_initial_epoch", "_iterations", "_keras_history",
    "_get_variable_index", "_inbound_nodes", "_input_shape_arg", "_kernel", "_use_gate",
    "_trainable_variables", "_non_trainable_variables", "_variables", "_moments",
    "_reduction_axes", "_train_writer", "_model",
    # tf_keras's questions to callbacks
    "_supports_tf_logs", "_implements_train_batch_hooks", "_implements_test_batch_hooks",
    "_implements_predict_batch_hooks",
}
# Private names kdist uses as its own where the checks below cannot tell (on a subclass of
# a library's class, or on an object of unknown type), and why each is not a library's.
# Names that start with `_kdist_` (kdist's marks on other objects) need no entry.
ALLOWED_PRIVATE_NAMES = {
    "_trackers": "kdist.gan.GAN's own loss trackers; Keras models have no such attribute",
    "_loss_mean": "the pipeline model's own loss metric (kdist.pipeline), made in compile",
    "_last_logs": "the pipeline model's own logs of its last step (kdist.pipeline)",
    "_reducers": "kdist's AllreduceOptimizer's bucket plans, looked for on any optimizer",
    "_initializing": "Python's ModuleSpec._initializing (importlib), no library's",
}
# Temporary: private uses in modules that are to reach them through the fences next, by
# file, with the names they use now. Each is listed with the fence function it needs.
TEMPORARILY_ALLOWED = {}
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}
OBJECT_ACCESSORS = {"__getattribute__", "__setattr__", "__delattr__"}


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _named_access(node):
    """(object, name) of `getattr(obj, "name")` and kin, and of
    `object.__setattr__(obj, "name", value)` and kin; None for other nodes."""
    if not isinstance(node, ast.Call):
        return None
    function, args = node.func, node.args
    literal = [isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args]
    if isinstance(function, ast.Name) and function.id in ACCESSORS and len(args) > 1:
        return (args[0], args[1].value) if literal[1] else None
    if isinstance(function, ast.Attribute) and function.attr in OBJECT_ACCESSORS and args:
        if literal[0]:  # obj.__setattr__("name", value)
            return function.value, args[0].value
        if len(args) > 1 and literal[1]:  # object.__setattr__(obj, "name", value)
            return args[0], args[1].value
    return None


def _chain(node, through_calls=False):
    """["a", "b", "c"] for `a.b.c` (and for `a.b().c` when `through_calls`); [] when the
    chain does not start at a name."""
    parts = []
    while True:
        if through_calls and isinstance(node, ast.Call):
            node = node.func
        elif through_calls and isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            return [node.id] + parts[::-1]
        else:
            return []


def _whose(dotted):
    """Whose the module or object `dotted` is: "library" for TensorFlow's, Keras's,
    keras-tuner's or a fence's (the fences' mixins stand for the libraries' classes),
    "kdist" for the rest of kdist's, None for anything else's."""
    if dotted.split(".")[0] in LIBRARIES or any(
            dotted == fence or dotted.startswith(fence + ".") for fence in FENCE_MODULES):
        return "library"
    return "kdist" if dotted.split(".")[0] == "kdist" else None


def _bindings(imports):
    """{name: "library" or "kdist"} for the names a module binds by its `imports`."""
    bound = {}
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                whose = _whose(alias.name if alias.asname else alias.name.split(".")[0])
                bound[alias.asname or alias.name.split(".")[0]] = whose
        else:
            for alias in node.names:
                whose = ("kdist" if node.level else
                         _whose(f"{node.module}.{alias.name}" if node.module else alias.name))
                bound[alias.asname or alias.name] = whose
    return {name: whose for name, whose in bound.items() if whose}


def _scan(source):
    """What the checks need of a module: its nodes, each with the innermost class whose
    body holds it (or None), the names its imports bind, and its classes by name with
    their bases."""
    nodes = list(ast.walk(ast.parse(source)))
    classes, holder = {}, {}
    for node in nodes:  # outer classes come first: inner ones take their nodes over
        if isinstance(node, ast.ClassDef):
            holder.update((id(inner), node) for item in node.body for inner in ast.walk(item))
    bound = _bindings([node for node in nodes
                       if isinstance(node, (ast.Import, ast.ImportFrom))])
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, []).append((node.bases, bound))
    return [(node, holder.get(id(node))) for node in nodes], bound, classes


def _kdist_classes(scans):
    """The classes of every scanned module, by name, to follow a class's bases through."""
    index = {}
    for _, _, classes in scans:
        for name, entries in classes.items():
            index.setdefault(name, []).extend(entries)
    return index


def _derives_from_a_library(bases, bound, index, seen=()):
    """Whether a class with `bases` subclasses a class of a library (or a fence's mixin),
    following bases that are kdist's classes by name."""
    for base in bases:
        parts = _chain(base, through_calls=True)
        if not parts:
            continue
        if bound.get(parts[0]) == "library":
            return True
        if parts[-1] not in seen and any(
                _derives_from_a_library(other, other_bound, index, seen + (parts[-1],))
                for other, other_bound in index.get(parts[-1], ())):
            return True
    return False


def _known_private_names():
    """PRIVATE_NAMES and every private name the fences reach, define or override."""
    names = set(PRIVATE_NAMES)
    for fence in FENCES:
        for node, _ in _scan((ROOT / fence).read_text())[0]:
            access = _named_access(node)
            if access is not None:
                names.add(access[1])
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names |= {name for item in node.body for name in _defined(item)}
    return {name for name in names if _is_private(name) or name in PRIVATE_NAMES}


def _defined(statement):
    """The names a statement of a class body defines (methods and class attributes)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [statement.name]
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return []


def _private_uses(source, private_names=None, classes=None, scan=None):
    """(line, name, what) for each use, in a module's `source`, of the libraries' private
    API: (a) an import of a private module; (b) a private attribute named by a string
    (`getattr(x, "_name")`, `object.__setattr__(x, "_name", v)`) of anything but kdist's
    own; (c) `x._name`, `_name` a known private name of theirs, of anything but kdist's
    own; (d) a string that is such a name (an attribute name kept for later);
    (e) a class that defines such a name, overriding a library's private hook.

    `self`, `cls` and `super()` are kdist's own in a class that derives from no library
    class; in one that does, a private name is the library's unless allowed
    (ALLOWED_PRIVATE_NAMES). `classes`: kdist's classes by name (`_kdist_classes`),
    to tell whether a class derives from a library's through them; `scan`: the module's
    `_scan`, when made already."""
    private_names = _known_private_names() if private_names is None else private_names
    nodes, bound, own_classes = _scan(source) if scan is None else scan
    index = dict(classes or {})
    for name, entries in own_classes.items():
        index[name] = index.get(name, []) + entries
    library_class = {}

    def owned(owner, klass, name):
        """Whether the attribute `name` of `owner`, used in `klass`, is kdist's own."""
        parts = _chain(owner)
        if parts and bound.get(parts[0]) == "kdist":
            return True  # a kdist module, or a class of kdist's
        mine = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                or isinstance(owner, ast.Call) and _chain(owner.func) == ["super"])
        if mine and klass is not None:
            if klass not in library_class:
                library_class[klass] = _derives_from_a_library(klass.bases, bound, index)
            if not library_class[klass]:
                return True
        if name in private_names:
            return mine and name in ALLOWED_PRIVATE_NAMES
        return name.startswith("_kdist_") or name in ALLOWED_PRIVATE_NAMES

    found, named, strings = [], set(), []
    for node, klass in nodes:
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Call) and _chain(node.func)[-1:] in (
                ["import_module"], ["__import__"]) and node.args \
                and isinstance(node.args[0], ast.Constant):
            modules = [str(node.args[0].value)]
        found += [(node.lineno, module, f"imports {module}") for module in modules
                  if module.startswith(PRIVATE_MODULES)]
        access = _named_access(node)
        if access is not None:
            owner, name = access
            named.add(id(node.args[1] if node.args[0] is owner else node.args[0]))
            if _is_private(name) and not owned(owner, klass, name):
                found.append((node.lineno, name, f'"{name}" of {ast.unparse(owner)}'))
        elif isinstance(node, ast.Attribute) and node.attr in private_names \
                and not owned(node.value, klass, node.attr):
            found.append((node.lineno, node.attr, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.ClassDef):
            found += [(item.lineno, name, f"class {node.name} defines {name}")
                      for item in node.body for name in _defined(item)
                      if name in private_names and name not in ALLOWED_PRIVATE_NAMES]
        elif isinstance(node, ast.JoinedStr):
            named.update(id(part) for part in node.values)  # pieces of an f-string
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in private_names:
            strings.append(node)
    found += [(node.lineno, node.value, f'the string "{node.value}"')
              for node in strings if id(node) not in named]
    return sorted(found)


_OFFENDERS = {}


def _offenders():
    """{relative path: [(line, name, what)]} of the modules outside the fences (worked out
    once for the tests that need it)."""
    if not _OFFENDERS:
        names = _known_private_names()
        sources = {path.relative_to(ROOT).as_posix(): path.read_text()
                   for path in sorted(PACKAGE.rglob("*.py"))}
        scans = {relative: _scan(source) for relative, source in sources.items()}
        classes = _kdist_classes(scans.values())
        _OFFENDERS.update({relative: _private_uses(source, names, classes, scans[relative])
                           for relative, source in sources.items() if relative not in FENCES})
    return _OFFENDERS


def test_private_apis_of_the_libraries_are_reached_only_through_their_fences():
    offenders = [f"{relative}:{line}: {what}"
                 for relative, uses in _offenders().items()
                 for line, name, what in uses
                 if name not in TEMPORARILY_ALLOWED.get(relative, ())]
    assert not offenders, (
        "private API of TensorFlow, Keras or keras-tuner outside kdist/_tf_private.py, "
        "kdist/_keras_private.py and kdist/tune/compat.py (add a function there):\n"
        + "\n".join(offenders))
    # The check sees what it looks for.
    for fence in FENCES:
        assert _private_uses((ROOT / fence).read_text()), fence


def test_every_temporary_allowance_is_still_needed():
    uses = _offenders()
    unused = {relative: sorted(set(names) - {name for _, name, _ in uses.get(relative, ())})
              for relative, names in TEMPORARILY_ALLOWED.items()}
    assert not {relative: names for relative, names in unused.items() if names}, (
        "no longer used there: take these out of TEMPORARILY_ALLOWED")


def test_the_fence_check_catches_private_names_however_they_are_reached():
    planted = '''
import keras
from keras.src.layers import Dense
from kdist import _keras_private


class Wrapper(keras.layers.Wrapper):
    def __init__(self, layer):
        super().__init__(layer)
        self._input_shape_arg = getattr(layer, "_input_shape_arg", None)

    def _moments(self, inputs, mask):
        return None


class Mixed(_keras_private.MomentsThrough):
    def build(self):
        return hasattr(self, "_something_of_keras")


def strategy_of(model):
    kernel_names = ("_kernel", "kernel")
    return model._distribute_strategy, kernel_names


def gate(layer):
    object.__setattr__(layer, "_use_gate", False)
    return layer.__getattribute__("_trainable_variables")
'''
    found = {(line, what) for line, _, what in _private_uses(planted)}
    assert found == {
        (3, "imports keras.src.layers"),
        (10, "self._input_shape_arg"),
        (10, '"_input_shape_arg" of layer'),
        (12, "class Wrapper defines _moments"),
        (18, '"_something_of_keras" of self'),
        (22, 'the string "_kernel"'),
        (23, "model._distribute_strategy"),
        (27, '"_use_gate" of layer'),
        (28, '"_trainable_variables" of layer'),
    }
    clean = '''
import logging
import keras
from kdist.coordination import consistency


class Counter:
    def __init__(self):
        self._count = 0
        self._variables = []

    def count(self):
        return getattr(self, "_count", 0) + len(self._variables)


class Callback(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self._kdist_seen = getattr(self, "_kdist_seen", 0) + 1
        return consistency._values, self.model.distribute_strategy


def configure():
    root = logging.getLogger("kdist")
    root._kdist_configured = getattr(root, "_kdist_configured", False)
'''
    assert _private_uses(clean) == []


def test_the_internals_the_fences_reach_are_where_they_look():
    # A Keras or TensorFlow release that moves one of them fails here, by name.
    import warnings

    import keras
    import numpy as np
    import tensorflow as tf

    from kdist import _keras_private, _tf_private

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras prefers an Input to input_shape=
        first = keras.layers.Dense(2, input_shape=(3,))
    wrapper = keras.layers.Dense(2)
    _keras_private.pass_on_input_shape(wrapper, first)
    assert tuple(keras.Sequential([wrapper]).inputs[0].shape) == (None, 3)

    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    assert _keras_private.stored_kernel(dense) is dense.kernel
    assert _keras_private.stored_kernel(keras.layers.Dropout(0.5)) is None
    assert [id(v) for v in _keras_private.own_layer_variables(dense)] == \
        [id(dense.kernel), id(dense.bias)]

    gated = keras.layers.MultiHeadAttention(2, 4, use_gate=True)
    assert _keras_private.attention_uses_gate(gated)
    assert not _keras_private.attention_uses_gate(keras.layers.MultiHeadAttention(2, 4))

    class Fixed(_keras_private.MomentsThrough, keras.layers.BatchNormalization):
        def batch_moments(self, inputs, mask, axes):
            self.seen_axes = tuple(axes)
            return keras.ops.zeros((2,)), keras.ops.ones((2,))

    norm = Fixed(epsilon=0.0, center=False, scale=False)
    out = norm(np.full((4, 2), 3.0, dtype="float32"), training=True)
    assert np.allclose(keras.ops.convert_to_numpy(out), 3.0) and norm.seen_axes == (0,)

    variable = keras.Variable(np.ones(2, dtype="float32"))
    inner = keras.optimizers.SGD()
    scaled = keras.optimizers.LossScaleOptimizer(inner)
    scaled.build([variable])
    own = _keras_private.optimizer_own_variables(scaled)
    assert own and not {id(v) for v in own} & {id(v) for v in inner.variables}
    assert [id(v) for v in _keras_private.optimizer_built_variables(inner)] == [id(variable)]
    assert isinstance(getattr(keras.callbacks.TensorBoard, "_train_writer", None), property)

    weight = tf.Variable(2.0)
    with tf.GradientTape() as tape:
        loss = weight * weight
    recording, _, _, watched = _tf_private.gradient_tape_state(tape)
    fresh = tf.GradientTape()
    _tf_private.continue_recording(fresh, recording, watched)
    assert float(fresh.gradient(loss, weight)) == 4.0


def test_tf_keras_callbacks_answer_what_kdists_callbacks_ask_them():
    tf_keras = pytest.importorskip("tf_keras")
    from kdist import _keras_private

    class Probe(tf_keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            pass

    answers = {mode: _keras_private.calls_batch_hooks(Probe(), mode)
               for mode in _keras_private.TF_KERAS_BATCH_MODES}
    assert answers == {"train": False, "test": True, "predict": False}


def _modules_after_import_keras(**env):
    import json
    import os
    import subprocess
    import sys

    code = ("import sys, json, kdist\n"
            "def hooked(): return any(type(f).__name__ == '_WatchKeras' for f in sys.meta_path)\n"
            "before = hooked(); import keras\n"
            "print(json.dumps([sorted(m for m in sys.modules if m.startswith('kdist.')), "
            "before, hooked()]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_keras_after_kdist_registers_kdists_classes_and_nothing_more():
    modules, hooked, after = _modules_after_import_keras()
    assert "kdist.optimizers.distributed" in modules and "kdist.sparsity.pruning" in modules
    # Only what defines saveable classes: not the FPGA export, not the pipeline machinery.
    assert "kdist.sparsity.hls" not in modules and "kdist.pipeline.model" not in modules
    assert hooked and not after, "the finder removes itself once Keras is in"
    modules, hooked, after = _modules_after_import_keras(KDIST_KERAS_REGISTRATION="0")
    assert "kdist.optimizers.distributed" not in modules and not hooked and not after


def test_the_keras_names_kdist_recognises_still_exist():
    # kdist._keras_private recognises Keras's steps by these names; a Keras that renames
    # them fails here, not silently in a distributed run.
    import keras

    from kdist import _keras_private

    assert callable(getattr(keras.optimizers.LossScaleOptimizer, "check_finite", None))
    assert callable(getattr(keras.Model, "predict_step", None))
    assert callable(getattr(keras.Model, "make_predict_function", None))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert _keras_private.is_loss_scale_finite_check(optimizer.check_finite)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _keras_private.is_predict_step(model.predict_step)
    assert not _keras_private.is_predict_step(model.train_step)
