"""The shadow run: a training step run on fake tensors, every allocation and free in autograd's
order, named as an audit names them.

step (train.py's step) and script (a user's own code as written, through entry: shadow(),
predict_loop, a script file) run under tracker's dispatch mode, which applies cpu's or cuda's
rules (rules/: one per op) to each op; distributed and ranks run one torchrun rank, gpu a GPU this
machine does not have, repeat and depth a deep step from its first blocks; replay counts the
trace as the caching allocator would; names gives its allocations the audit's names; patches
holds what it changes in torch and libraries while it runs. Plain Python until a shadow starts.
"""
