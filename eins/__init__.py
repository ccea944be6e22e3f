"""eins: automatic multi-GPU parallelism where every kernel is a join (Einsummable)."""
from eins.errors import *  # noqa: F401,F403
from eins.errors import EinsError  # noqa: F401
from eins.tracing import ShapeDtype, tree_flatten, tree_unflatten  # noqa: F401
from eins.api import jit, make_ir  # noqa: F401
from eins.api import distribute  # noqa: F401
from eins.ops import *  # noqa: F401,F403
from eins import numpy_api as _numpy_api  # noqa: F401  (numpy's functions on traced arrays)
from eins import world as _world  # noqa: F401  (distribute(devices="world"))
from eins.frontends import from_torch  # noqa: F401  (also: jit/distribute of an nn.Module)
from eins.ir.types import bfloat16  # noqa: F401
from eins.paper import createGraph, tensorDesc, compileGraph  # noqa: F401  (paper Section 2)

__version__ = "0.1.0"
