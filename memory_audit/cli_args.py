"""The command line's parsers (cli.py runs the commands): each subcommand's arguments, the config
and the device a prediction command names (overrides, device, gpu_config), and the help texts
built only when help is printed (the config keys, the GPU table, the grids), so parsing a command
imports neither the predictor nor torch.
"""

import argparse
import os
from ast import literal_eval


def parser(description):
    """The `python -m memory_audit` parser, every subcommand on it."""
    p = argparse.ArgumentParser(prog="python -m memory_audit", description=description)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    a = sub.add_parser("attribute", help="where every byte of a snapshot went")
    a.add_argument("path", help="a snapshot pickle or a run directory")
    a.add_argument("--json", action="store_true", help="JSON on stdout (`--json -` also works)")
    a.add_argument("--out", default=None, help="write the JSON to this file (never over a file it did not write)")
    a.add_argument("--force", action="store_true", help="with --out: overwrite whatever file is there")
    a.add_argument("--by", choices=("category", "name"), default="category")
    a.add_argument("--categorize", action="store_true", help="also write *.categorized.pickle for MemoryViz")
    _prediction_parsers(sub)
    r = sub.add_parser("report", help="predicted vs actual for an audit run")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true")
    r.add_argument("--repredict", action="store_true", help="make the run's prediction again with this checkout's "
                   "predictor and store it in its meta.json (imports torch); by default the one its audit stored")
    r.add_argument("--trace", action="store_true", help="also shadow-run the step (eager; one process on CPU "
                   "or CUDA, or one torchrun rank; imports torch) and name the first event where it and the measured trace part")
    df = sub.add_parser("diff", help="two audits (or an audit and a `predict --json` file) line by line")
    df.add_argument("a", help="run directory or prediction JSON (the baseline)")
    df.add_argument("b", help="run directory or prediction JSON (with the lever)")
    df.add_argument("--json", action="store_true", help="JSON on stdout (`--json -` also works)")
    _audit_parsers(sub)
    return p


def _audit_parsers(sub):
    """sweep, accuracy, viz and predict-script: grids of audits, their table, the viz pages, a script."""
    s = sub.add_parser("sweep", help="audit a grid of configs and record predicted vs actual")
    s.add_argument("--grid", default=None, help=_grid_help)
    s.add_argument("--configs", default=None, help="a JSON file: a list of train.py override dicts")
    s.add_argument("--device", default="auto")
    s.add_argument("--out", default=None, help="results .jsonl (default snapshots/results/<device>.jsonl)")
    s.add_argument("--timeout", type=int, default=900)
    s.add_argument("--jobs", type=int, default=1, help="configs audited at once (CPU; on a GPU keep 1: "
                   "the plain-step overhead runs only then)")
    s.add_argument("--keep", action="store_true", help="keep each run's snapshots")
    s.add_argument("--audit-dir", default=None, help="where runs go (default snapshots/sweep)")
    t = sub.add_parser("accuracy", help="markdown table of sweep results (the README's table)")
    t.add_argument("results", nargs="+", help="results .jsonl files")
    t.add_argument("--json", action="store_true", help="the rows as JSON, reserved_predicted/reserved_actual included")
    v = sub.add_parser("viz", help="the PyTorch memory viz page of a run, coloured by our categories, and an "
                       "overview page (offline, any size; predicted beside measured for an audit)")
    v.add_argument("path", help="a run directory or a snapshot pickle")
    v.add_argument("--phase", default="step2_end", help="which snapshot of a run (default: the whole step)")
    v.add_argument("--view", default="Active Memory Timeline", help="Active Memory Timeline | "
                   "Allocator State History | Active Cached Segment Timeline")
    v.add_argument("--out", default=None, help="HTML file (default: beside the snapshot); the overview and "
                   "window pages go beside it")
    v.add_argument("--detail", action="store_true", help="second-level categories (temporary/backward, ...); "
                   "more than ten share colours")
    v.add_argument("--window", default=None, metavar="START:END", help="write trace entries START to END "
                   "(with what was live at START) as a snapshot and its MemoryViz page, for any size of trace")
    ps = sub.add_parser("predict-script", help="shadow-run a training script as written, on fake tensors (CPU, or --gpu): "
                        "step 2's peak and where it goes, before it runs")
    ps.add_argument("script", help="the training script (.py), run as `python SCRIPT ARGS` would run it")
    ps.add_argument("script_args", nargs=argparse.REMAINDER, help="-- then the script's own arguments")
    ps.add_argument("--step", type=int, default=2, help="the step recorded, an index from 0 counted by "
                    "optimizer.step(), as Audit(step=...) takes it (default 2, the third; train.py's --audit_step=2 is 1)")
    ps.add_argument("--gpu", default=None, metavar="NAME", help="predict the script on one CUDA GPU with no GPU here "
                    "(its CUDA rules were read on H100s: other GPUs take them as they are): what it puts on 'cuda' "
                    "is counted as the caching allocator counts it")
    ps.add_argument("--world_size", type=int, default=None, metavar="N", help="with --gpu: the script run as one "
                    "rank of a torchrun job on N GPUs (its init_process_group gets a fake group; FSDP2, tensor "
                    "parallelism)")
    ps.add_argument("--rank", type=int, default=0, help="with --world_size: which rank (default 0)")
    ps.add_argument("--repeat-blocks", dest="repeat_blocks", action="store_true", help="with --gpu (one GPU): a "
                    "deep model's list of 12+ equal blocks shadow-run with 3 and 4 of them and repeated (faster); "
                    "wrong, unseen, where the script treats blocks by index after building them (freezing the "
                    "first k, adapters on some): docs/any_model.md")
    ps.add_argument("--trace", default=None, metavar="FILE.pickle", help="write step 2 as a snapshot MemoryViz opens")
    ps.add_argument("--assume", action="append", default=[], metavar="KEY=SIZE",
                    help="the size of a data-dependent shape (nonzero, a boolean mask's index): KEY the line "
                         "(file.py:205) or the op (nonzero); SIZE rows, a fraction of the mask (0.25) or rows per "
                         "call in a step (12,30,6); repeatable")
    ps.add_argument("--json", action="store_true")


