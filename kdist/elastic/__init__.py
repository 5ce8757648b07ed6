"""Elastic data parallelism: training that carries on when ranks die.

Horovod Elastic's Keras API on MPI's fault tolerance (Open MPI's ULFM).
Wrap the training in `run`, keep what must survive in a `KerasState`, and
let the callbacks commit it:

    state = kdist.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [kdist.elastic.CommitStateCallback(state),
                 kdist.elastic.UpdateBatchStateCallback(state),
                 kdist.elastic.UpdateEpochStateCallback(state)]

    @kdist.elastic.run
    def train(state):
        model.fit(x, y, epochs=10 - state.epoch, callbacks=callbacks)

    train(state)

Start it with `kdist run --elastic -n 3 script.py` (add `--max-np 3` to
replace lost ranks with new processes); outside such a launch a rank that
dies still ends the job. The guide is docs/elastic.md.

- `run`: the decorator that calls the training function again after ranks
  died, on the survivors (and on new processes, with `max_size`).
- `KerasState`, `TensorFlowKerasState`: a Keras model, its optimizer and
  plain values; `TensorFlowState`: a list of variables and plain values, for
  custom loops; `ObjectState`: plain values only; `State`: their base class.
  Each is committed (copied to host memory), restored (after a failure, back
  to the last commit) and synced (every rank takes rank 0's) as a whole.
- `CommitStateCallback`, `UpdateBatchStateCallback`,
  `UpdateEpochStateCallback`: Keras callbacks that keep the state up to date
  during `fit`.
- `is_replacement`: whether this process replaces a lost rank.

Exceptions:

- `RanksLost` (also under Horovod's name, `HorovodInternalError`): the
  failure `run` recovers from, raised when a collective fails because ranks
  died.
- `FatalToThisRank`: raise it on a rank that cannot go on; inside `run` that
  rank leaves the job (it kills itself, as a crash would) and the others
  carry on without it. In a world of one rank, or a job not started
  fault-tolerant, it ends the process (`SystemExit`).
- `HostsUpdatedInterrupt`: raised by a state (from `commit`, on every rank)
  to make `run` reset without restoring; kdist itself never raises it.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "RanksLost": "kdist.comm.recovery",
    "CommitStateCallback": "kdist.elastic.callbacks",
    "UpdateBatchStateCallback": "kdist.elastic.callbacks",
    "UpdateEpochStateCallback": "kdist.elastic.callbacks",
    "FatalToThisRank": "kdist.elastic.runner",
    "HorovodInternalError": "kdist.elastic.runner",
    "is_replacement": "kdist.elastic.runner",
    "run": "kdist.elastic.runner",
    "HostsUpdatedInterrupt": "kdist.elastic.state",
    "KerasState": "kdist.elastic.state",
    "ObjectState": "kdist.elastic.state",
    "State": "kdist.elastic.state",
    "TensorFlowKerasState": "kdist.elastic.state",
    "TensorFlowState": "kdist.elastic.state",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
