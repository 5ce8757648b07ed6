"""Where the workers of a TensorFlow multi-worker job live: cluster resolution.

`tf.distribute.MultiWorkerMirroredStrategy` needs every worker's "host:port"
and which of them the current process is. TensorFlow reads that from
TF_CONFIG; this module also derives it from what a batch system or an MPI
launcher puts in each process's environment, in this order:

1. TF_CONFIG, when set (TensorFlow's own `TFConfigClusterResolver`).
2. A SLURM step started by `srun`: SLURM_PROCID, SLURM_STEP_NUM_TASKS (or
   SLURM_NTASKS), SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) and
   SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE). Tasks are laid out in
   block order (SLURM's default) and the task with local index `l` on its
   node listens on port `base + l`. `base` is KDIST_TF_PORT when set, else
   `8888 + 100 * (SLURM_JOB_ID % 500)`, so that two jobs sharing a node do
   not pick the same ports.
3. An MPI launcher: Open MPI (OMPI_COMM_WORLD_RANK/SIZE), MPICH, Hydra and
   PMI (PMI_RANK/PMI_SIZE) or PMIx (PMIX_RANK). Each rank picks a free port
   on its host (KDIST_TF_HOST, else the host name) and the ranks allgather
   their "host:port" over MPI.

When `srun` starts MPI ranks, the SLURM and MPI variables describe the same
processes and the SLURM layout is used: it needs no communication.

>>> env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "KDIST_TF_PORT": "9000",
...        "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
>>> cluster_spec_from_environ(env)["cluster"]
{'worker': ['node01:9000', 'node02:9000']}
>>> expand_nodelist("node[01-03],gpu7")
['node01', 'node02', 'node03', 'gpu7']
"""

import json
import os
import re
import socket

DEFAULT_PORT_BASE = 8888
# Each job gets its own block of ports; more tasks than this on one node
# would run into the next job's block.
PORTS_PER_JOB = 100
JOB_PORT_BLOCKS = 500

_MPI_RANK_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("PMIX_RANK", None),  # PMIx puts no job size in the environment.
)


def _int(environ, name):
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {text!r}.") from None


def _worker_spec(addresses, index):
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}


# ---------------------------------------------------------------------------
# TF_CONFIG

def parse_tf_config(text):
    """Checks a TF_CONFIG string and returns it as a dict.

    >>> parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"]}, '
    ...                 '"task": {"type": "worker", "index": 0}}')["task"]
    {'type': 'worker', 'index': 0}
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not valid JSON ({error}): {text!r}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ValueError('TF_CONFIG needs a "cluster" object, e.g. {"cluster": {"worker": '
                         f'["host1:2222", "host2:2222"]}}, "task": {{...}}}}; got {text!r}.')
    task = config.get("task", {})
    if task:
        jobs = config["cluster"]
        kind, index = task.get("type"), task.get("index")
        if kind not in jobs or not isinstance(index, int) or not 0 <= index < len(jobs[kind]):
            raise ValueError(f"TF_CONFIG task {task} is not in its cluster {jobs}.")
    return config


# ---------------------------------------------------------------------------
# SLURM

def expand_nodelist(nodelist):
    """Expands a SLURM host list such as "node[01-03],gpu7" into host names.

    Zero padding is kept, and several bracket groups per name multiply out
    ("r[1-2]n[1-2]" is r1n1, r1n2, r2n1, r2n2), as in `scontrol show hostnames`.

    >>> expand_nodelist("c[1-2,5]-ib,login")
    ['c1-ib', 'c2-ib', 'c5-ib', 'login']
    """
    hosts = []
    for name in _split_outside_brackets(nodelist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", name):
            choices = _expand_ranges(ranges, nodelist) if ranges else [""]
            expanded = [done + literal + choice for done in expanded for choice in choices]
        hosts.extend(expanded)
    return hosts


def _split_outside_brackets(nodelist):
    names, current, depth = [], "", 0
    for char in nodelist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"Unbalanced brackets in SLURM node list {nodelist!r}.")
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"Unbalanced brackets in SLURM node list {nodelist!r}.")
    names.append(current)
    if any(not name for name in names):
        raise ValueError(f"Empty host name in SLURM node list {nodelist!r}.")
    return names


def _expand_ranges(ranges, nodelist):
    values = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ValueError(f"Bad range [{ranges}] in SLURM node list {nodelist!r}.")
        values.extend(str(i).zfill(len(low)) for i in range(int(low), int(high) + 1))
    return values


def expand_tasks_per_node(text):
    """Expands SLURM's tasks-per-node string: "2(x3),1" is [2, 2, 2, 1].

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"Bad SLURM tasks-per-node list {text!r}; expected e.g. '2(x3),1'.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _first(environ, *names):
    return next((environ[name] for name in names if environ.get(name)), None)


