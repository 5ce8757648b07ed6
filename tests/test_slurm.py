"""kdist under SLURM: srun's plugins, batch scripts with each launcher, and the elastic case.

These run on a one-node SLURM cluster that the module starts on loopback
(tests/slurm_cluster.py). They are selected with the `slurm` marker and run only
when `KDIST_TEST_SLURM=1`: `bash benchmarks/slurm.sh` installs Slurm and runs them.
"""

import os
import re
import subprocess
import sys

import pytest

import slurm_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
ELASTIC = os.path.join(ROOT, "examples", "elastic_digits.py")
BIN = os.path.dirname(sys.executable)
# Where benchmarks/other_mpi.py makes its MPICH environment.
MPICH_PYTHON = os.path.expanduser("~/.cache/kdist/mpi-mpich/bin/python")

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, mpiexec_path):
    if os.environ.get("KDIST_TEST_SLURM") != "1":
        pytest.skip("SLURM tests run with KDIST_TEST_SLURM=1 (bash benchmarks/slurm.sh)")
    why_not = slurm_cluster.available()
    if why_not:
        pytest.skip(why_not)
    with slurm_cluster.LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def job_env(cluster):
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TF_CONFIG"))}
    env.update({"PATH": BIN + os.pathsep + env.get("PATH", ""), "TF_CPP_MIN_LOG_LEVEL": "3",
                "PYTHONUNBUFFERED": "1", "KDIST_COLLECTIVE_TIMEOUT": "120"})
    if os.geteuid() == 0:  # the cluster runs jobs as root here; Open MPI asks to be told
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return cluster.env(env)


def srun(cluster, args, timeout=240):
    done = subprocess.run(["srun", *args], env=job_env(cluster), capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def test_srun_with_pmix_starts_one_job_and_prints_no_pmix_noise(slurm):
    code, out = srun(slurm, ["-n", "2", "--mpi=pmix", sys.executable, "-m", "kdist.cli",
                             "info"])
    assert code == 0, out[-3000:]
    assert re.search(r"launcher: srun\b", out) and re.search(r"size: 2\b", out), out[-3000:]
    assert "rank 1: host" in out
    assert "help-pmix-mca-base" not in out and "Sorry!" not in out, out[-3000:]
    assert "\x00" not in out
    # Unbound tasks: the advice names srun's flag, not mpiexec's.
    assert "--cpu-bind=cores" in out and "--bind-to core" not in out


def test_auto_under_srun_is_the_mpi_strategy(slurm):
    code, out = srun(slurm, ["-n", "2", "--mpi=pmix", sys.executable, "-c",
                             "import kdist; s = kdist.distribute.auto(); "
                             "print('strategy', type(s).__name__, s.num_replicas_in_sync)"])
    assert code == 0, out[-3000:]
    assert out.count("strategy MPIStrategy 2") == 2, out[-3000:]


def test_srun_without_a_matching_plugin_fails_naming_the_plugin(slurm):
    # Each task sees a world of one: kdist refuses to train two separate models.
    code, out = srun(slurm, ["-n", "2", "--mpi=none", sys.executable, "-c",
                             "import kdist; kdist.init()"], timeout=120)
    assert code != 0
    assert "--mpi=pmix" in out, out[-3000:]


def quickstart_batch(launch, tasks=2):
    return (f"#!/bin/bash\n#SBATCH --ntasks={tasks}\n#SBATCH --time=10\n"
            f"{launch} {QUICKSTART} --epochs 2\n")


@pytest.mark.parametrize("launch", [
    "kdist run -n $SLURM_NTASKS",
    "mpiexec -n $SLURM_NTASKS python",
    "srun --mpi=pmix python",
])
def test_a_batch_script_trains_the_quickstart_with_each_launcher(slurm, launch):
    code, out = slurm.sbatch(quickstart_batch(launch), env=job_env(slurm))
    assert code == 0, out[-3000:]
    assert "Training on 2 rank(s)" in out, out[-3000:]
    assert "ranks hold identical weights: True" in out, out[-3000:]
    assert "help-pmix-mca-base" not in out


def test_the_elastic_example_carries_on_inside_an_allocation(slurm):
    # Three tasks on this machine's two cores: --overcommit lets Slurm place them.
    script = ("#!/bin/bash\n#SBATCH --ntasks=3\n#SBATCH --overcommit\n#SBATCH --time=10\n"
              f"kdist run --elastic -n 3 --min-np 2 {ELASTIC} --epochs 3 --kill-rank 2\n")
    code, out = slurm.sbatch(script, env=job_env(slurm), timeout=400)
    assert "rank 2: killing myself" in out, out[-3000:]
    assert "carrying on with 2 rank(s)" in out, out[-3000:]
    assert re.search(r"finished on 2 rank\(s\): loss [0-9.]+, accuracy", out), out[-3000:]
    assert code == 0, out[-3000:]


def test_mpich_under_srun_with_pmi2(slurm):
    if not os.path.exists(MPICH_PYTHON):
        pytest.skip("no MPICH environment: python benchmarks/other_mpi.py --wheel mpich "
                    "makes it")
    code, out = srun(slurm, ["-n", "2", "--mpi=pmi2", MPICH_PYTHON, "-m", "kdist.cli",
                             "info"])
    assert code == 0, out[-3000:]
    assert "MPICH" in out and re.search(r"size: 2\b", out), out[-3000:]
    # The same library under the pmix plugin: MPICH itself refuses in MPI_Init, loudly,
    # before kdist could say anything.
    code, out = srun(slurm, ["-n", "2", "--mpi=pmix", MPICH_PYTHON, "-c",
                             "import kdist; kdist.init()"], timeout=120)
    assert code != 0 and "unsupported PMI version PMIx" in out, out[-3000:]
