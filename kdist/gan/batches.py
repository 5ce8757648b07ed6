"""What a GAN batch holds, and the latent noise each update draws."""

import tensorflow as tf

KEYS = ("real", "condition", "aux", "latent")


def unpack(data, aux_outputs):
    """Splits a batch into real samples, condition, auxiliary targets and latent draws.

    A batch is what `fit` hands `train_step`: `real`, `(real,)`,
    `(real, condition)`, `(real, condition, aux)`, or a dict with the keys
    "real" (required), "condition", "aux" and "latent". Without "aux", every
    auxiliary discriminator output regresses the condition.
    """
    if isinstance(data, (tuple, list)):
        # train_on_batch hands (x, None, None) when only x is given.
        data = list(data)
        while len(data) > 1 and data[-1] is None:
            data.pop()
        if len(data) == 1:
            data = data[0]
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(KEYS))
        if unknown or "real" not in data:
            raise ValueError(f"A GAN batch dict holds the keys {list(KEYS)}, 'real' required; "
                             f"got {sorted(data)}.")
        real, condition = data["real"], data.get("condition")
        aux, latent = data.get("aux"), data.get("latent")
    elif isinstance(data, (tuple, list)):
        if len(data) > 3:
            raise ValueError("A GAN batch is (real, condition, aux) at most; got "
                             f"{len(data)} parts. Pass a dict to give the latent draws too.")
        real, condition, aux = (list(data) + [None, None])[:3]
        latent = None
    else:
        real, condition, aux, latent = data, None, None, None
    if aux is None:
        if aux_outputs and condition is None:
            raise ValueError("The discriminator has auxiliary outputs, so each batch needs "
                             "their targets ('aux') or a condition for them to regress.")
        aux = [condition] * aux_outputs
    elif not isinstance(aux, (tuple, list)):
        aux = [aux]
    aux = list(aux)
    if len(aux) != aux_outputs:
        raise ValueError(f"The discriminator has {aux_outputs} auxiliary outputs but the batch "
                         f"gives {len(aux)} targets.")
    return real, condition, aux, latent


def column(values):
    """`values` as a float tensor of shape (batch, features)."""
    values = tf.convert_to_tensor(values)
    if values.dtype.is_integer or values.dtype == tf.bool:
        values = tf.cast(values, tf.float32)
    if values.shape.rank == 1:
        values = values[:, None]
    return values


def latent_draw(latent, step, steps):
    """Draw `step` of `steps` from a batch's given latent values.

    `latent` is (batch, latent_dim), reused by every update, or
    (batch, steps, latent_dim), one draw per update.
    """
    if latent.shape.rank == 3:
        if latent.shape[1] != steps:
            raise ValueError(f"Given latent draws have {latent.shape[1]} per sample; this GAN "
                             f"makes {steps} updates per batch (d_steps + g_steps).")
        return latent[:, step]
    return latent


def normal(batch, latent_dim, seed, stream):
    """Standard normal latent vectors from a stateless seed, distinct per process stream.

    Each rank passes its own `stream`, so data-parallel replicas do not draw
    the same noise for their shares of the batch, while the seed state itself
    (a model variable) stays identical everywhere.
    """
    seed = tf.cast(seed, tf.int64) + tf.constant([0, 1000003], tf.int64) * stream
    return tf.random.stateless_normal((batch, latent_dim), seed=seed)
