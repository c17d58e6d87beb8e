"""The reading side: snapshot files in, named bytes out, without torch.

loader (safe unpickling, schema checks) -> trace (the allocator's history as columns) ->
allocator_sim / timeline (replay: what was live at each moment, the peak) -> attribute (every
block named: weights, grads, optimizer state, activations, gaps ...) -> viz (MemoryViz page).
inductor_plan reads the memory plan in inductor's generated wrapper code.
"""
