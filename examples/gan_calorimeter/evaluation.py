"""How a calorimeter physicist judges generated showers, each figure beside its floor.

Every metric compares generated showers with a reference sample, and the
same metric between the reference and a second, independent reference
sample of the same size and primary energies (`floor`): what a perfect
generator would score with this many showers.

- histogram metrics, per high-level feature: separation power
  `0.5 * sum((p - q)**2 / (p + q))` of the normalised histograms (0 when they
  agree, 1 when they do not overlap) and chi-squared per degree of freedom of
  the two-sample test (`scipy.stats.chi2_contingency`);
- features: deposited over primary energy, energy per layer (longitudinal
  profile), per cell along x and y (transverse profiles), shower depth (the
  energy-weighted mean layer), centre of gravity and width along x and y per
  layer, sparsity (fraction of empty cells) and the cell-energy spectrum;
- classifier AUC: a gradient-boosted classifier (scikit-learn) trained to
  tell reference from generated showers, on the high-level features and on
  the cells (log energies, summed over 5x5x5 blocks), scored out of fold;
  0.5 is perfect, 1 means every shower is told apart;
- FPD and KPD (Frechet and kernel physics distances, `distances.py`) on ten
  high-level features;
- energy response (mean deposited over primary energy) and resolution
  (its relative spread) per primary-energy bin, and the generated over the
  reference response;
- generation time per shower, when given.

Showers are `(N, x, y, depth)` arrays in GeV. Everything here is numpy,
scipy, scikit-learn and matplotlib; nothing depends on kdist.
"""

import json
import os

import numpy as np

# Cells below this (GeV) count as empty: well under one ionisation hit.
EMPTY_BELOW = 1e-5
HISTOGRAM_BINS = 30
ENERGY_BINS = (10.0, 50.0, 100.0, 200.0, 350.0, 500.0)


def high_level_features(showers, energies):
    """name -> (N,) or (N, k) per-shower features (see the module docstring)."""
    showers = np.asarray(showers, np.float64)
    energies = np.asarray(energies, np.float64).reshape(-1)
    cells = showers.shape[1]
    coords = np.arange(cells) + 0.5
    total = showers.sum(axis=(1, 2, 3))
    longitudinal = showers.sum(axis=(1, 2))                    # (N, depth)
    per_layer = np.maximum(longitudinal, 1e-12)
    x_profile = showers.sum(axis=(2, 3))
    y_profile = showers.sum(axis=(1, 3))
    x_layer = showers.sum(axis=2)                              # (N, x, depth)
    y_layer = showers.sum(axis=1)                              # (N, y, depth)
    centre_x = np.einsum("nxd,x->nd", x_layer, coords) / per_layer
    centre_y = np.einsum("nyd,y->nd", y_layer, coords) / per_layer
    spread_x = np.einsum("nxd,x->nd", x_layer, coords ** 2) / per_layer - centre_x ** 2
    spread_y = np.einsum("nyd,y->nd", y_layer, coords ** 2) / per_layer - centre_y ** 2
    depth = (longitudinal @ coords) / np.maximum(total, 1e-12)
    return {
        "energy_ratio": total / energies,
        "longitudinal": longitudinal,
        "transverse_x": x_profile,
        "transverse_y": y_profile,
        "shower_depth": depth,
        "centre_x": centre_x,
        "centre_y": centre_y,
        "width_x": np.sqrt(np.maximum(spread_x, 0.0)),
        "width_y": np.sqrt(np.maximum(spread_y, 0.0)),
        "sparsity": (showers <= EMPTY_BELOW).mean(axis=(1, 2, 3)),
    }


