"""Code generation from the device IR (eins/ir/device.py).

``generate(dprog, target)`` renders a device program from Jinja templates
(eins/codegen/templates/) into one Python module per device plus a shared kernel module:

- target ``"cuda"``: per device a host program for the GPU runtime (eins/runtime/gpu.py):
  every buffer allocated once, Loads first and Stores last, the device's instructions in
  order on its own stream, fused elementwise Triton kernels and ⊕ kernels from the shared
  module, the other primitives through eins/kernels' launchers (attention,
  rms_norm, rope in Triton; matmul via cuBLAS) or torch lowerings, each run of kernels a
  graph segment (captured once, replayed), transfers as copies ordered by events. The same
  sources run on GPUs (backend "cuda") and on the CPU under Triton's interpreter (backend
  "interpret"), which is how the tests run them.
- target ``"numpy"``: the same instruction walk as plain numpy, executable here
  (``GeneratedProgram.run``), so the generator's scheduling is checked on the CPU.

Elementwise kernels in both come from one expression table with two dialects
(eins/kernels/expressions.py).
"""
from eins.codegen.generate import GeneratedProgram, generate  # noqa: F401
