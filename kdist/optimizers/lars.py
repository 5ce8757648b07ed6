"""Layer-wise adaptive rate scaling (LARS, You et al. 2017) around any Keras optimizer.

At very large global batches one learning rate does not suit every layer: the
ratio of a layer's weight norm to its gradient norm varies by orders of
magnitude between layers, and a rate large enough for one layer makes
another diverge. LARS scales each layer's gradient by its own trust ratio
before the wrapped optimizer sees it.
"""

import keras
from keras import ops

from kdist import _keras_private


@keras.saving.register_keras_serializable(package="kdist")
class LARS(keras.optimizers.Optimizer):
    """Scales each variable's gradient by its trust ratio, then lets `optimizer` apply it.

    For a variable `w` with gradient `g`, the gradient handed on is
    `trust * (g + weight_decay * w)` with
    `trust = eta * |w| / (|g| + weight_decay * |w| + epsilon)` (norms over
    the whole variable; 1 when either norm is 0). The wrapped optimizer then
    multiplies by its own learning rate, so SGD moves each layer by about
    `lr * eta` of its weight norm. With `clip=True` (LARC) the trust ratio is
    `min(trust / lr, 1)`: a layer's rate may shrink below the global one,
    never exceed it.

    Variables of rank 0 or 1 (biases, normalisation scales and offsets) are
    left alone, neither adapted nor decayed, unless `skip_vectors=False`;
    `exclude` adds variables by a substring of their path.

    Wrap the local optimizer and hand the result to the distributed one, so
    that the trust ratio is computed on the averaged gradient, the same on
    every rank: `kdist.DistributedOptimizer(kdist.optimizers.LARS(SGD(...)))`.
    For LAMB, the same idea on top of Adam, use Keras's own
    `keras.optimizers.Lamb`.

    `learning_rate` and `iterations` are the wrapped optimizer's (assigning the
    learning rate sets the wrapped optimizer's), and `variables` are the wrapper's own
    then the wrapped optimizer's. LARS is registered with Keras serialization: a model
    compiled with it saves and loads with its state, once kdist is imported.

    Args:
        optimizer: the `keras.optimizers.Optimizer` that applies the scaled gradients.
        eta: the trust coefficient.
        weight_decay: L2 decay added to the gradient of adapted variables.
        epsilon: keeps the ratio finite when the gradient vanishes.
        clip: LARC's clipping mode (see above).
        skip_vectors: leave variables of rank 0 and 1 alone.
        exclude: substrings of variable paths to leave alone as well (a string or a
            sequence of strings).
        name: the optimizer's name; default `"lars"`.

    Raises:
        TypeError: `optimizer` is not a `keras.optimizers.Optimizer`, or `exclude` holds
            something other than strings.
        ValueError: `eta` or `epsilon` is not positive, or `weight_decay` is negative.

    Example:

        >>> import keras, numpy as np
        >>> from kdist.optimizers import LARS
        >>> optimizer = LARS(keras.optimizers.SGD(1.0), eta=0.1)
        >>> w = keras.Variable(np.array([[3.0, 4.0]]))  # |w| = 5
        >>> optimizer.apply([np.array([[0.0, 2.0]])], [w])  # |g| = 2: trust 0.1 * 5 / 2
        >>> keras.ops.convert_to_numpy(w).round(3).tolist()
        [[3.0, 3.5]]
    """

    def __init__(self, optimizer, eta=0.001, weight_decay=0.0, epsilon=1e-9, clip=False,
                 skip_vectors=True, exclude=(), name=None):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"LARS wraps a keras.optimizers.Optimizer; got "
                            f"{type(optimizer).__name__}.")
        for value, label in ((eta, "eta"), (epsilon, "epsilon")):
            if not value > 0:
                raise ValueError(f"{label} must be positive; got {value!r}.")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be 0 or more; got {weight_decay!r}.")
        if isinstance(exclude, str):
            exclude = (exclude,)
        if not all(isinstance(pattern, str) for pattern in exclude):
            raise TypeError("exclude takes substrings of variable paths (strings).")
        super().__init__(learning_rate=0.0, name=name or "lars")
        self.inner_optimizer = optimizer
        self.eta = float(eta)
        self.weight_decay = float(weight_decay)
        self.epsilon = float(epsilon)
        self.clip = bool(clip)
        self.skip_vectors = bool(skip_vectors)
        self.exclude = tuple(exclude)

    def build(self, var_list):
        super().build(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)

    @property
    def variables(self):
        return super().variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def adapts(self, variable):
        """Whether `variable`'s gradient is scaled (and decayed)."""
        if self.skip_vectors and len(variable.shape) <= 1:
            return False
        path = getattr(variable, "path", None) or variable.name
        return not any(pattern in path for pattern in self.exclude)

    def trust_ratio(self, grad, variable):
        """The factor `variable`'s decayed gradient is multiplied by, from its raw `grad`."""
        weight_norm = ops.norm(ops.reshape(ops.cast(variable, "float32"), (-1,)))
        grad_norm = ops.norm(ops.reshape(ops.cast(grad, "float32"), (-1,)))
        ratio = self.eta * weight_norm / (grad_norm + self.weight_decay * weight_norm
                                          + self.epsilon)
        ratio = ops.where(ops.logical_and(weight_norm > 0, grad_norm > 0), ratio, 1.0)
        if self.clip:
            rate = ops.cast(self.inner_optimizer.learning_rate, "float32")
            ratio = ops.minimum(ratio / rate, 1.0)
        return ratio

    def _adapted(self, grad, variable):
        if grad is None or not self.adapts(variable):
            return grad
        grad = ops.convert_to_tensor(grad)
        ratio = ops.cast(self.trust_ratio(grad, variable), grad.dtype)
        if self.weight_decay:
            grad = grad + ops.cast(self.weight_decay * variable, grad.dtype)
        return grad * ratio

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            if not self.built:
                raise ValueError("Pass the variables with the first gradients, or build the "
                                 "optimizer first: optimizer.build(trainable_variables).")
            trainable_variables = _keras_private.optimizer_built_variables(self)
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        grads = [self._adapted(g, v) for g, v in zip(grads, trainable_variables)]
        self.inner_optimizer.apply(grads, trainable_variables)

    def apply_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        self.apply([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])
        return self.iterations

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "eta": self.eta,
            "weight_decay": self.weight_decay,
            "epsilon": self.epsilon,
            "clip": self.clip,
            "skip_vectors": self.skip_vectors,
            "exclude": list(self.exclude),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects)
        return cls(**config)
