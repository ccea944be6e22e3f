"""Each primitive's registered GPU lowering (beside its reference kernel in its op family
file) runs its eqn's blocks, here on CPU tensors under Triton's interpreter, and equals the
primitive's numpy reference kernel."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels import build  # noqa: E402
from eins.ir.joinagg import FunctionSpec  # noqa: E402
from eins.ir.types import Box  # noqa: E402
from eins.ops import get_primitive  # noqa: E402
from eins.errors import EinsError  # noqa: E402
from eins.ir.primitive import gpu_lowering, register_gpu_lowering  # noqa: E402


def run(fn, *arrays):
    """Trace fn, run its single non-trivial eqn through the GPU lowering and the reference."""
    prog = eins.make_ir(fn)(*arrays)
    (eqn,) = prog.eqns
    env = {id(v): a for v, a in zip(prog.inputs, arrays)}
    ins = [torch.from_numpy(np.ascontiguousarray(env[id(a)])) if id(a) in env else
           ("lit", a.value, a.dtype) for a in eqn.inputs]
    outs = [torch.empty(v.shape, dtype=build.torch_dtype(v.dtype)) for v in eqn.outputs]
    low = gpu_lowering(eqn.prim)
    low.fn(None, outs, ins, **eqn.params)
    ref = get_primitive(eqn.prim).impl(*[env.get(id(a), getattr(a, "value", None))
                                         for a in eqn.inputs], **eqn.params)[0]
    return outs[0].numpy(), ref, low


def test_lowerings_live_beside_their_primitives():
    for prim, template in [("attention", "triton_attention.py.j2"),
                           ("rms_norm", "triton_rms_norm.py.j2"),
                           ("rope", "triton_rope.py.j2"), ("matmul", "triton_matmul.py.j2"),
                           ("silu", "triton_fused.py.j2"), ("where", "triton_fused.py.j2")]:
        low = gpu_lowering(prim)
        assert low.template == template
    # the attention family's GPU side is its own third file
    assert gpu_lowering("attention").fn.__module__ == "eins.ops.attention_gpu"
    assert gpu_lowering("einsum").template is None  # a library call, no template
    assert gpu_lowering("reshape").fn is None   # a torch view (its fallback), no kernel
    assert gpu_lowering("reshape").fallback.__module__ == "eins.ops.shape"
    with pytest.raises(EinsError, match="registered twice"):
        register_gpu_lowering("rope", lambda *a, **k: None)


def test_lowered_eqns_equal_reference_kernels():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    cases = [
        (lambda x, w: eins.rms_norm(x, w, eps=1e-5), (x, w), 1e-6),
        (lambda x, c, s: eins.rope(x, c, s), (x, x, x[::-1].copy()), 1e-6),
        (lambda a, b: a @ b, (x, rng.standard_normal((16, 3)).astype(np.float32)), 1e-5),
        (lambda a, b: a * b, (x, w), 0.0),                     # broadcast operand
        (lambda a: a + 0.5, (x,), 0.0),                        # literal operand
        (lambda a, b: eins.einsum("ij,j->i", a, b), (x, w), 1e-5),
    ]
    for fn, args, atol in cases:
        got, ref, _ = run(fn, *args)
        np.testing.assert_allclose(got, ref, atol=atol, rtol=1e-6)


def test_bare_python_scalars_take_their_nep50_dtype():
    # float16 tensor + 0.1: the scalar is float16 (rounded to 0.0999755859375), as traced
    x = torch.linspace(-1, 1, 12, dtype=torch.float16).reshape(3, 4)
    out = torch.empty(3, 4, dtype=torch.float16)
    gpu_lowering("add").fn(None, [out], [x, 0.1])
    ref = get_primitive("add").impl(x.numpy(), np.float16(0.1))[0]
    np.testing.assert_array_equal(out.numpy(), ref)
    cmp = torch.empty(3, 4, dtype=torch.bool)
    gpu_lowering("greater").fn(None, [cmp], [x, 0])
    np.testing.assert_array_equal(cmp.numpy(), x.numpy() > 0)


def test_attention_lowering_uses_the_blocks_global_positions():
    """A query block [16, 40) of a segmented causal attention, given its function spec,
    equals those rows of the whole."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 40, 16)).astype(np.float32)
    k = rng.standard_normal((1, 40, 16)).astype(np.float32)
    prog = eins.make_ir(lambda q, k, v: eins.attention(q, k, v, segments=(16, 40)))(q, k, k)
    (eqn,) = prog.eqns
    whole = get_primitive("attention").impl(q, k, k, **eqn.params)[0]
    fspec = FunctionSpec((Box((0, 16, 0), (2, 40, 16)), Box((0, 16, 0), (1, 40, 16)),
                          Box((0, 16, 0), (1, 40, 16))), (Box((0, 16, 0), (2, 40, 16)),))
    out = torch.empty(2, 24, 16)
    kb = torch.from_numpy(k[:, 16:].copy())
    gpu_lowering("attention").fn(fspec, [out], [torch.from_numpy(q[:, 16:].copy()), kb, kb],
                                 **eqn.params)
    np.testing.assert_allclose(out.numpy(), whole[:, 16:], atol=1e-5, rtol=0)


