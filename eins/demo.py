"""`eins demo` / `make demo`: the main job."""


def run(args=None):
    import numpy as np
    import eins

    def ffn(x, w1, w2):
        return eins.matmul(eins.matmul(x, w1), w2)

    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in [(8, 4), (4, 16), (16, 4)])
    print(eins.make_ir(ffn)(x, w1, w2))
    y = eins.jit(ffn)(x, w1, w2)
    ok = np.allclose(y, x @ w1 @ w2, rtol=1e-5)
    print("matches numpy:", ok)
    return 0 if ok else 1
