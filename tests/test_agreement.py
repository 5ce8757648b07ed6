"""Ranks of a data-parallel fit agree at each epoch's end: global metrics, one stop, no drift."""

import logging
import time

import keras
import numpy as np
import pytest

from kdist.callbacks import agreement
from kdist.coordination import model_state


def test_the_digest_is_exact():
    values = np.linspace(-1, 1, 1001, dtype=np.float32)
    same = values.copy()
    nudged = values.copy()
    nudged[500] = np.nextafter(nudged[500], np.float32(2))  # one ulp
    swapped = values.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert model_state.digest(values) == model_state.digest(same)
    assert model_state.digest(values) != model_state.digest(nudged)
    assert model_state.digest(values) != model_state.digest(swapped)


def test_around_puts_a_sentinel_after_each_callback_that_names_the_one_that_stopped():
    stopper = keras.callbacks.EarlyStopping()
    wrapped = agreement.Agreement().around([keras.callbacks.TerminateOnNaN(), stopper])
    assert [type(c).__name__ for c in wrapped] == [
        "_Front", "TerminateOnNaN", "_Sentinel", "EarlyStopping", "_Sentinel", "_Back"]
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    for callback in wrapped:
        callback.set_model(model)
    model.stop_training = False
    wrapped[0].on_train_begin()
    wrapped[2].on_epoch_end(0)
    model.stop_training = True  # as EarlyStopping does
    wrapped[4].on_epoch_end(0)
    assert wrapped[0]._agreement.stopped_by == "EarlyStopping"


def test_on_a_model_trained_alone_the_agreement_only_notes_who_stopped():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    agreed = agreement.Agreement()

    class StopAfterFirst(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=5, verbose=0,
                        callbacks=agreed.around([StopAfterFirst()]))
    # No collective ran (this process is no job), and the logs are this process's own.
    assert history.epoch == [0] and agreed.stopped_by == "StopAfterFirst"


def test_fit_is_keras_own():
    # The agreement is asked for through fit's callbacks; nothing wraps Keras's fit.
    import kdist  # noqa: F401  (importing kdist must leave Keras's classes alone)

    assert keras.Model.fit.__module__.startswith("keras.")
    assert keras.Model.compile.__module__.startswith("keras.")


@pytest.mark.mpi
def test_ranks_validating_on_their_own_shards_agree_and_drift_is_named(mpirun):
    job = mpirun("agreement.py", n=2, args=["all"], timeout=240)
    zero, one = job.rank(0), job.rank(1)
    # EarlyStopping on each rank's own val_loss, no MetricAverageCallback: both ranks
    # stop at the same epoch (rank 1 alone stops after 2: the next test), the same way.
    early = zero["early_stopping"]
    assert early["epochs"] == one["early_stopping"]["epochs"] < 10
    assert early["history"] == one["early_stopping"]["history"]
    assert early["weights"] == one["early_stopping"]["weights"]
    # ReduceLROnPlateau: the same learning rate and weights on both ranks.
    assert zero["plateau"]["lr"] == one["plateau"]["lr"] < 2e-2
    assert zero["plateau"]["weights"] == one["plateau"]["weights"]
    assert zero["plateau"]["history"] == one["plateau"]["history"]
    # A callback stops rank 1's fit alone: both stop, with a warning naming it.
    assert zero["stop_alone"]["epochs"] == one["stop_alone"]["epochs"] == 2
    assert zero["stop_alone"]["weights"] == one["stop_alone"]["weights"]
    assert "rank 1 stopped training after epoch 2 (StopOnRankOne); every rank stops with " \
           "it" in job.output, job.output[-3000:]
    # A learning rate changed on rank 1 alone, at the end of the second epoch.
    for report in (zero, one):
        error = report["learning_rate"]["error"]
        assert "learning rates differ after epoch 2" in error, error
        assert "rank 0: [0.002], rank 1: [0.001]" in error
    # A weight changed on rank 1 alone: the variable and the epoch are named.
    for report in (zero, one):
        error = report["weight"]["error"]
        assert f"after epoch 2 rank(s) [1] hold other values of " \
               f"'{report['weight']['kernel']}'" in error, error
    # MPIStrategy, a custom train_step logging a value of its own batch: one History.
    assert zero["strategy"]["history"] == one["strategy"]["history"]
    assert zero["strategy"]["weights"] == one["strategy"]["weights"]
    history = zero["strategy"]["history"]
    assert np.allclose(np.array(history["scaled_loss"]) * 2, history["batch_error"], rtol=1e-5)


@pytest.mark.mpi
def test_a_rank_whose_fit_stops_alone_ends_the_job_naming_its_callback(mpi_job):
    """Its own job: one rank's script ends while the other waits, and the job ends; how is the
    subject.
    """
    started = time.monotonic()
    job = mpi_job("agreement.py", n=2, args=["leave"], check=False, timeout=90)
    elapsed = time.monotonic() - started
    assert job.returncode != 0 and elapsed < 80
    assert job.rank(1) == {"finished": True}
    error = job.rank(0)["error"]
    # Rank 0 waited in its gradient allreduce (the C++ engine): it fails at once, naming
    # the rank that left and how that rank's fit ended (BroadcastGlobalVariablesCallback
    # saw it), with the advice to let the ranks agree.
    assert "rank 1: leaving the job: its script ended; its last fit stopped after epoch 2 " \
           "of 40: a callback set stop_training" in error, error
    assert "Usually a rank left a loop early" in error
    assert "kdist.callbacks.Agreement().around" in error
    # The hand-built agreement without log averaging compared EarlyStopping's inputs.
    assert "EarlyStopping monitors 'val_loss', whose value differs across the ranks after " \
           "epoch 1" in job.output, job.output[-3000:]


def test_rank_1_of_a_job_saving_without_the_agreement_is_advised_once(monkeypatch, caplog):
    from types import SimpleNamespace

    from kdist.coordination import team

    monkeypatch.setattr(team.processes, "size", lambda: 2)
    monkeypatch.setattr(team, "_advised", False)
    rank = {0: SimpleNamespace(comm=SimpleNamespace(size=2, rank=0)),
            1: SimpleNamespace(comm=SimpleNamespace(size=2, rank=1))}
    # Directly on the logger (kdist's own logging set-up may stop it propagating), and
    # only there, so that each record is seen once.
    logger = logging.getLogger("kdist.coordination.team")
    propagates, logger.propagate = logger.propagate, False
    logger.addHandler(caplog.handler)
    try:
        team.advise_on_saving(rank[0])  # rank 0 is the one that should save
        assert not caplog.records
        team.advise_on_saving(rank[1])
        team.advise_on_saving(rank[1])
        assert len(caplog.records) == 1 and "rank 1 saves a model" in caplog.text
        # A team smaller than the job (a search's trial) keeps its files apart itself.
        monkeypatch.setattr(team, "_advised", False)
        monkeypatch.setattr(team.processes, "size", lambda: 5)
        caplog.clear()
        team.advise_on_saving(rank[1])
        assert not caplog.records
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagates
