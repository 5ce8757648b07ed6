"""The master's whole state on disk: centre, rule state, clock, epoch, history.

One file, written atomically after each epoch; rerunning the same command
finds it and goes on from the next epoch.
"""

import os

import numpy as np

from kdist.callbacks.checkpoint import write_npz_atomically

FILENAME = "master.npz"


def path_in(directory):
    return os.path.join(directory, FILENAME)


def save(directory, epoch, snapshot, config, history):
    """Writes the master's state as of the end of `epoch`."""
    arrays = {"center": snapshot["center"]}
    arrays.update({f"rule/{k}": v for k, v in snapshot["rule"].items()})
    meta = {"epoch": int(epoch), "clock": int(snapshot["clock"]), "config": config,
            "history": history}
    write_npz_atomically(path_in(directory), arrays, meta)


def load(directory, expected_size, config):
    """The saved state, or None when there is none yet."""
    import json

    path = path_in(directory)
    if not os.path.exists(path):
        return None
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        center = np.array(data["center"], dtype=np.float32)
        rule = {k[5:]: np.array(data[k]) for k in data.files if k.startswith("rule/")}
    if center.shape[0] != expected_size:
        raise ValueError(
            f"{path} holds a model of {center.shape[0]} values but this model has "
            f"{expected_size}: it was written by another model. Move it away or choose "
            "another checkpoint_dir.")
    if meta["config"].get("mode") != config.get("mode"):
        raise ValueError(
            f"{path} was written in mode {meta['config'].get('mode')!r}; this run uses "
            f"{config.get('mode')!r}. Resume with the same mode or another checkpoint_dir.")
    saved_servers = meta["config"].get("servers", 1)
    if saved_servers != config.get("servers", 1):
        raise ValueError(
            f"{path} was written by {saved_servers} server(s), each with the rule state of "
            f"its shard; this run has {config.get('servers', 1)}. Resume with "
            f"servers={saved_servers} or another checkpoint_dir.")
    return {"epoch": meta["epoch"], "clock": meta["clock"], "center": center, "rule": rule,
            "history": meta.get("history", {})}
