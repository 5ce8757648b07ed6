"""Distributed search under mpiexec: one oracle on rank 0, groups of ranks evaluating trials."""

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.mpi
pytest.importorskip("keras_tuner")


def _trials(directory):
    found = {}
    project = os.path.join(directory, "search")
    for name in os.listdir(project):
        path = os.path.join(project, name, "trial.json")
        if name.startswith("trial_") and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            found[state["trial_id"]] = state
    return found


def test_five_ranks_in_two_groups_of_two_fold_teams_account_for_every_trial(mpirun, tmp_path):
    stale = tmp_path / "search" / "trial_9"
    stale.mkdir(parents=True)  # overwrite=True must clear it once, for every rank
    job = mpirun("tune_search.py", n=5, timeout=400,
                 args=[tmp_path, "--folds-per-group", 2, "--trials", 4, "--overwrite"])
    assert not stale.exists()
    reports = [job.rank(r) for r in range(5)]
    for report in reports:
        assert report["statuses"] == {str(i): "COMPLETED" for i in range(4)}
        assert report["best"] == reports[0]["best"]
    # Each trial's 4 folds were built by the 2 fold teams of one group (2 each),
    # after every rank built one model to learn the search space.
    builds = [report["built"] - 1 for report in reports[1:]]
    assert sum(builds) == 4 * 4
    assert builds[0] == builds[1] and builds[2] == builds[3]
    assert builds[0] > 0 and builds[2] > 0  # both groups worked
    assert "search done" in job.output and "4 completed" in job.output
    on_disk = _trials(str(tmp_path))
    assert sorted(on_disk) == [str(i) for i in range(4)]
    for state in on_disk.values():
        metrics = state["metrics"]["metrics"]
        assert {"val_accuracy", "val_accuracy_std", "val_accuracy_fold_3"} <= set(metrics)


def test_a_trial_that_fails_on_one_rank_is_recorded_and_the_search_goes_on(mpirun, tmp_path):
    job = mpirun("tune_search.py", n=3, timeout=400,
                 args=[tmp_path, "--folds-per-group", 2, "--trials", 6, "--fail-trial", 2,
                       "--folds", 2])
    statuses = job.rank(0)["statuses"]
    assert statuses.pop("2") == "FAILED"
    assert statuses == {str(i): "COMPLETED" for i in (0, 1, 3, 4, 5)}
    assert "failed on rank 1 of group 0" in job.output
    assert "this trial's model cannot be built here" in job.output


@pytest.mark.slow
def test_a_killed_search_resumes_with_its_finished_trials_kept(mpi_job, mpirun, tmp_path):
    """The killed search is a job of its own: its processes die mid-search."""
    first = mpi_job("tune_search.py", n=3, timeout=400, check=False,
                    args=[tmp_path, "--trials", 6, "--die-after", 2, "--folds", 2])
    assert first.returncode != 0
    finished = {tid: state for tid, state in _trials(str(tmp_path)).items()
                if state["status"] == "COMPLETED"}
    assert 2 <= len(finished) < 6
    second = mpirun("tune_search.py", n=3, timeout=400,
                    args=[tmp_path, "--trials", 6, "--folds", 2])
    assert second.rank(0)["statuses"] == {str(i): "COMPLETED" for i in range(6)}
    after = _trials(str(tmp_path))
    for tid, state in finished.items():
        assert after[tid]["hyperparameters"]["values"] == state["hyperparameters"]["values"]
        assert after[tid]["score"] == state["score"]
    assert "Reloading Tuner" in second.output


def test_a_stock_tuner_trains_each_trial_data_parallel(mpirun, tmp_path):
    job = mpirun("tune_search.py", n=3, timeout=400,
                 args=[tmp_path, "--generic", "--workers-per-fold", 2, "--oracle", "bayesian",
                       "--trials", 5])
    for rank in range(3):
        assert job.rank(rank)["statuses"] == {str(i): "COMPLETED" for i in range(5)}
    assert job.rank(1)["built"] == job.rank(2)["built"] == 1 + 5


def test_bohb_promotes_across_groups_within_its_budget(mpirun, tmp_path):
    job = mpirun("tune_search.py", n=3, timeout=400, args=[tmp_path, "--oracle", "bohb",
                                                           "--trials", 16])
    report = job.rank(0)
    assert set(report["statuses"].values()) == {"COMPLETED"}
    values = report["values"]
    spent = sum(v["tuner/epochs"] - v["tuner/initial_epoch"] for v in values.values())
    assert 15 <= spent <= 16
    promoted = [v for v in values.values() if "tuner/trial_id" in v]
    assert promoted
    for child in promoted:
        parent = values[child["tuner/trial_id"]]
        assert child["tuner/initial_epoch"] == parent["tuner/epochs"]
    # Both groups trained: each group's leader built models.
    assert job.rank(1)["built"] > 1 and job.rank(2)["built"] > 1


