"""Public names, declared once per package.

Each package's `__init__` maps its public names to the modules that define them
and hands the mapping to `declare`:

    _EXPORTS = {"GAN": "kdist.gan.gan", "algorithms": "kdist.ps.algorithms"}
    __all__, __getattr__, __dir__ = declare(__name__, _EXPORTS)

`__all__`, attribute access and the API reference all come from that one
mapping (the documentation build reads it from the source; see
docs/hooks/reference.py). A name is imported on first use and kept (PEP 562), so
`import kdist` costs no TensorFlow and `kdist run --help` starts at once. A name
mapped to its own path (`"algorithms": "kdist.ps.algorithms"`) is that
submodule.
"""

import importlib
import sys
from importlib import util


def declare(package, exports, missing=None):
    """(`__all__`, `__getattr__`, `__dir__`) for `package` (its `__name__`).

    `exports` maps each public name to the module that defines it. `missing`
    maps names a user may reach for that the package does not provide to the
    advice its `AttributeError` gives.
    """
    module = sys.modules[package]
    missing = dict(missing or {})

    def __getattr__(name):
        source = exports.get(name)
        if source is not None:
            imported = importlib.import_module(source)
            value = imported if source == f"{package}.{name}" else getattr(imported, name)
            setattr(module, name, value)
            return value
        if name in missing:
            raise AttributeError(f"{package} does not provide {name!r}: {missing[name]}.")
        # A submodule that is not a public name loads as an eager package's would.
        if not name.startswith("_") and util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(module)) | set(exports))

    return sorted(exports), __getattr__, __dir__
