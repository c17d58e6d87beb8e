"""torch.compile: what AOTAutograd's partitioner decides to save, and what inductor plans.

Inductor partitions each compiled graph's joint forward/backward with
`min_cut_rematerialization_partition` (its choice, shaped by
`torch._functorch.config.activation_memory_budget`). The forward graph's outputs past the
user's are the values saved for backward, in the order the compiled function hands them to
`ctx.save_for_backward`, which is the order the pack hooks of `saved_tensors_hooks` see them
(checked on cpu-tiny: 51 of 51 in order, shapes and dtypes equal). So:

- `capture()` records, for every graph compiled while it is on, its saved values (FX node name,
  shape, dtype, bytes, module path from `nn_module_stack`), and every wrapper inductor loads;
  the audit names each packed tensor by its position and each wrapper buffer by its name.
- `inductor_plans(model, inputs, budget)` runs inductor's own compile_fx and stops once both
  wrappers are written (no kernel compiled, no step run): the partition and the memory plan
  prediction/compiled.py turns into a ledger.

A warm inductor cache skips the partitioner; `no_cache()` turns the FX graph and AOT autograd
caches off for the audited process (the compiled code is the same).
"""

from contextlib import contextmanager

import torch


def _module_path(node, prefix):
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]  # "L['self'].transformer.h.0.ln_1"
    path = path.split("L['self']", 1)[-1].lstrip(".") if "L['self']" in path else path
    return path[len(prefix):] if prefix and path.startswith(prefix) else path


def saved_values(fw_module, num_fwd_outputs, prefix=""):
    """[{node, module, shape, dtype, nbytes}] of the tensors a partitioned forward saves."""
    out = []
    for node in fw_module.graph.output_node().args[0][num_fwd_outputs:]:
        val = getattr(node, "meta", {}).get("val")
        if isinstance(val, torch.Tensor):
            out.append({"node": node.name, "module": _module_path(node, prefix), "shape": list(val.shape),
                        "dtype": str(val.dtype).replace("torch.", ""),
                        "nbytes": val.numel() * val.element_size(), "target": str(node.target)})
    return out


def matmul_flops(gm):
    """FLOPs of a graph's matrix products: 2*M*N*K per mm/addmm/bmm/baddbmm, 4*B*H*T*S*D per
    fused attention forward, and twice that for its backward (the usual convention)."""
    total = 0
    for node in gm.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        vals = [a.meta.get("val") for a in node.args if hasattr(a, "meta")]
        if name in ("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"):
            a = vals[-2] if name.endswith(("addmm.default", "baddbmm.default")) else vals[0]
            total += 2 * node.meta["val"].numel() * a.shape[-1]
        elif name.startswith("aten._scaled_dot_product") and len(vals) >= 2:
            q, k = vals[0], vals[1]
            flops = 4 * q.numel() * k.shape[-2]
            total += 2 * flops if "_backward" in name else flops
    return total


@contextmanager
def capture(graphs, prefix="", costs=None, wrappers=None):
    """While on, append each compiled graph's saved values (a list, see saved_values) to `graphs`;
    to `costs` when given, its forward's and backward's matmul FLOPs; to `wrappers` when given,
    every wrapper module inductor loads: {"file", "kind" (forward/backward), "allocations"}."""
    import torch._inductor.compile_fx as cfx
    from torch._inductor.graph import GraphLowering
    original = cfx.min_cut_rematerialization_partition
    load = GraphLowering._compile_to_module_lines

    def loaded(self, wrapper_code):
        mod = load(self, wrapper_code)
        if wrappers is not None:
            wrappers.append(wrapper_entry(mod.__file__, wrapper_code.value, buffer_layouts(self)))
        return mod

    def partition(joint, inputs, *args, num_fwd_outputs=None, **kwargs):
        fw, bw = original(joint, inputs, *args, num_fwd_outputs=num_fwd_outputs, **kwargs)
        graphs.append(saved_values(fw, num_fwd_outputs, prefix))
        if costs is not None:
            costs.append({"forward_matmul_flops": matmul_flops(fw), "backward_matmul_flops": matmul_flops(bw)})
        return fw, bw
    cfx.min_cut_rematerialization_partition = partition
    GraphLowering._compile_to_module_lines = loaded
    try:
        yield graphs
    finally:
        cfx.min_cut_rematerialization_partition = original
        GraphLowering._compile_to_module_lines = load


