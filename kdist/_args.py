"""Checks for the numbers users pass to kdist's Keras-facing classes.

Horovod scripts pass plain Python numbers, numpy scalars (`np.int64` from a
config array) and sometimes whole floats (`4.0`); all of those are accepted,
anything else gets an error naming the argument and the value.
"""

import math
import numbers


def whole_number(value, name, minimum=None):
    """Returns `value` as a Python int, refusing fractions, booleans and non-numbers.

    >>> import numpy as np
    >>> whole_number(np.int64(3), "backward_passes_per_step", minimum=1)
    3
    >>> whole_number(2.7, "backward_passes_per_step")
    Traceback (most recent call last):
    ...
    ValueError: backward_passes_per_step must be a whole number; got 2.7.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a whole number; got {value!r} "
                        f"({type(value).__name__}).")
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or not float(value).is_integer():
            raise ValueError(f"{name} must be a whole number; got {value!r}.")
    result = int(value)
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be a whole number, at least {minimum}; got {value!r}.")
    return result


def positive_number(value, name):
    """Returns `value` as a Python float, refusing zero, negatives, NaN and non-numbers.

    >>> positive_number(0.5, "gradient_predivide_factor")
    0.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number; got {value!r} "
                        f"({type(value).__name__}).")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return float(value)
