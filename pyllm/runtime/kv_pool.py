"""KV memory as a pool of blocks (paged): sequences take fixed-size blocks of rows as they grow.

A ``BlockPool`` holds the keys and values of ``block_rows`` consecutive positions of every layer per block, in the
cache kind's own storage (float rows or llama.cpp q8_0 / q4_0 blocks, the rotated kinds included): per part,
one tensor [n_blocks, n_layer, n_kv_head, block_rows, row].  A sequence's ``BlockTable`` lists its blocks in
position order; position p is row p % block_rows of block table[p // block_rows].  ``PagedKVCache`` is the
KVCache interface over one table: the torch forward gathers rows through it, and the C++ steps read the table
itself (PartLayout.table, csrc/kernels.h KVPart), so a sequence's logits are bit for bit those of a contiguous
cache (tests/test_kv_pool.py).

Blocks are reference counted.  A sequence that starts with another's prompt shares that prefix's blocks
(``share_prefix``, ``fork``) instead of copying rows; the first write into a shared block copies it first (copy
on write), so no sequence ever sees another's later rows.  A finished or cancelled sequence gives its blocks back
(``trim``, ``release``); a block returns to the free list when its last holder lets go.

Memory.  The pool's tensors are allocated once, for its cap of ``n_blocks``, with ``torch.empty``: on the CPU
that reserves address space only, and the OS commits a block's pages when a sequence first writes it.  Free
blocks are handed out lowest id first, so the resident part is the high-water mark of blocks in use at once
(``reserved_bytes``), not the cap: ``serve --parallel 32 --ctx 8192`` costs what its sequences hold.  When every
block is taken, the next one asked for raises ``PoolFullError`` (memory stays bounded by the cap).

Admission.  By default a server's pool holds every slot's whole context, so it never runs out.  A smaller cap
(``serve --kv-pool-tokens N``, ``slot_caches(pool_tokens=)``) overcommits: the scheduler asks before it writes.
``blocks_to_write(pos, t)`` says how many blocks a cache's next write takes (new ones and copies of shared ones),
``free_blocks`` how many are left, and ``reserve`` takes a sequence's blocks up front (a prompt's, when it is
admitted), so a prompt being read never runs out halfway.  The engine (runtime/batch.py) admits a request only
when its blocks are free (it waits in the queue meanwhile), gives back idle slots' kept prompt rows first when
short, and preempts the most recently admitted running sequence when a running one cannot grow: the victim's
blocks are freed and it is re-read later from its prompt and its generated tokens, its output unchanged.

Per-sequence statistics of the block kinds (means, key scales, exact sink rows: kv_cache.py) are a few KiB and
stay with each cache; a shared prefix shares them by copy (they are fixed by the prefix's first chunk).
Gemma 3's sliding window changes nothing here: every position is kept (its global layers read them all), and the
window is applied by attention, which reads rows through the table like any other.
"""

from __future__ import annotations

import heapq
import json

import torch

from ..errors import PyllmError
from .kv_cache import KV_DTYPES, KVCache, PartLayout, cache_memory
from .kv_kinds import BLOCK_BYTES, QK, check_kind, split_kind
from .prompt_cache import PREFILL_CHUNK

# Positions per block: one prefill chunk, the unit of prompt reuse, so a shared prefix is whole blocks and never
# copied on write (a power of two: the C++ step finds a row with a shift and a mask).  Each (layer, head) then has
# 64 consecutive rows in a block (8 KiB of f16 rows of 64 values), runs the hardware prefetcher follows: with 16-row
# blocks (2 KiB runs) 4 sequences of SmolLM2 at 1000 cached tokens spent 13% more time in attention
# (docs/BENCHMARKS.md, "Decode attention").
BLOCK_ROWS = PREFILL_CHUNK


class PoolFullError(PyllmError):
    """Every block of the KV pool is in use."""


def _row_spec(kind: str, head_dim: int) -> tuple[torch.dtype, int]:
    """(dtype, entries per row) of one stored row of a part of ``kind``."""
    if kind in KV_DTYPES:
        return KV_DTYPES[kind], head_dim
    return torch.uint8, head_dim // QK * BLOCK_BYTES[kind]


