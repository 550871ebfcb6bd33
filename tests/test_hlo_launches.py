"""Kernel-launch counting from optimized HLO text (benchmarks/hlo_launches.py), against hand counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks.hlo_launches import count_launches

# Shaped like XLA's GPU dumps: a while with a known trip count, a call, a two-branch conditional.
HLO = """HloModule jit_f, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_a (p.0: f32[8]) -> f32[8] {
  %p.0 = f32[8]{0} parameter(0)
  ROOT %neg.1 = f32[8]{0} negate(%p.0)
}

%body.1 (arg.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %arg.1 = (s32[], f32[8]{0}) parameter(0)
  %gte.1 = f32[8]{0} get-tuple-element(%arg.1), index=1
  %loop_fusion.1 = f32[8]{0} fusion(%gte.1), kind=kLoop, calls=%fused_a
  %loop_fusion.2 = s32[] fusion(%arg.1), kind=kLoop, calls=%fused_a
  %copy.1 = f32[8]{0} copy(%loop_fusion.1)
  ROOT %tuple.1 = (s32[], f32[8]{0}) tuple(%loop_fusion.2, %copy.1)
}

%cond.1 (arg.2: (s32[], f32[8])) -> pred[] {
  %arg.2 = (s32[], f32[8]{0}) parameter(0)
  ROOT %loop_compare_fusion = pred[] fusion(%arg.2), kind=kLoop, calls=%fused_a
}

%callee.1 (x.1: f32[8]) -> f32[8] {
  %x.1 = f32[8]{0} parameter(0)
  ROOT %f.9 = f32[8]{0} fusion(%x.1), kind=kLoop, calls=%fused_a
}

%branch_one (y.1: f32[8]) -> f32[8] {
  %y.1 = f32[8]{0} parameter(0)
  ROOT %f.10 = f32[8]{0} fusion(%y.1), kind=kLoop, calls=%fused_a
}

%branch_two (y.2: f32[8]) -> f32[8] {
  %y.2 = f32[8]{0} parameter(0)
  %f.11 = f32[8]{0} fusion(%y.2), kind=kLoop, calls=%fused_a
  ROOT %f.12 = f32[8]{0} fusion(%f.11), kind=kLoop, calls=%fused_a
}

ENTRY %main.1 (a.1: f32[8]) -> f32[8] {
  %a.1 = f32[8]{0} parameter(0)
  %c.1 = s32[] constant(0)
  %in_fusion = f32[8]{0} fusion(%a.1), kind=kInput, calls=%fused_a, metadata={op_name="jit(f)/while(x)"}
  %cc.1 = f32[8]{0} custom-call(%in_fusion), custom_call_target="__gpu$xla.gpu.triton"
  %bc.1 = f32[8]{0} bitcast(%cc.1)
  %t.1 = (s32[], f32[8]{0}) tuple(%c.1, %bc.1)
  %while.1 = (s32[], f32[8]{0}) while(%t.1), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  %g.1 = f32[8]{0} get-tuple-element(%while.1), index=1
  %call.1 = f32[8]{0} call(%g.1), to_apply=%callee.1
  %p.1 = s32[] constant(1)
  %cond.2 = f32[8]{0} conditional(%p.1, %call.1, %call.1), branch_computations={%branch_one, %branch_two}
  ROOT %out_fusion = f32[8]{0} fusion(%cond.2), kind=kLoop, calls=%fused_a
}
"""


def test_hand_counted_module():
    c = count_launches(HLO)
    # entry: 2 fusions + 1 custom call; while: 3 x (2 fusions + copy) + 4 x 1 fusion;
    # call: 1 fusion; conditional: the 2-fusion branch
    assert c.total == 3 + 3 * 3 + 4 + 1 + 2 == 19
    assert dict(c.by_opcode) == {"fusion": 2 + 6 + 4 + 1 + 2, "custom-call": 1, "copy": 3}
    assert c.unknown_trip_whiles == 0


def test_while_without_a_known_trip_count_is_counted_once_and_flagged():
    c = count_launches(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
    assert c.total == 3 + 3 + 1 + 1 + 2 and c.unknown_trip_whiles == 1


def test_missing_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        count_launches(HLO.replace("ENTRY ", ""))


def test_parses_what_the_local_compiler_emits():
    """The counter reads this jax's own HLO text: a 5-step loop launches its body's ops 5 times,
    or, where the compiler did not annotate the trip count, once with the loop flagged."""
    def f(x):
        return jax.lax.fori_loop(0, 5, lambda i, y: jnp.sin(y) * 2.0 + i, x)

    text = jax.jit(f).lower(jnp.ones(8)).compile().as_text()
    c = count_launches(text)
    assert c.total >= 1
    single = count_launches(text.replace("known_trip_count", "unknown_trip"))
    if c.unknown_trip_whiles == 0 and "known_trip_count" in text:
        assert c.total > single.total
    else:
        assert c.unknown_trip_whiles >= 1
