"""Virtual environments for the baselines whose pins clash with kdist's own.

BoTorch wants PyTorch and Ray Tune its own pins; each baseline runs in a venv the
benchmark makes once and then reuses, so kdist's environment is never touched.
"""

import os
import subprocess
import sys


def make_environment(venv, packages):
    """The Python of `venv`, created with `packages` installed if it does not exist yet."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", *packages], check=True)
    return python
