"""`ParameterServerStrategy`: asynchronous training around a central model.

Rank 0 is the master: it holds the central weights, applies the workers'
updates as they arrive, validates the central model and runs the callbacks.
The other ranks are workers (or, with `submasters=k`, first k sub-masters
and then workers): each trains a replica on its shard of the data and
exchanges with its server every `sync_every` steps. The same script runs on
every rank:

```python
strategy = kdist.ps.ParameterServerStrategy(mode="easgd", sync_every=4, elastic_force=0.5)
with strategy.scope():
    model = build_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(x, y, epochs=10, batch_size=32, validation_data=(xv, yv))
```

After `fit`, every rank holds the final central weights; the master's
History has the workers' mean training metrics and the central model's
validation metrics per epoch.
"""

import contextlib
import functools
import inspect
import logging
import sys
import threading

import keras
import numpy as np

from kdist._args import whole_number
from kdist.comm import p2p, processes
from kdist.ps import master_checkpoint, masks, master_optimizers, messages, rules, shared
from kdist.ps.layout import Layout
from kdist.ps.exchange import ServerExchange
from kdist.ps.server import Server
from kdist.ps.hierarchy import shard_bounds, topology, workers
from kdist.ps.worker import SyncCallback, WorkerSession, shard

logger = logging.getLogger(__name__)


