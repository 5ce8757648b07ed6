"""The benchmark scripts still run and print the JSON that the pages of docs/lab/ quote."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

# Every benchmark script runs here; the long ones (whole comparisons of several jobs)
# only with --slow.
pytestmark = pytest.mark.mpi
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _json_from(output):
    """The first JSON object in the output (whatever follows it is ignored)."""
    return json.JSONDecoder().raw_decode(output[output.index("{"):])[0]


def test_allreduce_fusion_benchmark_prints_ratios(mpirun):
    job = mpirun(os.path.join(ROOT, "benchmarks", "allreduce_fusion.py"), n=2,
                 env={"REPEATS": "5"})
    result = _json_from(job.output)
    assert result["gradient_tensors"] == 6 and result["megabytes"] == pytest.approx(2.679, 1e-3)
    assert set(result["ratio_to_raw"]) == {"raw_mpi4py", "kdist_numpy", "kdist_in_graph",
                                           "kdist_in_graph_py_function"}


def test_custom_loop_benchmark_times_ways_that_reduce_to_the_same_gradients(mpirun):
    job = mpirun(os.path.join(ROOT, "benchmarks", "custom_loop.py"), n=2,
                 args=["--layers", "2", "--width", "32", "--steps", "5", "--rounds", "1"])
    result = _json_from(job.output)
    assert result["tensors"] == 6 and result["ranks"] == 2
    assert set(result["step_ms"]) == {"local", "per_tensor", "per_tensor_unfused", "grouped",
                                      "tape"}
    zero, one = result["gradient_sum_per_rank"]
    # Each rank's data differ: its local gradients too, and every reduction averages them.
    assert zero["local"] != pytest.approx(one["local"], rel=1e-3)
    average = (zero["local"] + one["local"]) / 2
    for way in ("per_tensor", "per_tensor_unfused", "grouped", "tape"):
        assert zero[way] == pytest.approx(average, rel=1e-4, abs=1e-5), way
        assert one[way] == zero[way], way


def test_step_overhead_benchmark_compares_the_overhead_with_the_raw_allreduce(mpirun):
    job = mpirun(os.path.join(ROOT, "benchmarks", "step_overhead.py"), n=2,
                 args=["--optimizers", "sgd", "--widths", "64", "--rounds", "2", "--steps", "8",
                       "--timeline"])
    result = _json_from(job.output)
    assert result["model"].startswith("MLP 784-64-64-10") and result["optimizer"] == "sgd"
    assert len(result["rounds"]) == 2
    median = result["median"]
    assert median["raw_allreduce_ms"] > 0 and median["plain_ms"] > 0
    # The timeline splits each kdist step's reduction into its phases: the benchmark
    # really reduced through kdist.
    assert {"negotiate", "pack", "allreduce"} <= set(result["phase_ms_per_step"])


def test_overlap_benchmark_times_models_that_train_identically(mpi_job):
    """Its own job: the benchmark sets TensorFlow's thread counts, which only a new process
    accepts.
    """
    job = mpi_job(os.path.join(ROOT, "benchmarks", "overlap.py"), n=2,
                  args=["--width", "128", "--depth", "3", "--batch", "32", "--bucket-mb", "0.06",
                        "--rounds", "2", "--steps", "4"])
    result = _json_from(job.output)
    # Several buckets, so that overlapping has something to overlap.
    assert result["buckets"] >= 3 and len(result["rounds"]) == 2
    # Serial and overlapping reductions of the same steps give the same bytes, on every
    # rank: a benchmark whose models skipped or garbled a reduction would not.
    assert result["weights_serial_vs_overlap_max_difference"] == 0.0
    assert result["weights_across_ranks_max_difference"] == 0.0


@pytest.mark.slow
def test_fault_matrix_benchmark_reports_each_case_and_the_totals(mpiexec_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "faults.py"), "--ranks", "2",
         "--faults", "kill", "--modes", "elastic", "--epochs", "2", "--timeout", "150"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    case, totals = lines[0], lines[-1]
    assert (case["mode"], case["fault"], case["ranks"]) == ("elastic", "kill", 2)
    assert case["ended"] and case["outcome"] == "finished" and case["final_size"] == 1
    assert case["batches_lost"] >= 0 and case["corrupt_checkpoints"] == 0
    assert totals == {"benchmark": "faults", "cases": 1, "hangs": 0, "corrupt_checkpoints": 0,
                      "finished": 1}


def test_host_fault_matrix_benchmark_tells_why_a_job_ended_and_tabulates_it():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "host_faults", os.path.join(ROOT, "benchmarks", "host_faults.py"))
    host_faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_faults)
    noise = "I0000 00:00:1796602842.229911    4437 cudart_stub.cc:31] Could not find cuda"
    verdict = "kdist run: exit status 1: rank 1 was killed by SIGKILL on host h1."
    assert host_faults._why(["[kdist 0] WARNING 1 rank(s) lost; carrying on with 1",
                             verdict, noise]) == verdict
    assert host_faults._why([noise, "[1] " + noise]) == ""
    # The mpiexec column runs Open MPI's launcher as a user types it.
    assert host_faults._without(["mpiexec", "-n", "2", "a", "b", "x"], ("a", "b")) == \
        ["mpiexec", "-n", "2", "x"]
    assert host_faults._without(["mpiexec", "x"], ("a", "b")) == ["mpiexec", "x"]
    # A launcher's banner may carry control characters; the table must stay readable.
    assert host_faults._why(["Errorcode: 0\x00\x1b"]) == "Errorcode: 0"
    row = {"hosts": 2, "fault": "link_down", "launcher": "mpiexec", "mode": "plain",
           "seconds": 180.0, "hung": True, "exit_status": None, "finished": [],
           "ranks_agree": True, "checkpoints": 2, "corrupt_checkpoints": 0, "why": "a|b"}
    line = host_faults.table([row]).splitlines()[-1]
    assert line == ("| 2 | link_down | mpiexec | plain | hung, ended at 180.0 | - | none | yes "
                    "| 0 of 2 | a/b |")


@pytest.mark.slow  # the whole-host tests of tests/test_hosts.py check what a cell shows
def test_host_fault_matrix_benchmark_reports_a_cell_and_the_totals(mpiexec_path):
    import emulated_hosts

    why_not = emulated_hosts.available()
    if why_not:
        pytest.skip(why_not)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "host_faults.py"), "--hosts", "2",
         "--faults", "kill_rank", "--launchers", "kdist_run", "--modes", "elastic",
         "--epochs", "40", "--at", "30", "--timeout", "200"],
        capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    cell, totals = lines[0], lines[-1]
    assert (cell["hosts"], cell["fault"], cell["launcher"], cell["mode"]) == (
        2, "kill_rank", "kdist_run", "elastic")
    # The second host's rank is lost; rank 0 finishes alone and the run says so.
    assert not cell["hung"] and cell["exit_status"] == 0 and cell["finished"] == [0], cell
    assert cell["why"].startswith("kdist run: exit status 0: rank 0 ended cleanly; rank 1 "), cell
    assert "| 2 | kill_rank | kdist_run | elastic |" in done.stdout
    assert totals == {"cells": 1, "hung": 0, "failed_but_exit_0": 0, "corrupt_checkpoints": 0,
                      "ranks_disagree": 0}


@pytest.mark.slow
def test_weak_scaling_benchmark_compares_all_cases_in_one_run(mpiexec_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "weak_scaling.py"), "--rounds", "1",
         "--steps", "60", "--modes", "kdist,mpi_strategy"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    modes = {"single", "kdist", "mpi_strategy"}
    assert set(result["ms_per_step"]) == modes
    assert set(result["efficiency"]) == modes - {"single"}
    assert set(result["slowest_over_fastest"]) == modes
    # The data-parallel modes' ranks end identical; one process has nothing to agree on.
    agreement = result["weights_across_ranks_max_difference"]
    assert agreement["kdist"] == 0.0 and agreement["mpi_strategy"] == 0.0
    assert agreement["single"] is None


@pytest.mark.slow
def test_shared_cores_benchmark_sets_four_ranks_beside_two_in_one_run(mpiexec_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "shared_cores.py"), "--rounds", "1",
         "--steps", "60"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    four = {"four_without_communication", "four_ranks", "four_ranks_yielding"}
    assert set(result["ms_per_step"]) == four | {"two_ranks"}
    assert set(result["ratio_to_two_ranks"]) == four
    assert set(result["communication_over_floor"]) == {"four_ranks", "four_ranks_yielding"}
    assert all(value > 0 for value in result["ratio_to_two_ranks"].values())


@pytest.mark.slow
def test_ps_throughput_benchmark_compares_each_mode_with_the_add_bound(mpirun):
    job = mpirun(os.path.join(ROOT, "benchmarks", "ps_throughput.py"), n=3,
                 args=["--sizes", "100000", "--seconds", "0.2", "--servers", "2"])
    result = _json_from(job.output)
    assert result["workers"] == 1 and result["servers"] == 2
    assert [(case["transport"], case["mode"]) for case in result["cases"]] == [
        (transport, mode) for transport in ("shared", "messages")
        for mode in ("downpour", "easgd", "gem")]
    for case in result["cases"]:
        assert case["parameters"] == 100000
        assert case["shared_children"] == (1 if case["transport"] == "shared" else 0)
        assert len(case["server_cpu_seconds"]) == 2
        assert sum(case["staleness_histogram"].values()) == case["updates"] > 0
        for rate in ("updates_per_second", "updates_per_cpu_second"):
            assert set(case[f"{rate}_fraction_of"]) == {"add", "cold_add", "copy"}
            assert all(value > 0 for value in case[f"{rate}_fraction_of"].values())


@pytest.mark.slow
def test_ps_convergence_benchmark_reports_each_method_against_the_target(mpiexec_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ps_convergence.py"), "--workers",
         "2", "--epochs", "1", "--target", "0.5", "--methods", "allreduce,gem", "--task",
         "teacher"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    assert set(result["methods"]) == {"allreduce", "gem"}
    for method in result["methods"].values():
        assert len(method["epochs"]) == 1 and method["to_target"]["updates"] > 0


@pytest.mark.slow
def test_gan_throughput_benchmark_compares_ranks_and_the_parameter_server(mpiexec_path):
    pytest.importorskip("h5py")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gan_throughput.py"), "--models",
         "small", "--steps", "1", "--batch", "2", "--ps-modes", "easgd", "--ps-ranks", "3"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    small = result["models"]["small"]
    assert set(small["showers_per_s"]) == {"1", "2"}
    assert all(rate > 0 for rate in small["showers_per_s"].values())
    assert small["scaling"] == pytest.approx(small["showers_per_s"]["2"]
                                             / small["showers_per_s"]["1"])
    # Two workers beside a master: their own rates add up, every update is
    # in the staleness histogram, and the comparison is with two sync ranks.
    ps = small["ps"]["easgd"]
    assert set(ps) == {"2", "vs_sync"}
    run = ps["2"]
    assert len(run["worker_showers_per_s"]) == 2 and min(run["worker_showers_per_s"]) > 0
    assert run["showers_per_s"] == pytest.approx(sum(run["worker_showers_per_s"]))
    assert run["updates"] >= 2 * 3 and 0 < run["master_busy"] < 1 and run["master_cpu"] > 0
    assert sum(run["staleness_histogram"].values()) == run["updates"]
    assert ps["vs_sync"] == pytest.approx(run["showers_per_s"] / small["showers_per_s"]["2"])


@pytest.mark.slow
def test_tfmot_guides_benchmark_runs_each_guide_with_both_libraries():
    from importlib.util import find_spec

    if find_spec("tensorflow_model_optimization") is None:
        pytest.skip("needs tensorflow-model-optimization")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "tfmot_guides.py"), "--seeds", "1",
         "--rows", "1200", "--test-rows", "100", "--baseline-epochs", "1"],
        capture_output=True, text=True, timeout=500, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    (run,) = result["runs"]
    for lib in ("kdist", "tfmot"):
        assert set(run[lib]) == {"pruning", "qat", "pqat"}
        assert 0 < run[lib]["qat"]["tflite_accuracy"] <= 1
        # 1,080 images at batch 128 give 9 steps: no pruning turn (every 100) comes.
        assert run[lib]["pqat"]["sparsity"] == run[lib]["pqat"]["pruned_sparsity"] == 0
    row = result["summary"]["qat"]["accuracy"]
    assert row["kdist_minus_tfmot"] == pytest.approx(row["kdist"] - row["tfmot"])
    assert result["summary"]["qat"]["accuracy_within_0.01"] == (
        abs(row["kdist_minus_tfmot"]) <= 0.01
        and abs(result["summary"]["qat"]["tflite_accuracy"]["kdist_minus_tfmot"]) <= 0.01)


@pytest.mark.slow
def test_sparsity_benchmark_compares_kdist_with_tfmot():
    from importlib.util import find_spec

    if find_spec("tensorflow_model_optimization") is None:  # importing it would set
        pytest.skip("needs tensorflow-model-optimization")  # TF_USE_LEGACY_KERAS here
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sparsity.py"), "--seeds", "1",
         "--epochs", "1", "--pretrain-epochs", "1", "--rows", "2000", "--sparsities", "0.5",
         "--bits", "8,4"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    (run,) = result["runs"]
    assert set(run["kdist"]) == {"dense", "pruned@0.5", "qat8", "fixed8", "qat4", "fixed4"}
    assert set(run["tfmot"]) == {"dense", "pruned@0.5", "qat8", "qat4"}
    for lib in ("kdist", "tfmot"):
        assert all(0.0 < accuracy <= 1.0 for accuracy in run[lib].values())
    table = result["summary"]["table"]
    assert table["qat4"]["kdist"]["drop_points"] == pytest.approx(
        100 * (run["kdist"]["dense"] - run["kdist"]["qat4"]), abs=0.01)
    # Weights counted at their width: 8 bits is a quarter of float, 4 bits an eighth at most.
    dense = table["dense"]["kdist"]["weight_bytes"]
    assert table["qat8"]["kdist"]["weight_bytes"] <= dense / 4
    assert table["fixed4"]["kdist"]["weight_bytes"] <= dense / 8
    if "hgq2" in run:
        assert set(run["hgq2"]) == {"qat8", "qat4"}
    pruned = result["summary"]["pruned@0.5"]
    assert pruned["kdist_drop_points"] == pytest.approx(
        100 * (run["kdist"]["dense"] - run["kdist"]["pruned@0.5"]))
    assert pruned["target_met"] == (pruned["kdist_drop_points"]
                                    <= pruned["tfmot_drop_points"] + 0.5)


@pytest.mark.slow
def test_hpo_groups_benchmark_times_one_and_two_groups(mpiexec_path):
    pytest.importorskip("keras_tuner")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "hpo_groups.py"), "--trials", "2",
         "--epochs", "1"], capture_output=True, text=True, timeout=400,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    result = _json_from(done.stdout)
    assert result["completed"] == {"1_group": 2, "2_groups": 2}
    assert result["ratio"] == pytest.approx(result["seconds"]["2_groups"]
                                            / result["seconds"]["1_group"])


@pytest.mark.slow
def test_hpo_budget_benchmark_counts_epochs_against_hyperbands(tmp_path):
    pytest.importorskip("keras_tuner")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "hpo_budget.py"), "--seeds", "1",
         "--max-epochs", "2", "--factor", "2", "--methods", "kdist_bohb,kt_random"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    assert result["budget_epochs"] == 7  # 2 x 1 + 1 x 1 more (bracket 1), then 2 x 2 (bracket 0)
    for method in ("kt_hyperband", "kdist_bohb", "kt_random"):
        (run,) = result["runs"][method]
        epochs = [spent for spent, _ in run["trajectory"]]
        best = [accuracy for _, accuracy in run["trajectory"]]
        assert epochs == sorted(epochs) and epochs[-1] == run["epochs"] <= 7
        assert best == sorted(best) and best[-1] == run["best_accuracy"]
    hyperband = result["runs"]["kt_hyperband"][0]
    assert hyperband["epochs_to_hyperband_best"] <= hyperband["epochs"]
    assert result["seeds"] == [1]  # keras-tuner reads seed 0 as none
    assert set(result["summary"]["kdist_bohb"]["median_best_at_epochs"]) == {"1", "3", "5", "7"}
    assert set(result["targets"]["bohb_beats_random_at_epochs"]) == {"1", "3", "5", "7"}
    # A report merged from runs side by side summarises them as one run would.
    report = tmp_path / "seed1.json"
    report.write_text(json.dumps(result))
    merged = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "hpo_budget.py"), "--merge",
         str(report)], capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr[-3000:]
    merged = json.loads(merged.stdout)
    assert merged["summary"] == result["summary"] and merged["targets"] == result["targets"]


@pytest.mark.slow
def test_pbt_benchmark_spends_equal_epochs_and_replays_the_schedule(tmp_path):
    pytest.importorskip("keras_tuner")
    plot = tmp_path / "population.png"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "pbt.py"), "--seeds", "1",
         "--population", "2", "--max-epochs", "2", "--interval", "1", "--plot", str(plot),
         "--methods", "kdist_pbt,kdist_pb2,kt_random"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    assert result["budget_epochs"] == 4 and plot.stat().st_size > 1000
    for method in ("kdist_pbt", "kdist_pb2", "kt_random"):
        (run,) = result["runs"][method]
        assert run["epochs"] == 4
        best = [accuracy for _, accuracy in run["trajectory"]]
        assert best == sorted(best) and best[-1] == run["best_accuracy"]
        assert set(result["summary"][method]["median_best_at_epochs"]) == {"1", "2", "4"}
    (replayed,) = result["runs"]["replayed"]
    assert replayed["schedule"][0]["epoch"] == 0 and 0 < replayed["best_accuracy"] <= 1


def test_pbt_toy_rewards_only_a_rate_that_follows_the_progress():
    import argparse

    toy = _load_benchmark("pbt_toy")
    rng = np.random.default_rng(0)
    followed = 0.0
    for _ in range(300):
        followed = toy.train(followed, toy.ideal_rate(followed), 1, rng)
    # At the ideal every step gains 1 on average, past the wave's turn at 100 too.
    assert 250 < followed < 350
    fixed = [toy.train(0.0, rate, 300, rng) for rate in np.logspace(-5, -1, 21)]
    assert max(fixed) < 60  # a fixed rate stops where the ideal leaves it
    assert toy.train(0.0, 1e-2, 50, rng) == 0.0  # too high from the start: no progress

    # Every search spends the same steps, and each continues its parents' progress.
    args = argparse.Namespace(population=4, max_epochs=4, interval=2, steps_per_epoch=2)
    budget = 4 * 4 * 2
    for method in ("kdist_pbt", "kdist_pb2", "kt_random", "kdist_bohb"):
        with tempfile.TemporaryDirectory() as directory:
            progress, steps = toy.search(method, args, 1, directory)
        assert steps == budget and 0 <= progress <= 2 * 1.5 * 4, method
    assert toy.by_hand("best_cosine", args, 1)[1] == 41 * 4 * 2
    # The cosine by hand (here and in pbt.py) decays from its start to a hundredth.
    assert [toy.cosine_rate(step, 10, 2.0) for step in (0, 5, 10)] == pytest.approx(
        [2.0, 1.01, 0.02])
    import keras_tuner as kt

    with tempfile.TemporaryDirectory() as directory:
        oracle = kt.oracles.RandomSearchOracle(objective=kt.Objective("score", "max"))
        tuner = toy._tuner_class()(oracle, args, 0, directory=directory)
        tuner.progress["parent"] = 20.0
        round_ = kt.engine.trial.Trial(kt.HyperParameters(), trial_id="child")
        round_.hyperparameters.values = {"learning_rate": toy.ideal_rate(20.0),
                                         "tuner/trial_id": "parent",
                                         "tuner/initial_epoch": 2, "tuner/epochs": 3}
        tuner.run_trial(round_)
    assert tuner.steps == 2 and 20.0 < tuner.progress["child"] <= 23.0


def test_ray_pbt_benchmark_sets_rays_runs_beside_kdists_in_epochs():
    ray_pbt = _load_benchmark("ray_pbt")
    ray_runs = [{"seed": 0, "progress": 50.0, "epochs": 150},
                {"seed": 1, "progress": 70.0, "epochs": 160}]
    kdist_runs = {"kdist_pbt": [{"seed": 0, "progress": 60.0, "steps": 1600},
                                {"seed": 1, "progress": 40.0, "steps": 1600}]}
    result = ray_pbt.combine(ray_runs, kdist_runs, steps_per_epoch=10)
    assert result["runs"]["kdist_pbt"][1] == {"seed": 1, "progress": 40.0, "epochs": 160}
    assert result["summary"]["ray_pbt"] == {"median_progress": 60.0, "range": [50.0, 70.0],
                                            "median_epochs": 155.0}
    assert result["summary"]["kdist_pbt"]["median_epochs"] == 160


def test_hpo_budget_benchmark_trains_a_configuration_alike_in_every_method():
    import keras_tuner as kt

    module = _load_benchmark("hpo_budget")

    def weights(run_seed, **budget):
        hp = kt.HyperParameters()
        hp.values = dict({"filters": 8, "units": 16, "dropout": 0.1, "lr": 1e-3}, **budget)
        module.RUN_SEED[0] = run_seed
        return np.concatenate([w.ravel() for w in module.build(hp).get_weights()])

    first = weights(1)
    # The budget a tuner attaches does not change the model; the run's seed does.
    np.testing.assert_array_equal(first, weights(1, **{"tuner/epochs": 3,
                                                       "tuner/initial_epoch": 1}))
    assert not np.array_equal(first, weights(2))


def _load_benchmark(name):
    """A script of benchmarks/ as a module, to test its pieces without running it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hpo_test_functions_take_their_known_minima():
    import math

    hpo = _load_benchmark("hpo")
    for point in ((-math.pi, 12.275), (math.pi, 2.275), (9.42478, 2.475)):
        assert hpo.branin(point) == pytest.approx(0.397887, abs=1e-5)
    best = (0.20169, 0.150011, 0.476874, 0.275332, 0.311652, 0.6573)
    assert hpo.hartmann6(best) == pytest.approx(-3.32237, abs=1e-4)
    assert hpo.ackley([0.0] * 10) == pytest.approx(0.0, abs=1e-12)
    assert hpo.ackley([1.0] * 10) > 3


