"""A Keras model that trains a generator and a discriminator in alternation."""

import keras
import tensorflow as tf

from kdist._args import whole_number
from kdist.comm import processes
from kdist.gan import batches
from kdist.precision import policy


@keras.saving.register_keras_serializable(package="kdist")
class GAN(keras.Model):
    """A generative adversarial network: two models, two optimizers, one `fit`.

    Each batch makes `d_steps` discriminator updates (real samples against
    fresh generated ones) and then `g_steps` generator updates. The generator
    takes latent noise, or `[noise, condition]` when it has two inputs (a
    conditional GAN, such as a calorimeter GAN conditioned on the primary
    energy). The discriminator's first output scores real against generated;
    any further outputs are auxiliary heads (an ACGAN-style energy regression,
    a sum of cell energies) trained with `aux_losses` on both real and
    generated samples.

    Batches, for `fit`, `evaluate` and `train_on_batch`, are `real`,
    `(real, condition)`, `(real, condition, aux)` or a dict with keys "real"
    (required), "condition", "aux" and "latent". Without "aux", each auxiliary
    output regresses the condition. "latent" gives the latent draws, for
    reproducible steps: `(batch, latent_dim)`, reused by every update, or
    `(batch, d_steps + g_steps, latent_dim)`, one draw per update. Otherwise
    each rank draws its own noise.

    The logs are `d_loss` and `g_loss`, and per auxiliary output
    `d_<name>_loss` and `g_<name>_loss` (the discriminator's output names,
    else `aux1`, `aux2`...), each the loss of the whole batch.

    Both optimizers take part in kdist's data parallelism: wrap each in
    `kdist.DistributedOptimizer`, or build and compile inside an
    `MPIStrategy` or `ParameterServerStrategy` scope. `optimizers` lists
    them, for kdist's callbacks (broadcast, checkpoints) to find both.

    Saving: `gan.save("gan.keras")` and `keras.models.load_model` restore
    both models, both optimizers' state and the loss settings
    (`get_config`, `get_compile_config`). The legacy `.h5` format cannot:
    saving to it raises `ValueError`; save the weights alone with
    `gan.save_weights("gan.weights.h5")`.

    Args:
        generator: a built `keras.Model` from noise (and condition) to samples.
        discriminator: a built `keras.Model` from samples to a real/fake
            score and optional auxiliary outputs; not the generator itself.
        latent_dim: size of the noise vector; read from the generator's first
            input when omitted.
        d_steps: discriminator updates per batch (at least 1).
        g_steps: generator updates per batch (at least 1).
        seed: seed of the latent noise.

    Raises:
        TypeError: a model that is not a `keras.Model`.
        ValueError: one model passed as both, `d_steps` or `g_steps` below 1,
            a model that is not built, or a generator whose first input has
            no fixed size and no `latent_dim`.

    Example:

        >>> import keras, numpy as np, kdist.gan
        >>> g = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> d = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, "sigmoid")])
        >>> gan = kdist.gan.GAN(g, d, d_steps=1, g_steps=2, seed=1)
        >>> gan.compile(d_optimizer="adam", g_optimizer="adam")
        >>> history = gan.fit(np.ones((8, 2), "float32"), batch_size=4, verbose=0)
        >>> int(gan.d_optimizer.iterations), int(gan.g_optimizer.iterations)
        (2, 4)
    """

    def __init__(self, generator, discriminator, latent_dim=None, d_steps=1, g_steps=1,
                 seed=None, **kwargs):
        super().__init__(**kwargs)
        for role, model in (("generator", generator), ("discriminator", discriminator)):
            if not isinstance(model, keras.Model):
                raise TypeError(f"The {role} must be a keras.Model; got {type(model).__name__}.")
        if generator is discriminator:
            raise ValueError("The generator and the discriminator must be different models.")
        for name, steps in (("d_steps", d_steps), ("g_steps", g_steps)):
            whole_number(steps, name, minimum=1)  # updates per batch
        self.generator = generator
        self.discriminator = discriminator
        self.conditional = len(_inputs(generator)) == 2
        self.latent_dim = int(latent_dim or _latent_size(generator))
        self.d_steps, self.g_steps = int(d_steps), int(g_steps)
        self.seed = seed
        self._noise = keras.random.SeedGenerator(seed)
        self.aux_outputs = len(_outputs(discriminator)) - 1
        self.built = generator.built and discriminator.built

    @property
    def optimizers(self):
        """`[d_optimizer, g_optimizer]` once compiled (empty before). kdist's
        callbacks that broadcast, check or save optimizer state read both here."""
        return [self.d_optimizer, self.g_optimizer] if self.compiled else []

    def compile(self, d_optimizer, g_optimizer, loss="binary_crossentropy", aux_losses=None,
                aux_loss_weights=None, adversarial_weight=1.0, label_smoothing=0.0, **kwargs):
        """Sets the two optimizers and the losses.

        Args:
            d_optimizer: the discriminator's optimizer (an instance or a name).
            g_optimizer: the generator's optimizer (an instance or a name), a
                different object from `d_optimizer`.
            loss: the adversarial loss on the first discriminator output; the
                default expects a sigmoid probability. Pass
                `keras.losses.BinaryCrossentropy(from_logits=True)` for logits.
            aux_losses: one loss per auxiliary discriminator output.
            aux_loss_weights: their weights (default 1 each).
            adversarial_weight: the weight of the adversarial loss.
            label_smoothing: one-sided smoothing, in [0, 1): the
                discriminator's target for real samples is
                `1 - label_smoothing`.
            **kwargs: passed to `keras.Model.compile`.

        Under Keras's `mixed_float16` global policy, both optimizers are
        wrapped in `kdist.precision.LossScaleOptimizer` (unless they are loss
        scale optimizers already), so that ranks agree on which steps overflow.

        Raises:
            ValueError: a missing optimizer or one object given as both;
                `label_smoothing` outside [0, 1); not one loss (or one weight)
                per auxiliary output; an unknown loss.
        """
        d_optimizer = keras.optimizers.get(d_optimizer)
        g_optimizer = keras.optimizers.get(g_optimizer)
        if d_optimizer is None or g_optimizer is None:
            raise ValueError("A GAN needs both a d_optimizer and a g_optimizer.")
        if d_optimizer is g_optimizer:
            raise ValueError("Give the discriminator and the generator separate optimizer "
                             "objects; each keeps its own slots and step count.")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}.")
        aux_losses = list(aux_losses or [])
        if len(aux_losses) != self.aux_outputs:
            raise ValueError(f"The discriminator has {self.aux_outputs} auxiliary outputs; "
                             f"give one loss for each in aux_losses (got {len(aux_losses)}).")
        weights = [1.0] * self.aux_outputs if aux_loss_weights is None else list(
            aux_loss_weights)
        if len(weights) != self.aux_outputs:
            raise ValueError(f"aux_loss_weights needs {self.aux_outputs} values; "
                             f"got {len(weights)}.")
        super().compile(optimizer=None, **kwargs)
        if policy.loss_scaling_enabled():
            # kdist's loss scaling, so that ranks agree on which steps overflow.
            d_optimizer, g_optimizer = (
                o if isinstance(o, keras.optimizers.LossScaleOptimizer)
                else policy.LossScaleOptimizer(o) for o in (d_optimizer, g_optimizer))
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.adversarial_loss = _as_loss(loss)
        self.aux_losses = [_as_loss(item) for item in aux_losses]
        self.aux_loss_weights = [float(w) for w in weights]
        self.adversarial_weight = float(adversarial_weight)
        self.label_smoothing = float(label_smoothing)
        self._compile_args = {
            "d_optimizer": d_optimizer, "g_optimizer": g_optimizer, "loss": loss,
            "aux_losses": aux_losses, "aux_loss_weights": self.aux_loss_weights,
            "adversarial_weight": self.adversarial_weight,
            "label_smoothing": self.label_smoothing}
        names = _aux_names(self.discriminator, self.aux_outputs)
        self._trackers = {name: keras.metrics.Mean(name=name) for name in
                          ["d_loss", "g_loss"] + [f"d_{n}_loss" for n in names]
                          + [f"g_{n}_loss" for n in names]}
        self._build_optimizers()

    def _build_optimizers(self):
        if self.discriminator.built and not self.d_optimizer.built:
            self.d_optimizer.build(self.discriminator.trainable_variables)
        if self.generator.built and not self.g_optimizer.built:
            self.g_optimizer.build(self.generator.trainable_variables)

    @property
    def metrics(self):
        return list(getattr(self, "_trackers", {}).values())

    def call(self, inputs, training=False):
        """The generator's output for `noise`, or for `[noise, condition]`."""
        return self.generator(inputs, training=training)

    def generate(self, condition=None, count=None, seed=None, batch_size=256):
        """Generated samples as numpy, one per condition row (or `count` of them).

        Args:
            condition: for a conditional generator, one row per sample.
            count: for an unconditional one, how many samples.
            seed: seed of the latent noise (numpy's generator).
            batch_size: samples per generator call.

        Raises:
            ValueError: no `condition` for a conditional generator, or no
                `count` for another.
        """
        import numpy as np

        if self.conditional:
            if condition is None:
                raise ValueError("This generator is conditional: pass condition=.")
            condition = np.asarray(condition, "float32").reshape(len(condition), -1)
            count = len(condition)
        elif count is None:
            raise ValueError("Pass count= to say how many samples to generate.")
        noise = np.random.default_rng(seed).normal(size=(count, self.latent_dim))
        inputs = noise.astype("float32")
        if self.conditional:
            inputs = [inputs, condition]
        return self.generator.predict(inputs, batch_size=batch_size, verbose=0)

    # Training.
    def train_step(self, data):
        real, condition, aux, latent = batches.unpack(data, self.aux_outputs)
        batch = tf.shape(real)[0]
        for step in range(self.d_steps):
            fake = self.generator(self._generator_inputs(batch, condition, latent, step),
                                  training=True)
            with tf.GradientTape() as tape:
                d_loss, d_aux = self._discriminator_loss(real, fake, aux, training=True)
                scaled = self.d_optimizer.scale_loss(d_loss)
            variables = self.discriminator.trainable_variables
            self.d_optimizer.apply(tape.gradient(scaled, variables), variables)
        for step in range(self.d_steps, self.d_steps + self.g_steps):
            with tf.GradientTape() as tape:
                fake = self.generator(self._generator_inputs(batch, condition, latent, step),
                                      training=True)
                g_loss, g_aux = self._generator_loss(fake, aux)
                scaled = self.g_optimizer.scale_loss(g_loss)
            variables = self.generator.trainable_variables
            self.g_optimizer.apply(tape.gradient(scaled, variables), variables)
        return self._track(batch, d_loss, g_loss, d_aux, g_aux)

    def test_step(self, data):
        real, condition, aux, latent = batches.unpack(data, self.aux_outputs)
        batch = tf.shape(real)[0]
        fake = self.generator(self._generator_inputs(batch, condition, latent, 0),
                              training=False)
        d_loss, d_aux = self._discriminator_loss(real, fake, aux, training=False)
        g_loss, g_aux = self._generator_loss(fake, aux)
        return self._track(batch, d_loss, g_loss, d_aux, g_aux)

    def _generator_inputs(self, batch, condition, latent, step):
        if latent is not None:
            noise = batches.latent_draw(tf.convert_to_tensor(latent), step,
                                        self.d_steps + self.g_steps)
        else:
            # Read when the step is traced, after kdist has started, so a GAN built
            # before init() still gets this rank's stream.
            stream = processes.rank() if processes.is_initialized() else 0
            noise = batches.normal(batch, self.latent_dim, self._noise.next(), stream)
        if not self.conditional:
            return noise
        if condition is None:
            raise ValueError("The generator takes a condition; give each batch one, as "
                             "(real, condition) or {'real': ..., 'condition': ...}.")
        return [noise, tf.cast(batches.column(condition), noise.dtype)]

    def _discriminator_loss(self, real, fake, aux, training):
        real_out = _as_list(self.discriminator(real, training=training))
        fake_out = _as_list(self.discriminator(fake, training=training))
        real_target = tf.fill(tf.shape(real_out[0]), 1.0 - self.label_smoothing)
        loss = self.adversarial_weight * (
            self.adversarial_loss(real_target, real_out[0])
            + self.adversarial_loss(tf.zeros_like(fake_out[0]), fake_out[0]))
        aux_terms = []
        for index, (target, weight) in enumerate(zip(aux, self.aux_loss_weights)):
            term = self._aux_loss(index, target, real_out[index + 1])
            loss += weight * (term + self._aux_loss(index, target, fake_out[index + 1]))
            aux_terms.append(term)
        return loss, aux_terms

    def _generator_loss(self, fake, aux):
        # The discriminator is frozen here: inference mode, as in a combined model
        # whose discriminator is not trainable.
        outputs = _as_list(self.discriminator(fake, training=False))
        loss = self.adversarial_weight * self.adversarial_loss(
            tf.ones_like(outputs[0]), outputs[0])
        aux_terms = []
        for index, (target, weight) in enumerate(zip(aux, self.aux_loss_weights)):
            term = self._aux_loss(index, target, outputs[index + 1])
            loss += weight * term
            aux_terms.append(term)
        return loss, aux_terms

    def _aux_loss(self, index, target, prediction):
        target = tf.cast(batches.column(target), prediction.dtype)
        return self.aux_losses[index](tf.reshape(target, tf.shape(prediction)), prediction)

    def _track(self, batch, d_loss, g_loss, d_aux, g_aux):
        # Keras losses divide by the replica count under tf.distribute (the
        # optimizer sums gradients); report the loss of the whole batch.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        values = [d_loss, g_loss] + d_aux + g_aux
        for tracker, value in zip(self._trackers.values(), values):
            tracker.update_state(tf.cast(value, "float32") * replicas, sample_weight=batch)
        return {name: tracker.result() for name, tracker in self._trackers.items()}

    # Serialisation.
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the GAN to a `.keras` file: both models, both optimizers, the settings.

        Raises:
            ValueError: a `.h5` or `.hdf5` path: the legacy format holds one
                optimizer and names the model's class without its package.
        """
        if str(filepath).endswith((".h5", ".hdf5")):
            raise ValueError(
                f"Cannot save a GAN to {str(filepath)!r}: the legacy .h5 format holds one "
                "optimizer and names the model's class without its package, so it cannot "
                "restore a GAN. Save to a .keras file (gan.save('gan.keras')), or the weights "
                "alone with gan.save_weights('gan.weights.h5').")
        return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update({
            "generator": keras.saving.serialize_keras_object(self.generator),
            "discriminator": keras.saving.serialize_keras_object(self.discriminator),
            "latent_dim": self.latent_dim, "d_steps": self.d_steps, "g_steps": self.g_steps,
            "seed": self.seed})
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for role in ("generator", "discriminator"):
            config[role] = keras.saving.deserialize_keras_object(config[role])
        return cls(**config)

    def get_compile_config(self):
        if not self.compiled:
            return None
        return {key: keras.saving.serialize_keras_object(value)
                for key, value in self._compile_args.items()}

    def compile_from_config(self, config):
        config = {key: keras.saving.deserialize_keras_object(value)
                  for key, value in config.items()}
        self.compile(**config)


class _MeanOverBatch(keras.losses.Loss):
    """A per-sample loss function reduced like Keras's own loss classes.

    The reduction (mean over the batch, divided by the replica count under
    tf.distribute) is what makes summed replica gradients equal the gradient
    of the global batch.
    """

    def __init__(self, function):
        super().__init__(name=getattr(function, "__name__", "loss"))
        self.function = function

    def call(self, y_true, y_pred):
        return self.function(y_true, y_pred)


def _as_loss(identifier):
    loss = keras.losses.get(identifier)
    if loss is None:
        raise ValueError(f"Unknown loss {identifier!r}.")
    return loss if isinstance(loss, keras.losses.Loss) else _MeanOverBatch(loss)


def _inputs(model):
    try:
        return list(model.inputs)
    except (AttributeError, ValueError):
        raise ValueError(f"Build the model {model.name!r} (give it a keras.Input) before "
                         "making a GAN of it.") from None


def _outputs(model):
    try:
        return list(model.outputs) if isinstance(model.outputs, (list, tuple)) else [
            model.outputs]
    except (AttributeError, ValueError):
        raise ValueError(f"Build the model {model.name!r} (give it a keras.Input) before "
                         "making a GAN of it.") from None


def _latent_size(generator):
    size = _inputs(generator)[0].shape[-1]
    if size is None:
        raise ValueError("The generator's first input has no fixed size; pass latent_dim=.")
    return size


def _aux_names(discriminator, count):
    names = list(getattr(discriminator, "output_names", None) or [])
    if len(names) == count + 1 and len(set(names)) == len(names):
        return names[1:]
    return [f"aux{index + 1}" for index in range(count)]


def _as_list(outputs):
    if isinstance(outputs, dict):
        return list(outputs.values())
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
