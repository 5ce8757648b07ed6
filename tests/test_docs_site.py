"""The docs site builds with every link, anchor and docstring checked."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
pytest.importorskip("mkdocstrings_handlers.python",
                    reason="the docs extra (mkdocstrings[python]) is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    # Under --strict any warning (a broken link or anchor, a docstring griffe cannot parse)
    # fails the build; the log names it.
    assert done.returncode == 0, done.stderr[-5000:]
    return site


def test_every_guide_and_reference_page_is_built(site):
    guides = [page.stem for page in (ROOT / "docs").glob("*.md") if page.stem != "index"]
    references = [page.stem for page in (ROOT / "docs" / "reference").glob("*.md")]
    assert guides and references
    assert (site / "index.html").is_file()
    for guide in guides:
        assert (site / guide / "index.html").is_file(), guide
    for reference in references:
        assert (site / "reference" / reference / "index.html").is_file(), reference


@pytest.mark.parametrize("page, names", [
    ("optimizers", ["kdist.optimizers.DistributedOptimizer", "kdist.optimizers.load_model"]),
    ("callbacks", ["kdist.callbacks.BroadcastGlobalVariablesCallback",
                   "kdist.callbacks.MetricAverageCallback"]),
    ("kdist", ["kdist.allreduce", "kdist.init"]),
    ("distribute", ["kdist.distribute.mpi_strategy.MPIStrategy"]),
    ("ps", ["kdist.ps.ParameterServerStrategy"]),
    ("sparsity", ["kdist.sparsity.prune"]),
    ("elastic", ["kdist.elastic.KerasState"]),
    ("tensor_parallel", ["kdist.tensor_parallel.ColumnParallelDense",
                         "kdist.tensor_parallel.TensorParallelMultiHeadAttention"]),
    ("pipeline", ["kdist.pipeline.PipelineModel", "kdist.pipeline.split",
                  "kdist.pipeline.ColumnParallelDense", "kdist.pipeline.schedule"]),
])
def test_reference_pages_document_the_public_names(site, page, names):
    html = (site / "reference" / page / "index.html").read_text()
    for name in names:
        assert f'id="{name}"' in html, name