def test_a_group_killed_mid_trial_loses_nothing_and_the_others_finish_the_search(mpi_job,
                                                                                 tmp_path):
    """Its own job: a group's rank is killed under Open MPI's fault tolerance and the search
    goes on.
    """
    job = mpi_job("tune_search.py", n=3, timeout=400, fault_tolerant=True, check=False,
                  args=[tmp_path, "--trials", 6, "--kill-group", 1, "--lost-after", 5,
                        "--folds", 2])
    assert job.returncode == 0, job.output[-3000:]
    assert sorted(job.results) == [0, 1]  # rank 2, group 1's only rank, was killed
    for rank in (0, 1):
        report = job.rank(rank)
        assert report["statuses"] == {str(i): "COMPLETED" for i in range(6)}
        assert sorted(report["ended"]) == [str(i) for i in range(6)]  # each once
    # Group 1 died in its first trial, so group 0 ran all six, that one included:
    # one model to learn the space, then 2 folds per trial.
    assert job.rank(1)["built"] == 1 + 6 * 2
    assert "giving up on group1" in job.output and "goes back to the queue" in job.output
    assert "lost group1" in job.output


@pytest.mark.slow
def test_a_group_whose_follower_dies_leaves_and_its_trial_goes_to_another(mpi_job, tmp_path):
    """Its own job: a follower is killed under Open MPI's fault tolerance and the search goes
    on.
    """
    job = mpi_job("tune_search.py", n=5, timeout=400, fault_tolerant=True, check=False,
                  args=[tmp_path, "--trials", 6, "--folds-per-group", 2, "--kill-group", 1,
                        "--kill-follower", "--lost-after", 5])
    assert job.returncode == 0, job.output[-3000:]
    assert sorted(job.results) == [0, 1, 2, 3]  # rank 4, group 1's follower, was killed
    for rank in range(4):
        report = job.rank(rank)
        assert report["statuses"] == {str(i): "COMPLETED" for i in range(6)}
        assert sorted(report["ended"]) == [str(i) for i in range(6)]
    # Group 0's fold teams built 2 folds of every trial, after one model for the space.
    assert job.rank(1)["built"] == job.rank(2)["built"] == 1 + 6 * 2
    assert "group 1 lost a rank during trial" in job.output
    assert "giving up on group1 (it lost a rank during its trial)" in job.output


@pytest.mark.slow
def test_a_stalled_trial_fails_at_its_timeout_and_the_search_ends_without_waiting(mpirun,
                                                                                  tmp_path):
    job = mpirun("tune_search.py", n=3, timeout=400,
                 args=[tmp_path, "--trials", 6, "--stall-trial", 1, "--trial-timeout", 20,
                       "--folds", 2])
    statuses = dict(job.rank(0)["statuses"])
    assert statuses.pop("1") == "FAILED"
    assert statuses == {str(i): "COMPLETED" for i in (0, 2, 3, 4, 5)}
    assert "past trial_timeout=20 s" in job.rank(0)["messages"]["1"]
    assert sorted(job.rank(0)["ended"]) == [str(i) for i in range(6)]
    # The stalled group woke up after the search had ended, and dropped its result.
    assert "ended after the search did; its result is dropped" in job.output
    for rank in (1, 2):
        assert job.rank(rank)["statuses"] == job.rank(0)["statuses"]


def test_a_rank_count_that_does_not_divide_into_groups_is_refused():
    # Every rank checks its job's size alike, before any collective, so each one
    # raises this error and the job ends.
    from types import SimpleNamespace

    from kdist.tune.distributed import Roles

    with pytest.raises(ValueError, match=r"N = 1 \+ groups x 2 fold team\(s\) x 1 worker\(s\)"
                       r".*use N = 3, 5"):
        Roles(SimpleNamespace(size=4, rank=0), folds_per_group=2)
    with pytest.raises(ValueError, match="workers_per_fold must be a whole number"):
        Roles(SimpleNamespace(size=4, rank=0), workers_per_fold=1.5)
    # A numpy integer is a whole number: the layout check is reached.
    with pytest.raises(ValueError, match=r"N = 1 \+ groups x 2 fold team\(s\)"):
        Roles(SimpleNamespace(size=4, rank=0), folds_per_group=np.int64(2))


