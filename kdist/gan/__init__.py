"""GAN training that knows there are two models.

`GAN(generator, discriminator)` is a `keras.Model` whose `fit` trains the two
in alternation, each with its own optimizer, conditional or not, with
auxiliary discriminator heads if any; it saves to `.keras` with both models
and both optimizers. The GAN guide covers the step, the batch formats,
distribution and a calorimeter example.

>>> import kdist.gan
>>> kdist.gan.GAN.__name__
'GAN'
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "GAN": "kdist.gan.gan",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
