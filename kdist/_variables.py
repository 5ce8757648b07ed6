"""Lists of Keras or TensorFlow variables: how kdist names one and fills many."""

import numpy as np


def path_of(variable):
    """A variable's path (Keras 3), else its name (TensorFlow), else None."""
    return getattr(variable, "path", None) or getattr(variable, "name", None)


def _fits(variable, shape):
    """Whether a value of `shape` fits `variable`, whose shape may leave
    dimensions (`None`) or its whole rank (a TensorFlow `TensorShape(None)`) open."""
    expected = variable.shape
    if getattr(expected, "rank", 0) is None:
        return True
    expected = tuple(expected)
    return len(expected) == len(shape) and all(
        want is None or want == got for want, got in zip(expected, shape))


def check_all(variables, values, what, why=""):
    """Raises a `ValueError` naming `what` (the owner of the variables) and
    ending with `why` (what the difference means there) if `values` do not
    fit `variables` one for one: their count, or a shape."""
    variables = list(variables)
    if len(values) != len(variables):
        raise ValueError(f"{what} has {len(variables)} variable(s) but {len(values)} "
                         f"value(s) were given{why}.")
    for variable, value in zip(variables, values):
        shape = tuple(np.shape(value))
        if not _fits(variable, shape):
            raise ValueError(f"{what}: variable '{path_of(variable)}' has shape "
                             f"{tuple(variable.shape)} but the value given has shape "
                             f"{shape}{why}.")


def assign_all(*groups):
    """Assigns each group `(variables, values, what[, why])`, values to
    variables in order: every group, or, when `check_all` finds a difference
    in any of them, none."""
    groups = [(list(group[0]),) + tuple(group[1:]) for group in groups]
    for group in groups:
        check_all(*group)
    for variables, values, *_ in groups:
        for variable, value in zip(variables, values):
            variable.assign(value)
