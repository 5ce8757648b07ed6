"""The alpha-beta cost model and the layout planner (`kdist plan`): arithmetic that the
docs' predictions and users' choices rest on."""

import json
import math

import pytest

from kdist import cli
from kdist.distribute import cost_model, planner
from kdist.distribute.cost_model import Link

GBIT = Link.from_gbit(1, latency_us=50)


def test_ring_and_tree_allreduce_follow_their_formulas():
    link = Link(latency=1e-5, bandwidth=1e9)
    n = 8e6
    # Ring on 4 ranks: 6 latencies, each rank sends and receives 2 * 3/4 of the bytes.
    assert cost_model.allreduce_time(n, 4, link) == pytest.approx(6e-5 + 1.5 * n / 1e9)
    # Tree: reduce then broadcast the whole buffer, 2 levels for 4 ranks.
    assert cost_model.allreduce_time(n, 4, link, "tree") == pytest.approx(4 * (1e-5 + n / 1e9))
    assert cost_model.allreduce_time(n, 1, link) == 0.0
    # For large messages the ring's bandwidth term stays below twice the bytes; the
    # tree's grows with the ranks: the ring wins as ranks are added.
    assert (cost_model.allreduce_time(n, 64, link)
            < cost_model.allreduce_time(n, 64, link, "tree") / 5)


def test_a_reduction_rate_adds_the_reducing_time():
    slow = Link(latency=0, bandwidth=1e9, reduce_rate=1e9)
    fast = Link(latency=0, bandwidth=1e9)
    extra = cost_model.allreduce_time(1e6, 2, slow) - cost_model.allreduce_time(1e6, 2, fast)
    assert extra == pytest.approx(0.5 * 1e6 / 1e9)


def test_hierarchical_allreduce_keeps_bytes_off_a_slow_network():
    network, memory = Link.from_gbit(10, 10), planner.SHARED_MEMORY
    flat = cost_model.allreduce_time(100e6, 32, network)
    two_level = cost_model.hierarchical_allreduce_time(100e6, 8, 4, network, memory)
    assert two_level < flat / 2


def test_buckets_overlap_the_backward_pass_but_not_the_last_one():
    link = Link(latency=0, bandwidth=1e8)
    compute, grads = 0.3, 10e6  # 0.1 s of allreduce on 2 ranks
    one = cost_model.data_parallel_step(compute, grads, 2, link, bucket_bytes=grads, overlap=1)
    assert one == pytest.approx(0.4)  # a single bucket travels after the backward pass
    ten = cost_model.data_parallel_step(compute, grads, 2, link, bucket_bytes=1e6, overlap=1)
    assert ten == pytest.approx(0.3 + 0.01)  # only the last bucket shows
    half = cost_model.data_parallel_step(compute, grads, 2, link, bucket_bytes=1e6, overlap=0.5)
    assert half == pytest.approx(0.3 + 0.1 - 0.5 * 0.09)
    assert cost_model.bucket_sizes(10, 4) == [4, 4, 2]
    # Where the core copies at the link's rate, nothing is waiting and nothing hides.
    copying = cost_model.data_parallel_step(compute, grads, 2, link, bucket_bytes=1e6,
                                            overlap=1, copy_rate=link.bandwidth)
    assert copying == pytest.approx(0.4)
    # kdist's own work per bucket is on the core: ten buckets pay it ten times.
    costly = cost_model.data_parallel_step(compute, grads, 2, link, bucket_bytes=1e6,
                                           overlap=1, per_bucket=0.002)
    assert costly == pytest.approx(0.31 + 10 * 0.002)
    with pytest.raises(ValueError, match="per_bucket"):
        cost_model.data_parallel_step(compute, grads, 2, link, per_bucket=-1)


