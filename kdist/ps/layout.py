"""A model's variables as one flat float32 vector, trainable values first.

The parameter server moves and updates whole models as single buffers (one
message per exchange, in-place arithmetic). `Layout` fixes the order once so
that every rank agrees on it. Variables that are not floating point (seed
states, counters) stay local to each process.
"""

import keras
import numpy as np


def _is_float(variable):
    return np.dtype(keras.backend.standardize_dtype(variable.dtype)).kind == "f"


class Layout:
    """The models' floating-point variables as one flat float32 vector, trainable first.

    Where each variable lives in the vector: `size` values in all, of which
    the first `trainable_size` are the trainable ones. `read()` returns the
    variables' values as a new vector, `read_(out)` writes them into `out`,
    `write(flat)` assigns them from a vector. Variables that are not floating
    point stay out.

    Args:
        models: one Keras model, or several (a generator and a discriminator)
            whose variables travel together.

    Raises:
        ValueError: the models have no floating-point variables (not built).
    """

    def __init__(self, models):
        models = models if isinstance(models, (list, tuple)) else [models]
        seen, trainable, frozen = set(), [], []
        for model in models:
            for group, variables in ((trainable, model.trainable_variables),
                                     (frozen, model.non_trainable_variables)):
                for variable in variables:
                    if id(variable) not in seen and _is_float(variable):
                        seen.add(id(variable))
                        group.append(variable)
        self.variables = trainable + frozen
        if not self.variables:
            raise ValueError("The model has no floating-point variables to train: build it "
                             "(call it once, or give it an Input) before fit.")
        self.shapes = [tuple(v.shape) for v in self.variables]
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.trainable_size = int(self.offsets[len(trainable)])
        self.size = int(self.offsets[-1])

    def read_(self, out):
        """Copies the variables' current values into `out` (float32, `size` long)."""
        for i, variable in enumerate(self.variables):
            out[self.offsets[i]:self.offsets[i + 1]] = np.reshape(
                keras.ops.convert_to_numpy(variable), -1)
        return out

    def read(self):
        """The variables' current values as a new float32 vector."""
        return self.read_(np.empty(self.size, dtype=np.float32))

    def write(self, flat):
        """Assigns the values in `flat` (`size` long) to the variables; raises
        `ValueError` for another length."""
        if flat.shape[0] != self.size:
            raise ValueError(f"Expected {self.size} values, got {flat.shape[0]}.")
        for i, variable in enumerate(self.variables):
            chunk = flat[self.offsets[i]:self.offsets[i + 1]].reshape(self.shapes[i])
            variable.assign(chunk.astype(keras.backend.standardize_dtype(variable.dtype),
                                         copy=False))
