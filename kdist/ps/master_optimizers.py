"""Optimizers that the master applies to flat numpy buffers, in place.

A Keras optimizer costs a graph call and a copy per update; the master
applies thousands of updates per second, so its optimizers work directly on
the central float32 buffer. Each treats an incoming worker update `u` as the
descent step already taken by the worker (the gradient is `-u`).

>>> import numpy as np
>>> opt = MasterSGD(learning_rate=0.5)
>>> center = np.zeros(2, np.float32)
>>> opt.apply_(center, np.array([1.0, -2.0], np.float32))
>>> center.tolist()
[0.5, -1.0]
"""

import numpy as np


class MasterSGD:
    """SGD at the master, applied in place to the central float32 buffer.

    Treats a worker's update `u` as the gradient `-u`: `v <- momentum v + u`,
    then `c <- c + lr v`, which is what `keras.optimizers.SGD` does with that
    gradient; at the defaults, plain addition `c <- c + u`. Pass it, or
    `"sgd"`, as `ParameterServerStrategy(master_optimizer=...)`.

    Args:
        learning_rate: > 0 (default 1).
        momentum: in [0, 1) (default 0).

    Raises:
        ValueError: a setting outside its range.
    """

    name = "sgd"

    def __init__(self, learning_rate=1.0, momentum=0.0):
        if learning_rate <= 0:
            raise ValueError(f"MasterSGD: learning_rate must be positive; got {learning_rate}.")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"MasterSGD: momentum must lie in [0, 1); got {momentum}.")
        self.learning_rate = float(learning_rate)
        self.momentum = float(momentum)
        self._velocity = None

    @property
    def adds_plainly(self):
        """True when a step is just `c + u`, so it may be written anywhere."""
        return self.learning_rate == 1.0 and self.momentum == 0.0

    def apply_(self, center, update, scale=1.0):
        """Applies `update` to `center` in place, the step multiplied by `scale`
        (`update` may be overwritten)."""
        step = self.learning_rate * scale
        if self.momentum == 0.0:
            if step == 1.0:
                center += update
            else:
                update *= step
                center += update
            return
        if self._velocity is None:
            self._velocity = np.zeros_like(center)
        self._velocity *= self.momentum
        self._velocity += update
        center += step * self._velocity

    def get_state(self):
        """The optimizer's slots as a dict of arrays (empty before the first step)."""
        return {} if self._velocity is None else {"velocity": self._velocity}

    def set_state(self, state):
        """Restores what `get_state` returned."""
        velocity = state.get("velocity")
        self._velocity = None if velocity is None else np.array(velocity, np.float32)

    def get_config(self):
        """The settings as a dict with "name", as `master_optimizer` accepts it."""
        return {"name": self.name, "learning_rate": self.learning_rate,
                "momentum": self.momentum}


class MasterAdam:
    """Adam at the master, applied in place to the central float32 buffer.

    Treats a worker's update `u` as the gradient `-u`; the steps match
    `keras.optimizers.Adam` with that gradient. Pass it, or `"adam"`, as
    `ParameterServerStrategy(master_optimizer=...)`.

    Args:
        learning_rate: > 0.
        beta_1: in [0, 1).
        beta_2: in [0, 1).
        epsilon: added to the root of the second moment.

    Raises:
        ValueError: a setting outside its range.
    """

    name = "adam"

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        if learning_rate <= 0:
            raise ValueError(f"MasterAdam: learning_rate must be positive; got {learning_rate}.")
        for label, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"MasterAdam: {label} must lie in [0, 1); got {beta}.")
        self.learning_rate = float(learning_rate)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self._m = self._v = None
        self._scratch = None
        self.iterations = 0

    adds_plainly = False

    def apply_(self, center, update, scale=1.0):
        """Applies `update` to `center` in place, the step multiplied by `scale`."""
        if self._m is None:
            self._m, self._v = np.zeros_like(center), np.zeros_like(center)
            self._scratch = np.empty_like(center)
        self.iterations += 1
        t = self.iterations
        self._m *= self.beta_1
        self._m += (1.0 - self.beta_1) * update
        np.multiply(update, update, out=self._scratch)
        self._v *= self.beta_2
        self._scratch *= 1.0 - self.beta_2
        self._v += self._scratch
        rate = scale * self.learning_rate * np.sqrt(1 - self.beta_2 ** t) / (1 - self.beta_1 ** t)
        np.sqrt(self._v, out=self._scratch)
        self._scratch += self.epsilon
        np.divide(self._m, self._scratch, out=self._scratch)
        self._scratch *= rate
        center += self._scratch

    def get_state(self):
        """The optimizer's slots and step count as a dict of arrays (empty before
        the first step)."""
        if self._m is None:
            return {}
        return {"m": self._m, "v": self._v, "iterations": np.array(self.iterations)}

    def set_state(self, state):
        """Restores what `get_state` returned."""
        if "m" in state:
            self._m = np.array(state["m"], np.float32)
            self._v = np.array(state["v"], np.float32)
            self._scratch = np.empty_like(self._m)
            self.iterations = int(state["iterations"])

    def get_config(self):
        """The settings as a dict with "name", as `master_optimizer` accepts it."""
        return {"name": self.name, "learning_rate": self.learning_rate, "beta_1": self.beta_1,
                "beta_2": self.beta_2, "epsilon": self.epsilon}


_BY_NAME = {"sgd": MasterSGD, "adam": MasterAdam}


def get(identifier):
    """A master optimizer from a name, a config dict or an instance."""
    if isinstance(identifier, (MasterSGD, MasterAdam)):
        return identifier
    if isinstance(identifier, str):
        identifier = {"name": identifier}
    if isinstance(identifier, dict):
        config = dict(identifier)
        name = str(config.pop("name", "")).lower()
        if name in _BY_NAME:
            return _BY_NAME[name](**config)
    raise ValueError(
        f"master_optimizer {identifier!r} is not known: use 'sgd', 'adam', a dict such as "
        "{'name': 'sgd', 'learning_rate': 0.5}, or kdist.ps.MasterSGD/MasterAdam.")
