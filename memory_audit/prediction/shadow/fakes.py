"""Module._apply and Tensor.__deepcopy__ as a model of fake tensors needs them (a user's code run
as written: shadow/script). patches.fake_modules puts them in place while the code runs.
"""


def fake_apply(original):
    """Module._apply for a model of fake tensors: torch swaps each fake parameter for its
    converted one (swap_tensors), which fails on a fake tensor something holds a weak reference
    to; here a conversion that returns the tensor itself (`.to()` to where it is) keeps it, and
    one that makes a new tensor (`.to(dtype)`, `.half()`) is set as the parameter's (and its
    gradient's) data, as torch does for plain tensors: the old storage goes, the Parameter stays.
    A move to another kind of tensor (host to the meta tensors of a GPU shadow, which `.data =`
    refuses) makes a new Parameter, once per Parameter (a tied weight stays tied)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    def apply(module, fn, recurse=True, _moved=None):
        if not any(isinstance(t, FakeTensor) for t in module.parameters()):
            return original(module, fn, recurse)
        moved = {} if _moved is None else _moved  # id(old Parameter) -> its new one
        if recurse:
            for child in module.children():
                apply(child, fn, _moved=moved)
        for key, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in moved:
                module._parameters[key] = moved[id(param)]
                continue
            with torch.no_grad():
                new = fn(param)
            if new is param:
                continue
            if new.device == param.device:  # the same Parameter object: ties and an optimizer's references hold
                param.data = new
                if param.grad is not None:
                    with torch.no_grad():
                        param.grad.data = fn(param.grad)
                continue
            moved[id(param)] = module._parameters[key] = torch.nn.Parameter(new, param.requires_grad)
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = fn(buf)
        return module
    return apply


def same_mode_deepcopy(original):
    """Tensor.__deepcopy__ for fake tensors: the copy stays in the same FakeTensorMode (torch
    deep-copies a fake tensor's __dict__, its mode too, and the copy's ops then mix two modes:
    nn.TransformerEncoder clones its layer with copy.deepcopy)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def deepcopy(t, memo):
        if isinstance(t, FakeTensor):
            memo.setdefault(id(t.fake_mode), t.fake_mode)
        return original(t, memo)
    return deepcopy
