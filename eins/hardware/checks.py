"""The checks every reader of a topology applies to a number it is given (a bandwidth, a
latency, a GPU id): a :class:`~eins.errors.TopologyError` naming the topology, the value's
role and the value, never a float that would stall the simulator."""
from __future__ import annotations

import math
import numbers

from eins.errors import TopologyError


def positive(name, label, v, scale: float = 1.0, zero: bool = False) -> float:
    """``v * scale`` as a float when ``v`` is a real number (not a bool, not a string) and
    the product is positive (``zero``: or 0, as a latency may be) and finite; else a
    TopologyError naming ``label`` of topology ``name`` and ``v`` as given. An infinite
    bandwidth would leave the simulator's max-min rates at inf - inf = nan, looping."""
    f = None
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        try:
            f = float(v) * scale
        except OverflowError:   # an int beyond float's range
            f = None
    if f is None or not (0 <= f if zero else 0 < f) or not f < math.inf:
        what = "a finite number at least 0" if zero else "a positive, finite number"
        raise TopologyError(f"topology {name!r}: {label} must be {what}, got {short(v)}")
    return f


def latency_s(name, label, v, per_second: float = 1.0) -> float:
    """A latency in seconds from ``v`` in units of ``1 / per_second`` seconds (JSON's
    microseconds: ``per_second=1e6``): :func:`positive` that also takes 0. Divided, not
    multiplied by 1e-6: a division is correctly rounded, so 3.4 us is exactly
    :data:`~eins.hardware.specs.NVLINK_LATENCY_S` (3.4 * 1e-6 is 1 ulp below it)."""
    return positive(name, label, v, zero=True) / per_second


def short(v) -> str:
    """``repr(v)``, cut to 40 characters (a 400-digit number in a file stays readable)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def gpu_id(name, v, where: str) -> int:
    # non-negative: device ids are (distribute, ExProg sites), so a GPU -1 could never be used
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise TopologyError(f"topology {name!r}: GPU ids are non-negative ints, got "
                            f"{short(v)} in {where}")
    return int(v)
