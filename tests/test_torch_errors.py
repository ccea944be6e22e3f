"""What eins.from_torch refuses, and how it says so: an op with no mapping names the op, the
submodule, the source line and the supported ops; control flow torch.export refuses is
reported with the exporter's message attached; each other refusal names its value."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eins
from eins.errors import ExportError, IndexRangeError, UnsupportedOpError


class Act(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, -1)   # no eins mapping (a scan)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = Act()

    def forward(self, x):
        return self.act(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_an_unmapped_op_names_itself_its_module_its_line_and_the_supported_ops():
    with pytest.raises(UnsupportedOpError) as e:
        eins.from_torch(Net(), torch.ones(2, 4))
    msg = str(e.value)
    assert "aten.cumprod" in msg
    assert "in blocks.0.act (Act)" in msg
    assert re.search(r"test_torch_errors\.py:\d+: return torch\.cumprod\(x, -1\)", msg)
    assert "supported ops: aten.__and__, " in msg and "aten.linear" in msg


def test_an_unmapped_op_through_distribute_is_the_same_error():
    with pytest.raises(UnsupportedOpError, match=r"aten.cumprod.default \(in blocks.0.act"):
        eins.distribute(Net(), devices=2)(torch.ones(2, 4))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:   # a Python branch on a tensor's value
            return x * 2
        return x


def test_data_dependent_control_flow_is_reported_with_the_exporters_message():
    with pytest.raises(ExportError) as e:
        eins.from_torch(DataDependent(), torch.ones(3))
    msg = str(e.value)
    assert "DataDependent" in msg and "control flow depends on tensor values" in msg
    assert "torch.where" in msg and "torch.export said" in msg
    assert e.value.__cause__ is not None and str(e.value.__cause__).split("\n")[0] in msg


def test_the_argument_must_be_a_module():
    with pytest.raises(eins.TraceError, match="expects a torch.nn.Module, got function"):
        eins.from_torch(lambda x: x, torch.ones(2))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(4, 4)

    def forward(self, *xs):
        return self.fn(self, *xs)


@pytest.mark.parametrize("fn,args,match", [
    (lambda m, x: F.dropout(x, 0.1, training=True), (torch.ones(2, 4),),
     r"aten.dropout.default in training mode \(p=0.1\): call module.eval\(\)"),
    (lambda m, x: x[:, ::2], (torch.ones(2, 4),), r"aten.slice.Tensor with step 2"),
    (lambda m, x: torch.div(x, m.lin(x), rounding_mode="trunc"), (torch.ones(2, 4),),
     r"aten.div.Tensor_mode with rounding_mode='trunc'"),
    (lambda m, x: torch.linalg.vector_norm(m.lin(x), ord=1), (torch.ones(2, 4),),
     r"aten.linalg_vector_norm.default with ord=1 \(the 2-norm is supported\)"),
    (lambda m, x, ids: m.lin(x)[ids > 0], (torch.ones(2, 4), torch.ones(2, dtype=torch.long)),
     r"aten.index.Tensor: its result's shape \(u\d+, 4\) depends on the data"),
    (lambda m, x: x + torch.randn(4), (torch.ones(2, 4),),
     r"aten.randn.default: it draws random numbers"),
    (lambda m, x: torch.histc(m.lin(x), bins=4), (torch.ones(2, 4),),
     r"aten.histc.default with min == max == 0 \(the range then comes from the data: give "
     r"min and max\)"),
    (lambda m, x: m.lin(x).index_put_((m.lin(x) > 0,), torch.tensor(0.0)),
     (torch.ones(2, 4),),
     r"aten.index_put_?.default with a boolean mask index \(write torch.where\(mask, values, "
     r"x\) instead\)"),
    (lambda m, x: m.lin(x).int() & 3, (torch.ones(2, 4),),
     r"aten.__and__.Scalar on int32 operands \(bool operands only\)"),
])
def test_a_mapped_op_it_cannot_take_names_why_and_where(fn, args, match):
    with pytest.raises(UnsupportedOpError, match=match) as e:
        eins.from_torch(Lambda(fn).eval(), *args)
    assert "test_torch_errors.py" in str(e.value)


def _qkv(s=6):
    return [torch.randn(1, 2, s, 8) for _ in range(3)]


class Sdpa(nn.Module):
    def __init__(self, mask=None, **flags):
        super().__init__()
        self.mask, self.flags = mask, flags

    def forward(self, q, k, v, mask=None):
        mask = self.mask if mask is None else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.flags)


def _attention_params(module, *args):
    """The params of the one attention eqn ``module`` converts to, and the eqn's operands."""
    fn, params = eins.from_torch(module, *args)
    prog = eins.make_ir(fn)(params, *(a.numpy() for a in args))
    (att,) = [e for e in prog.eqns if e.prim == "attention"]
    return fn, params, att