def _prediction_parsers(sub):
    """predict, fit and plan: a config (train.py's keys) and the machine to judge it on."""
    for name, helptext in (("predict", "the predicted ledger for a config"),
                           ("fit", "the largest batch that fits a GPU"),
                           ("plan", "does it fit, and which levers make it fit, cheapest first")):
        q = sub.add_parser(name, help=helptext, epilog_from=config_help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        q.add_argument("--gpu", default="H100", help=_gpu_help)
        q.add_argument("--memory", type=int, default=None, help="GPU memory in bytes (with --capability: other GPUs)")
        q.add_argument("--capability", default=None, help="compute capability MAJOR.MINOR of a GPU not in the table")
        q.add_argument("--json", action="store_true")
        q.add_argument("--headroom", type=float, default=0.02, help="fraction of the card kept free beyond the "
                       "prediction (fit, plan); reserved memory is predicted exact on the 23 H100 rows that measured it "
                       "(from the shadow run)")
        q.add_argument("--outside", type=int, default=None, help=_outside_help)
        if name == "plan":
            q.add_argument("--jobs", type=int, default=None, help="options shadow-run at once, each in a forked "
                           "process (default: every CPU this process may use)")
        if name == "predict":
            q.add_argument("--trace", default=None, metavar="FILE.pickle",
                           help="write the shadow run's step (on a GPU through the caching allocator's model) as a "
                                "snapshot MemoryViz opens")


CHOICES = {"dtype": "float32 | bfloat16 | float16", "attention": "manual | sdpa", "activation": "gelu | relu",
           "optimizer_impl": "fused | foreach | for", "activation_checkpointing": "none | full | selective | sac",
           "sac_save_ops": "comma-separated aten ops; empty = mm, addmm, bmm and the SDPA kernels"}


def config_help():
    """The config keys predict and fit take (train.py's), with defaults and allowed values."""
    from .prediction.predict import DEFAULTS
    from .prediction.ledger.config import presets
    PRESETS = presets()
    pairs = [("--preset=NAME", f"one of {', '.join(PRESETS)}")]
    pairs += [(f"--{key}={value}", CHOICES.get(key, type(value).__name__)) for key, value in DEFAULTS.items()]
    width = max(len(a) for a, _ in pairs) + 2
    return "config keys (train.py's; default = the reference run):\n" + "\n".join(f"  {a:<{width}}{b}" for a, b in pairs)


class _Parser(argparse.ArgumentParser):
    """A subcommand parser whose epilog is built only when its help is printed (predict's config
    keys and model.py's presets)."""

    def __init__(self, *args, epilog_from=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._epilog_from = epilog_from

    def format_help(self):
        if self._epilog_from is not None:
            self.epilog, self._epilog_from = self._epilog_from(), None
        for action in self._actions:  # help texts that name the GPU table or the grids
            if callable(action.help):
                action.help = action.help()
        return super().format_help()


def _gpu_help():
    from .prediction.predict import GPUS
    return f"{', '.join(GPUS)} (any case) or cpu"


def _outside_help():
    from .prediction.predict import OUTSIDE_PYTORCH_DEFAULT
    return f"bytes CUDA holds outside PyTorch (context, handles); default {OUTSIDE_PYTORCH_DEFAULT:,}, an estimate"


def _grid_help():
    from .comparison.grids import GRIDS
    return f"a named grid of configs: {', '.join(GRIDS)} (memory_audit/comparison/grids.py)"


# -- the config and the device a prediction command names -------------------------------------

def overrides(extra):
    """--KEY=VALUE pairs (train.py keys) -> dict with Python values."""
    from .prediction.predict import DEFAULTS
    from .prediction.ledger.config import presets
    PRESETS = presets()  # model.py's, read without importing torch
    known = dict(DEFAULTS, compile=False, activation_memory_budget=1.0)  # compile=True: prediction/compiled
    cfg = {}
    for arg in extra:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"expected --KEY=VALUE, got {arg!r}")
        key, value = arg[2:].split("=", 1)
        if key == "preset":
            if value not in PRESETS:
                raise ValueError(f"unknown preset {value!r}; one of {', '.join(PRESETS)}")
            cfg.update(PRESETS[value])
            continue
        if key not in known:
            raise ValueError(f"unknown config key {key!r}")
        try:
            cfg[key] = literal_eval(value)
        except (ValueError, SyntaxError):
            cfg[key] = value
        if isinstance(known[key], bool) and not isinstance(cfg[key], bool):
            raise ValueError(f"--{key} expects True or False, got {value!r}")
    return cfg


def device(args):
    """The machine to predict for. A GPU not in the table needs its memory and capability:
    guessing them would give a different answer without saying so."""
    from .prediction.predict import GPUS, device_facts, gpu_name
    if args.gpu.lower() == "cpu":
        return device_facts("cpu")
    name = gpu_name(args.gpu)
    if args.memory is not None and args.memory <= 0:
        raise ValueError(f"--memory must be a positive number of bytes, got {args.memory}")
    if name is None:
        if args.memory is None or args.capability is None:
            raise ValueError(f"unknown GPU {args.gpu!r} (known: {', '.join(GPUS)}, cpu); for another GPU give "
                             f"--memory=BYTES and --capability=MAJOR.MINOR")
        major, _, minor = args.capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError(f"--capability expects MAJOR.MINOR such as 9.0, got {args.capability!r}")
        return device_facts("cuda", gpu=args.gpu, capability=(int(major), int(minor)), total_memory=args.memory,
                            **allocator(args))
    return device_facts("cuda", gpu=name, total_memory=args.memory, **allocator(args))


def allocator(args):
    """The allocator settings of this shell (PYTORCH_CUDA_ALLOC_CONF: expandable_segments) and
    the memory outside PyTorch (--outside, else the default estimate)."""
    from .prediction.predict import OUTSIDE_PYTORCH_DEFAULT
    if args.outside is not None and args.outside < 0:
        raise ValueError(f"--outside must be >= 0 bytes, got {args.outside}")
    env = {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")
           if k in os.environ}
    return {"env": env, "outside_pytorch": OUTSIDE_PYTORCH_DEFAULT if args.outside is None else args.outside}


def gpu_config(args, extra):
    """(config, device) for the commands that judge a GPU's memory (fit, plan)."""
    cfg, dev = overrides(extra), device(args)
    if dev["type"] == "cpu" or not dev.get("total_memory"):
        raise ValueError(f"{args.cmd} needs a GPU: --gpu=NAME, or --memory=BYTES with --capability")
    return cfg, dev
