"""The CUDA caching allocator's model: given requests in order, the blocks and segments it makes.

The allocator rounds every request up to 512 B, carves requests of at most 1 MiB out of 2 MiB
segments, requests under 10 MiB out of 20 MiB segments and larger ones out of a segment rounded
up to 2 MiB; it serves a request from the smallest cached free block of the request's pool that
fits and splits that block only if more than 1 MiB would remain (512 B in the small pool). So a
block can hold up to 1 MiB nobody asked for, and which blocks do depends on what was freed before.
With expandable_segments:True each pool is one segment that grows by pages. Each stream has
pools of its own (shadow/replay keeps one model per stream).

The model is the replay's own block bookkeeping (allocator_sim.BlockSim), which the byte-exact
replay of a trace uses unchanged: the trace says which address each allocation got; here the
best-fit choice and the new segments are made instead. _fastcore.model is the same model in C
(test_fastcore). Plain Python: no torch.
"""

import bisect

from .allocator_sim import SMALL_SIZE as MiB, BlockSim, round_size
from .allocator_sim import ALLOC, FREE, FREE_COMPLETED, SEG_ALLOC, SEG_MAP


def segment_size(rounded):
    """cudaMalloc size for a request that no cached block can serve."""
    if rounded <= MiB:
        return 2 * MiB
    if rounded < 10 * MiB:
        return 20 * MiB
    return 2 * MiB * ((rounded + 2 * MiB - 1) // (2 * MiB))


# expandable_segments:True maps one growing segment per pool, in pages of these sizes
EXPANDABLE_PAGE = {True: 2 * MiB, False: 20 * MiB}  # small pool? -> page bytes


class CachingAllocatorModel(BlockSim):
    """The replay's block bookkeeping (allocator_sim.BlockSim: free blocks per segment, the split
    rule, merging on free) with the choices the replay reads from a trace made here instead:
    the smallest cached free block of the request's pool that fits, else a new segment
    (`segment_size`), or with `expandable` the pool's one segment grown at its end by pages."""

    def __init__(self, expandable=False):
        super().__init__()
        self.by_size = {True: [], False: []}  # small pool? -> sorted [(size, start)] of free blocks
        self.pool_of = {}  # segment start -> small pool?
        self.next_segment = 1 << 60  # the next segment ends here (they go down)
        self.reserved = 0  # bytes of all segments (cudaMalloc'd, never released in a step)
        self.expandable = expandable
        self.grown = {}  # expandable: small pool? -> its segment's start

    def _add_free(self, start, size, seg):
        super()._add_free(start, size, seg)
        bisect.insort(self.by_size[self.pool_of[seg]], (size, start))

    def _take_free(self, start):
        pool = self.by_size[self.pool_of[self.segment_of[start]]]
        del pool[bisect.bisect_left(pool, (self.free[start], start))]
        return super()._take_free(start)

    def _new_segment(self, small, size):
        # each below the last, never touching (no merging across segments): the address breaks
        # best fit's ties, and cudaMalloc hands out lower addresses as it goes (73 of 85 large
        # segments of a GPT-2 run on an H200; the small pool's 2 MiB ones go either way). Made
        # upwards, the model missed 7 of 11 GPT-2-sized H200 peaks by up to 8.65 MB fed the runs'
        # own requests; downwards none (and 1 of 91 tiny runs' reserved either way)
        self.next_segment -= size + (1 << 30)
        seg = self.next_segment
        self.pool_of[seg] = small
        self.segment_alloc(seg, size)
        self.reserved += size
        return seg

    def _grow(self, small, rounded):
        """Map pages at the end of the pool's segment (joining its free tail); returns the start."""
        if small not in self.grown:
            self.next_segment -= 1 << 44  # room above it to grow into
            self.grown[small] = self._new_segment(small, 0)
        seg = self.grown[small]
        end = seg + self.segments[seg]
        tail = self.free_by_end.get(end)
        start, have = (tail, self._take_free(tail)) if tail is not None else (end, 0)
        page = EXPANDABLE_PAGE[small]
        pages = -(-(rounded - have) // page) * page
        self.segments[seg] += pages
        self.reserved += pages
        self._add_free(start, have + pages, seg)
        return start

    def alloc(self, nbytes):
        """Returns (address, bytes in the block beyond the 512 B rounding)."""
        rounded = round_size(nbytes)
        small = rounded <= MiB
        pool = self.by_size[small]
        i = bisect.bisect_left(pool, (rounded, -1))
        if i < len(pool):
            start = pool[i][1]
        elif self.expandable:
            start = self._grow(small, rounded)
        else:
            start = self._new_segment(small, segment_size(rounded))
        return start, super().alloc(start, nbytes) - rounded

    def release(self, addr):
        self.complete(addr)


def replay_requests(act, addr, size, expandable=False, stream=None):
    """The allocator model fed a real trace's requests in their order (the sizes asked for and
    when each block came back), choosing blocks and segments itself, a pool per stream (`stream`:
    each entry's, as the trace records it; None: one stream). For a trace that starts with the
    process (an audit records from before the model exists) the segments it makes should be the
    ones the snapshot shows: where they are, the allocator rules are right and a reserved-memory
    miss lies in the predicted history (which tensors, in which order), not in the rules.
    Returns {"reserved": bytes of the model's segments, "segments": their sizes,
    "trace_reserved": bytes of the trace's own segment_alloc/map entries, "trace_segments"}."""
    models, placed, real = {}, {}, []
    streams = [0] * len(act) if stream is None else stream
    for a, ad, sz, st in zip(act, addr, size, streams):
        a, ad, sz, st = int(a), int(ad), int(sz), int(st)
        if a == ALLOC:
            model = models.setdefault(st, CachingAllocatorModel(expandable))
            placed[ad] = (model, model.alloc(sz)[0])
        elif a in (FREE_COMPLETED, FREE) and ad in placed:
            model, at = placed.pop(ad)
            model.release(at)
        elif a in (SEG_ALLOC, SEG_MAP):
            real.append(sz)
    return {"reserved": sum(m.reserved for m in models.values()),
            "segments": sorted(n for m in models.values() for n in m.segments.values()),
            "trace_reserved": sum(real), "trace_segments": sorted(real)}
