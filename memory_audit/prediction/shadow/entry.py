"""The ways into a shadow run of a user's own code (shadow/script.Shadow is the session):
`with memory_audit.shadow() as s:` around the code (`with s.step(held):` marking its steps where
the code says them: shadow/loop.MarkedStep), `predict_loop(make, step)` for a loop given as two functions, and
`shadow_file(script, argv)` for a script file run as __main__ (`predict-script`; on one GPU a
deep model's equal blocks repeated: shadow/depth).
Plain Python until a shadow run starts: torch is imported inside the functions.
"""

import os
import sys

from .depth import predicted
from .error import ShadowError


def shadow(device="cpu", step=2, assume=None, gpu="H100", world_size=None, rank=0):
    """`with memory_audit.shadow() as s:` around a training script's own code (module docstring).
    device: "cpu", or "cuda" for the code run on one `gpu` (shadow/gpu: no GPU needed).
    assume: {"file.py:205" or "nonzero": rows, a fraction of the mask, or [rows, ...] per step}, the
    sizes of data-dependent shapes (known_values). world_size, rank: the code run as that rank of a
    torchrun job on `world_size` GPUs (device="cuda"; shadow/ranks.script_ranks)."""
    from .script import Shadow
    return Shadow(device=device, step=step, assume=assume, gpu=gpu, world_size=world_size, rank=rank)


def predict_loop(make, step, inputs=None, audited=1, assume=None):
    """The shadow run of a loop (issue #28; CPU): `make()` builds (model, optimizer, *batch) on
    fake tensors; `step(model, optimizer, *batch)` is one training step (forward, loss, backward,
    optimizer step, zero_grad) and returns what the loop keeps until the next step (its loss,
    or {name: tensor}: named by its keys where nothing else names it). Steps 0..audited run;
    step `audited` is recorded as Audit(step=...) records it. `inputs`: names for the batch, as
    the loop would give them with `audit.step(i, tensors=...)`. Returns the audited step's
    result (run()'s dict; lines() reads any phase) with "summary" (loop_summary); raises
    ShadowError (one line, naming the op and the loop's line) for a step fake tensors cannot
    run. Reads of values and data-dependent sizes are answered as shadow() answers them
    (summary["placeholders"], summary["sizes"]; `assume`: shadow()'s)."""
    from .script import Shadow
    with Shadow(step=audited, assume=assume) as s:
        model, optimizer, *batch = make()
        s.use(model, optimizer)  # the model make() returns, not one found from the forward's calls
        s.given = dict(zip(inputs or (), batch))
        kept = {}
        for _ in range(audited + 1):
            with s.step(kept):
                out = step(model, optimizer, *batch)
                kept.clear()  # the previous step's, let go as a rebinding loop lets it go
                kept.update({"temporary/loop/loss": out} if _is_tensor(out) else dict(out or {}))
                del out
    return dict(s.result, summary=dict(s.summary, source="predict_loop: the loop's shadow run on fake tensors"))


def _is_tensor(value):
    import torch
    return isinstance(value, torch.Tensor)


def shadow_file(script, argv=(), repeat=False, **shadow_kw):
    """The exited Shadow of the script at path `script` run as __main__ with sys.argv
    [script, *argv] under Shadow(**shadow_kw) (`predict-script`). repeat: on one GPU (device
    "cuda", no world_size), a deep model's equal blocks repeated (predicted(); `--repeat-blocks`:
    asked for, as the script runs up to three times and what it does to blocks by index after
    building them is not seen)."""
    import runpy
    from .script import Shadow

    def run(depth=None):
        saved_argv, saved_path = sys.argv, list(sys.path)
        sys.argv, sys.path[:0] = [script, *argv], [os.path.dirname(os.path.abspath(script))]
        try:
            with Shadow(depth=depth, **shadow_kw) as s:
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            raise ShadowError(f"{script} exited (code {e.code}) before its step {shadow_kw.get('step', 2)} "
                              "ended") from None
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        return s
    one_gpu = shadow_kw.get("device") == "cuda" and shadow_kw.get("world_size") is None
    return predicted(run) if repeat and one_gpu else run()
