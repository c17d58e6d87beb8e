"""Independent predictions on every CPU this process may use (plan's options: issue #26's speed).

Each of plan's options is a shadow run of its own config, and none reads another's. Where more
than one CPU is free and the platform forks, they run in forked worker processes, which start
with what the parent has already imported and cached (torch, the meta-kernel cache, the
baseline's run); each returns need()'s plain dict. The results are the same as one process's
(test_cli); with one CPU, or jobs=1, nothing forks.
"""

import multiprocessing
import os


def cpus():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def mapped(fn, items, jobs=None):
    """[fn(item) for item in items], in that order, on up to `jobs` forked workers (default:
    cpus()). fn must be a module-level function; an exception in a worker is raised here.
    Items are handed out one at a time in the order given: put the longest first."""
    items = list(items)
    jobs = min(jobs or cpus(), len(items))
    if jobs < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(item) for item in items]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(fn, items, chunksize=1)
