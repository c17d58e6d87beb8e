"""A deep model's shadow from a shallow one's: a middle block's events repeated, not rerun (issue #26: speed).

GPT-2 XL runs 48 identical blocks; its shadow asked each op 48 times. Here the step is shadow-run
with 3 blocks and with 4, each allocation and event tagged with its block (shadow/blocks.block_tags:
the module a forward op runs in, the autograd node a backward op runs for, the parameter an
optimizer op works on). The 3-block run reads as runs of events: outside any block, block 0,
block 1, block 2. For n blocks, each run of block 1 (between runs of blocks 0 and 2, either way
round) is emitted for blocks 1..n-2 in that order, block 2's runs become block n-1's, and each
free lands on the copy of the allocation it frees in its own block or its neighbour's (block
0's residual freed by block 1's backward is block r-1's, freed by block r's). The keys are
renamed (h.1 -> h.r). Allocations outside every block keep their size, or, where it depends on
the depth (a foreach kernel's buffer over every tensor), grow by their 3-to-4 difference per
block.

The 4-block run checks the rule every time: the 3-block run expanded to 4 must equal it event
by event (action, key, bytes, which allocation). Anything else (a block's run not between its
neighbours, a free the rule cannot place, a mismatch with the 4-block run) returns None and the
caller runs every block. Checkpointing every k-th block (ac_every > 1) is not uniform: not
repeated.

Micro-steps (gradient accumulation) are the second channel, repeated the same way from runs with
3 and 4 of them (at each depth, before the blocks are): events tagged with the micro-step they
happen in, micro-step 1's runs emitted for 1..k-2, a free in one micro-step of what the previous
one made placed on the previous copy's, and a free in step 2 of what step 1 made (the last
micro-step's batch and loss) placed on step 1's first or last micro-step's. Keys carry no
micro-step, so none is renamed.
"""

import itertools
import re

_BLOCK = re.compile(r"((?:^|[./])h\.)(\d+)(?=[./]|$)")  # nanoGPT's transformer.h.N


def block_pattern(path):
    """The pattern of the block numbers in keys for blocks held at module path `path`
    (a user's model's list of equal blocks: shadow/depth)."""
    return re.compile(r"((?:^|[./])" + re.escape(path) + r"\.)(\d+)(?=[./]|$)")
SOURCE = (3, 4)  # the depths shadow-run
_SEP = "\x00"  # joins a run's key templates (no key holds it)


def repeatable(cfg):
    """Whether the step's blocks are alike and deep enough for repeating to save time. A rank of a
    torchrun strategy is run whole: the rule has not held for one (FSDP2's groups, DDP's buckets),
    and a repeated step keeps no streams."""
    uniform = cfg.get("activation_checkpointing", "none") == "none" or cfg.get("ac_every", 1) == 1
    return uniform and cfg["n_layer"] > sum(SOURCE) and cfg.get("parallel", "none") == "none"


def micro_repeatable(cfg):
    """Whether the step has micro-steps enough for repeating them to save time (one process)."""
    return cfg.get("gradient_accumulation_steps", 1) > sum(SOURCE) and cfg.get("parallel", "none") == "none"


CHANNELS = ("blocks", "micro")  # what a run's events are tagged with (step.run(..., blocks=True))


def expand(r3, r4, n, channel="blocks", carry=True, pattern=_BLOCK):
    """run()'s result for `n` blocks (channel "blocks") or micro-steps ("micro") from the
    results of 3 and 4 (run(..., blocks=True)), or None where the repeat rule does not hold
    (module docstring). carry: the other channel's tags are carried over, for a second expansion.
    pattern: the block numbers in keys (block_pattern)."""
    source = _Source(r3, channel, pattern)
    four = source.emit(4, {})
    if four is None:
        return None
    growth = _growth(four, r4, channel)
    if growth is None:
        return None
    out = source.emit(n, growth)
    if out is None:
        return None
    out = _result(source, *out, carry=carry)
    out["unmeasured"] = sorted(set(r3.get("unmeasured", ())) | set(r4.get("unmeasured", ())))  # both runs' calls
    return out


