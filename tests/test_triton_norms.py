"""rms_norm and rope Triton kernels under the interpreter against eins's numpy reference
kernels (eins/ops/norms.py, eins/ops/rope.py)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from eins.kernels.norms import rms_norm, rope  # noqa: E402
from eins.errors import DTypeError, ShapeError  # noqa: E402
from eins.ir.primitive import get_primitive  # noqa: E402
from helpers import torch_eps  # noqa: E402

# the numpy reference kernels, from the primitive registry
rms_impl = get_primitive("rms_norm").impl
rope_impl = get_primitive("rope").impl


def rand(shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ref(fn, *ts, out_dtype, **kw):
    r = fn(*(t.float().numpy() for t in ts), **kw)[0]
    return torch.from_numpy(r).to(out_dtype).float().numpy()


@pytest.mark.parametrize("dtype,wdtype", [(torch.float16, torch.float16),
                                          (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.float32),
                                          (torch.float16, torch.float32)])
def test_rms_norm(dtype, wdtype):
    x, w = rand((3, 7, 40), dtype, 0), rand((40,), wdtype, 1)
    od = torch.promote_types(dtype, wdtype)
    out = torch.empty(x.shape, dtype=od)
    rms_norm(x, w, out, eps=1e-5)
    r = ref(rms_impl, x, w, out_dtype=od, eps=1e-5)
    # one rounding of the result, fp32 statistics over 40 elements
    np.testing.assert_allclose(out.float().numpy(), r,
                               atol=2 * torch_eps(od) * float(np.abs(r).max()) + 1e-6, rtol=0)


def test_rms_norm_eps_matters_and_errors():
    x, w = torch.full((2, 8), 1e-3), torch.ones(8)
    a, b = torch.empty(2, 8), torch.empty(2, 8)
    rms_norm(x, w, a, eps=1e-6)
    rms_norm(x, w, b, eps=1e-2)
    np.testing.assert_allclose(a.numpy(), ref(rms_impl, x, w, out_dtype=torch.float32,
                                              eps=1e-6), rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), ref(rms_impl, x, w, out_dtype=torch.float32,
                                              eps=1e-2), rtol=1e-6)
    with pytest.raises(ShapeError, match=r"\(8,\)"):
        rms_norm(x, torch.ones(7), a)
    with pytest.raises(DTypeError, match="out must be torch.float32"):
        rms_norm(x, w, torch.empty(2, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rope_with_broadcast_tables(dtype):
    x = rand((2, 3, 11, 16), dtype, 2)          # [B, H, S, D]
    cos, sin = rand((11, 16), dtype, 3), rand((11, 16), dtype, 4)   # [S, D]
    out = torch.empty_like(x)
    rope(x, cos, sin, out)
    r = ref(rope_impl, x, cos, sin, out_dtype=dtype)
    np.testing.assert_allclose(out.float().numpy(), r,
                               atol=2 * torch_eps(dtype) * float(np.abs(r).max()) + 1e-6, rtol=0)


def test_rope_fuses_the_layout_change():
    """x in projection layout [B, S, H, D] read through a transposed view, written
    contiguous [B, H, S, D]: equal to the reference on the transposed x."""
    xp = rand((2, 9, 4, 8), torch.float32, 5)
    x = xp.transpose(1, 2)                       # [B, H, S, D] view, not contiguous
    cos, sin = rand((9, 1, 8), torch.float32, 6)[:, 0], rand((9, 8), torch.float32, 7)
    out = torch.empty(2, 4, 9, 8)
    rope(x, cos, sin, out, block_rows=8)
    r = ref(rope_impl, x.contiguous(), cos, sin, out_dtype=torch.float32)
    np.testing.assert_allclose(out.numpy(), r, atol=1e-6, rtol=0)


def test_rope_errors():
    x = torch.zeros(2, 5, 6)
    with pytest.raises(ShapeError, match="even"):
        rope(torch.zeros(2, 5), torch.zeros(5), torch.zeros(5), torch.zeros(2, 5))
    with pytest.raises(ShapeError, match=r"cos of shape \(4, 6\)"):
        rope(x, torch.zeros(4, 6), torch.zeros(5, 6), torch.empty_like(x))
