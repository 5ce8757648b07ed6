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
def test_survivors_shrink_restore_the_last_commit_and_finish_identically(mpi_job, lost, how,
                                                                         path):
    """Its own job: ranks die and the survivors shrink the world under Open MPI's fault
    tolerance, which a shared world cannot lend.
    """
    job = mpi_job(WORKER, n=3, args=["--lose-rank", lost, "--how", how, "--at-batch", 10,
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
    # Under a plain mpiexec the survivors end the job through MPI_Abort(0), so that the
    # launcher does not wait for a lost rank that never ends: a finished job, status 0.
    assert "ending it with MPI_Abort(0)" in job.output
    assert job.returncode == 0, job.output[-3000:]


@pytest.mark.mpi
def test_a_custom_loops_traced_step_goes_on_with_the_survivors(mpi_job):
    # Horovod's elastic TF2 example: the tf.function step is traced while the job has all
    # its ranks, and is not traced again after one is lost. Its collectives must reach the
    # survivors' communicator (they look it up each time they run).
    """Its own job: a rank dies and the survivors shrink the world under Open MPI's fault
    tolerance, which a shared world cannot lend.
    """
    # Each rank traces and runs its first step before any collective: seconds without
    # an MPI call, which a loaded machine can stretch past the detector's 4 s.
    job = mpi_job("horovod_elastic_loop.py", n=3, args=["--lose-rank", 2, "--at-batch", 6],
                  fault_tolerant=True, check=False, timeout=180, mpi_args=SLOW_DETECTOR)
    survivors = _survivors(job, 2)
    for out in survivors:
        assert out["size"] == 2 and out["batch"] == 24 and out["sizes_at_reset"] == [2]
        assert out["learning_rate"] == pytest.approx(0.002)
        # Rows 1 and 2 (the survivors' ranks + 1) summed and divided by 2, not by 3.
        assert out["sparse_average"] == pytest.approx([1.5, 1.5])
    assert survivors[0]["weights"] == survivors[1]["weights"]
    assert "1 rank(s) lost; carrying on with 2" in job.output
    assert job.returncode == 0, job.output[-3000:]


@pytest.mark.mpi
def test_a_stopped_rank_is_declared_dead_and_ended_so_the_job_finishes(mpi_job):
    """Its own job: a rank is stopped and declared dead; the job's processes are the subject."""
    job = mpi_job(WORKER, n=3, args=["--lose-rank", 1, "--how", "stop"], fault_tolerant=True,
                  check=False, timeout=150)
    survivors = _survivors(job, 2)
    assert all(out["size"] == 2 and out["epoch"] == 2 for out in survivors)
    assert "which MPI declared dead but still ran" in job.output


@pytest.mark.mpi
def test_a_gan_keeps_both_models_and_both_optimizers_through_a_lost_rank(mpi_job):
    """Its own job: ranks die and the survivors shrink the world under Open MPI's fault
    tolerance, which a shared world cannot lend.
    """
    job = mpi_job("elastic_gan.py", n=3, fault_tolerant=True, check=False, timeout=180)
    survivors = _survivors(job, 2)
    assert all(out["size"] == 2 and out["resets"] == [2] for out in survivors)
    assert survivors[0]["w"] == survivors[1]["w"]
    # Both optimizers went back to the same commit: one update each per batch.
    assert survivors[0]["d"] == survivors[0]["g"] == survivors[1]["d"] > 0


@pytest.mark.mpi
def test_a_job_that_loses_no_rank_trains_as_usual(mpi_job):
    """Its own job: the job runs under Open MPI's fault tolerance (its launcher's settings),
    which a shared world is not started with.
    """
    survivors = _survivors(mpi_job(WORKER, n=2, fault_tolerant=True, timeout=180), 2)
    for out in survivors:
        assert out["size"] == 2 and out["epoch"] == 2 and out["sizes_at_reset"] == []
        # 1797 digits, 898 per rank, 57 batches of 16 per epoch.
        assert out["iterations"] == 2 * 57
    assert survivors[0]["weights_sum"] == survivors[1]["weights_sum"]


@pytest.mark.mpi
def test_an_ordinary_exception_ends_the_elastic_job_on_every_rank_with_its_message(mpi_job):
    """Its own job: an exception ends the elastic job; how the job ends is the subject."""
    job = mpi_job(WORKER, n=3, args=["--lose-rank", 1, "--how", "raise"], fault_tolerant=True,
                  check=False, timeout=120)
    assert job.returncode != 0 and not job.results
    assert "uncaught ValueError on rank 1: a bug on one rank" in job.output
    # The others learn of it together instead of carrying on without rank 1.
    assert "rank 1 failed (ValueError: a bug on one rank); ending the job" in job.output


@pytest.mark.mpi
def test_fewer_survivors_than_the_minimum_end_the_job_with_a_message(mpi_job):
    """Its own job: ranks die and the survivors shrink the world under Open MPI's fault
    tolerance, which a shared world cannot lend.
    """
    job = mpi_job(WORKER, n=3, args=["--lose-rank", 1], fault_tolerant=True, check=False,
                  timeout=120, env={"KDIST_ELASTIC_MIN_NP": "3"})
    assert job.returncode != 0 and not job.results, job.output[-4000:]
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
    # A model that changed its structure since the commit is refused whole.
    model.add(keras.layers.Dense(1))
    model.build((None, 3))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="changed its structure since the last commit"):
        state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
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


def test_kdist_run_elastic_checks_max_np():
    args = build_parser().parse_args(["run", "--elastic", "--max-np", "4", "-n", "3", "x.py"])
    assert args.max_np == 4
    with pytest.raises(SystemExit, match="--max-np needs --elastic"):
        main(["run", "--max-np", "4", "-n", "3", "--raw-command", "true"])
    with pytest.raises(SystemExit, match="at least -n"):
        main(["run", "--elastic", "--max-np", "2", "-n", "3", "--raw-command", "true"])


def test_max_ranks_come_from_the_argument_or_the_launcher():
    from kdist.elastic.runner import max_ranks

    assert max_ranks(environ={}) is None
    assert max_ranks(environ={"KDIST_ELASTIC_MAX_NP": ""}) is None
    assert max_ranks(environ={"KDIST_ELASTIC_MAX_NP": "4"}) == 4
    assert max_ranks(3, environ={"KDIST_ELASTIC_MAX_NP": "4"}) == 3
    with pytest.raises(ValueError, match="whole number"):
        max_ranks(environ={"KDIST_ELASTIC_MAX_NP": "many"})
    import kdist

    with pytest.raises(ValueError, match="smaller than min_size"):
        kdist.elastic.run(lambda state: None, min_size=3, max_size=2)


def test_a_replacement_starts_the_same_program_through_the_same_wrapper(monkeypatch):
    import sys

    from kdist.comm import recovery

    monkeypatch.setattr(sys, "orig_argv", ["python", "-u", "train.py", "--epochs", "3"])
    assert recovery.spawn_command(environ={}) == (sys.executable,
                                                  ["-u", "train.py", "--epochs", "3"])
    executable, args = recovery.spawn_command(environ={"KDIST_PREFIXER": "/p/_prefix.py"})
    assert args == ["/p/_prefix.py", "--", sys.executable, "-u", "train.py", "--epochs", "3"]


def test_checkpoint_leaves_the_disk_alone_once_an_elastic_world_changed(tmp_path, monkeypatch):
    import keras

    import kdist
    from kdist.comm import processes

    def fit(epochs):
        keras.backend.clear_session()  # the same variable names each time
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        checkpoint = kdist.callbacks.Checkpoint(tmp_path)
        history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=epochs, verbose=0,
                            callbacks=[checkpoint])
        return checkpoint.resumed_from, len(history.epoch)

    assert fit(2) == (None, 2)
    assert fit(3) == (2, 1)  # an ordinary restart resumes from the disk
    # After a reset the last commit in memory is newer than anything on disk.
    monkeypatch.setattr(processes._state, "generation", 1)
    assert fit(3) == (None, 3)


