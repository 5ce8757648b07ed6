"""Helpers for scripts that tests run as TensorFlow workers (TF_CONFIG, no MPI)."""

import json
import os

from common import write_report


def task_index():
    """This worker's index: from TF_CONFIG, else its MPI rank, else 0."""
    if os.environ.get("TF_CONFIG"):
        return int(json.loads(os.environ["TF_CONFIG"]).get("task", {}).get("index", 0))
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", 0)))


def one_thread():
    """One TensorFlow thread of each kind: the test machines have few cores."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass  # a process that ran other scripts first (a shared test world) keeps its own


def report(obj):
    """Hands a JSON object back to the test, keyed by the TF_CONFIG task index."""
    write_report(task_index(), obj)
