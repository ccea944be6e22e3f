"""Tiny transformers models with random weights, unedited, through
``eins.distribute(model, devices=p)`` at p = 1, 4 and 8: every output tensor equals the
module's own within the tolerance rule (eins/tolerance.py), in the module's own output type.

``SUITE`` runs in the test suite. ``PENDING`` are the targets that need operators eins does
not have yet (each with its reason); they stay out of the suite and run with
``python tests/test_torch_models.py --pending``, which prints which of them pass today. The
sliding window and the padding mask run both with transformers' eager attention
(``attn_implementation="eager"``: scores as matmuls, the mask added to them) and with SDPA
(the default: one eins.attention with ``window=`` or ``mask=``/``bias=``). Mixtral with
``experts_implementation="batched_mm"`` (top_k routing, the experts' weights gathered per
token, batched matmuls) and with transformers' default grouped experts (tokens sorted per
expert, histc, cumsum, grouped_mm, index_put: eins/frontends/aten_experts.py) run in the
suite.
"""
import inspect
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
import transformers as T

import eins
from eins.ir.plan import Tuning
from helpers import accumulation, assert_close

VOCAB, BATCH, SEQ = 64, 2, 8
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=64)


def _labels():
    g = torch.Generator().manual_seed(1)
    return {"labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}


def _padding_mask():
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ - 3:] = 0   # the first sequence is 3 tokens shorter
    return {"attention_mask": mask}


# name -> (build the module, extra keyword arguments of the call)
MODELS = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DECODER)), dict),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_DECODER)), dict),
    # a window longer than the sequence: the mask transformers builds is plain causal
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**_DECODER,
                                                             sliding_window=2 * SEQ)), dict),
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**_DECODER, head_dim=8)), dict),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0)), dict),
    "bert": (lambda: T.BertModel(T.BertConfig(**_BERT)), dict),
    # transformers' own eager attention (scores materialized, the mask added to them):
    # a window shorter than the sequence and a padding mask run through matmul and softmax
    "mistral-window-eager": (lambda: T.MistralForCausalLM(T.MistralConfig(
        **_DECODER, sliding_window=4, attn_implementation="eager")), dict),
    "bert-mask-eager": (lambda: T.BertModel(T.BertConfig(**_BERT, attn_implementation="eager")),
                        _padding_mask),
    # experts as gathered weights and batched matmuls (top_k routing, gather, bmm)
    "mixtral-batched": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation="batched_mm")), dict),
    # SDPA with a window shorter than the sequence, and with a padding mask
    "mistral-window": (lambda: T.MistralForCausalLM(T.MistralConfig(**_DECODER,
                                                                    sliding_window=4)), dict),
    "bert-mask": (lambda: T.BertModel(T.BertConfig(**_BERT)), _padding_mask),
    # the whole model with its loss (logits, shifted labels, cross entropy)
    "llama-loss": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DECODER)), _labels),
    # Gemma 2: score caps (attention and final logits), alternating sliding windows
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **_DECODER, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=8)), dict),
    # transformers' default experts: sorted per expert, histc, grouped_mm, index_put
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2)), dict),
}

SUITE = ["llama", "qwen2", "mistral", "gemma", "gpt2", "bert", "mistral-window-eager",
         "bert-mask-eager", "mixtral-batched", "mistral-window", "bert-mask", "llama-loss",
         "gemma2", "mixtral"]

PENDING: dict = {}   # name: why it cannot run yet


def check_model(name, ps=(1, 4, 8)):
    build, call_kwargs = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    kwargs = call_kwargs()
    # eins converts a model whose forward takes use_cache with use_cache=False: a KV cache
    # is decoding state, not a result (eins/frontends/torch.py)
    cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        want = model(ids, **kwargs, **cache)
    want_leaves, want_spec = pytree.tree_flatten(want)
    for p in ps:
        # every device busy (a tiny model is fastest on one: device subsets would take it)
        f = eins.distribute(model, devices=p, tuning=Tuning(device_subsets=False))
        got = f(ids, **kwargs)
        assert type(got) is type(want), (name, p)
        got_leaves, got_spec = pytree.tree_flatten(got)
        assert got_spec == want_spec, (name, p)
        conv = f.convert(ids, **kwargs)
        prog = eins.make_ir(conv.fn)(conv.params, ids.numpy(),
                                     **{k: v.numpy() for k, v in kwargs.items()})
        n, depth = accumulation(prog)
        for g, w in zip(got_leaves, want_leaves):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype
            assert_close(g.numpy(), w.numpy(), n=n, depth=depth, err_msg=f"{name} p={p}")
        # on several devices the plan splits work: more kernels run than the program has
        # eqns (one device running everything would run exactly one per eqn)
        kernels = f.stats()["kernels"]
        assert kernels > len(prog.eqns) if p > 1 else kernels == len(prog.eqns), \
            (name, p, kernels, len(prog.eqns))


