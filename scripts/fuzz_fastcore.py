"""Driver for scripts/fuzz_fastcore_asan.sh: PKG_DIR SEED COUNT."""

import glob
import os
import random
import sys

import numpy as np

pkg_dir, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, pkg_dir)
from memory_audit import _fastcore as core  # noqa: E402  (the ASan build)

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sources = sorted(glob.glob(os.path.join(root, "snapshots", "examples", "*", "*.pickle"))) + \
    sorted(glob.glob(os.path.join(os.path.dirname(root), "shared", "fixtures", "foreign_snapshots", "*.pickle")))[:8]
rng = random.Random(seed)
path = os.path.join(pkg_dir, "mutated.pickle")
taken = 0
for k in range(count):
    b = bytearray(open(sources[k % len(sources)], "rb").read())
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        b = b[:rng.randrange(1, len(b))]
    elif kind == 2:
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        b = b[:i] + b[j:]
    else:
        i, j = rng.randrange(len(b)), rng.randrange(len(b))
        b[i:i] = b[j:j + rng.randint(1, 64)]
    with open(path, "wb") as f:
        f.write(bytes(b))
    res = core.scan(path)
    if res is not None:  # touch everything it returned
        taken += 1
        top, lists, columns, _ = res
        repr(top)
        for _, kind, data, table, itemsize in columns:
            np.frombuffer(data, np.int64 if kind == 1 else np.dtype(f"i{itemsize}")).sum()
            repr(table)
        for _, rows in lists:
            if not isinstance(rows, tuple):  # (first, count) for a run of rows
                np.frombuffer(rows, np.int64).sum()
nr = np.random.default_rng(seed)
for _ in range(200):
    n = 2000
    core.replay(nr.integers(0, 9, n).astype(np.uint8), nr.integers(0, 40, n) * 512,
                nr.integers(0, 3 << 20, n), bool(nr.integers(0, 2)))
print(f"{count} mutated files decoded ({taken} valid ones taken), 200 random replays: no memory error")
