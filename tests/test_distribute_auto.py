"""`kdist.distribute.auto()` picks the strategy from how the process was started."""

import pytest

from kdist.distribute import selection

OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}
MPICH = {"PMI_SIZE": "2", "PMI_RANK": "0", "HYDRA_CONTROL_FD": "7"}
PMIX = {"PMIX_RANK": "3"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5",
        "SLURM_JOB_ID": "123"}
SRUN_ONE_TASK = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "123"}
SBATCH_ONLY = {"SLURM_JOB_ID": "123", "SLURM_NTASKS": "4"}  # the batch script itself
TF_CONFIG = {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, '
                          '"task": {"type": "worker", "index": 0}}'}
TF_CONFIG_ONE = {"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, '
                              '"task": {"type": "worker", "index": 0}}'}


@pytest.mark.parametrize("environ,gpus,expected", [
    (OPEN_MPI, 0, "mpi"),
    (MPICH, 0, "mpi"),
    (PMIX, 0, "mpi"),
    (SRUN, 0, "mpi"),
    (SRUN, 4, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, 0, "default"),
    (SRUN_ONE_TASK, 2, "mirrored"),
    (SBATCH_ONLY, 0, "default"),
    (TF_CONFIG, 0, "multi_worker"),
    ({**TF_CONFIG, **SRUN}, 0, "multi_worker"),
    (TF_CONFIG_ONE, 0, "default"),
    ({}, 2, "mirrored"),
    ({}, 1, "default"),
    ({}, 0, "default"),
])
def test_choice_follows_the_environment(environ, gpus, expected):
    choice, reason = selection.choose(environ, gpus=gpus)
    assert choice == expected
    assert reason


@pytest.mark.parametrize("value,expected", [("mpi", "mpi"), ("MPI", "mpi"), ("tf", "multi_worker"),
                                            ("multi_worker", "multi_worker"),
                                            ("mirrored", "mirrored"), ("default", "default")])
def test_kdist_strategy_overrides_everything(value, expected):
    choice, reason = selection.choose({**OPEN_MPI, **TF_CONFIG, "KDIST_STRATEGY": value}, gpus=4)
    assert choice == expected
    assert "KDIST_STRATEGY" in reason


def test_unknown_override_is_a_clear_error():
    with pytest.raises(ValueError, match="KDIST_STRATEGY='parameter_server'.*mpi, multi_worker"):
        selection.choose({"KDIST_STRATEGY": "parameter_server"})


def test_malformed_tf_config_is_a_clear_error():
    with pytest.raises(ValueError, match="TF_CONFIG is set but is not a JSON object"):
        selection.choose({"TF_CONFIG": "worker0:2222"})


def test_one_process_gets_the_default_strategy(caplog):
    import tensorflow as tf

    strategy = selection.auto(environ={})
    assert strategy is tf.distribute.get_strategy()


@pytest.mark.mpi
def test_under_mpiexec_auto_is_the_mpi_strategy_and_says_so(mpirun, python_run):
    single = python_run("strategy.py", ["--strategy", "default", "--epochs", 1])
    job = mpirun("strategy.py", n=2, args=["--strategy", "auto", "--epochs", 1])
    assert job.rank(0)["strategy"] == job.rank(1)["strategy"] == "MPIStrategy"
    assert "kdist.distribute.auto(): MPIStrategy (started by an MPI launcher with 2 tasks)" \
        in job.output
    assert job.rank(0)["weights"] == pytest.approx(single["weights"], abs=1e-5)


@pytest.mark.mpi
def test_override_under_mpiexec_gives_independent_processes(mpirun):
    job = mpirun("strategy.py", n=2, args=["--strategy", "auto", "--epochs", 1],
                 env={"KDIST_STRATEGY": "default"})
    assert job.rank(0)["replicas"] == 1
    assert "KDIST_STRATEGY=default" in job.output