@pytest.mark.parametrize("name", SUITE)
def test_transformers_model_equals_the_module(name):
    check_model(name)


@pytest.mark.parametrize("name,p", [("llama-loss", 1), ("llama-loss", 4), ("gpt2", 4)])
def test_gradients_of_a_converted_model_equal_torch_autograd(name, p):
    """eins.value_and_grad over the function eins.from_torch makes of an unedited
    transformers LLaMA (its loss from labels) equals loss.backward() on the module: the
    loss and every parameter's gradient, under the tolerance rule; distributed too. GPT-2
    ties its head to its embedding: one entry, under torch's name, with both uses' sum."""
    build = MODELS[name][0]
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = _labels()["labels"]
    fn, params = eins.from_torch(model, ids, labels=labels)

    def loss(params, ids, labels):
        return fn(params, ids, labels=labels)["loss"]

    vg = eins.value_and_grad(loss)
    args = (params, ids.numpy(), labels.numpy())
    val, grads = (eins.jit(vg) if p == 1 else eins.distribute(
        vg, devices=p, tuning=Tuning(device_subsets=False)))(*args)
    out = model(ids, labels=labels, use_cache=False)
    out.loss.backward()
    n, depth = accumulation(eins.make_ir(vg)(*args))
    assert_close(np.asarray(val), out.loss.detach().numpy(), n=n, depth=depth)
    named = dict(model.named_parameters())
    assert set(grads) == {k for k, t in named.items() if t.requires_grad}
    for k, t in named.items():
        assert_close(np.asarray(grads[k]), t.grad.numpy(), n=n, depth=depth, err_msg=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_equals_the_module_in_its_dtype(dtype):
    torch.manual_seed(0)
    model = MODELS["llama"][0]().to(dtype).eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    f = eins.distribute(model, devices=4)
    got = f(ids).logits
    assert got.dtype == dtype
    conv = f.convert(ids)
    n, depth = accumulation(eins.make_ir(conv.fn)(conv.params, ids.numpy()))
    # numpy has no bfloat16 of its own: compare in float32 under the tolerance of dtype
    assert_close(got.float().numpy(), want.float().numpy(), n=n, depth=depth,
                 dtype=conv.params["lm_head.weight"].dtype)


def test_the_hf_llama_example_runs():
    """examples/hf_llama.py as docs/torch.md runs it, at 2 layers and 512 tokens to keep
    the suite fast (the default is LLaMA-3-8B's 32 layers at 8,192 tokens)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(root / "examples" / "hf_llama.py"), "--layers",
                        "2", "--seq", "512"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    assert "within the tolerance" in r.stdout
    assert re.search(r"LLaMA-3-8B sizes \(2 layers, 1 x 512 tokens, bfloat16\) on dgx-h100:8",
                     r.stdout)
    assert re.search(r"  2 x attention +split \S+", r.stdout)   # one per layer
    assert re.search(r"predicted [0-9.]+ ms per forward pass", r.stdout)


def test_the_lists_name_models_that_exist():
    assert set(SUITE) | set(PENDING) == set(MODELS) and not set(SUITE) & set(PENDING)


def main(argv) -> int:
    names = list(PENDING) if "--pending" in argv else SUITE
    failed = 0
    for name in names:
        try:
            check_model(name)
            print(f"PASS {name}")
        except Exception as e:   # a report of every pending model, not the first failure
            failed += 1
            print(f"FAIL {name}: {PENDING.get(name, '')}\n    {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main(sys.argv[1:]))