def wrapper_entry(path, code, layouts):
    """What names a wrapper's allocations in a trace: its file, forward or backward, and the
    buffers its `call` makes, in order ([] when the plan cannot be read)."""
    from ..reading.inductor_plan import PlanError, call_body, replay
    try:
        body = call_body(code)
        kind = "backward" if body and "tangents_" in body[0] else "forward"
        allocations = replay(code, {}, layouts=layouts)["allocations"]
    except PlanError:
        kind, allocations = "forward", []
    return {"file": path, "kind": kind, "allocations": allocations}


@contextmanager
def no_cache():
    """Inductor's FX graph cache and AOT autograd's cache off: a hit would skip the partitioner."""
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    saved = (iconfig.fx_graph_cache, getattr(fconfig, "enable_autograd_cache", None))
    iconfig.fx_graph_cache = False
    if saved[1] is not None:
        fconfig.enable_autograd_cache = False
    try:
        yield
    finally:
        iconfig.fx_graph_cache = saved[0]
        if saved[1] is not None:
            fconfig.enable_autograd_cache = saved[1]


@contextmanager
def memory_budget(budget):
    """torch._functorch.config.activation_memory_budget = budget, restored on exit."""
    import torch._functorch.config as fconfig
    before = fconfig.activation_memory_budget
    fconfig.activation_memory_budget = float(budget)
    try:
        yield
    finally:
        fconfig.activation_memory_budget = before


def _caused_by(exc, kind):
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def compiled_ledger(out, device, graphs, short):
    """The saved-tensor ledger of a compiled forward: every tensor packed for backward, named by
    its position in the partitioner's saved values (`graphs`, from capture()). No module hooks:
    they would change what dynamo compiles. Yields label(loss=None, held=None) as the eager
    ledger does; fills `out` with SavedTensor dicts keyed activations/<module>/<FX node>."""
    packed = []

    def pack(t):
        st = t.untyped_storage()
        packed.append((st.data_ptr(), st.nbytes(), str(t.dtype).replace("torch.", ""), list(t.shape), str(t.device)))
        return t

    def label(loss=None, held=None):
        values = [v for graph in graphs for v in graph]
        named = len(values) == len(packed)  # one graph, or graphs run in the order they compiled
        seen = {}
        for i, (ptr, nbytes, dtype, shape, dev) in enumerate(packed):
            if ptr in seen or dev != device:
                continue
            v = values[i] if named else {"node": f"saved{i}", "module": "", "target": ""}
            seen[ptr] = {"key": f"activations/{short(v['module'])}/{v['node']}", "module": v["module"],
                         "op": v["node"], "grad_fn": "CompiledFunctionBackward", "savers": [v["target"]],
                         "data_ptr": ptr, "nbytes": nbytes, "dtype": dtype, "shape": shape}
        # eager ops around the compiled graph (the loop's division) and what the loop holds:
        # named as the eager ledger names them
        from .saved import graph_savers, saved_records
        savers, info = graph_savers([loss.grad_fn]) if loss is not None else ({}, {})
        rest = {p: {"module": "", **info[p]} for p in savers if p not in seen}
        for module, t in (held or {}).items():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                rest.setdefault(st.data_ptr(), {"module": module, "held": True, "device": str(t.device),
                                                "nbytes": st.nbytes(), "dtype": str(t.dtype).replace("torch.", ""),
                                                "shape": list(t.shape)})
        for r in saved_records(rest, savers, device, checkpointed=False, short=short):
            seen[r["data_ptr"]] = r
        out.extend(seen.values())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield label


