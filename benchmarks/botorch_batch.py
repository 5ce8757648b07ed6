"""BoTorch's batched Bayesian optimisation on hpo.py's Branin and Hartmann-6, in rounds.

    python benchmarks/botorch_batch.py [--seeds 10] [--problems branin,hartmann6]
                                       [--batches 1,4,8] [--venv DIR]

A reference for what joint batch acquisition reaches on hpo.py's problems and
budget (30 trials), so that kdist's batched figures can be judged against the
state of the art and not only against keras-tuner and Optuna. BoTorch needs
PyTorch, which kdist does not, so it runs in a virtual environment of its own,
made once at `--venv` (default `~/.cache/kdist/botorch`, with `botorch`).

Per seed and batch size q: the same number of scrambled Sobol points as kdist's
`BayesianOracle` starts with (2 per input, at least 3, at most a third of the
trials), then rounds of q points until the budget is spent. A round fits
BoTorch's `SingleTaskGP` (its default priors, inputs in the unit cube, scores
standardised) to every result so far and maximises `qLogExpectedImprovement`
over the q points jointly (`optimize_acqf`, 10 restarts from 512 raw samples).
The JSON gives every run's regret and the median over seeds per batch size.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hpo  # noqa: E402  (the problems; numpy only at import)
from _environments import make_environment  # noqa: E402


def design_size(dimensions, trials):
    """Sobol points before the model, as kdist's BayesianOracle starts."""
    return max(3, min(2 * dimensions, trials // 3))


def search(name, seed, batch):
    """The regret of one batched search."""
    import numpy as np
    import torch
    from botorch.acquisition.logei import qLogExpectedImprovement
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import SingleTaskGP
    from botorch.optim import optimize_acqf
    from gpytorch.mlls import ExactMarginalLogLikelihood

    function, bounds, minimum, trials = hpo.PROBLEMS[name]
    low, high = np.array(bounds).T
    dimensions = len(bounds)
    torch.manual_seed(seed)
    torch.set_num_threads(1)

    def evaluate(points):
        return [function(low + point * (high - low)) for point in points]

    design = design_size(dimensions, trials)
    sobol = torch.quasirandom.SobolEngine(dimensions, scramble=True, seed=seed)
    inputs = sobol.draw(design, dtype=torch.double)
    values = evaluate(inputs.numpy())
    unit = torch.stack([torch.zeros(dimensions), torch.ones(dimensions)]).double()
    while len(values) < trials:
        count = min(batch, trials - len(values))
        scores = -torch.tensor(values, dtype=torch.double)[:, None]
        model = SingleTaskGP(inputs, scores)
        fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
        acquisition = qLogExpectedImprovement(model, best_f=scores.max())
        chosen, _ = optimize_acqf(acquisition, bounds=unit, q=count, num_restarts=10,
                                  raw_samples=512)
        inputs = torch.cat([inputs, chosen.detach()])
        values += evaluate(chosen.detach().numpy())
    return float(min(values) - minimum)


def inside(args):
    import warnings

    warnings.simplefilter("ignore")
    runs = {}
    for name in args.problems.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            regrets = [search(name, seed, batch) for seed in range(args.seeds)]
            runs.setdefault(name, {})[str(batch)] = {
                "median_regret": statistics.median(regrets), "regrets": regrets}
    print(json.dumps({"benchmark": "botorch_batch", "seeds": args.seeds,
                      "method": "qLogExpectedImprovement", "results": runs}, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--problems", default="branin,hartmann6")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--venv", default=os.path.expanduser("~/.cache/kdist/botorch"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in args.problems.split(","):
        if name not in ("branin", "hartmann6"):
            parser.error(f"unknown problem {name!r}; choose from branin, hartmann6")
    try:
        if any(int(b) < 1 for b in args.batches.split(",")) or args.seeds < 1:
            raise ValueError
    except ValueError:
        parser.error("--seeds and --batches take whole numbers of at least 1")
    if args.inside:
        return inside(args)
    python = make_environment(args.venv, ["botorch"])
    command = [python, os.path.abspath(__file__), "--inside", "--seeds", str(args.seeds),
               "--problems", args.problems, "--batches", args.batches]
    sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
