"""Registers kdist's saveable classes with Keras as soon as Keras is imported.

`keras.models.load_model` finds a class saved as "kdist>AllreduceOptimizer"
only if the module defining it has run. Those modules import TensorFlow,
which `import kdist` must not do (the `kdist run` launcher starts in a
fraction of a second), so registration waits for Keras: if Keras is already
imported it happens at once; otherwise a finder at the front of
`sys.meta_path` watches the imports of `keras` and `tensorflow` (each imports
the other while it starts) and, once both have finished, imports kdist's
modules that register classes, and removes itself.
"""

import importlib
import importlib.abc
import os
import sys
import warnings

# The modules whose import registers every class kdist writes into saved models.
SERIALIZABLE_MODULES = (
    "kdist.optimizers.distributed",  # AllreduceOptimizer (what DistributedOptimizer returns)
    "kdist.optimizers.lars",  # LARS
    "kdist.precision.policy",  # LossScaleOptimizer
    "kdist.sparsity.pruning",  # PruneLowMagnitude
    "kdist.sparsity.quantization",  # QuantizeAware
    "kdist.sparsity.annotation",  # QuantizeAnnotate
    "kdist.sparsity.configured",  # QuantizeWithConfig, QuantizeAwareActivation
    "kdist.sparsity.quantizers",  # LastValueQuantizer and the other quantizers
    "kdist.sparsity.inputs",  # QuantizeLayer, FixedRangeConfig
    "kdist.sparsity.weightless",  # the configs of layers without weights
    "kdist.sparsity.registry",  # KernelQuantizeConfig
    "kdist.sparsity.schedules",  # the pruning schedules
    "kdist.gan.gan",  # GAN
    "kdist.distribute.sync_batch_norm",  # SyncBatchNormalization
    "kdist.tensor_parallel.dense",  # ColumnParallelDense, RowParallelDense
    "kdist.tensor_parallel.einsum",  # ColumnParallelEinsumDense, RowParallelEinsumDense
    "kdist.tensor_parallel.attention",  # TensorParallelMultiHeadAttention
)

_WATCHED = ("keras", "tensorflow")

_registered = False


def register():
    """Imports the modules that register kdist's classes with Keras (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name in SERIALIZABLE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # A broken optional part must not break `import keras`.
            warnings.warn(f"kdist could not import {name} ({type(error).__name__}: {error}); "
                          "models holding its classes load only once it imports.",
                          stacklevel=2)


def _loaded(name):
    """Whether module `name` has been imported and has finished running."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def _ready(finished=None):
    """Whether Keras, and TensorFlow if it is being imported, have finished starting.

    TensorFlow imports Keras before it has finished starting, and Keras
    imports TensorFlow: kdist's modules need both complete. `finished` names
    a module whose code has just run (Python marks it complete a moment later).
    """
    def done(name):
        return name == finished or _loaded(name)

    return done("keras") and ("tensorflow" not in sys.modules or done("tensorflow"))


class _WatchKeras(importlib.abc.MetaPathFinder):
    """Wraps the loaders of `keras` and `tensorflow` to register once both have run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader, self)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """Runs the real loader, then registers if Keras and TensorFlow are both complete."""

    def __init__(self, loader, finder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # The module names its real loader: nothing after this sees the wrapper.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if _ready(finished=module.__name__):
            _uninstall(self._finder)
            register()

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _uninstall(finder):
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install():
    """Registers now if Keras is loaded, otherwise as soon as it is (idempotent).

    `KDIST_KERAS_REGISTRATION=0` leaves Keras's imports alone: kdist's classes are then
    registered when a script imports the modules that define them (any use of
    `kdist.DistributedOptimizer`, `kdist.sparsity`, ... does), and `kdist.load_model`
    imports them all before it loads.
    """
    if _registered or os.environ.get("KDIST_KERAS_REGISTRATION", "1").strip().lower() in (
            "0", "false", "no", "off"):
        return
    if _ready():
        register()
    elif not any(isinstance(finder, _WatchKeras) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WatchKeras())
