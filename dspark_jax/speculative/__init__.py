"""Speculative decoding on the host side: token tiers, the confidence scheduler, the cost model.

* ``tiers``: the compiled verify shapes and the tier a step runs, from (batch size, budget) only.
* ``scheduler``: the batch budget K from lagged survival and a cost table, and per-request
  verify lengths as a prefix-shaped top-K of the current survival.
* ``cost_model``: the additive step-time table T(bs, K) = bias + alpha(bs) + theta(bs + K), its
  JSON file and its least-squares fit.

Everything here is numpy; nothing imports jax.
"""
