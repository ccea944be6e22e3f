"""eins.from_torch and eins.jit/eins.distribute of an nn.Module on small hand-written modules:
each family of the ATen table against torch's own result, constant folding, the attention
mapping (causal from a mask, GQA without the repeated copy), output structures, the meta
device, and docs/torch.md against the table."""
import math
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
import torch.nn.functional as F
from torch import nn

import eins
from eins.frontends.aten import supported_ops, supported_ops_markdown
from helpers import accumulation, assert_close

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_both(module, *args, p=None, **kwargs):
    """(eins's result, torch's result, the traced program) of ``module(*args)``: through
    eins.jit, or eins.distribute over ``p`` devices."""
    module = module.eval()
    with torch.no_grad():
        want = module(*args, **kwargs)
    f = eins.jit(module) if p is None else eins.distribute(module, devices=p)
    got = f(*args, **kwargs)
    conv = f.convert(*args, **kwargs)
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    prog = eins.make_ir(conv.flat_fn)(conv.params, *tensors)
    return got, want, prog


def assert_matches(got, want, prog):
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    assert g_spec == w_spec
    n, depth = accumulation(prog)
    for g, w in zip(g_leaves, w_leaves):
        if w is None:   # a None output (torch's pytree: a leaf)
            assert g is None
            continue
        assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
        if g.dtype == torch.bfloat16:   # numpy has none: compare in float32, bf16's tolerance
            assert_close(g.float().numpy(), w.float().numpy(), n=n, depth=depth,
                         dtype=eins.bfloat16)
        else:
            assert_close(g.numpy(), w.numpy(), n=n, depth=depth)


class Lambda(nn.Module):
    """A module computing ``fn(self, *inputs)`` with a few parameters of its own."""

    def __init__(self, fn, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.fn = fn
        self.w = nn.Parameter(torch.randn(d, d))
        self.b = nn.Parameter(torch.randn(d))
        self.lin = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, *xs):
        return self.fn(self, *xs)


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


FAMILIES = {
    "linear algebra": lambda m, x: (m.lin(x), x @ m.w, torch.bmm(x, x.transpose(1, 2)),
                                    torch.addmm(m.b, x[0], m.w, beta=0.5, alpha=2.0),
                                    torch.einsum("bij,jk->bik", x, m.w),
                                    torch.baddbmm(m.b, x.mT, x, beta=2.0)),
    "shapes": lambda m, x: (x.view(3, 2, 2, 8).permute(3, 0, 2, 1), x.reshape(-1, 8).t(),
                            x.unsqueeze(1).expand(3, 2, 4, 8), x[:, 1:3, 2:], x[:, 1],
                            torch.cat([x, x * 2], dim=-1), *x.split([3, 5], dim=-1),
                            *x.chunk(2, dim=1), x[None, ..., None].squeeze(0),
                            x.flatten(1), x.contiguous(), x.mT, x.narrow(1, -3, 2),
                            torch.stack([x, m.b.expand_as(x)], 2), x.repeat(2, 1, 3),
                            torch.tile(x[0], (2, 1, 1)), x.tril(1), x.triu(),
                            x.repeat_interleave(2, dim=1), x[0].repeat_interleave(3)),
    "elementwise": lambda m, x: (x + 2 * m.b, x - m.b, 1 - x, x * x, x / 3, -x, x.abs(),
                                 x.exp(), (x.abs() + 1).log(), x.abs().sqrt(),
                                 (x.abs() + 1).rsqrt(), x.tanh(), x.sigmoid(), x.relu(),
                                 F.silu(x), F.gelu(x), F.gelu(x, approximate="tanh"),
                                 x.cos(), x.sin(), x ** 3, torch.pow(2.0, x), x.reciprocal(),
                                 torch.maximum(x, m.b), torch.minimum(x, m.b),
                                 x.clamp(-0.5, 0.5), x.clamp(min=0.1),
                                 torch.where(x > 0, x, m.b), x.masked_fill(x < 0, -1.0),
                                 (x > 0) & (x < 1), (x > 0) | (x < -1), ~(x > 0), x == m.b,
                                 x != 0, x <= 0, x >= 0.5, x.square(),
                                 F.leaky_relu(x, 0.2), F.hardtanh(x, -0.5, 0.7),
                                 F.softplus(x * 30), F.softplus(x, beta=2.0, threshold=1.0),
                                 F.elu(x, 0.5), F.hardsigmoid(x * 4), F.hardswish(x * 4),
                                 F.mish(x), F.logsigmoid(x * 50)),
    "casts": lambda m, x: (x.to(torch.float64), x.double().float(), (x > 0).to(torch.int64),
                           (x * 4).int(), x.type_as(torch.zeros((), dtype=torch.float64)),
                           x.half().sum(-1, dtype=torch.float32),
                           F.softmax(x.half(), -1, dtype=torch.float32)),
    "reductions": lambda m, x: (x.sum(), x.sum(-1), x.sum((0, 2), keepdim=True), x.mean(1),
                                x.amax(-1), x.amin(0), x.var(-1), x.var(1, unbiased=False),
                                x.std(1), x.std(), torch.linalg.vector_norm(x, dim=(0, 2)),
                                F.normalize(x, dim=-1),
                                x.softmax(-1), F.log_softmax(x, dim=1), x.max(), x.min(),
                                torch.max(x, m.b), *x.max(1), *x.min(-1, keepdim=True),
                                x.argmax(), x.argmax(0), x.argmin(-1, keepdim=True),
                                *torch.topk(x, 3), *torch.topk(x, 2, dim=1, largest=False),
                                *x.sort(1), *x.sort(-1, descending=True), x.argsort(0)),
    "experts": lambda m, x: _experts(m, x),
    "grouped_mm": lambda m, x: _grouped_mm(m, x),
    "norms": lambda m, x: (m.ln(x), F.layer_norm(x, (4, 8)), F.rms_norm(x, (8,), m.b),
                           F.rms_norm(x, (8,), eps=1e-3)),
}