@pytest.mark.parametrize("steady,running_at_each_ask", [
    (False, [0, 1, 2, 0, 1, 2, 0]),  # rounds: three asked, then three told
    (True, [0, 1, 2, 2, 2, 2, 2]),   # steady: the oldest told, then one asked
])
def test_hpo_benchmark_asks_in_rounds_or_keeps_the_batch_running(steady, running_at_each_ask,
                                                                 monkeypatch):
    pytest.importorskip("keras_tuner")
    pytest.importorskip("optuna")
    hpo = _load_benchmark("hpo")
    seen, created, ended = [], [], []
    make_oracle = hpo.make_oracle

    def counting(*args):
        oracle = make_oracle(*args)
        create, end = oracle.create_trial, oracle.end_trial

        def create_trial(tuner_id):
            seen.append(sum(t.status == "RUNNING" for t in oracle.trials.values()))
            trial = create(tuner_id)
            created.append(trial.trial_id)
            return trial

        def end_trial(trial):
            ended.append(trial.trial_id)
            return end(trial)

        oracle.create_trial, oracle.end_trial = create_trial, end_trial
        return oracle

    monkeypatch.setattr(hpo, "make_oracle", counting)
    hpo.run_keras_tuner("kt_random", hpo.branin, [(-5.0, 10.0), (0.0, 15.0)], 7, 0, 3, steady)
    assert seen[:7] == running_at_each_ask
    assert ended == created[:7]  # the oldest running trial always ends first

    import optuna

    asked, told = [], []
    ask, tell = optuna.Study.ask, optuna.Study.tell
    monkeypatch.setattr(optuna.Study, "ask", lambda study, *a, **k: asked.append(sum(
        t.state == optuna.trial.TrialState.RUNNING for t in study.trials)) or ask(study, *a, **k))
    monkeypatch.setattr(optuna.Study, "tell", lambda study, trial, *a, **k: told.append(
        trial.number) or tell(study, trial, *a, **k))
    hpo.run_optuna(hpo.branin, [(-5.0, 10.0), (0.0, 15.0)], 7, 0, 3, steady=steady)
    assert asked == running_at_each_ask
    assert told == list(range(7))