class BlockPool:
    """``n_blocks`` blocks of ``block_rows`` positions of a cache of ``kind`` (every layer, keys and values)."""

    def __init__(self, kind: str, n_layer: int, n_kv_head: int, head_dim: int, n_blocks: int,
                 block_rows: int = BLOCK_ROWS, device: str | torch.device = "cpu"):
        check_kind(kind, head_dim)
        if block_rows < 1 or block_rows & (block_rows - 1):
            raise PyllmError(f"KV pool block size must be a power of two, got {block_rows}")
        if n_blocks < 1:
            raise PyllmError(f"KV pool needs at least one block, got {n_blocks}")
        self.kind, self.n_layer, self.n_kv_head, self.head_dim = kind, n_layer, n_kv_head, head_dim
        self.block_rows, self.n_blocks, self.device = block_rows, n_blocks, torch.device(device)
        self.k_kind, self.v_kind = split_kind(kind)
        self.data = []  # per part (keys, values): [n_blocks, n_layer, Hkv, block_rows, row], committed as written
        for part_kind in (self.k_kind, self.v_kind):
            dtype, row = _row_spec(part_kind, head_dim)
            self.data.append(cache_memory((n_blocks, n_layer, n_kv_head, block_rows, row), dtype, device,
                                          zero=False))
        self.block_bytes = sum(d[0].numel() * d.element_size() for d in self.data)
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks))  # a heap: the lowest free id first keeps the touched blocks compact
        self.high_water = 0  # blocks 0..high_water-1 have been handed out at some time

    # ---- accounting -----------------------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the blocks handed out so far (the most in use at once): what the pool has made resident."""
        return self.high_water * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of every block: the bound on the pool's memory."""
        return self.n_blocks * self.block_bytes

    # ---- blocks ---------------------------------------------------------------------------------------------
    def take(self) -> int:
        """A free block, now held once; PoolFullError when none is left."""
        if not self._free:
            raise PoolFullError(f"the KV cache pool is full: all {self.n_blocks} blocks of {self.block_rows} "
                                f"positions are in use")
        b = heapq.heappop(self._free)
        self.refs[b] = 1
        self.high_water = max(self.high_water, b + 1)
        return b

    def hold(self, b: int) -> None:
        """One more holder of block ``b`` (a shared prefix)."""
        if self.refs[b] < 1:
            raise RuntimeError(f"KV pool block {b} is free; only a held block can be shared")
        self.refs[b] += 1

    def release(self, b: int) -> None:
        """One holder less; the block is free again when none is left."""
        if self.refs[b] < 1:
            raise RuntimeError(f"KV pool block {b} is released more often than it was taken")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            heapq.heappush(self._free, b)

    def blocks_for(self, n: int) -> int:
        """Blocks that hold ``n`` positions."""
        return -(-n // self.block_rows)

    def copy(self, b: int) -> int:
        """A new block holding block ``b``'s rows (copy on write)."""
        nb = self.take()
        for d in self.data:
            d[nb].copy_(d[b])
        return nb

    def table(self, max_seq: int) -> "BlockTable":
        return BlockTable(self, max_seq)

    def cache(self, max_seq: int) -> "PagedKVCache":
        """A KV cache of up to ``max_seq`` positions over this pool (no block taken yet)."""
        return PagedKVCache(self, max_seq)


class BlockTable:
    """One sequence's blocks in position order; ``table`` is the int32 copy the C++ steps read (entries past the
    sequence's blocks are 0, never read: a step touches positions it was given room for)."""

    def __init__(self, pool: BlockPool, max_seq: int):
        self.pool = pool
        self.max_blocks = -(-max_seq // pool.block_rows)
        self.blocks: list[int] = []
        self.table = torch.zeros(self.max_blocks, dtype=torch.int32)

    @property
    def rows(self) -> int:
        """Positions the sequence's blocks can hold."""
        return len(self.blocks) * self.pool.block_rows

    def _set(self, i: int, b: int) -> None:
        if i == len(self.blocks):
            self.blocks.append(b)
        else:
            self.blocks[i] = b
        self.table[i] = b

    def ensure(self, upto: int) -> None:
        """Blocks for positions 0..upto-1 (PoolFullError, the blocks taken so far kept, when the pool runs out)."""
        n = -(-upto // self.pool.block_rows)
        if n > self.max_blocks:
            raise PyllmError(f"KV cache holds {self.max_blocks * self.pool.block_rows} positions; cannot grow to "
                             f"{upto}")
        while len(self.blocks) < n:
            self._set(len(self.blocks), self.pool.take())

    def writable(self, pos: int, upto: int) -> None:
        """Makes the blocks of positions pos..upto-1 this sequence's own, copying each that is shared."""
        B = self.pool.block_rows
        for i in range(pos // B, min(-(-upto // B), len(self.blocks))):
            b = self.blocks[i]
            if self.pool.refs[b] > 1:
                nb = self.pool.copy(b)
                self.pool.release(b)
                self._set(i, nb)

    def trim(self, n: int) -> None:
        """Gives back the blocks wholly past position n."""
        keep = -(-n // self.pool.block_rows)
        while len(self.blocks) > keep:
            self.pool.release(self.blocks.pop())
            self.table[len(self.blocks)] = 0

    def share_prefix(self, src: "BlockTable", n: int) -> None:
        """This sequence's positions 0..n-1 become ``src``'s, by reference (its own blocks are given back)."""
        if src.pool is not self.pool:
            raise ValueError("block tables of different pools cannot share blocks")
        keep = min(-(-n // self.pool.block_rows), len(src.blocks))
        shared = src.blocks[:keep]
        for b in shared:  # hold first: src and self may hold the same blocks already
            self.pool.hold(b)
        self.trim(0)
        for i, b in enumerate(shared):
            self._set(i, b)

    def fork(self) -> "BlockTable":
        """A new sequence holding every block of this one (copy on write from here on)."""
        t = BlockTable(self.pool, self.max_blocks * self.pool.block_rows)
        for i, b in enumerate(self.blocks):
            self.pool.hold(b)
            t._set(i, b)
        return t

    def locate(self, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, rows within the block) of positions pos..pos+n-1, int64 [n] each."""
        p = torch.arange(pos, pos + n)
        B = self.pool.block_rows
        return self.table[p // B].long(), p % B


class _PagedRows:
    """A part's rows in the pool, through a block table (kv_cache._Rows' interface)."""

    def __init__(self, data: torch.Tensor, seq: BlockTable):
        self.data, self.seq = data, seq
        self.buffers: list[torch.Tensor] = []  # the rows belong to the pool, not to the cache's own state

    def put(self, layer: int, pos: int, x: torch.Tensor) -> None:
        blk, off = self.seq.locate(pos, x.shape[1])
        self.data[:, layer][blk, :, off] = x.transpose(0, 1)

    def get(self, layer: int, upto: int) -> torch.Tensor:
        blk, off = self.seq.locate(0, upto)
        return self.data[:, layer][blk, :, off].transpose(0, 1).contiguous()  # [upto, Hkv, row] -> [Hkv, upto, row]

    def gather(self, n: int) -> torch.Tensor:
        """Positions 0..n-1 of every layer as a contiguous cache holds them: [n_layer, Hkv, n, row]."""
        blk, off = self.seq.locate(0, n)
        return self.data[blk, :, :, off].permute(1, 2, 0, 3).contiguous()

    def scatter(self, rows: torch.Tensor, n: int) -> None:
        """Positions 0..n-1 from ``rows`` [n_layer, Hkv, >= n, row]."""
        blk, off = self.seq.locate(0, n)
        self.data[blk, :, :, off] = rows[:, :, :n].permute(2, 0, 1, 3).to(self.data.dtype)

    def layout(self, lay: PartLayout) -> PartLayout:
        return lay._replace(table=self.seq.table, block_rows=self.seq.pool.block_rows)


class PagedKVCache(KVCache):
    """The KVCache interface over a block table of ``pool`` (see the module docstring).  ``check_room(pos, t)``,
    which every writer calls first, also takes the blocks for those positions and copies the shared ones among
    them, so the C++ steps find their rows in place."""

    def __init__(self, pool: BlockPool, max_seq: int, _seq: BlockTable | None = None):
        self.pool = pool
        self.seq = _seq if _seq is not None else BlockTable(pool, max_seq)
        super().__init__(pool.n_layer, pool.n_kv_head, max_seq, pool.head_dim, pool.kind, pool.device)
        self.k = self.v = None  # no tensor of this cache's own holds its rows

    def _part_rows(self, index: int):
        return _PagedRows(self.pool.data[index], self.seq)

    @property
    def nbytes(self) -> int:
        """Bytes of this sequence's blocks (shared ones counted in full) and its statistics."""
        own = sum(t.numel() * t.element_size() for p in self.parts for t in p.buffers)
        return len(self.seq.blocks) * self.pool.block_bytes + own

    def check_room(self, pos: int, t: int) -> None:
        super().check_room(pos, t)
        self.seq.ensure(pos + t)
        self.seq.writable(pos, pos + t)

    def blocks_to_write(self, pos: int, t: int) -> int:
        """Blocks that check_room(pos, t) takes from the pool: those past this sequence's last block, and a copy of
        each shared block among positions pos..pos+t-1."""
        seq, B = self.seq, self.pool.block_rows
        end = -(-(pos + t) // B)
        shared = sum(1 for b in seq.blocks[pos // B:end] if self.pool.refs[b] > 1)
        return max(0, end - len(seq.blocks)) + shared

    def reserve(self, pos: int, t: int) -> bool:
        """Takes the blocks for writing positions pos..pos+t-1 now (check_room's), when the pool has them all;
        False, taking none, when it does not."""
        if self.blocks_to_write(pos, t) > self.pool.free_blocks:
            return False
        self.check_room(pos, t)
        return True

    def trim(self, n: int) -> None:
        self.seq.trim(n)

    def release(self) -> None:
        """Gives every block back (the sequence finished or was cancelled)."""
        self.seq.trim(0)

    def fork(self) -> "PagedKVCache":
        """A second sequence with this one's rows and statistics, its blocks shared (n > 1 choices)."""
        other = PagedKVCache(self.pool, self.max_seq, _seq=self.seq.fork())
        other._copy_stats(self)
        return other

    # ---- prefix state: the same names, shapes and bytes as a contiguous cache's ---------------------------------
    def _stats(self):
        """(name, tensor) of the statistics, named as KVCache._buffers names them."""
        for i, part in enumerate(self.parts):
            for j, b in enumerate(part.buffers, start=1):
                yield f"p{i}b{j}", b

    def _buffers(self):
        raise NotImplementedError("a paged cache's rows live in its pool: use prefix_state / load_prefix_state")

    def state_layout(self) -> str:
        shapes = []
        for part in self.parts:
            shapes.append([self.n_layer, self.n_kv_head, part.rows.data.shape[-1]])
            shapes += [list(b.shape) for b in part.buffers]
        return json.dumps({"kind": self.kind, "shapes": shapes})

    def prefix_state(self, n: int) -> dict[str, torch.Tensor]:
        out = {f"p{i}b0": part.rows.gather(n) for i, part in enumerate(self.parts)}
        out.update((name, b.clone()) for name, b in self._stats())
        return out

    def load_prefix_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        for i, part in enumerate(self.parts):
            src, d = state.get(f"p{i}b0"), part.rows.data
            want = [self.n_layer, self.n_kv_head, f">={n}", d.shape[-1]]
            if src is None:
                raise ValueError(f"tensor p{i}b0 is missing")
            if (src.dim() != 4 or list(src.shape[:2]) != want[:2] or src.shape[2] < n or src.shape[3] != d.shape[-1]
                    or src.dtype != d.dtype):
                raise ValueError(f"tensor p{i}b0 has shape {list(src.shape)} {src.dtype}, expected {want} {d.dtype}")
        for name, b in self._stats():
            src = state.get(name)
            if src is None:
                raise ValueError(f"tensor {name} is missing")
            if src.shape != b.shape or src.dtype != b.dtype:
                raise ValueError(f"tensor {name} has shape {list(src.shape)} {src.dtype}, expected {list(b.shape)} "
                                 f"{b.dtype}")
        self.check_room(0, n)
        for i, part in enumerate(self.parts):
            part.rows.scatter(state[f"p{i}b0"], n)
        for name, b in self._stats():
            b.copy_(state[name])
        if self.centered:
            self.mu_set = [True] * self.n_layer

    def _copy_stats(self, src: "PagedKVCache") -> None:
        for (_, d), (_, b) in zip(self._stats(), src._stats()):
            d.copy_(b)
        self.mu_set = list(src.mu_set)

    def copy_prefix_from(self, src: KVCache, n: int) -> None:
        """Positions 0..n-1 and the statistics of ``src``: its blocks shared when it is a cache of the same pool,
        else its rows copied in."""
        if isinstance(src, PagedKVCache) and src.pool is self.pool:
            self.seq.share_prefix(src.seq, n)
            self._copy_stats(src)
        else:
            self.load_prefix_state(src.prefix_state(n), n)


def slot_caches(backend, kind: str, n_layer: int, n_kv_head: int, head_dim: int, n_ctx: int,
                n_slots: int, block_rows: int = BLOCK_ROWS, pool_tokens: int | None = None) -> list[KVCache]:
    """``n_slots`` KV caches of ``n_ctx`` positions for one server: paged over one BlockPool where the backend
    offers pools (``make_kv_pool``), else a contiguous cache each.  The pool holds ``pool_tokens`` positions
    (rounded up to whole blocks; None: every slot's whole context), at least one whole context: a sequence alone
    must be able to reach n_ctx."""
    if pool_tokens is not None and pool_tokens < n_ctx:
        raise PyllmError(f"a KV pool of {pool_tokens} tokens cannot hold one context of {n_ctx}; give at least "
                         f"--ctx tokens (--kv-pool-tokens)")
    make_pool = getattr(backend, "make_kv_pool", None)
    if make_pool is None:
        return [backend.make_kv_cache(kind, n_layer, n_kv_head, n_ctx, head_dim) for _ in range(n_slots)]
    whole = n_slots * -(-n_ctx // block_rows)
    n_blocks = whole if pool_tokens is None else min(whole, -(-pool_tokens // block_rows))
    pool = make_pool(kind, n_layer, n_kv_head, head_dim, n_blocks, block_rows)
    return [pool.cache(n_ctx) for _ in range(n_slots)]
