#!/usr/bin/env bash
# kdist under SLURM, on a one-node cluster on this machine (loopback only).
#
#   bash benchmarks/slurm.sh [--mpich] [pytest arguments]
#
# Installs Debian's Slurm, munge and PMIx packages when they are missing (needs root),
# then runs tests/test_slurm.py, which starts munge, slurmctld and slurmd with a
# configuration of their own in a temporary directory and stops them afterwards:
# srun with the pmix plugin, srun with no plugin (the clear refusal), auto() under srun,
# batch scripts launching the quickstart with `kdist run`, `mpiexec` and `srun`, and the
# elastic example inside an allocation. With --mpich it first makes the MPICH environment
# of benchmarks/other_mpi.py, so that MPICH under `srun --mpi=pmi2` is tested too.
# Run it from the environment kdist's test extras are installed in.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then python=.venv/bin/python; fi

mpich=0
if [ "${1:-}" = "--mpich" ]; then mpich=1; shift; fi

have_pmix() { compgen -G "/usr/lib/*/slurm-wlm/mpi_pmix.so" >/dev/null; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! have_pmix; then
    if [ "$(id -u)" != 0 ]; then
        echo "Slurm is missing and installing it needs root: apt-get install slurm-wlm munge libpmix-dev" >&2
        exit 2
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge libpmix-dev >/dev/null
fi

if [ "$mpich" = 1 ]; then
    # Makes the environment and runs one test there, so that the C++ ops are built for MPICH.
    "$python" benchmarks/other_mpi.py --wheel mpich \
        --tests tests/test_comm.py::test_collectives_on_real_ranks >/dev/null
fi

export KDIST_TEST_SLURM=1
exec "$python" -m pytest -q -m slurm -p no:cacheprovider tests/test_slurm.py "$@"