@pytest.mark.slow
def test_hpo_benchmark_reports_median_regrets():
    pytest.importorskip("keras_tuner")
    pytest.importorskip("optuna")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "hpo.py"), "--seeds", "2",
         "--trials-scale", "0.2", "--methods", "kdist_bayesian,kdist_genetic,kt_random,"
         "optuna_tpe,optuna_tpe_no_liar", "--problems", "branin,ackley10", "--batches", "1,3"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    branin = result["problems"]["branin"]
    assert branin["trials"] == 6
    for method, regrets in branin["regrets"].items():
        assert len(regrets) == 2 and all(r >= -1e-6 and np.isfinite(r) for r in regrets)
        assert branin["median_regret"][method] == pytest.approx(float(np.median(regrets)))
    # Three proposals at a time spend the same budget (the script checks every run's
    # trial count); the top level is the first batch size's column.
    assert set(branin["by_batch"]) == {"1", "3"}
    assert branin["by_batch"]["1"]["regrets"] == branin["regrets"]
    assert set(branin["by_batch"]["3"]["regrets"]) == set(branin["regrets"])
    assert "kdist_bayesian" not in result["problems"]["ackley10"]["regrets"]  # skipped: slow
    assert result["targets"]["kdist_bayesian_hartmann6_le_0.10"] is None
    assert isinstance(result["targets"]["kdist_genetic_ackley10_le_half_random"], bool)