# Open MPI keeps a dead rank's slot, so a replacement on this machine shares a core.
# While it imports TensorFlow, a survivor retracing its step on the other core can
# go 4 s without an MPI call and be declared dead too (and replaced as well); these
# tests count replacements exactly, so they give the failure detector more time.
SLOW_DETECTOR = ["--mca", "mpi_ft_detector_timeout", "10"]
GROW = {"env": {"KDIST_ELASTIC_MAX_NP": "3"}, "mpi_args": ["--oversubscribe"] + SLOW_DETECTOR}


@pytest.mark.mpi
@pytest.mark.parametrize("lost,path", [(2, "optimizer"),
                                       pytest.param(1, "strategy", marks=pytest.mark.slow)])
def test_a_lost_rank_is_replaced_and_the_newcomer_trains_from_the_last_commit(mpi_job, lost,
                                                                              path):
    """Its own job: a rank dies and the survivors spawn its replacement; the processes are the
    subject.
    """
    job = mpi_job(WORKER, n=3, args=["--lose-rank", lost, "--at-batch", 10, "--path", path],
                  fault_tolerant=True, check=False, timeout=180, **GROW)
    ranks = _survivors(job, 3)
    assert "started 1 rank(s) to replace lost ones; carrying on with 3" in job.output
    # The survivors keep the lower ranks and reset; the newcomer takes rank 2 and
    # starts from their state without a reset of its own.
    assert [out["replacement"] for out in ranks] == [False, False, True]
    assert [out["sizes_at_reset"] for out in ranks] == [[3], [3], []]
    for out in ranks:
        assert out["size"] == 3 and out["epoch"] == 2
        assert out["learning_rate"] == pytest.approx(0.15)
        # 1797 digits, 599 per rank: 38 batches of 16 per epoch, two epochs.
        assert out["iterations"] == 2 * 38
    assert len({out["weights_sum"] for out in ranks}) == 1
    assert ranks[0]["loss"] < 1.5


