"""Records what every rank of a parameter-server job sends, receives and absorbs.

Tests replay the records with their own implementation of each update rule
(`tests/ps_reference.py`). Each rank appends events to its own file and
flushes after each one, so a job that is aborted still leaves every event
up to its end:

- ("server", children, center, trainable): a server starts around `center`,
  whose first `trainable` values its rule updates;
- ("absorb", child, stale): a server folds `child`'s next message in;
- ("send", kind, epoch, steps, weights, body): a link sends `body` up, while
  the watched model holds `weights` (None on a sub-master);
- ("reply", body, stop): what came back down, and whether it asks to stop;
- ("step", weights): a worker's training step starts from `weights`.

Only `ServerExchange.exchange` and the server's call into its rule are wrapped: the
values recorded are the ones that really travel.
"""

import os
import pickle

import keras
import numpy as np

_state = {"file": None, "model": None}


def flat(model):
    """Every floating-point variable of `model`, trainable ones first, as float32."""
    seen, parts = set(), []
    for group in (model.trainable_variables, model.non_trainable_variables):
        for variable in group:
            value = keras.ops.convert_to_numpy(variable)
            if id(variable) in seen or value.dtype.kind != "f":
                continue
            seen.add(id(variable))
            parts.append(value.astype(np.float32).ravel())
    return np.concatenate(parts)


def _write(event):
    f = _state["file"]
    pickle.dump(event, f, protocol=pickle.HIGHEST_PROTOCOL)
    f.flush()


class _RecordingRule:
    """Logs which child each absorbed message came from, then lets the rule work."""

    def __init__(self, rule):
        self._rule = rule

    def __getattr__(self, name):
        return getattr(self._rule, name)

    def absorb(self, child, incoming, center, reply, stale):
        _write(("absorb", int(child), int(stale)))
        return self._rule.absorb(child, incoming, center, reply, stale)


def install(directory):
    """Starts recording this rank's events into `directory`; call before fit."""
    import kdist
    from kdist.ps import exchange as exchange_lib, server

    path = os.path.join(str(directory), f"ps-{kdist.rank()}.pkl")
    _state["file"] = open(path, "wb")
    original_exchange = exchange_lib.ServerExchange.exchange
    original_init = server.Server.__init__

    def exchange(self, kind, epoch=0, steps=0, logs=None):
        model = _state["model"]
        weights = flat(model) if model is not None else None
        _write(("send", int(kind), int(epoch), int(steps), weights, self.message.body.copy()))
        reply = original_exchange(self, kind, epoch=epoch, steps=steps, logs=logs)
        _write(("reply", reply.body.copy(), bool(reply.stop)))
        return reply

    def init(self, comm, children, center, trainable_size, rule, *args, **kwargs):
        _write(("server", [int(c) for c in children], np.array(center, np.float32),
                int(trainable_size)))
        original_init(self, comm, children, center, trainable_size, _RecordingRule(rule),
                      *args, **kwargs)

    exchange_lib.ServerExchange.exchange = exchange
    server.Server.__init__ = init


def watch(model):
    """The worker's model, whose weights each exchange records (workers only)."""
    _state["model"] = model


class StepStarts(keras.callbacks.Callback):
    """Records the weights each training step starts from (a worker callback)."""

    def on_train_batch_begin(self, batch, logs=None):
        _write(("step", flat(self.model)))