def _experts(m, x):
    """What transformers' default MoE layer records (eins/frontends/aten_experts.py), and
    the floor and remainder ops around it."""
    ids = (x[0, :, 0] * 3).abs().long().float()         # expert ids 0.., some out of range
    perm = torch.argsort(x[0, 0])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(8)                          # index_put: the inverse permutation
    acc = torch.zeros(8)
    acc.index_put_((perm % 3,), x[0, 0], accumulate=True)
    return (x // 0.5, torch.floor_divide(x, -0.3), torch.div(x, 0.7, rounding_mode="floor"),
            x % 0.3, x.floor(), x.ceil(), x.trunc(), torch.histc(ids, bins=4, min=0, max=3),
            torch.cumsum(x, 1), torch.cumsum(ids, 0, dtype=torch.int32), inv, acc)


def _grouped_mm(m, x):
    # torch's grouped matmul takes bfloat16 (its CPU kernel too); an empty group in the
    # middle, every row in a group
    offs = torch.tensor([3, 3, 12], dtype=torch.int32)
    w = m.w.reshape(1, 8, 8).repeat(3, 1, 1) * torch.arange(1.0, 4.0)[:, None, None]
    return torch._grouped_mm(x.reshape(12, 8).bfloat16(), w.bfloat16(), offs=offs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_of_ops_equals_torch(family):
    got, want, prog = run_both(Lambda(FAMILIES[family]), _x(3, 4, 8))
    assert_matches(got, want, prog)


def test_promotion_is_torchs():
    # torch: int64 * 0.5 is float32, numpy would say float64
    got, want, prog = run_both(Lambda(lambda m, i: (i * 0.5, i / 2, i + m.b)),
                               torch.arange(8).reshape(1, 8))
    assert [t.dtype for t in got] == [torch.float32] * 3
    assert_matches(got, want, prog)


def test_in_place_ops_on_intermediates_are_their_functional_ops():
    def f(m, x):
        y = m.lin(x)
        y.add_(1.0)
        y.mul_(m.b)
        return y, y.relu_()
    got, want, prog = run_both(Lambda(f), _x(3, 8))
    assert_matches(got, want, prog)


def test_an_in_place_op_on_a_view_is_refused():
    def f(m, x):
        y = m.lin(x)
        y[:, 0].add_(1.0)   # changes y through its view
        return y
    with pytest.raises(eins.UnsupportedOpError, match="aten.add_.Tensor on a tensor that "
                                                      "shares memory"):
        eins.from_torch(Lambda(f), _x(3, 8))


def test_embedding_and_index_gather_the_rows():
    emb = Lambda(lambda m, ids: (F.embedding(ids, m.w), m.w[ids], m.w[:, ids], m.w[ids, ids],
                                 m.w[-1 - ids]))
    got, want, prog = run_both(emb, torch.tensor([[0, 7, 3], [2, 2, 5]]))
    assert_matches(got, want, prog)


class Tied(nn.Module):
    """An embedding and an output projection sharing one weight (tied, as a GPT-2 head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.e = nn.Embedding(20, 8)
        self.h = nn.Linear(8, 20, bias=False)
        self.h.weight = self.e.weight
        self.register_buffer("shift", torch.full((20,), 0.25))

    def forward(self, ids):
        return self.h(torch.tanh(self.e(ids))) + self.shift


def test_a_tied_parameter_is_one_entry_read_by_every_use():
    m = Tied().eval()
    ids = torch.tensor([[1, 2, 3, 3]])
    fn, params = eins.from_torch(m, ids)
    # torch's own deduplication: the first name named_parameters() lists
    assert sorted(params) == ["e.weight", "shift"]
    grads = eins.grad(lambda p, i: eins.sum(fn(p, i) ** 2))(params, ids.numpy())
    (m(ids) ** 2).sum().backward()
    assert sorted(grads) == ["e.weight", "shift"]
    # both uses (the rows gathered and the projection) add to the one gradient
    assert_close(grads["e.weight"], m.e.weight.grad.numpy(), n=20, depth=2)
    assert_close(grads["shift"], 2 * m(ids).sum((0, 1)).detach().numpy(), n=4, depth=2)
    bumped = dict(params, **{"e.weight": params["e.weight"] + 0.5})
    with torch.no_grad():
        m.e.weight.add_(0.5)
        want = m(ids).numpy()
    assert_close(np.asarray(fn(bumped, ids.numpy())), want, n=8, depth=2)


def test_constants_are_folded_with_torch():
    def f(m, x):   # position ids, a mask and a table from arange and triu: no eqns
        pos = torch.arange(x.shape[1])
        table = torch.cos(pos[:, None] * torch.arange(8)[None, :] / 10.0)
        keep = ~torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
        return x + table, keep.float().sum() * x
    got, want, prog = run_both(Lambda(f), _x(2, 4, 8))
    assert_matches(got, want, prog)
    assert [e.prim for e in prog.eqns] == ["add", "mul"]


@pytest.mark.parametrize("shape", [(6, 8), (2, 8, 6), (2, 5, 3, 4)])
def test_cross_entropy_takes_the_classes_on_dim_1_at_any_rank(shape):
    # torch's (N, C, d1, ..., dk) logits with (N, d1, ..., dk) targets; -100 ignored
    logits = _x(*shape)
    target = torch.randint(0, shape[1], shape[:1] + shape[2:],
                           generator=torch.Generator().manual_seed(2))
    target.view(-1)[::5] = -100
    got, want, prog = run_both(Lambda(lambda m, x, t: (
        F.cross_entropy(x, t), F.cross_entropy(x, t, reduction="sum"),
        F.cross_entropy(x, t, reduction="none"))), logits, target)
    assert got[2].shape == target.shape
    assert_matches(got, want, prog)


class Attn(nn.Module):
    def __init__(self, heads=4, kv_heads=2, d=8, how="causal"):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.kvh, self.d, self.how = heads, kv_heads, d, how
        self.q = nn.Linear(32, heads * d)
        self.kv = nn.Linear(32, 2 * kv_heads * d)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kvh, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        g = self.h // self.kvh
        if self.how == "gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # transformers' repeat_kv: the kv heads copied g times
        k, v = (t[:, :, None].expand(b, self.kvh, g, s, self.d).reshape(b, self.h, s, self.d)
                for t in (k, v))
        if self.how == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        if self.how == "bool mask":
            mask = torch.ones(s, s, dtype=torch.bool).tril()
        elif self.how == "additive mask":
            low = torch.finfo(q.dtype).min   # what transformers fills in, in the model's dtype
            mask = torch.full((s, s), low, dtype=q.dtype).triu(1)[None, None]
        else:   # a full mask: nothing hidden
            mask = torch.ones(b, 1, s, s, dtype=torch.bool)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("how,causal", [("causal", True), ("gqa", True), ("bool mask", True),
                                        ("additive mask", True), ("full", False)])
def test_attention_stays_whole_with_its_flags(how, causal):
    got, want, prog = run_both(Attn(how=how), _x(2, 6, 32), p=4)
    assert_matches(got, want, prog)
    (att,) = [e for e in prog.eqns if e.prim == "attention"]
    assert att.params["causal"] is causal
    # GQA: eins.attention reads the 2 kv heads; the repeated copy is never computed
    assert att.inputs[0].shape == (2, 4, 6, 8) and att.inputs[1].shape == (2, 2, 6, 8)
    assert not any(e.prim == "where" for e in prog.eqns)


def test_an_additive_causal_mask_in_bfloat16_is_causal():
    m = Attn(how="additive mask").to(torch.bfloat16)
    got, want, prog = run_both(m, _x(2, 6, 32).to(torch.bfloat16), p=2)
    assert_matches(got, want, prog)
    (att,) = [e for e in prog.eqns if e.prim == "attention"]
    assert att.params["causal"] is True


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.full((4,), 0.5))   # persistent: a param

    def forward(self, x, extra=None, *, scale=2.0, reduce="sum"):
        y = self.lin(x) + self.offset
        if extra is not None:
            y = y * extra
        return {"y": y * scale, "pair": (y, getattr(x, reduce)(-1))}


def test_outputs_keep_the_modules_structure_and_python_values_are_baked():
    m = Structured()
    x = _x(3, 4)
    got, want, prog = run_both(m, x, scale=3.0)
    assert_matches(got, want, prog)
    # a string, None, a tensor keyword: the module's call as it is
    f = eins.distribute(m, devices=2)
    for extra, reduce in [(None, "amax"), (_x(3, 4, seed=3), "sum")]:
        with torch.no_grad():
            want = m(x, extra, scale=0.5, reduce=reduce)
        got = f(x, extra, scale=0.5, reduce=reduce)
        conv = f.convert(x, extra, scale=0.5, reduce=reduce)
        tensors = [t for t in (x, extra) if t is not None]
        assert_matches(got, want, eins.make_ir(conv.flat_fn)(conv.params, *tensors))
    fn, params = eins.from_torch(m, x, scale=3.0)
    assert sorted(params) == ["lin.bias", "lin.weight", "offset"]
    assert all(isinstance(v, np.ndarray) for v in params.values())
    out = eins.jit(fn, static_argnames="scale")(params, x.numpy(), scale=3.0)
    assert set(out) == {"y", "pair"} and isinstance(out["pair"], tuple)


class WithNone(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.mha(x, x, x, need_weights=False)   # weights: None
        return out, weights, {"none": None, "y": x * 2}


@pytest.mark.parametrize("p", [None, 2])
def test_a_none_among_the_outputs_stays_none(p):
    got, want, prog = run_both(WithNone(), _x(2, 8, 16), p=p)
    assert got[1] is None and got[2]["none"] is None
    assert_matches(got, want, prog)


def test_a_transformers_output_keeps_its_type_and_a_second_call_reuses_the_plan():
    import transformers as T
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1)).eval()
    ids = torch.randint(0, 32, (1, 5))
    f = eins.distribute(m, devices=2)
    out = f(ids)
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits.shape == (1, 5, 32)
    first = f.convert(ids)
    again = f(torch.randint(0, 32, (1, 5)))
    assert f.convert(ids) is first and again.logits.shape == (1, 5, 32)


def test_a_meta_module_plans_from_shapes_alone():
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        dtype=torch.bfloat16)
    with torch.device("meta"):
        m = T.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros((1, 16), dtype=torch.long, device="meta")
    f = eins.distribute(m, devices=8, topology="dgx-h100:8")
    conv = f.convert(ids)
    assert conv.shape_only
    assert all(isinstance(v, eins.ShapeDtype) for v in conv.params.values())
    assert conv.params["model.embed_tokens.weight"] == eins.ShapeDtype((64, 64), "bfloat16")
    low = f.lower(ids)
    assert low.predicted_time()["total_ms"] > 0
    assert sum(e.prim == "attention" for e in low.program.eqns) == 2
    with pytest.raises(eins.EinsError, match="meta tensors.*lower"):
        f(ids)


def test_a_gpu_backend_places_the_parameters_once():
    # backend "interpret": the generated GPU program on the CPU (Triton's interpreter)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    f = eins.distribute(m, devices=2, backend="interpret")
    x = _x(4, 8)
    assert_close(f(x).numpy(), m(x).detach().numpy(), n=16, depth=2)
    x2 = _x(4, 8, seed=2)
    y2 = f(x2)   # a new input: only its blocks are loaded, the parameters stay placed
    assert_close(y2.numpy(), m(x2).detach().numpy(), n=16, depth=2)
    stats = f.stats()
    assert stats["device_load_bytes"] == x2.numel() * 4 and stats["loads_skipped"] > 0


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_each_call_reads_the_modules_current_parameters(backend):
    # an optimizer step (in place), a new Parameter bound to the name, a new .data, a
    # changed dtype: every call equals the module as it is then (interpret: the weights
    # placed on their devices are placed again)
    torch.manual_seed(0)
    lin = nn.Linear(16, 4).eval()
    x = _x(3, 16)
    f = eins.distribute(lin, devices=2, backend=backend)

    def check(x):
        got = f(x)
        with torch.no_grad():
            want = lin(x)
        assert got.dtype == want.dtype
        assert_close(got.numpy(), want.numpy(), n=16, depth=1)

    check(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    check(x)
    lin.weight = nn.Parameter(torch.randn(4, 16))
    check(x)
    lin.bias.data = torch.randn(4)
    check(x)
    lin.double()
    check(x.double())
    lin.weight = nn.Parameter(torch.randn(4, 16, dtype=torch.float64))
    check(x.double())
    assert f.convert(x.double()).params["weight"].dtype == np.float64


def test_a_changed_non_persistent_buffer_converts_again():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

        def forward(self, x):
            return x * self.scale   # a folded constant of the conversion

    m, x = Scaled(), _x(3, 4)
    f = eins.jit(m)
    assert_close(f(x).numpy(), 2 * x.numpy())
    m.scale.fill_(3.0)
    assert_close(f(x).numpy(), 3 * x.numpy())
    m.scale = torch.full((4,), 5.0)
    assert_close(f(x).numpy(), 5 * x.numpy())
    m.scale.data.fill_(7.0)   # no version counter moves: its values tell
    assert_close(f(x).numpy(), 7 * x.numpy())
    conv = f.convert(x)
    assert_close(f(x).numpy(), 7 * x.numpy())
    assert f.convert(x) is conv   # unchanged since: not converted again


WORLD_SCRIPT = """
import torch, eins
from eins.tolerance import close
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).eval()
x = torch.randn(4, 8)
y = eins.distribute(m, devices="world", timeout_s=60)(x)
assert isinstance(y, torch.Tensor) and y.shape == (4, 8)
assert close(y.numpy(), m(x).detach().numpy(), n=16, depth=2)
print("CHECKED")
"""


def test_a_module_runs_on_the_ranks_of_a_world(tmp_path):
    # rank 0 of a one-rank world, as torchrun would start it (RANK, WORLD_SIZE, ...)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "world.py"
    script.write_text(WORLD_SCRIPT)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=f"{ROOT}{os.pathsep}"
                                                 f"{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CHECKED" in r.stdout


def test_distribute_checks_its_options_before_the_first_call():
    with pytest.raises(eins.PlanError, match="devices must be at least 1"):
        eins.distribute(nn.Linear(2, 2), devices=0)
    # a module's call returns torch tensors: results left on the devices are refused, not
    # silently brought back
    with pytest.raises(eins.PlanError, match=r"outputs='devices' does not apply to an "
                                             r"nn.Module: .*torch tensors.*eins.from_torch"):
        eins.distribute(nn.Linear(2, 2), devices=2, outputs="devices")
    with pytest.raises(eins.PlanError, match=r"donate_argnums=\(0,\) .* nn.Module"):
        eins.distribute(nn.Linear(2, 2), devices=2, donate_argnums=0)


def test_the_doc_lists_the_tables_ops():
    doc = (ROOT / "docs" / "torch.md").read_text()
    assert supported_ops_markdown() in doc
    assert "aten.scaled_dot_product_attention" in supported_ops()


def test_importing_eins_does_not_import_torch():
    code = "import sys, eins; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_a_plain_function_is_not_taken_for_a_module():
    assert math.isclose(float(eins.jit(lambda x: x * 2)(np.float32(1.5))), 3.0)
