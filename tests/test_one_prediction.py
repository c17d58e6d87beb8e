"""One prediction wherever a user looks: train.py --audit's report, `report`, `predict`, `fit` and
`plan` read prediction() and print the same peak for the same config. Ten configs drawn at random
(seed printed; SHADOW_SEED replays it) over sweep.random_config's space."""

import json
import os
import random

import pytest

from conftest import run_train
from memory_audit.cli import main
from memory_audit.comparison.sweep import random_config

SEED = int(os.environ["SHADOW_SEED"])  # conftest draws it once per run
N = 10


def _configs():
    rng = random.Random(SEED * 7 + 1)  # not test_shadow's draws
    return [random_config(rng) for _ in range(N)]


def _cli(capsys, *args):
    capsys.readouterr()
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def _args(cfg):
    return ["--preset=cpu-tiny"] + [f"--{k}={v}" for k, v in cfg.items()]


@pytest.mark.parametrize("i", range(N))
def test_audit_report_and_predict_print_the_same_peak(tmp_path, capsys, i):
    """A CPU audit's report (train.py --audit; `report` on the run again) and `predict --gpu=cpu`:
    one peak, the measured one."""
    cfg = _configs()[i]
    print(f"seed {SEED} (replay: SHADOW_SEED={SEED}), config {i}: {cfg}")
    p = run_train("--audit", "--device=cpu", f"--audit_dir={tmp_path}", "--run_name=r", *_args(cfg), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    run = os.path.join(tmp_path, "r")
    with open(os.path.join(run, "report.json")) as f:
        audited = json.load(f)["totals"]["peak"]
    assert main(["report", run, "--repredict"]) == 0  # made again here, not read back
    with open(os.path.join(run, "report.json")) as f:
        reported = json.load(f)["totals"]["peak"]
    predicted = _cli(capsys, "predict", "--gpu=cpu", "--json", *_args(cfg))["totals"]["peak_allocated_bytes"]
    assert audited["predicted"] == reported["predicted"] == predicted, (cfg, audited, reported, predicted)
    assert predicted == audited["actual"], f"seed {SEED} config {i} {cfg}: predicted {predicted:,} B, " \
                                           f"measured {audited['actual']:,} B"


def test_predict_fit_and_plan_print_the_same_prediction_on_a_gpu(capsys):
    """On an H100 (no GPU here): `predict`'s peak and reserved memory are plan's baseline row,
    and fit's need at batch 1 is predict's reserved memory at batch 1 plus what CUDA holds
    outside PyTorch."""
    for i, cfg in enumerate(_configs()):
        args = _args(cfg) + ["--gpu=H100"]
        t = _cli(capsys, "predict", "--json", *args)["totals"]
        base = _cli(capsys, "plan", "--json", "--jobs=1", *args)["baseline"]
        assert (base["allocated_peak"], base["reserved_peak"], base["from"]) == \
            (t["peak_allocated_bytes"], t["reserved_peak_bytes"], t["from"]), (i, cfg)
        fit = _cli(capsys, "fit", "--json", *args)
        one = _cli(capsys, "predict", "--json", *_args(dict(cfg, batch_size=1)), "--gpu=H100")["totals"]
        assert fit["batch_1_need"] == one["reserved_peak_bytes"] + one["outside_pytorch_bytes"], (i, cfg)
        assert t["from"].startswith("shadow run"), (i, cfg, t["from"])
