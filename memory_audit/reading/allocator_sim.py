"""Block sizes over time, from the trace, by following the caching allocator's rules.

Trace entries record the bytes a caller asked for; memory_allocated() counts the blocks that
served them, which are bigger: rounded up to 512 B, and in the large pool a block is split
only when more than 1 MiB would remain (c10/cuda/CUDACachingAllocator.cpp). Replaying the
segments and the splits gives each allocation's real block size, so the replayed peak equals
torch.cuda.max_memory_allocated() to the byte.

Allocations the trace cannot place (it began after they were made, or expandable segments
are on) fall back to the 512 B rounding.
"""

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB use the small pool


def round_size(nbytes):
    """The allocator's rounding of a request (default settings, no power-of-2 divisions)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((nbytes + MIN_BLOCK - 1) // MIN_BLOCK)


def should_split(block_size, rounded):
    remaining = block_size - rounded
    if rounded <= SMALL_SIZE:  # small pool: any whole 512 B left over is split off
        return remaining >= MIN_BLOCK
    return remaining > SMALL_SIZE


class BlockSim:
    """Free blocks per segment; alloc/free return the block size that memory_allocated counts."""

    def __init__(self):
        self.free = {}  # start -> size of free blocks
        self.free_by_end = {}  # end -> start
        self.segment_of = {}  # free/used block start -> segment start
        self.segments = {}  # segment start -> size
        self.used = {}  # start -> block size

    def _add_free(self, start, size, seg):
        self.free[start] = size
        self.free_by_end[start + size] = start
        self.segment_of[start] = seg

    def _take_free(self, start):
        size = self.free.pop(start)
        # (a trace whose blocks overlap can leave two free blocks ending at one address: the
        # later one's end was kept; as the compiled replay does, a missing end is no error)
        self.free_by_end.pop(start + size, None)
        return size

    def segment_alloc(self, addr, size):
        self.segments[addr] = size
        self._add_free(addr, size, addr)

    def segment_free(self, addr, size):
        self.segments.pop(addr, None)
        if addr in self.free and self.free[addr] == size:
            self._take_free(addr)
            self.segment_of.pop(addr, None)

    def alloc(self, addr, nbytes):
        rounded = round_size(nbytes)
        if addr not in self.free:
            self.used[addr] = rounded
            return rounded
        seg = self.segment_of[addr]
        size = self._take_free(addr)
        if size >= rounded and should_split(size, rounded):
            self._add_free(addr + rounded, size - rounded, seg)
            size = rounded
        self.used[addr] = size
        self.segment_of[addr] = seg
        return size

    def release(self, addr):
        """free_requested: the block leaves memory_allocated now; returns its size."""
        return self.used.get(addr)

    def complete(self, addr):
        """free_completed: the block returns to the pool and merges with free neighbours."""
        size = self.used.pop(addr, None)
        seg = self.segment_of.get(addr)
        if size is None or seg is None or seg not in self.segments:
            return
        start = addr
        prev = self.free_by_end.get(start)
        if prev is not None and self.segment_of.get(prev) == seg:
            size += self._take_free(prev)
            start = prev
        nxt = start + size
        if nxt in self.free and self.segment_of.get(nxt) == seg:
            size += self._take_free(nxt)
        self._add_free(start, size, seg)


# action codes of trace.ACTIONS, repeated here so that this module stays free of numpy
ALLOC, _FREE_REQUESTED, FREE_COMPLETED, FREE, SEG_ALLOC, _SEG_FREE, SEG_MAP, _SEG_UNMAP = range(1, 9)


def replay_blocks_py(act, addr, size, cpu):
    """The reference replay (the compiled one in _fastcore.c follows it line for line).

    Returns (block, pair), one value per entry: block is the bytes memory_allocated() gained
    (alloc) or lost (free_requested / free: the matched alloc's block, or the entry's size when
    the trace never saw the alloc); pair is, for an alloc, the entry that ended it (its free, or
    a later alloc at the same address while it was live) and, for a free, its alloc; -1 if none.
    """
    n = len(act)
    block, pair = [0] * n, [-1] * n
    sim, live = BlockSim(), {}
    for i in range(n):
        a, ad, sz = act[i], addr[i], size[i]
        if a == ALLOC:
            prev = live.get(ad)
            if prev is not None:
                pair[prev] = i
            block[i] = sz if cpu else sim.alloc(ad, sz)
            live[ad] = i
        elif a in (_FREE_REQUESTED, FREE):
            j = live.pop(ad, None)
            if j is None:
                block[i] = sz
            else:
                block[i], pair[i], pair[j] = block[j], j, i
            if a == FREE:
                sim.complete(ad)
        elif a == FREE_COMPLETED:
            sim.complete(ad)
        elif a in (SEG_ALLOC, SEG_MAP):
            sim.segment_alloc(ad, sz)
        elif a in (_SEG_FREE, _SEG_UNMAP):
            sim.segment_free(ad, sz)
    return block, pair
