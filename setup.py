"""Builds memory_audit's compiled core (memory_audit/_fastcore.c) in place: `pip install -e .`

The extension is optional: where it cannot be compiled (no C compiler or Python headers),
the install still succeeds and memory_audit uses its pure-Python twins, with the same results,
slower. Dependencies are listed in requirements.txt.
"""

from setuptools import Extension, setup

setup(
    name="nanogpt-memory-audit",
    version="0.2.0",
    packages=["memory_audit", "memory_audit.reading", "memory_audit.naming", "memory_audit.recording",
              "memory_audit.prediction", "memory_audit.prediction.ledger", "memory_audit.prediction.shadow",
              "memory_audit.prediction.shadow.rules", "memory_audit.comparison"],
    ext_modules=[Extension("memory_audit._fastcore", ["memory_audit/_fastcore.c"],
                           extra_compile_args=["-O2"], optional=True)],
)