class _Source:
    """The 3-block (3-micro-step) run read once: its events, their runs by block, each
    allocation's block, first event and counterparts in the other blocks."""

    def __init__(self, r, channel, pattern=_BLOCK):
        self.r, self.channel, self.pattern = r, channel, pattern
        self.events = r["history"] + r["events"]
        self.start = len(r["history"])
        self.blocks = r[channel]["allocs"]
        self.marks = {phase: self.start + i for phase, i in r["phases"].items()}
        self.made = {e[3]: i for i, e in enumerate(self.events) if e[0] == "alloc"}  # id -> its alloc's index
        self.match = _Matcher(self.events, self.blocks, pattern if channel == "blocks" else None)
        self.runs = [(tag, len(list(g))) for tag, g in itertools.groupby(r[channel]["events"])]
        self.names = {}  # (allocation, block) -> its key there
        self.templates = {}  # allocation -> _template() of its key
        self.early = {aid: i < self.start for aid, i in self.made.items()} if channel == "micro" else None
        self.pre_names = {aid: name for aid, name, _ in r.get("pre", ())}  # what step 2's start names

    def _across(self, aid, i):
        """Event i frees (or makes) micro-step allocation `aid` in the other step than the one
        that made it: the previous step's own."""
        return self.early is not None and self.early[aid] != (i < self.start)

    def key(self, src, layer):
        k = (src, layer)
        if k not in self.names:
            key = self.events[self.made[src]][1]
            block = self.blocks.get(src)
            if self.channel != "blocks" or block is None or layer is None or block == layer:
                self.names[k] = key
            else:
                if src not in self.templates:
                    self.templates[src] = _template(key, block, self.pattern)
                fmt, offsets = self.templates[src]
                self.names[k] = fmt.format(*[layer + o for o in offsets])
        return self.names[k]

    def emit(self, n, growth):
        """(events [(action, key, bytes, id)], [(source id, source event) per event], phases
        {phase: index}) for n, or None. growth: {source id: bytes per block beyond 3}."""
        out, sources, ids, at, lo = [], [], {}, {}, 0
        extra = n - SOURCE[0]
        events, blocks, match, key = self.events, self.blocks, self.match, self.key
        nbytes = {src: events[i][2] + extra * growth.get(src, 0) for src, i in self.made.items()}
        across_of = self._across
        plans = {}  # a repeated run's first event -> _plan(): its inner blocks' rows, worked out once
        for k, (tag, size) in enumerate(self.runs):
            layers = _layers(tag, self.runs, k, n)
            if layers is None or any(tag == 1 and lo < i < lo + size for i in self.marks.values()):
                return None  # a run out of place, or a phase inside a repeated run
            for i in range(lo, lo + size):
                at[i] = len(out) + i - lo
            for real in layers:
                if tag == 1 and 2 <= real <= n - 3:  # an inner block: every neighbour a middle one too
                    if lo not in plans:
                        plans[lo] = self._plan(range(lo, lo + size), n, nbytes)
                    if not _inner(plans[lo], real, ids, out, sources):
                        return None
                    continue
                for i in range(lo, lo + size):
                    action, _, _, aid = events[i]
                    placed = _place(aid, blocks.get(aid), tag, real, n, match, across_of(aid, i))
                    if placed is None:
                        return None  # a free the rule cannot place
                    if action == "alloc":
                        if placed in ids:
                            return None  # an allocation made twice
                        new = ids[placed] = len(ids)
                    else:
                        new = ids.get(placed)
                        if new is None:
                            return None  # a free of what this step never made
                    out.append((action, key(*placed), nbytes[placed[0]], new))
                    sources.append((placed[0], i))
            lo += size
        at[len(events)] = len(out)
        return out, sources, {phase: at[i] for phase, i in self.marks.items()}

    def _plan(self, span, n, nbytes):
        """A run of block 1 standing for an inner block, worked out once: each event's placement
        as _place() gives it there, (source allocation, offset of its block) for what moves with
        the block (its own or a middle neighbour's counterpart), ((allocation, block), None) for
        what does not (a micro-step's allocation freed in the next step: step 1's first or last
        micro-step's); with the events' actions, bytes and sources. None where one cannot be
        placed."""
        moves = []
        for i in span:
            aid = self.events[i][3]
            # _place() at the inner block of the smallest step that has one (block 2 of 5): a
            # target of 1-3 moves with the block, one of 0 or 4 (the first or last block) stays
            placed = _place(aid, self.blocks.get(aid), 1, 2, 5, self.match, self._across(aid, i))
            if placed is None:
                return None
            src, target = placed
            moves.append(((src, 0 if target == 0 else n - 1), None) if target in (0, 4) else (src, target - 2))
        srcs = [p if d is not None else p[0] for p, d in moves]
        actions = [self.events[i][0] for i in span]
        plan = {"moves": moves, "actions": actions, "sizes": [nbytes[s] for s in srcs], "keys": None,
                "sources": list(zip(srcs, span)), "allocs": [j for j, a in enumerate(actions) if a == "alloc"]}
        if self.channel != "blocks":  # no micro-step in a key
            plan["keys"] = [self.events[self.made[s]][1] for s in srcs]
            return plan
        # the run's keys at any inner block in one format call: each event's template (_template),
        # its holes' offsets moved by its block's, joined by a character no key holds
        parts, offsets = [], []
        for p, d in moves:
            if d is None:  # a fixed placement: its key is fixed
                parts.append(self.key(*p).replace("{", "{{").replace("}", "}}"))
                continue
            if p not in self.templates:
                self.templates[p] = _template(self.events[self.made[p]][1], 1, self.pattern)
            fmt, holes = self.templates[p]
            parts.append(fmt)
            offsets += [d + o for o in holes]
        if any(_SEP in part for part in parts):
            return None
        plan["names"] = (_SEP.join(parts), offsets)
        return plan


