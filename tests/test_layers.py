"""The package's shape: imports point down the layers, MPI stays in comm, the public
API is declared and documented."""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kdist"

# Bottom first. A module may import its own layer and those below it. Mixed
# precision sits below the optimizers: DistributedOptimizer wraps itself in
# precision's loss-scale optimizer when mixed precision is on.
LAYERS = ["comm", "distribute", "callbacks", "precision", "optimizers", "sparsity", "tfmot",
          "ps", "gossip", "pipeline", "elastic", "gan", "tune", "cli"]
PUBLIC_PACKAGES = ["kdist", "kdist.callbacks", "kdist.comm", "kdist.distribute",
                   "kdist.elastic", "kdist.gan", "kdist.gossip", "kdist.optimizers",
                   "kdist.pipeline", "kdist.precision", "kdist.ps", "kdist.sparsity",
                   "kdist.tune"]


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path):
    """(imported kdist module, line) for every import in the file, in functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
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
    docs = "\n".join(path.read_text() for path in (ROOT / "docs").glob("*.md"))
    for name in declared:
        assert not name.startswith("_") or name == "__version__", (
            f"{package}.__all__ exports private {name}")
        assert hasattr(module, name), f"{package}.__all__ names {name}, which it lacks"
        assert re.search(rf"\b{re.escape(name)}\b", docs), (
            f"{package}.{name} is public but docs/ never mentions it")


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
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tf_keras.src", "keras_tuner.src")
# Private names of TensorFlow and Keras that kdist relies on (see the fences).
PRIVATE_NAMES = {"_flatten_layers", "_compile_config", "_initial_epoch", "_iterations",
                 "_context_handle", "CONVERSION_RULES", "ASYNC_STATEFUL_OPS",
                 "_in_multi_worker_mode", "_get_cross_replica", "_values", "_keras_history",
                 "_get_variable_index", "_tape", "_persistent", "_watch_accessed_variables",
                 "_watched_variables"}


def _private_uses(path):
    """(line, what) for each import of a private module and each private name reached
    on something other than the module's own objects (`self`, `cls`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [(node.lineno, f"import {n}") for n in names
                  if n.startswith(PRIVATE_MODULES)]
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, f".{node.attr}"))
    return found


def test_private_apis_of_tensorflow_and_keras_are_reached_only_through_their_fences():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative in FENCES:
            continue
        offenders += [f"{relative}:{line}: {what}" for line, what in _private_uses(path)]
    assert not offenders, ("private TensorFlow or Keras API outside kdist/_tf_private.py "
                           "and kdist/_keras_private.py:\n" + "\n".join(offenders))
    # The check sees what it looks for.
    assert _private_uses(ROOT / "kdist" / "_tf_private.py")
    assert _private_uses(ROOT / "kdist" / "_keras_private.py")


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


def test_without_registration_an_mpi_strategy_still_brings_the_agreement_callbacks():
    import os
    import subprocess
    import sys

    code = ("import sys, kdist, keras\n"
            "before = 'kdist.callbacks.agreement' in sys.modules\n"
            "kdist.distribute.MPIStrategy()\n"
            "print(before, 'kdist.callbacks.agreement' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                   KDIST_KERAS_REGISTRATION="0"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "True"]


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