def test_fit_link_recovers_latency_and_bandwidth_and_refuses_bad_data():
    link = Link(latency=30e-6, bandwidth=3e8)
    sizes = [2**16, 2**20, 2**24]
    fitted = cost_model.fit_link(sizes, [cost_model.allreduce_time(s, 4, link) for s in sizes], 4)
    assert fitted.latency == pytest.approx(30e-6, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(3e8, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct sizes"):
        cost_model.fit_link([1e6, 1e6], [0.1, 0.1], 2)
    with pytest.raises(ValueError, match="do not grow"):
        cost_model.fit_link([1e6, 2e6], [0.2, 0.1], 2)


def test_the_other_layouts_steps():
    # A master serving 8 workers carries 8 pushes and 8 pulls.
    assert cost_model.parameter_server_step(0.01, 1e6, 8, Link(0, 1e9)) == pytest.approx(0.016)
    assert cost_model.gossip_step(0.1, 1e6, 2, Link(0, 1e9)) == pytest.approx(0.102)
    # GPipe's bubble: 4 stages, 4 micro-batches, free links: 7 slots of 1/16.
    assert cost_model.pipeline_step(1.0, 4, 4, 0, Link(0, 1e12)) == pytest.approx(7 / 16)
    split = cost_model.tensor_parallel_step(1.0, 4, 2, 1e6, Link(0, 1e9))
    assert split == pytest.approx(0.25 + 4 * cost_model.allreduce_time(1e6, 4, Link(0, 1e9)))


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="bandwidth"):
        Link(latency=0, bandwidth=0)
    with pytest.raises(ValueError, match="algorithm"):
        cost_model.allreduce_time(1, 2, GBIT, "butterfly")
    with pytest.raises(ValueError, match="overlap"):
        cost_model.data_parallel_step(1, 1, 2, GBIT, overlap=2)
    with pytest.raises(ValueError, match="ranks must be a whole number"):
        cost_model.allreduce_time(1, 2.5, GBIT)
    with pytest.raises(ValueError, match="parameters"):
        planner.Workload(parameters=-1, step_seconds=1, batch_per_rank=1)


def test_a_fast_network_keeps_plain_data_parallelism_near_perfect():
    work = planner.Workload(parameters=1e6, step_seconds=0.5, batch_per_rank=64)
    layouts = planner.plan(work, planner.Cluster(nodes=8, per_node=1,
                                                 inter=Link.from_gbit(100, 2)))
    best = layouts[0]
    assert best.layout.startswith("data") and best.efficiency > 0.98
    assert [l.samples_per_second for l in layouts] == sorted(
        (l.samples_per_second for l in layouts), reverse=True)


def test_a_slow_network_favours_fewer_bytes_and_larger_batches():
    work = planner.Workload(parameters=25e6, step_seconds=0.2, batch_per_rank=32)
    cluster = planner.Cluster(nodes=4, per_node=1, inter=GBIT)
    layouts = {l.layout: l for l in planner.plan(work, cluster)}
    assert layouts["data, fp16 gradients"].step_seconds < layouts["data"].step_seconds
    assert layouts["data"].efficiency < 0.5
    batch = planner.batch_for_efficiency(work, cluster, target=0.8)
    assert batch is not None and batch > 32
    bigger = planner.Workload(parameters=25e6, step_seconds=0.2 * batch / 32,
                              batch_per_rank=batch)
    assert planner.plan(bigger, cluster)[0].efficiency >= 0.8


def test_the_chosen_bucket_size_splits_a_large_model_to_overlap():
    work = planner.Workload(parameters=100e6, step_seconds=1.0, batch_per_rank=32)
    cluster = planner.Cluster(nodes=16, per_node=1, inter=Link.from_gbit(25, 5))
    data = next(l for l in planner.plan(work, cluster) if l.layout == "data")
    bucket = data.settings["bucket_bytes"]
    assert bucket < work.gradient_bytes / 2  # several buckets, so that they overlap
    one_bucket = cost_model.data_parallel_step(1.0, 400e6, 16, cluster.inter,
                                               bucket_bytes=2**29)
    assert data.step_seconds < one_bucket


def test_a_model_too_big_for_one_rank_is_split():
    work = planner.Workload(parameters=2e9, step_seconds=4.0, batch_per_rank=8,
                            activation_bytes_per_sample=4e6, layers=32)
    cluster = planner.Cluster(nodes=64, per_node=8, inter=Link.from_gbit(200, 5),
                              memory_bytes=16e9)
    layouts = planner.plan(work, cluster)
    assert layouts and all(l.layout.startswith(("pipeline", "tensor")) for l in layouts)
    for layout in layouts:
        split = layout.settings.get("stages") or layout.settings.get("ways")
        assert 2e9 * 16 / split <= 16e9
    no_activations = planner.Workload(parameters=2e9, step_seconds=4.0, batch_per_rank=8)
    with pytest.raises(ValueError, match="No layout fits"):
        planner.plan(no_activations, cluster)


def test_kdist_plan_prints_a_recommendation_and_json(capsys):
    args = ["plan", "--parameters", "25e6", "--step-ms", "200", "--batch", "32", "--nodes",
            "4", "--gbit", "1", "--latency-us", "50"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "Recommended: data, fp16 gradients" in text and "bucket_bytes=" in text
    assert cli.main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    steps = [l["step_seconds"] for l in report["layouts"]]
    assert steps[0] == min(steps) and all(math.isfinite(s) for s in steps)
    assert report["batch_per_rank_for_efficiency_0.8"] > 32
    with pytest.raises(SystemExit, match="kdist plan: .*parameters"):
        cli.main(["plan", "--parameters", "0", "--step-ms", "1", "--batch", "1"])
    chosen = report["layouts"][0]["settings"]["bucket_bytes"]
    assert f"Buckets: export KDIST_BUCKET_BYTES={chosen}" in text
    with pytest.raises(SystemExit, match="--measure measures the link; leave out --gbit"):
        cli.main(args + ["--measure"])
    with pytest.raises(SystemExit, match="--measure needs 2 or more ranks"):
        cli.main(args[:-4] + ["--measure"])


def test_the_cost_of_each_bucket_makes_the_planner_choose_fewer_buckets():
    work = planner.Workload(parameters=25e6, step_seconds=0.2, batch_per_rank=32)
    link = Link.from_gbit(10, 10)

    def bucket(per_bucket):
        cluster = planner.Cluster(nodes=4, per_node=1, inter=link, per_bucket=per_bucket)
        layouts = {l.layout: l for l in planner.plan(work, cluster)}
        return layouts["data"].settings["bucket_bytes"], layouts["data"].step_seconds

    (free, free_step), (costly, costly_step) = bucket(0.0), bucket(0.02)
    assert costly > free and costly_step > free_step
    with pytest.raises(ValueError, match="per_bucket"):
        planner.Cluster(nodes=1, per_node=1, inter=link, per_bucket=-1e-3)


def test_the_cluster_guides_plan_is_what_kdist_plan_prints(capsys):
    import pathlib
    import re
    import shlex

    page = (pathlib.Path(__file__).parent.parent / "docs" / "cluster.md").read_text()
    command, shown = re.search(r"```sh\n(kdist plan [^\n]*)\n```\n\n```text\n(.*?)```",
                               page, re.S).groups()
    assert cli.main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out
    assert shown.strip() in printed


MEASURE_AND_BUCKET = """
import contextlib, io
import tensorflow as tf
import kdist
from kdist import cli
from kdist.comm.tensors import TensorReducer
from workers.common import report

printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    code = cli.main(["plan", "--measure", "--parameters", "1e6", "--step-ms", "20",
                     "--batch", "32", "--json"])
reducer = TensorReducer()  # KDIST_BUCKET_BYTES=4096: 1 KiB tensors, four to a bucket
tensors = [tf.fill([256], float(kdist.rank() + i)) for i in range(10)]
summed = reducer(tensors)
report({"code": code, "printed": printed.getvalue(), "buckets": reducer.plans[0],
        "bucket_bytes": reducer.bucket_bytes,
        "sums": [float(t[0]) for t in summed]})
"""


@pytest.mark.mpi
def test_measure_plans_with_the_link_between_the_ranks_and_the_bucket_setting_is_read(
        mpirun):
    job = mpirun(MEASURE_AND_BUCKET, n=2, env={"KDIST_BUCKET_BYTES": "4096"})
    # Both ranks on this one machine: the plan says the link is partly within a node.
    assert "some ranks share a node" in job.output
    zero, one = job.rank(0), job.rank(1)
    assert zero["code"] == one["code"] == 0
    assert one["printed"] == "", "only rank 0 prints the plan"
    plan = json.loads(zero["printed"])
    assert plan["link"]["measured"] and plan["link"]["gbit"] > 0
    assert plan["layouts"] and plan["layouts"][0]["step_seconds"] > 0
    for rank in (zero, one):
        assert rank["bucket_bytes"] == 4096
        # Backpropagation order: the last tensors first, at most four 1 KiB tensors each.
        assert rank["buckets"] == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
        assert rank["sums"] == [pytest.approx(i + 0.5) for i in range(10)]  # averaged


def test_a_bad_bucket_setting_is_refused_by_name(monkeypatch):
    from kdist.comm.tensors import TensorReducer

    monkeypatch.setenv("KDIST_BUCKET_BYTES", "4MB")
    with pytest.raises(ValueError, match="KDIST_BUCKET_BYTES must be a positive whole number"):
        TensorReducer()
    monkeypatch.setenv("KDIST_BUCKET_BYTES", "65536")
    assert TensorReducer().bucket_bytes == 65536
    assert TensorReducer(bucket_bytes=1024).bucket_bytes == 1024  # an argument wins

