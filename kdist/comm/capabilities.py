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
    """False: kdist has no Gloo engine; it runs its collectives over MPI."""
    return False


def gloo_enabled():
    """False: kdist never runs over Gloo; see `kdist.mpi_enabled`."""
    return False


def nccl_built():
    """False: kdist has no NCCL engine. It reduces over MPI on the host; tensors on a GPU are
    copied to the host for each collective.

    Example:

        >>> import kdist
        >>> kdist.nccl_built(), kdist.gloo_enabled(), kdist.cuda_built()
        (False, False, False)
    """
    return False


def ddl_built():
    """False: kdist has no IBM DDL engine."""
    return False


def ccl_built():
    """False: kdist has no oneCCL engine."""
    return False


def cuda_built():
    """False: kdist is not built against CUDA (GPU tensors are copied to the host for each
    collective; TensorFlow itself may still use the GPU)."""
    return False


def rocm_built():
    """False: kdist is not built against ROCm (GPU tensors are copied to the host for each
    collective)."""
    return False


def is_homogeneous():
    """True when every node runs the same number of ranks.

    A collective over the world: call it on every rank. Starts kdist on first use.
    """
    world = processes.world()
    return len(set(world.allgather_object(processes.local_size()))) == 1
