"""Function-preserving expansion of a trained (target, DSpark drafter, MTP drafter) to a big shape.

The expanded target chooses every token as the small trained target does, so a speculative
engine sees the real trained acceptance, while each step costs what a step of the big shape
(e.g. Qwen3-8B) costs.  Source d, D (head_dim), Hq / Hkv heads, F, L, V; big d', D', Hq', Hkv',
F', L', V'.  Weights are [in, out].

- Residual stream: x' = [x ; 0].  Embedding rows of real ids are [E[v] ; 0]; o_proj and
  down_proj columns >= d are zero, so the extra dims stay exactly zero through every layer.
- RMSNorm over d': mean(x'^2) = (d/d') mean(x^2), so with w'[:d] = w * sqrt(d/d') and the big
  config's eps' = eps * d/d' the real dims equal the source's norm exactly; the extra dims are 0
  whatever w'[d:] holds.
- Heads: source KV head g -> big KV head kv(g); its query heads -> query heads of kv(g)'s group.
  Rotate-half pair i (dims i, i + D/2) turns at theta^(-2i/D); it goes to big pair c*i, with
  c = (D'/D) ln(theta) / ln(theta') a positive integer (equal thetas: c = D'/D, e.g. pair 2i of a
  head twice as wide turns at theta^(-4i/D') = theta^(-2i/D)); anything else is refused.  q and k
  of source heads are zero at the other dims before their norm, which shrinks the mean square by
  D/D': with the one config eps' these norms act as if eps were eps * (D'/D) (d/d') (exact up to
  eps: 0.16 eps for an 8B shape).  k_norm' = k_norm * sqrt(D/D') so normed k (the K cache)
  equals the source's; q_norm' = q_norm, so q comes out sqrt(D'/D) larger and
  q'.k' / sqrt(D') = q.k / sqrt(D).  v holds the source's values at the mapped dims.
- o_proj' is zero except rows (source query head, mapped dim) x columns < d: extra query heads
  and v's extra dims are computed from random weights and read by nothing.
- FFN: source unit u is unit u; the extra units' down_proj rows are zero.
- Layers: source layer i sits at round(i (L'-1) / (L-1)); the others have zero o_proj and
  down_proj, so x + 0 + 0 = x exactly.  A drafter's tapped layer t becomes its image.
- LM head: the (real dims, real ids) block is the source's; rows of extra dims read zeros.  Ids
  past the tokenizer have random rows and are masked to -inf by Qwen3ForCausalLM.logits.
- DSpark drafter: fc reads each tap's real dims through the source's rows and writes no extra
  dims (H_ctx's extra dims stay zero under hidden_norm); its layers map as the target's, with
  identity layers up to the requested depth; Markov w1 rows / w2 columns of masked ids are
  random; the confidence head and gated / rnn Markov inputs map h's real rows.  MTP drafter: fc
  reads [h ; embed] through the source's rows, writes no extra dims (bias included).
- Every weight whose value cannot reach the output is random (uniform with the source tensor's
  std, seeded), so the padded regions cost what real weights cost; only weights exactness needs
  are zero.

Exactness: all maps are exact in real arithmetic except the q / k norms' eps (above) and, for
theta' != theta, float32 rounding of the rotary frequencies (different expressions for the same
value).
"""

from dspark_jax.expand.api import (
                                   ExpandedPair,
                                   ExpandedParams,
                                   Sources,
                                   build_drafter,
                                   build_mtp,
                                   build_target,
                                   expand_pair,
                                   expand_params,
                                   plan_expansion,
                                   sources,
                                   write_pair,
)
from dspark_jax.expand.plan import Plan, head_maps, rotary_dim_map, spread
from dspark_jax.expand.shapes import PRESETS, ExpandError, ExpandShape, resolve_shape

__all__ = ["PRESETS", "ExpandError", "ExpandShape", "ExpandedPair", "ExpandedParams", "Plan", "Sources", "build_drafter",
           "build_mtp", "build_target", "expand_pair", "expand_params", "head_maps", "plan_expansion", "resolve_shape",
           "rotary_dim_map", "sources", "spread", "write_pair"]
