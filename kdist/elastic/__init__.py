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
replace lost ranks with new processes). See docs/elastic.md.
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
