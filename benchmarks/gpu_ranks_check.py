"""GPU check of the rank runtime (issue 13, part 6): torchrun ranks on CUDA equal eins.jit.

Needs CUDA and torch with NCCL. Each rank runs the GPU runtime's ``"cuda"`` kernel set
(eins/runtime/gpu_ranks.py: Triton elementwise and ⊕ kernels, cuBLAS matmul, Triton
attention/norms/rope on the rank's own stream), chosen with ``backend="cuda"``. With one
GPU, 2 ranks share it (their transfers go through host memory over gloo, since NCCL refuses
two ranks on one GPU); with more, one rank per GPU (transfers over NCCL). Each rank runs the LLaMA tiny block with packed segments and chain B
and compares with eins.jit; each rank's sent bytes are compared with its Send instructions.

    python benchmarks/gpu_ranks_check.py          # prints a JSON report, exit 1 on failure

:func:`check_ranks` is importable (e.g. by ``benchmarks/gpu_check.py``). Not run yet on a
GPU: none was at hand when it or the "cuda" kernel set was written; the same kernels on the
CPU ("interpret") are tested by tests/test_ranks.py.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# float32 matmuls on GPUs may run in TF32 (10-bit mantissa): ~1e-3 relative per product
TOL = 5e-3


def check_ranks(nproc=None, timeout_s=300.0) -> dict:
    """Launch the ranks; -> {"ok", "nproc", "shared_gpu", "ranks": {rank: result}} or
    {"ok": False, "skipped"/"error": why}."""
    import torch
    if not torch.cuda.is_available():
        return {"ok": False, "skipped": "no CUDA device"}
    gpus = torch.cuda.device_count()
    n = nproc or max(2, gpus)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               "--master-addr=127.0.0.1", f"--master-port={port}", os.path.abspath(__file__),
               "--worker", out, str(timeout_s)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"torchrun did not finish in {timeout_s + 60:g} s"}
        ranks = {}
        for r in range(n):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks[r] = json.load(f)
    ok = (p.returncode == 0 and len(ranks) == n
          and all(res.get("ok") for res in ranks.values()))
    rep = {"ok": ok, "nproc": n, "gpus": gpus, "shared_gpu": n > gpus, "ranks": ranks}
    if not ok:
        rep["log"] = (p.stdout + p.stderr).decode(errors="replace")[-4000:]
    return rep


def _worker(out, timeout_s):
    import eins
    from eins.models import chains, llama
    from eins.runtime import ranks as R
    rank = int(os.environ["RANK"])
    res = {"ok": False}
    try:
        cfg, segs, s = llama.TINY, (4, 12, 16), 16
        rng = np.random.default_rng(0)
        w = llama.init_weights(cfg, rng)
        x = rng.standard_normal((s, cfg.d_model)).astype(np.float32)
        cos, sin = llama.rope_tables(s, cfg.head_dim, segs)
        c = chains.chain("B", scale=256)
        cases = {"llama": (llama.block_fn(cfg, segs), (x, w, cos, sin)),
                 "chain": (c.fn, tuple(c.arrays()))}
        for name, (fn, args) in cases.items():
            f = eins.distribute(fn, devices="world", timeout_s=timeout_s, backend="cuda")
            got = f(*args)
            want = eins.jit(fn)(*args)
            err = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))))
                      for a, b in zip(eins.tree_flatten(got)[0], eins.tree_flatten(want)[0]))
            dprog = f.lower(*args).physical.device
            st = f.stats()
            res[name] = {"err": err, "kernels": f._kernels.name, "wire": f._kernels.wire,
                         "sent_equals_plan": st["bytes_sent"] == R.planned_sends(dprog, rank),
                         "seconds": st["seconds"]}
        res["ok"] = all(res[k]["err"] <= TOL and res[k]["sent_equals_plan"]
                        and res[k]["kernels"] == "cuda" for k in cases)
    except Exception as e:  # the report carries it to the launcher
        res["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], float(sys.argv[3]))
    import argparse
    argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Prints a JSON report; exit 1 on failure, 0 when it passed or was skipped "
               "(no CUDA device).").parse_args()
    rep = check_ranks()
    print(json.dumps(rep, indent=1))
    sys.exit(0 if rep["ok"] or "skipped" in rep else 1)
