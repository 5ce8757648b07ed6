"""The digit classifier trained asynchronously around a parameter server.

    kdist run -n 4 examples/ps_quickstart.py                     # 1 master + 3 workers, Downpour
    kdist run -n 4 examples/ps_quickstart.py --mode gem
    kdist run -n 6 examples/ps_quickstart.py --submasters 1      # 1 master, 1 sub-master, 4 workers
    kdist run -n 4 examples/ps_quickstart.py --checkpoint ps-state   # rerun to resume

Rank 0 keeps the central model, validates it after every epoch, keeps the
best one with ModelCheckpoint and stops everyone early if validation stops
improving. The workers each train on their share of the images.
"""

import argparse

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kdist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("downpour", "easgd", "gem"), default="downpour")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--sync-every", type=int, default=1)
    parser.add_argument("--submasters", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=0.05,
                        help="of each worker's SGD")
    parser.add_argument("--checkpoint", help="directory of the master's state, for resuming")
    parser.add_argument("--save", default="ps_digits.keras", help="where the master saves")
    return parser.parse_args()


def main():
    args = parse_args()
    strategy = kdist.ps.ParameterServerStrategy(
        mode=args.mode, sync_every=args.sync_every, submasters=args.submasters,
        checkpoint_dir=args.checkpoint)
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype("int64"), test_size=0.2, random_state=0, stratify=digits.target)

    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)),
                                  keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    if strategy.is_master:
        print(f"ParameterServerStrategy({args.mode}): {strategy.num_workers} worker(s), "
              f"{args.submasters} sub-master(s), {len(x_train)} images.", flush=True)
    model.fit(x_train, y_train, batch_size=32, epochs=args.epochs,
              validation_data=(x_test, y_test),
              callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
                         keras.callbacks.ModelCheckpoint(args.save, monitor="val_loss",
                                                         save_best_only=True)])
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if strategy.is_master:
        print(f"test accuracy {accuracy:.3f}, loss {loss:.3f}", flush=True)


if __name__ == "__main__":
    main()
