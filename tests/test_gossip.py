"""Gossip: graphs and their mixing weights, and replicas averaged with neighbours on 4 ranks."""

import keras
import numpy as np
import pytest

import kdist
from kdist.gossip import GossipAveraging, Topology


def test_a_ring_of_four_mixes_with_thirds_and_halves_nothing_twice():
    ring = Topology.ring(4)
    assert [ring.neighbours(i) for i in range(4)] == [[1, 3], [0, 2], [1, 3], [0, 2]]
    mixing = ring.mixing_matrix()
    np.testing.assert_allclose(mixing[0], [1 / 3, 1 / 3, 0, 1 / 3])
    # Doubly stochastic and symmetric: averaging keeps the mean of the replicas.
    np.testing.assert_allclose(mixing.sum(axis=0), 1)
    np.testing.assert_allclose(mixing.sum(axis=1), 1)
    np.testing.assert_allclose(mixing, mixing.T)
    assert ring.spectral_gap() == pytest.approx(2 / 3)


def test_graphs_by_name_and_their_speed_of_agreement():
    torus = Topology.torus(2, 4)
    assert torus.neighbours(0) == [1, 3, 4] and torus.neighbours(5) == [1, 4, 6]
    exponential = Topology.exponential(8)
    assert exponential.neighbours(0) == [1, 2, 4, 6, 7]
    # More edges, faster agreement; the complete graph agrees in one round.
    gaps = [Topology.ring(8).spectral_gap(), torus.spectral_gap(),
            exponential.spectral_gap(), Topology.complete(8).spectral_gap()]
    assert gaps == sorted(gaps) and gaps[-1] == pytest.approx(1.0)
    # Degrees differ here, and Metropolis weights still make rows and columns sum to 1.
    star_and_tail = Topology([[1, 2, 3], [0], [0, 3], [0, 2]], name="star")
    mixing = star_and_tail.mixing_matrix()
    np.testing.assert_allclose(mixing.sum(axis=0), 1)
    assert star_and_tail.weights(1) == {0: 0.25}
    from kdist.gossip.topology import resolve
    assert resolve("torus", 8).neighbours(0) == torus.neighbours(0)
    assert resolve(Topology.ring(3), 3).size == 3