def test_core_placement_benchmark_samples_both_series(mpiexec_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "core_placement.py"), "--seconds",
         "0.5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    allreduce = result["allreduce_ms"]
    assert allreduce["windows"] >= 1 and 0 < allreduce["p10_ms"] <= allreduce["p90_ms"]
    trips = result["cache_line_round_trip_ns"]
    if isinstance(trips, dict):  # absent without a C compiler or a second core
        assert trips["windows"] >= 1 and 0 < trips["p10_ns"] <= trips["p90_ns"]


@pytest.mark.slow
def test_tflite_export_benchmark_compares_sizes_latency_and_accuracy():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "tflite_export.py"), "--epochs", "1",
         "--rows", "1500", "--calls", "50"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    models = result["models"]
    assert set(models) == {"dense/float", "dense/dynamic", "dense/int8", "qat/int8",
                           "pruned_qat/int8"}
    assert models["dense/float"]["io"] == ["float32", "float32"]
    for name in ("dense/int8", "qat/int8", "pruned_qat/int8"):
        assert models[name]["io"] == ["int8", "int8"]
        # int8 weights: about a quarter of the float flatbuffer
        assert models[name]["size_ratio"] < 0.4
        assert abs(models[name]["accuracy"] - models[name]["keras_accuracy"]) < 0.05
    # pruning's zeros compress
    assert models["pruned_qat/int8"]["gzip_ratio"] < models["qat/int8"]["gzip_ratio"]
    assert result["pruned_hidden_sparsity"] == pytest.approx(0.8, abs=0.01)
    keras_int8 = result["keras"]["qat/keras_int8"]
    assert keras_int8["size_ratio"] < 0.3  # int8 kernels, float biases and scales
    assert abs(keras_int8["accuracy"] - models["qat/int8"]["keras_accuracy"]) < 0.05


