"""One table from several trainings of the same setting: each metric's spread.

    python replicates.py run1/validation run2/validation run3/validation [--output table.md]

A GAN's figures move from one training to the next, so a setting is judged
by several replicates (the same command with `--seed 0`, `1`, `2`), each
validated with `validate.py`. This reads their `evaluation.json` files and
writes one markdown row per metric: the median and the range over the
replicates, the floor (the median of theirs), the target, how many replicates
met it, and what the CaloChallenge GANs reached.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import evaluation  # noqa: E402


def load(directories):
    """The evaluation.json of each of `directories`, as dicts."""
    reports = []
    for directory in directories:
        path = os.path.join(directory, "evaluation.json")
        if not os.path.exists(path):
            raise SystemExit(f"No {path}; run validate.py --output {directory} first.")
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def combine(reports):
    """[{"metric", "median", "low", "high", "floor", "target", "met", "replicates",
    "calochallenge_gans"}] over the reports' summaries, in their order."""
    if not reports:
        raise ValueError("No reports to combine.")
    names = [row["metric"] for row in reports[0]["summary"]]
    for report in reports[1:]:
        if [row["metric"] for row in report["summary"]] != names:
            raise ValueError("The reports list different metrics; validate every replicate "
                             "with the same validate.py.")
    table = []
    for index, name in enumerate(names):
        rows = [report["summary"][index] for report in reports]
        values = [r["generated"] for r in rows if r["generated"] is not None]
        floors = [r["floor"] for r in rows if r["floor"] is not None]
        met = [r["met"] for r in rows if r["met"] is not None]
        table.append({
            "metric": name, "replicates": len(values),
            "median": float(np.median(values)) if values else None,
            "low": float(min(values)) if values else None,
            "high": float(max(values)) if values else None,
            "floor": float(np.median(floors)) if floors else None,
            "target": rows[0]["target"], "met": sum(met) if met else None,
            "calochallenge_gans": evaluation.CALOCHALLENGE_GANS.get(name)})
    return table


def markdown(table, showers=None):
    """The combined table as markdown."""
    def number(value):
        return "n/a" if value is None else f"{value:.3g}"

    count = max((row["replicates"] for row in table), default=0)
    lines = [f"{count} replicates" + (f", {showers} showers each" if showers else "")
             + "; generated: median (lowest-highest); met: replicates that met the target.",
             "", "| metric | generated | floor | target | met | CaloChallenge GANs |",
             "|---|---|---|---|---|---|"]
    for row in table:
        spread = (f"{number(row['median'])} ({number(row['low'])}-{number(row['high'])})"
                  if row["median"] is not None else "n/a")
        met = f"{row['met']} of {row['replicates']}" if row["met"] is not None else ""
        lines.append(f"| {row['metric']} | {spread} | {number(row['floor'])} | "
                     f"{row['target'] or ''} | {met} | {row['calochallenge_gans'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directories", nargs="+", help="validate.py output directories")
    parser.add_argument("--output", help="write the table here too")
    args = parser.parse_args(argv)
    reports = load(args.directories)
    text = markdown(combine(reports), showers=reports[0].get("showers"))
    if args.output:
        import data

        def write(path):
            with open(path, "w") as f:
                f.write(text)

        data.replace_atomically(args.output, write)
    print(text, end="")


if __name__ == "__main__":
    main()
