"""Triton kernels for eins's GPU path, generated from Jinja templates
(eins/kernels/templates/triton_*.py.j2), with launchers on torch tensors.

Every launcher runs compiled Triton on CUDA tensors and Triton's interpreter on CPU tensors
(chosen per launch from the tensors' device; see build.py), which is how the CPU tests run
them. Tensors must be contiguous unless said otherwise. Stable launcher signatures:

- ``attention(q, k, v, out=None, *, causal=True, segments=None, scale=None, lse=None,
  q_offset=0, k_offset=0, impl="auto", config=None, window=None, softcap=None, mask=None,
  mask_kind=None, bias=None, bias_kind=None, rows=None, running=None) -> out``: flash
  attention; q
  ``[..., Hq, Sq, D]``, k ``[..., Hkv, Sk, D]``, v ``[..., Hkv, Sk, Dv]``, one dtype
  (float16, bfloat16, float32); ``segments`` = global packed-sequence end positions;
  ``lse`` (float32 ``[..., Hq, Sq]``) receives the row log-sum-exps;
  ``q_offset``/``k_offset`` the key positions of the blocks' first rows (a decode step's
  ``q_offset`` is its cache length); ``window``, ``softcap``, a bool ``mask`` ("keys"
  ``[..., Sk]`` or "full" ``[..., Hq or 1, Sq, Sk]``) and a float ``bias`` ("alibi" slopes
  ``[..., Hq]`` or "add" like a full mask) as eins's attention primitive takes them;
  ``out`` ``[..., Hq, Sq, Dv]`` in q's dtype, or float32 for a key-split partial.
  ``impl``: "triton" (this package's kernel), "sdpa" (PyTorch's scaled_dot_product_attention
  where it computes exactly this; eins/kernels/sdpa.py), "cudnn" (the same on SDPA's cuDNN
  backend alone), "flash_attn" (its varlen kernel) or "auto" (flash-attn, then SDPA on CUDA
  16-bit fused backends, else Triton; with a ``measured`` table, the fastest exact kernel
  there; ``attention.choose_impl``). ``running``: a pipelined piece's running (o, lse)
  pairs in :func:`attention_pairs`' layout, which the Triton kernel's online softmax
  starts from (Triton only).
- ``attention_pairs(q, k, v, pairs, *, causal=True, segments=None, scale=None, q_offset=0,
  k_offset=0, config=None, window=..., mask=..., running=None) -> pairs`` (in
  ``eins.kernels.attention``): a key-split block's partial written straight into the
  device IR's (o, lse) pair layout, float32 ``[..., Hq, Sq, Dv, 2]`` (what the GPU runtime and the rank kernel sets hold; the generated
  lse ⊕ kernel, ``triton_agg.py.j2``, combines them).
- ``combine_lse(o1, lse1, o2, lse2, out, lse_out) -> (out, lse_out)``: the exact ⊕ of two
  key-split partials.
- ``matmul(a, b, out, *, impl="torch") -> out``: batched ``a @ b`` with numpy batch
  broadcasting, fp32 accumulation, result in ``out``'s dtype (eqn dtype); ``impl="torch"``
  is cuBLAS through ``torch.matmul(out=)`` (capturable), ``impl="triton"`` the template.
- ``rms_norm(x, weight, out, *, eps) -> out`` and ``rope(x, cos, sin, out) -> out``: the
  ops of eins/ops/norms.py and rope.py (statistics/products in float32).
- ``fusion_groups(program, instrs=None, bufs=None, min_size=2, reorder=False)
  -> list[list[int]]`` (``reorder=True``: chains across independent items such as the
  matmul between silu and mul; launch those at ``FusedKernel.launch_at``, the last member),
  ``fused_source(program, group, instrs=None, bufs=None) -> FusedKernel`` (``.name``,
  ``.source``, ``.inputs``, ``.outputs``, ``.shape``) and
  ``launch_fused(fk, inputs, outputs, block=None)``: one Triton kernel per chain of
  consecutive elementwise eqns; ``op_source(prim, params, operands, out_shape, out_dtype)``
  for a single op (eins/kernels/fusion.py).

Each primitive's GPU lowering is registered beside its reference kernel
(``eins.ir.primitive.gpu_lowering(prim).fn(fspec, outs, ins, **params)``); it calls these
launchers. A missing torch/triton raises ``KernelUnavailable`` naming the extra to install.
"""
from eins.kernels.build import KernelUnavailable  # noqa: F401
from eins.kernels.attention import attention, attention_source, combine_lse  # noqa: F401
