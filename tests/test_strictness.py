"""A wrong predictor must fail the checks: a line dropped, a line added, one byte changed.

The predictor is broken here, inside the test (monkeypatched into reconcile), and the shared
`mismatched` rule that tests, sweep and report use must see each break, on a committed CUDA
example and on a fresh CPU audit; intact, it sees nothing.
"""

import copy
import os

import pytest

import memory_audit.comparison.reconcile as reconcile_mod
from conftest import EXAMPLES
from memory_audit.comparison.reconcile import mismatched, reconcile
from memory_audit.comparison.reconcile import prediction_of as real_prediction_of
from memory_audit.comparison.sweep import row_for


def _drop(pred):
    """Remove the first activation line and the first exp_avg line."""
    first_act = next(l for l in pred["ledger"] if l["category"] == "activations")
    first_avg = next(l for l in pred["ledger"] if l["key"].startswith("optimizer/exp_avg/"))
    pred["ledger"] = [l for l in pred["ledger"] if l is not first_act and l is not first_avg]
    return {first_act["key"], first_avg["key"]}


def _add(pred):
    extra = dict(pred["ledger"][-1], key="activations/h.0.attn/spurious.result", category="activations",
                 bytes=512, allocated=512, phases=["step2_before_backward"])
    pred["ledger"].append(extra)
    return {extra["key"]}


def _one_byte(pred):
    line = next(l for l in pred["ledger"] if l["key"].endswith("masked_fill.mask") or l["key"].endswith("gelu.self"))
    line["bytes"] += 1
    line["allocated"] += 1
    return {line["key"]}


@pytest.fixture(params=["committed-cuda", "fresh-cpu"])
def run_dir(request, cpu_run):
    return os.path.join(EXAMPLES, "cuda-tiny-fp16-manual") if request.param == "committed-cuda" else cpu_run


def test_intact_predictor_has_no_mismatch(run_dir):
    assert mismatched(reconcile(run_dir)["rows"]) == []


@pytest.mark.parametrize("brk", [_drop, _add, _one_byte], ids=["drop-lines", "spurious-line", "one-byte"])
def test_each_break_is_caught(run_dir, brk, monkeypatch):
    broken = set()

    def wrong_predict(*args, **kwargs):
        pred = copy.deepcopy(real_prediction_of(*args, **kwargs))
        broken.update(brk(pred))
        return pred
    monkeypatch.setattr(reconcile_mod, "prediction_of", wrong_predict)
    rec = reconcile(run_dir)
    caught = {r["key"] for r in mismatched(rec["rows"])}
    assert broken and broken <= caught, (broken, caught)
    # the sweep's row (what results files and the accuracy table rest on) sees it too
    row = row_for({}, "ok", run_dir, "", 0.0, {})
    assert row["activation_lines_mismatched"] or row["steady_lines_mismatched"]
