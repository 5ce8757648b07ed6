"""A digit classifier too large for one process's memory budget, trained as a pipeline.

    kdist run -n 2 examples/pipeline_parallel.py                  # 2 stages
    kdist run -n 4 examples/pipeline_parallel.py --replicas 2     # 2 pipelines x 2 stages
    kdist run -n 2 examples/pipeline_parallel.py --recompute --schedule gpipe

Each rank builds only its own stage, so the whole model exists nowhere. The
budget is simulated: a stage whose weights and Adam's two slots exceed
`--budget-mb` is refused, and the whole model does not fit it.
"""

import argparse

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kdist
from kdist.pipeline import PipelineModel

WIDTH = 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="per pipeline")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--budget-mb", type=float, default=32.0,
                        help="weights and optimizer slots one process may hold")
    return parser.parse_args()


def stage_layers():
    """The layers of each of the two stages."""
    return [
        lambda: [keras.Input((64,)), keras.layers.Dense(WIDTH, activation="relu"),
                 keras.layers.Dense(WIDTH, activation="relu")],
        lambda: [keras.Input((WIDTH,)), keras.layers.Dense(WIDTH, activation="relu"),
                 keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(10)],
    ]


def megabytes_with_adam(model):
    return 3 * sum(int(np.prod(w.shape)) for w in model.trainable_weights) * 4 / 2**20


def main():
    args = parse_args()
    kdist.init()
    builders = []
    for index, layers in enumerate(stage_layers()):
        def build(index=index, layers=layers):
            keras.utils.set_random_seed(index)
            stage = keras.Sequential(layers(), name=f"stage_{index}")
            size = megabytes_with_adam(stage)
            if size > args.budget_mb:
                raise MemoryError(f"stage {index} needs {size:.1f} MB, over the budget of "
                                  f"{args.budget_mb} MB")
            return stage
        builders.append(build)
    model = PipelineModel(builders, micro_batches=args.micro_batches, schedule=args.schedule,
                          recompute=args.recompute, replicas=args.replicas)
    sizes = kdist.allgather_object(megabytes_with_adam(model.stage))[:model.num_stages]
    if kdist.rank() == 0:
        print(f"whole model: {sum(sizes):.1f} MB with Adam's slots, over the "
              f"{args.budget_mb} MB budget; stages: "
              + ", ".join(f"{s:.1f} MB" for s in sizes)
              + f"; {model.replicas} replica(s), {args.micro_batches} micro-batches, "
              f"{args.schedule}{', recomputing' if args.recompute else ''}", flush=True)

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=0)
    # Each pipeline replica trains on its own share of the rows.
    shard = slice(model.replica, None, model.replicas)
    model.compile(optimizer=keras.optimizers.Adam(3e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x_train[shard], y_train[shard], batch_size=args.batch_size, epochs=args.epochs,
              verbose=2 if kdist.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    model.close()
    if kdist.rank() == 0:
        print(f"test accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