def _inner(plan, real, ids, out, sources):
    """emit()'s rows for a planned run standing for inner block `real`, appended to out and
    sources; False where the rule fails. The run's allocations are numbered first, in order:
    in a source made of real events each allocation comes before its frees, so every free finds
    the id event-by-event numbering gives it, and one that finds none frees what was never made."""
    if plan is None:
        return False
    placed = [p if d is None else (p, real + d) for p, d in plan["moves"]]
    base = len(ids)
    ids.update((placed[j], base + k) for k, j in enumerate(plan["allocs"]))
    if len(ids) != base + len(plan["allocs"]):
        return False  # an allocation made twice
    try:
        new = [ids[p] for p in placed]
    except KeyError:
        return False  # a free of what this step never made
    keys = plan["keys"]
    if keys is None:
        fmt, offsets = plan["names"]
        keys = fmt.format(*[real + o for o in offsets]).split(_SEP)
    out.extend(zip(plan["actions"], keys, plan["sizes"], new))
    sources.extend(plan["sources"])
    return True


def _layers(tag, runs, k, n):
    """The blocks a run of the 3-block step stands for at n blocks, in order."""
    if tag is None:
        return [None]
    if tag != 1:
        return [0 if tag == 0 else n - 1]
    around = (runs[k - 1][0] if k else None, runs[k + 1][0] if k + 1 < len(runs) else None)
    if around == (0, 2):
        return list(range(1, n - 1))
    if around == (2, 0):
        return list(range(n - 2, 0, -1))
    return None


def _place(aid, block, tag, real, n, match, across=False):
    """(source allocation, block at n) of an event of allocation `aid` (of block `block`) in a
    run of block `tag` standing for block `real`: the same allocation, or its counterpart in
    the source block that stands for the target block. None where it cannot be placed."""
    if block is None:
        return None if tag == 1 else (aid, None)  # one allocation freed in every repeated block: no
    if tag is None:  # cannot happen (an event outside every block is of an allocation outside them)
        return None
    if across and block != tag:  # made in the other step: its first or last micro-step's
        target = {0: 0, 2: n - 1}.get(block)
        if target is None:
            return None
    else:
        target = real + (block - tag)  # its own block's, or a neighbour's
    if not 0 <= target < n:
        return None
    stands = 0 if target == 0 else 2 if target == n - 1 else 1
    src = aid if stands == block else match.counterpart(aid, block, stands)
    return None if src is None else (src, target)


