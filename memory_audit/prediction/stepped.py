"""The step's totals as replays of its one ordered trace (issue #26): what predict, fit and plan read.

The ledger (predict.py) names every byte that is live at the phases an audit snapshots; its peak
is the largest of a list of candidate moments and its memory_reserved() a second model of the
same timeline (gap_sim). Where the shadow run covers a config (eager; one process or one torchrun
rank on CPU; on a GPU the kernels shadow_cuda knows), the peak, the moments before backward and at the end, and
memory_reserved() are taken instead from the shadow's trace replayed as the device counts it
(shadow.replayed: the caching allocator's model on CUDA). The ledger's own numbers stay beside
them under totals["ledger"], and totals["from"] says which one the totals are.

Under torchrun on CPU the shadow runs one rank of any strategy (shadow_dist). Where it does not
cover the config (torchrun on a GPU, torch.compile, measured gaps given,
flash attention on older GPUs), the totals stay the ledger's and totals["from"] says why. A
step the shadow cannot run (ShadowError) is an error, never a number.
"""

from . import shadow, shadow_dist

# the ledger's totals a replay of the trace replaces
REPLACED = ("steady_state_allocated", "steady_state_gaps", "before_backward_allocated", "peak_allocated_bytes",
            "end_allocated", "reserved_steady_bytes", "reserved_peak_bytes")


def uncovered(cfg, dev, gaps_bytes=None):
    """Why the shadow run does not give this config's totals, or None when it does."""
    parallel = cfg.get("parallel", "none")
    if parallel != "none" and parallel not in shadow_dist.COVERED:
        return f"parallel={parallel}: not in the shadow run"
    if parallel != "none" and dev["type"] == "cuda":
        return f"parallel={parallel} on a GPU: the shadow's collectives are gloo's (CPU audits); no NCCL trace is committed"
    if cfg.get("compile"):
        return "compile=True: inductor's own plan predicts it"
    if gaps_bytes is not None:
        return "--gaps: measured allocator gaps given"
    low = cfg["dtype"] in ("float16", "bfloat16")
    if dev["type"] == "cuda" and cfg["attention"] == "sdpa" and low and dev.get("sdpa_backend") != "cudnn":
        return f"SDPA takes {dev.get('sdpa_backend')} attention on this GPU: no committed trace has measured it"
    return None


def with_shadow(pred, gaps_bytes=None, ledger=True, names=False):
    """(pred with its totals from the shadow's replay where it covers the config, the replay
    or None). The ledger's lines are unchanged; ledger: its replaced totals are kept under
    totals["ledger"] (False: they were computed without the allocator model); names: the
    shadow names what it made as an audit does (shadow.replayed)."""
    cfg, dev, t = pred["config"], pred["device"], pred["totals"]
    reason = uncovered(cfg, dev, gaps_bytes)
    if reason is not None:
        t["from"] = f"ledger ({reason})"
        return pred, None
    r = shadow.replayed(cfg, dev, names=names)
    if ledger:  # the ledger's totals were computed with its allocator model: kept beside
        t["ledger"] = {k: t[k] for k in REPLACED}
    cpu = r["reserved"] is None  # no cache: reserved is what is allocated
    t.update({"steady_state_allocated": r["steady_state"], "steady_state_gaps": r["steady_state"] - t["steady_state_bytes"],
              "before_backward_allocated": r["before_backward"], "peak_allocated_bytes": r["peak"],
              "end_allocated": r["end"], "reserved_steady_bytes": r["steady_state"] if cpu else r["reserved_steady"],
              "reserved_peak_bytes": r["peak"] if cpu else r["reserved"],
              "from": "shadow run" + (" (blocks repeated)" if r["result"].get("repeated") else "")
              + (f" (kernels not asked for their own buffers: {', '.join(r['result']['unprobed'])})"
                 if r["result"].get("unprobed") else "")})
    if dev["type"] == "cuda":  # the CUDA rules it applied outside the shapes a trace measured
        t["unmeasured_on_gpu"] = r["result"].get("unmeasured", [])
    pred["backward"] = dict(pred["backward"], peak_at=busiest(r))
    return pred, r


def busiest(r):
    """The event at which the step's allocated bytes peak (replayed()'s), in words."""
    i = r["peak_event"]
    if i < 0:
        return "the step's start (no event adds to it)"
    return f"event {i} of step 2 (shadow run): {r['result']['events'][i][1]}"
