"""Whole-model gradients: a tiny LLaMA language model written in eins
(eins/models/llama_lm.py: embedding, blocks, head, cross-entropy) against the same model
written in torch and differentiated by torch.autograd, float32, within the tolerance rule."""
import numpy as np
import pytest
from helpers import (SPREAD, accumulation, assert_close, assert_splits, torch_llama_layer,
                     torch_rms)

import eins
from eins.autodiff import saved_bytes
from eins.models import llama, llama_lm

torch = pytest.importorskip("torch")

CFG = llama.TINY
VOCAB, LAYERS, SEQ = 48, 2, 16


def torch_loss(params, tokens, labels, cos, sin, cfg):
    """The model in torch: the same math as eins/models/llama_lm.py, written independently
    (HF LLaMA's rotate_half, repeat_interleave for the grouped heads)."""
    s = tokens.shape[0]
    x = params["embed"][tokens]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for w in params["layers"]:
        x = torch_llama_layer(x, w, cos, sin, mask, cfg)
    logits = torch_rms(x, params["norm"], cfg.eps) @ params["head"]
    return torch.nn.functional.cross_entropy(logits, labels)


def to_torch(tree):
    leaves, tree_def = eins.tree_flatten(tree)
    ts = [torch.tensor(a, requires_grad=True) for a in leaves]
    return eins.tree_unflatten(tree_def, ts), ts


@pytest.fixture(scope="module")
def model():
    params = llama_lm.init_lm(CFG, VOCAB, LAYERS, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, SEQ)
    labels = rng.integers(0, VOCAB, SEQ)
    cos, sin = llama.rope_tables(SEQ, CFG.head_dim)
    return params, tokens, labels, cos, sin


def torch_grads(params, tokens, labels, cos, sin):
    tparams, leaves = to_torch(params)
    loss = torch_loss(tparams, torch.tensor(tokens), torch.tensor(labels),
                      torch.tensor(cos), torch.tensor(sin), CFG)
    loss.backward()
    return float(loss), [t.grad.numpy() for t in leaves]


@pytest.mark.parametrize("remat", [False, True])
def test_llama_gradients_equal_torch_autograd(model, remat):
    loss = llama_lm.lm_loss_fn(CFG, attention="composed", remat=remat)
    vg = eins.value_and_grad(loss)
    value, grads = vg(*model)
    want_value, want = torch_grads(*model)
    n, depth = accumulation(eins.make_ir(vg)(*model))
    assert_close(value, np.float32(want_value), n=n, depth=depth)
    got = eins.tree_flatten(grads)[0]
    assert len(got) == len(want) == 3 + 9 * LAYERS
    for g, w in zip(got, want):
        assert_close(g, w, n=n, depth=depth)


def test_checkpointed_blocks_keep_less_for_the_backward(model):
    plain = eins.make_ir(eins.grad(llama_lm.lm_loss_fn(CFG, "composed")))(*model)
    remat = eins.make_ir(eins.grad(llama_lm.lm_loss_fn(CFG, "composed", remat=True)))(*model)
    assert saved_bytes(remat) < saved_bytes(plain) / 2


def test_distributed_llama_gradients_equal_jit(model):
    vg = eins.value_and_grad(llama_lm.lm_loss_fn(CFG, attention="composed"))
    want = eins.jit(vg)(*model)
    d = eins.distribute(vg, devices=4, schedule="optimized", tuning=SPREAD)
    got = d(*model)
    low = d.lower(*model)
    assert_splits(low)
    n, depth = accumulation(low.program)
    for g, w in zip(eins.tree_flatten(got)[0], eins.tree_flatten(want)[0]):
        assert_close(g, w, n=n, depth=depth)


def test_the_attention_choice_is_checked():
    with pytest.raises(eins.EinsError, match="attention must be 'auto', 'primitive' or "
                                             "'composed', got 'flash'"):
        eins.make_ir(llama_lm.lm_loss_fn(CFG, attention="flash"))(
            llama_lm.lm_weight_shapes(CFG, VOCAB, 1), eins.ShapeDtype((4,), "int64"),
            eins.ShapeDtype((4,), "int64"), eins.ShapeDtype((4, 4)), eins.ShapeDtype((4, 4)))