def separation_power(reference, other, bins=HISTOGRAM_BINS):
    """0.5 * sum((p - q)^2 / (p + q)) over shared bins of the two normalised
    histograms: 0 for the same distribution, 1 for disjoint ones."""
    edges = _edges(reference, other, bins)
    p = np.histogram(reference, edges)[0].astype(float)
    q = np.histogram(other, edges)[0].astype(float)
    p, q = p / max(p.sum(), 1.0), q / max(q.sum(), 1.0)
    both = (p + q) > 0
    return float(0.5 * np.sum((p[both] - q[both]) ** 2 / (p[both] + q[both])))


def chi2_per_dof(reference, other, bins=HISTOGRAM_BINS):
    """Chi-squared per degree of freedom of the two-sample histogram test."""
    from scipy.stats import chi2_contingency

    edges = _edges(reference, other, bins)
    table = np.stack([np.histogram(reference, edges)[0], np.histogram(other, edges)[0]])
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 0.0
    statistic, _, dof, _ = chi2_contingency(table, correction=False)
    return float(statistic / dof)


def _edges(a, b, bins):
    both = np.concatenate([np.ravel(a), np.ravel(b)])
    both = both[np.isfinite(both)]
    low, high = np.percentile(both, [0.5, 99.5]) if both.size else (0.0, 1.0)
    if high <= low:
        low, high = low - 0.5, high + 0.5
    return np.linspace(low, high, bins + 1)


def histogram_metrics(reference_features, other_features):
    """feature -> {"separation_power", "chi2_per_dof"}. A profile (N, k) is
    compared position by position (layer, or cell along x or y); its figures
    are the means over positions, with the separation power of each beside."""
    result = {}
    for name, ref in reference_features.items():
        other = other_features[name]
        if ref.ndim == 1:
            result[name] = {"separation_power": separation_power(ref, other),
                            "chi2_per_dof": chi2_per_dof(ref, other)}
            continue
        powers = [separation_power(ref[:, k], other[:, k]) for k in range(ref.shape[1])]
        chi2s = [chi2_per_dof(ref[:, k], other[:, k]) for k in range(ref.shape[1])]
        result[name] = {"separation_power": float(np.mean(powers)),
                        "chi2_per_dof": float(np.mean(chi2s)),
                        "separation_power_per_position": [float(v) for v in powers]}
    return result


def spectrum_separation(reference, other, bins=HISTOGRAM_BINS):
    """Separation power of the log10 energies of non-empty cells."""
    ref = np.log10(reference[reference > EMPTY_BELOW])
    oth = np.log10(other[other > EMPTY_BELOW])
    if not ref.size or not oth.size:
        return 1.0
    return separation_power(ref, oth, bins)


def feature_matrix(features):
    """The high-level features as one (N, k) matrix, for classifiers and FPD/KPD."""
    columns = []
    for name in sorted(features):
        values = features[name]
        if name in ("longitudinal", "transverse_x", "transverse_y"):
            values = np.log10(np.maximum(values, EMPTY_BELOW))
        columns.append(values.reshape(len(values), -1))
    return np.concatenate(columns, axis=1)


def distance_features(features, blocks=5):
    """Ten features per shower for FPD and KPD, whose covariance estimates need
    far fewer features than showers: energy ratio, shower depth, sparsity, the
    mean widths along x and y, and the fractions of the energy in `blocks`
    groups of consecutive layers."""
    longitudinal = features["longitudinal"]
    share = longitudinal / np.maximum(longitudinal.sum(axis=1, keepdims=True), 1e-12)
    groups = np.array_split(np.arange(share.shape[1]), blocks)
    columns = [features["energy_ratio"], features["shower_depth"], features["sparsity"],
               (features["width_x"] * share).sum(axis=1), (features["width_y"] * share).sum(axis=1)]
    columns += [share[:, g].sum(axis=1) for g in groups]
    return np.stack(columns, axis=1)


def cell_matrix(showers, block=5):
    """Log cell energies summed over block^3 cells: (N, (cells/block)^3)."""
    n, cells = showers.shape[0], showers.shape[1]
    k = cells // block
    trimmed = showers[:, :k * block, :k * block, :k * block]
    summed = trimmed.reshape(n, k, block, k, block, k, block).sum(axis=(2, 4, 6))
    return np.log10(np.maximum(summed.reshape(n, -1), EMPTY_BELOW))


