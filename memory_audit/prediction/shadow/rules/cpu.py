"""What CPU kernels allocate inside themselves that fake tensors do not show, one rule per op.

Each rule was read from CPU audits (the profiler's memory timeline, event by event) and is held
by the tests that replay them: the random nanoGPT configs of tests/test_shadow.py and the
committed rows (snapshots/results/random/shadow-check-*.jsonl, tests/test_random_rows.py), the
library-model loops of scripts/zoo_check.py (snapshots/results/random/zoo-check-*.txt) and the
loops written by someone who had not seen the rules (scripts/user_loops.py, its printout
snapshots/results/random/user-loops-54591.txt). Parts on CPU:
  before   f(args) -> [(name, bytes)] made before the outputs and freed as the op returns, in order; name is
           the allocation's suffix under the op's key, or None for the op's buffer
  after    f(args, out) -> [bytes] made after the outputs, in order, and freed in reverse as the
           op returns (before anything made ahead of the outputs); skipped where the kernel was
           probed (shadow/probe asks it for its own buffers)
  events   f(args) -> (before, after): temporaries made and freed around the outputs in an order
           of their own, as ("alloc", bytes) | ("free", k) (k: the k-th alloc of both lists)
The tracker's own rules (wrapped scalars, mixed-dtype casts, a foreach op's per-tensor scalars,
CPU mean's divide, reduced losses, layer norm's fp32 statistics, kernel probes) are machinery
over many ops and stay in shadow/tracker. Plain Python until a rule is called.
"""

import math

from . import rule
from .. import probe

LAYER_NORM = "aten.native_layer_norm.default"
LAYER_NORM_BACKWARD = "aten.native_layer_norm_backward.default"
FLASH = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default")


def _copy(t):
    return t.numel() * t.element_size()


@rule("cpu", "aten.embedding.default", "before")
def embedding_index_copy(args):
    """Non-contiguous indices are copied before the output (indices.reshape(-1)) and freed as it
    returns (random loops of scripts/any_model_check.py, seeds 982210 and 312884, at b401c0b)."""
    return [] if args[1].is_contiguous() else [("indices", _copy(args[1]))]


@rule("cpu", LAYER_NORM, "before")
def layer_norm_input_copy(args):
    """A non-contiguous X is copied contiguous before the outputs (X.expect_contiguous()), freed
    as it returns (Whisper's encoder: conv, permute, + positions, 3,840 B for a 2 x 30 x 16 fp32
    input; scripts/user_loops.py's whisper, user-loops-54591.txt; tests/test_known_values.py)."""
    return [] if args[0].is_contiguous() else [(None, _copy(args[0]))]


@rule("cpu", LAYER_NORM_BACKWARD, "before")
def layer_norm_backward_input_copy(args):
    """The backward copies a non-contiguous X the same way (the same Whisper loop:
    scripts/user_loops.py)."""
    return [] if args[1].is_contiguous() else [(None, _copy(args[1]))]


@rule("cpu", LAYER_NORM_BACKWARD, "after")
def layer_norm_backward_buffers(args, out):
    """After its outputs: a non-contiguous dY's contiguous copy (the same Whisper loop), then,
    where dgamma or dbeta is asked for, the buffer they are reduced through, 2 x threads x N
    elements of X's dtype (torch.get_num_threads() of the predicting process: the audit's own on
    one machine; the random nanoGPT configs of tests/test_shadow.py)."""
    import torch
    dy, x, n = args[0], args[1], math.prod(args[2])
    out = [] if dy.is_contiguous() else [_copy(dy)]
    return out + ([2 * torch.get_num_threads() * n * x.element_size()] if any(args[-1][1:]) else [])


def _flash(name):
    def buffers(args, out):
        import torch
        return probe.flash_cpu_buffers(getattr(torch.ops.aten, name).default, args)
    buffers.__doc__ = f"""CPU flash attention's per-thread work buffers ({name}: shadow/probe.flash_cpu_buffers,
    read from the random nanoGPT configs of tests/test_shadow.py with SDPA in fp32; in bf16 the
    kernel is probed on a CPU with oneDNN bf16)."""
    return buffers


flash_attention_buffers = rule("cpu", FLASH[0], "after")(_flash("_scaled_dot_product_flash_attention_for_cpu"))
flash_attention_backward_buffers = rule("cpu", FLASH[1], "after")(_flash("_scaled_dot_product_flash_attention_for_cpu_backward"))


@rule("cpu", "aten._safe_softmax.default", "after")
def safe_softmax_buffers(args, out):
    """_safe_softmax (math SDPA) decomposes on real tensors: after the softmax, x.isneginf() (a
    bool per element), its all() over the last dim (a bool per row) and the 0-dim zero written
    into fully masked rows, in the output's dtype (CPU audits of math SDPA: the random nanoGPT
    configs of tests/test_shadow.py, seed 616607's SAC configs at 03674e5)."""
    x = args[0]
    return [x.numel(), x.numel() // max(x.shape[-1], 1), out.element_size()]


@rule("cpu", ("aten._softmax.default", "aten._log_softmax.default"), "after")
def softmax_input_copy(args, out):
    """Softmax and log-softmax of a non-contiguous input run on a contiguous copy made after the
    output (cross-entropy over logits.movedim(-1, 1): 27,200 B for a 4 x 68 x 25 fp32 input, at
    any dim; an LSTM tagger's per-token loss, scripts/zoo_check.py seed 418482;
    tests/test_known_values.py)."""
    return [] if args[0].is_contiguous() else [_copy(args[0])]


@rule("cpu", "aten.embedding_dense_backward.default", "after")
def embedding_backward_copies(args, out):
    """indices.contiguous() then grad.contiguous() where they are not, after the output (random
    loops of scripts/any_model_check.py, seeds 982210 and 312884, at b401c0b)."""
    return [_copy(t) for t in (args[1], args[0]) if not t.is_contiguous()]


@rule("cpu", "aten.repeat.default", "events")
def repeat_permutation(args):
    """After its output, repeat builds the permutation of its unfolded dims on the host: arange(n)
    and arange(n) + n (the n a wrapped int64 scalar, freed at once), stacked (2n), then freed
    (the sum, the range, the stack last); n = len(repeats), nothing where a repeat is 0.
    Whisper's decoder positions (`arange(T).repeat(B, 1)`: the 16 B first divergence of
    scripts/user_loops.py's whisper, user-loops-54591.txt), then CPU audits of repeat at 1-4
    dims, 0-dim and empty inputs, bf16; tests/test_known_values.py's CrossAttended, event by event)."""
    n = len(args[1])
    if 0 in args[1]:
        return (), ()
    return (), [("alloc", 8 * n), ("alloc", 8), ("alloc", 8 * n), ("free", 1), ("alloc", 16 * n),
                ("free", 2), ("free", 0), ("free", 3)]