@pytest.mark.slow
def test_pipeline_benchmark_sets_bubbles_beside_the_formula_and_peaks_per_stage(mpiexec_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pipeline.py"),
                           "--quick", "--parts", "bubble,memory", "--steps", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=400, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = _json_from(done.stdout)
    assert [(r["schedule"], r["M"]) for r in result["bubble"]] == [("gpipe", 4), ("1f1b", 4)]
    for row in result["bubble"]:
        assert row["formula"] == pytest.approx(1 / (row["M"] + 1))
        assert all(0 <= b < 1 for b in row["per_stage"]) and len(row["pass_seconds"]) == 2
        assert all(0 <= share < 1 for share in row["receiving_share"])
        assert 0 <= row["with_measured_times"] < 1
    assert [(r["schedule"], r["recompute"]) for r in result["memory"]] == [
        ("gpipe", False), ("gpipe", True)]
    assert all(len(r["peak_above_start_mb"]) == 2 for r in result["memory"])
    assert "| gpipe | 4 |" in done.stderr


def _run_over_emulated_hosts(script, *args):
    """Runs a benchmark that makes its own emulated hosts (skipped where it cannot);
    fails the test if the benchmark fails."""
    import emulated_hosts

    why_not = emulated_hosts.available()
    if why_not:
        pytest.skip(why_not)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.mpi
def test_network_benchmark_sets_kdist_beside_the_raw_allreduce_over_a_limited_link(
        mpiexec_path):
    done = _run_over_emulated_hosts("network.py", "--rates", "2", "--width", "64", "--batch",
                                    "16", "--bucket-mb", "0.01", "--rounds", "1", "--steps",
                                    "4", "--bursts", "200kb")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and rows[0]["link_gbit"] == 2 and rows[0]["buckets"] >= 2
    row, goals = rows
    # The cost model is fitted to the limited link: were the limit not applied, the
    # loopback's tens of Gbit/s would show.
    assert 0 < row["fitted_gbit"] <= 2 * 1.2
    assert row["predicted_serial_ms"] >= row["predicted_overlap_ms"] >= row["compute_ms"]
    # The backward pass is what is left of the step once the forward pass is timed.
    assert 0 < row["forward_ms"] < row["compute_ms"]
    assert row["backward_ms"] == pytest.approx(row["compute_ms"] - row["forward_ms"], abs=2e-3)
    assert row["forward_plus_max_ms"] == pytest.approx(
        row["forward_ms"] + max(row["backward_ms"], row["raw_allreduce_ms"]), abs=2e-3)
    (cell,) = goals["cells"]
    assert (cell["link_gbit"], cell["burst"], cell["launches"]) == (2, "200kb", 1)
    assert cell["serial_misses_by"] == pytest.approx(
        max(0.0, row["serial_over_compute_plus_allreduce"] / 1.05 - 1), abs=2e-3)


def test_emulated_links_take_the_token_bucket_they_are_given():
    import emulated_hosts

    why_not = emulated_hosts.available() or (None if shutil.which("tc") else "no tc")
    if why_not:
        pytest.skip(why_not)
    network = _load_benchmark("network")
    # A time becomes bytes at the rate (at least 64 KiB); a size goes to tc as it is.
    assert network.burst_bytes("1ms", 10) == 1_250_000
    assert network.burst_bytes("1ms", 0.1) == 64 * 1024
    assert network.burst_bytes("1mbit", 10) == "1mbit"
    with emulated_hosts.EmulatedHosts(2) as hosts:
        hosts.limit_link(0, 10, burst=network.burst_bytes("1ms", 10))
        hosts.limit_link(1, 10, burst="1mbit")
        shown = [subprocess.run(["tc", "-n", hosts.namespace(name), "qdisc", "show"],
                                capture_output=True, text=True, check=True).stdout
                 for name in hosts.names]
    # tc shows each bucket in bytes of its own rounding (1,250,000 as 1248750b).
    buckets = [re.search(r"rate 10Gbit burst (\d+)b ", text) for text in shown]
    assert all(buckets)
    assert int(buckets[0].group(1)) == pytest.approx(1_250_000, rel=0.01)
    assert int(buckets[1].group(1)) == pytest.approx(1e6 / 8, rel=0.05)  # 1 Mbit


@pytest.mark.mpi
def test_decentralized_benchmark_over_a_limited_link_spans_two_hosts_and_records_a_curve(
        mpiexec_path):
    done = _run_over_emulated_hosts("decentralized.py", "--workers", "2", "--epochs", "2",
                                    "--width", "32", "--methods", "allreduce-topk",
                                    "--straggler", "off", "--link-gbit", "5", "--target",
                                    "0.5")
    row = json.loads(done.stdout)["rows"][0]
    assert sorted(row["hosts"]) == ["h0", "h1"]
    assert len(row["curve"]) == 2 and row["curve"][0][0] < row["curve"][1][0]
    # Four classes: compressed to 1 % of the entries, training still learns the task.
    assert row["curve"][-1][1] > 0.5 and row["seconds_to_target"] is not None


def test_strided_conv_benchmark_times_two_equal_convolutions():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "strided_conv.py"), "--batch", "1",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    assert set(result["layers"]) == {"first", "second"}
    for layer in result["layers"].values():
        # The two ways compute the same function; the speedup is their time ratio.
        assert layer["max_output_difference"] < 1e-4
        assert layer["speedup"] == pytest.approx(layer["strided_s"] / layer["subsampled_s"])


