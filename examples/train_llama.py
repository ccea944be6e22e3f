"""Train a tiny LLaMA (embedding, 2 blocks, head, cross-entropy; AdamW as eins elementwise
ops) for 50 steps on 8 virtual devices, and check its loss curve against the same model
trained by PyTorch (torch.autograd + torch.optim.AdamW, same initial weights, same batches),
step by step, within the tolerance rule (eins/tolerance.py).

The step (forward, backward and optimizer) is one program planned once. Weights and AdamW's
moments stay on the devices between steps (``outputs="devices"``: Sharded arrays in the
blocks the plan stored them; ``donate_argnums``: each step consumes the previous state), so
after the first step only the batch crosses from the host (the printed h2d bytes).

    python examples/train_llama.py                          # numpy virtual devices
    python examples/train_llama.py --backend interpret --steps 3
    torchrun --nproc-per-node=2 examples/train_llama.py --world --steps 3
"""
import argparse
import time

import numpy as np

import eins
from eins import tolerance
from eins.ir.plan import Tuning
from eins.models import llama, train


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--backend", choices=["numpy", "interpret"], default="numpy")
    ap.add_argument("--world", action="store_true",
                    help="one device per torchrun rank (devices='world')")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    a = ap.parse_args(argv)

    cfg = train.LMConfig(vocab=64, layers=2, block=llama.TINY)
    params = train.init_params(cfg)
    data = train.batches(cfg, a.steps, a.batch, a.seq)
    cos, sin = llama.rope_tables(a.seq, cfg.block.head_dim)

    # every device gets a share (device subsets off): a model this tiny is predicted
    # fastest on one device, and the example is about training distributed
    opts = dict(outputs="devices", donate_argnums=(0, 1, 2), backend=a.backend,
                tuning=Tuning(device_subsets=False))
    step = eins.distribute(train.step_fn(cfg), devices="world" if a.world else a.devices,
                           **({"timeout_s": 300} if a.world else {}), **opts)
    rank = step.rank if a.world else 0
    p, m, v = params, train.zeros_like(params), train.zeros_like(params)
    state_inputs = len(eins.tree_flatten((p, m, v))[0])
    losses, t0 = [], time.perf_counter()
    for t, (ids, targets) in enumerate(data, 1):
        loss, p, m, v = step(p, m, v, ids, targets, cos, sin, train.schedule(t))
        losses.append(float(loss))   # the only device-to-host copy of a step
        st = step.stats()
        state_h2d = sum(b for k, b in st["h2d_inputs"].items() if k < state_inputs)
        if t > 1 and state_h2d:
            raise SystemExit(f"step {t}: {state_h2d} bytes of state came from the host")
        if rank == 0 and (t <= 2 or t % 10 == 0 or t == a.steps):
            print(f"step {t:3d}  loss {losses[-1]:.6f}  h2d {st['h2d_bytes']:6d} B "
                  f"(state {state_h2d} B)  re-layout {st['relayout_bytes']} B  "
                  f"resident {st['resident_bytes']} B", flush=True)
    seconds = time.perf_counter() - t0

    ref = train.torch_losses(params, data, cos, sin, cfg)
    low = step.lower(params, train.zeros_like(params), train.zeros_like(params), *data[0], cos,
                     sin, train.schedule(1))
    n, depth = tolerance.accumulation(low.program)
    split = sum(bool(r["splits"]) for r in low.plan_table())
    if not split and len(low.devices) > 1:
        raise SystemExit("the plan splits no eqn: the step did not run distributed")
    err = float(np.max(np.abs(np.array(losses) - np.array(ref))))
    if rank == 0:
        where = "torchrun ranks" if a.world else f"{a.devices} {a.backend} devices"
        print(f"{a.steps} steps on {where} in {seconds:.1f} s (planning included): loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}; PyTorch {ref[0]:.4f} -> {ref[-1]:.4f}; "
              f"max |eins - torch| = {err:.2e} (tolerance "
              f"{tolerance.tolerance(np.float32, n, depth):.2e} relative); {split} of "
              f"{len(low.program.eqns)} eqns split over the devices")
    if not tolerance.close(losses, ref, n, depth, np.float32):
        raise SystemExit(f"the loss curve differs from PyTorch's: {err:.3e}")
    return losses, ref


if __name__ == "__main__":
    main()
