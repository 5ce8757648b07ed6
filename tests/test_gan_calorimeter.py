"""The calorimeter GAN example: simulator physics, the reader, training on two ranks, validation."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
pytest.importorskip("scipy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "gan_calorimeter")
sys.path.insert(0, EXAMPLE)

import data  # noqa: E402
import model as gan_model  # noqa: E402


@pytest.fixture(scope="module")
def showers():
    energies = np.repeat([20.0, 50.0, 100.0, 200.0, 400.0], 40)
    return energies, data.simulate(energies, seed=1)


def test_deposited_energy_is_linear_in_the_primary_energy(showers):
    energies, cells = showers
    assert cells.shape == (200, 25, 25, 25) and cells.dtype == np.float32
    totals = cells.sum(axis=(1, 2, 3))
    means = np.array([totals[energies == e].mean() for e in np.unique(energies)])
    slope, intercept = np.polyfit(np.unique(energies), means, 1)
    # Through the origin with the sampling fraction as slope, within a few percent.
    assert slope == pytest.approx(data.SAMPLING_FRACTION, rel=0.03)
    np.testing.assert_allclose(means / np.unique(energies), data.SAMPLING_FRACTION, rtol=0.04)
    # The stochastic term: relative spread falls with energy.
    spread = [totals[energies == e].std() / totals[energies == e].mean() for e in (20.0, 400.0)]
    assert spread[0] > 2 * spread[1]


def test_shower_maximum_deepens_with_energy(showers):
    energies, cells = showers
    maxima = [np.argmax(cells[energies == e].sum(axis=(1, 2)).mean(0))
              for e in np.unique(energies)]
    assert maxima == sorted(maxima) and maxima[-1] - maxima[0] >= 3, maxima


def test_showers_are_narrow_sparse_and_centred(showers):
    _, cells = showers
    assert (cells == 0).mean() > 0.8
    profile = cells.sum(axis=(0, 2, 3))
    assert np.argmax(profile) in (11, 12, 13)
    # Most of the energy within two cells of the axis.
    assert profile[10:15].sum() > 0.8 * profile.sum()
    with pytest.raises(ValueError, match="positive"):
        data.simulate([10.0, -1.0])


def test_files_round_trip_and_ranks_share_the_rows(tmp_path):
    paths = data.make_dataset(tmp_path, files=2, showers=13, seed=4)
    with h5py.File(paths[0], "r") as f:
        assert f["ECAL"].shape == (13, 25, 25, 25) and f["energy"].shape == (13,)
        first = (f["ECAL"][:], f["energy"][:])
    everything = data.ShowerFiles(paths).read()
    assert len(everything[0]) == 26
    np.testing.assert_array_equal(everything[0][:13], first[0])
    np.testing.assert_array_equal(everything[1][:13], first[1])
    shares = [data.ShowerFiles(paths, rank, 3).read() for rank in range(3)]
    energies = np.sort(np.concatenate([share[1] for share in shares]))
    np.testing.assert_array_equal(energies, np.sort(everything[1]))
    assert sorted(len(share[1]) for share in shares) == [8, 9, 9]
    # Streamed through tf.data, one shower per element.
    rows = list(data.ShowerFiles(paths, 1, 2).dataset(limit=5).as_numpy_iterator())
    assert len(rows) == 5 and rows[0]["ECAL"].shape == (25, 25, 25)
    np.testing.assert_array_equal(rows[0]["energy"], data.ShowerFiles(paths, 1, 2).read()[1][0])
    # A rerun keeps files already written; a broken file is named.
    assert data.make_dataset(tmp_path, files=2, showers=99, seed=4) == paths
    with h5py.File(tmp_path / "broken.h5", "w") as f:
        f.create_dataset("ECAL", data=np.zeros((2, 25, 25, 25)))
    with pytest.raises(ValueError, match="energy"):
        data.ShowerFiles([tmp_path / "broken.h5"])


def test_outputs_are_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "train.json"
    target.write_text("old")

    def fails_halfway(path):
        with open(path, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        data.replace_atomically(str(target), fails_halfway)
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["train.json"]
    data.replace_atomically(str(target), lambda path: open(path, "w").write("new"))
    assert target.read_text() == "new"
    assert data.is_simulated("/d/showers_007.h5") and not data.is_simulated("/d/run_1.h5")


@pytest.mark.parametrize("small", [True, False])
def test_models_have_the_published_shapes(small):
    generator, discriminator = gan_model.generator(small), gan_model.discriminator(small)
    assert [tuple(i.shape[1:]) for i in generator.inputs] == [(200,), (1,)]
    assert tuple(generator.output.shape[1:]) == (25, 25, 25, 1)
    assert [tuple(o.shape[1:]) for o in discriminator.outputs] == [(1,), (1,), (1,)]
    showers = np.random.default_rng(0).random((2, 25, 25, 25, 1)).astype("float32")
    _, _, total = discriminator(showers)
    np.testing.assert_allclose(np.asarray(total)[:, 0], showers.sum(axis=(1, 2, 3, 4)),
                               rtol=1e-5)


def test_recipe_layers_give_positions_and_a_log_view_and_survive_saving(tmp_path):
    import keras

    cells = gan_model.CellCoordinates()(np.zeros((2, 5, 4, 3, 1), "float32"))
    cells = np.asarray(cells)
    assert cells.shape == (2, 5, 4, 3, 4) and not cells[..., 0].any()
    np.testing.assert_allclose(cells[1, :, 0, 0, 1], np.linspace(-1, 1, 5), atol=1e-6)
    np.testing.assert_allclose(cells[1, 0, :, 0, 2], np.linspace(-1, 1, 4), atol=1e-6)
    np.testing.assert_allclose(cells[1, 0, 0, :, 3], [-1, 0, 1], atol=1e-6)
    # One hit reads log(2) / 7, and an empty cell stays zero.
    seen = np.asarray(gan_model.LogCells(unit=0.01)(np.array([0.0, 0.01, 10.0], "float32")))
    np.testing.assert_allclose(seen, np.log1p([0.0, 1.0, 1000.0]) / 7, rtol=1e-5)
    with pytest.raises(ValueError, match="unit must be > 0"):
        gan_model.LogCells(unit=0)

    for small in (True, False):
        generator = gan_model.generator(small, coordinates=True)
        assert tuple(generator.output.shape[1:]) == (25, 25, 25, 1)
        assert any(isinstance(layer, gan_model.CellCoordinates) for layer in generator.layers)
    discriminator = gan_model.discriminator(True, log_cells=True)
    showers = np.random.default_rng(1).random((2, 25, 25, 25, 1)).astype("float32")
    path = str(tmp_path / "discriminator.keras")
    discriminator.save(path)
    loaded = keras.models.load_model(path)
    for before, after in zip(discriminator(showers), loaded(showers)):
        np.testing.assert_allclose(np.asarray(before), np.asarray(after), rtol=1e-5)
    # The cell sum stays linear: the log view feeds only the convolutions.
    np.testing.assert_allclose(np.asarray(loaded(showers)[2])[:, 0],
                               showers.sum(axis=(1, 2, 3, 4)), rtol=1e-5)


def test_split_energy_generator_deposits_exactly_its_sampled_total(tmp_path):
    import keras

    energy = np.array([[0.1], [5.0]], "float32")
    noise = np.zeros((2, 200), "float32")
    noise[:, 0] = [1.0, -2.0]
    params = np.array([[4.6, np.log(0.05)], [4.5, np.log(0.01)]], "float32")
    total = np.asarray(gan_model.SampleTotal()([energy, params, noise]))
    np.testing.assert_allclose(total[:, 0], energy[:, 0] * np.exp(
        params[:, 0] + np.exp(params[:, 1]) * noise[:, 0]), rtol=1e-5)

    # Cells under the threshold are emptied; the rest still sum to the total.
    logits = np.zeros((2, 25, 25, 25, 1), "float32")
    logits[:, 12, 12, :5] = 12.0       # five cells take 98 % of the total
    deposit = gan_model.Deposit(initial_threshold=0.01)
    showers = np.asarray(deposit([logits, total]))
    assert float(deposit.threshold) == pytest.approx(0.01, rel=1e-5)
    np.testing.assert_allclose(showers.sum(axis=(1, 2, 3, 4)), total[:, 0], rtol=1e-5)
    assert (showers[:, 12, 12, :5] > 0).all() and (showers == 0).mean() > 0.99
    with pytest.raises(ValueError, match="initial_threshold must be > 0"):
        gan_model.Deposit(initial_threshold=0.0)

    # With the mean shower as prior, zero logits give the mean shower, less the
    # cells under the threshold.
    prior = np.zeros((25, 25, 25))
    prior[12, 12, :10] = np.arange(1, 11) / 55.0
    deposit = gan_model.Deposit(initial_threshold=1e-4)
    deposit.build([(None, 25, 25, 25, 1), (None, 1)])
    deposit.set_mean_shape(prior)
    showers = np.asarray(deposit([np.zeros((2, 25, 25, 25, 1), "float32"), total]))[..., 0]
    fractions = showers / total[:, 0, None, None, None]
    np.testing.assert_allclose(fractions[:, 12, 12, :10], np.tile(prior[12, 12, :10], (2, 1)),
                               rtol=1e-3)
    assert np.count_nonzero(showers) == 2 * 10
    with pytest.raises(ValueError, match="sum to 1"):
        deposit.set_mean_shape(2 * prior)

    generator = gan_model.generator(True, split_energy=True)
    made = np.asarray(generator([noise, energy]))
    assert made.min() >= 0 and tuple(made.shape[1:]) == (25, 25, 25, 1)
    path = str(tmp_path / "generator.keras")
    generator.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(np.asarray(loaded([noise, energy])), made, rtol=1e-5, atol=1e-7)


def test_the_total_energy_fit_finds_the_simulated_response_and_resolution(tmp_path):
    import train

    paths = data.make_dataset(str(tmp_path), files=1, showers=600, seed=4)
    weights, fitted = train.fit_total_energy(*data.ShowerFiles(paths).totals())
    mean = data.ShowerFiles(paths).mean_fractions()
    # The mean shower: all of the energy, most of it on the axis around layer 10.
    assert mean.sum() == pytest.approx(1.0) and mean.shape == (25, 25, 25)
    assert np.unravel_index(mean.argmax(), mean.shape)[:2] == (12, 12)
    energies, totals = data.ShowerFiles(paths).totals()
    ratio = np.log(totals * gan_model.CELL_SCALE / (energies / gan_model.ENERGY_SCALE))
    # The simulated mean of log(deposited / primary), and its spread per energy.
    low, high = ratio[energies < 60], ratio[energies > 400]
    near_100 = ratio[(energies > 60) & (energies < 140)]
    assert fitted["100 GeV"][0] == pytest.approx(near_100.mean(), abs=0.01)
    assert fitted["10 GeV"][1] > 2 * fitted["500 GeV"][1]
    assert fitted["500 GeV"][1] == pytest.approx(high.std(), rel=0.25)
    assert low.std() > high.std()
    generator = gan_model.generator(True, split_energy=True)
    generator.get_layer("total_energy").set_weights(weights)


@pytest.mark.mpi
def test_two_ranks_train_resume_and_validate(mpirun, tmp_path):
    out = tmp_path / "run"
    train = os.path.join(EXAMPLE, "train.py")
    # Small batches: the 3D convolutions take seconds per shower-step on a CPU.
    args = ["--quick", "--output", out, "--showers", 64, "--steps", 2, "--batch-size", 2,
            "--split-energy"]
    job = mpirun(train, n=2, args=args + ["--epochs", 1], timeout=300)
    assert "with hvd on 2 process(es)" in job.output and "2/2 - " in job.output
    assert (out / "generator.keras").exists() and (out / "checkpoints").is_dir()
    # The same command with more epochs resumes after the finished one.
    job = mpirun(train, n=2, args=args + ["--epochs", 2], timeout=300)
    assert "Epoch 2/2" in job.output and "Epoch 1/2" not in job.output
    summary = json.loads((out / "train.json").read_text())
    assert summary["ranks"] == 2 and summary["epochs_run"] == 1
    assert summary["split_energy"] and set(summary["total_energy_fit"]) == {
        "10 GeV", "100 GeV", "500 GeV"}
    # The total-energy network was fitted first and stayed frozen while the GAN trained.
    import keras
    import train as train_module

    files = data.ShowerFiles(sorted(map(str, (out / "data").glob("*.h5"))))
    fitted, _ = train_module.fit_total_energy(*files.totals())
    trained = keras.models.load_model(out / "generator.keras").get_layer("total_energy")
    for before, after in zip(fitted, trained.get_weights()):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-6)
    assert all(np.isfinite(summary["history"]["g_loss"]))
    rows = (out / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and "d_loss" in rows[0]

    validation = tmp_path / "validation"
    done = subprocess.run([sys.executable, os.path.join(EXAMPLE, "validate.py"), "--quick",
                           "--showers", "40", "--input", str(out), "--output", str(validation)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("longitudinal.png", "transverse.png", "total_energy.png", "cell_spectrum.png",
                 "showers.png"):
        assert (validation / name).stat().st_size > 1000, name
    metrics = json.loads((validation / "metrics.json").read_text())
    assert metrics["showers"] == 40 and len(metrics["longitudinal_relative_difference"]) == 25
    assert metrics["total_energy_ratio"] > 0 and metrics["cell_spectrum_wasserstein_log10"] >= 0
    # The physicist's report: every metric beside its floor, and the timings.
    report = json.loads((validation / "evaluation.json").read_text())
    assert report["showers"] == 40 and set(report) >= {"generated", "floor", "summary"}
    names = [row["metric"] for row in report["summary"]]
    assert "classifier AUC, high-level features" in names and "energy response" in names[0]
    assert all(row["floor"] is not None for row in report["summary"])
    # The quick report carries the physics distances, each with its error and floor.
    for name in ("fpd", "kpd"):
        value, error = report["generated"]["physics_distances"][name]
        assert np.isfinite(value) and error >= 0, name
        assert np.isfinite(report["floor"]["physics_distances"][name][0]), name
    assert report["timing"]["generation_seconds_per_shower"] > 0
    assert "| metric | generated | floor |" in (validation / "evaluation.md").read_text()
    for name in ("energy_ratio", "shower_depth", "sparsity", "width_x", "centre_x"):
        assert (validation / f"feature_{name}.png").stat().st_size > 1000, name

    # Against the training files, the floor is the next showers of the same files.
    import validate

    on_files = tmp_path / "on_files"
    validate.main(["--input", str(out), "--output", str(on_files), "--data", str(out / "data"),
                   "--showers", "20"])
    report = json.loads((on_files / "evaluation.json").read_text())
    assert report["showers"] == 20 and report["timing"]["simulation_seconds_per_shower"] is None
    assert report["floor"]["sparsity"]["reference"] == report["generated"]["sparsity"]["reference"]
    assert report["floor"]["sparsity"]["other"] != report["floor"]["sparsity"]["reference"]


def test_validation_metrics_separate_good_from_bad_showers(showers):
    import validate

    energies, cells = showers
    same = validate.metrics(cells[::2], data.simulate(energies[::2], seed=9))
    assert same["total_energy_ratio"] == pytest.approx(1.0, abs=0.03)
    assert same["longitudinal_mean_relative_difference"] < 0.1
    assert same["cell_spectrum_wasserstein_log10"] < 0.05
    doubled = validate.metrics(cells, 2 * cells)
    assert doubled["total_energy_ratio"] == pytest.approx(2.0, rel=1e-5)
    # Every cell doubled shifts the log spectrum by log10(2), less the few cells
    # that doubling lifts over the empty-cell threshold.
    assert 0.25 < doubled["cell_spectrum_wasserstein_log10"] <= np.log10(2) + 1e-6


@pytest.mark.mpi
@pytest.mark.parametrize("strategy,ranks", [("mpi", 2),
                                            pytest.param("ps", 3, marks=pytest.mark.slow)])
def test_train_runs_with_the_other_strategies(mpirun, tmp_path, strategy, ranks):
    out = tmp_path / "run"
    job = mpirun(os.path.join(EXAMPLE, "train.py"), n=ranks, timeout=300,
                 args=["--quick", "--strategy", strategy, "--output", out, "--showers", 48,
                       "--steps", 1, "--epochs", 2, "--batch-size", 2, "--coordinates",
                       "--log-cells", "--split-energy"])
    assert f"with {strategy} on {ranks} process(es)" in job.output
    summary = json.loads((out / "train.json").read_text())
    assert summary["strategy"] == strategy and summary["epochs_run"] == 2
    assert all(np.isfinite(summary["history"]["d_loss"]))
    import keras

    generator = keras.models.load_model(out / "generator.keras")
    assert any(isinstance(layer, gan_model.CellCoordinates) for layer in generator.layers)
    assert isinstance(generator.get_layer("shower"), gan_model.Deposit)
    assert not generator.get_layer("total_energy").trainable
    # The mean shower's log fractions were set as the prior (all below zero).
    assert np.asarray(generator.get_layer("shower").mean_shape).max() < 0


def test_separation_power_and_chi2_tell_one_distribution_from_another():
    import evaluation

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=4000), rng.normal(size=4000)
    assert evaluation.separation_power(a, a) == 0.0
    assert evaluation.separation_power(a, b) < 0.01
    assert evaluation.separation_power(a, a + 100.0) == pytest.approx(1.0)
    assert evaluation.chi2_per_dof(a, b) < 2.0 < 10.0 < evaluation.chi2_per_dof(a, b + 0.5)


def test_the_evaluation_puts_a_wrong_generator_far_from_the_floor(showers):
    import evaluation

    energies, cells = showers
    second = data.simulate(energies, seed=2)
    # Right shapes but 5 % too much energy, and every other row of cells empty.
    wrong = data.simulate(energies, seed=3) * 1.05
    wrong[:, ::2] = 0.0
    report = evaluation.evaluate(cells, second, wrong, energies)
    rows = {row["metric"]: row for row in report["summary"]}
    response = rows["energy response, worst bin (generated / reference - 1)"]
    assert response["floor"] < 0.02 < response["generated"] and response["met"] is False
    sparsity = rows["sparsity (generated - reference)"]
    assert sparsity["floor"] < 0.005 and sparsity["generated"] > 0.03 and not sparsity["met"]
    auc = rows["classifier AUC, high-level features"]
    assert auc["floor"] < 0.7 < 0.95 < auc["generated"]
    transverse = rows["transverse profile separation power (x, y mean)"]
    assert transverse["generated"] > 3 * transverse["floor"]
    assert transverse["met"] is (transverse["generated"] <= 10 * transverse["floor"])
    # Per energy bin, the reference against itself responds as one.
    for row in report["floor"]["energy_response"]:
        assert row["response_ratio"] == pytest.approx(1.0, abs=0.02)
    resolution = rows["energy resolution, worst bin (generated / reference)"]
    assert resolution["target"] == "<= 1.5" and resolution["floor"] > 0
    for name in ("FPD", "KPD"):
        assert rows[name]["generated"] > 5 * abs(rows[name]["floor"]), name
    table = evaluation.markdown(report)
    assert "| energy response" in table and "| 0.92-0.99 |" in table


def test_frechet_distance_of_gaussians_is_the_closed_form():
    import distances

    # Diagonal covariances: |mu1 - mu2|^2 + sum((sqrt(s1) - sqrt(s2))^2).
    mean_1, mean_2 = np.array([0.0, 1.0]), np.array([0.5, -1.0])
    var_1, var_2 = np.array([1.0, 4.0]), np.array([0.25, 1.0])
    expected = 0.25 + 4.0 + (1.0 - 0.5) ** 2 + (2.0 - 1.0) ** 2
    value = distances.frechet_distance(mean_1, np.diag(var_1), mean_2, np.diag(var_2))
    assert value == pytest.approx(expected, rel=1e-9)


def test_fpd_and_kpd_tell_a_shifted_sample_from_a_second_one():
    import distances

    rng = np.random.default_rng(0)
    reference, second = rng.normal(size=(2, 1500, 4))
    shifted = rng.normal(size=(1500, 4)) + [0.3, 0.0, 0.0, 0.0]
    floor_fpd, floor_error = distances.fpd(reference, second)
    shifted_fpd, _ = distances.fpd(reference, shifted)
    # Scaled by the reference's largest value (about 3.5), a shift of 0.3 is
    # about 0.085, so the distance about 0.0072; the floor extrapolates to ~0.
    scale = np.abs(reference[:, 0]).max()
    assert shifted_fpd == pytest.approx((0.3 / scale) ** 2, rel=0.35)
    assert floor_fpd < 0.1 * shifted_fpd and floor_error < 0.1 * shifted_fpd
    floor_kpd, floor_kpd_error = distances.kpd(reference, second)
    shifted_kpd, shifted_kpd_error = distances.kpd(reference, shifted)
    assert abs(floor_kpd) < 3 * floor_kpd_error + 1e-6
    assert shifted_kpd > 3 * shifted_kpd_error > 0
    assert shifted_kpd > floor_kpd + 3 * floor_kpd_error


def test_physics_distances_refuse_mismatched_features():
    import distances

    with pytest.raises(ValueError, match="same d"):
        distances.fpd(np.ones((10, 3)), np.ones((10, 2)))
    with pytest.raises(ValueError, match="min_samples <= max_samples"):
        distances.fpd(np.ones((10, 3)), np.ones((10, 3)), min_samples=8, max_samples=5)
    with pytest.raises(ValueError, match="the smaller sample"):
        distances.fpd(np.ones((10, 3)), np.ones((10, 3)), max_samples=20)
    # Fewer showers than features + 2: still a number, from singular covariances.
    rng = np.random.default_rng(1)
    value, error = distances.fpd(rng.normal(size=(8, 10)), rng.normal(size=(8, 10)))
    assert np.isfinite(value) and np.isfinite(error)


def test_replicates_give_each_metric_its_median_range_and_met_count(tmp_path, capsys):
    import replicates

    auc = "classifier AUC, high-level features"
    for index, (value, response) in enumerate([(0.95, 0.01), (0.85, 0.03), (0.88, 0.015)]):
        summary = [{"metric": auc, "generated": value, "floor": 0.5 + index / 100,
                    "target": "<= 0.9", "met": value <= 0.9},
                   {"metric": "energy response", "generated": response, "floor": 0.004,
                    "target": "<= 0.02", "met": response <= 0.02},
                   {"metric": "FPD", "generated": None, "floor": None, "target": None,
                    "met": None}]
        run = tmp_path / f"run{index}"
        run.mkdir()
        (run / "evaluation.json").write_text(json.dumps({"showers": 2000, "summary": summary}))
    runs = [str(tmp_path / f"run{i}") for i in range(3)]
    table = replicates.combine(replicates.load(runs))
    row = table[0]
    assert (row["median"], row["low"], row["high"]) == (0.88, 0.85, 0.95)
    assert row["floor"] == 0.51 and row["met"] == 2 and row["replicates"] == 3
    assert row["calochallenge_gans"] == "0.92-0.99"
    assert table[1]["met"] == 2 and table[2]["median"] is None
    replicates.main(runs + ["--output", str(tmp_path / "table.md")])
    text = (tmp_path / "table.md").read_text()
    assert "| classifier AUC, high-level features | 0.88 (0.85-0.95) | 0.51 | <= 0.9 | " \
           "2 of 3 | 0.92-0.99 |" in text and text == capsys.readouterr().out
    # Reports of different validate.py versions are not mixed.
    other = json.loads((tmp_path / "run2" / "evaluation.json").read_text())
    other["summary"] = other["summary"][:2]
    (tmp_path / "run2" / "evaluation.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different metrics"):
        replicates.combine(replicates.load(runs))
    with pytest.raises(SystemExit, match="validate.py"):
        replicates.load([str(tmp_path / "missing")])
