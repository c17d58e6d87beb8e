"""Autograd's gradient sums and a backward formula's zeros: what a real backward does in place
that the shadow's fake tensors make it do out of place, and the adds it must leave alone.

FunctionsManual's formulas and the engine's InputBuffer test `isTensorSubclassLike` (true for a
fake tensor, and for any tensor while a dispatch mode runs) and take another branch: a gradient
sum `old + new` where a real run adds in place, a formula's `zeros.scatter_add(...)` where a real
run fills the zeros in place. The tracker folds such an op's output into the operand a real run
writes (the operand's allocation stands for both); these rules say which ops, and which adds are
a formula's own out-of-place sum that a real run keeps too. after_op is the tracker's call after
every op; note_node before each op of a backward. Plain Python until called.
"""

import math


def after_op(tracker, func, args, out, on_shards):
    """The folds this op's output may take (read by the tracker's next op, before_op)."""
    import torch
    # autograd steals only a gradient with storage of its own: a DTensor's sum, run on
    # its shards, is out of place (measured under tp: the tied embedding's gradients)
    if (func is torch.ops.aten.add.Tensor and not on_shards and (_summing(tracker) or tracker.adds_in_place)
            and not _formula_add(tracker, args)):
        _note_accumulate(tracker, args, out)
    # indexing's backward, zeros.index_put_(indices, grad, accumulate=True) in a real run, is
    # out of place for a tensor subclass (FunctionsManual's index_backward): the output
    # takes the zeros' memory as they die (a routed MoE's weight[idx] in bf16: 400 B more
    # live per expert; scripts/zoo_check.py seed 418482)
    if func is torch.ops.aten.index_put.default and _summing(tracker) and len(args) > 3 and args[3]:
        _note_accumulate(tracker, args, out)
    elif (_summing(tracker) and str(func.overloadpacket).split(".")[-1] in SCATTERED_BACKWARD
          and _made_by(tracker, args[0], ZEROS)):
        _note_folded(tracker, args[0], out)


# Backward formulas that fill a new zeros tensor in place in a real run (a gather's backward:
# zeros.scatter_add_(dim, index, grad); index_select's: index_add_; take's: put_; a max, topk or
# sort's: scatter_; masked_select's: masked_scatter_; trace's: index_fill_) and out of place for a
# tensor subclass, as the shadow's fake tensors are (FunctionsManual's areAnyTensorSubclassLike):
# the output takes the zeros' memory as they die (scripts/op_loops.py: gather +192 B, index_select
# +92, topk +992, trace +100 without it). Only over zeros made for it: `grad.scatter(dim, index, 0)`
# (scatter.value's own backward) is out of place in a real run too, and holds both.
SCATTERED_BACKWARD = frozenset(("scatter_add", "scatter", "scatter_reduce", "index_add", "put", "masked_scatter",
                                "index_fill"))
ZEROS = ("zeros", "zeros_like", "new_zeros")


# Backward formulas that sum two temporaries of their own out of place (FunctionsManual.cpp:
# var_mean_backward's and std_mean_backward's `gself + aux`, infinitely_differentiable_native_group_norm_backward's
# sums): that add is no gradient sum of autograd's and keeps its own memory in a real run too.
# Read from scripts/op_loops.py's var_mean, std_mean and native_group_norm loops (seed 2097219595:
# 488, 88 and 56 B under); autograd's own sum of what such a node returns is still folded.
FORMULA_ADDS = frozenset(("VarMeanBackward0", "StdMeanBackward0", "NativeGroupNormBackward0"))


def note_node(tracker):
    """Where a FORMULA_ADDS node's backward begins (the event index its first op sees)."""
    import torch
    node = torch._C._current_autograd_node()
    if node is not None and node.name() in FORMULA_ADDS:
        tracker.node_start.setdefault(node._sequence_nr(), len(tracker.events))


def _formula_add(tracker, args):
    """Whether this backward add is a FORMULA_ADDS node's own sum: its first operand made inside
    the node's backward."""
    import torch
    node = torch._C._current_autograd_node()
    if node is None or node.name() not in FORMULA_ADDS or not args or not isinstance(args[0], torch.Tensor):
        return False
    entry = tracker.live.get(args[0].untyped_storage()._cdata)
    start = tracker.node_start.get(node._sequence_nr())
    return entry is not None and start is not None and entry[1] is not None and entry[1] >= start


def _summing(tracker):
    """Whether an add may be autograd's gradient sum, which it does in place: in backward with
    grad mode off (a checkpoint's recomputation runs with it on, and adds out of place)."""
    import torch
    return tracker.phase == "backward" and not torch.is_grad_enabled()


def _made_by(tracker, t, ops):
    """Whether tensor `t`'s storage was made by one of `ops` (its allocation's key ends with one)."""
    import torch
    entry = tracker.live.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None
    return entry is not None and tracker.allocs[entry[0]][0].rsplit("/", 1)[-1] in ops


def _note_folded(tracker, first, out):
    """before_op folds `out` into `first`'s memory if `first` dies with the op (as autograd's
    InputBuffer decides for an add: `first` non-overlapping and dense, not a view, of the output's
    shape and dtype)."""
    import torch
    if (isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor) and first.shape == out.shape
            and first.dtype == out.dtype and dense(first.shape, first.stride()) and not first._is_view()):
        tracker.accumulate = (out.untyped_storage()._cdata, first.untyped_storage()._cdata)


def _note_accumulate(tracker, args, out):
    """An add (autograd's gradient sum in backward; CPU math SDPA's mask add, F.linear's bias add)
    whose first operand may die with it: before_op folds the output into that operand's memory.
    As autograd's InputBuffer decides: the operand non-overlapping and dense (not necessarily
    contiguous), not a view, of the output's shape and dtype."""
    import torch
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) == 2:
        _note_folded(tracker, tensors[0], out)


def dense(sizes, strides):
    """Whether a tensor of these (int) sizes and strides is non-overlapping and dense: some
    order of its dimensions is contiguous; any tensor of fewer than 2 elements is (c10 finds it
    contiguous). c10's compute_non_overlapping_and_dense, which the C++ side asks
    (torch._prims_common's version imports sympy: 0.7 s)."""
    if math.prod(sizes) < 2:
        return True
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    order = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d]))  # size < 2 last
    need = 1
    for d in order:
        if sizes[d] < 2:
            return True
        if strides[d] != need:
            return False
        need *= sizes[d]
    return True
