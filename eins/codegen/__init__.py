"""Code generation from the device IR (eins/ir/device.py).

``generate(dp, target)`` renders a device program from Jinja templates
(eins/codegen/templates/) into one Python module per device plus a shared kernel module:

- target ``"cuda"``: per device a CuPy host program that allocates every buffer, walks the
  device's instructions in order on one stream, launches Triton kernels (elementwise eqns,
  ⊕ aggregation, strided box copies for Slice/Concat) and CuPy ports of the other
  primitives (matmul/einsum via cuBLAS, attention via flash_attn when importable), captures
  each run of kernels into a ``cupy.cuda.Graph``, and moves blocks between GPUs with
  ``memcpyPeerAsync`` ordered by CUDA events.
- target ``"numpy"``: the same instruction walk as plain numpy, executable here
  (``GeneratedProgram.run``), so the generator's scheduling is checked on the CPU.

Elementwise kernels in both come from one expression table with two dialects
(eins/codegen/expressions.py).

Tested on the CPU (tests/test_codegen.py): the numpy target's outputs equal the numpy
backend's and eins.jit's; every CUDA source compiles as Python and names exactly the IR's
kernels, transfers, loads and stores; the two dialects give the same expression trees; the
numpy dialect and the CuPy ports (run with numpy) match the reference kernels.

The CUDA target has NOT been run on a GPU yet: no GPU was lent while it was written.
"""
from eins.codegen.generate import GeneratedProgram, generate  # noqa: F401
