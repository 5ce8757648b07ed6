"""The shipped examples run and learn, on one process and on two."""

import os
import re
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY_EXAMPLE = os.path.join(ROOT, "examples", "strategy_quickstart.py")

pytest.importorskip("sklearn")


def _accuracy(output):
    found = re.findall(r"test accuracy ([0-9.]+)", output)
    assert len(found) == 1, "exactly one process reports:\n" + output[-3000:]
    return float(found[0])


@pytest.mark.mpi
def test_strategy_example_under_mpiexec_uses_the_mpi_strategy(mpirun):
    job = mpirun(STRATEGY_EXAMPLE, n=2, args=["--epochs", 3], timeout=240)
    assert "MPIStrategy: 2 replica(s), global batch 64" in job.output
    assert _accuracy(job.output) > 0.85
    assert "Warning" not in job.output, job.output[-3000:]


def test_strategy_example_under_kdist_launch_uses_the_multi_worker_strategy(tf_launch):
    job = tf_launch(STRATEGY_EXAMPLE, n=2, args=["--epochs", 3], timeout=240)
    assert "MultiWorkerMirroredStrategy: 2 replica(s), global batch 64" in job.output
    assert _accuracy(job.output) > 0.85


PS_EXAMPLE = os.path.join(ROOT, "examples", "ps_quickstart.py")


@pytest.mark.mpi
def test_parameter_server_example_learns_and_saves_the_central_model(mpirun, tmp_path):
    saved = tmp_path / "digits.keras"
    job = mpirun(PS_EXAMPLE, n=4, args=["--mode", "gem", "--epochs", 4, "--save", saved],
                 timeout=240)
    assert "ParameterServerStrategy(gem): 3 worker(s)" in job.output
    assert "Epoch 4/4" in job.output
    assert _accuracy(job.output) > 0.85
    assert saved.exists()


SPARSITY_EXAMPLE = os.path.join(ROOT, "examples", "prune_quantize.py")


@pytest.mark.mpi
def test_prune_quantize_example_keeps_accuracy_and_exports_integers(mpirun, tmp_path):
    import numpy as np

    exported = tmp_path / "digits_int.npz"
    job = mpirun(SPARSITY_EXAMPLE, n=2, timeout=300,
                 args=["--epochs", 4, "--sparsity", 0.8, "--export", exported])
    found = dict(re.findall(r"^(?:\[kdist 0\] )?(.+): test accuracy ([0-9.]+)$", job.output,
                            re.MULTILINE))
    tflite = [float(v) for k, v in found.items() if k.startswith("int8 TFLite model")]
    found = {k: v for k, v in found.items() if not k.startswith("int8 TFLite model")}
    assert set(found) == {"dense", "pruned to 80%", "8-bit"}, job.output[-3000:]
    assert float(found["dense"]) > 0.9
    assert float(found["pruned to 80%"]) > float(found["dense"]) - 0.05
    assert float(found["8-bit"]) > float(found["dense"]) - 0.05
    assert len(tflite) == 1 and tflite[0] > float(found["8-bit"]) - 0.02
    assert "Warning" not in job.output, job.output[-3000:]
    assert (tmp_path / "digits_int.tflite").exists()
    with np.load(exported) as stored:
        codes = stored["hidden1/codes"]
        assert codes.dtype == np.int8 and codes.shape == (64, 256)
        assert np.mean(codes == 0) == pytest.approx(0.8, abs=1e-3)
        assert stored["logits/scales"].shape == (10,)


ELASTIC_EXAMPLE = os.path.join(ROOT, "examples", "elastic_digits.py")


@pytest.mark.mpi
def test_elastic_example_finishes_on_two_ranks_after_killing_the_third(mpi_job):
    """Its own job: the example kills one of its ranks under Open MPI's fault tolerance."""
    job = mpi_job(ELASTIC_EXAMPLE, n=3, args=["--epochs", 4, "--kill-rank", 2],
                  fault_tolerant=True, check=False, timeout=240)
    assert "rank 2: killing myself" in job.output
    assert "carrying on with 2 rank(s) from epoch 1" in job.output
    found = re.findall(r"finished on 2 rank\(s\): loss [0-9.]+, accuracy ([0-9.]+)", job.output)
    assert len(found) == 1, job.output[-3000:]
    assert float(found[0]) > 0.8