def test_onednn_benchmark_runs_each_setting_in_its_own_process_and_reports_ratios():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "onednn.py"), "--models", "conv2d",
         "--settings", "off,on", "--steps", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    row = result["models"]["conv2d"]
    assert row["unit"] == "steps/s" and min(row["rate"].values()) > 0
    # Each process ran the kernels its setting asked for: the switch took.
    assert row["onednn"] == {"off": False, "on": True}
    assert row["over_off"]["on"] == pytest.approx(row["rate"]["on"] / row["rate"]["off"],
                                                  rel=0.01)
    assert "CPU has" in result["cpu"] or "unknown" in result["cpu"]


def test_startup_benchmark_compares_with_keras_and_names_what_keras_imports_unused():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "startup.py"),
                           "--repeats", "1", "--cases", "python"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    cases = {row["case"]: row for row in rows if "case" in row}
    assert set(cases) == {"python", "keras"}
    assert cases["keras"]["wall_vs_keras"] == 1.0
    assert cases["python"]["wall_s"] < cases["keras"]["wall_s"]
    breakdown = rows[-1]
    assert breakdown["kdist_own_s"] > 0 and "tensorflow" in breakdown["by_package"]
    # Keras's own start-up imports scikit-learn and pyplot: the benchmark names both.
    assert {"keras.src.wrappers", "matplotlib.pyplot"} <= set(
        breakdown["unused_by_a_rank_cumulative_s"])


