"""A user's deep model predicted from shallow runs of itself (issue #49: a model of billions of
parameters in seconds, on a GPU the machine does not have).

The script's model is built as written, but the first list of DEEP or more equal blocks made
while it runs (nn.ModuleList or nn.Sequential of modules alike: alike()) keeps its first 3
blocks in one shadow run of the whole script and its first 4 in a second, every allocation and
event tagged with its block (shadow/blocks.mark_blocks). shadow/repeat builds the step at the
model's own depth from the two, as it does for nanoGPT's blocks, the 4-block run checking the
rule event by event. Where nothing is cut the first run is the prediction itself; where the rule
does not hold (a block's run out of place, a size inside a block that depends on the depth, the
script failing with fewer blocks, the cut list not the trained model's) the script is run once
more with every block. What the script prints in a cut run is not shown (it would describe a
shallower model); the data-dependent reads and sizes listed are those of the 3-block run.
Not seen (the check passes, the step is wrong): code that treats blocks by index after building
them beyond block 3 (freezing the first 6, adapters on some, checkpointing every 4th block), and
memory outside the blocks growing faster than linearly with depth. Asked for, not by default
(`predict-script --repeat-blocks`): the script runs up to three times in one process.
Plain Python until a shadow run starts: torch is imported inside the functions.
"""

import contextlib
import io
import sys

from .blocks import mark_blocks
from .repeat import SOURCE, block_pattern, expand

DEEP = 12  # the fewest blocks cut: two shallow runs (3 and 4 blocks, the rest of the model twice)
# took about as long as the whole run of 10 blocks (scripts/depth_check.py's seconds, seed 121143)


def alike(modules):
    """Whether `modules` are blocks one step can repeat: modules of the same types all the way
    down, parameters and buffers of the same names, shapes, dtypes and requires_grad, and the same
    plain attributes (numbers, strings, dtypes, tuples of those; a tensor's shape; a container's
    length; any other object's type), save one that holds each block's own index (a layer_idx)."""
    import torch
    if not all(isinstance(m, torch.nn.Module) for m in modules) or len({id(m) for m in modules}) < len(modules):
        return False  # (one module repeated shares its weights: no block of its own to repeat)
    params = [{id(p) for p in m.parameters()} for m in modules]
    if len(set().union(*params)) < sum(map(len, params)):
        return False  # parameters shared between blocks
    rows = [_facts(m, torch) for m in modules]
    if any(len(r) != len(rows[0]) for r in rows):
        return False
    for column in zip(*rows):
        if any(c != column[0] for c in column) and not all(
                c[:-1] == column[0][:-1] and type(c[-1]) is int and c[-1] == i for i, c in enumerate(column)):
            return False
    return True


def _facts(module, torch):
    out = []
    for path, m in module.named_modules(remove_duplicate=False):
        out.append((path, "type", type(m)))
        for name, value in sorted(vars(m).items()):
            if name in ("_parameters", "_buffers", "_modules"):
                out += [(path, name, k, None if t is None else _plain(t, torch)) for k, t in value.items()]
            else:
                out.append((path, name, _plain(value, torch)))
    return out


def _plain(v, torch):
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_plain(x, torch) for x in v)
    if isinstance(v, torch.Tensor):
        return ("tensor", type(v), tuple(v.shape), v.dtype, v.requires_grad)
    if isinstance(v, (dict, set, frozenset)):
        return (type(v), len(v))
    return type(v)


class Cut:
    """One shadow run's cut (shadow/script.Shadow(depth=...)): the first list of DEEP or more
    alike blocks made while it runs keeps its first `depth`, watched by mark_blocks.
    n: the depth it had (None: nothing was cut); path: its module path in the trained model
    (place()), None where it is not the model's."""

    def __init__(self, depth, tracker):
        self.depth, self.tracker = depth, tracker
        self.n = self.kept = self.path = self.pattern = None
        self.handles, self.inner = [], False

    def take(self, modules):
        """patches.cut_lists' function: the modules a list is built from, cut or not. A list built
        later whose modules hold the cut one made it an inner list (an MoE block's experts): the
        cut stands for nothing the step repeats (place() then finds no path)."""
        if self.n is not None:
            kept = {id(b) for b in self.kept}  # (a slice of the cut list is the same blocks: no inner list)
            self.inner = self.inner or any(id(m) not in kept and any(s is self.kept[0] for s in m.modules())
                                           for m in modules if hasattr(m, "modules"))
            return modules
        if len(modules) < DEEP or not alike(modules):
            return modules
        self.n, self.kept = len(modules), modules[:self.depth]
        self.handles = mark_blocks(self.kept, self.tracker)
        self.tracker.tagging = True
        self.tracker.block_label = self.label
        return self.kept

    def place(self, model):
        """The model the loop trains is known: where the kept blocks sit in it."""
        if self.kept is None or self.inner:
            return
        names = {id(m): name for name, m in model.named_modules()}
        first = names.get(id(self.kept[0]), "")
        path = first.rpartition(".")[0]
        if path and all(names.get(id(b)) == f"{path}.{i}" for i, b in enumerate(self.kept)):
            self.path, self.pattern = path, block_pattern(path)

    def label(self, key):
        """The block a key or module path names, or None (Tracker.block_label)."""
        m = self.pattern.search(key) if self.pattern is not None else None
        return int(m.group(2)) if m else None

    def remove(self):
        for h in self.handles:
            h.remove()


def predicted(run):
    """The Shadow of a script's audited step at its model's own depth: run(depth) shadow-runs the
    whole script (with Shadow(depth=depth); None: every block) and returns the exited Shadow.
    The Shadow returned says how it was made in `depth_note`. See the module docstring."""
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        s3 = _tried(run, SOURCE[0])
    if s3 is not None and s3.cut.n is None:  # nothing cut: this run is the prediction
        sys.stdout.write(quiet.getvalue())
        s3.depth_note = f"no list of {DEEP} or more equal blocks"
        return s3
    why = "the script failed with 3 blocks"
    if s3 is not None:
        why = "the cut list is inside a deeper list's blocks" if s3.cut.inner else "the cut list is not the trained model's"
    if s3 is not None and s3.cut.path is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            s4 = _tried(run, SOURCE[1])
        why = "the 4-block run differs from the 3-block run's repeat"
        if s4 is None or (s4.cut.n, s4.cut.path) != (s3.cut.n, s3.cut.path):
            why = "the 4-block run failed or cut another list"
        else:
            result = expand(s3.result, s4.result, s3.cut.n, carry=False, pattern=s3.cut.pattern)
            if result is not None:
                s3.summarize(result, repeated=f"the {s3.cut.n} blocks of {s3.cut.path}, repeated from shadow runs "
                                              f"of {SOURCE[0]} and {SOURCE[1]}")
                s3.depth_note = "repeated"
                return s3
    whole = run(None)
    whole.depth_note = f"every block run: {why}"
    return whole


def _tried(run, depth):
    """run(depth), or None where the script fails with fewer blocks (run whole then)."""
    try:
        return run(depth)
    except Exception:  # noqa: BLE001 (any failure of a cut run: the whole run answers, or fails itself)
        return None