class _Matcher:
    """The allocation of one block that plays the same part as another block's: the same key
    (block number aside) and bytes, the same ordinal among those."""

    def __init__(self, events, blocks, pattern=_BLOCK):
        """pattern: the block numbers in keys, read relative to the block (None: keys hold none)."""
        self.by_role, self.role = {}, {}
        for action, key, nbytes, aid in events:
            if action == "alloc" and blocks.get(aid) is not None:
                role = (_role(key, blocks[aid], pattern) if pattern else key, nbytes)
                group = self.by_role.setdefault((blocks[aid], role), [])
                self.role[aid] = (role, len(group))
                group.append(aid)

    def counterpart(self, aid, block, other):
        role, i = self.role[aid]
        group = self.by_role.get((other, role), [])
        return group[i] if i < len(group) else None


def _template(key, block, pattern=_BLOCK):
    """(format string, offsets) that rename block `block`'s key for any block `layer`:
    fmt.format(*[layer + o for o in offsets]), each block number in it moved by the same
    amount (a recomputation's first op carries the label the previous recomputation's early
    stop left: the next block's)."""
    offsets = []

    def hole(m):
        offsets.append(int(m.group(2)) - block)
        return m.group(1) + "{}"
    return pattern.sub(hole, key.replace("{", "{{").replace("}", "}}")), offsets


def _role(key, block, pattern=_BLOCK):
    """A key with its block numbers relative to `block`."""
    return pattern.sub(lambda m: f"{m.group(1)}{int(m.group(2)) - block:+d}", key)


def _growth(four, r4, channel="blocks"):
    """{source id: bytes per block} from the 3-block step expanded to 4 against the 4-block
    run; None unless they agree event by event but for the sizes of allocations outside every
    block."""
    events, sources, phases = four
    actual = r4["history"] + r4["events"]
    start = len(r4["history"])
    if len(events) != len(actual) or phases != {p: start + i for p, i in r4["phases"].items()}:
        return None
    growth, same = {}, {}
    for (action, key, nbytes, aid), (action4, key4, nbytes4, aid4), (src, _) in zip(events, actual, sources):
        if action != action4 or key != key4 or same.setdefault(aid, aid4) != aid4:
            return None
        if nbytes != nbytes4:
            if r4[channel]["allocs"].get(aid4) is not None:
                return None
            growth[src] = nbytes4 - nbytes
    return growth


def _renamed(source, name, src, key):
    """`name`, which the source run gave allocation `src`, for `key`, a copy of src: its block
    numbers moved as the key's are."""
    own = source.events[source.made[src]][1]
    if name is None or name == own:
        return key
    moved, was = source.pattern.search(key), source.pattern.search(own)
    if key == own or moved is None or was is None:
        return name if key == own else key
    shift = int(moved.group(2)) - int(was.group(2))
    return source.pattern.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + shift}", name)


NAMED = ("saved", "made", "end")  # a named run's {allocation: name} dicts (step.step_result)


def _result(source, events, sources, phases, carry=True):
    """step.run()'s dict from the expanded process: the history before step 2, its events,
    what is live when it starts, the phases, the peak, and (carry) the other channel's tags."""
    start = phases["step2_start"]
    history, step = events[:start], events[start:]
    live = {}
    for (action, key, nbytes, aid), (src, _) in zip(history, sources):
        if action == "alloc":
            live[aid] = (aid, _renamed(source, source.pre_names.get(src), src, key), nbytes)
        else:
            live.pop(aid, None)
    pre = list(live.values())
    start_bytes = sum(n for _, _, n in pre)
    peak = max(itertools.accumulate((nbytes if action == "alloc" else -nbytes for action, _, nbytes, _ in step),
                                    initial=0))
    out = {"events": step, "history": history, "pre": pre, "start_bytes": start_bytes,
           "phases": {p: i - start for p, i in phases.items()}, "peak": start_bytes + peak, "repeated": True}
    for named in NAMED:  # the audit's names of what the copies stand for
        if named in source.r:
            given = source.r[named]
            out[named] = {aid: _renamed(source, given[src], src, key) for (action, key, _, aid), (src, _) in
                          zip(events, sources) if action == "alloc" and src in given}
    for other in CHANNELS:
        if carry and other != source.channel and other in source.r:
            tags = source.r[other]
            out[other] = {"allocs": {aid: tags["allocs"].get(src) for (_, _, _, aid), (src, _) in zip(events, sources)},
                          "events": [tags["events"][i] for _, i in sources]}
    return out
