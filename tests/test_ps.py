"""Parameter-server training under real mpiexec: modes, sub-masters, resume, failures."""

import os
import re

import numpy as np
import pytest

import ps_reference
from kdist.ps import messages

pytestmark = pytest.mark.mpi

SCRIPT = "ps_train.py"
# Per-mode settings under which each algorithm is expected to match plain SGD
# in the same number of epochs, all at the same learning rate: EASGD's centre
# averages its workers, which by default stretch their steps by their number.
MODES = {
    "downpour": [],
    "gem": [],
    "easgd": ["--sync-every", "4"],
}
# The rules each mode must follow (ps_train.py's strategy settings), and rules
# that must not fit its messages: each mode is told apart from the others.
RULES = {
    "downpour": ps_reference.Rules("downpour"),
    "gem": ps_reference.Rules("gem", gem_kappa=1.5, gem_momentum=0.9),
    "easgd": ps_reference.Rules("easgd", elastic_force=0.5, step_scale=3),
}
IMPOSTORS = {
    "downpour": [ps_reference.Rules("gem"), ps_reference.Rules("easgd"),
                 ps_reference.Rules("downpour", staleness_aware=True)],
    "gem": [ps_reference.Rules("downpour"), ps_reference.Rules("gem", gem_kappa=1.0),
            ps_reference.Rules("gem", staleness_aware=True)],
    "easgd": [ps_reference.Rules("downpour"), ps_reference.Rules("easgd", elastic_force=0.25)],
}
# 3072 rows, batch 32, split between 3 workers: 32 steps per worker and epoch.
STEPS_PER_EPOCH = 32


@pytest.fixture(scope="module")
def sgd_accuracy(python_run):
    """Validation accuracy of single-process SGD on the same task and epochs."""
    return python_run(SCRIPT, ["downpour", "--baseline"], timeout=120)["val_accuracy"]


def _final_weights(job, n):
    assert sorted(job.results) == list(range(n)), job.output[-3000:]
    return [job.results[rank]["weights"] for rank in range(n)]


