"""The versions kdist supports, read from its own package metadata (pyproject.toml's
`dependencies`), so that pyproject, `kdist info` and the docs cannot disagree.

`benchmarks/versions.py` tests the ends of the range in fresh environments.
"""

import importlib.metadata

CHECKED = ("tensorflow", "keras")


def supported():
    """{package: version specifier} for the packages in CHECKED, as kdist declares them;
    empty when kdist's metadata is not installed (a checkout on `sys.path`)."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("kdist") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is None and requirement.name.lower() in CHECKED:
            # Lower bound first: ">=2.20,<2.22", as people write it.
            parts = sorted((str(spec) for spec in requirement.specifier),
                           key=lambda spec: not spec.startswith(">"))
            ranges[requirement.name.lower()] = ",".join(parts)
    return ranges


def outside(installed, ranges=None):
    """[(package, installed version, supported range)] for each package of `installed`
    ({package: version}) whose version kdist does not declare support for; `ranges`:
    `supported()`, when the caller has it already."""
    from packaging.specifiers import SpecifierSet

    ranges = supported() if ranges is None else ranges
    return [(name, version, ranges[name]) for name, version in sorted(installed.items())
            if name in ranges and not SpecifierSet(ranges[name]).contains(
                version, prereleases=True)]
