"""Files that several ranks save at once: one complete file per path, written by one rank.

The scripts run on shared worlds (`mpirun`); the rest runs in this process.
"""

import os

import keras
import numpy as np
import pytest

import kdist
from kdist.callbacks import saving

ROUNDS = 12


@pytest.mark.parametrize("n, mode", [(2, "strategy"), (3, "optimizer")])
def test_every_rank_saving_at_once_leaves_one_loadable_file_per_path(mpirun, tmp_path, n,
                                                                     mode):
    job = mpirun("saving_once.py", n=n, args=[mode, tmp_path, ROUNDS])
    first, others = job.results[0], [job.results[rank] for rank in range(1, n)]
    assert first["unreadable"] == []
    # 4 epochs of each of 3 checkpoint callbacks (one on rank 0 alone), 12 rounds, one
    # latest of each kind, and one file of each rank's own.
    assert len(first["loaded"]) == 3 * 4 + ROUNDS + 2 + n, first["loaded"]
    assert first["left"] == []
    # Rank 0 wrote every shared file; each other rank wrote only its own.
    assert first["by_fit"] == 4 * 4  # three checkpoints and a backup per epoch
    assert first["written"] == first["by_fit"] + 3 * ROUNDS + 1
    assert [r["written"] for r in others] == [1] * (n - 1)
    # The second fit resumed from the backup of the interrupted one, on every rank.
    assert [job.results[rank]["epochs"] for rank in range(n)] == [[2, 3]] * n
    assert all(np.allclose(r["weights"], first["weights"]) for r in others)


def test_a_failed_save_leaves_the_previous_file_and_no_partial_one(tmp_path):
    path = tmp_path / "model.keras"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    saving.save_model(model, path)
    before = path.read_bytes()

    def torn(target):
        with open(target, "wb") as stream:
            stream.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        saving.write_whole(path, torn)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]
    assert keras.saving.load_model(path).count_params() == 3


def test_a_directory_save_is_replaced_whole(tmp_path):
    path = tmp_path / "model"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    saving.save_model(model, path, zipped=False)
    saving.save_model(model, path, zipped=False)
    assert sorted(os.listdir(tmp_path)) == ["model"]
    assert keras.saving.load_model(path).count_params() == 3


def test_sharded_weights_keep_their_shards_beside_the_index(tmp_path):
    def build():
        return keras.Sequential([keras.Input((50,)), keras.layers.Dense(400),
                                 keras.layers.Dense(400)])

    model, path = build(), tmp_path / "m.weights.json"
    saving.save_weights(model, path, max_shard_size=0.5)
    shards = [name for name in os.listdir(tmp_path) if name.endswith(".weights.h5")]
    assert len(shards) >= 1 and sorted(os.listdir(tmp_path)) == sorted(shards + [path.name])
    again = build()
    again.load_weights(path)
    for saved, loaded in zip(model.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(saved, loaded)


def test_on_one_process_the_callbacks_are_keras_own_with_whole_files(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.ones((8, 2), "float32")
    checkpoint = kdist.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"),
                                                 monitor="loss", save_best_only=True)
    backup = kdist.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model.fit(x, x[:, :1], epochs=3, verbose=0, callbacks=[checkpoint, backup])
    assert isinstance(checkpoint, keras.callbacks.ModelCheckpoint)
    assert checkpoint.best < np.inf
    assert sorted(os.listdir(tmp_path)) == ["best.keras"]  # the backup is deleted at the end
    assert keras.saving.load_model(tmp_path / "best.keras").count_params() == 3


def test_writing_once_takes_only_keras_saving_callbacks():
    with pytest.raises(TypeError, match="EarlyStopping"):
        kdist.callbacks.writing_once(keras.callbacks.EarlyStopping())
    with pytest.raises(TypeError, match="ModelCheckpoint"):
        kdist.callbacks.writing_once(kdist.callbacks.ModelCheckpoint("a.keras"))
    wrapped = kdist.callbacks.writing_once(keras.callbacks.ModelCheckpoint("a.keras"))
    assert wrapped.name == "ModelCheckpoint"
