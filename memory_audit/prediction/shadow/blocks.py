"""Where a shadow run's op runs: the module (module_labels: tracker.label, the innermost module
path, which names what the op makes) and the transformer block (block_tags, op_block: each
allocation and event tagged with its block transformer.h.N, so shadow/repeat can repeat a deep
step's equal blocks; mark_blocks: the same for any model's list of equal blocks).
Plain Python until a shadow run starts: torch is imported inside the functions.
"""

import re


def module_labels(model, tracker, root="gpt"):
    """Forward pre/post hooks that keep tracker.label at the innermost module path (`root` for
    the model's own forward)."""
    stack, handles = [], []
    for name, mod in model.named_modules():
        def pre(_m, _a, name=name):
            stack.append(tracker.label)
            tracker.label = name or root

        def post(_m, _a, _o):
            tracker.label = stack.pop() if stack else ""
        handles.append(mod.register_forward_pre_hook(pre))
        # always_call: a checkpoint's recomputation stops early by raising inside a forward
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


def op_block(tracker, args):
    """The block (transformer.h.N) an op belongs to, for shadow/repeat: in backward (a
    recomputation included) the autograd node's (block_tags); in a forward the module it runs
    in; in the optimizer its tensors' block if they share one. None outside any block."""
    import torch
    if tracker.phase == "backward":  # a recomputation's early stop leaves the module label stale
        node = torch._C._current_autograd_node()
        return None if node is None else node.metadata.get(_BLOCK)
    if tracker.in_block:  # a forward inside a block the hooks of mark_blocks watch
        return tracker.in_block[-1]
    if tracker.label:
        return tracker.block_label(tracker.label)
    if tracker.phase != "optimizer":
        return None
    found = None
    for a in args:
        if isinstance(a, torch.Tensor):
            tag = tracker.tag_of(a)
            if tag is not None:
                if found is not None and tag != found:
                    return None
                found = tag
    return found


def foreach_blocks(tracker, func, args, n):
    """[block or None] per output: a _foreach_ op's i-th output is its first list's i-th tensor's."""
    if not tracker.tagging or not func.__name__.startswith("_foreach_") or n < 2:
        return [None] * n
    first = args[0]
    if not isinstance(first, (list, tuple)) or len(first) != n:
        return [None] * n
    return [tracker.tag_of(t) for t in first]


_BLOCK = "shadow_block"  # the autograd node metadata key block_tags sets
_LABEL_BLOCKS = {}  # module path -> block number or None


def label_block(label):
    if label not in _LABEL_BLOCKS:
        m = re.search(r"(?:^|[./])h\.(\d+)(?:[./]|$)", label)
        _LABEL_BLOCKS[label] = int(m.group(1)) if m else None
    return _LABEL_BLOCKS[label]


def block_tags(model, tracker):
    """Tag the parameters and buffers of each block transformer.h.N with N, and, as each
    block's forward returns, the autograd nodes it made (walked from its output back to its
    input's node), so the backward's ops know their block. Returns the hook handles."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        entry = tracker.live.get(t.untyped_storage()._cdata)
        if entry is not None:
            tracker.tags[entry[0]] = label_block(name)
    handles = []
    for name, mod in model.named_modules():
        n = label_block(name)
        if n is None or not re.search(r"(?:^|\.)h\.\d+$", name):
            continue

        def pre(_m, args):
            node = getattr(args[0], "grad_fn", None) if args else None
            if node is not None:
                node.metadata.setdefault(_BLOCK, None)  # where the walk stops

        def post(_m, _a, out, n=n):
            _tag_nodes([getattr(out, "grad_fn", None)], n)
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def mark_blocks(blocks, tracker):
    """block_tags for any model's list of equal blocks (shadow/depth): as block N's forward
    runs, tracker.in_block names it (op_block), its parameters and buffers are tagged N, and the
    autograd nodes it made are tagged as it returns (walked from its outputs back to the nodes
    of its inputs, positional or keyword). Returns the hook handles."""
    import torch
    from torch.utils._pytree import tree_leaves
    handles = []
    for n, block in enumerate(blocks):
        def pre(mod, args, kwargs, n=n):
            for t in list(mod.parameters()) + list(mod.buffers()):
                entry = tracker.live.get(t.untyped_storage()._cdata)
                if entry is not None:
                    tracker.tags[entry[0]] = n
            for t in tree_leaves((args, kwargs)):
                node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
                if node is not None:
                    node.metadata.setdefault(_BLOCK, None)  # where the walk stops
            tracker.in_block.append(n)

        def post(_m, _a, _k, out=None, n=n):  # out: None where the forward raised (always_call)
            tracker.in_block.pop()
            _tag_nodes([getattr(t, "grad_fn", None) for t in tree_leaves(out) if isinstance(t, torch.Tensor)], n)
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def _tag_nodes(todo, n):
    """Tag block n on the autograd nodes reachable from `todo` (None entries skipped), stopping at
    nodes already tagged (an earlier block's, or a block input's None)."""
    while todo:
        node = todo.pop()
        if node is None or _BLOCK in node.metadata:
            continue
        node.metadata[_BLOCK] = n
        todo.extend(f for f, _ in node.next_functions)
