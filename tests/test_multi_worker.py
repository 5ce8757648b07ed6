"""kdist's MultiWorkerMirroredStrategy: Keras 3 fit/evaluate/predict on TensorFlow workers.

The workers are real processes started by `kdist launch` with TF_CONFIG and
one TensorFlow thread each.
"""

import numpy as np
import pytest

@pytest.fixture(scope="module")
def two_kdist_workers(tf_launch):
    return tf_launch("tf_train.py", n=2, args=["kdist"], timeout=150)


@pytest.mark.timeout(240)
def test_stock_strategy_fails_in_keras_fit_and_kdist_runs_the_same_script(tf_launch,
                                                                          two_kdist_workers):
    stock = tf_launch("tf_train.py", n=2, args=["stock"], timeout=150, check=False)
    assert stock.returncode != 0, stock.output[-3000:]
    # keras-team/keras#20585: Keras reduces a whole (x, y) batch of per-replica values.
    assert "Attempt to convert a value (PerReplica" in stock.output, stock.output[-3000:]
    assert not stock.results
    assert two_kdist_workers.returncode == 0
    assert sorted(two_kdist_workers.results) == [0, 1]
    assert "[0] done 0" in two_kdist_workers.output
    assert "[1] done 1" in two_kdist_workers.output


@pytest.mark.timeout(240)
def test_two_workers_match_one_process_on_the_global_batch(two_kdist_workers, python_run):
    single = python_run("tf_train.py", ["none"], timeout=120)
    worker0, worker1 = two_kdist_workers.rank(0), two_kdist_workers.rank(1)
    assert worker0["replicas"] == 2 and single["replicas"] == 1
    assert worker0["weights"] == worker1["weights"], "workers must hold identical weights"
    np.testing.assert_allclose(worker0["weights"], single["weights"], atol=1e-5, rtol=0)
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(worker0["history"][key], single["history"][key], atol=1e-5)
    assert worker0["history"]["loss"][-1] < worker0["history"]["loss"][0]
    # evaluate and predict: every worker gets the global answer, rows in order.
    for key in ("evaluate", "predict", "predict_uneven"):
        assert worker0[key] == worker1[key], key
        np.testing.assert_allclose(worker0[key], single[key], atol=1e-5, rtol=0, err_msg=key)
    assert len(worker0["predict_uneven"]) == 30 * 4


def test_steps_per_execution_above_one_is_refused_with_a_reason(two_kdist_workers):
    for worker in (two_kdist_workers.rank(0), two_kdist_workers.rank(1)):
        assert "steps_per_execution=1" in (worker["steps_per_execution_error"] or "")


@pytest.mark.timeout(240)
def test_tensorflow_multi_worker_tutorial_flow(tf_launch):
    job = tf_launch("tf_tutorial.py", n=2, timeout=150)
    worker0, worker1 = job.rank(0), job.rank(1)
    assert worker0["workers"] == worker1["workers"] == 2
    assert worker0["weights_sum"] == worker1["weights_sum"]
    assert worker0["loss"] == worker1["loss"] and len(worker0["loss"]) == 2
    assert worker0["loss"][1] < worker0["loss"][0]
    assert worker0["saved"], "the chief saves the model"
    assert "[0] Epoch 2/2" in job.output and "[1] Epoch 2/2" in job.output


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_workers_find_each_other_under_mpiexec(mpi_job, two_kdist_workers):
    # No TF_CONFIG: the strategy gathers the workers' addresses over MPI. Both
    # workers read the same data, so agreeing proves little; training as the
    # TF_CONFIG cluster does (itself checked against one process) proves they
    # reduce together.
    """Its own job: TensorFlow's collective ops are configured once per process, at its start."""
    job = mpi_job("tf_train.py", n=2, args=["kdist"], timeout=150)
    worker0, worker1 = job.rank(0), job.rank(1)
    assert worker0["replicas"] == 2
    assert worker0["weights"] == worker1["weights"]
    np.testing.assert_allclose(worker0["weights"], two_kdist_workers.rank(0)["weights"],
                               atol=1e-6, rtol=0)
