"""What this installation of kdist can do, under Horovod's names.

kdist reduces over MPI on the host; it has no Gloo, NCCL, DDL or oneCCL
engine of its own and is not built against CUDA or ROCm (GPU tensors are
copied to the host for each collective), so those queries answer False.

>>> import kdist
>>> kdist.nccl_built(), kdist.gloo_enabled()
(False, False)
"""

from kdist.comm import processes
from kdist.comm.processes import mpi_built  # noqa: F401  (re-exported)


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return False


def rocm_built():
    return False


def is_homogeneous():
    """True when every node runs the same number of ranks. A collective: call it on every rank."""
    world = processes.world()
    return len(set(world.allgather_object(processes.local_size()))) == 1
