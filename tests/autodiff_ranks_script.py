"""Run by tests/test_autodiff_ranks.py under torchrun (one process per rank, gloo on
127.0.0.1): the gradients of a small MLP distributed over the ranks (devices="world") equal
eins.jit's. Each rank writes its result to OUT/rank<r>.json.

    python autodiff_ranks_script.py OUT [SCHEDULE]
"""
import json
import os
import sys

import numpy as np
from helpers import accumulation, assert_close  # tests/helpers.py: this script's directory

import eins
from eins.ir.plan import Tuning

OUT = sys.argv[1]
SCHEDULE = sys.argv[2] if len(sys.argv) > 2 else "naive"


def loss(p, x, y):
    h = eins.silu(eins.rms_norm(x, p["g"]) @ p["w1"])
    return eins.mean((h @ p["w2"] - y) ** 2)


def main():
    rng = np.random.default_rng(0)
    p = {"w1": (rng.standard_normal((16, 32)) / 4).astype(np.float32),
         "w2": (rng.standard_normal((32, 8)) / 6).astype(np.float32),
         "g": (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)}
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.standard_normal((64, 8)).astype(np.float32)
    vg = eins.value_and_grad(loss)
    f = eins.distribute(vg, devices="world", timeout_s=60, schedule=SCHEDULE,
                        tuning=Tuning(device_subsets=False))   # a plan over every rank
    got = f(p, x, y)
    want = eins.jit(vg)(p, x, y)
    low = f.lower(p, x, y)
    n, depth = accumulation(low.program)
    try:
        for g, w in zip(eins.tree_flatten(got)[0], eins.tree_flatten(want)[0]):
            assert_close(g, w, n=n, depth=depth)
        close = "ok"
    except AssertionError as e:
        close = str(e)[:2000]
    res = {"rank": f.rank, "world": f.world_size, "close": close,
           "bwd_eqns": sum(e.phase == "bwd" for e in low.program.eqns),
           "sent": sum(f.stats()["bytes_sent"].values())}
    with open(os.path.join(OUT, f"rank{f.rank}.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    main()
