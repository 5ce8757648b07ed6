"""Fixed-point grids: the arithmetic of FPGA firmware, for training and export.

A fixed-point number of `width` bits with `integer` integer bits (sign
included when signed) is a multiple of `2**(integer - width)` saturated to
its range. `quantize(..., fixed_point=True)` trains on such grids: weight
scales are powers of two and outputs are rounded half to even and
saturated, so a model exported with `export_hls4ml` computes the same
numbers in hls4ml's C++ (`ap_fixed<width, integer, AP_RND_CONV, AP_SAT>`).
"""

import math

import keras
import numpy as np
import tensorflow as tf

from kdist._args import whole_number


class FixedType:
    """A fixed-point type: `width` bits, `integer` of them above the binary point.

    A value of the type is a multiple of `step = 2**(integer - width)`
    between `smallest` and `largest`; `cast(values)` puts values there, and
    `str()` is the type in hls4ml's notation. Types compare equal by that
    string. `kdist.sparsity.fixed.exact_type(values)` (the narrowest type
    that holds values exactly) and `kdist.sparsity.fixed.range_type(low,
    high, bits)` (the `bits`-wide type that covers a range) make the types
    `export_hls4ml` uses.

    Args:
        width: bits in all, at least 1.
        integer: bits above the binary point, the sign included when signed
            (may be negative or exceed `width`).
        signed: two's complement (`fixed`) or unsigned (`ufixed`).
        rounding: round half to even and saturate (`RND_CONV,SAT` in the
            name), as kdist's fixed-point training does; else hls4ml's
            default truncation and wrapping.

    Raises:
        ValueError: `width` is a fraction or below 1 (`TypeError` if it is not
            a number).

    Example:

        >>> FixedType(8, 3).step, FixedType(8, 3).largest, FixedType(8, 3).smallest
        (0.03125, 3.96875, -4.0)
        >>> str(FixedType(6, 2, signed=False, rounding=True))
        'ufixed<6,2,RND_CONV,SAT>'
    """

    def __init__(self, width, integer, signed=True, rounding=False):
        whole_number(width, "A fixed-point width", minimum=1)
        self.width, self.integer = int(width), int(integer)
        self.signed, self.rounding = bool(signed), bool(rounding)

    @property
    def step(self):
        """The distance between neighbouring values, `2**(integer - width)`."""
        return 2.0 ** (self.integer - self.width)

    @property
    def smallest(self):
        """The most negative value (0 when unsigned)."""
        return -(2.0 ** (self.integer - 1)) if self.signed else 0.0

    @property
    def largest(self):
        """The largest value, one step below a power of two."""
        top = self.integer - 1 if self.signed else self.integer
        return 2.0 ** top - self.step

    def __str__(self):
        name = "fixed" if self.signed else "ufixed"
        modes = ",RND_CONV,SAT" if self.rounding else ""
        return f"{name}<{self.width},{self.integer}{modes}>"

    __repr__ = __str__

    def __eq__(self, other):
        return isinstance(other, FixedType) and str(self) == str(other)

    def __hash__(self):
        return hash(str(self))

    def cast(self, values):
        """`values` rounded half to even onto the grid and saturated (NumPy)."""
        values = np.asarray(values, dtype=np.float64)
        return np.clip(np.rint(values / self.step) * self.step, self.smallest, self.largest)


def exact_type(values, max_width=64):
    """The narrowest signed fixed-point type that holds every value exactly.

    >>> exact_type([0.75, -1.5, 0.0])
    fixed<4,2>
    """
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    values = values[values != 0]
    if values.size == 0:
        return FixedType(1, 1)
    fraction = 0
    while not np.all(values * 2.0 ** fraction == np.rint(values * 2.0 ** fraction)):
        fraction += 1
        if fraction > max_width:
            raise ValueError("These values are not on a fixed-point grid of at most "
                             f"{max_width} bits; train with quantize(..., fixed_point=True).")
    codes = np.rint(values * 2.0 ** fraction)
    # Two's complement of w bits holds -2**(w-1) .. 2**(w-1) - 1.
    width = max(int(np.max(np.where(codes < 0, -codes - 1, codes))).bit_length() + 1, 1)
    return FixedType(width, width - fraction)


def range_type(low, high, bits):
    """The `bits`-wide type whose range just covers [low, high], rounding and saturating.

    Unsigned when `low >= 0` (after a ReLU), so no bit is spent on a sign.

    >>> range_type(0.0, 5.2, 8), range_type(-0.7, 0.4, 6)
    (ufixed<8,3,RND_CONV,SAT>, fixed<6,1,RND_CONV,SAT>)
    """
    signed = low < 0
    largest = max(abs(float(low)), abs(float(high)), 2.0 ** -24)
    integer = math.ceil(math.log2(largest)) + (1 if signed else 0)
    return FixedType(bits, integer, signed=signed, rounding=True)


def power_of_two_scale(largest, levels):
    """The smallest power of two `s` with `largest <= levels * s` (tensor ops)."""
    ops = keras.ops
    needed = ops.maximum(largest / levels, 2.0 ** -24)
    return ops.power(2.0, ops.ceil(ops.log2(needed)))


def fake_fixed(values, low, high, bits):
    """`values` on the grid `range_type(low, high, bits)` picks, in tensor ops.

    `low` and `high` are scalar tensors (the tracked output range); the
    exponent follows them, so it is the one `range_type` gives at export.
    """
    ops = keras.ops
    signed = low < 0
    largest = ops.maximum(ops.maximum(ops.abs(low), ops.abs(high)), 2.0 ** -24)
    integer = ops.ceil(ops.log2(largest)) + ops.cast(signed, "float32")
    step = ops.power(2.0, integer - bits)
    top = ops.where(signed, ops.power(2.0, integer - 1), ops.power(2.0, integer)) - step
    bottom = ops.where(signed, -ops.power(2.0, integer - 1), ops.zeros_like(step))
    # Saturation stops the gradient outside the range, as a real clip does;
    # rounding passes it straight through. Both bounds lie on the grid, so
    # clipping first gives the same values as rounding first.
    inside = ops.clip(values, bottom, top)
    return tf.grad_pass_through(lambda v: ops.round(v / step) * step)(inside)
