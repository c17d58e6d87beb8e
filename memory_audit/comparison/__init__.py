"""The comparison side: prediction beside measurement.

reconcile (line by line, phase by phase, the first divergent event) -> report (report.md and
report.json) and diff (two runs); views (the tables README and the notebook show), sweep
(grids of audited runs, committed rows), plan (fit and plan: which settings fit a GPU).
"""