class ParameterServerStrategy:
    """Asynchronous data parallelism with a master (and optional sub-masters).

    Ranks `0` to `servers - 1` hold the centre (rank 0 is the master, which
    also validates, runs the callbacks and checkpoints), the next `submasters`
    ranks are sub-masters, and the rest are workers. Creating the strategy
    starts kdist (`kdist.init()`) and checks the settings against the job's
    size. Compile the model inside `scope()` (or pass it to `distribute`),
    then call `model.fit` on every rank:

    ```python
    strategy = kdist.ps.ParameterServerStrategy(mode="easgd", sync_every=4)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, epochs=10, batch_size=32, validation_data=(xv, yv))
    ```

    Args:
        mode: "downpour" (workers push updates, the master applies them with
            `master_optimizer`), "easgd" (elastic averaging) or "gem"
            (Gradient Energy Matching: updates rescaled per parameter).
        sync_every: training steps between a worker's exchanges (a whole
            number, at least 1).
        master_optimizer: Downpour's optimizer at the master: "sgd" (learning
            rate 1, momentum 0: plain addition; the default), "adam", a dict
            with "name" and the optimizer's arguments (e.g.
            `{"name": "sgd", "learning_rate": 0.5}`), or a
            `kdist.ps.MasterSGD`/`MasterAdam`.
        elastic_force: EASGD's moving rate `a`, in (0, 1].
        elastic_step_scale: EASGD only: each worker sends `w0 + s (w - w0)`,
            its progress since its last exchange (from `w0` to `w`) stretched
            by `s` (for plain SGD, the same as multiplying its learning rate).
            The centre is an average of workers that each see 1/p of the data,
            so at the compiled rate it learns about p times slower per epoch
            than Downpour's, which sums their steps. "workers" (the default)
            takes `s` = p, the number of workers, so that one worker's step
            moves the centre about as far as in Downpour; a positive number
            sets `s`; 1 trains each worker exactly as compiled.
        gem_momentum: the momentum `mu` GEM assumes for each worker, in [0, 1).
        gem_kappa: GEM's target multiple of one worker's momentum (> 0).
        submasters: sub-masters between the master and the workers; workers
            are dealt to them in turn, and each needs at least one.
        servers: top servers that split the centre between them (a whole
            number, at least 1), each holding one contiguous shard of about
            `1/servers` of it (ranks 0 to servers-1; rank 0 is also the
            master). Every child of the top exchanges its shard with each of
            them at once, so the work and the traffic of each update are
            divided among them. Not with pruned models.
        validate_every: the master validates every this many epochs.
        staleness_aware: divide each Downpour or GEM update by its staleness
            (the central updates applied since its sender last pulled).
        checkpoint_dir: the master writes its whole state (centre, rule
            state, clock, epoch, history) to `master.npz` there after every
            epoch; a rerun of the same command resumes from it.
        shard: split array or `tf.data` inputs between workers (each gets
            every n-th row). With False, each rank trains on what it is given.
        fault_tolerant: carry on when workers die, with the survivors. Needs
            Open MPI's fault tolerance: start the job with
            `kdist run --fault-tolerant` (`mpiexec --with-ft ulfm`). Without it
            (the default) a dead worker ends the whole job.
        shared_memory: in `fit`, a server and its children on the same node
            exchange through an MPI shared-memory window: only a 64-byte
            header travels and the server reads and writes the children's
            buffers in place (`kdist.ps.shared.SharedSlots`). Children on other
            nodes use messages. Not used with `fault_tolerant`, or by the
            lower-level `worker_session`/`make_server`.
        comm: the `kdist.comm.Communicator` to run on (default: the world).

    Attributes:
        stats: after `fit`, on servers: `updates`, `staleness_mean`,
            `staleness_max`, `staleness_histogram` (staleness -> count),
            `utilisation` (fraction of the serving time spent working),
            `busy_seconds`, `cpu_seconds` (the serving thread's CPU time),
            `shared_children` (children served through shared memory),
            `clock` (updates applied so far) and `lost` (ranks that died).
            None before `fit` and on workers.
        epoch_stats: on the master, the same per epoch (with `epoch`).
        comm: the communicator.

    Raises:
        ValueError: an unknown `mode` or `master_optimizer`, a setting out of
            its range, or a job too small for its servers and sub-masters
            (at least `servers + 1` ranks, and one worker per sub-master).
    """

    def __init__(self, mode="downpour", sync_every=1, master_optimizer="sgd",
                 elastic_force=0.5, elastic_step_scale="workers", gem_momentum=0.9,
                 gem_kappa=1.5, submasters=0, servers=1,
                 validate_every=1, staleness_aware=False, checkpoint_dir=None, shard=True,
                 fault_tolerant=False, shared_memory=True, comm=None):
        if mode not in rules.MODES:
            raise ValueError(f"mode must be one of {rules.MODES}; got {mode!r}.")
        # Training steps between exchanges.
        sync_every = whole_number(sync_every, "sync_every", minimum=1)
        if not 0.0 < elastic_force <= 1.0:
            raise ValueError(f"elastic_force must lie in (0, 1]; got {elastic_force}. "
                             "0.5 is a common choice; 1 copies the worker into the centre.")
        if elastic_step_scale != "workers" and (
                isinstance(elastic_step_scale, bool)
                or not isinstance(elastic_step_scale, (int, float)) or elastic_step_scale <= 0):
            raise ValueError(f"elastic_step_scale must be 'workers' or a positive number "
                             f"(1 keeps each worker's steps as compiled); got "
                             f"{elastic_step_scale!r}.")
        if not 0.0 <= gem_momentum < 1.0:
            raise ValueError(f"gem_momentum must lie in [0, 1); got {gem_momentum}.")
        if gem_kappa <= 0:
            raise ValueError(f"gem_kappa must be positive (about 1 to 2); got {gem_kappa}.")
        validate_every = whole_number(validate_every, "validate_every", minimum=1)  # epochs
        self.mode = mode
        self.sync_every = sync_every
        self.master_optimizer = master_optimizer
        self.elastic_force = float(elastic_force)
        self.elastic_step_scale = elastic_step_scale
        self.gem_momentum = float(gem_momentum)
        self.gem_kappa = float(gem_kappa)
        self.submasters = int(submasters)
        self.servers = servers
        self.validate_every = validate_every
        self.staleness_aware = bool(staleness_aware)
        self.checkpoint_dir = checkpoint_dir
        self.shard = bool(shard)
        self.fault_tolerant = bool(fault_tolerant)
        self.shared_memory = bool(shared_memory)
        self._slots = None
        # Resolve the optimizer now, so a bad name fails on every rank at once.
        master_optimizers.get(master_optimizer)
        if comm is None:
            processes.init()
            comm = processes.world()
        self.comm = comm
        self.parent, self.children = topology(comm.size, self.submasters, servers)
        self.stats = None
        self.epoch_stats = []

    # Roles.
    @property
    def rank(self):
        """This process's rank in `comm`."""
        return self.comm.rank

    @property
    def is_master(self):
        """True on rank 0, which holds the centre (or its first shard) and runs
        validation, callbacks and checkpoints."""
        return self.rank == 0

    @property
    def is_shard_server(self):
        """True on the top servers after the first (`servers` > 1)."""
        return 0 < self.rank < self.servers

    @property
    def is_submaster(self):
        """True on the `submasters` ranks after the top servers."""
        return self.servers <= self.rank < self.servers + self.submasters

    @property
    def is_worker(self):
        """True on the ranks that train: all after the servers and sub-masters."""
        return self.rank >= self.servers + self.submasters

    @property
    def num_workers(self):
        """How many ranks train."""
        return len(workers(self.comm.size, self.submasters, self.servers))

    @property
    def worker_index(self):
        """This worker's index among the workers, or None on a server."""
        return self.rank - self.servers - self.submasters if self.is_worker else None

    def _step_scale(self):
        if self.mode != "easgd":
            return 1.0
        if self.elastic_step_scale == "workers":
            return float(self.num_workers)
        return float(self.elastic_step_scale)

    def _servers_of(self, rank):
        parent = self.parent[rank]
        return list(range(self.servers)) if parent == 0 else [parent]

    def get_config(self):
        """The settings as a dict (the master optimizer as its config), as the
        checkpoint records them: a resumed run must use the same."""
        return {"mode": self.mode, "sync_every": self.sync_every,
                "master_optimizer": master_optimizers.get(self.master_optimizer).get_config(),
                "elastic_force": self.elastic_force,
                "elastic_step_scale": self.elastic_step_scale, "gem_momentum": self.gem_momentum,
                "gem_kappa": self.gem_kappa, "submasters": self.submasters,
                "servers": self.servers,
                "validate_every": self.validate_every,
                "staleness_aware": self.staleness_aware,
                "checkpoint_dir": self.checkpoint_dir, "shard": self.shard,
                "fault_tolerant": self.fault_tolerant, "shared_memory": self.shared_memory}

    # Keras integration.
    @contextlib.contextmanager
    def scope(self):
        """Models compiled inside this block train with this strategy in `fit`.

        Keras has no hook on `compile`, and kdist changes no Keras class. While
        the block is open, this thread's profiling hook (`sys.setprofile`, which
        changes nothing it sees) watches for Keras's `Model.compile` returning,
        also through a subclass's `super().compile(...)`, and hands each model
        compiled there to `distribute`. Other threads are not watched. A Python
        profile function set before is still called; a C profiler (cProfile)
        pauses while the block is open. Outside the block, compile as usual and
        call `strategy.distribute(model)`.
        """
        watched = inspect.unwrap(keras.Model.compile).__code__
        before = sys.getprofile()
        chained = before if callable(before) else None

        def watch(frame, event, arg):
            if event == "return" and frame.f_code is watched:
                model = frame.f_locals.get("self")
                if getattr(model, "compiled", False):  # not when compile raised
                    self.distribute(model)
            return chained(frame, event, arg) if chained is not None else None

        sys.setprofile(watch)
        try:
            yield self
        finally:
            sys.setprofile(before)

    def distribute(self, model):
        """Makes `model.fit` train with this strategy (what `scope()` does at compile)."""
        # Bypass Keras attribute tracking: this is a plain bound function.
        object.__setattr__(model, "fit", functools.partial(self.fit, model))
        return model

    def fit(self, model, x=None, y=None, *, epochs=1, batch_size=None, verbose="auto",
            callbacks=None, validation_data=None, validation_split=0.0, initial_epoch=0,
            sample_weight=None, worker_callbacks=None, **fit_kwargs):
        """Trains `model` on every rank; the same call everywhere.

        What `model.fit` calls once the model is in `scope()` or passed to
        `distribute`. Workers run Keras `fit` on their shard (`batch_size`
        rows per step) with `worker_callbacks` (for instance a learning-rate
        schedule of the workers' optimizer) and `fit_kwargs` (e.g. `shuffle`,
        `class_weight`, `steps_per_epoch`). The master runs `callbacks` on
        the central model, validates it on `validation_data` every
        `validate_every` epochs, prints each epoch's line (unless
        `verbose=0`) and logs the workers' mean training metrics. A callback
        that sets `model.stop_training` stops every worker. After `fit`, every
        rank holds the final central weights.

        Args:
            model: the compiled model, the same on every rank.
            x: the training inputs, split between the workers when the
                strategy's `shard` is True (also `y` and `sample_weight`).
            y: the targets.
            epochs: as for Keras `fit`.
            batch_size: rows per worker step.
            verbose: 0 silences the master's per-epoch lines and summary.
            callbacks: Keras callbacks, run on the master.
            validation_data: data the master evaluates the central model on.
            validation_split: the last fraction of numpy inputs kept for
                validation, as Keras does.
            initial_epoch: as for Keras `fit`.
            sample_weight: per-row weights.
            worker_callbacks: Keras callbacks, run on every worker.
            **fit_kwargs: passed to the workers' Keras `fit`.

        Returns:
            The central History (workers' mean metrics, the central model's
                validation metrics) on the master, the worker's own History on a
                worker, and an empty one on sub-masters and shard servers.

        Raises:
            ValueError: the model is not compiled; ranks built different
                models; both `validation_data` and `validation_split`, or a
                `validation_split` without numpy inputs; a pruned model with
                `servers` > 1.
            RuntimeError: the master or a shard server stopped serving (the
                cause is chained).
        """
        if getattr(model, "optimizer", None) is None and not getattr(model, "optimizers", None):
            raise ValueError("Compile the model (inside strategy.scope()) before fit.")
        if validation_split:
            if validation_data is not None:
                raise ValueError("Pass validation_data or validation_split, not both.")
            x, y, sample_weight, validation_data = _split(x, y, sample_weight,
                                                          validation_split)
        layout = Layout(model)
        self._check_same_model(layout)
        resumed = None
        if self.is_master and self.checkpoint_dir:
            resumed = master_checkpoint.load(self.checkpoint_dir, layout.size, self.get_config())
        start = {"epoch": initial_epoch, "clock": 0, "rule": None}
        if resumed is not None:
            start = {"epoch": max(initial_epoch, resumed["epoch"] + 1), "clock": resumed["clock"],
                     "rule": resumed["rule"] if self.servers > 1 else None}
        start = self.comm.bcast_object(start)
        center = resumed["center"] if resumed is not None else layout.read()
        self.comm.bcast_(center)
        layout.write(center)
        if self.servers > 1 and masks.for_models(model, layout, center) is not None:
            raise ValueError("Pruned models keep their masks on one master: use servers=1 "
                             "with pruning.")
        if self.shared_memory and not self.fault_tolerant:
            self._slots = shared.SharedSlots(
                self.comm, {child: self._servers_of(child) for child in self.parent},
                layout.size)
        try:
            history = self._run_role(model, layout, center, start, resumed, epochs, callbacks,
                                     validation_data, verbose, x, y, sample_weight,
                                     batch_size, worker_callbacks, fit_kwargs)
        finally:
            # Every exchange is over once each role returns; an error on one
            # rank ends the job before this collective is reached.
            slots, self._slots = self._slots, None
        final = layout.read() if self.is_master else np.empty(layout.size, np.float32)
        survivors = self.comm.shrink() if self.fault_tolerant else self.comm
        survivors.bcast_(final)
        if slots is not None:
            slots.free()
        layout.write(final)
        return history

    def _run_role(self, model, layout, center, start, resumed, epochs, callbacks,
                  validation_data, verbose, x, y, sample_weight, batch_size, worker_callbacks,
                  fit_kwargs):
        if self.is_master:
            if resumed is not None:
                logger.info("Resuming from %s at epoch %d.",
                            master_checkpoint.path_in(self.checkpoint_dir), start["epoch"] + 1)
            history = self._run_master(model, layout, center, start, resumed, epochs,
                                       callbacks, validation_data, verbose)
        elif self.is_submaster or self.is_shard_server:
            history = self._run_server(layout, center, start)
        else:
            fit_kwargs["callbacks"] = list(worker_callbacks or [])
            history = self._run_worker(model, layout, x, y, sample_weight, epochs, batch_size,
                                       start, fit_kwargs)
        return history

    # Lower-level API.
    def worker_session(self, models):
        """A `WorkerSession` for a custom loop on a worker rank.

        Args:
            models: the model (or a list of models) this worker trains.

        Raises:
            ValueError: this rank is a server; call `make_server` there.
        """
        if not self.is_worker:
            raise ValueError(f"Rank {self.rank} is a server, not a worker; call make_server() "
                             "there.")
        return WorkerSession(self.comm, self._servers_of(self.rank), Layout(models),
                             self.mode == "easgd", self.sync_every,
                             step_scale=self._step_scale())

    def make_server(self, models, center=None, first_epoch=0, clock=0):
        """The `Server` this rank runs (master, shard server or sub-master), for
        custom loops.

        Call `run()` on it; at the top, read `events` for ("epoch", epoch,
        logs, snapshot), then ("done", stats) or ("error", exception). With
        `servers` > 1 each top server's `center` is its shard of the whole.

        Args:
            models: the model (or a list of models) whose variables form the
                centre (`kdist.ps.Layout`).
            center: the starting centre as a flat float32 vector (default:
                the models' current values).
            first_epoch: the epoch a resumed run starts at.
            clock: the update count a resumed run starts at.

        Raises:
            ValueError: this rank is a worker; call `worker_session` there.
        """
        layout = Layout(models)
        return self._server(layout, layout.read() if center is None else center,
                            first_epoch, clock, models)

    def _server(self, layout, center, first_epoch, clock, models=None):
        size = layout.trainable_size
        if self.rank < self.servers:
            begin, end = shard_bounds(layout.size, self.servers)[self.rank]
            trainable = min(max(size - begin, 0), end - begin)
            hook = None
            if models is not None and self.servers == 1:
                hook = masks.for_models(models, layout, center)
            rule = rules.make(self.mode, trainable, master_optimizer=self.master_optimizer,
                              elastic_force=self.elastic_force, gem_kappa=self.gem_kappa,
                              gem_momentum=self.gem_momentum,
                              staleness_aware=self.staleness_aware)
            return Server(self.comm, self.children[0], center[begin:end], trainable, rule,
                          first_epoch=first_epoch, clock=clock, center_hook=hook,
                          slots=self._slots, offset=begin, receives_logs=self.is_master)
        if self.is_submaster:
            rule = rules.make_intermediate(self.mode, size, self.elastic_force)
            return Server(self.comm, self.children[self.rank], center, size, rule,
                          link=ServerExchange(self.comm, self._servers_of(self.rank), layout.size,
                                    self._slots),
                          first_epoch=first_epoch, slots=self._slots)
        raise ValueError(f"Rank {self.rank} is a worker; call worker_session() there.")

    # Roles at work.
    def _check_same_model(self, layout):
        shapes = self.comm.allgather_object((layout.size, layout.trainable_size))
        if len(set(shapes)) > 1:
            listing = ", ".join(f"rank {r}: {s[0]} values ({s[1]} trainable)"
                                for r, s in enumerate(shapes))
            raise ValueError("Every rank must build the same model before fit; got "
                             + listing + ".")

    def _run_worker(self, model, layout, x, y, sample_weight, epochs, batch_size, start,
                    fit_kwargs):
        if self.shard:
            index, count = self.worker_index, self.num_workers
            x, y = shard(x, index, count), shard(y, index, count)
            sample_weight = shard(sample_weight, index, count)
        session = WorkerSession(self.comm, self._servers_of(self.rank), layout,
                                self.mode == "easgd", self.sync_every, self._slots,
                                self._step_scale())
        for master_only in ("validation_freq", "validation_steps", "validation_batch_size"):
            fit_kwargs.pop(master_only, None)
        fit_kwargs["callbacks"].append(SyncCallback(session))
        return type(model).fit(model, x, y, batch_size=batch_size, epochs=epochs,
                               initial_epoch=start["epoch"], sample_weight=sample_weight,
                               verbose=0, **fit_kwargs)

    def _run_server(self, layout, center, start):
        """A sub-master, or a top server after the first: serves; a shard server
        also hands each closed epoch's shard, and its last, to the master."""
        if self.is_submaster:
            server = self._server(layout, center, start["epoch"], 0)
            server.run()
            self.stats = server.stats()
            return keras.callbacks.History()
        server = self._server(layout, center, start["epoch"], start["clock"])
        if start["rule"] is not None:
            server.rule.set_state(_shard_state(start["rule"], self.rank))
        thread = threading.Thread(target=server.run, name="kdist-ps-shard", daemon=True)
        thread.start()
        while True:
            event = server.events.get()
            if event[0] == "error":
                thread.join()
                raise RuntimeError(f"Parameter-server shard {self.rank} stopped serving.") \
                    from event[1]
            if event[0] == "epoch":
                p2p.send_object(self.comm, 0, ("epoch", event[1], event[3]), messages.SHARD)
                continue
            thread.join()
            self.stats = event[1]
            final = {"center": server.center, "clock": server.clock,
                     "rule": server.rule.get_state(), "stats": self.stats}
            p2p.send_object(self.comm, 0, ("done", None, final), messages.SHARD)
            return keras.callbacks.History()

    def _shard_snapshots(self, epoch, snapshot):
        """`snapshot` (the master's own shard at the end of `epoch`, or its last)
        completed with every other shard's, in the order they were cut."""
        if self.servers == 1:
            return snapshot
        parts, rule = [snapshot["center"]], dict(snapshot["rule"])
        for rank in range(1, self.servers):
            shard = self._shard_finals.get(rank)
            while shard is None:
                kind, closed, cut = p2p.recv_object(self.comm, rank, messages.SHARD)
                if kind == "done":
                    self._shard_finals[rank] = shard = cut
                # Epochs the master no longer reports (a callback stopped
                # training) are passed over.
                elif closed == epoch:
                    shard = cut
            parts.append(shard["center"])
            rule.update({f"shard{rank}/{k}": v for k, v in shard["rule"].items()})
        return dict(snapshot, center=np.concatenate(parts), rule=rule)

    def _run_master(self, model, layout, center, start, resumed, epochs, callbacks,
                    validation_data, verbose):
        server = self._server(layout, center, start["epoch"], start["clock"], model)
        if resumed is not None:
            server.rule.set_state(_shard_state(resumed["rule"], 0))
        history = keras.callbacks.History()
        callback_list = keras.callbacks.CallbackList(
            list(callbacks or []) + [history], add_history=False, add_progbar=False,
            model=model, epochs=epochs, verbose=0)
        show = verbose != 0
        thread = threading.Thread(target=server.run, name="kdist-ps-master", daemon=True)
        self.epoch_stats = []
        self._shard_finals = {}
        model.stop_training = False
        callback_list.on_train_begin()
        if resumed is not None:
            history.history = {k: list(v) for k, v in resumed["history"].items()}
            history.epoch = list(range(start["epoch"]))
        thread.start()
        epoch, logs = start["epoch"], {}
        if epoch < epochs:
            callback_list.on_epoch_begin(epoch)
        while True:
            event = server.events.get()
            if event[0] == "error":
                thread.join()
                raise RuntimeError("The parameter-server master stopped serving.") from event[1]
            if event[0] == "done":
                self.stats = event[1]
                break
            _, epoch, logs, snapshot = event
            if model.stop_training:
                continue
            snapshot = self._shard_snapshots(epoch, snapshot)
            self.epoch_stats.append(dict(snapshot["stats"], epoch=epoch))
            layout.write(snapshot["center"])
            if validation_data is not None and (epoch + 1) % self.validate_every == 0:
                logs.update({f"val_{k}": v for k, v in _evaluate(model, validation_data).items()})
            callback_list.on_epoch_end(epoch, logs)
            if show:
                _print_epoch(epoch, epochs, logs, snapshot["stats"])
            if self.checkpoint_dir:
                master_checkpoint.save(self.checkpoint_dir, epoch, snapshot, self.get_config(),
                           history.history)
            if model.stop_training:
                logger.info("Stopping every worker after epoch %d (asked by a callback).",
                            epoch + 1)
                server.request_stop()
            elif epoch + 1 < epochs:
                callback_list.on_epoch_begin(epoch + 1)
        thread.join()
        last = self._shard_snapshots(None, {"center": server.center, "rule": {}})
        if not model.stop_training and server.next_epoch > start["epoch"]:
            # The last epoch's centre is final, not the snapshot the callbacks saw.
            layout.write(last["center"])
        callback_list.on_train_end(logs)
        if show:
            _print_summary(self.stats)
        return history


