"""Pruning on the parameter server: the master owns the masks.

Workers' weights differ, so masks computed on workers would differ too. The
master instead recomputes each pruned layer's mask from the central kernel
when the layer's schedule says so (counting the master's updates as steps),
holds the central kernel at zero where the mask is, and sends the masks
down with the weights, so every worker computes with the master's masks.
"""

import numpy as np

from kdist.sparsity import pruned_layers


class CentralMasks:
    """Applies the masks of `model`'s pruned layers to flat centre vectors.

    Args:
        models: the model(s) the layout was made from.
        layout: their `kdist.ps.layout.Layout`.
        center: the starting centre, whose mask values (a resumed run's
            included) are the starting masks.
    """

    def __init__(self, models, layout, center):
        models = models if isinstance(models, (list, tuple)) else [models]
        where = {id(v): (int(layout.offsets[i]), int(layout.offsets[i + 1]))
                 for i, v in enumerate(layout.variables)}
        self.layers = []
        for model in models:
            for wrapper in pruned_layers(model):
                for target, mask in zip(wrapper.targets, wrapper.masks):
                    kernel, held = where[id(target)], where[id(mask)]
                    self.layers.append((wrapper, tuple(mask.shape), slice(*kernel),
                                        slice(*held), center[slice(*held)].copy()))

    def __bool__(self):
        return bool(self.layers)

    def __call__(self, center, step, reply=None):
        """Updates due masks before master update `step`, then applies all masks."""
        for wrapper, shape, kernel, mask, values in self.layers:
            if wrapper.schedule.should_prune(step):
                values[:] = wrapper.pattern_mask((center[kernel] * values).reshape(shape),
                                                 wrapper.schedule.sparsity(step)).ravel()
            for buffer in (center, reply):
                if buffer is not None:
                    buffer[mask] = values
                    np.multiply(buffer[kernel], values, out=buffer[kernel])


def for_models(models, layout, center):
    """A `CentralMasks` when the models are pruned, else None."""
    masks = CentralMasks(models, layout, center)
    return masks if masks else None
