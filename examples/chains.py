"""The paper's matrix chains A-E with their fixed parenthesizations: traced at paper size
(ShapeDtype, no data) and run at 1/1024 scale on numpy."""
import numpy as np

import eins
from eins.models import chains

for name in chains.CHAINS:
    full = chains.chain(name)
    prog = eins.make_ir(full.fn)(*full.shape_args("float16"))
    small = chains.chain(name, scale=1024)
    ms = small.arrays(np.random.default_rng(0), "float64")
    expect = ms[0]
    for m in ms[1:]:
        expect = expect @ m
    np.testing.assert_allclose(eins.jit(small.fn)(*ms), expect, rtol=1e-10)
    print(f"{full}: {len(prog.eqns)} matmuls, {full.matmul_flops() / 1e12:.1f} TFLOP; "
          f"scaled run OK")
