"""data/prepare.py tokenizes offline with GPT-2's BPE; train.py reads what it wrote."""

import os
import shutil
import subprocess
import sys

import numpy as np

from conftest import ROOT, run_train

TEXT = "Hello world. " * 400 + "Memory accounting for transformers, byte by byte.\n" * 50


def _prepare(tmp_path, name):
    """Tokenize TEXT into data/<name>/ with data/prepare.py; returns that folder."""
    src = tmp_path / f"{name}.txt"
    src.write_text(TEXT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "data", "prepare.py"), str(src), f"--name={name}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return os.path.join(ROOT, "data", name)


def test_prepare_then_train(tmp_path):
    name = "pytest_tiny_corpus"
    out = os.path.join(ROOT, "data", name)
    try:
        _prepare(tmp_path, name)
        ids = np.fromfile(os.path.join(out, "train.bin"), dtype=np.uint16)
        assert list(ids[:2]) == [15496, 995]  # "Hello world", as tiktoken's gpt2 encodes it
        t = run_train("--device=cpu", "--preset=cpu-tiny", "--vocab_size=50304", "--batch_size=2",
                      "--max_iters=2", f"--dataset={name}")
        assert t.returncode == 0, t.stderr
        assert f"data: {out}/train.bin (GPT-2 tokens)" in t.stdout
        t = run_train("--device=cpu", "--preset=cpu-tiny", "--batch_size=2", "--max_iters=2", f"--dataset={name}")
        assert t.returncode == 2 and "vocab_size=512 is too small" in t.stderr
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_prepare_refuses_an_empty_file(tmp_path):
    src = tmp_path / "empty.txt"
    src.write_text("")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "data", "prepare.py"), str(src)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "is empty" in p.stderr and "Traceback" not in p.stderr


def test_audit_on_prepared_data_names_every_byte(tmp_path):
    """Batches read from a memmap (torch.from_numpy over numpy's memory) leave nothing
    unattributed, and every line is predicted to the byte."""
    from memory_audit.comparison.reconcile import mismatched, reconcile
    name = "pytest_audit_corpus"
    out = os.path.join(ROOT, "data", name)
    try:
        _prepare(tmp_path, name)
        t = run_train("--device=cpu", "--preset=cpu-tiny", "--vocab_size=50304", "--batch_size=2", "--audit",
                      f"--dataset={name}", f"--audit_dir={tmp_path}", "--run_name=r")
        assert t.returncode == 0, t.stderr
        rec = reconcile(str(tmp_path / "r"))
        assert rec["unattributed_bytes"] == 0
        assert mismatched(rec["rows"], skip=()) == [] and rec["totals"]["peak"]["diff"] == 0
    finally:
        shutil.rmtree(out, ignore_errors=True)
