"""Front ends that turn other frameworks' programs into eins functions: PyTorch modules
through ``torch.export`` (:func:`from_torch`; ``eins.jit``/``eins.distribute`` of an
``nn.Module``). Importing this package does not import torch."""
from eins import api
from eins.frontends.module import is_module, wrap_module
from eins.frontends.torch import from_torch  # noqa: F401

# eins.api (a layer below) cannot import this package: it asks the frontends it is given
api._FRONTENDS.append((is_module, wrap_module))
