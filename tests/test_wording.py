"""Tracked text says what the project is, not how it was developed: no numbered work periods,
no borrowed machines or their time budgets, no "was X, now Y" (STYLE.md: git log keeps
history; a commit or a date says when, a GPU's name says where)."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")

# Each pattern is written in pieces, so that this file's own source does not match it.
S = "sess" + "ion"
NARRATION = [re.compile(p, re.I) for p in (
    rf"\b{S}s?[- ]\d+",                                  # a numbered work period, its rules, its code
    rf"\b{S}s? (?:ago|before|after|since)\b",
    rf"\b(?:this|last|next|previous|earlier|later) {S}\b",
    rf"\b(?:GPU|CPU|H100|H200|device) {S}\b",
    r"\b" + "le" + r"nt\b",                              # a machine handed over for a while
    r"\b" + "le" + r"ase\b",
    r"\b" + "device" + r" time\b",
    r"\bwhen a GPU is (?:next |)(?:avail" + r"able|here)\b",
    r"\bno GPU " + r"(?:since|in between)\b",
    r"\b(?:before|after|since) the " + r"fix\b",
    r"\b(?:was|were) (?:[^.;|]|\.(?=\d)){1,40}, " + r"now\b",  # "was X, now Y"
)]
TEXT = (".md", ".py", ".sh", ".txt", ".toml", ".cfg", ".c", ".h")


def _tracked():
    """The tracked text files to read: README, docs, scripts, the package, tests, examples, the
    nanoGPT files, and under snapshots/ the READMEs only (the rest are data: .json, .jsonl,
    .ipynb and pickles are never read)."""
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs git and the repository's .git")
    p = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"git ls-files failed: {p.stderr.strip()}")
    paths = []
    for path in p.stdout.split("\0"):
        if not path or path == HERE:
            continue
        if path.startswith("snapshots/"):
            if os.path.basename(path) == "README.md":
                paths.append(path)
        elif path.endswith(TEXT) or (path.startswith(("scripts/", ".ci/")) and "." not in os.path.basename(path)):
            paths.append(path)
    return paths


def narration(text):
    """[(line number, the phrase)] for each line of `text` that tells development history."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern in NARRATION:
            m = pattern.search(line)
            if m:
                found.append((n, m.group(0)))
    return found


def test_the_patterns_catch_narration_and_spare_technical_words():
    said = ["measured in " + S + " 24 on a " + "le" + "nt H200",
            "the " + S + "-18 code", S + " 12's rules", "two " + S + "s ago",
            "15 minutes of " + "device" + " time", "a 15-minute " + "le" + "ase",
            "no GPU " + "since cb9b33a", "unit-tested, but nothing ran since the " + "fix",
            "the peak was 1.49%, " + "now 0.10%", "the next " + S + "'s first call"]
    for line in said:
        assert narration(line), line
    spared = ["tiny CPU audits made once per " + S, "pytest_" + S + "start(" + S + ")",
              "@pytest.fixture(scope=\"" + S + "\")", "<" + S + " tmp>/shared/<name>",
              "PyBuffer_Re" + "lease(&act)", "segments are never re" + "leased inside a step",
              "measured on an H200 (torch 2.11), 2026-11-26; commit 9330377", "excel" + "lent",
              "a jupyter " + S, "the loop holds each step's output until the next"]
    for line in spared:
        assert not narration(line), line


def test_no_tracked_file_narrates_how_the_project_was_developed():
    bad = []
    paths = _tracked()
    assert any(p == "README.md" for p in paths) and any(p.startswith("docs/") for p in paths)
    for path in paths:
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):  # deleted in the working tree, not yet in the index
            continue
        with open(full, "rb") as f:
            raw = f.read()
        if b"\0" in raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        bad += [f"{path}:{n}: {phrase!r}" for n, phrase in narration(text)]
    assert not bad, ("development history in tracked text (say what is: a command, a commit, a date, "
                     "a GPU's name; STYLE.md):\n" + "\n".join(bad))