def test_attention_partial_lowering_key_split_combines_to_the_whole():
    """Key-split blocks through the registered partial lowering (float32 o, lse), combined
    by combine_lse into a float16 output, equal the whole reference."""
    from eins.kernels import combine_lse
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 30, 16)).astype(np.float16)
    k = rng.standard_normal((1, 30, 16)).astype(np.float16)
    v = rng.standard_normal((1, 30, 16)).astype(np.float16)
    params = dict(causal=True, segments=(11, 30), scale=None)
    whole = get_primitive("attention").impl(q, k, v, **params)[0].astype(np.float32)
    low = gpu_lowering("attention")
    parts = []
    for lo, hi in ((0, 17), (17, 30)):
        fspec = FunctionSpec((Box((0, 0, 0), (2, 30, 16)), Box((0, lo, 0), (1, hi, 16)),
                              Box((0, lo, 0), (1, hi, 16))), (Box((0, 0, 0), (2, 30, 16)),))
        o, lse = torch.empty(2, 30, 16), torch.empty(2, 30)
        kb, vb = (torch.from_numpy(t[:, lo:hi].copy()) for t in (k, v))
        low.partial(fspec, [o, lse], [torch.from_numpy(q), kb, vb], **params)
        parts += [o, lse]
    out = torch.empty(2, 30, 16, dtype=torch.float16)
    combine_lse(*parts, out, torch.empty(2, 30))
    np.testing.assert_allclose(out.float().numpy(), whole, atol=4 * 2 ** -10, rtol=0)


def test_a_platform_override_replaces_the_lowering_there_only(monkeypatch):
    """register_lowering(prim, lowering, platform="interpret") overrides the lowering for
    every platform on that platform alone: the GPU runtime on "interpret" runs it (here a
    fallback that counts its calls), "cuda" still gets the shared one; a second override
    for the same platform is refused by name."""
    import dataclasses
    from eins.ir.primitive import register_lowering
    prim = get_primitive("transpose")
    monkeypatch.setattr(prim, "lowerings", dict(prim.lowerings))   # undone after the test
    shared = prim.lowering()
    calls = []

    def counting(fspec, x, *, axes):
        calls.append(tuple(axes))
        return shared.fallback(fspec, x, axes=axes)
    register_lowering(prim, dataclasses.replace(shared, fallback=counting), "interpret")
    assert prim.lowering("interpret").fallback is counting
    assert prim.lowering("cuda") is shared and prim.lowering() is shared
    with pytest.raises(EinsError, match="registered twice for platform 'interpret'"):
        register_lowering(prim, shared, "interpret")
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    f = eins.distribute(lambda a: eins.transpose(a, (2, 0, 1)) * 2, devices=1,
                        backend="interpret")
    np.testing.assert_array_equal(f(x), np.transpose(x, (2, 0, 1)) * 2)
    assert calls and set(calls) == {(2, 0, 1)}   # its warm-up run and the call
