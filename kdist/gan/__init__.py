"""GAN training that knows there are two models.

>>> import kdist.gan
>>> kdist.gan.GAN.__name__
'GAN'
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "GAN": "kdist.gan.gan",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
