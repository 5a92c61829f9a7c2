"""The roofline's read probe reads memory laid out as the decode step's streams are (pyllm/roofline.py).

A probe on 4 KiB pages pays a TLB miss per page that the weights' copies and KV caches, asked onto huge pages, do
not: it read 23 GB/s where the decode GEMVs read 28-29 (a Xeon VM, 2 threads), and every bench row showed more than
100% of the bandwidth.  Reference: the advice the runtime's own buffers get (ops.advise_huge_pages), asked before
the first write, over the whole probe buffer.
"""

from __future__ import annotations

import torch

from pyllm import ops, roofline
from pyllm.errors import PyllmError


def test_the_read_probe_asks_for_huge_pages_before_its_first_write(monkeypatch):
    calls = []

    def advise(t: torch.Tensor) -> int:
        calls.append((t.data_ptr(), t.numel(), t.dtype))
        t.fill_(7)  # a write after the advice is overwritten by the probe's fill; one before it would show here
        return 0

    monkeypatch.setattr(ops, "advise_huge_pages", advise)
    buf = roofline.probe_buffer(3 << 20)
    assert calls == [(buf.data_ptr(), 3 << 20, torch.uint8)]
    assert bool((buf == 1).all()), "the probe buffer is filled after the advice"


def test_the_read_probe_times_the_whole_buffer_with_and_without_the_extension(monkeypatch):
    """Reference: the buffer's bytes over the reads' time, on a clock that advances one second a read.  With the
    extension the reads are its read_sum on the threads asked for; without it (pyllm._ext.load fails), torch's sum
    of the same buffer."""
    from pyllm import _ext

    seen = []
    real = _ext.load()

    class Counting:
        def read_sum(self, buf, threads):
            seen.append((buf.numel(), threads))
            return real.read_sum(buf, threads)

    ticks = iter(range(1000))
    monkeypatch.setattr(ops, "advise_huge_pages", lambda t: 0)  # the advice: the test above
    monkeypatch.setattr(_ext, "load", lambda: Counting())
    rate = roofline.measure_read_bandwidth(2, gib=1 / 64, repeats=3, clock=lambda: next(ticks))
    assert rate == 2**24 and seen == [(2**24, 2)] * 4  # one untimed read, then three timed

    def unbuilt():
        raise PyllmError("no compiler")

    sums = []
    monkeypatch.setattr(_ext, "load", unbuilt)
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: sums.append(t.numel()) or torch.tensor(0.0))
    assert roofline.measure_read_bandwidth(1, gib=1 / 64, repeats=2, clock=lambda: next(ticks)) == 2**24
    assert sums == [2**22] * 3  # the same bytes as float32


def test_a_roofline_cached_by_another_probe_is_not_reused(monkeypatch):
    monkeypatch.setattr(roofline, "_prefill_kernel", lambda: "f32")
    assert roofline._cache_key(2).endswith("|" + roofline.READ_PROBE)