CRASHES_ON_RANK_1 = """
import ctypes, os
if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    ctypes.string_at(0)
"""


@pytest.mark.parametrize("crash", [False, True])
def test_stress_benchmark_counts_how_each_launch_ended(mpiexec_path, tmp_path, crash):
    script = tmp_path / "job.py"
    script.write_text(CRASHES_ON_RANK_1 if crash else "print('fine')\n")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stress.py"),
                           "--ranks", "2", "--launches", "2", "--load", "1", "--timeout", "120",
                           "--keep", str(tmp_path / "logs"), "--", str(script)],
                          capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1]
    assert summary["launches"] == 2 and summary["load"] == 1
    if crash:
        assert done.returncode == 1
        assert summary["crashed"] == 2 and summary["ok"] == 0
        assert all(row["signal"] == 11 for row in rows[:-1])
        assert len(summary["logs"]) == 2 and all(os.path.exists(p) for p in summary["logs"])
    else:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert summary["ok"] == 2 and summary["crashed"] == summary["failed"] == 0


@pytest.mark.slow
def test_sanitizers_benchmark_runs_the_engine_test_clean(mpiexec_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sanitizers.py"),
                           "--sanitizers", "address", "--ranks", "2", "--rounds", "1"],
                          capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    # The plain build, then AddressSanitizer's, each on 2 ranks.
    assert rows and rows[-1] == {"summary": True, "cases": 2, "clean": True}, (
        done.stdout[-3000:] + done.stderr[-3000:])
    assert [row["sanitizer"] for row in rows[:-1]] == ["none", "address"]
    assert rows[1]["runtime_linked"] is True and rows[1]["ok_ranks"] == 2


