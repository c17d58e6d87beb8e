"""One optimizer step of nanoGPT's training loop: what train.py runs, and what the memory audit's
shadow run (memory_audit/prediction/shadow/step.py) runs on fake tensors, so the prediction follows
the loop by construction.

The step reads and writes the loop's live tensors through `state` ({"X", "Y", "loss"}) and
holds no other reference to them: a batch or a loss lives exactly as long as in a loop written
inline (the next batch replaces the one in use as soon as it is made; the last loss is let go
when the next forward returns). An observer (`Watch`) sees each moment of the step; its methods
do nothing here and never change what the step computes.
"""

from contextlib import nullcontext

import torch


class Watch:
    """The moments of a step an observer can see (train.py's audit, the shadow run). Each is a
    no-op here."""

    def forward(self, micro):
        """A context around micro-step `micro`'s forward and what follows it until backward."""
        return nullcontext()

    def forward_done(self, micro):
        """Inside autocast, right after the forward returned."""

    def before_backward(self, micro, loss, logits):
        """The forward's outputs as the loop holds them (logits None unless kept)."""

    def batch(self):
        """A context around fetching the next batch."""
        return nullcontext()

    def backward(self, micro, model):
        """A context around the backward."""
        return nullcontext()

    def optimizer(self):
        """A context around clipping, the optimizer's step and zero_grad."""
        return nullcontext()


WATCH = Watch()


def run_step(state, cfg, model, train_model, optimizer, scaler, get_batch, autocast, watch=WATCH):
    """Gradient accumulation over cfg["gradient_accumulation_steps"] micro-steps, then clipping
    (grad_clip != 0), the scaler's step and update, and zero_grad(set_to_none). `model` is the
    module itself, `train_model` what the forward calls (compiled, DDP). cfg keys:
    gradient_accumulation_steps, parallel, keep_logits, grad_clip, set_to_none."""
    accum = cfg["gradient_accumulation_steps"]
    for micro in range(accum):
        last = micro == accum - 1  # DDP, FSDP2: average the gradients once, after the last backward
        if cfg["parallel"].startswith("fsdp"):
            model.set_requires_gradient_sync(last)
        sync = train_model.no_sync() if cfg["parallel"] == "ddp" and not last else nullcontext()
        with watch.forward(micro):
            with sync, autocast:
                logits, state["loss"] = train_model(state["X"], state["Y"])
                watch.forward_done(micro)
                state["loss"] = state["loss"] / accum  # scale the loss to account for accumulation
            if not cfg["keep_logits"]:
                logits = None  # nothing else refers to them: their memory is free before backward
            watch.before_backward(micro, state["loss"], logits)
        with watch.batch():
            state["X"], state["Y"] = get_batch()  # prefetch the next batch while the GPU works
        with watch.backward(micro, model):
            scaler.scale(state["loss"]).backward()
        del logits  # nanoGPT would hold the last logits (2*B*T*V bytes) into the next forward
    with watch.optimizer():
        if cfg["grad_clip"] != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=cfg["set_to_none"])
