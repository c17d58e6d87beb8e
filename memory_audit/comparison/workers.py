"""Independent predictions on every CPU this process may use (plan's options: issue #26's speed).

Each of plan's options is a shadow run of its own config, and none reads another's. Where more
than one CPU is free and the platform forks, they run in forked worker processes, which start
with what the parent has already imported and cached; each returns need()'s plain dict. The
results are the same as one process's (test_cli); with one CPU, or jobs=1, nothing forks. A
worker that dies (killed, out of memory) ends the command with one line, never a hang.
"""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool


def cpus():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def mapped(fn, items, jobs=None):
    """[fn(item) for item in items], in that order, on up to `jobs` forked workers (default:
    cpus()). fn must be a module-level function; an exception in a worker is raised here.
    Items are handed out in the order given: put the longest first."""
    items = list(items)
    jobs = min(jobs or cpus(), len(items))
    if jobs < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(item) for item in items]
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(fn, items))
    except BrokenProcessPool:
        raise ValueError(f"a worker process died ({jobs} at once; killed, or out of memory?): "
                         f"run with --jobs=1 to use this process alone") from None
