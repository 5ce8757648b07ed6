"""Package attributes loaded on first use (PEP 562), for packages whose public names
would otherwise import heavy modules when the package is imported."""

import importlib
from importlib import util


def lazy_attributes(package, names):
    """(`__getattr__`, `__dir__`) for package `package` (its `__name__`) whose public
    `names` map each name to the module defining it. A name is imported on first access
    and kept; a submodule's name gives the submodule, as an eager package would."""
    module = importlib.import_module(package)

    def __getattr__(name):
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            setattr(module, name, value)
            return value
        if not name.startswith("_") and util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module '{package}' has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(module)) | set(names))

    return __getattr__, __dir__