@pytest.mark.parametrize("make, message", [
    (lambda: Topology([[1], []]), "mutual"),
    (lambda: Topology([[1, 1], [1, 0]]), "own neighbour"),
    (lambda: Topology([[1], [0], [3], [2]]), "not connected"),
    (lambda: Topology([[5], [0]]), "outside"),
    (lambda: Topology.ring(0), "whole number"),
    (lambda: Topology.torus(2, 1.5), "cols"),
    (lambda: Topology([1, 2]), "neighbour lists"),
])
def test_bad_graphs_are_refused_with_the_reason(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_gossip_refuses_a_distributed_optimizer_a_single_rank_and_bad_arguments():
    from kdist.gossip.topology import resolve
    with pytest.raises(ValueError, match="Unknown topology"):
        resolve("star", 4)
    with pytest.raises(ValueError, match="has 3 ranks"):
        resolve(Topology.ring(3), 4)
    with pytest.raises(ValueError, match="period"):
        GossipAveraging(period=0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x, y = np.zeros((4, 2)), np.zeros(4)
    model.compile(kdist.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    with pytest.raises(ValueError, match="plain Keras optimizer"):
        model.fit(x, y, verbose=0, callbacks=[GossipAveraging()])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match="2 ranks or more"):
        model.fit(x, y, verbose=0, callbacks=[GossipAveraging()])


GOSSIP = """
import os
import time
import keras, numpy as np, kdist
from kdist.gossip import GossipAveraging, Topology
from workers.common import report, flat_weights

kdist.init()
rank, size = kdist.rank(), kdist.size()
out = {}

# Replicas that start apart and do not train: averaging alone must bring them together.
def replica():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), float(rank)), np.full(2, -float(rank))])
    return model

model = replica()
ring = GossipAveraging("ring")
ring.set_model(model)
ring.on_train_begin()
distances = [ring.consensus_distance()]
for _ in range(8):
    ring.average()
    distances.append(ring.consensus_distance())
ring.on_train_end()
out["sync"] = {"distances": distances, "weights": flat_weights(model)}

# Asynchronous: rank 3 starts only once the others have finished, which they can only do
# if nobody waits for it.
def wait_for_the_others(tag):
    flags = os.environ["KDIST_TEST_REPORTS"]
    if rank != 3:
        open(os.path.join(flags, f"{tag}-{rank}"), "w").close()
        return
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(flags, f"{tag}-{r}")) for r in range(3)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks 0-2 did not finish {tag} without rank 3")
        time.sleep(0.02)

def asynchronous_rounds(late):
    model = replica()
    gossip = GossipAveraging(Topology.torus(2, 2), asynchronous=True)
    gossip.set_model(model)
    gossip.on_train_begin()
    if late and rank == 3:
        wait_for_the_others("rounds")
    for _ in range(60):
        time.sleep(0.006 if rank == 3 else 0.002)
        gossip.average()
    if late and rank != 3:
        wait_for_the_others("rounds")
    gossip.on_train_end()
    return {"rounds": gossip.rounds, "mixed": gossip.mixed,
            "distance": gossip.consensus_distance()}

out["async"] = asynchronous_rounds(late=False)  # rank 3 three times slower
out["late"] = asynchronous_rounds(late=True)

# The same in fit, where kdist's callbacks join the ranks at epoch ends in data parallelism.
class Straggle(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if (rank == 3 and epoch == 0) or (rank != 3 and epoch == 2):
            wait_for_the_others("epochs")

model = replica()
model.compile(keras.optimizers.SGD(0.01), "mse")
model.fit(np.ones((32, 3)), np.zeros((32, 2)), batch_size=8, epochs=3, verbose=0,
          callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0), Straggle(),
                     GossipAveraging("ring", asynchronous=True, consensus_every=0)])

# fit: each rank its own shard of one regression, replicas mixed every 2 steps.
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 4)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.7
keras.utils.set_random_seed(rank)
model = keras.Sequential([keras.layers.Dense(1)])  # no Input: built in its first step
model.compile(keras.optimizers.SGD(0.05), "mse")
fitted = GossipAveraging("ring", period=2, final_average=True, consensus_every=2)
history = model.fit(x[rank::size], y[rank::size], batch_size=16, epochs=4, verbose=0,
                    callbacks=[fitted])
out["fit"] = {"loss": history.history["loss"],
              "consensus": history.history["consensus_distance"],
              "rounds": fitted.rounds, "bytes": fitted.bytes_sent,
              "weights": flat_weights(model)}

# Checkpoints: rank 0's replica is saved each epoch, and a rerun resumes every rank from it.
def checkpointed_fit(epochs):
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")],
                             name="resumable")
    model.compile(keras.optimizers.SGD(0.05, name="sgd"), "mse")
    checkpoint = kdist.callbacks.Checkpoint(os.path.join(os.environ["KDIST_TEST_REPORTS"], "ck"))
    history = model.fit(x[rank::size], y[rank::size], batch_size=16, epochs=epochs, verbose=0,
                        callbacks=[checkpoint, GossipAveraging("ring", consensus_every=0)])
    return checkpoint.resumed_from, len(history.epoch)

checkpointed_fit(2)
out["resumed"] = checkpointed_fit(3)

# A GAN: both of its models are mixed.
import kdist.gan
keras.utils.set_random_seed(rank)
g = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
d = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, "sigmoid")])
gan = kdist.gan.GAN(g, d, seed=rank)
gan.compile(d_optimizer="adam", g_optimizer="adam")
before = flat_weights(gan)
gan.fit(rng.normal(size=(64, 2)).astype("float32"), batch_size=8, epochs=1, verbose=0,
        callbacks=[GossipAveraging("ring", final_average=True)])
out["gan"] = {"before": before, "after": flat_weights(gan)}
report(out)
"""


def test_gossip_on_four_ranks_agrees_keeps_the_mean_and_never_waits(mpirun):
    result = mpirun(GOSSIP, n=4, timeout=300)
    reports = [result.results[r] for r in range(4)]

    # Synchronous ring: every round removes two thirds of the disagreement, the mean stays.
    distances = np.array(reports[0]["sync"]["distances"])
    assert distances[0] > 1
    np.testing.assert_allclose(distances[1:] / distances[:-1], 1 / 3, rtol=1e-3)
    for report in reports:
        weights = np.array(report["sync"]["weights"])
        np.testing.assert_allclose(weights[:6], 1.5, atol=1e-3)
        np.testing.assert_allclose(weights[6:], -1.5, atol=1e-3)

    # Asynchronous: ranks 0-2 finished without rank 3 (else the job would have failed),
    # and everyone still came to agree.
    assert all(r["async"]["mixed"] > 0 and r["late"]["mixed"] > 0 for r in reports)
    assert reports[0]["async"]["distance"] < 0.05 * distances[0]

    # fit: the loss fell, the logs carry the spread, and the final average made one model.
    for report in reports:
        assert report["fit"]["loss"][-1] < 0.1 * report["fit"]["loss"][0]
        # Measured at epochs 2 and 4 only; 8 steps an epoch, mixed every 2nd, 5 float32
        # weights to each of 2 neighbours.
        assert len(report["fit"]["consensus"]) == 2
        assert report["fit"]["rounds"] == 16
        assert report["fit"]["bytes"] == 16 * 2 * 5 * 4
        np.testing.assert_allclose(report["fit"]["weights"], reports[0]["fit"]["weights"],
                                   atol=1e-6)
        np.testing.assert_allclose(report["gan"]["after"], reports[0]["gan"]["after"],
                                   atol=1e-6)
    assert reports[0]["gan"]["before"] != reports[1]["gan"]["before"]
    assert all(report["resumed"] == [2, 1] for report in reports)
    assert reports[0]["fit"]["weights"][:4] == pytest.approx([1, -2, 0.5, 3], abs=0.1)
