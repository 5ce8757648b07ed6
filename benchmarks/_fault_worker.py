"""One rank of a fault-injection run (started by benchmarks/faults.py, not by hand).

    _fault_worker.py --out DIR --fault KIND --victim R --step S [--elastic]
                     [--checkpoints DIR] [--epochs E]

Trains an MLP on the bundled digits with `DistributedOptimizer` (plain, or in
`kdist.elastic.run`), and at global batch S rank R suffers KIND:

- none: nothing (the fault-free reference);
- kill: SIGKILL;  stop: SIGSTOP (a hang: MPI cannot tell it from slowness);
- raise: an exception;  leave: `kdist.elastic.FatalToThisRank` (elastic only);
- overflow: mixed float16, and that rank's batch S holds a value float16 cannot hold;
- uneven: that rank holds a third fewer samples (it joins early each epoch);
- kill_in_checkpoint: SIGKILL halfway through writing a checkpoint (rank 0's
  writes; plain runs only);
- kill_in_commit: SIGKILL halfway through an elastic commit.

Each rank writes `DIR/rank-N.json` when it finishes: the world size, the loss
on the whole data, the optimizer's update count, and how many batches this
process ran (counting those run again after a restore or a resume).
"""

import argparse
import io
import json
import os
import signal

import numpy as np

FAULTS = ("none", "kill", "stop", "raise", "leave", "overflow", "uneven", "kill_in_checkpoint",
          "kill_in_commit")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--victim", type=int, default=0)
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--checkpoints", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    return parser.parse_args()


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_halfway_through_savez():
    """Makes this process die after writing half of its next `np.savez` file."""
    real = np.savez

    def torn(file, *args, **kwargs):
        buffer = io.BytesIO()
        real(buffer, *args, **kwargs)
        data = buffer.getvalue()
        file.write(data[:len(data) // 2])
        file.flush()
        die()

    np.savez = torn


def main():
    args = parse_args()
    import keras
    from sklearn.datasets import load_digits

    import kdist

    kdist.init()
    me = kdist.rank()
    # A process that replaced a lost rank may take the victim's number; the
    # fault happens once per job.
    victim = me == args.victim and not kdist.elastic.is_replacement()
    if args.fault == "overflow":
        kdist.precision.enable("mixed_float16")
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    base_rate = 0.02
    optimizer = kdist.DistributedOptimizer(keras.optimizers.SGD(base_rate * kdist.size()))
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches_run = [0]
    state = kdist.elastic.KerasState(model, batch=0, epoch=0) if args.elastic else None

    class Inject(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches_run[0] += 1
            if not victim or batches_run[0] != args.step:
                return
            if args.fault == "kill":
                die()
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.fault == "raise":
                raise RuntimeError("injected failure")
            if args.fault == "leave":
                raise kdist.elastic.FatalToThisRank("injected")
            if args.fault == "kill_in_checkpoint":
                kill_halfway_through_savez()
            if args.fault == "kill_in_commit" and state is not None:
                save = state._save_variables

                def torn_commit():
                    save()
                    die()  # variables copied, values not yet

                state._save_variables = torn_commit

    def shard():
        rows = np.arange(len(x))
        size, rank = kdist.size(), kdist.rank()
        mine = rows[rank * len(x) // size:(rank + 1) * len(x) // size]
        if args.fault == "uneven" and victim:
            mine = mine[:2 * len(mine) // 3]
        xs, ys = x[mine].copy(), y[mine]
        if args.fault == "overflow" and victim:
            batch = (args.step - 1) % max(1, len(mine) // 16)
            xs[16 * batch] = 1e6  # its activations overflow float16 under the loss scale
        return xs, ys

    callbacks = [Inject()]
    if args.elastic:
        callbacks = [kdist.elastic.CommitStateCallback(state, batches_per_commit=5),
                     kdist.elastic.UpdateBatchStateCallback(state),
                     kdist.elastic.UpdateEpochStateCallback(state)] + callbacks

        def on_reset():
            optimizer.learning_rate.assign(base_rate * kdist.size())

        state.register_reset_callbacks([on_reset])

        @kdist.elastic.run
        def train(state):
            xs, ys = shard()
            model.fit(xs, ys, batch_size=16, epochs=args.epochs - state.epoch,
                      callbacks=callbacks, verbose=0)

        train(state)
    else:
        if args.checkpoints:
            callbacks.append(kdist.callbacks.Checkpoint(args.checkpoints, keep=10))
        xs, ys = shard()
        model.fit(xs, ys, batch_size=16, epochs=args.epochs, callbacks=callbacks, verbose=0)
    loss = float(model.evaluate(x, y, verbose=0))
    result = {"size": kdist.size(), "loss": loss, "batches_run": batches_run[0],
              "updates": int(optimizer.iterations.numpy())}
    path = os.path.join(args.out, f"rank-{me}.json")
    with open(path + ".tmp", "w") as stream:
        json.dump(result, stream)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