def _record(tmp_path, name="record"):
    directory = tmp_path / name
    directory.mkdir()
    return directory


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_applies_its_rule_to_every_update_and_learns_as_well_as_sgd(
        mpirun, sgd_accuracy, mode, tmp_path):
    record = _record(tmp_path)
    job = mpirun(SCRIPT, n=4, args=[mode] + MODES[mode] + ["--record", record], timeout=240)
    master = job.results[0]
    # On one node every worker's bodies sit in memory the master shares.
    assert master["stats"]["shared_children"] == 3
    # Every reply, replayed with the mode's own rule from the messages the
    # workers really sent, in the order the master took them; the staleness
    # histogram is recounted; every rank ends with the replayed centre.
    replay = ps_reference.check(record, RULES[mode], stats=master["stats"],
                                final_weights=_final_weights(job, 4))
    sync_every = 4 if mode == "easgd" else 1
    per_worker = 6 * (STEPS_PER_EPOCH // sync_every + 1) + 1  # + epoch ends + the last
    assert replay.absorbed[0] == 3 * per_worker
    assert max(replay.histograms[0]) > 1, "three asynchronous workers must see stale centres"
    for impostor in IMPOSTORS[mode]:
        assert ps_reference.deviation(record, impostor) > 100 * ps_reference.TOLERANCE, (
            mode, impostor.mode)
    assert master["val_accuracy"] >= sgd_accuracy - 0.02, (mode, master, sgd_accuracy)
    history = master["history"]
    assert len(history["val_accuracy"]) == 6 and len(history["loss"]) == 6
    # Training metrics come from the workers, validation from the central model.
    assert history["loss"][-1] < history["loss"][0]
    assert "Epoch 6/6" in job.output and "staleness" in job.output


def test_submasters_add_up_their_workers_updates_and_report_once_a_round(mpirun,
                                                                         sgd_accuracy,
                                                                         tmp_path):
    record = _record(tmp_path)
    job = mpirun(SCRIPT, n=5, args=["downpour", "--submasters", 1, "--record", record],
                 timeout=240)
    master, sub = job.results[0]["stats"], job.results[1]["stats"]
    assert job.results[2]["stats"] is None  # a worker
    assert master["shared_children"] == 1 and sub["shared_children"] == 3
    # The sub-master's replies are its running sum; what it sends up is the
    # change since its last pull; the master adds that.
    replay = ps_reference.check(record, ps_reference.Rules("downpour"), stats=master,
                                final_weights=_final_weights(job, 5))
    assert replay.absorbed[1] == sub["updates"] == 3 * (6 * (STEPS_PER_EPOCH + 1) + 1)
    # Nothing lost or counted twice on the way up: the centre moved by the sum
    # of every worker's updates.
    records = ps_reference.load(record)
    total = sum(sent["body"] for rank in (2, 3, 4) for sent in records[rank].sends)
    np.testing.assert_allclose(replay.centers[0], records[0].server[2] + total, atol=1e-4)
    # One report up per round of its 3 workers' updates (epoch ends and the
    # end of training report early).
    since, rounds = 0, []
    for event in records[1].events:
        if event[0] == "absorb":
            since += 1
        elif event[0] == "send":
            rounds.append((event[1], since))
            since = 0
    assert {n for kind, n in rounds if kind == messages.EXCHANGE} == {3}
    assert master["updates"] == len(rounds) < sub["updates"] / 2
    assert job.results[0]["val_accuracy"] >= sgd_accuracy - 0.02


def test_a_model_of_two_halves_with_two_optimizers_exchanges_both(mpirun, tmp_path):
    record = _record(tmp_path)
    job = mpirun("ps_two_models.py", n=3, args=[record], timeout=180)
    assert sorted(job.results) == [0, 1, 2]
    # 4-8-1 and 1-1 dense layers: 49 + 2 values, and no optimizer slots.
    assert job.results[0]["exchanged"] == 51
    # Each worker's messages carry both halves' changes, and the master added
    # every one of them: the replay of Downpour ends where every rank ends.
    ps_reference.check(record, ps_reference.Rules("downpour"),
                       final_weights=[job.results[r]["all"] for r in range(3)])
    for rank in (1, 2):
        sends = [sent["body"] for sent in ps_reference.load(record)[rank].sends]
        assert max(np.abs(body[:49]).max() for body in sends) > 0
        assert max(np.abs(body[49:]).max() for body in sends) > 0
    assert all(moved > 0 for moved in job.results[0]["moved"])
    history = job.results[0]["history"]
    assert history["first_loss"][-1] < history["first_loss"][0]


def _closes_epoch(epoch, children):
    """A replay stop: the message that brings the last child's report for `epoch`."""
    reported = set()

    def until(child, index, sent):
        if sent["kind"] == messages.EPOCH_END and sent["epoch"] == epoch:
            reported.add(child)
        return reported == set(children)

    return until


def test_early_stopping_on_the_master_stops_every_rank_staleness_aware(mpirun, tmp_path):
    record = _record(tmp_path)
    job = mpirun(SCRIPT, n=4, args=["downpour", "--staleness-aware", "--early-stopping",
                                    "--logs", tmp_path, "--record", record, "--messages"],
                 timeout=240)
    assert job.results[0]["epochs"] == [0, 1]
    assert "Stopping every worker after epoch 2" in job.output
    # Each update was divided by its staleness; plain Downpour would not fit.
    aware = ps_reference.Rules("downpour", staleness_aware=True)
    replay = ps_reference.check(record, aware, stats=job.results[0]["stats"])
    # The workers stopped too: the request came back with their next exchange,
    # after which they took no step and only closed the epoch and the run.
    records = ps_reference.load(record)
    for rank in (1, 2, 3):
        after = records[rank].after_first_stop()
        assert after is not None, f"rank {rank} was never asked to stop"
        assert not [e for e in after if e[0] == "step"], f"rank {rank} trained on"
        assert [e[1] for e in after if e[0] == "send"] in (
            [messages.EPOCH_END, messages.DONE], [messages.DONE])
    assert any(len(job.results[rank]["epochs"]) < 6 for rank in (1, 2, 3))
    # Every rank ends with the centre the master's callbacks stopped on, the
    # one it had when the last worker closed epoch 2.
    at_stop = ps_reference.replay(records, aware, until=_closes_epoch(1, [1, 2, 3]))
    for weights in _final_weights(job, 4):
        np.testing.assert_allclose(weights, at_stop.centers[0], atol=ps_reference.TOLERANCE)
    assert max(replay.histograms[0]) > 1
    assert ps_reference.deviation(record, ps_reference.Rules("downpour")) > (
        100 * ps_reference.TOLERANCE)
    assert job.results[0]["stats"]["shared_children"] == 0  # --messages: every body travels
    # The master's CSVLogger saw both epochs, with the central validation metrics,
    # and TensorBoard wrote event files for training and validation.
    rows = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and "val_accuracy" in rows[0] and "loss" in rows[0]
    for part in ("train", "validation"):
        events = os.listdir(tmp_path / "tensorboard" / part)
        assert any(name.startswith("events.out") for name in events), events


def _same_run(first, second, ranks):
    for rank in ranks:
        np.testing.assert_array_equal(first.results[rank]["weights"],
                                      second.results[rank]["weights"])
    assert first.results[0]["history"] == second.results[0]["history"]


def test_two_servers_holding_half_the_centre_each_train_as_one_and_resume(mpirun, mpi_job,
                                                                          tmp_path):
    """The crash is a job of its own: kdist.comm.abort ends its processes mid-run."""
    # One worker makes the run deterministic; GEM's rule is element-wise, so
    # splitting the centre between two servers must change no value at all.
    one = mpirun(SCRIPT, n=2, args=["gem", "--epochs", 4], timeout=180)
    args = ["gem", "--epochs", 4, "--servers", 2, "--checkpoint", tmp_path / "ps"]
    crashed = mpi_job(SCRIPT, n=3, args=args + ["--stop-after", 3], timeout=180, check=False)
    assert crashed.returncode != 0 and "stopping after epoch 3" in crashed.output
    with np.load(tmp_path / "ps" / "master.npz") as saved:
        # The checkpoint holds both shards' momenta of the one worker.
        assert {"rule/momentum/2", "rule/shard1/momentum/2"} <= set(saved.files)
    resumed = mpirun(SCRIPT, n=3, args=args, timeout=180)
    assert "Resuming from" in resumed.output
    assert resumed.results[2]["epochs"] == [2, 3]
    _same_run(one, resumed, [0, 1])
    np.testing.assert_array_equal(resumed.results[2]["weights"], one.results[1]["weights"])
    master, shard = resumed.results[0]["stats"], resumed.results[1]["stats"]
    assert master["shared_children"] == shard["shared_children"] == 1
    assert master["updates"] == shard["updates"] > 0


@pytest.mark.slow
def test_two_servers_under_a_submaster_by_message_train_as_one(mpirun):
    # EASGD at both levels, every body sent by message: the sub-master splits
    # what it reports between the two top servers and joins their replies.
    args = ["easgd", "--epochs", 2, "--submasters", 1, "--messages"]
    one = mpirun(SCRIPT, n=3, args=args, timeout=180)
    two = mpirun(SCRIPT, n=4, args=args + ["--servers", 2], timeout=180)
    _same_run(one, two, [0])
    for rank in (1, 2):  # the sub-master and the worker
        np.testing.assert_array_equal(one.results[rank]["weights"],
                                      two.results[rank + 1]["weights"])
    assert two.results[0]["stats"]["shared_children"] == 0
    loss = two.results[0]["history"]["loss"]
    assert loss[-1] < loss[0]


def test_a_crashed_run_resumes_from_the_master_checkpoint(mpirun, mpi_job, tmp_path):
    """The crash is a job of its own: kdist.comm.abort ends its processes mid-run."""
    directory = tmp_path / "ps"
    seen, first, second = (_record(tmp_path, name) for name in ("seen", "first", "second"))
    args = ["gem", "--checkpoint", directory]
    crashed = mpi_job(SCRIPT, n=4, args=args + ["--stop-after", 3, "--record", first,
                                                "--epoch-weights", seen],
                      timeout=240, check=False)
    assert crashed.returncode != 0
    assert "stopping after epoch 3 on purpose" in crashed.output
    assert (directory / "master.npz").exists()
    # The callbacks of epoch 3 stopped the job before its checkpoint: the last
    # one is epoch 2's. Its centre and GEM momenta are the replay's state when
    # the last worker's report of epoch 2 arrived.
    at_checkpoint = ps_reference.Rules("gem")
    replay = ps_reference.replay(ps_reference.load(first), at_checkpoint,
                                 until=_closes_epoch(1, [1, 2, 3]))
    assert replay.reply_deviation < ps_reference.TOLERANCE
    np.testing.assert_array_equal(replay.centers[0], np.load(seen / "epoch-1.npy"))

    resumed = mpirun(SCRIPT, n=4, args=args + ["--record", second], timeout=240)
    assert "Resuming from" in resumed.output
    master = resumed.results[0]
    # This run started every rank from that centre and the master from those
    # momenta, and trained epochs 3-6 only.
    restored = ps_reference.Rules("gem", momenta=replay.momenta)
    ps_reference.check(second, restored, stats=master["stats"],
                       final_weights=_final_weights(resumed, 4))
    np.testing.assert_array_equal(ps_reference.load(second)[0].server[2], replay.centers[0])
    assert ps_reference.deviation(second, ps_reference.Rules("gem")) > (
        100 * ps_reference.TOLERANCE), "momenta from zero must not fit a resumed run"
    assert master["epochs"] == [0, 1, 2, 3, 4, 5]
    for rank in (1, 2, 3):
        assert resumed.results[rank]["epochs"] == [2, 3, 4, 5]
    assert "Epoch 3/6" in resumed.output and "Epoch 2/6" not in resumed.output
    # The history of the first two epochs is the crashed run's.
    printed = re.findall(r"Epoch (\d)/6 - .*val_accuracy: ([0-9.]+)", crashed.output)
    assert [e for e, _ in printed] == ["1", "2"]
    for epoch, value in printed[:2]:
        assert f"{master['history']['val_accuracy'][int(epoch) - 1]:.4f}" == value
    assert len(master["history"]["val_accuracy"]) == 6
    assert master["history"]["val_accuracy"][-1] > 0.9


def test_a_killed_worker_ends_the_job_quickly_naming_it(mpi_job):
    """Its own job: a worker's process dies and the job must end; how it ends is the subject."""
    job = mpi_job(SCRIPT, n=4, args=["downpour", "--die-on", 2], timeout=120, check=False)
    assert job.returncode != 0
    assert ",2]" in job.output or "rank 2" in job.output, job.output[-3000:]


def test_with_fault_tolerance_the_master_carries_on_without_a_dead_worker(mpi_job):
    # Not recorded: the failure detector's 4 s heartbeat deadline leaves no
    # room for extra work on a loaded machine.
    """Its own job: a worker dies under Open MPI's fault tolerance and the master carries on."""
    job = mpi_job(SCRIPT, n=4, args=["downpour", "--die-on", 2, "--fault-tolerant"],
                  timeout=180, check=False, fault_tolerant=True)
    assert "Rank(s) [2] died; carrying on" in job.output, job.output[-3000:]
    assert "carried on without rank(s) [2]" in job.output
    assert sorted(job.results) == [0, 1, 3]
    master = job.results[0]
    assert master["stats"]["lost"] == [2]
    # Rank 2's five updates before it died, and every update of the two
    # survivors through all six epochs, reached the centre.
    assert master["stats"]["updates"] == 5 + 2 * (6 * (STEPS_PER_EPOCH + 1) + 1)
    # The survivors alone share the final centre.
    reference = np.array(master["weights"])
    for rank in (1, 3):
        np.testing.assert_array_equal(np.array(job.results[rank]["weights"]), reference)
    assert len(master["history"]["val_accuracy"]) == 6
    assert master["val_accuracy"] > 0.9


def test_a_raising_worker_ends_the_job_with_its_error(mpi_job):
    """Its own job: one worker raises and kdist ends the job; how it ends is the subject."""
    job = mpi_job(SCRIPT, n=4, args=["downpour", "--raise-on", 1], timeout=120, check=False)
    assert job.returncode != 0
    assert "worker failed on purpose" in job.output
    assert "rank 1" in job.output
