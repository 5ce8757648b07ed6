"""The keras-tuner versions kdist's search is tested with, and two fixes to its base Oracle.

kdist's oracles and tuners use keras-tuner's public classes and a few of its
private helpers (`Oracle._random_values`, `_duplicate`, `_save_trial`, the
distributed chief/client). Those helpers may change in any release, so the
packaging pins keras-tuner to `TESTED_KERAS_TUNER` and importing
`kdist.tune` with another version warns.
"""

import numbers
import warnings
import zlib

import keras_tuner as kt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

TESTED_KERAS_TUNER = ">=1.4.7,<1.5"


def keras_tuner_is_tested(version=None):
    """Whether `version` (default: the installed one) is in the tested range."""
    return Version(version or kt.__version__) in SpecifierSet(TESTED_KERAS_TUNER)


def warn_if_untested():
    if not keras_tuner_is_tested():
        warnings.warn(f"kdist.tune is tested with keras-tuner {TESTED_KERAS_TUNER}; "
                      f"{kt.__version__} is installed. Install a tested version "
                      f"(pip install 'keras-tuner{TESTED_KERAS_TUNER}') if searches fail.",
                      stacklevel=3)


def keep_seed(oracle, seed):
    """Makes `seed=0` a seed: keras-tuner's Oracle replaces any false seed by a random one."""
    if seed is not None:
        if not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}.")
        oracle.seed = int(seed)
        oracle._seed_state = int(seed)


def trial_number(trial_id):
    """A non-negative integer for a trial id: its count when it is one (keras-tuner's
    ids are zero-padded counts), otherwise a stable hash, so any id seeds the same way."""
    text = str(trial_id)
    return int(text) if text.isdigit() else zlib.crc32(text.encode())
