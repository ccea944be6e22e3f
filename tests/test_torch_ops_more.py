"""The ATen ops of eins/frontends/aten_more.py (mse_loss, gather, index_select, one_hot,
flip, roll, logsumexp) and sign: each against torch eager, the differentiable ones'
parameter gradients under eins.grad against torch.autograd, and an index out of range
(torch's: negatives included) as an eins.IndexRangeError naming it."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eins
from eins.errors import IndexRangeError, ShapeError
from eins.ops.gather import embedding_rows, gather_along
from helpers import assert_close


class Fn(nn.Module):
    """``fn(self.w, *inputs)`` with one parameter ``w`` [3, 4]."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, *xs):
        return self.fn(self.w, *xs)


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


ROWS = torch.tensor([[0, 3], [2, 2], [1, 0]])   # gather indices along dim 1 of w [3, 4]
COLS = torch.tensor([3, 0, 0, 2])

CASES = {
    "mse_loss mean": lambda w, y: F.mse_loss(w, y),
    "mse_loss sum": lambda w, y: F.mse_loss(w, y, reduction="sum"),
    "mse_loss none, broadcast": lambda w, y: F.mse_loss(w, y[0], reduction="none"),
    "gather dim 1": lambda w, y: torch.gather(w, 1, ROWS),
    "gather dim 0, smaller index": lambda w, y: torch.gather(w, 0, ROWS[:2, :] % 3),
    "gather dim -1, computed index": lambda w, y: torch.gather(w, -1, y.argsort(-1)),
    "index_select dim 1": lambda w, y: torch.index_select(w, 1, COLS),
    "index_select dim 0, computed": lambda w, y: torch.index_select(w, 0, y[0, :3].argsort()),
    "flip": lambda w, y: torch.flip(w, [0, 1]) * y,
    "flip -1": lambda w, y: w.flip(-1),
    "roll one dim": lambda w, y: torch.roll(w, 2, 1),
    "roll two dims": lambda w, y: torch.roll(w, (1, -5), (0, 1)),
    "roll flattened": lambda w, y: torch.roll(w, 5),
    "logsumexp": lambda w, y: torch.logsumexp(w * 30, 1),
    "logsumexp keepdim, all dims": lambda w, y: torch.logsumexp(w, (0, 1), keepdim=True),
    "sign": lambda w, y: torch.sign(w - y) * w,
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("p", [None, 2])
def test_each_op_equals_torch_eager(name, p):
    m, y = Fn(CASES[name]).eval(), _x(3, 4)
    with torch.no_grad():
        want = m(y)
    got = (eins.jit(m) if p is None else eins.distribute(m, devices=p))(y)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got.numpy(), want.numpy(), n=12)


@pytest.mark.parametrize("name", CASES)
def test_gradients_equal_torch_autograd(name):
    m, y = Fn(CASES[name]), _x(3, 4)
    # a loss that tells the elements apart
    weights = torch.randn(m(y).shape, generator=torch.Generator().manual_seed(2))
    (m(y) * weights).sum().backward()
    fn, params = eins.from_torch(m, y)
    grads = eins.grad(lambda p, y: eins.sum(fn(p, y) * weights.numpy()))(params, y.numpy())
    assert_close(grads["w"], m.w.grad.numpy(), n=12, depth=2)
    assert np.abs(grads["w"]).max() > 0


def test_the_ops_values_by_hand():
    w = torch.arange(12.0).reshape(3, 4)
    m = Fn(lambda w, y: (torch.gather(w, 1, ROWS), torch.index_select(w, 1, COLS),
                         torch.flip(w, [1])[0], torch.roll(w, 1, 1)[0],
                         F.mse_loss(w, torch.zeros(3, 4)),
                         torch.logsumexp(torch.tensor([0.0, float("-inf")]) + w[0, 0], 0)))
    with torch.no_grad():
        m.w.copy_(w)
    g, s, f, r, mse, lse = eins.jit(m)(_x(3, 4))
    np.testing.assert_array_equal(g.numpy(), [[0, 3], [6, 6], [9, 8]])
    np.testing.assert_array_equal(s.numpy(), [[3, 0, 0, 2], [7, 4, 4, 6], [11, 8, 8, 10]])
    np.testing.assert_array_equal(f.numpy(), [3, 2, 1, 0])
    np.testing.assert_array_equal(r.numpy(), [3, 0, 1, 2])
    assert mse.item() == pytest.approx(sum(v * v for v in range(12)) / 12, rel=1e-6)
    assert lse.item() == 0.0


