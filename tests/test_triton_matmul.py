"""The Triton matmul template under Triton's interpreter and the torch (cuBLAS) path, both
against eins's numpy reference kernel (eins/ops/linalg.py): odd shapes, batch dims with
numpy broadcasting, float32 accumulation with the result in the output's dtype."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from eins.kernels.matmul import matmul, matmul_source  # noqa: E402
from eins.errors import DTypeError, ShapeError  # noqa: E402
from eins.ir.primitive import get_primitive  # noqa: E402
from helpers import torch_eps  # noqa: E402

matmul_impl = get_primitive("matmul").impl  # the numpy reference kernel


def tol(dtype, k, ref):
    """One rounding of the result plus float32 accumulation error over K products."""
    return (torch_eps(dtype) + 2 * k * torch_eps(torch.float32)) * float(np.abs(ref).max())


def rand(shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(a, b, out_dtype):
    # the reference on the same (low-precision) values: numpy fp32 accumulation, then round
    r = matmul_impl(a.float().numpy(), b.float().numpy())[0]
    return torch.from_numpy(r).to(out_dtype).float().numpy()


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sa,sb", [((37, 45), (45, 19)),            # odd, one tile edge
                                   ((3, 33, 17), (17, 40)),          # batch against 2-D
                                   ((2, 1, 5, 70), (3, 70, 9))])     # broadcast both ways
def test_matches_reference(impl, dtype, sa, sb):
    a, b = rand(sa, dtype, 0), rand(sb, dtype, 1)
    shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (sa[-2], sb[-1])
    out = torch.full(shape, float("nan"), dtype=dtype)
    assert matmul(a, b, out, impl=impl) is out
    r = reference(a, b, dtype)
    np.testing.assert_allclose(out.float().numpy(), r, atol=tol(dtype, sa[-1], r), rtol=0)


def test_mixed_dtypes_accumulate_in_float32():
    # float16 @ float32 -> float32 (numpy promotion): the Triton path, casting in registers
    a, b = rand((20, 33), torch.float16, 2), rand((33, 12), torch.float32, 3)
    out = torch.empty(20, 12)
    matmul(a, b, out)
    r = reference(a, b, torch.float32)
    np.testing.assert_allclose(out.numpy(), r, atol=tol(torch.float32, 33, r), rtol=0)


def test_unmergeable_batch_dims_and_transposed_operand():
    # a [2,1,3]-batched view that cannot flatten to two strided batch dims, b transposed
    a = rand((2, 4, 3, 9, 11), torch.float32, 4)[:, ::2]
    b = rand((3, 13, 11), torch.float32, 5).transpose(-1, -2)
    out = torch.empty(2, 2, 3, 9, 13)
    matmul(a, b, out, impl="triton", config=(16, 16, 16, 2, 1, 1))
    r = reference(a, b, torch.float32)
    np.testing.assert_allclose(out.numpy(), r, atol=tol(torch.float32, 11, r), rtol=0)


def test_source_keeps_16_bit_dots_native():
    src = matmul_source(torch.float16, torch.float16, torch.float16)
    assert "tl.dot(a, b, acc)" in src  # no register casts of the fp16 operands


def test_bad_inputs():
    a, b = torch.zeros(3, 4), torch.zeros(5, 6)
    with pytest.raises(ShapeError, match="K=4"):
        matmul(a, b, torch.zeros(3, 6))
    with pytest.raises(ShapeError, match=r"expected \(3, 6\)"):
        matmul(a, torch.zeros(4, 6), torch.zeros(3, 7))
    with pytest.raises(DTypeError, match="int32"):
        matmul(a, torch.zeros(4, 6), torch.zeros(3, 6, dtype=torch.int32))
    with pytest.raises(ShapeError, match="impl"):
        matmul(a, torch.zeros(4, 6), torch.zeros(3, 6), impl="cutlass")


def test_tile_aligned_and_ragged_shapes_with_small_tiles():
    # 32x48x64 divides 16-wide tiles (the unmasked, unwrapped path); 31x47x63 wraps everywhere
    for m, k, n in ((32, 64, 48), (31, 63, 47)):
        a, b = rand((2, m, k), torch.float16, 6), rand((k, n), torch.float16, 7)
        out = torch.empty(2, m, n, dtype=torch.float16)
        matmul(a, b, out, impl="triton", config=(16, 16, 16, 2, 1, 1))
        r = reference(a, b, torch.float16)
        np.testing.assert_allclose(out.float().numpy(), r, atol=tol(torch.float16, k, r), rtol=0)


@pytest.mark.parametrize("sa,sb", [((2, 0, 4), (2, 4, 3)),    # baddbmm, no rows
                                   ((2, 3, 0), (2, 0, 5)),    # baddbmm, K = 0
                                   ((2, 3, 0), (0, 5)),       # the rows of every batch, K = 0
                                   ((0, 3, 4), (4, 5)),       # no batches
                                   ((3, 0), (0, 4))])         # addmm, K = 0
def test_add_with_an_empty_dim_is_the_residual_plus_the_empty_product(sa, sb):
    # the one-call paths flatten the batch dims; an inferred (-1) size is ambiguous for a
    # zero-size block, so they must name the sizes (an empty product is zeros: out == c)
    a, b = rand(sa, torch.float32, 0), rand(sb, torch.float32, 1)
    shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (sa[-2], sb[-1])
    c = rand(shape, torch.float32, 2)
    out = torch.full(shape, 7.0)
    assert matmul(a, b, out, add=c) is out
    torch.testing.assert_close(out, c, rtol=0, atol=0)


def test_bfloat16_template_outputs_round_as_the_gpu_under_the_interpreter():
    """Every template's final store casts through _to_dtype (eins/kernels/build.py),
    which the interpreter's prelude makes round to nearest even: the Triton rms_norm under
    backend "interpret" equals numpy's (ml_dtypes) bits (truncating, as the interpreter's
    own cast does, half its outputs were one unit low); the matmul (torch's there) too."""
    import eins
    from eins.ir.types import bfloat16
    rng = np.random.default_rng(0)
    a = rng.standard_normal((32, 48)).astype(bfloat16)
    b = rng.standard_normal((48, 40)).astype(bfloat16)
    w = (1 + 0.1 * rng.standard_normal(48)).astype(bfloat16)
    for fn, args in [(lambda a, b: a @ b, (a, b)),
                     (lambda a, w: eins.rms_norm(a, w, eps=1e-5), (a, w))]:
        want = eins.jit(fn)(*args).astype(np.float32)
        got = eins.distribute(fn, devices=1, backend="interpret")(*args).astype(np.float32)
        np.testing.assert_array_equal(got, want)