@pytest.mark.mpi
@pytest.mark.slow
def test_a_replacement_that_dies_is_replaced_in_turn(mpi_job):
    """Its own job: replacements are spawned and die; the processes are the subject."""
    job = mpi_job(WORKER, n=3, args=["--lose-rank", 2, "--replacement-dies-at", 5],
                  fault_tolerant=True, check=False, timeout=180, **GROW)
    ranks = _survivors(job, 3)
    assert [out["sizes_at_reset"] for out in ranks] == [[3, 3], [3, 3], []]
    assert len({out["weights_sum"] for out in ranks}) == 1
    assert all(out["iterations"] == 2 * 38 for out in ranks)


@pytest.mark.mpi
def test_replacements_that_die_before_they_join_are_not_started_again(mpi_job):
    """Its own job: replacements are spawned and die; the processes are the subject."""
    job = mpi_job(WORKER, n=3, args=["--lose-rank", 2, "--replacement-dies-at", 0],
                  fault_tolerant=True, check=False, timeout=180, **GROW)
    ranks = _survivors(job, 2)
    assert "died before they received the state; not starting more" in job.output
    assert job.output.count("started 1 rank(s) to replace lost ones") == 2  # once per survivor
    assert all(out["size"] == 2 and out["epoch"] == 2 for out in ranks)
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


@pytest.mark.mpi
@pytest.mark.slow
def test_a_gan_replacement_receives_both_models_and_both_optimizers(mpi_job):
    """Its own job: a rank dies and the survivors spawn its replacement; the processes are the
    subject.
    """
    job = mpi_job("elastic_gan.py", n=3, fault_tolerant=True, check=False, timeout=180, **GROW)
    ranks = _survivors(job, 3)
    assert [out["resets"] for out in ranks] == [[3], [3], []]
    assert len({out["w"] for out in ranks}) == 1
    assert len({(out["d"], out["g"]) for out in ranks}) == 1 and ranks[0]["d"] > 0


@pytest.mark.mpi
def test_with_no_slot_for_a_replacement_the_survivor_carries_on_and_its_failure_counts(
        mpi_job):
    # Two slots, two ranks, no leave to oversubscribe: the dead rank's slot stays taken.
    # The survivor, alone, then fails after its report: a world of one leaves through
    # kdist's own exit (kdist/comm/ending.py), which must not call that a clean end.
    """Its own job: ranks die and the survivors shrink the world under Open MPI's fault
    tolerance, which a shared world cannot lend.
    """
    job = mpi_job(WORKER, n=2, args=["--lose-rank", 1, "--fail-at-the-end"],
                  fault_tolerant=True, check=False, timeout=180,
                  env={"KDIST_ELASTIC_MAX_NP": "2"}, mpi_args=["--host", "localhost:2"])
    (out,) = _survivors(job, 1)
    assert out["size"] == 1 and out["epoch"] == 2
    assert "Could not start 1 rank(s) to replace the lost ones" in job.output
    assert "RuntimeError: a bug after training" in job.output
    assert "this rank failed; leaving with status 1, which ends the job" in job.output
    assert job.returncode != 0


def test_only_the_larger_side_of_a_possible_partition_carries_on(monkeypatch):
    # A host cut off by the network looks dead from both sides; only one side may go on.
    from kdist.comm.recovery import NoQuorum, check_quorum

    check_quorum([0], ["a", "a"])  # the lost rank shared a host with a survivor: it died
    check_quorum([0], ["a", "b"])  # half of the ranks, with rank 0
    check_quorum([1, 2], ["a", "b", "c"])  # a majority
    check_quorum([0, 1], ["a", "a", "b", "b"])
    for left, hosts in (([1], ["a", "b"]), ([2, 3], ["a", "a", "b", "b"]),
                        ([2], ["a", "b", "c"])):
        with pytest.raises(NoQuorum, match="network partition"):
            check_quorum(left, hosts)
    check_quorum([1], ["a", "b"], environ={"KDIST_ELASTIC_QUORUM": "0"})