def test_logsumexp_of_infinities_is_torchs():
    m = Fn(lambda w, y: torch.logsumexp(y, 1))
    y = torch.tensor([[float("-inf")] * 4, [0.0, float("inf"), 1.0, 2.0], [0.0] * 4])
    got = eins.jit(m)(y)
    np.testing.assert_array_equal(got.numpy(), torch.logsumexp(y, 1).numpy())
    assert got[0].item() == float("-inf") and got[1].item() == float("inf")


def test_one_hot_equals_torch():
    m = Fn(lambda w, c: (F.one_hot(c, 5), F.one_hot(c, 5) * w.sum()))
    c = torch.tensor([[3, 0], [4, 4]])
    with torch.no_grad():
        want = m(c)
    for p in (None, 2):
        got = (eins.jit(m) if p is None else eins.distribute(m, devices=p))(c)
        assert got[0].dtype == torch.int64
        np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
        assert_close(got[1].numpy(), want[1].numpy(), n=12)


def test_one_hot_without_num_classes_is_refused():
    # its width would come from the data: torch.export refuses it, in eins's words
    with pytest.raises(eins.ExportError, match="depends on tensor values"):
        eins.from_torch(Fn(lambda w, c: F.one_hot(c)), torch.tensor([1, 2]))


OUT_OF_RANGE = {   # (op on w [3, 4] at an index tensor i, the axis, its size)
    "gather": (lambda w, i: torch.gather(w, 1, i.reshape(1, -1)), 1, 4),
    "index_select": (lambda w, i: torch.index_select(w, 1, i), 1, 4),
    "one_hot": (lambda w, i: F.one_hot(i, 4), 0, 4),
}


@pytest.mark.parametrize("op", OUT_OF_RANGE)
@pytest.mark.parametrize("bad", [-1, 4])
@pytest.mark.parametrize("p", [None, 2])
def test_an_index_out_of_range_is_an_index_error_naming_it(op, bad, p):
    # torch takes indices in [0, n): a negative one is an error there too, not an element
    # counted from the end
    fn, axis, n = OUT_OF_RANGE[op]
    m = Fn(fn).eval()
    with pytest.raises(RuntimeError):
        m(torch.tensor([1, bad]))
    f = eins.jit(m) if p is None else eins.distribute(m, devices=p)
    good = torch.tensor([1, 3])
    np.testing.assert_array_equal(f(good).numpy(), m(good).detach().numpy())
    # named by eins's primitive (gather, take_along_axis) and the model's line
    with pytest.raises(IndexRangeError, match=rf"index {bad} is out of bounds for axis "
                                              rf"{axis} with size {n} .*no negatives"):
        f(torch.tensor([1, bad]))


def test_a_constant_index_out_of_range_is_refused_at_conversion():
    m = Fn(lambda w, y: torch.gather(w, 1, torch.tensor([[0], [-1], [2]])) + y)
    with pytest.raises(IndexRangeError, match=r"gather: index -1 is out of bounds for axis 1"):
        eins.from_torch(m, _x(3, 1))


def test_gather_along_and_index_select_rows_refuse_negatives_at_the_eins_level():
    x = np.arange(12.0).reshape(3, 4)
    ids = np.array([[3], [0], [1]])
    np.testing.assert_array_equal(eins.jit(lambda x: gather_along(x, ids, 1))(x),
                                  [[3.0], [4.0], [9.0]])
    np.testing.assert_array_equal(
        eins.jit(lambda x, i: embedding_rows(x, i, axis=1, op="index_select"))(
            x, np.array([2, 0])), x[:, [2, 0]])
    with pytest.raises(IndexRangeError, match=r"gather: index -2 is out of bounds for axis "
                                              r"1 with size 4 \(indices lie in \[0, 4\)"):
        eins.jit(lambda x: gather_along(x, np.array([[3], [-2], [1]]), 1))(x)
    with pytest.raises(IndexRangeError, match=r"index -1 is out of bounds for axis 1 with "
                                              r"size 4 \(indices lie in \[0, 4\)"):
        eins.jit(lambda x, i: gather_along(x, i, 1))(x, ids - 1)
    with pytest.raises(IndexRangeError, match=r"index_select: index 4 is out of bounds"):
        eins.jit(lambda x: embedding_rows(x, [0, 4], axis=1, op="index_select"))(x)
    with pytest.raises(ShapeError, match=r"gather: indices of shape \(3,\) and array of "
                                         r"shape \(3, 4\) must have the same number"):
        eins.jit(lambda x: gather_along(x, np.array([0, 1, 2]), 1))(x)
