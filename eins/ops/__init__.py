"""The operator library: one file per family, every primitive registered in
``eins.ir.primitive``. The user-facing functions are re-exported here and from ``eins``;
importing this package installs them as the tracer's operators (``x + y`` on a Tracer is
:func:`add`)."""
import sys as _sys

from eins.ir.primitive import PRIMITIVES, Primitive, get_primitive, register  # noqa: F401
from eins.ops.elementwise import *  # noqa: F401,F403
from eins.ops.reductions import *  # noqa: F401,F403
from eins.ops.linalg import *  # noqa: F401,F403
from eins.ops.norms import *  # noqa: F401,F403
from eins.ops.rope import *  # noqa: F401,F403
from eins.ops.attention import *  # noqa: F401,F403
from eins.ops.shape import *  # noqa: F401,F403
from eins.ops.gather import *  # noqa: F401,F403
from eins.ops.sorting import *  # noqa: F401,F403
from eins.ops.ufuncs import *  # noqa: F401,F403
from eins.ops import gather as _gather, shape as _shape

# Looked up in sys.modules: the functions eins.ops.rope and eins.ops.attention shadow their
# modules' names in this package.
__all__ = [n for m in ("elementwise", "reductions", "linalg", "norms", "rope", "attention",
                       "shape", "gather", "sorting", "ufuncs")
           for n in _sys.modules[f"eins.ops.{m}"].__all__]


def getitem(x, idx):
    """``x[idx]``: static slicing (eins.ops.shape; a slice of another step: its covering
    slice, then a gather of the elements it picks), or numpy's integer-array indexing
    (eins.ops.gather) when an integer array is among the indices."""
    def basic(x, idx):
        if _shape.has_step(idx):
            return _shape.stepped(x, idx, _gather.take)
        return _shape.getitem(x, idx)
    return _gather.getitem(x, idx, basic)


from eins.tracing import install_operators as _install  # noqa: E402

_install(_sys.modules[__name__], "ops")
