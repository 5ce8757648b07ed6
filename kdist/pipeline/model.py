"""A Keras model whose layers are spread over processes, trained micro-batch by micro-batch.

Each rank holds one stage. A batch is cut into micro-batches; stage s runs
its forward pass on a micro-batch as soon as stage s - 1's activations
arrive, and its backward pass when stage s + 1's gradient arrives, in the
order the schedule gives (`kdist.pipeline.schedule`). Gradients add up over
the micro-batches, each weighted by its share of the batch, so one optimizer
step sees exactly the gradient of the whole batch: the same update as one
process. With several replicas, each stage's gradient is then averaged over
the replicas of that stage (data parallelism across pipelines).
"""

import logging
import time

import h5py
import keras
import numpy as np
import tensorflow as tf

from kdist._args import whole_number
from kdist import _keras_private
from kdist._files import write_atomically
from kdist._variables import assign_all
from kdist.comm import processes
from kdist.comm.stage_link import StageLink
from kdist.pipeline import schedule as schedule_lib
from kdist.pipeline.stages import build_stage, weighted_layers

logger = logging.getLogger(__name__)

_FORWARD, _BACKWARD, _LABELS = 1, 2, 3


class PipelineModel(keras.Model):
    """Trains a model cut into stages, one stage per rank, with `compile` and `fit`.

    Every rank runs the same script and builds the same `PipelineModel`; rank
    r holds stage `r % len(stages)` of replica `r // len(stages)` (with
    `tensor_parallel=T`, T consecutive ranks hold each stage together). Give every
    rank the same data (the same number of batches): the first stage reads
    the inputs and sends the targets to the last one, so only its copy
    counts. Loss and metrics are computed on the last stage and every rank
    reports them, so rank 0 prints progress as usual.

    Args:
        stages: one entry per stage, in order: a built `keras.Model`, or a
            function that builds one (only the rank that holds the stage
            calls it, so a model too large for one process is never whole
            anywhere). `kdist.pipeline.split` cuts a Sequential model.
        micro_batches: micro-batches per batch (M). The idle share of a step
            is (S - 1) / (M + S - 1) for S stages.
        schedule: "1f1b" (one forward, one backward: stage s holds at most
            S - s micro-batches' activations) or "gpipe" (every forward pass
            first: stage s holds all M).
        recompute: keep only each micro-batch's stage input and run the
            forward pass again in the backward pass, trading about a third
            more compute for the activations' memory.
        replicas: pipelines trained data-parallel (default: the world's size
            divided by stages x tensor_parallel).
        tensor_parallel: ranks per stage (T). Each stage's builder is then
            called with the `kdist.comm.Communicator` of its T ranks, to pass as
            the `group` of its tensor-parallel layers (`ColumnParallelDense`...).
            Rank `(replica * S + stage) * T + t` holds slice t of that stage.
        jit_compile: compile each stage's forward pass with XLA.
        comm: the `kdist.comm.Communicator` to span (the world by default).
        name: the model's name.

    Attributes:
        stage: this rank's stage, a `keras.Model`.
        stage_index: which stage this rank holds (0 to S - 1).
        replica: which pipeline replica this rank belongs to.
        num_stages: S, the number of stages.
        replicas: the number of pipeline replicas.
        tensor_group: the `Communicator` of the ranks that split this
            stage (None without `tensor_parallel`).
        tensor_rank: this rank's place in `tensor_group` (0 without it).
        profile: where the steps' time went, to measure the bubble:
            `scheduled` (seconds in schedules), `waiting` (of those, idle until
            another stage's message came), `receiving`, `forward`, `backward`,
            `micro_batches` and `steps`; `reset_profile()` zeroes it.

    Training: `compile(optimizer, loss, metrics=None, loss_weights=None,
    weighted_metrics=None)` puts the loss and metrics on the last stage;
    `fit`, `evaluate` and `predict` take the same data on every rank of a
    pipeline (the first stage reads it) and report the same logs and
    predictions on every rank. Each step runs eagerly between the stages'
    compiled forward passes, one batch per step.

    Saving: `save_weights(path)` (collective; rank 0 writes one HDF5 file) and
    `load_weights(path)` use a file that a pipeline with any other cut or
    replica count loads, as does the whole model in one process
    (`kdist.pipeline.load_whole_model_weights`). `save` raises
    `NotImplementedError`: the model is never whole in one process. `close()`
    (collective) frees the link between the stages.

    Raises:
        ValueError: the ranks are not replicas x stages x `tensor_parallel`;
            `micro_batches` below 1; an unknown schedule; a stage that is not
            built; and from `compile`, a missing loss, or `jit_compile` or
            `steps_per_execution` passed there.
        TypeError: a stage that is neither a `keras.Model` nor a function
            that builds one.

    Example:

        >>> import keras, kdist, numpy as np
        >>> from kdist.pipeline import PipelineModel
        >>> kdist.init()
        >>> whole = keras.Sequential([keras.Input((8,)),
        ...                           keras.layers.Dense(16, activation="relu"),
        ...                           keras.layers.Dense(3)])
        >>> model = PipelineModel([whole], micro_batches=2)  # one stage: a world of one
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 8)), np.zeros((8, 3)), batch_size=4, verbose=0)
        >>> model.profile["steps"]
        2

    Two stages on two ranks (`kdist run -n 2 python train.py`):

    ```python
    stages = kdist.pipeline.split(whole, [1])  # Dense(16) | Dense(3)
    model = kdist.pipeline.PipelineModel(stages, micro_batches=8, schedule="1f1b")
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64, epochs=3)
    model.save_weights("pipeline.weights.h5")
    ```
    """

    def __init__(self, stages, micro_batches=4, schedule="1f1b", recompute=False, replicas=None,
                 tensor_parallel=1, jit_compile=False, comm=None, name=None):
        super().__init__(name=name)
        stages = list(stages)
        if not stages:
            raise ValueError("A pipeline needs at least one stage.")
        whole_number(micro_batches, "micro_batches", minimum=1)
        whole_number(tensor_parallel, "tensor_parallel", minimum=1)  # ranks per stage
        self.micro_batches = int(micro_batches)
        self.schedule = schedule_lib.check(schedule)
        self.recompute = bool(recompute)
        self.num_stages = len(stages)
        self.tensor_parallel = int(tensor_parallel)
        world = comm if comm is not None else processes.world()
        per_replica = self.num_stages * self.tensor_parallel
        if replicas is None:
            replicas = max(1, world.size // per_replica)
        replicas = whole_number(replicas, "replicas", minimum=1)
        if replicas * per_replica != world.size:
            raise ValueError(
                f"{world.size} ranks cannot hold {replicas} replica(s) of {self.num_stages} "
                f"stage(s) of {self.tensor_parallel} rank(s); start "
                f"{int(replicas) * per_replica} ranks (replicas x stages x tensor_parallel), "
                "or change the number of stages.")
        self.replicas = int(replicas)
        # Rank (replica * S + stage) * T + t: a stage's tensor-parallel ranks are neighbours.
        position, self.tensor_rank = divmod(world.rank, self.tensor_parallel)
        self.replica, self.stage_index = divmod(position, self.num_stages)
        split = self.replicas > 1 or self.tensor_parallel > 1
        # One pipeline per replica and tensor-parallel rank: rank t of each stage talks to
        # rank t of the next, as every rank of a split stage holds its whole output.
        self._pipe = (world.split(self.replica * self.tensor_parallel + self.tensor_rank)
                      if split else world)
        self._data = (world.split(self.stage_index * self.tensor_parallel + self.tensor_rank)
                      if self.replicas > 1 else None)
        self.tensor_group = world.split(position) if self.tensor_parallel > 1 else None
        self.stage = build_stage(stages[self.stage_index], self.stage_index, self.tensor_group)
        self._link = StageLink(self._pipe) if self.num_stages > 1 else None
        self._forward_fn = tf.function(self._stage_forward, jit_compile=bool(jit_compile),
                                       reduce_retracing=True)
        self._jit = bool(jit_compile)
        counts = self._pipe.allgather_object(len(weighted_layers(self.stage)))
        self._first_layer = int(sum(counts[:self.stage_index]))
        self._layer_counts = counts
        if self._data is not None:
            # Replicas of a stage start from replica 0's weights.
            for variable in self.stage.weights:
                variable.assign(self._data.bcast_(np.array(variable.numpy()), root=0))
        # Read by callbacks that would save or broadcast rank 0's weights for all ranks.
        self.ranks_hold_different_weights = per_replica > 1
        self.reset_profile()
        self.run_eagerly = True  # messages pass between the compiled stages
        self.built = True

    @property
    def is_first(self):
        return self.stage_index == 0

    @property
    def is_last(self):
        return self.stage_index == self.num_stages - 1

    def _stage_forward(self, inputs, training):
        return self.stage(inputs, training=training)

    # Compiling.
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                weighted_metrics=None, **kwargs):
        """Like `keras.Model.compile`; the loss and metrics live on the last stage.

        The step always runs eagerly between the stages' compiled forward
        passes (messages go between them); pass `jit_compile=True` to the
        constructor to compile the stages with XLA.

        Raises:
            ValueError: no `loss`; `jit_compile=True` (give it to the
                constructor); `steps_per_execution` other than 1.
        """
        CompileLoss, CompileMetrics = _keras_private.compile_loss_and_metrics()

        if loss is None:
            raise ValueError("A pipeline needs a loss to train: compile(loss=...).")
        if kwargs.pop("jit_compile", None) is True:
            raise ValueError("Pass jit_compile=True to PipelineModel(...): the stages' forward "
                             "passes are compiled, the step between them runs eagerly.")
        if kwargs.pop("steps_per_execution", 1) != 1:
            raise ValueError("A PipelineModel runs one batch per step; leave "
                             "steps_per_execution out of compile().")
        kwargs.pop("run_eagerly", None)
        super().compile(optimizer=optimizer, run_eagerly=True, jit_compile=False, **kwargs)
        self._pipeline_loss = CompileLoss(loss, loss_weights)
        self._pipeline_metrics = CompileMetrics(metrics, weighted_metrics)
        # Without metrics the last stage need not keep a batch's outputs until its end.
        self._keeps_outputs = bool(metrics or weighted_metrics)
        self._loss_mean = keras.metrics.Mean(name="loss")
        if not self.optimizer.built:
            self.optimizer.build(self.stage.trainable_variables)

    @property
    def metrics(self):
        if not self.compiled or not hasattr(self, "_loss_mean"):
            return []
        return [self._loss_mean] + ([self._pipeline_metrics] if self.is_last else [])

    def get_metrics_result(self):
        # What the step returned: gathered over the stages and averaged over the
        # replicas, where the metrics of this rank alone would be partial.
        return dict(getattr(self, "_last_logs", {}))

    # Moving micro-batches.
    def _send(self, tensors, stage, tag):
        self._link.send([np.asarray(t) for t in tensors], stage, tag)

    def _recv(self, stage, tag):
        waited, received = self._link.seconds_waiting, self._link.seconds_receiving
        arrays = self._link.recv(stage, tag)
        self.profile["waiting"] += self._link.seconds_waiting - waited
        self.profile["receiving"] += self._link.seconds_receiving - received
        return [tf.convert_to_tensor(a) for a in arrays]

    def reset_profile(self):
        """Zeroes `profile`: seconds spent in schedules (`scheduled`) and, of
        those, idle until another stage's message came (`waiting`: the bubble), taking
        messages in once they had (`receiving`), in forward and backward passes
        (`forward`, `backward`, over `micro_batches` micro-batches), and `steps`."""
        self.profile = {"scheduled": 0.0, "waiting": 0.0, "receiving": 0.0, "steps": 0,
                        "forward": 0.0, "backward": 0.0, "micro_batches": 0}

    def _split_batch(self, x, y, sample_weight):
        """On the first stage: the micro-batches' inputs, targets and weights."""
        size = int(tf.shape(tf.nest.flatten(x)[0])[0])
        count = min(self.micro_batches, size)
        bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(size), count)])

        def cut(structure):
            if structure is None:
                return [None] * count
            return [tf.nest.map_structure(lambda t: t[a:b], structure)
                    for a, b in zip(bounds, bounds[1:])]

        return cut(x), cut(y), cut(sample_weight), np.diff(bounds).tolist()

    def _plan(self, data):
        """Agrees on this step's micro-batch sizes and targets' layout; the first stage decides."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        parts = plan = None
        if self.is_first:
            parts = self._split_batch(x, y, sample_weight)
            layout = (None if y is None else tf.nest.map_structure(lambda _: 0, y),
                      int(sample_weight is not None))
            plan = (parts[3], layout)
        if self.num_stages > 1:
            plan = self._pipe.bcast_object(plan, root=0)
        sizes, self._label_layout = plan
        return parts, sizes

    def _targets(self, parts, m):
        """The last stage's targets and sample weights of micro-batch m."""
        if self.is_first:
            return parts[1][m], parts[2][m]
        received = self._recv(0, _LABELS)
        y_structure, has_weight = self._label_layout
        y = tf.nest.pack_sequence_as(y_structure, received[:len(received) - has_weight])
        return y, (received[-1] if has_weight else None)

    def _send_targets(self, parts, m):
        y, sample_weight = parts[1][m], parts[2][m]
        if y is None:
            raise ValueError("A pipeline trains on (inputs, targets) batches; got no targets.")
        flat = tf.nest.flatten(y) + ([] if sample_weight is None else [sample_weight])
        self._send(flat, self.num_stages - 1, _LABELS)

    def _inputs(self, parts, m):
        if self.is_first:
            return parts[0][m]
        received = self._recv(self.stage_index - 1, _FORWARD)
        return received[0] if len(received) == 1 else received

    def _state(self):
        # Seed-generator states and moving statistics: restored before a recomputation
        # so that it draws the same dropout masks and leaves statistics as they were.
        return [v.numpy() for v in self.stage.non_trainable_variables]

    def _set_state(self, values):
        for variable, value in zip(self.stage.non_trainable_variables, values):
            variable.assign(value)

    # Training.
    def _forward(self, inputs, targets, share, keep_tape):
        """One micro-batch's forward pass; returns (record, outputs, loss)."""
        tape = tf.GradientTape() if keep_tape else None
        if tape is not None:
            tape.__enter__()
            for t in tf.nest.flatten(inputs):
                if t.dtype.is_floating:
                    tape.watch(t)
        try:
            outputs = self._forward_fn(inputs, True)
            objective = None
            loss = None
            if self.is_last:
                loss = self._pipeline_loss(targets[0], outputs, targets[1])
                objective = loss * share
            regularisation = self.stage.losses
            if regularisation:
                extra = tf.add_n(regularisation) * share
                objective = extra if objective is None else objective + extra
        finally:
            if tape is not None:
                tape.__exit__(None, None, None)
        return (tape, inputs, outputs, objective), outputs, loss

    def _backward(self, record, upstream, state_before, share, targets):
        """Gradients of this stage's weights and of its input, for one micro-batch."""
        tape, inputs, outputs, objective = record
        if tape is None:  # recompute: run the forward pass again, under a tape
            now = self._state()
            self._set_state(state_before)
            record, _, _ = self._forward(inputs, targets, share, True)
            self._set_state(now)
            tape, inputs, outputs, objective = record
        variables = self.stage.trainable_variables
        sources = list(variables)
        floating_inputs = [t for t in tf.nest.flatten(inputs) if t.dtype.is_floating]
        if not self.is_first:
            sources += floating_inputs
        targets_, gradients_in = [], []
        if upstream is not None:
            targets_ += tf.nest.flatten(outputs)
            gradients_in += [tf.cast(g, o.dtype) for g, o in
                             zip(upstream, tf.nest.flatten(outputs))]
        if objective is not None:
            targets_.append(objective)
            gradients_in.append(tf.ones_like(objective))
        gradients = tape.gradient(targets_, sources, output_gradients=gradients_in,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return gradients[:len(variables)], gradients[len(variables):]

    def _run_schedule(self, parts, sizes, training):
        start = time.perf_counter()
        try:
            return self._run_actions(parts, sizes, training)
        finally:
            self.profile["scheduled"] += time.perf_counter() - start
            self.profile["steps"] += 1

    def _run_actions(self, parts, sizes, training):
        total = float(sum(sizes))
        count = len(sizes)
        order = (schedule_lib.actions(self.schedule, self.stage_index, self.num_stages, count)
                 if training else [("F", m) for m in range(count)])
        records, states, all_targets, outputs, losses = {}, {}, {}, [None] * count, []
        accumulated = None
        for kind, m in order:
            share = sizes[m] / total
            if kind == "F":
                if self.is_first and not self.is_last:
                    self._send_targets(parts, m)
                inputs = self._inputs(parts, m)
                targets = self._targets(parts, m) if self.is_last else None
                if training and self.recompute:
                    states[m] = self._state()
                start = time.perf_counter()
                record, out, loss = self._forward(inputs, targets, share,
                                                  training and not self.recompute)
                self.profile["forward"] += time.perf_counter() - start
                self.profile["micro_batches"] += 1
                if training:
                    records[m] = record
                    all_targets[m] = targets
                if self.is_last:
                    outputs[m] = out if self._keeps_outputs else None
                    losses.append(loss * share)
                    if not training:
                        all_targets[m] = targets
                else:
                    self._send(tf.nest.flatten(out), self.stage_index + 1, _FORWARD)
            else:
                upstream = None if self.is_last else self._recv(self.stage_index + 1, _BACKWARD)
                start = time.perf_counter()
                weights_grad, inputs_grad = self._backward(
                    records.pop(m), upstream, states.pop(m, None), share, all_targets.get(m))
                if not self.is_first:
                    self._send(inputs_grad, self.stage_index - 1, _BACKWARD)
                weights_grad = [tf.convert_to_tensor(g) for g in weights_grad]
                accumulated = weights_grad if accumulated is None else [
                    a + g for a, g in zip(accumulated, weights_grad)]
                self.profile["backward"] += time.perf_counter() - start
        return accumulated, outputs, all_targets, losses

    def _penalty(self):
        # Read before the update, as Keras reports a step's loss.
        regularisation = self.stage.losses
        return float(tf.add_n(regularisation)) if regularisation else 0.0

    def train_step(self, data):
        parts, sizes = self._plan(data)
        penalty = self._penalty()
        gradients, outputs, targets, losses = self._run_schedule(parts, sizes, training=True)
        if self._data is not None:
            gradients = [tf.convert_to_tensor(g) for g in self._data.allreduce_many(
                [np.asarray(g) for g in gradients], average=True, label="pipeline gradients")]
        variables = self.stage.trainable_variables
        if variables:
            self.optimizer.apply(gradients, variables)
        return self._logs(outputs, targets, losses, sum(sizes), penalty)

    def test_step(self, data):
        parts, sizes = self._plan(data)
        penalty = self._penalty()
        _, outputs, targets, losses = self._run_schedule(parts, sizes, training=False)
        return self._logs(outputs, targets, losses, sum(sizes), penalty)

    def _logs(self, outputs, targets, losses, size, own):
        if self.is_last:
            if self._keeps_outputs:
                y_pred = _concat(outputs)
                y_true = _concat([targets[m][0] for m in range(len(outputs))])
                weights = [targets[m][1] for m in range(len(outputs))]
                weight = None if weights[0] is None else tf.concat(weights, 0)
                self._pipeline_metrics.update_state(y_true, y_pred, weight)
            self._loss_mean.update_state(float(tf.add_n(losses)) + own, sample_weight=size)
            logs = {"loss": float(self._loss_mean.result())}
            if self._keeps_outputs:
                for name, value in self._pipeline_metrics.result().items():
                    logs[name] = float(value)
        else:
            # Weight penalties of the other stages belong in the reported loss too.
            self._loss_mean.update_state(own, sample_weight=size)
            logs = {"loss": float(self._loss_mean.result())}
        if self.num_stages > 1:
            gathered = self._pipe.allgather_object(logs)
            logs = dict(gathered[-1])
            logs["loss"] = sum(item["loss"] for item in gathered)
        if self._data is not None:
            names = sorted(logs)
            values = self._data.allreduce_many(
                [np.array([logs[n] for n in names], np.float64)], average=True,
                label="pipeline metrics")[0]
            logs = dict(zip(names, values.tolist()))
        self._last_logs = logs
        return logs

    # Inference.
    def _predict_batch(self, x):
        parts, sizes = self._plan((x,))
        count = len(sizes)
        outputs = []
        for m in range(count):
            inputs = self._inputs(parts, m)
            out = self._forward_fn(inputs, False)
            if self.is_last:
                outputs.append(out)
            else:
                self._send(tf.nest.flatten(out), self.stage_index + 1, _FORWARD)
        result = _concat(outputs) if self.is_last else None
        if self.num_stages > 1:
            result = self._pipe.bcast_object(
                None if result is None else tf.nest.map_structure(np.asarray, result),
                root=self.num_stages - 1)
        return tf.nest.map_structure(tf.convert_to_tensor, result)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._predict_batch(x)

    def call(self, inputs, training=False):
        """The whole pipeline's output for `inputs`, on every rank (eager only)."""
        if not tf.executing_eagerly():
            raise RuntimeError("A PipelineModel passes messages between its stages and runs "
                               "eagerly; call it outside tf.function.")
        return self._predict_batch(inputs)

    # Weights, independent of how the model is cut.
    def save_weights(self, filepath, overwrite=True):
        """Writes every stage's weights to one HDF5 file on rank 0 (collective).

        Layers are numbered across the stages in order, so the file loads into
        a pipeline cut elsewhere, with another number of replicas, or into the
        whole model in one process (`kdist.pipeline.load_whole_model_weights`).
        """
        own = {}
        for index, layer in enumerate(weighted_layers(self.stage)):
            # A tensor-parallel layer's whole weights, gathered over its group (every rank
            # of the group takes part), so that the file holds the unsplit model.
            values = (layer.full_weights() if hasattr(layer, "full_weights")
                      else [w.numpy() for w in layer.weights])
            own[self._first_layer + index] = (layer.name, [np.asarray(v) for v in values])
        if self.tensor_rank != 0:
            return
        gathered = self._pipe.allgather_object(own)
        if self._pipe.rank != 0 or self.replica != 0:
            return
        merged = {}
        for part in gathered:
            merged.update(part)
        _write_layers(str(filepath), merged, overwrite)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a file `save_weights` wrote, whatever pipeline or model wrote it."""
        layers = weighted_layers(self.stage)
        stored = _read_layers(str(filepath), range(self._first_layer,
                                                   self._first_layer + len(layers)))
        plain = [(layer, stored[self._first_layer + index], self._first_layer + index)
                 for index, layer in enumerate(layers) if not hasattr(layer, "load_from_full")]
        _assign_layers(plain)
        for index, layer in enumerate(layers):
            if hasattr(layer, "load_from_full"):
                layer.load_from_full(stored[self._first_layer + index][1])

    def save(self, *args, **kwargs):
        raise NotImplementedError(
            "A PipelineModel is spread over processes and is not saved whole; use "
            "save_weights(path) (one file for every stage), and build the same model in one "
            "process with kdist.pipeline.load_whole_model_weights(model, path).")

    def close(self):
        """Frees the stage-to-stage link (collective over the pipeline's ranks)."""
        if self._link is not None:
            self._link.close()
            self._link = None


def _concat(parts):
    first = parts[0]
    if isinstance(first, (list, tuple, dict)):
        return tf.nest.map_structure(lambda *items: tf.concat(items, 0), *parts)
    return tf.concat(parts, 0)


def _write_layers(path, layers, overwrite):
    import os

    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")

    def write(stream):
        with h5py.File(stream, "w") as f:
            f.attrs["format"] = "kdist.pipeline weights 1"
            f.attrs["layers"] = len(layers)
            for index in sorted(layers):
                name, values = layers[index]
                group = f.create_group(f"layer_{index:05d}")
                group.attrs["name"] = name
                for j, value in enumerate(values):
                    group.create_dataset(str(j), data=value)

    write_atomically(path, write)


def _read_layers(path, indices):
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != "kdist.pipeline weights 1":
            raise ValueError(f"{path} was not written by PipelineModel.save_weights.")
        total = int(f.attrs["layers"])
        result = {}
        for index in indices:
            if index >= total:
                raise ValueError(f"{path} holds {total} layers with weights; this model has "
                                 f"more (layer {index}). It was saved from another model.")
            group = f[f"layer_{index:05d}"]
            result[index] = (group.attrs["name"],
                             [group[str(j)][()] for j in range(len(group))])
        return result


def _assign_layers(layers):
    """Assigns each `(layer, (stored name, values), index)`, once every layer's
    values were found to fit: a file of another model changes no layer."""
    def described(layer, stored, index):
        return (layer.weights, stored[1], f"Layer {index} ({layer.name})",
                f" (the file's layer {index} is {stored[0]}: it was saved from another model)")

    assign_all(*(described(*each) for each in layers))


def load_whole_model_weights(model, filepath):
    """Loads a pipeline's `save_weights` file into the whole model in one process.

    Args:
        model: the whole model, built; its layers with weights, in order
            (descending into nested models), must be the stages' layers with
            weights, in order.
        filepath: a file `PipelineModel.save_weights` wrote.

    Raises:
        ValueError: the file was not written by `PipelineModel.save_weights`,
            or it holds another model's layers (no weight is changed then).
    """
    layers = weighted_layers(model)
    stored = _read_layers(str(filepath), range(len(layers)))
    _assign_layers([(layer, stored[index], index) for index, layer in enumerate(layers)])