def buffer_layouts(graph):
    """{buffer name: [size, stride, dtype]} of a lowered graph's buffers with a fixed layout:
    what sizes the outputs of fallback kernels (aten ops inductor calls as they are), which the
    wrapper makes without an empty_strided line."""
    out = {}
    for name, buf in graph.name_to_buffer.items():
        try:
            layout = buf.get_layout()
            size, stride = [int(s) for s in layout.size], [int(s) for s in layout.stride]
        except (AttributeError, TypeError, NotImplementedError):
            continue  # a multi-output kernel's own node, or a symbolic size
        out[name] = [size, stride, str(layout.dtype).replace("torch.", "")]
    return out


class _Generated(Exception):
    """Raised once inductor has written a graph's wrapper code (before it compiles kernels)."""


@contextmanager
def _wrappers_only(codes, layouts):
    """Inside: inductor stops each graph once its wrapper code is written (its code appended to
    `codes`, its buffers' layouts to `layouts`, then _Generated raised), the backward generated
    with the forward; dynamo's caches reset on both sides."""
    import torch._functorch.config as fconfig
    from torch._inductor.graph import GraphLowering

    def grab(self, wrapper_code):
        codes.append(wrapper_code.value)
        layouts.append(buffer_layouts(self))
        raise _Generated()
    original, lazy = GraphLowering._compile_to_module_lines, fconfig.force_non_lazy_backward_lowering
    GraphLowering._compile_to_module_lines = grab
    fconfig.force_non_lazy_backward_lowering = True  # the backward is generated with the forward
    torch._dynamo.reset()
    try:
        yield
    finally:
        GraphLowering._compile_to_module_lines = original
        fconfig.force_non_lazy_backward_lowering = lazy
        torch._dynamo.reset()


def inductor_plans(model, inputs, budget=1.0, prefix="", context=None):
    """What inductor would run for `model(*inputs)` at this activation memory budget, without
    compiling a kernel or running a step: the partitioner's saved values and the generated
    Python wrappers of the forward and the backward (their memory plans, see inductor_plan.py).

    Returns {"saved": [saved values], "forward": code, "backward": code (each wrapper's
    `call` function: its memory plan), "inputs": [{"param": bool, "nbytes": int, "name": the
    parameter's name or None}] per forward input (primals_1, ...), the matmul FLOPs of both graphs and the recomputation's}. One graph
    only: a graph break raises ValueError. `context`: entered around the call (autocast, as the loop runs it).
    """
    from contextlib import nullcontext

    import torch._inductor.compile_fx as cfx

    codes, graphs, primals, costs, layouts = [], [], [], [], []
    owned = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    names = {p.data_ptr(): n for n, p in model.named_parameters()}

    def inner(gm, example_inputs, **kwargs):
        try:
            cfx.compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as e:
            if not _caused_by(e, _Generated):
                raise
        if kwargs.get("is_backward"):
            raise _Generated()
        return lambda args: None

    def backend(gm, example_inputs):
        primals[:] = [{"param": t.data_ptr() in owned, "nbytes": t.untyped_storage().nbytes(),
                       "name": names.get(t.data_ptr())} for t in example_inputs]
        return cfx.compile_fx(gm, example_inputs, inner_compile=inner)

    with _wrappers_only(codes, layouts), capture(graphs, prefix, costs), no_cache(), memory_budget(budget), \
            context or nullcontext():
        try:
            torch.compile(model, backend=backend)(*inputs)
        except Exception as e:
            if not _caused_by(e, _Generated):
                raise
    if len(graphs) != 1 or len(codes) != 2:
        raise ValueError(f"expected one compiled graph with a forward and a backward, got {len(graphs)} "
                         f"graphs and {len(codes)} wrappers (a graph break?)")
    from ..reading.inductor_plan import call_function
    fw_flops, bw_flops = costs[0]["forward_matmul_flops"], costs[0]["backward_matmul_flops"]
    return {"saved": graphs[0], "forward": call_function(codes[0]), "backward": call_function(codes[1]),
            "forward_layouts": layouts[0], "backward_layouts": layouts[1],
            "inputs": primals, "budget": float(budget), "torch_version": torch.__version__,
            "forward_matmul_flops": fw_flops, "backward_matmul_flops": bw_flops,
            # a backward computes two products per forward product; what it does beyond is recomputation
            "recompute_flops": max(0, bw_flops - 2 * fw_flops)}