@pytest.mark.mpi
def test_elastic_example_replaces_a_killed_rank_and_finishes_on_three(mpi_job):
    """Its own job: the example kills a rank and the survivors spawn its replacement."""
    job = mpi_job(ELASTIC_EXAMPLE, n=3, args=["--epochs", 4, "--kill-rank", 1],
                  fault_tolerant=True, check=False, timeout=240,
                  env={"KDIST_ELASTIC_MAX_NP": "3"},
                  # As in test_elastic.py: a retracing survivor must not be taken for dead.
                  mpi_args=["--oversubscribe", "--mca", "mpi_ft_detector_timeout", "10"])
    assert job.output.count("killing myself") == 1, job.output[-3000:]
    assert "rank 2 of 3: pid" in job.output and "(replacing a lost rank)" in job.output
    assert "carrying on with 3 rank(s) from epoch 1" in job.output
    found = re.findall(r"finished on 3 rank\(s\): loss [0-9.]+, accuracy ([0-9.]+)", job.output)
    assert len(found) == 1, job.output[-3000:]
    assert float(found[0]) > 0.8


FPGA_EXAMPLE = os.path.join(ROOT, "examples", "fpga_trigger.py")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="hls4ml's C++ emulation needs a C++ compiler")
def test_fpga_trigger_example_writes_firmware_that_matches_the_model(mpirun, tmp_path):
    pytest.importorskip("hls4ml")
    job = mpirun(FPGA_EXAMPLE, n=2, timeout=300,
                 args=["--epochs", 3, "--rows", 6000, "--bits", 6,
                       "--output-dir", tmp_path / "prj"])
    found = dict(re.findall(r"^(?:\[kdist 0\] )?(.+): test accuracy ([0-9.]+)$", job.output,
                            re.MULTILINE))
    assert set(found) == {"float", "6-bit fixed point, 50% pruned", "firmware"}, job.output
    assert float(found["float"]) > 0.6
    assert float(found["6-bit fixed point, 50% pruned"]) > float(found["float"]) - 0.08
    # The firmware takes 16-bit inputs, the Keras model float ones: a jet or two may differ.
    assert abs(float(found["firmware"]) - float(found["6-bit fixed point, 50% pruned"])) < 0.01
    assert re.search(r"100\.00% of 6000 outputs bit-exact, largest difference 0$",
                     job.output, re.MULTILINE), job.output
    assert (tmp_path / "prj" / "firmware" / "myproject.cpp").exists()


QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


@pytest.mark.mpi
def test_quickstart_under_kdist_run_trains_and_prints_cleanly(mpiexec_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kdist.cli", "run", "-n", "2", QUICKSTART,
                           "--epochs", "2"], capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    # Rank 0 untagged, so that its progress bar redraws in place.
    assert any(line.startswith("Training on 2 rank(s)") for line in output.splitlines())
    assert "ranks hold identical weights: True" in output
    # What a user sees: no TensorFlow start-up lines, no warnings, bars tagged once.
    for noise in ("absl::InitializeLog", "cuInit", "oneDNN", "Warning", "[0]", "[1] [1]",
                  "\x1b[", "kdist-run:"):
        assert noise not in output, noise + "\n" + output[-3000:]
    # The last line says how each rank ended.
    assert done.stderr.splitlines()[-1] == "kdist run: exit status 0: ranks 0-1 ended cleanly."


PIPELINE_EXAMPLE = os.path.join(ROOT, "examples", "pipeline_parallel.py")


@pytest.mark.mpi
def test_pipeline_example_trains_a_model_over_the_budget_in_two_stages(mpirun):
    job = mpirun(PIPELINE_EXAMPLE, n=2, args=["--epochs", 3], timeout=240)
    assert re.search(r"whole model: 36\.9 MB with Adam's slots, over the 32\.0 MB budget; "
                     r"stages: 12\.8 MB, 24\.1 MB", job.output), job.output[-3000:]
    assert "Epoch 3/3" in job.output
    assert _accuracy(job.output) > 0.85


@pytest.mark.mpi
def test_pipeline_example_refuses_a_stage_over_the_budget(mpirun):
    job = mpirun(PIPELINE_EXAMPLE, n=2, args=["--budget-mb", 20], timeout=240, check=False)
    assert job.returncode != 0
    assert "stage 1 needs 24.1 MB, over the budget of 20.0 MB" in job.output
