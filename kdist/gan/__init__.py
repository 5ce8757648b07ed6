"""GAN training that knows there are two models.

>>> import kdist.gan
>>> kdist.gan.GAN.__name__
'GAN'
"""

from kdist.gan.gan import GAN

__all__ = ["GAN"]
