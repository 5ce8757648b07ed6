"""Lists of Keras or TensorFlow variables: how kdist names one and fills many."""

import numpy as np


def path_of(variable):
    """A variable's path (Keras 3), else its name (TensorFlow), else None."""
    return getattr(variable, "path", None) or getattr(variable, "name", None)


def assign_all(variables, values, what, why=""):
    """Assigns `values` to `variables` in order, all of them or, on a count or
    shape that differs, none: the `ValueError` then names `what` (the owner of
    the variables) and ends with `why` (what the difference means there)."""
    variables = list(variables)
    if len(values) != len(variables):
        raise ValueError(f"{what} has {len(variables)} variables but {len(values)} values "
                         f"were given{why}.")
    for variable, value in zip(variables, values):
        shape = tuple(getattr(value, "shape", None) or np.shape(value))
        if shape != tuple(variable.shape):
            raise ValueError(f"{what}: variable '{path_of(variable)}' has shape "
                             f"{tuple(variable.shape)} but the value given has shape "
                             f"{shape}{why}.")
    for variable, value in zip(variables, values):
        variable.assign(value)
