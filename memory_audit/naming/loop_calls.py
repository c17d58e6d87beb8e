"""What the code made that no other rule names: each tensor by the torch call that returned it.

The Audit names weights, gradients, optimizer state, saved activations and what the loop feeds
and keeps (loop_names.LoopNames). A loop also keeps tensors of its own between steps and within
one: a padding mask it built, the lengths it gave a CTC loss, a validation loss, the total norm
clip_grad_norm_ returned. Those are named here, last, by the outermost torch function the code
called that returned a new storage, where it ran:

    activations/<module>/<call>          before the step's backward (<module>/ left out at loop level)
    temporary/optimizer/<module>/<call>  after a backward, until the optimizer's step or the
                                         model's next forward (a micro-step's)

(<module>: the innermost module running, its path in the model, the model itself by its class
name; <call>: the function's name, `x[mask]` as getitem). An Audit records from watch() to the
end of the audited step, and the shadow run of the same code (prediction/shadow/script) the
same way over its fake tensors, so both give a tensor the same name.

A torch-function mode, not a dispatch mode: it sees the calls as the code writes them and
changes no allocation (a dispatch mode would parse a wrapped scalar twice on CPU), and it steps
aside while torch.compile traces. Storages are held by weak references: naming keeps nothing
alive, and a storage freed since is not named. Naming never stops the step: a call whose output
has no storage to name (sparse, nested) is left unnamed.
"""

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .tensors import local_tensor

def storage_ptr(storage):
    return storage.data_ptr()


def _plain(t):
    """A strided tensor with a storage of its own to name (not sparse, not nested)."""
    return t.layout == torch.strided and not t.is_nested


class LoopCalls(TorchFunctionMode):
    def __init__(self, ident=storage_ptr):
        super().__init__()
        self.ident = ident
        self.made = {}  # ident -> (name, weak reference to the storage, its bytes, dtype, shape)
        self.label, self.phase, self.off = "", "activations/", False
        self._stack, self._handles = [], []
        self._prune_at = 4096

    def watch(self, model, optimizer=None):
        """Name by `model`'s modules from now on (forward hooks; `remove()` takes them away); a
        step's forward starts at the model's forward and after `optimizer`'s step (any
        optimizer's where none is given: a shadow run finds its optimizer at that step)."""
        self.remove()
        self.new_step()  # (a shadow run finds the model at the first optimizer step's end)
        root = type(model).__name__.lower()
        for name, module in model.named_modules():
            def pre(_m, _a, name=name):
                if not name and torch._C._current_autograd_node() is None:  # the model's forward, not
                    self.new_step()  # a recomputation in backward: a (micro-)step's forward
                self._stack.append(self.label)
                self.label = name or root

            def post(_m, _a, _o):
                self.label = self._stack.pop() if self._stack else ""
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post, always_call=True))
        self._handles.append(optimizer.register_step_post_hook(self.new_step) if optimizer is not None
                             else register_optimizer_step_post_hook(self.new_step))

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles, self._stack, self.label = [], [], ""

    def close(self):
        """Hooks off and the mode left: popped where it is on top of torch's function-mode stack,
        else (the code entered a mode of its own since, still open) left in place, passing every
        call through."""
        self.remove()
        self.off = True
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is self:
            self.__exit__(None, None, None)

    def new_step(self, *_):
        self.phase = "activations/"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off or torch.compiler.is_compiling():  # nothing of it in a compiled graph
            return func(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:  # (as patched now, if it is)
            try:
                return func(*args, **kwargs)
            finally:
                self.phase = "temporary/optimizer/"
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name != "__get__" and torch._C._current_autograd_node() is None:
            try:
                self._note(out, args, kwargs, name.strip("_"))
            except Exception:  # naming never stops a training step (a tensor with no storage to name)
                pass
        return out

    def _note(self, out, args, kwargs, name):
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and _plain(t)]
        if not outs:
            return
        given = {self.ident(local_tensor(a).untyped_storage()) for a in tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor) and _plain(a)}
        key = f"{self.phase}{self.label + '/' if self.label else ''}{name}"
        for t in outs:
            t = local_tensor(t)
            st = t.untyped_storage()
            sid = self.ident(st)
            if sid in given or st.nbytes() == 0:
                continue
            seen = self.made.get(sid)
            if seen is None or seen[1].expired():
                if seen is None and len(self.made) >= self._prune_at:  # forget the storages freed since
                    self.made = {k: m for k, m in self.made.items() if not m[1].expired()}
                    self._prune_at = 2 * len(self.made) + 4096
                self.made[sid] = (key, StorageWeakRef(st), st.nbytes(), str(t.dtype).replace("torch.", ""),
                                  list(t.shape))

    def names(self):
        """{ident: name} of the storages still live."""
        return {sid: m[0] for sid, m in self.made.items() if not m[1].expired()}

    def entries(self):
        """The live ones as registry entries (name, data_ptr, nbytes, dtype, shape)."""
        return [{"name": m[0], "data_ptr": sid, "nbytes": m[2], "dtype": m[3], "shape": m[4]}
                for sid, m in self.made.items() if not m[1].expired()]