@pytest.mark.parametrize("mode", ["synchronous", "asynchronous"])
def test_population_based_training_on_three_groups_trains_every_member(mpirun, tmp_path, mode):
    # Four members on three single-rank groups: the population is time-multiplexed.
    args = [tmp_path] + (["--asynchronous"] if mode == "asynchronous" else [])
    job = mpirun("tune_pbt.py", n=4, timeout=400, args=args)
    report = job.rank(0)
    values = report["values"]
    assert set(report["statuses"].values()) == {"COMPLETED"}
    reached = {}
    for trial in values.values():
        member = trial["pbt/member"]
        reached[member] = max(reached.get(member, 0), trial["tuner/epochs"])
        parent = trial.get("tuner/trial_id")
        if parent is not None:
            assert values[parent]["tuner/epochs"] == trial["tuner/initial_epoch"]
    assert reached == {0: 3, 1: 3, 2: 3, 3: 3}
    if mode == "synchronous":
        assert len(values) == 12
        exploits = [t for t in values.values() if t.get("tuner/trial_id") is not None
                    and values[t.get("tuner/trial_id")]["pbt/member"] != t["pbt/member"]]
        assert len(exploits) == 2  # one bottom member of four, at each of two boundaries
    # Every group trained rounds, each from the step its weights had reached (6 a epoch).
    starts = [job.rank(r)["rounds_started_at_step"] for r in (1, 2, 3)]
    assert sum(len(s) > 0 for s in starts) >= 2 and sum(len(s) for s in starts) == len(values)
    assert sorted(step for s in starts for step in s) == sorted(
        6 * t["tuner/initial_epoch"] for t in values.values())
    for rank in (1, 2, 3):
        assert job.rank(rank)["best"] == report["best"]
    assert report["schedule"][0]["epoch"] == 0


def test_population_based_training_on_groups_of_two_ranks_trains_each_round_data_parallel(
        mpirun, tmp_path):
    # Two groups of two ranks; each rank trains on its own half of the rows.
    job = mpirun("tune_pbt.py", n=5, timeout=400, args=[
        tmp_path, "--population", 3, "--max-epochs", 2, "--workers-per-group", 2])
    values = job.rank(0)["values"]
    assert set(job.rank(0)["statuses"].values()) == {"COMPLETED"} and len(values) == 6
    ends = set()
    for leader, follower in ((1, 2), (3, 4)):
        ours, theirs = job.rank(leader)["trained"], job.rank(follower)["trained"]
        assert [r["team"] for r in ours] == [[0, 2]] * len(ours)
        assert [r["team"] for r in theirs] == [[1, 2]] * len(ours)
        # Same rounds, each starting and ending with the same weights on both ranks,
        # though each saw other rows: the gradients were averaged over the group.
        assert [(r["start"], r["end"], r["steps"]) for r in ours] == [
            (r["start"], r["end"], r["steps"]) for r in theirs]
        ends.update(r["end"] for r in ours)
    assert len(job.rank(1)["trained"]) + len(job.rank(3)["trained"]) == 6
    # A round that continues another starts from the weights the other ended with,
    # though the follower loads them from the donor's leader's files.
    continued = [r for rank in (1, 2, 3, 4) for r in job.rank(rank)["trained"]
                 if r["steps"] > 3]
    assert continued and all(r["start"] in ends for r in continued)
    assert job.rank(1)["best"] == job.rank(2)["best"] == job.rank(0)["best"]


def test_a_group_lost_mid_round_hands_its_round_to_another_and_no_member_is_lost(mpi_job,
                                                                                 tmp_path):
    """Its own job: a group's rank is killed under Open MPI's fault tolerance and the
    population goes on.
    """
    job = mpi_job("tune_pbt.py", n=3, timeout=400, fault_tolerant=True, check=False, args=[
        tmp_path, "--population", 3, "--max-epochs", 2, "--kill-group", 1,
        "--lost-after", 5])
    assert job.returncode == 0, job.output[-3000:]
    assert sorted(job.results) == [0, 1]  # rank 2, group 1's only rank, was killed
    values = job.rank(0)["values"]
    assert set(job.rank(0)["statuses"].values()) == {"COMPLETED"} and len(values) == 6
    reached = {}
    for trial in values.values():
        reached[trial["pbt/member"]] = max(reached.get(trial["pbt/member"], 0),
                                           trial["tuner/epochs"])
    assert reached == {0: 2, 1: 2, 2: 2}
    # Group 0 trained every round, the one group 1 died in included.
    assert len(job.rank(1)["trained"]) == 6
    assert "lost group1" in job.output and "goes back to the queue" in job.output


def test_a_data_parallel_group_without_a_distributed_optimizer_is_refused(mpirun, tmp_path):
    # Each rank would train alone on its own rows and the group's ranks drift apart;
    # the trials fail with the fix instead, and the search ends.
    job = mpirun("tune_pbt.py", n=3, timeout=240, check=False, args=[
        tmp_path, "--population", 2, "--max-epochs", 1, "--workers-per-group", 2,
        "--plain-optimizer"])
    assert job.returncode != 0
    assert ("workers_per_fold=2 trains each trial on 2 ranks, but this model's optimizer "
            "does not average gradients over them") in job.output
    assert "comm=kdist.tune.trial_comm()" in job.output
