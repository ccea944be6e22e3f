"""Code generation from the device IR: ``generate(dprog, target)`` renders a device
program from the Jinja templates of eins/codegen/templates/ into one Python module per
device plus a shared kernel module, for the GPU runtime (target "cuda") or as plain numpy
(target "numpy"); eins/codegen/generate.py says how."""
from eins.codegen.generate import GeneratedProgram, generate  # noqa: F401
