"""OpenMP worker threads do not outlive the call that started them.

libgomp keeps a pool of worker threads for every thread that has opened a parallel region, and once the pools'
threads outnumber the CPUs it cuts every barrier's spin-wait to ~100 iterations, so a decode step's ~200 regions
each put the workers to sleep and wake them (csrc/kernels.h cpu_release_thread_pool).  A model loaded on one thread
and run on another (the server's engine thread, a web framework's worker pool) then decoded at about half speed.
Speed is a benchmark's business (tools/load_test.py); what is tested here is the cause: after ``pyllm.load`` and
after each library generation, the calling thread holds no OpenMP workers.

Reference: the process's thread count from /proc/self/task (Linux), before and after, with the threads that this
test starts itself (an idle executor's) counted in both.
"""

import concurrent.futures
import os
import threading
import time

import pytest

import pyllm
from pyllm import ops

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(expected: int, timeout: float = 5.0) -> int:
    """The thread count once it is down to ``expected`` (released workers exit asynchronously), or the last one read
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    n = _threads()
    while n > expected and time.monotonic() < deadline:
        time.sleep(0.01)
        n = _threads()
    return n


@pytest.fixture(scope="module")
def llm(smollm2_path):
    pyllm._ext.load()  # a build that fails is a failure here, not a skip
    llm = pyllm.load(smollm2_path, n_ctx=256, n_threads=2)
    yield llm
    llm.close()


def test_the_extension_releases_a_thread_pool():
    """The binding returns True where the runtime has omp_pause_resource_all (libgomp and libomp since OpenMP 5.0,
    every runtime torch ships), and a kernel called afterwards starts new workers and gives the same result."""
    import torch

    ops.set_num_threads(2)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    buf = (x * 100).to(torch.uint8)
    before = ops._C.read_sum(buf, 2)
    assert ops._C.release_thread_pool() is True
    assert ops._C.read_sum(buf, 2) == before


def test_generations_on_pool_threads_leave_no_workers(llm):
    """Three live executor threads each generate: none keeps OpenMP workers once its call returns (without the
    release each kept one per extra kernel thread: the count grew by 3)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        barrier = threading.Barrier(3)
        list(pool.map(lambda _: barrier.wait(), range(3)))  # all three executor threads exist now
        base = _threads()

        def generate(i):
            barrier.wait()  # each call on its own executor thread
            return llm.generate(f"Count to {i + 3}:", max_tokens=8, temperature=0)

        outs = list(pool.map(generate, range(3)))
        assert all(isinstance(o, str) for o in outs)
        assert _settles_at(base) <= base


def test_batch_calls_on_pool_threads_leave_no_workers(llm):
    """generate_batch steps its own engine in the calling thread: that thread keeps no workers afterwards either."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        barrier = threading.Barrier(2)
        list(pool.map(lambda _: barrier.wait(), range(2)))
        base = _threads()

        def generate(i):
            barrier.wait()
            return llm.generate_batch([f"Count to {i + 3}:", "Name a river."], max_tokens=6, temperature=0)

        assert all(len(o) == 2 for o in pool.map(generate, range(2)))
        assert _settles_at(base) <= base


def test_load_leaves_no_workers_on_the_loading_thread(smollm2_path):
    """A live thread that loads a model (its weights interleaved and checked in parallel regions) keeps no workers
    (the server loads on its main thread and decodes on the engine's)."""
    pyllm._ext.load()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(lambda: None).result()
        base = _threads()
        other = pool.submit(pyllm.load, smollm2_path, n_ctx=128, n_threads=2).result()
        try:
            assert _settles_at(base) <= base
        finally:
            other.close()