def _shard_state(rule_state, rank):
    """Shard `rank`'s part of a whole rule state (its keys carry "shard{rank}/",
    except the first shard's, which match a single server's)."""
    if rank == 0:
        return {k: v for k, v in rule_state.items() if not k.startswith("shard")}
    prefix = f"shard{rank}/"
    return {k[len(prefix):]: v for k, v in rule_state.items() if k.startswith(prefix)}


def _evaluate(model, validation_data):
    if isinstance(validation_data, (tuple, list)):
        return model.evaluate(*validation_data, verbose=0, return_dict=True)
    return model.evaluate(validation_data, verbose=0, return_dict=True)


def _split(x, y, sample_weight, fraction):
    """Keeps the last `fraction` of array inputs for validation, as Keras does."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_split must lie in (0, 1); got {fraction}.")
    if not hasattr(x, "shape"):
        raise ValueError("validation_split needs numpy array inputs; pass validation_data.")
    cut = int(len(x) * (1.0 - fraction))
    val = (x[cut:], y[cut:]) if y is not None else (x[cut:],)
    weights = sample_weight[:cut] if sample_weight is not None else None
    return x[:cut], (y[:cut] if y is not None else None), weights, val


def _format(logs):
    return " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())


def _print_epoch(epoch, epochs, logs, stats):
    print(f"Epoch {epoch + 1}/{epochs} - {_format(logs)} - updates: {stats['updates']} - "
          f"staleness: {stats['staleness_mean']:.1f} (max {stats['staleness_max']})",
          flush=True)


def _print_summary(stats):
    print(f"Parameter server: {stats['updates']} updates, master busy "
          f"{100 * stats['utilisation']:.0f}% of the time, staleness mean "
          f"{stats['staleness_mean']:.2f}, histogram {stats['staleness_histogram']}",
          flush=True)
    if stats["lost"]:
        print(f"Parameter server: carried on without rank(s) {stats['lost']}, which died.",
              flush=True)
