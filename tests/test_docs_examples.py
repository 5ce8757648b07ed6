"""Every Python code block of README.md and docs/ runs (see docs_runner.py for the markers).

Single-process blocks of a page run in order in one process without a launcher
(the shared one of conftest's `python_script`); a block marked `<!-- docs: mpi N -->`
runs on N ranks of a shared world (`mpirun`). Each in a temporary directory, since
blocks write checkpoints and exported models.
"""

import functools
import glob
import os

import pytest

import docs_runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
RUNNER = os.path.join(ROOT, "tests", "docs_runner.py")


@functools.cache
def _blocks(page):
    with open(page) as file:
        return docs_runner.blocks(file.read())


def _id(page):
    return os.path.relpath(page, ROOT)


SINGLE = [p for p in PAGES if any(b.kind != "mpi" and b.kind != "skip" for b in _blocks(p))]
MULTI = [(p, b) for p in PAGES for b in _blocks(p) if b.kind == "mpi"]


def test_every_page_with_python_is_covered_and_skips_say_why():
    kinds = {b.kind for p in PAGES for b in _blocks(p)}
    assert {"run", "doctest", "mpi", "signature"} <= kinds
    for page in PAGES:
        for block in _blocks(page):
            if block.kind == "skip":
                assert len(block.argument) > 10, f"{_id(page)}:{block.line} skips without reason"
            if block.kind == "mpi":
                assert 2 <= block.ranks <= 4, f"{_id(page)}:{block.line}: 2 to 4 ranks"


def test_a_signature_block_that_drifts_fails():
    namespace = docs_runner.preamble()
    exec("import kdist", namespace)
    docs_runner.check_signatures("kdist.callbacks.Checkpoint(directory, ...)", namespace, "x")
    with pytest.raises(AssertionError, match="no parameter 'every'"):
        docs_runner.check_signatures("kdist.callbacks.Checkpoint(directory, every=1)",
                                     namespace, "x")
    with pytest.raises(AssertionError, match="does not show"):
        docs_runner.check_signatures("kdist.callbacks.Checkpoint(directory)", namespace, "x")


@pytest.mark.parametrize("page", SINGLE, ids=_id)
def test_single_process_blocks_run(page, tmp_path, python_script):
    python_script(RUNNER, [page], cwd=tmp_path, timeout=420)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", sorted({b.ranks for _, b in MULTI}))
def test_multi_rank_blocks_run(ranks, mpirun, tmp_path):
    # One job for all blocks of a size: each starts from a fresh preamble in its own
    # directory, and the job is spared a TensorFlow start per block.
    chosen = [(p, b) for p, b in MULTI if b.ranks == ranks]
    each = [f"{p}:{b.index}" for p, b in chosen]
    job = mpirun(RUNNER, n=ranks, args=["--cwd", tmp_path, "--each", *each],
                 timeout=120 + 60 * len(chosen), check=False)
    done = [line for line in job.output.splitlines() if line.startswith(("ok: ", "FAILED: "))]
    assert job.returncode == 0 and len(done) == ranks * len(chosen), (
        "\n".join(done) + "\n" + job.output[-5000:])
