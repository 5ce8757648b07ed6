"""Drop-in `tf.distribute` strategies: `with strategy.scope()` then plain `model.fit`."""

from kdist.distribute.mpi_strategy import MPIStrategy, slice_batches

__all__ = ["MPIStrategy", "slice_batches"]
