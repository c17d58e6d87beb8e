"""What a training loop feeds its model and keeps between steps, found without being told.

The Audit names a loop's own tensors this way, and the shadow run of the same loop
(prediction/shadow/script.Shadow, and predict_loop through it) names its fake ones with this same code, so a prediction's lines
carry the measurement's names:

- `inputs/model.<arg>`: each tensor the model's forward received, by its signature's names
  (`arg<i>` where the signature does not say), from a forward hook on the model; a
  checkpoint's recomputation is not a forward;
- `temporary/loop/output` (`output<i>` for several): what the model's last forward returned;
- `temporary/loop/loss`: the tensor backward starts from;
- `inputs/loop/<op>.<attr>`: leaf tensors that need no gradient saved by the loss's own autograd
  nodes (those made after the model returned): the targets.
- `activations/loop/leaf<i>` and `grads/loop/leaf<i>`: tensors the code made needing a gradient
  that are no Parameter (T5 with its checkpointing makes its position bias so), found as the
  loss's graph accumulates into them, and the gradient backward leaves in each; the previous
  step's loss keeps both alive into the next step.

Tensors are held by weak references: naming keeps nothing alive. `ident(tensor)` tells two
tensors' memory apart (the Audit: the storage's data pointer; a shadow run's fake tensors have
none, so it passes the storage's C++ address).
"""

import inspect
import weakref

import torch

from .saved import saved_values_of
from .tensors import local_tensor, op_name, tensors_in


def storage_ptr(t):
    return local_tensor(t).untyped_storage().data_ptr()


class LoopNames:
    def __init__(self, ident=storage_ptr):
        self.ident = ident
        self.loop = {}  # name -> weak reference: the model's last output and the loss, as the loop holds them
        self.inputs = {}  # name -> weak reference: what the step was fed (the model's arguments, the loss's targets)
        self.leaves = []  # weak references: graph leaves that are no Parameter, in the loss's graph order
        self.returned_at = -1  # the autograd sequence number of the model output's node
        self.hook = None

    def watch(self, model):
        """Find the model's inputs and output at each forward (a hook; `remove()` takes it away)."""
        self.remove()
        self.hook = model.register_forward_hook(self.note_output, with_kwargs=True)

    def remove(self):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def note_output(self, module, args, kwargs, output):
        if torch._C._current_autograd_node() is not None:  # a checkpoint's recomputation, not a forward
            return
        tensors = tensors_in(output)
        for k in [k for k in self.loop if k.startswith("temporary/loop/output")]:
            del self.loop[k]
        for i, t in enumerate(tensors):
            self.loop["temporary/loop/output" + (f"{i}" if len(tensors) > 1 else "")] = weakref.ref(t)
        self.inputs = {k: r for k, r in self.inputs.items() if not k.startswith("inputs/model.")}
        for name, t in arguments(module, args, kwargs):
            self.inputs[f"inputs/model.{name}"] = weakref.ref(t)
        # autograd numbers nodes as they are made: the loss's come after these
        self.returned_at = max((t.grad_fn._sequence_nr() for t in tensors if t.grad_fn is not None), default=-1)

    def note_loss(self, loss, targets=True):
        """The tensor backward starts from; targets: also what its own nodes saved (loss_inputs)."""
        self.loop["temporary/loop/loss"] = weakref.ref(loss)
        if targets:
            self.inputs = {k: r for k, r in self.inputs.items() if not k.startswith("inputs/loop/")}
            for name, t in loss_inputs(loss.grad_fn, self.returned_at):
                self.inputs.setdefault(f"inputs/loop/{name}", weakref.ref(t))
            self.leaves = [weakref.ref(t) for t in graph_leaves(loss.grad_fn)]

    def tensors(self, given=None):
        """{name: tensor}: `given` (the loop's own names) first, then the inputs found, each
        memory once."""
        out = dict(given or {})
        named = {self.ident(v) for v in out.values() if torch.is_tensor(v)}
        leaves = {}
        for i, r in enumerate(self.leaves):
            v = r()
            if v is not None:
                leaves[f"activations/loop/leaf{i}"] = v
                if v.grad is not None:
                    leaves[f"grads/loop/leaf{i}"] = v.grad
        for name, v in [(k, r()) for k, r in self.inputs.items()] + list(leaves.items()):
            if v is not None and self.ident(v) not in named:
                named.add(self.ident(v))
                out.setdefault(name, v)
        return out

    def held(self):
        """{name: tensor} of the model's last output and the loss, while the loop holds them."""
        return {k: v for k, v in ((k, r()) for k, r in self.loop.items()) if v is not None}


def arguments(module, args, kwargs):
    """(parameter name, tensor) of a forward call's tensor arguments: x for forward(self, x),
    arg<i> where the signature does not say."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    return [(k, v) for k, v in bound.items() if torch.is_tensor(v)]


def graph_leaves(root, limit=1 << 16):
    """Tensors needing a gradient that are no Parameter, accumulated into by the graph from root
    (its AccumulateGrad nodes; at most `limit` nodes walked), in the walk's order."""
    out, seen, todo = [], set(), [root]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        v = getattr(node, "variable", None)
        if torch.is_tensor(v) and not isinstance(v, torch.nn.Parameter):
            out.append(v)
        todo.extend(fn for fn, _ in node.next_functions)
    return out


def loss_inputs(root, returned_at, limit=64):
    """(op.attr, tensor) of leaf tensors that need no gradient, saved by the autograd nodes made
    after the model returned (sequence number above `returned_at`: the loss's; at most `limit`);
    a saved view stands for its base tensor."""
    out, seen, todo = [], set(), [root]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen or node._sequence_nr() <= returned_at:
            continue
        seen.add(node)
        for attr, value in saved_values_of(node, False):
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if torch.is_tensor(t) and t.grad_fn is None and not t.requires_grad and t.dim() > 0:
                    # a view made for the loss (y.view(-1)) dies with the step: keep its base, the loop's
                    out.append((op_name(node.name(), attr), t._base if t._base is not None else t))
        todo.extend(fn for fn, _ in node.next_functions)
    return out