def _equals_torch(module, *args):
    fn, params, att = _attention_params(module, *args)
    with torch.no_grad():
        want = module(*args).numpy()
    got = eins.jit(fn)(params, *(a.numpy() for a in args))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return att


def test_attention_with_a_window_mask_is_a_window():
    window = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6,
                                                                     dtype=torch.bool).tril(-3)
    att = _equals_torch(Sdpa(window), *_qkv())
    assert att.params["window"] == 3 and att.params["causal"] and len(att.inputs) == 3


def test_attention_with_another_constant_mask_or_bias_takes_it_as_an_operand():
    torch.manual_seed(0)
    mask = torch.rand(6, 6) > 0.3
    mask[:, 0] = True
    att = _equals_torch(Sdpa(mask), *_qkv())
    assert att.params["mask"] == "full"
    att = _equals_torch(Sdpa(torch.randn(2, 6, 6)), *_qkv())
    assert att.params["bias"] == "add"


def test_attention_with_a_mask_from_the_inputs_is_a_mask_operand():
    torch.manual_seed(1)
    keep = torch.ones(6, 6, dtype=torch.bool)
    keep[:, 4:] = False
    att = _equals_torch(Sdpa(), *_qkv(), keep)
    assert att.params["mask"] == "full" and not att.params["causal"]
    add = torch.zeros(6, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    att = _equals_torch(Sdpa(), *_qkv(), add)
    assert att.params["bias"] == "add"


def test_attention_with_unequal_lengths_follows_torch_and_dropout_is_refused():
    with pytest.raises(UnsupportedOpError, match="dropout_p=0.5"):
        eins.from_torch(Sdpa(dropout_p=0.5), *_qkv())
    torch.manual_seed(2)
    q, k, v = _qkv()
    _equals_torch(Sdpa(), q[:, :, :3], k, v)              # cross-attention: 3 queries, 6 keys
    # torch's is_causal aligns at the first key (query i sees keys j <= i): a constant mask
    att = _equals_torch(Sdpa(is_causal=True), q[:, :, :3], k, v)
    assert att.params["mask"] == "full" and not att.params["causal"]


def test_a_module_that_changes_its_buffers_is_refused():
    bn = nn.BatchNorm1d(4)   # training mode: running statistics updated in place
    with pytest.raises(UnsupportedOpError, match=r"BatchNorm1d: it changes "
                                                 r"num_batches_tracked in place with "
                                                 r"aten.add_.Tensor"):
        eins.from_torch(bn, torch.ones(3, 4))


class Scaled(nn.Module):
    def forward(self, x, scale=2.0):
        return x * scale


def test_the_function_keeps_the_python_values_and_structure_it_was_converted_for():
    fn, params = eins.from_torch(Scaled(), torch.ones(2), scale=3.0)
    x = np.ones(2, np.float32)
    # a Python value baked into the conversion is a static argument of eins.jit, as in JAX
    f = eins.jit(fn, static_argnames="scale")
    np.testing.assert_array_equal(f(params, x, scale=3.0), [3.0, 3.0])
    with pytest.raises(eins.TraceError, match=r"Python value 3.0 as its input 1, called "
                                              r"with 4.0: convert it again"):
        f(params, x, scale=4.0)
    with pytest.raises(eins.TraceError, match=r"keyword arguments \['scale'\], called "
                                              r"with \[\]"):
        f(params, x)
    # traced (not marked static), the scalar cannot be compared with the baked value
    with pytest.raises(eins.TraceError, match=r"keyword argument 'scale' is a Python scalar "
                                              r"traced as a runtime value .* mark it static: "
                                              r"static_argnames=\('scale',\)"):
        eins.jit(fn)(params, x, scale=3.0)


def test_params_must_hold_every_parameter():
    fn, params = eins.from_torch(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(eins.TraceError, match="params has no 'bias'"):
        eins.jit(fn)({"weight": params["weight"]}, np.ones((1, 2), np.float32))


@pytest.mark.parametrize("bad", [-1, 10])
@pytest.mark.parametrize("p", [None, 2])
def test_an_embedding_id_out_of_range_is_an_index_error_naming_it(bad, p):
    # torch's embedding takes ids in [0, num_embeddings): a negative one is no row from
    # the end (as torch's x[ids] would take) but an IndexError, in eins as in torch
    emb = nn.Embedding(10, 4).eval()
    ids = torch.tensor([[1, bad]])
    with pytest.raises(IndexError):
        emb(ids)
    f = eins.jit(emb) if p is None else eins.distribute(emb, devices=p)
    with pytest.raises(IndexRangeError, match=rf"index {bad} is out of bounds for axis 0 "
                                              rf"with size 10"):
        f(ids)
    good = torch.tensor([[1, 9]])
    np.testing.assert_array_equal(f(good).numpy(), emb(good).detach().numpy())


def test_an_op_tagged_random_that_draws_nothing_in_this_call_is_an_unmapped_op():
    # aten.gru carries torch's nondeterministic_seeded tag for its dropout; in eval mode
    # (train=False), or with dropout 0, it draws nothing: the generic refusal
    x = torch.ones(2, 5, 4)
    for gru in (nn.GRU(4, 8, batch_first=True).eval(), nn.GRU(4, 8, batch_first=True)):
        with pytest.raises(UnsupportedOpError, match=r"eins cannot map the ATen op "
                                                     r"aten.gru.input \(in <the module "
                                                     r"itself> \(GRU\).*supported ops: ") as e:
            eins.from_torch(gru, x)
        assert "random" not in str(e.value)
    # two layers with dropout between them, in training mode: it does draw
    with pytest.raises(UnsupportedOpError, match=r"aten.gru.input: it draws random numbers"):
        eins.from_torch(nn.GRU(4, 8, num_layers=2, dropout=0.5, batch_first=True), x)


@pytest.mark.parametrize("shape", [(2, 1, 1, 6), (1, 6), (6, 1), (2, 2, 1, 6), (2, 6),
                                   (1, 1, 6, 6)])
@pytest.mark.parametrize("boolean", [True, False])
@pytest.mark.parametrize("given", ["input", "constant"])
def test_an_attention_mask_broadcasting_over_queries_or_keys_equals_torch(shape, boolean,
                                                                          given):
    # torch broadcasts attn_mask to (B, H, Sq, Sk): a key-padding mask as (B, 1, 1, Sk) (a
    # boolean one is eins.attention's key mask: no S x S), a 2-d mask is (Sq, Sk) even where
    # B == Sq (2 sequences of 2 queries: (2, 6) is not a per-sequence key mask)
    g = torch.Generator().manual_seed(3)
    sq = 2 if shape == (2, 6) else 6
    q, k, v = (torch.randn(2, 2, s, 8, generator=g) for s in (sq, 6, 6))
    mask = torch.arange(math.prod(shape)).reshape(shape) % 4 != 1   # rows differ
    mask[..., 0] = True   # every query keeps a key
    if not boolean:
        mask = torch.randn(shape, generator=g).masked_fill(~mask, float("-inf"))
    module, args = (Sdpa(), (q, k, v, mask)) if given == "input" else (Sdpa(mask), (q, k, v))
    att = _equals_torch(module, *args)
    if shape == (2, 1, 1, 6) and boolean:
        assert att.params["mask"] == "keys"
