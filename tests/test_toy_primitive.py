"""docs/adding-a-primitive.md, followed: a toy primitive registered from one file under
tests/ (tests/toy_primitive.py, softsign) runs end to end with no edit anywhere else in
eins: through jit, distribute on the numpy backend, on the GPU runtime under Triton's
interpreter and on torchrun ranks, validate_specs, predicted_time, its GPU lowering, the
paper API and the tracer's attribute hints."""
import importlib
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import eins
from eins import validate_specs
from eins.cost.predict import B_HALF, W_HALF
from eins.errors import TraceAttributeError
from eins.ir.primitive import gpu_lowering
from helpers import accumulation, assert_close

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def toy():
    """The toy registered for this module's tests only (the rest of the suite never sees
    it): imported as a family file is, then taken back out."""
    mod = importlib.import_module("toy_primitive")
    yield mod
    mod.remove()
    sys.modules.pop("toy_primitive", None)


def _reference(x, w):
    y = x.astype(np.float64) @ w.astype(np.float64)
    return y / (1 + np.abs(y)) + 1


def _args():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((6, 8)).astype(np.float32),
            rng.standard_normal((8, 12)).astype(np.float32))


def _fn(toy):
    return lambda x, w: toy.softsign(x @ w) + 1


def test_jit_and_eager(toy):
    x, w = _args()
    prog = eins.make_ir(_fn(toy))(x, w)
    assert [e.prim for e in prog.eqns] == ["matmul", "softsign", "add"]
    assert_close(eins.jit(_fn(toy))(x, w), _reference(x, w), **_acc(toy, x, w))
    # bind runs it eagerly on numpy arrays too, through the reference kernel
    assert_close(toy.softsign(x), x / (1 + np.abs(x)))


def _acc(toy, x, w):
    n, depth = accumulation(eins.make_ir(_fn(toy))(x, w))
    return {"n": n, "depth": depth}


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_distribute_splits_the_toy(toy, backend):
    """Its eqn split in two along its rows (the elementwise indexing), on the virtual numpy
    devices and on the GPU runtime under Triton's interpreter (its Triton expression fused
    with the add after it)."""
    if backend == "interpret":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    x, w = _args()
    d = eins.distribute(_fn(toy), devices=2, backend=backend, plan={1: {"a": 2}})
    low = d.lower(x, w)
    assert len(low.physical.plan.eqn_plans[1].spec.fspecs) == 2
    assert_close(d(x, w), eins.jit(_fn(toy))(x, w), **_acc(toy, x, w))
    if backend == "interpret":
        kernels = "\n".join(map(str, low.generate("cuda").sources.values()))
        assert "softsign" in kernels


def test_validate_specs_checks_its_samples(toy):
    (report,) = validate_specs.check([toy.NAME]).values()
    assert not report.wrong and not report.untested and report.checked > 0


def test_predicted_time_charges_its_own_cost(toy):
    """The toy's kernel costs what the kernel model gives for its own rules by hand: 3
    FLOPs per element (computed in float32) and its operand and result bytes."""
    x = np.ones((512, 1024), np.float32)
    low = eins.distribute(toy.softsign, devices=2, plan={0: {"a": 2}}).lower(x)
    topo = low.physical.exchange.topology
    (row,) = low.predicted_time()["per_eqn"]
    n = x.size // 2   # the elements of one block
    compute = (3 * n * topo.flops / topo.flops_of(np.float32) + W_HALF) / topo.flops
    memory = (2 * 4 * n + B_HALF) / topo.hbm_bw
    assert row["op"] == "softsign"
    assert row["compute_ms"] == pytest.approx(max(compute, memory) * 1e3, rel=1e-12)


def test_gpu_lowering_runs_its_triton_kernel(toy):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    x = np.linspace(-4, 4, 40, dtype=np.float32).reshape(5, 8)
    out = torch.empty((5, 8), dtype=torch.float32)
    low = gpu_lowering(toy.NAME)
    assert low.template == "triton_fused.py.j2"
    low.fn(None, [out], [torch.from_numpy(x)])
    assert_close(out.numpy(), toy.impl(x)[0], n=4)


def test_front_ends_know_it(toy):
    x = np.ones((3, 4), np.float32)
    with pytest.raises(TraceAttributeError, match=r"use toy_primitive\.softsign\(x\)"):
        eins.jit(lambda a: a.softsign())(x)
    graph = eins.createGraph()
    t = graph.insertTensor(eins.tensorDesc([3, 4], "float32"))
    graph.save(graph.unary(t, "softsign"))
    c = eins.compileGraph(graph, device=[0, 1])
    c.load(t, x)
    c.execute()
    assert_close(c.offload(graph.saved[0]), x / (1 + np.abs(x)))


RANK_SCRIPT = """
import json, os, sys
import numpy as np
import eins
import toy_primitive as toy

out = {}
rng = np.random.default_rng(0)
x = rng.standard_normal((6, 8)).astype(np.float32)
w = rng.standard_normal((8, 12)).astype(np.float32)
fn = lambda x, w: toy.softsign(x @ w) + 1
for backend in ("numpy", "interpret"):
    f = eins.distribute(fn, devices="world", backend=backend, timeout_s=30,
                        plan={1: {"a": 2}})
    got = np.asarray(f(x, w))
    out[backend] = {"got": got.tolist(), "kernel_set": f.kernels.name}
with open(sys.argv[1] + f"/rank{os.environ['RANK']}.json", "w") as fh:
    json.dump(out, fh)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_ranks_run_it(toy, tmp_path):
    """One torchrun launch, 2 ranks over gloo: the numpy kernel set and the GPU runtime's
    (interpret) both run the split toy eqn; each rank's result equals eins.jit."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    script = tmp_path / "toy_ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(script),
           str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    x, w = _args()
    want = eins.jit(_fn(toy))(x, w)
    for r in (0, 1):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        for backend, kernel_set in (("numpy", "cpu"), ("interpret", "interpret")):
            assert res[backend]["kernel_set"] == kernel_set
            assert_close(np.asarray(res[backend]["got"], np.float32), want,
                         **_acc(toy, x, w))
