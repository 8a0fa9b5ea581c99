"""Host page allocator: sharing, copy-on-write, exhaustion, and a hypothesis state machine."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiderl.serving.pages import PageAllocator, PoolExhaustedError


def _alloc(num_pages=8, page_size=4, max_slots=4, max_pages_per_slot=6):
    return PageAllocator(num_pages=num_pages, page_size=page_size, max_slots=max_slots,
                         max_pages_per_slot=max_pages_per_slot)


def test_pages_module_imports_without_jax():
    code = ("import sys, tiderl.serving.pages, tiderl.serving.config; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fork_shares_pages_and_copies_last_partial_page_on_write():
    a = _alloc()
    s = a.open()
    assert a.reserve(s, 0, 10) == []  # 3 pages, the last holds 2 of 4 tokens
    kids = a.fork(s, 2)
    assert [a.refcount[p] for p in a.tables[s]] == [3, 3, 3]
    assert a.pages_in_use == 3 and a.pages_shared == 3  # memory counted once
    copies = a.reserve(kids[0], 10, 11)  # first write into the shared partial page
    assert len(copies) == 1 and copies[0][0] == a.tables[s][2]
    assert a.tables[kids[0]][:2] == a.tables[s][:2] and a.tables[kids[0]][2] != a.tables[s][2]
    assert a.refcount[a.tables[s][2]] == 2 and a.pages_in_use == 4
    a.check()
    for slot in [s, *kids]:
        a.close(slot)
    assert a.pages_in_use == 0 and a.pages_free == 8
    a.check()


def test_exhaustion_names_the_setting_and_changes_nothing():
    a = _alloc(num_pages=4)
    s0, s1 = a.open(), a.open()
    a.reserve(s0, 0, 12)
    before = [list(t) for t in a.tables], a.refcount.copy()
    with pytest.raises(PoolExhaustedError, match=r"rollout\.num_pages=4"):
        a.reserve(s1, 0, 8)
    assert [list(t) for t in a.tables] == before[0] and np.array_equal(a.refcount, before[1])
    a.check()
    for _ in range(2):
        a.open()
    with pytest.raises(PoolExhaustedError, match=r"rollout\.max_slots=4"):
        a.open()


def test_context_longer_than_a_slot_names_max_context():
    a = _alloc(max_pages_per_slot=2)
    s = a.open()
    with pytest.raises(ValueError, match=r"rollout\.max_context"):
        a.reserve(s, 0, 9)


class AllocatorMachine(RuleBasedStateMachine):
    """Random open / append / fork / evict / free, with a shadow copy of every slot's tokens.

    Page contents are simulated on the host (`data`), copies applied exactly as the engine
    does, so a wrong copy-on-write or a page reused while still referenced shows up as a slot
    reading back tokens it never wrote.
    """

    def __init__(self):
        super().__init__()
        self.a = _alloc(num_pages=12, page_size=3, max_slots=5, max_pages_per_slot=6)
        self.data = np.full((13, 3), -1, np.int64)
        self.expected: dict[int, list[int]] = {}
        self.counter = 0

    def _write(self, slot, start, values):
        copies = self.a.reserve(slot, start, start + len(values))
        for src, dst in copies:
            self.data[dst] = self.data[src]
        for i, v in enumerate(values):
            pos = start + i
            self.data[self.a.tables[slot][pos // 3], pos % 3] = v

    @precondition(lambda self: len(self.expected) < 5)
    @rule()
    def open(self):
        self.expected[self.a.open()] = []

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 8))
    def append(self, data, n):
        slot = data.draw(st.sampled_from(sorted(self.expected)))
        length = len(self.expected[slot])
        values = list(range(self.counter, self.counter + n))
        self.counter += n
        snapshot = [list(t) for t in self.a.tables], self.a.refcount.copy(), self.data.copy()
        try:
            self._write(slot, length, values)
        except PoolExhaustedError as e:
            assert "rollout.num_pages=12" in str(e)
            assert [list(t) for t in self.a.tables] == snapshot[0]
            assert np.array_equal(self.a.refcount, snapshot[1])
            assert np.array_equal(self.data, snapshot[2])
            return
        except ValueError as e:  # over max_pages_per_slot
            assert "rollout.max_context" in str(e) and length + n > 18
            return
        self.expected[slot] += values

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        slot = data.draw(st.sampled_from(sorted(self.expected)))
        try:
            kids = self.a.fork(slot, n)
        except PoolExhaustedError as e:
            assert "rollout.max_slots" in str(e)
            return
        for k in kids:
            self.expected[k] = list(self.expected[slot])

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), evict=st.booleans())
    def free(self, data, evict):
        slot = data.draw(st.sampled_from(sorted(self.expected)))
        if evict:
            self.a.release_pages(slot)
            self.expected[slot] = []
        else:
            self.a.close(slot)
            del self.expected[slot]

    @invariant()
    def consistent(self):
        self.a.check()
        assert 0 <= self.a.pages_in_use <= self.a.num_pages
        for slot, tokens in self.expected.items():
            read = [int(self.data[self.a.tables[slot][i // 3], i % 3]) for i in range(len(tokens))]
            assert read == tokens, f"slot {slot} reads back {read}, wrote {tokens}"


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
