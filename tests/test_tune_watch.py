"""The oracle's watch over the groups of a distributed search, driven with a fake clock."""

import keras_tuner as kt
import pytest

from kdist.tune import watch as watch_module
from kdist.tune.watch import GroupWatch, beat_id


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _oracle(tmp_path, max_trials=4):
    oracle = kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=max_trials,
                                           seed=1)
    oracle._set_project_dir(str(tmp_path), "watch")
    oracle.verbose = 0
    oracle.hyperparameters.Float("x", 0, 1)
    return oracle


def _watch(tmp_path, **settings):
    clock = Clock()
    oracle = _oracle(tmp_path)
    return clock, oracle, GroupWatch(oracle, clock=clock, **settings)


def _given_up_on_group0(tmp_path):
    """A watch that has just given up on group0, which held a trial."""
    clock, oracle, watch = _watch(tmp_path, lost_after=10)
    trial = watch.create_trial("group0")
    clock.now = 11.0
    assert watch.check() == ["group0"]
    return oracle, watch, trial


def _finish(watch, trial, loss):
    watch.update_trial(trial.trial_id, {"loss": loss})
    trial.status = "COMPLETED"
    watch.end_trial(trial)


def test_a_silent_group_loses_its_trial_to_the_next_group_with_its_metrics_cleared(tmp_path):
    clock, oracle, watch = _watch(tmp_path, lost_after=10)
    first = watch.create_trial("group0")
    watch.update_trial(first.trial_id, {"loss": 5.0})
    values = dict(first.hyperparameters.values)
    clock.now = 9.0
    assert watch.check() == []
    clock.now = 10.5
    assert watch.check() == ["group0"]
    assert watch.lost == {"group0"}
    assert not oracle.trials[first.trial_id].metrics.exists("loss")
    again = watch.create_trial("group1")
    assert again.trial_id == first.trial_id and again.hyperparameters.values == values
    assert watch.create_trial("group0").status == "STOPPED"
    _finish(watch, again, 1.0)
    # Four trials in all: the re-run was not counted as a fifth.
    for _ in range(3):
        _finish(watch, watch.create_trial("group1"), 2.0)
    assert watch.create_trial("group1").status == "STOPPED"
    assert sorted(oracle.end_order) == sorted(oracle.trials) and len(oracle.trials) == 4
    assert oracle.trials[first.trial_id].score == 1.0


def test_heartbeats_keep_a_group_that_trains_for_long_alive(tmp_path):
    clock, _, watch = _watch(tmp_path, lost_after=10)
    trial = watch.create_trial("group0")
    for second in range(5, 60, 5):
        clock.now = float(second)
        assert watch.get_trial(beat_id("group0", trial.trial_id)).status == "RUNNING"
        assert watch.check() == []
    assert watch.holds("group0") == trial.trial_id


def test_a_late_result_counts_once_whichever_group_sends_it_first(tmp_path):
    oracle, watch, trial = _given_up_on_group0(tmp_path)
    taken = watch.create_trial("group1")
    assert taken.trial_id == trial.trial_id
    # group1's heartbeat still holds it; group0's learns it was taken.
    assert watch.get_trial(beat_id("group1", trial.trial_id)).status == "RUNNING"
    assert watch.get_trial(beat_id("group0", trial.trial_id)).status == "STOPPED"
    # group0 comes back with its result first: it counts ...
    _finish(watch, trial, 3.0)
    assert oracle.trials[trial.trial_id].score == 3.0
    assert watch.holds("group1") is None
    # ... and group1's later one is dropped.
    _finish(watch, taken, 0.5)
    assert oracle.trials[trial.trial_id].score == 3.0
    assert oracle.end_order.count(trial.trial_id) == 1
    assert oracle._run_times[trial.trial_id] == 1


def test_a_lost_groups_result_is_taken_while_its_trial_waits_in_the_queue(tmp_path):
    oracle, watch, trial = _given_up_on_group0(tmp_path)
    assert oracle._retry_queue == [trial.trial_id]
    _finish(watch, trial, 2.0)
    assert oracle._retry_queue == [] and oracle.trials[trial.trial_id].status == "COMPLETED"
    assert watch.create_trial("group1").trial_id != trial.trial_id


def test_a_trial_past_its_timeout_fails_and_is_not_run_again(tmp_path):
    clock, oracle, watch = _watch(tmp_path, lost_after=10, trial_timeout=30)
    trial = watch.create_trial("group0")
    for second in range(5, 35, 5):
        clock.now = float(second)
        watch.get_trial(beat_id("group0", trial.trial_id))
        assert watch.check() == []
    clock.now = 31.0
    assert watch.check() == ["group0"]
    failed = oracle.trials[trial.trial_id]
    assert failed.status == "FAILED" and "past trial_timeout=30 s" in failed.message
    assert oracle._retry_queue == [] and trial.trial_id in oracle.end_order
    assert watch.create_trial("group1").trial_id != trial.trial_id


def test_a_group_that_stopped_asking_is_not_reported_lost(tmp_path):
    clock = Clock()
    oracle = _oracle(tmp_path, max_trials=1)
    watch = GroupWatch(oracle, lost_after=10, clock=clock)
    _finish(watch, watch.create_trial("group0"), 1.0)
    assert watch.create_trial("group0").status == "STOPPED"
    clock.now = 100.0
    assert watch.check() == [] and watch.lost == set()


def test_the_queue_survives_a_reload(tmp_path):
    _, _, trial = _given_up_on_group0(tmp_path)
    reloaded = _oracle(tmp_path)
    reloaded.reload()
    assert trial.trial_id in reloaded._retry_queue
    assert reloaded.trials[trial.trial_id].status == "INVALID"
    assert "group0 was given up on" in reloaded.trials[trial.trial_id].message


@pytest.mark.parametrize("lost_after,trial_timeout,match", [
    (0, None, "lost_after must be a number of seconds > 0"),
    ("60", None, "lost_after"),
    (True, None, "lost_after"),
    (10, -1, "trial_timeout must be None or a number of seconds > 0"),
])
def test_bad_timeouts_are_refused_with_their_name(lost_after, trial_timeout, match):
    with pytest.raises(ValueError, match=match):
        watch_module.check_timeouts(lost_after, trial_timeout)


def test_search_checks_its_timeouts_before_anything_else(tmp_path):
    import kdist.tune

    with pytest.raises(ValueError, match="trial_timeout"):
        kdist.tune.search(object(), trial_timeout=0)