def classifier_auc(reference, other, seed=0, folds=3):
    """Out-of-fold ROC AUC of a classifier telling `other` rows from `reference` rows."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    x = np.concatenate([reference, other]).astype(np.float32)
    y = np.concatenate([np.zeros(len(reference)), np.ones(len(other))])
    x = np.where(np.isfinite(x), x, 0.0)
    model = HistGradientBoostingClassifier(max_iter=100, learning_rate=0.1,
                                           early_stopping=False, random_state=seed)
    scores = cross_val_predict(model, x, y, method="predict_proba",
                               cv=StratifiedKFold(folds, shuffle=True, random_state=seed))[:, 1]
    auc = float(roc_auc_score(y, scores))
    # Telling them apart with the labels swapped is as good: report the side above 0.5.
    return max(auc, 1.0 - auc)


def physics_distances(reference, other):
    """{"fpd": [value, error], "kpd": [value, error]} of `distances`."""
    import distances

    return {"fpd": list(distances.fpd(reference, other)),
            "kpd": list(distances.kpd(reference, other))}


def energy_response(showers, energies, bins=ENERGY_BINS):
    """Per primary-energy bin: showers, response (mean deposited / primary)
    and resolution (standard deviation over mean of that ratio)."""
    energies = np.asarray(energies, float).reshape(-1)
    ratio = np.asarray(showers, np.float64).sum(axis=(1, 2, 3)) / energies
    rows = []
    for low, high in zip(bins[:-1], bins[1:]):
        inside = (energies >= low) & (energies < high) if high != bins[-1] else (
            (energies >= low) & (energies <= high))
        if inside.sum() < 2:
            continue
        mean = float(ratio[inside].mean())
        rows.append({"energy_bin": [float(low), float(high)], "showers": int(inside.sum()),
                     "response": mean,
                     "resolution": float(ratio[inside].std() / mean) if mean else float("inf")})
    return rows


def describe(showers, energies, classifier=True):
    """What the metrics read of one sample, computed once however many
    comparisons it takes part in."""
    features = high_level_features(showers, energies)
    return {"showers": showers, "features": features, "matrix": feature_matrix(features),
            "cells": cell_matrix(showers) if classifier else None,
            "distance": distance_features(features),
            "response": energy_response(showers, energies)}


def compare(reference, other, seed=0):
    """Every metric of `other` against `reference`, two `describe` results;
    the classifier AUCs when both were described with their cells."""
    ref_features, oth_features = reference["features"], other["features"]
    result = {"histograms": histogram_metrics(ref_features, oth_features),
              "cell_spectrum_separation_power": spectrum_separation(reference["showers"],
                                                                    other["showers"]),
              "sparsity": {"reference": float(ref_features["sparsity"].mean()),
                           "other": float(oth_features["sparsity"].mean())}}
    if reference["cells"] is not None and other["cells"] is not None:
        result["classifier_auc_high_level"] = classifier_auc(reference["matrix"],
                                                             other["matrix"], seed)
        result["classifier_auc_cells"] = classifier_auc(reference["cells"], other["cells"],
                                                        seed)
    result["physics_distances"] = physics_distances(reference["distance"], other["distance"])
    oth_response = {tuple(r["energy_bin"]): r for r in other["response"]}
    result["energy_response"] = [
        {"energy_bin": r["energy_bin"], "showers": r["showers"],
         "response_reference": r["response"],
         "response_other": oth_response[tuple(r["energy_bin"])]["response"],
         "response_ratio": oth_response[tuple(r["energy_bin"])]["response"] / r["response"],
         "resolution_reference": r["resolution"],
         "resolution_other": oth_response[tuple(r["energy_bin"])]["resolution"]}
        for r in reference["response"] if tuple(r["energy_bin"]) in oth_response]
    return result


def evaluate(reference, second_reference, generated, energies, seed=0, classifier=True,
             generation_seconds_per_shower=None, simulation_seconds_per_shower=None,
             second_energies=None):
    """{"generated": compare(reference, generated), "floor": compare(reference,
    second_reference), "timing": ..., "summary": rows}. `generated` is for the
    reference's `energies`; `second_reference` too, unless `second_energies`
    gives its own (a second part of the same real files)."""
    second_energies = energies if second_energies is None else second_energies
    base = describe(reference, energies, classifier)
    generated_figures = compare(base, describe(generated, energies, classifier), seed)
    floor = compare(base, describe(second_reference, second_energies, classifier), seed)
    result = {"showers": int(len(reference)), "generated": generated_figures, "floor": floor,
              "timing": {"generation_seconds_per_shower": generation_seconds_per_shower,
                         "simulation_seconds_per_shower": simulation_seconds_per_shower}}
    result["summary"] = summary_rows(result)
    return result


TARGETS = {
    "energy response, worst bin (generated / reference - 1)": ("<=", 0.02),
    "energy resolution, worst bin (generated / reference)": ("<=", 1.5),
    "sparsity (generated - reference)": ("<=", 0.02),
    "longitudinal profile separation power": ("<= 10x floor", 10.0),
    "transverse profile separation power (x, y mean)": ("<= 10x floor", 10.0),
    "classifier AUC, high-level features": ("<=", 0.90),
}

# What the GAN entries of the CaloChallenge 2022 reached (arXiv:2410.21611,
# its result tables); Geant4 against itself gives 0.50.
CALOCHALLENGE_GANS = {
    "classifier AUC, high-level features": "0.92-0.99",
    "classifier AUC, cells": "0.89-0.94",
}


def summary_rows(result):
    """[{"metric", "generated", "floor", "target", "met"}] for the report table."""
    gen, floor = result["generated"], result["floor"]

    def worst_response(figures):
        rows = figures["energy_response"]
        return max(abs(r["response_ratio"] - 1.0) for r in rows) if rows else float("nan")

    def sparsity_gap(figures):
        return abs(figures["sparsity"]["other"] - figures["sparsity"]["reference"])

    def transverse(figures):
        h = figures["histograms"]
        return 0.5 * (h["transverse_x"]["separation_power"] + h["transverse_y"]["separation_power"])

    def worst_resolution(figures):
        rows = figures["energy_response"]
        return max(r["resolution_other"] / r["resolution_reference"] for r in rows) if rows \
            else float("nan")

    rows = [
        ("energy response, worst bin (generated / reference - 1)", worst_response),
        ("energy resolution, worst bin (generated / reference)", worst_resolution),
        ("sparsity (generated - reference)", sparsity_gap),
        ("longitudinal profile separation power",
         lambda f: f["histograms"]["longitudinal"]["separation_power"]),
        ("transverse profile separation power (x, y mean)", transverse),
        ("shower depth separation power",
         lambda f: f["histograms"]["shower_depth"]["separation_power"]),
        ("width x separation power", lambda f: f["histograms"]["width_x"]["separation_power"]),
        ("energy ratio separation power",
         lambda f: f["histograms"]["energy_ratio"]["separation_power"]),
        ("energy ratio chi2 / dof", lambda f: f["histograms"]["energy_ratio"]["chi2_per_dof"]),
        ("cell spectrum separation power", lambda f: f["cell_spectrum_separation_power"]),
        ("classifier AUC, high-level features", lambda f: f.get("classifier_auc_high_level")),
        ("classifier AUC, cells", lambda f: f.get("classifier_auc_cells")),
        ("FPD", lambda f: f["physics_distances"]["fpd"][0]),
        ("KPD", lambda f: f["physics_distances"]["kpd"][0]),
    ]
    table = []
    for name, measure in rows:
        value, base = measure(gen), measure(floor)
        row = {"metric": name, "generated": value, "floor": base, "target": None, "met": None,
               "calochallenge_gans": CALOCHALLENGE_GANS.get(name)}
        if name in TARGETS and value is not None:
            kind, bound = TARGETS[name]
            row["target"] = f"{kind} {bound}" if kind == "<=" else kind
            row["met"] = bool(value <= (bound * base if kind != "<=" else bound))
        table.append(row)
    return table


def markdown(result):
    """The summary as a markdown table."""
    def cell(value):
        if value is None:
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:.4g}"

    lines = [f"Generated against reference showers ({result['showers']} of each); the floor is "
             "a second reference sample of the same size and energies.", "",
             "| metric | generated | floor | target | met | CaloChallenge GANs |",
             "|---|---|---|---|---|---|"]
    for row in result["summary"]:
        met = cell(row["met"]) if row["met"] is not None else ""
        lines.append(f"| {row['metric']} | {cell(row['generated'])} | {cell(row['floor'])} | "
                     f"{row['target'] or ''} | {met} | {row.get('calochallenge_gans') or ''} |")
    timing = [(what, result["timing"][f"{what}_seconds_per_shower"])
              for what in ("generation", "simulation")]
    timing = [f"{what}: {1e3 * seconds:.3g} ms per shower" for what, seconds in timing
              if seconds is not None]
    if timing:
        lines += ["", "; ".join(timing).capitalize() + "."]
    return "\n".join(lines) + "\n"


def plot(reference, second_reference, generated, energies, output, second_energies=None):
    """Step histograms with ratio panels (over the reference) of the main features;
    returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    second_energies = energies if second_energies is None else second_energies
    samples = [("reference", reference, energies, "black"),
               ("reference 2 (floor)", second_reference, second_energies, "grey"),
               ("generated", generated, energies, "tab:red")]
    features = [(label, high_level_features(s, e), colour) for label, s, e, colour in samples]
    panels = [("energy_ratio", "deposited / primary energy"),
              ("shower_depth", "shower depth (layer)"),
              ("sparsity", "fraction of empty cells"),
              ("width_x", "width along x, layer 12 (cells)"),
              ("centre_x", "centre along x, layer 12 (cells)")]
    written = []
    for name, xlabel in panels:
        values = [(label, f[name] if f[name].ndim == 1 else f[name][:, f[name].shape[1] // 2],
                   colour) for label, f, colour in features]
        edges = _edges(values[0][1], values[2][1], HISTOGRAM_BINS)
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 5), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1]})
        counts = {}
        for label, v, colour in values:
            counts[label] = top.hist(v, edges, histtype="step", color=colour, label=label,
                                     density=True)[0]
        top.set_ylabel("showers (normalised)")
        top.legend(frameon=False, fontsize=8)
        centres = 0.5 * (edges[1:] + edges[:-1])
        base = counts["reference"]
        for label, _, colour in values[1:]:
            with np.errstate(divide="ignore", invalid="ignore"):
                bottom.step(centres, np.where(base > 0, counts[label] / base, np.nan),
                            where="mid", color=colour)
        bottom.axhline(1.0, color="black", lw=0.8)
        bottom.set_ylim(0.5, 1.5)
        bottom.set_ylabel("/ reference")
        bottom.set_xlabel(xlabel)
        fig.tight_layout()
        path = os.path.join(output, f"feature_{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def write_report(result, output):
    """evaluation.json and evaluation.md in `output`, each written atomically."""
    import data

    os.makedirs(output, exist_ok=True)
    for name, text in (("evaluation.json", json.dumps(result, indent=1)),
                       ("evaluation.md", markdown(result))):
        def write(path, text=text):
            with open(path, "w") as f:
                f.write(text)

        data.replace_atomically(os.path.join(output, name), write)
