"""Elastic training: survivors of a lost rank shrink the job and finish it."""

import numpy as np
import pytest

from kdist.cli import build_parser, main

WORKER = "elastic_train.py"


def _survivors(job, expected):
    reports = job.results
    assert sorted(reports) == list(range(expected)), job.output[-3000:]
    return [reports[r] for r in range(expected)]


@pytest.mark.mpi
@pytest.mark.parametrize("lost,how,path", [(2, "kill", "optimizer"), (0, "leave", "optimizer"),
                                           (1, "kill", "strategy")])
def test_survivors_shrink_restore_the_last_commit_and_finish_identically(mpirun, lost, how,
                                                                          path):
    job = mpirun(WORKER, n=3, args=["--lose-rank", lost, "--how", how, "--at-batch", 10,
                                    "--path", path],
                 fault_tolerant=True, check=False, timeout=180)
    survivors = _survivors(job, 2)
    for out in survivors:
        assert out["size"] == 2 and out["epoch"] == 2
        assert out["sizes_at_reset"] == [2]  # the reset callbacks ran once, after the loss
        assert out["learning_rate"] == pytest.approx(0.1)  # rescaled there
        assert np.isfinite(out["loss"]) and out["loss"] < 1.5  # it trained (2.3 at random)
    assert survivors[0]["weights_sum"] == survivors[1]["weights_sum"]
    assert survivors[0]["iterations"] == survivors[1]["iterations"]
    if how == "leave":
        assert "leaving the job: this rank's device is gone" in job.output
    assert "1 rank(s) lost; carrying on with 2" in job.output


@pytest.mark.mpi
def test_a_stopped_rank_is_declared_dead_and_ended_so_the_job_finishes(mpirun):
    job = mpirun(WORKER, n=3, args=["--lose-rank", 1, "--how", "stop"], fault_tolerant=True,
                 check=False, timeout=150)
    survivors = _survivors(job, 2)
    assert all(out["size"] == 2 and out["epoch"] == 2 for out in survivors)
    assert "which MPI declared dead but still ran" in job.output


@pytest.mark.mpi
def test_a_gan_keeps_both_models_and_both_optimizers_through_a_lost_rank(mpirun):
    job = mpirun("elastic_gan.py", n=3, fault_tolerant=True, check=False, timeout=180)
    survivors = _survivors(job, 2)
    assert all(out["size"] == 2 and out["resets"] == [2] for out in survivors)
    assert survivors[0]["w"] == survivors[1]["w"]
    # Both optimizers went back to the same commit: one update each per batch.
    assert survivors[0]["d"] == survivors[0]["g"] == survivors[1]["d"] > 0


@pytest.mark.mpi
def test_a_job_that_loses_no_rank_trains_as_usual(mpirun):
    survivors = _survivors(mpirun(WORKER, n=2, fault_tolerant=True, timeout=180), 2)
    for out in survivors:
        assert out["size"] == 2 and out["epoch"] == 2 and out["sizes_at_reset"] == []
        # 1797 digits, 898 per rank, 57 batches of 16 per epoch.
        assert out["iterations"] == 2 * 57
    assert survivors[0]["weights_sum"] == survivors[1]["weights_sum"]


@pytest.mark.mpi
def test_an_ordinary_exception_ends_the_elastic_job_on_every_rank_with_its_message(mpirun):
    job = mpirun(WORKER, n=3, args=["--lose-rank", 1, "--how", "raise"], fault_tolerant=True,
                 check=False, timeout=120)
    assert job.returncode != 0 and not job.results
    assert "uncaught ValueError on rank 1: a bug on one rank" in job.output
    # The others learn of it together instead of carrying on without rank 1.
    assert "rank 1 failed (ValueError: a bug on one rank); ending the job" in job.output


@pytest.mark.mpi
def test_fewer_survivors_than_the_minimum_end_the_job_with_a_message(mpirun):
    job = mpirun(WORKER, n=3, args=["--lose-rank", 1], fault_tolerant=True, check=False,
                 timeout=120, env={"KDIST_ELASTIC_MIN_NP": "3"})
    assert job.returncode != 0 and not job.results
    assert "Only 2 rank(s) are left, fewer than the 3 this job needs" in job.output


def test_state_commit_and_restore_cover_model_optimizer_and_values():
    import keras

    import kdist

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    model.fit(x, y, verbose=0)
    state = kdist.elastic.KerasState(model, epoch=1, best=None)
    committed = [w.copy() for w in model.get_weights()]
    committed_steps = int(model.optimizer.iterations.numpy())
    model.fit(x, y, epochs=2, verbose=0)
    state.epoch, state.best = 3, 0.5
    state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed))
    assert int(model.optimizer.iterations.numpy()) == committed_steps
    assert (state.epoch, state.best) == (1, None)
    model.fit(x, y, verbose=0)
    state.epoch = 2
    state.commit()
    kept = [w.copy() for w in model.get_weights()]
    state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), kept))
    assert state.epoch == 2
    state.sync()  # a world of one: nothing to take from anyone
    assert state.epoch == 2
    with pytest.raises(ValueError, match="may not be named"):
        kdist.elastic.ObjectState(commit=1)
    with pytest.raises(TypeError, match="callable"):
        state.register_reset_callbacks([3])


def test_callbacks_count_epochs_across_fits_and_resume_an_epoch_where_it_stopped():
    import keras

    import kdist

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((40, 3), "float32"), np.zeros((40, 1), "float32")
    state = kdist.elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    state.save = lambda original=state.save: (commits.append((state.epoch, state.batch)),
                                              original())
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    callbacks = [kdist.elastic.CommitStateCallback(state, batches_per_commit=3),
                 kdist.elastic.UpdateBatchStateCallback(state),
                 kdist.elastic.UpdateEpochStateCallback(state), Count()]
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    assert state.epoch == 2 and state.batch == 0
    assert len(seen) == 20
    # Commits every 3 batches, and after each epoch once the counters moved on.
    assert commits[0] == (0, 3) and (1, 0) in commits and commits[-1] == (2, 0)

    # As after a failure 6 batches into the third epoch: that epoch runs its last 4.
    state.batch, seen[:] = 6, []
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    assert len(seen) == 4 + 10 and state.epoch == 4 and state.batch == 0
    with pytest.raises(ValueError, match="batches_per_commit"):
        kdist.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_run_returns_the_result_and_checks_its_state_and_minimum():
    import kdist

    calls = []

    @kdist.elastic.run
    def train(state, scale):
        calls.append(state.epoch)
        return 2 * scale

    assert train(kdist.elastic.ObjectState(epoch=5), 21) == 42 and calls == [5]
    with pytest.raises(TypeError, match="kdist.elastic State first"):
        train(object(), 1)
    with pytest.raises(ValueError, match="at least 1"):
        kdist.elastic.run(lambda state: None, min_size=0)

    @kdist.elastic.run
    def give_up(state):
        raise kdist.elastic.FatalToThisRank("no device")

    with pytest.raises(SystemExit):  # alone, leaving is ending
        give_up(kdist.elastic.ObjectState())


def test_kdist_run_elastic_checks_min_np(capsys):
    args = build_parser().parse_args(["run", "--elastic", "--min-np", "2", "-n", "3", "x.py"])
    assert args.elastic and args.min_np == 2
    with pytest.raises(SystemExit, match="--min-np needs --elastic"):
        main(["run", "--min-np", "2", "-n", "3", "--raw-command", "true"])
    with pytest.raises(SystemExit, match="between 1 and -n"):
        main(["run", "--elastic", "--min-np", "4", "-n", "3", "--raw-command", "true"])
