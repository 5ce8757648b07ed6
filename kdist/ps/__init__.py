"""Asynchronous parameter-server training: Downpour, EASGD, GEM, sub-masters.

`ParameterServerStrategy` is the way in: the same script on every rank,
`with strategy.scope():` around `compile`, then `model.fit`. Rank 0 is the
master, which holds the central model; workers train replicas on their
shards of the data and exchange with it every `sync_every` steps, without
waiting for each other. The modes:

| mode | a worker sends | the server |
|---|---|---|
| `"downpour"` | its update since the last pull | applies it with `MasterSGD` or `MasterAdam` |
| `"easgd"` | its weights | moves centre and worker towards each other |
| `"gem"` | its update | rescales it per parameter (energy matching), adds it |

Sub-masters (`submasters=k`) sit between the master and the workers, and
several top servers (`servers=K`) split the centre into shards. The
parameter-server guide covers modes, sub-masters, resuming and failures.

The lower-level parts, for custom loops:

- `ParameterServerStrategy.worker_session(models)` gives a `WorkerSession`
  (a worker's side; `SyncCallback` drives one from Keras `fit`), and
  `make_server(models)` the `Server` a master, shard server or sub-master runs.
- `Layout(models)`: the models' floating-point variables as one flat float32
  vector, the form in which models travel and are updated.
- `topology(size, submasters, servers)`: who serves whom.
- `kdist.ps.algorithms`: the update rules as functions on flat float32 arrays,
  the ones ending in `_` in place: `downpour_apply(center, update, optimizer,
  out, scale=1.0)`, `easgd_exchange_(worker, center, elastic_force, scratch,
  worker_out=None)`, `gem_momentum_(momentum, update, mu)`,
  `gem_scale(update, momentum, drift, kappa, eps=1e-8)`, `gem_apply_(center,
  update, momentum, drift, kappa, mu, ...)`, `staleness(clock, pulled_at)` and
  `staleness_factor(stale)` (1/staleness, 1 when fresh).
- `kdist.ps.shared.SharedSlots(comm, servers_of, size)`: exchange buffers in
  an MPI shared-memory window, for a server and its children on one node
  (collective over `comm`, as is its `free()`).

>>> import kdist.ps
>>> kdist.ps.topology(5, submasters=2)
({1: 0, 2: 0, 3: 1, 4: 2}, {0: [1, 2], 1: [3], 2: [4]})
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "algorithms": "kdist.ps.algorithms",
    "topology": "kdist.ps.hierarchy",
    "Layout": "kdist.ps.layout",
    "MasterAdam": "kdist.ps.master_optimizers",
    "MasterSGD": "kdist.ps.master_optimizers",
    "Server": "kdist.ps.server",
    "ParameterServerStrategy": "kdist.ps.strategy",
    "SyncCallback": "kdist.ps.worker",
    "WorkerSession": "kdist.ps.worker",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
