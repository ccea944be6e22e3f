"""The paper's LLaMA block: trace the 128K-token workload at paper size without data (ShapeDtype),
then run a small config with two packed sequences on numpy."""
import numpy as np

import eins
from eins import tolerance
from eins.models import llama

# Paper size, no data: 131,072 tokens x 4,096, float16.
wl = llama.WORKLOADS["1x128K"]
prog = eins.make_ir(wl.function(llama.PAPER))(*wl.args(llama.PAPER, "float16"))
print(f"{wl.name}: {len(prog.eqns)} eqns, x {prog.inputs[0].type}, "
      f"out {prog.outputs[0].type}")

# Small and real: two sequences of 6 and 10 tokens packed end to end.
cfg, segments = llama.SMALL, (6, 16)
rng = np.random.default_rng(0)
x = rng.standard_normal((16, cfg.d_model)).astype(np.float32)
weights = llama.init_weights(cfg, rng, np.float32)
cos, sin = llama.rope_tables(16, cfg.head_dim, segments)
block = eins.jit(llama.block_fn(cfg, segments))
y = block(x, weights, cos, sin)
ref = llama.reference_block(x, weights, cos, sin, cfg, segments)
# float32 rounding, as far as the block's longest accumulation and its chain of them allow
n, depth = tolerance.accumulation(eins.make_ir(llama.block_fn(cfg, segments))(x, weights, cos, sin))
assert tolerance.close(y, ref, n, depth), np.max(np.abs(y - ref))
print("small block:", y.shape, "matches the numpy reference")
