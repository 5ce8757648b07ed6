"""A population's history at a glance: each member's score and hyper-parameters
round by round, with the exploit steps that moved it onto another member's weights."""

from kdist.tune.population import lineage, searched_values


def _finished_rounds(oracle):
    rounds = {}
    for trial_id, trial in oracle.trials.items():
        values = trial.hyperparameters.values
        if trial.score is not None and "pbt/member" in values:
            rounds[trial_id] = (values, float(trial.score))
    return rounds


def _is_log(oracle, name):
    for hp in oracle.hyperparameters.space:
        if hp.name == name:
            return getattr(hp, "sampling", None) == "log"
    return False


def plot_population(oracle, path=None, hyperparameters=None, axes=None):
    """Plots population-based training's rounds: the score each round ended with
    (top panel) and each explored hyper-parameter (one panel each) against the
    epoch, one colour per member, with matplotlib. A dashed line marks an
    exploit: the member took the weights of the round it starts from. The best
    trial's lineage, whose values `learned_schedule()` gives, is drawn thick.
    Hyper-parameters sampled on a log scale get log axes.

    Args:
        oracle: a `PBTOracle` (`tuner.oracle` of a `PBT` tuner) with finished rounds.
        path: where to save the figure (PNG, PDF, ... by its suffix); None leaves
            it open.
        hyperparameters: the names to plot (default: every explored number).
        axes: matplotlib axes to draw on, one for the score and one per name
            (default: a new figure).

    Returns:
        The list of matplotlib axes.

    Raises:
        ValueError: no round has finished, a name in `hyperparameters` is not
            an explored number, or `axes` does not hold one axes for the score
            and one per name.
    """
    import matplotlib
    import matplotlib.ticker

    if axes is None and path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rounds = _finished_rounds(oracle)
    if not rounds:
        raise ValueError("plot_population: no round has finished yet.")
    explored = sorted({name for values, _ in rounds.values()
                       for name, value in searched_values(values).items()
                       if isinstance(value, (int, float)) and not isinstance(value, bool)})
    names = explored if hyperparameters is None else list(hyperparameters)
    unknown = [name for name in names if name not in explored]
    if unknown:
        raise ValueError(f"plot_population: {unknown} are not explored numbers; "
                         f"choose among {explored}.")
    if axes is None:
        _, axes = plt.subplots(1 + len(names), 1, sharex=True,
                               figsize=(6, 2.2 * (1 + len(names))), squeeze=False)
        axes = list(axes[:, 0])
    elif len(axes) != 1 + len(names):
        raise ValueError(f"plot_population: {len(axes)} axes given for the score and "
                         f"{len(names)} hyper-parameter(s).")
    best = oracle.get_best_trials(1)
    thick = set(lineage(oracle.trials, best[0].trial_id)) if best else set()
    for trial_id, (values, score) in rounds.items():
        colour = f"C{values['pbt/member'] % 10}"
        width = 2.5 if trial_id in thick else 1.0
        start, end = values["tuner/initial_epoch"], values["tuner/epochs"]
        parent = rounds.get(values.get("tuner/trial_id"))
        exploited = parent is not None and parent[0]["pbt/member"] != values["pbt/member"]
        style = "--" if exploited else "-"
        if parent is not None:
            axes[0].plot([start, end], [parent[1], score], style, color=colour, lw=width)
        axes[0].plot([end], [score], "o", color=colour, ms=3)
        for ax, name in zip(axes[1:], names):
            value = values.get(name)
            if value is None:
                continue
            ax.plot([start, end], [value, value], "-", color=colour, lw=width)
            before = None if parent is None else parent[0].get(name)
            if before is not None and before != value:
                ax.plot([start, start], [before, value], style, color=colour, lw=width)
    objective = oracle.objective
    axes[0].set_ylabel(f"{objective.name} ({objective.direction})")
    for ax, name in zip(axes[1:], names):
        ax.set_ylabel(name)
        if _is_log(oracle, name):
            ax.set_yscale("log")
    axes[-1].set_xlabel("epoch")
    members = sorted({values["pbt/member"] for values, _ in rounds.values()})
    axes[0].set_title(f"{len(members)} members, {len(rounds)} rounds; dashed: exploit, "
                      "thick: the best trial's lineage", fontsize=9)
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if path is not None:
        axes[0].figure.tight_layout()
        axes[0].figure.savefig(path)
        plt.close(axes[0].figure)
    return axes
