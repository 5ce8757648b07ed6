"""Gradient accumulation: several backward passes for each allreduce and update."""

from keras import ops

from kdist import _keras_private


class LocalGradientAggregator:
    """Sums one rank's gradients over `backward_passes_per_step` backward passes.

    The distributed optimizer adds each pass's gradients to per-variable
    accumulators and counts the pass in `counter`; on the last pass of a cycle
    it reduces the sums across ranks, applies them and `reset`s. Resetting
    assigns zeros rather than scaling by zero, so an infinite gradient in one
    cycle does not turn the next cycle's sums into NaN. Horovod scripts reach
    this object as `optimizer._agg_helper`. Sparse gradients (`tf.IndexedSlices`) are
    added into dense accumulators.

    Args:
        optimizer: the Keras optimizer that owns the variables made here.
        backward_passes_per_step: passes per cycle (at least 2).
        average_aggregated_gradients: divide the reduced sums by that number.

    Attributes:
        counter: an int32 variable, the passes added since the last reset.
        accumulators: one variable per trainable variable, in the optimizer's variable
            order, holding this rank's sums (made by `build`).

    Example:

        >>> import keras, kdist
        >>> opt = kdist.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=4)
        >>> int(opt._agg_helper.counter.numpy())
        0
    """

    def __init__(self, optimizer, backward_passes_per_step, average_aggregated_gradients):
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self._optimizer = optimizer
        self.counter = optimizer.add_variable(
            shape=(), initializer="zeros", dtype="int32", name="backward_passes")
        self.accumulators = []

    def build(self, var_list):
        """Makes one zero accumulator per variable, in the optimizer's variable order."""
        self.accumulators = [
            self._optimizer.add_variable_from_reference(v, name="gradient_accumulator")
            for v in var_list
        ]

    def _accumulator(self, variable):
        return self.accumulators[_keras_private.optimizer_variable_index(self._optimizer, variable)]

    def add(self, grads, variables):
        """Adds one pass's gradients (dense or `tf.IndexedSlices`) and counts the pass."""
        for grad, variable in zip(grads, variables):
            if grad is not None:
                self._optimizer.assign_add(self._accumulator(variable), grad)
        self.counter.assign_add(1)

    def sums(self, grads, variables):
        """The accumulated sums, None where `grads` has None."""
        return [None if g is None else ops.convert_to_tensor(self._accumulator(v))
                for g, v in zip(grads, variables)]

    def is_last_pass(self):
        """True (as a tensor) once the cycle's last pass has been added."""
        return ops.equal(self.counter, self.backward_passes_per_step)

    def is_update_pass(self):
        """True (as a tensor) when the pass just completed a cycle and reset the counter."""
        return ops.equal(self.counter, 0)

    def finish(self, reduced):
        """Divides the reduced sums by the passes per cycle, if asked to average them."""
        if not self.average_aggregated_gradients:
            return reduced
        scale = 1.0 / self.backward_passes_per_step
        return [None if g is None else g * scale for g in reduced]

    def reset(self):
        """Zeroes the accumulators and the pass counter."""
        for accumulator in self.accumulators:
            accumulator.assign(ops.zeros(accumulator.shape, dtype=accumulator.dtype))
        self.counter.assign(0)
