"""The roofline's read probe reads memory laid out as the decode step's streams are (pyllm/roofline.py).

A probe on 4 KiB pages pays a TLB miss per page that the weights' copies and KV caches, asked onto huge pages, do
not: it read 23 GB/s where the decode GEMVs read 28-29 (a Xeon VM, 2 threads), and every bench row showed more than
100% of the bandwidth.  Reference: the advice the runtime's own buffers get (ops.advise_huge_pages), asked before
the first write, over the whole probe buffer.
"""

from __future__ import annotations

import torch

from pyllm import ops, roofline


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


def test_the_read_probe_measures_a_rate_on_one_and_two_threads():
    for threads in (1, 2):
        rate = roofline.measure_read_bandwidth(threads, gib=1 / 64, repeats=2)
        assert 1e8 < rate < 1e13, f"{threads} threads: {rate} B/s"


def test_a_roofline_cached_by_another_probe_is_not_reused(monkeypatch):
    monkeypatch.setattr(roofline, "_prefill_kernel", lambda: "f32")
    assert roofline._cache_key(2).endswith("|" + roofline.READ_PROBE)
