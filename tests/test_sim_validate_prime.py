"""validate's compile warm-up reaches every prefill kernel shape a job can use, page-table
widths included (a shape first met in a timed run compiles there: the simulator does not
model compilation). Checked on the simulated engine, which keeps the real engine's contract
(no JAX)."""

import itertools
import types


def _bucket(n, buckets):
    return next(b for b in buckets if b >= n)


class _Recorder:
    """A simulated engine that records the (rows, new tokens, page-table width) shape of each
    prefill call, as the real engine buckets it."""

    def __init__(self, rcfg):
        from tiderl.sim.virtual_engine import SimEngine

        self.rcfg, self.shapes = rcfg, set()
        self.eng = SimEngine(max_context=rcfg.max_context, num_pages=rcfg.num_pages,
                             page_size=rcfg.page_size, max_action_tokens=1)

    def prefill_many(self, params, requests):
        r = self.rcfg
        rows = []  # (position, end) of each row's computation
        for q in requests:
            h = q.existing_prefix
            held, kv = (len(h.tokens), h.kv_length) if h is not None else (0, 0)
            end = held + q.true_length
            rows.append([min(kv, end - 1), end])
        chunk = r.prefill_buckets[-1]  # long inputs advance one chunk per call
        while pending := [x for x in rows if x[0] < x[1]]:
            n = [min(chunk, end - pos) for pos, end in pending]
            keys = max(pos + k for (pos, _), k in zip(pending, n))
            pages = -(-keys // r.page_size)
            width = min(1 << (pages - 1).bit_length(), r.max_pages_per_slot)
            self.shapes.add((_bucket(len(pending), r.decode_buckets),
                             _bucket(max(n), r.prefill_buckets), width))
            for x, k in zip(pending, n):
                x[0] += k
        return self.eng.prefill_many(params, requests)

    def generate(self, params, state):
        return self.eng.generate(params, state)

    state = {}  # the simulated engine keeps no decode state

    def free(self, h):
        self.eng.free(h)


def test_prime_widths_reaches_every_prefill_shape_on_a_resident_context():
    from tiderl.serving.warmup import prime_widths

    rcfg = types.SimpleNamespace(page_size=16, max_context=128, max_pages_per_slot=8,
                                 prefill_buckets=(16, 64), decode_buckets=(8, 16, 32, 64),
                                 num_pages=96)
    rec = _Recorder(rcfg)
    n = prime_widths(rec, rcfg, itertools.count())
    want = set()
    for b, t, w in itertools.product(rcfg.decode_buckets, rcfg.prefill_buckets, (1, 2, 4, 8)):
        # reachable: some n new tokens in bucket t on a context of w pages (< max_context)
        lo_t = max([x for x in rcfg.prefill_buckets if x < t], default=0)
        lo_keys = (w // 2) * rcfg.page_size
        hi_keys = min(w * rcfg.page_size, rcfg.max_context - 1)
        if lo_keys < hi_keys and hi_keys - 1 > lo_t:
            want.add((b, t, w))
    assert want <= rec.shapes
    assert n == len(want) and (8, 64, 1) not in want  # 17+ new tokens need 2 pages
