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

from kdist.comm.recovery import RanksLost
from kdist.elastic.callbacks import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)
from kdist.elastic.runner import FatalToThisRank, is_replacement, run
from kdist.elastic.state import (
    HostsUpdatedInterrupt,
    KerasState,
    ObjectState,
    State,
    TensorFlowKerasState,
    TensorFlowState,
)

# Horovod's name for the error a lost rank causes.
HorovodInternalError = RanksLost

__all__ = [
    "CommitStateCallback",
    "FatalToThisRank",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "RanksLost",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "is_replacement",
    "run",
]
