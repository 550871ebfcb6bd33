"""Admission batching (engine/scheduler.py): several admissions per drain of the overlapped loop."""

from __future__ import annotations

import pytest

from dspark_jax.engine.request import Request, Status
from dspark_jax.engine.scheduler import Scheduler
from dspark_jax.page_pool import PagePool
from dspark_jax.sampling import SamplingParams


def _scheduler(n_waiting, max_running=8, **kw):
    s = Scheduler(PagePool(1024, 16), max_running=max_running, max_prefill_tokens=512, max_prefill_seqs=8, **kw)
    for i in range(n_waiting):
        s.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=8), seed=i, tokenizer=None,
                      eos_ids=frozenset(), max_model_len=64))
    return s


def _finish(s, n):
    for r in [r for r in s.running if r.status is not Status.FINISHED][:n]:
        r.finish("length")
    s.release_finished()


def test_waits_for_a_batch_of_free_slots_then_admits_them_together():
    s = _scheduler(20, admit_batch=4, admit_max_wait=100)
    s.admit()
    assert len(s.running) == 8  # an empty engine fills at once
    for freed in (1, 2, 3):
        _finish(s, 1)
        s.admit()
        assert len(s.running) == 8 - freed  # held: fewer than 4 free
    _finish(s, 1)
    s.admit()
    assert len(s.running) == 8 and len(s.waiting) == 8  # four admitted in one step, FIFO
    assert [r.id for r in s.running[-4:]] == ["r8", "r9", "r10", "r11"]


def test_a_short_queue_is_admitted_as_soon_as_it_fits():
    s = _scheduler(10, admit_batch=4, admit_max_wait=100)
    s.admit()
    _finish(s, 2)
    s.admit()  # two waiting, two free: nothing more to wait for
    assert len(s.running) == 8 and not s.waiting


def test_a_held_request_waits_at_most_admit_max_wait_steps():
    s = _scheduler(12, admit_batch=4, admit_max_wait=3)
    s.admit()
    _finish(s, 1)
    for _ in range(3):
        s.admit()
        assert len(s.running) == 7
    s.admit()  # the fourth step admits whatever fits
    assert len(s.running) == 8


def test_admit_batch_one_admits_on_every_free_slot_and_bad_settings_fail():
    s = _scheduler(12)
    s.admit()
    _finish(s, 1)
    s.admit()
    assert len(s.running) == 8
    with pytest.raises(ValueError, match="admit_batch"):
        _scheduler(1, admit_batch=0)
    s = _scheduler(12, max_running=4, admit_batch=16, admit_max_wait=100)
    s.admit()
    _finish(s, 4)
    s.admit()  # a batch larger than the engine: all its slots free is enough
    assert len(s.running) == 4
