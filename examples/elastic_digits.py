"""Elastic data-parallel training: the job carries on when a rank dies.

    kdist run --elastic -n 3 examples/elastic_digits.py --kill-rank 2
    kdist run --elastic -n 3 --max-np 3 examples/elastic_digits.py --kill-rank 2
    kdist run --elastic -n 3 examples/elastic_digits.py      # then kill -9 one rank's PID

A Horovod Elastic Keras script with `import kdist as hvd`. Each rank trains on
its shard of scikit-learn's bundled digits and commits its state (model,
optimizer, epoch and batch counters) every few batches. When a rank dies, the
others agree on who is left, go back to the last commit, re-shard the data
over the survivors, rescale the learning rate and carry on. With --max-np the
survivors first start a new process in place of the dead one, which receives
their state and trains on with them. Every rank prints its PID at the start,
so you can kill one from another terminal.
"""

import argparse
import os
import signal

import keras
from sklearn.datasets import load_digits

import kdist as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--learning-rate", type=float, default=0.02, help="for one rank")
    parser.add_argument("--batches-per-commit", type=int, default=5)
    parser.add_argument("--kill-rank", type=int, default=None,
                        help="this rank kills itself (SIGKILL) in the second epoch")
    return parser.parse_args()


class KillOnce(keras.callbacks.Callback):
    """Kills this process, as a failing node would, once, in the given epoch."""

    def __init__(self, rank, epoch):
        super().__init__()
        self.rank, self.epoch = rank, epoch
        # After the first loss the ranks are renumbered: another process may
        # now hold `rank`, and it must live.
        self.armed = not hvd.elastic.is_replacement()

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.armed and hvd.rank() == self.rank and self.current == self.epoch and batch == 10:
            print(f"rank {hvd.rank()}: killing myself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    args = parse_args()
    hvd.init()
    joined = " (replacing a lost rank)" if hvd.elastic.is_replacement() else ""
    print(f"rank {hvd.rank()} of {hvd.size()}: pid {os.getpid()}{joined}", flush=True)
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int64")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.learning_rate * hvd.size()))
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_state_reset():
        # The survivors' global batch is smaller: scale the learning rate with it.
        optimizer.learning_rate.assign(args.learning_rate * hvd.size())
        if hvd.rank() == 0:
            print(f"carrying on with {hvd.size()} rank(s) from epoch {state.epoch}, "
                  f"batch {state.batch}", flush=True)

    state.register_reset_callbacks([on_state_reset])
    callbacks = [hvd.elastic.CommitStateCallback(state, args.batches_per_commit),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]
    if args.kill_rank is not None:
        killer = KillOnce(args.kill_rank, epoch=1)
        callbacks.append(killer)
        state.register_reset_callbacks([lambda: setattr(killer, "armed", False)])

    @hvd.elastic.run
    def train(state):
        start = hvd.rank() * len(x) // hvd.size()
        stop = (hvd.rank() + 1) * len(x) // hvd.size()
        model.fit(x[start:stop], y[start:stop], batch_size=args.batch_size,
                  epochs=args.epochs - state.epoch, callbacks=callbacks,
                  verbose=2 if hvd.rank() == 0 else 0)

    train(state)
    loss, accuracy = model.evaluate(x, y, verbose=0)
    if hvd.rank() == 0:
        print(f"finished on {hvd.size()} rank(s): loss {loss:.3f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