@pytest.mark.slow  # 20-40 s: a Keras application traced under the tape
def test_synthetic_benchmark_worker_trains_the_same_model_on_every_rank(mpirun):
    job = mpirun(os.path.join(ROOT, "benchmarks", "synthetic.py"), n=2,
                 args=["--worker", "--model", "MobileNetV3Small", "--image-size", "32",
                       "--batch-size", "4", "--classes", "10", "--warmup-batches", "1",
                       "--batches-per-iter", "1", "--iters", "2"])
    synthetic = _load_benchmark("synthetic")
    results = sorted(synthetic.results_of(job.output), key=lambda r: r["rank"])
    assert [(r["rank"], r["ranks"]) for r in results] == [(0, 2), (1, 2)]
    assert all(r["images_per_second"] > 0 for r in results)
    # Each rank draws its own images: only averaged gradients keep the weights alike.
    assert results[0]["weights_checksum"] == pytest.approx(results[1]["weights_checksum"],
                                                           rel=1e-6)


def test_synthetic_benchmark_shares_the_cores_among_the_processes_alone():
    synthetic = _load_benchmark("synthetic")
    shares = synthetic.core_shares(2)
    cores = sorted(os.sched_getaffinity(0))
    assert len(shares) == 2
    if len(cores) >= 2:
        used = [int(c) for share in shares for c in share.split(",")]
        assert sorted(used) == sorted(set(used)) and set(used) <= set(cores)
    assert synthetic.core_shares(len(cores) + 1)[-1] == str(cores[0])
    environ = {"OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "PATH": "/bin"}
    assert synthetic.without_mpi(environ) == {"PATH": "/bin"}


@pytest.mark.slow
def test_synthetic_benchmark_sets_ranks_beside_processes_alone(mpiexec_path):
    import emulated_hosts

    links = [] if emulated_hosts.available() else ["--links", "10"]
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "synthetic.py"), "--model",
         "MobileNetV3Small", "--image-size", "32", "--batch-size", "4", "--classes", "10",
         "--warmup-batches", "1", "--batches-per-iter", "1", "--iters", "1", "--rounds", "1",
         *links], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = _json_from(done.stdout)
    cases = {"one_rank", "ranks", "alone"} | ({"ranks_over_10gbit"} if links else set())
    assert set(result["cases"]) == cases
    assert all(case["images_per_second"] > 0 for case in result["cases"].values())
    assert set(result["ranks_over_alone"]) == cases - {"one_rank", "alone"}
    assert len(result["cases"]["alone"]["rounds"][0]["per_rank"]) == 2


def test_pbt_textures_task_hands_each_method_its_test_accuracy(monkeypatch):
    import argparse

    pbt = _load_benchmark("pbt")
    (x, y), (xv, yv), (xt, yt) = pbt.textures()
    assert x.shape == (2000, 16, 16, 1) and xv.shape == xt.shape == (1000, 16, 16, 1)
    again = pbt.textures()
    np.testing.assert_array_equal(again[0][0], x)
    np.testing.assert_array_equal(again[0][1], y)
    assert set(np.unique(np.concatenate([y, yv, yt]))) == set(range(10))
    # Two rates, two epochs each: the better one's validation and test accuracy.
    monkeypatch.setattr(pbt, "HAND_RATES", np.array([1e-3, 0.1]))
    args = argparse.Namespace(max_epochs=2)
    data = ((x[:400], y[:400]), (xv[:200], yv[:200]), (xt[:200], yt[:200]))
    for method in ("best_constant", "best_cosine"):
        valid, tested, epochs = pbt.by_hand(method, data, args)
        assert epochs == 4 and 0 < valid <= 1 and 0 < tested <= 1


def test_pbt_benchmark_refuses_hand_tuned_methods_on_the_digits():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pbt.py"),
                           "--methods", "kdist_pbt,best_cosine"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "best_cosine" in done.stderr


def test_botorch_benchmark_starts_from_kdists_design_and_checks_its_arguments():
    import keras_tuner as kt

    from kdist.tune import BayesianOracle

    botorch_batch = _load_benchmark("botorch_batch")
    oracle = BayesianOracle(objective=kt.Objective("value", "min"), max_trials=30)
    for dimensions in (1, 2, 6, 20):
        assert botorch_batch.design_size(dimensions, 30) == oracle.initial_points(dimensions)
    script = os.path.join(ROOT, "benchmarks", "botorch_batch.py")
    for bad in (["--batches", "4,0"], ["--problems", "ackley10"], ["--seeds", "0"]):
        done = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and "error" in done.stderr, bad