def in_slurm_step(environ):
    """True when `srun` started this process as one task of several."""
    if "SLURM_PROCID" not in environ:
        return False
    # The batch script itself also has SLURM_PROCID and SLURM_NTASKS but is a
    # single process; only srun sets the step variables.
    if "SLURM_STEP_ID" not in environ and "SLURM_STEP_NUM_TASKS" not in environ:
        return False
    tasks = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    return tasks is not None and int(tasks) > 1


def slurm_port_base(environ):
    """The port of local task 0 on every node: KDIST_TF_PORT, else one block per job."""
    if environ.get("KDIST_TF_PORT"):
        base = _int(environ, "KDIST_TF_PORT")
    else:
        job = int(environ.get("SLURM_JOB_ID", "0") or 0)
        base = DEFAULT_PORT_BASE + PORTS_PER_JOB * (job % JOB_PORT_BLOCKS)
    if not 1 <= base <= 65535:
        raise ValueError(f"KDIST_TF_PORT must be a port number (1-65535); got {base}.")
    return base


def slurm_cluster_spec(environ):
    """TF_CONFIG-shaped dict for a SLURM step, or None when this is not one."""
    if not in_slurm_step(environ):
        return None
    rank = _int(environ, "SLURM_PROCID")
    tasks = int(_first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is None:
        raise ValueError("SLURM step without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST.")
    hosts = expand_nodelist(nodelist)
    per_node = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if per_node is not None:
        counts = expand_tasks_per_node(per_node)
    elif tasks % len(hosts) == 0:
        counts = [tasks // len(hosts)] * len(hosts)
    else:
        raise ValueError(f"Cannot spread {tasks} SLURM tasks over {len(hosts)} nodes without "
                         "SLURM_STEP_TASKS_PER_NODE.")
    if len(counts) != len(hosts) or sum(counts) != tasks:
        raise ValueError(f"SLURM node list {nodelist!r} with tasks per node {per_node!r} does "
                         f"not add up to {tasks} tasks.")
    if not 0 <= rank < tasks:
        raise ValueError(f"SLURM_PROCID={rank} is outside the step's {tasks} tasks.")
    base = slurm_port_base(environ)
    addresses, placement = [], []
    for host, count in zip(hosts, counts):
        for local in range(count):
            if base + local > 65535:
                raise ValueError(f"Port {base + local} for {host} is past 65535; "
                                 "set KDIST_TF_PORT lower.")
            addresses.append(f"{host}:{base + local}")
            placement.append((host, local))
    # Other tasks' hosts cannot be known without talking to them, so the
    # block layout is assumed; a task that finds itself elsewhere says so
    # rather than letting the workers wait for each other forever.
    host, local = placement[rank]
    actual_local = environ.get("SLURM_LOCALID")
    actual_host = environ.get("SLURMD_NODENAME")
    if (actual_local is not None and int(actual_local) != local) or (
            actual_host is not None and actual_host != host):
        raise ValueError(
            f"SLURM task {rank} runs on {actual_host or '?'} as local task "
            f"{actual_local or '?'}, not on {host} as local task {local}: kdist assumes "
            "block task distribution (srun --distribution=block), or set TF_CONFIG.")
    return _worker_spec(addresses, rank)


# ---------------------------------------------------------------------------
# MPI launchers

def mpi_rank_and_size(environ):
    """(rank, size) from an MPI launcher's variables, size None when unknown; or None."""
    for rank_name, size_name in _MPI_RANK_VARIABLES:
        if rank_name in environ:
            size = _int(environ, size_name) if size_name and size_name in environ else None
            return _int(environ, rank_name), size
    return None


def free_port(host=""):
    """A TCP port that nobody listened on a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _mpi_allgather(address):
    from kdist import comm

    return comm.allgather_object(address)


def mpi_cluster_spec(environ, allgather=None):
    """TF_CONFIG-shaped dict for MPI ranks, exchanging addresses with `allgather`.

    `allgather(obj)` must return every rank's object in rank order; it
    defaults to `kdist.comm.allgather_object`. Returns None outside an MPI
    job and for a job of one rank.
    """
    found = mpi_rank_and_size(environ)
    if found is None or found[1] == 1:
        return None
    rank, size = found
    host = environ.get("KDIST_TF_HOST") or socket.gethostname()
    mine = f"{host}:{free_port()}"
    addresses = list((allgather or _mpi_allgather)(mine))
    if size is not None and len(addresses) != size:
        raise ValueError(f"allgather returned {len(addresses)} addresses for {size} ranks.")
    if not 0 <= rank < len(addresses) or addresses[rank] != mine:
        raise ValueError(f"allgather did not put rank {rank}'s address {mine} at index "
                         f"{rank}: {addresses}")
    if len(addresses) == 1:
        return None
    return _worker_spec(addresses, rank)


# ---------------------------------------------------------------------------
# Entry points

def cluster_spec_from_environ(environ=None, allgather=None):
    """The TF_CONFIG-shaped dict this process's environment describes, or None.

    The same decision as `resolve_cluster`, as a plain dict:
    `{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker",
    "index": i}}` (TF_CONFIG itself is returned as it is, checked). Pure apart
    from the MPI case, which picks a free port and calls `allgather`.

    Args:
        environ: the environment to read (default: `os.environ`).
        allgather: for MPI launchers, `allgather(obj)` returning every
            rank's object in rank order (default: `kdist.allgather_object`).

    Returns:
        The dict, or None for a single process (no cluster to join).

    Raises:
        ValueError: a malformed variable (TF_CONFIG, a SLURM node list or
            tasks-per-node string, a port past 65535...), named in the
            message; or SLURM tasks not laid out in block order.

    Example:

        >>> env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "KDIST_TF_PORT": "9000",
        ...        "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
        >>> cluster_spec_from_environ(env)["cluster"]
        {'worker': ['node01:9000', 'node02:9000']}
    >>> cluster_spec_from_environ({}) is None
    True
    >>> cluster_spec_from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
    ...                            "KDIST_TF_HOST": "a"},
    ...                           allgather=lambda mine: [mine, "b:2222"])["task"]
    {'type': 'worker', 'index': 0}
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CONFIG"):
        return parse_tf_config(environ["TF_CONFIG"])
    mpi = mpi_rank_and_size(environ)
    if in_slurm_step(environ):
        slurm_rank = _int(environ, "SLURM_PROCID")
        slurm_tasks = int(_first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
        # mpiexec inside an allocation leaves the batch step's SLURM
        # variables around; trust them only when they describe these ranks.
        if mpi is None or (mpi[0] == slurm_rank and mpi[1] in (None, slurm_tasks)):
            return slurm_cluster_spec(environ)
    if mpi is not None:
        return mpi_cluster_spec(environ, allgather)
    return None


def resolve_cluster(environ=None, allgather=None):
    """A `tf.distribute.cluster_resolver.ClusterResolver` for this process, or None.

    What `MultiWorkerMirroredStrategy` uses by default. The cluster comes
    from, in order:

    1. TF_CONFIG: in this process's own environment, TensorFlow's
       `TFConfigClusterResolver`.
    2. A SLURM step started by `srun` (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
       SLURM_STEP_NODELIST, which may use ranges such as `node[01-04]`, and
       SLURM_STEP_TASKS_PER_NODE, or their job-wide forms): tasks in block
       order over the nodes; local task `l` of a node listens on port
       `KDIST_TF_PORT + l`, by default `8888 + 100 * (SLURM_JOB_ID % 500) + l`
       so that two jobs sharing a node pick different ports.
    3. An MPI launcher (Open MPI, MPICH/Hydra and PMI, PMIx): each rank picks
       a free port on its host (`KDIST_TF_HOST`, else the host name) and the
       ranks exchange their `host:port` with `allgather`.

    SLURM and MPI clusters get a `SimpleClusterResolver` that also reports
    this node's GPUs (TensorFlow would otherwise run a non-TF_CONFIG cluster
    on the CPU). When `srun` starts MPI ranks, the SLURM layout is used.

    Args:
        environ: the environment to read (default: `os.environ`).
        allgather: for MPI launchers, `allgather(obj)` returning every
            rank's object in rank order (default: `kdist.allgather_object`).

    Returns:
        The resolver, or None for a single process.

    Raises:
        ValueError: a malformed variable, named in the message (TF_CONFIG that
            is not a JSON object with a "cluster", a bad SLURM node list...).

    >>> resolve_cluster({}) is None
    True
    """
    import tensorflow as tf

    resolvers = tf.distribute.cluster_resolver
    if environ is None and os.environ.get("TF_CONFIG"):
        parse_tf_config(os.environ["TF_CONFIG"])  # clear errors before TensorFlow's
        return resolvers.TFConfigClusterResolver()
    spec = cluster_spec_from_environ(environ, allgather)
    if spec is None:
        return None
    gpus = len(tf.config.list_physical_devices("GPU"))
    task = spec.get("task", {})
    return resolvers.SimpleClusterResolver(
        tf.train.ClusterSpec(spec["cluster"]), task_type=task.get("type"),
        task_id=task.get("index"), rpc_layer="grpc",
        num_accelerators={"GPU": gpus} if gpus else None)
