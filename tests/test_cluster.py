"""Cluster resolution for the TensorFlow multi-worker path, from fake environments."""

import json

import pytest

from kdist.distribute import cluster

SLURM_STEP = {
    "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "node02",
}


def never_called(address):
    raise AssertionError("no address exchange expected")


def test_tf_config_is_parsed_and_checked():
    config = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    assert cluster.cluster_spec_from_environ({"TF_CONFIG": json.dumps(config)}) == config
    with pytest.raises(ValueError, match="not valid JSON"):
        cluster.parse_tf_config("{cluster")
    with pytest.raises(ValueError, match='needs a "cluster"'):
        cluster.parse_tf_config('{"task": {"type": "worker", "index": 0}}')
    with pytest.raises(ValueError, match="not in its cluster"):
        cluster.parse_tf_config('{"cluster": {"worker": ["a:1"]}, '
                                '"task": {"type": "worker", "index": 1}}')


def test_no_launcher_means_no_cluster():
    assert cluster.cluster_spec_from_environ({}) is None
    assert cluster.resolve_cluster({"PATH": "/usr/bin"}) is None


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("n[8-10,12]", ["n8", "n9", "n10", "n12"]),
    ("c[1-2]-ib", ["c1-ib", "c2-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("login", ["login"]),
])
def test_slurm_node_lists_expand_like_scontrol(nodelist, hosts):
    assert cluster.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["a[1-", "a]1", "a,,b", "a[3-1]", "a[x]"])
def test_bad_node_lists_are_named(nodelist):
    with pytest.raises(ValueError, match="SLURM node list"):
        cluster.expand_nodelist(nodelist)


def test_tasks_per_node():
    assert cluster.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="tasks-per-node"):
        cluster.expand_tasks_per_node("2x3")


def test_slurm_step_lays_tasks_out_in_block_order():
    spec = cluster.cluster_spec_from_environ(SLURM_STEP, allgather=never_called)
    base = 8888 + 100 * (1234 % 500)
    assert spec == {"cluster": {"worker": [f"node01:{base}", f"node01:{base + 1}",
                                           f"node02:{base}", f"node02:{base + 1}"]},
                    "task": {"type": "worker", "index": 3}}


def test_slurm_port_base_from_kdist_tf_port_and_job_level_fallbacks():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "3",
           "SLURM_JOB_NODELIST": "a,b[1-2]", "KDIST_TF_PORT": "9000"}
    spec = cluster.cluster_spec_from_environ(env)
    assert spec["cluster"]["worker"] == ["a:9000", "b1:9000", "b2:9000"]
    with pytest.raises(ValueError, match="KDIST_TF_PORT"):
        cluster.cluster_spec_from_environ(dict(env, KDIST_TF_PORT="70000"))
    with pytest.raises(ValueError, match="KDIST_TF_PORT must be an integer"):
        cluster.cluster_spec_from_environ(dict(env, KDIST_TF_PORT="http"))


def test_slurm_batch_script_alone_is_a_single_process():
    # sbatch's script has SLURM_PROCID and SLURM_NTASKS but no step: it is one process.
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert cluster.cluster_spec_from_environ(env) is None
    assert cluster.cluster_spec_from_environ(dict(SLURM_STEP, SLURM_STEP_NUM_TASKS="1",
                                                  SLURM_PROCID="0")) is None


def test_slurm_inconsistencies_are_explained():
    with pytest.raises(ValueError, match="does not add up"):
        cluster.cluster_spec_from_environ(dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="1,2"))
    with pytest.raises(ValueError, match="block task distribution"):
        # Cyclic distribution runs task 2 as node01's second task; block order
        # would have it first on node02.
        cluster.cluster_spec_from_environ(dict(SLURM_STEP, SLURM_PROCID="2",
                                               SLURM_LOCALID="1", SLURMD_NODENAME="node01"))


def test_mpi_ranks_exchange_addresses():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "KDIST_TF_HOST": "h1"}
    offered = []

    def allgather(address):
        offered.append(address)
        return ["h0:4000", address]

    spec = cluster.cluster_spec_from_environ(env, allgather=allgather)
    host, port = offered[0].split(":")
    assert host == "h1" and 0 < int(port) < 65536
    assert spec == {"cluster": {"worker": ["h0:4000", offered[0]]},
                    "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize("env,index", [
    ({"PMI_RANK": "2", "PMI_SIZE": "3"}, 2),  # MPICH, Hydra, Intel MPI
    ({"PMIX_RANK": "0"}, 0),  # PMIx: the size comes from the exchange
])
def test_pmi_and_pmix_ranks(env, index):
    gathered = {}

    def allgather(address):
        gathered["all"] = [f"h{i}:1" for i in range(3)]
        gathered["all"][index] = address
        return gathered["all"]

    spec = cluster.cluster_spec_from_environ(dict(env, KDIST_TF_HOST="x"), allgather=allgather)
    assert spec["task"]["index"] == index
    assert spec["cluster"]["worker"] == gathered["all"]


def test_mpi_exchange_is_checked_and_one_rank_is_no_cluster():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match="2 ranks"):
        cluster.cluster_spec_from_environ(env, allgather=lambda address: [address])
    with pytest.raises(ValueError, match="index 0"):
        cluster.cluster_spec_from_environ(env, allgather=lambda address: ["a:1", "b:1"])
    single = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert cluster.cluster_spec_from_environ(single, allgather=never_called) is None


def test_srun_started_mpi_ranks_use_the_slurm_layout():
    env = dict(SLURM_STEP, PMI_RANK="3", PMI_SIZE="4")
    spec = cluster.cluster_spec_from_environ(env, allgather=never_called)
    assert spec["task"]["index"] == 3 and spec["cluster"]["worker"][0].startswith("node01:")


def test_mpiexec_inside_an_allocation_exchanges_addresses():
    # The batch step's SLURM variables say task 0; Open MPI says rank 1.
    env = dict(SLURM_STEP, SLURM_PROCID="0", OMPI_COMM_WORLD_RANK="1",
               OMPI_COMM_WORLD_SIZE="2", KDIST_TF_HOST="me")
    spec = cluster.cluster_spec_from_environ(env, allgather=lambda address: ["a:1", address])
    assert spec["task"]["index"] == 1 and spec["cluster"]["worker"][1].startswith("me:")


def test_resolve_cluster_gives_tensorflow_a_resolver():
    resolver = cluster.resolve_cluster(SLURM_STEP)
    assert resolver.task_type == "worker" and resolver.task_id == 3
    assert resolver.rpc_layer == "grpc"
    assert len(resolver.cluster_spec().as_dict()["worker"]) == 4


def test_resolve_cluster_prefers_tensorflows_tf_config_resolver(monkeypatch):
    import tensorflow as tf

    config = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    resolver = cluster.resolve_cluster()
    assert isinstance(resolver, tf.distribute.cluster_resolver.TFConfigClusterResolver)
    assert resolver.cluster_spec().as_dict() == config["cluster"]
