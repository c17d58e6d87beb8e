"""torch.cuda's streams and events as a shadow run meets them without a GPU. Stream: an id, no
graph being captured, nothing recorded or waited for (the shadow runs in program order, and the
caching allocator frees without record_stream). Streams: the device handle FSDP2 calls on its
GPU path (patches.fsdp_on_gpu): each stream it makes a new id, and `stream(s)` makes that id the
one the tracker's allocations are made on (tracker.stream: the caching allocator keeps a pool per
stream). Plain Python.
"""

import contextlib


class Stream:
    def __init__(self, sid=0):
        self.id = sid

    def __eq__(self, other):
        return isinstance(other, Stream) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def is_capturing(self):  # the optimizers ask whether a CUDA graph is being captured
        return False

    def synchronize(self):
        return None

    def record_event(self, event=None):
        return event or Event()

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class Event:
    def record(self, stream=None):
        return self

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class Streams:
    """torch.cuda's stream API as FSDP2 calls it: Stream() a new id, stream(s) the one the
    tracker's allocations are made on inside, events and waits nothing."""

    def __init__(self, tracker):
        self.tracker, self.made = tracker, 0

    def Stream(self, priority=0):
        self.made += 1
        return Stream(self.made)

    def current_stream(self):
        return Stream(self.tracker.stream)

    def current_device(self):
        return 0

    def Event(self, *args, **kwargs):
        return Event()

    @contextlib.contextmanager
    def stream(self, s):
        outer = self.tracker.stream
        self.tracker.stream = outer if s is None else s.id
        try:
            yield
        finally:
            self.tracker.stream = outer
