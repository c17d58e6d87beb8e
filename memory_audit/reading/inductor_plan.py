"""Inductor's memory plan, read from the Python wrapper it generates for a compiled graph.

Inductor decides every buffer of a compiled graph before it runs: the wrapper's `call(args)`
allocates with `empty_strided_<device>(size, stride, dtype)`, hands a dead buffer on to a new
one (`buf7 = buf3; del buf3  # reuse`, or `reinterpret_tensor(buf3, ...)`), frees with `del`, and
returns the graph's outputs. Replaying those lines gives the bytes the graph holds at every
line, exactly as inductor planned them (no model of fusion or reuse of our own: the plan is
inductor's). Pure Python, no torch: the code is text.

Storage is what counts: a name is a view of a storage, a storage is freed when its last name is
deleted, and an input whose storage the caller still holds (weights, the batch, an output the
loop keeps) is never freed by the graph.
"""

import re

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1, "float64": 8,
            "int8": 1, "uint8": 1, "int16": 2}

_ALLOC = re.compile(r"^(\w+) = empty_strided_\w+\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)$")
_VIEW = re.compile(r"^(\w+) = reinterpret_tensor\((\w+),")
_ALIAS = re.compile(r"^(\w+) = (\w+)$")
_ASSIGN = re.compile(r"^(\w+) = (.+)$")
_REINTERPRET = re.compile(r"reinterpret_tensor\((\w+),")
_ITEM = re.compile(r"^(\w+) = (\w+)\[(\d+)\]$")
_ASSERT = re.compile(r"^assert_size_stride\((\w+), \(([^)]*)\), \(([^)]*)\)")
_EXTERN = re.compile(r"^extern_kernels\.(\w+)\((.*)\)$")
_FALLBACK = re.compile(r"^\w+ = torch\.ops\.(aten\.\w+\.\w+)\((.*)\)$")
_LITERAL = {"True": True, "False": False, "None": None}
_LIST = re.compile(r"^\[((True|False|-?\d+)(, )?)*\]$")
_REINTERPRET_ARG = re.compile(r"^reinterpret_tensor\((\w+), \(([^)]*)\), \(([^)]*)\), [^)]*\)$")


class PlanError(ValueError):
    """The wrapper has a line whose memory this reader cannot tell."""


def _ints(text):
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def strided_bytes(size, stride, dtype):
    """Bytes empty_strided allocates: the span of the strides, times the item size."""
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * ITEMSIZE[dtype]


def _call_lines(code):
    lines = code.splitlines()
    start = next((i for i, l in enumerate(lines) if re.match(r"^\s*def call\((self, )?args\):", l)), None)
    if start is None or start + 1 >= len(lines):
        raise PlanError("no `def call(args)` in the generated wrapper")
    indent = len(lines[start + 1]) - len(lines[start + 1].lstrip())
    end = next((j for j in range(start + 1, len(lines))
                if lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) < indent), len(lines))
    return lines[start:end]


def asserted(code, name):
    """(size, stride) the wrapper asserts for its input `name`, or None where it asserts none."""
    for stmt in call_body(code):
        m = _ASSERT.match(stmt)
        if m and m.group(1) == name:
            return _ints(m.group(2)), _ints(m.group(3))
    return None


def call_function(code):
    """The wrapper's `call` function alone (its memory plan; the kernels' source left out)."""
    return "\n".join(_call_lines(code)) + "\n"


def call_body(code):
    """The statements of the wrapper's `call(args)`, one per list item ("a; b" split)."""
    body = []
    for l in _call_lines(code)[1:]:
        s = l.strip().split("  #")[0]
        if s and not s.startswith("#"):
            body += [part.strip() for part in s.split("; ")]
    return body


def replay(code, inputs, held=frozenset(), tag="buf", layouts=None, kernel=None, count=None):
    """Replay a wrapper's memory plan.

    inputs: {input name: (storage id, bytes)}; names that share a storage id are one storage.
    held: storage ids the caller keeps alive (never freed by the graph). tag: the prefix of the
    storage ids of the buffers this graph makes ("<tag>:<name>@<line>"), unique per graph.
    layouts: {buffer name: [size, stride, dtype]} (compiled.buffer_layouts), which sizes what a
    fallback kernel returns (`buf7 = torch.ops.aten.<op>(...)`, `buf8 = buf7[0]`).
    kernel(op, args, kwargs): what an extern kernel (`extern_kernels.mm(a, b, out=buf4)`) or a
    fallback kernel (`buf7 = torch.ops.aten.<op>.<overload>(...)`, op "aten.<op>.<overload>")
    allocates inside itself, outputs included: [("alloc", output index or None, bytes) | ("free",
    index of the alloc entry, bytes) | ("host", output index, 0): an output kept on the host, which
    its `bufN = bufM[k]` line then sizes 0]; None where it is not asked; a reason (str) where it would
    be asked but cannot be (listed in "unasked"). Its tensors are given as (size, stride, dtype).
    What it holds at its busiest counts at that line (_Kernels.held), its own buffers named
    "unplanned" in peak_live as the audit names allocations inside a compiled kernel. layouts
    also give the inputs' dtypes. count(bytes): what the device counts for a buffer of that many
    bytes (CUDA: the caching allocator's 512 B rounding), which decides the busiest line; default
    the bytes themselves.
    Returns {"inputs": [names], "peak": bytes above the start, "peak_line": index,
    "end": bytes above the start once it has returned (its locals gone), "outputs": [(storage id, bytes) per output],
    "peak_live": {name: bytes of buffers made by the graph, live at the peak},
    "freed_at_peak": [storage ids of inputs already freed at the peak], "allocations": [[name,
    bytes] of each buffer made, in order], "unasked": [(line, op, reason)] (kernel's)}.
    """
    body = call_body(code)
    order = next(([n.strip() for n in stmt[:-len("= args")].split(",") if n.strip()]
                  for stmt in body if stmt.endswith("= args")), [])
    sizing = {"layouts": layouts or {}, "tuples": {m.group(2) for m in map(_ITEM.match, body) if m}, "host": set()}
    plan = _Storages(inputs, order, held, tag, sizing, count or (lambda n: n))
    kernels = _Kernels(kernel, layouts or {}, order, sizing) if kernel else None
    peak, peak_line, peak_live, freed_at_peak = 0, -1, {}, []
    for i, stmt in enumerate(body):
        inside = kernels.held(i, stmt, body) if kernels else {}  # what a kernel holds inside the line
        if stmt.startswith("return "):
            return dict(plan.returned(stmt), inputs=order, peak=peak, peak_line=peak_line, peak_live=peak_live,
                        freed_at_peak=freed_at_peak, allocations=plan.allocations,
                        unasked=kernels.unasked if kernels else [])
        plan.run(i, stmt)
        busy = plan.live + sum(plan.count(n) for n in inside.values())
        if busy > peak:
            peak, peak_line = busy, i
            peak_live = dict(plan.buffers(), **inside)
            freed_at_peak = list(plan.freed)
    raise PlanError("the wrapper's call(args) has no return")


class _Storages:
    """The storages a wrapper's names stand for while its call runs: a storage is freed when its
    last name is deleted, unless the caller holds it (`held`); `live` is the bytes the graph has
    added above its start."""

    def __init__(self, inputs, order, held, tag, sizing, count):
        self.names, self.storages, self.size = {}, {}, {}  # name -> storage; storage -> names; storage -> bytes
        for n in order:
            sid, nbytes = inputs.get(n, (f"input:{n}", 0))
            self.names[n] = sid
            self.storages.setdefault(sid, set()).add(n)
            self.size[sid] = nbytes
        self.input_sids, self.held, self.tag, self.sizing = {self.names[n] for n in order}, held, tag, sizing
        self.count = count
        self.live = 0
        self.made, self.freed = {}, []  # storages the graph allocated -> first name; inputs it freed
        self.allocations = []  # [name, bytes] of every buffer it makes, in order (what the trace shows)

    def run(self, i, stmt):
        """One statement of the call before its return: a `del`, or an assignment."""
        if stmt.startswith("del "):
            for n in stmt[4:].split(","):
                self.drop(n.strip())
        elif not (stmt.endswith("= args") or stmt == "args.clear()") and _ASSIGN.match(stmt):
            target = _ASSIGN.match(stmt).group(1)
            if target in self.names:  # a name bound again: what it named loses it first
                self.drop(target)
            grew = _assign(stmt, self.names, self.storages, self.size, self.made, f"{self.tag}:{{}}@{i}", self.sizing)
            if grew:
                self.allocations.append([target, grew])
            self.live += self.count(grew)

    def drop(self, name):
        sid = self.names.pop(name, None)
        if sid is None:
            return
        self.storages[sid].discard(name)
        if not self.storages[sid] and sid not in self.held:
            self.live -= self.count(self.size[sid])
            self.made.pop(sid, None)
            if sid in self.input_sids:
                self.freed.append(sid)

    def buffers(self):
        """{buffer name: bytes} of what the graph made and holds (a tuple result holds nothing)."""
        return {self.made[s]: self.size[s] for s in self.made if self.size[s]}

    def returned(self, stmt):
        """What the `return` statement hands back: outputs, their buffers, and the bytes left."""
        outputs = []
        for item in _split_top(stmt[len("return "):].strip().strip("()")):
            m = _REINTERPRET.match(item)
            ref = m.group(1) if m else item
            outputs.append((self.names[ref], self.size[self.names[ref]]) if ref in self.names else (None, 0))
        returned = {sid for sid, _ in outputs}
        return {"outputs": outputs, "output_buffers": [self.made.get(sid) for sid, _ in outputs],
                "end": self.live - sum(self.count(self.size[s]) for s in self.made if s not in returned)}  # the call's locals die


class _Kernels:
    """What the kernels a wrapper calls hold inside themselves, line by line (replay's `kernel`):
    the layout each name has (an allocation, a view, an alias, an input's assert line, its dtype
    from `layouts` where the line does not say), each extern or fallback call's tensors read from
    them, and the calls that would be asked but could not be (`unasked`: [(line, op, reason)])."""

    def __init__(self, kernel, layouts, inputs, sizing):
        self.kernel, self.layouts, self.tuples, self.unasked = kernel, layouts, sizing["tuples"], []
        self.host = sizing["host"]  # names of a tuple's outputs the kernel keeps on the host
        self.shape_of = {n: list(layouts[n]) for n in inputs if n in layouts}  # name -> [size, stride, dtype]

    def held(self, i, stmt, body):
        """{name: bytes} the call on this line holds at its busiest beyond what the line's own
        assignment sizes: its buffers as "unplanned", and a tuple result's outputs (sized later, at
        their `bufN = bufM[k]` lines) by those lines' names."""
        self._note(stmt)
        m = _EXTERN.match(stmt) or _FALLBACK.match(stmt)
        if m is None:
            return {}
        call = _call_layouts(m, self.shape_of)
        answer = self.kernel(*call) if call else "a tensor's layout is not in the wrapper"
        if isinstance(answer, str):
            self.unasked.append((i, m.group(1), answer))
            return {}
        target = stmt.split("=", 1)[0].strip() if _FALLBACK.match(stmt) else None
        items = {int(k.group(3)): k.group(1) for k in map(_ITEM.match, body[i + 1:i + 64])
                 if k and k.group(2) == target} if target in self.tuples else {}
        self.host.update(items[j] for action, j, _ in answer or () if action == "host" and j in items)
        return _busiest(answer or (), items)

    def _note(self, stmt):
        shape_of = self.shape_of
        m = _ALLOC.match(stmt)
        if m:
            shape_of[m.group(1)] = [_ints(m.group(2)), _ints(m.group(3)), m.group(4)]
            return
        m = _ASSERT.match(stmt)
        if m:
            shape_of[m.group(1)] = [_ints(m.group(2)), _ints(m.group(3)), (shape_of.get(m.group(1)) or [0, 0, None])[2]]
            return
        m = _VIEW.match(stmt)
        view = m and _REINTERPRET_ARG.match(stmt.split("=", 1)[1].strip())
        if view:
            shape_of[m.group(1)] = [_ints(view.group(2)), _ints(view.group(3)), (shape_of.get(m.group(2)) or [0, 0, None])[2]]
            return
        m = _ALIAS.match(stmt)
        name = stmt.split("=", 1)[0].strip()
        if m and m.group(2) in shape_of:
            shape_of[m.group(1)] = shape_of[m.group(2)]
        elif m is None and _ASSIGN.match(stmt) and name in self.layouts:
            shape_of[name] = self.layouts[name]


def _call_layouts(m, shape_of):
    """(op, args, kwargs) of a kernel call (an _EXTERN or _FALLBACK match), each tensor as (size,
    stride, dtype), or None where a tensor's layout is not in the wrapper. A tensor whose dtype
    the wrapper does not say (an input) takes the out= buffer's: the matmuls inductor calls take
    one dtype."""
    args, kwargs = [], {}
    for item in _split_top(m.group(2)):
        key, value = item.split("=", 1) if re.match(r"^\w+=", item) else (None, item)
        view = _REINTERPRET_ARG.match(value)
        if view:
            v = [_ints(view.group(2)), _ints(view.group(3)), (shape_of.get(view.group(1)) or [0, 0, None])[2]]
        elif value in shape_of:
            v = list(shape_of[value])
        elif re.match(r"^-?[\d.]+(e-?\d+)?$", value):
            v = float(value) if any(c in value for c in ".e") else int(value)
        elif value in _LITERAL:
            v = _LITERAL[value]
        elif _LIST.match(value):  # a list of literals ([True, True, True, False]), passed as a list
            v = [_LITERAL[x] if x in _LITERAL else int(x) for x in _split_top(value[1:-1])]
        else:
            return None
        if key:
            kwargs[key] = v
        else:
            args.append(v)
    out = kwargs.get("out")
    dtype = out[2] if isinstance(out, list) else None

    def fixed(v):  # a tensor's [size, stride, dtype] as a tuple; a list of literals stays a list
        return (tuple(v[0]), tuple(v[1]), v[2] or dtype) if isinstance(v, list) and v and isinstance(v[0], list) else v
    args, kwargs = [fixed(a) for a in args], {k: fixed(v) for k, v in kwargs.items()}
    if any(isinstance(v, tuple) and (v[2] is None or len(v[0]) != len(v[1])) for v in args + list(kwargs.values())):
        return None
    return m.group(1), args, kwargs


def _busiest(entries, items):
    """{name: bytes} at the busiest moment of a kernel's entries: its own buffers as "unplanned",
    its outputs under `items`' names ({output index: name}; outputs not listed are the line's own
    buffer, already counted)."""
    live, best, top = {}, {}, 0
    for j, (action, out, nbytes) in enumerate(entries):
        if action == "alloc":
            live[j] = (out, nbytes)
        elif action == "free":
            live.pop(out, None)
        counted = {}
        for o, n in live.values():
            name = "unplanned" if o is None else items.get(o)
            if name is not None:
                counted[name] = counted.get(name, 0) + n
        if sum(counted.values()) > top:
            top, best = sum(counted.values()), counted
    return best


def _assign(stmt, names, storages, size, made, sid_format, sizing):
    """One assignment: a new buffer (returns its bytes) or a new name for an existing storage.
    sizing: {"layouts": buffer layouts, "tuples": names of multi-output kernels' results, "host":
    names of outputs a kernel keeps on the host}."""
    layouts = sizing["layouts"]
    m = _ALLOC.match(stmt)
    if m:
        return _new(m.group(1), strided_bytes(_ints(m.group(2)), _ints(m.group(3)), m.group(4)),
                    names, storages, size, made, sid_format)
    m = _VIEW.match(stmt) or _ALIAS.match(stmt)
    if m and m.group(2) in names:
        _bind(m.group(1), names[m.group(2)], names, storages)
        return 0
    name = stmt.split("=", 1)[0].strip()
    if _ITEM.match(stmt) or (name.startswith("buf") and "(" in stmt):  # a fallback kernel's output(s)
        if name in sizing["host"]:  # an output the kernel keeps on the host (a philox seed)
            return _new(name, 0, names, storages, size, made, sid_format)
        if name in layouts:
            return _new(name, strided_bytes(*layouts[name]), names, storages, size, made, sid_format)
        if name in sizing["tuples"]:  # several outputs: the tuple itself holds no memory of its own
            return _new(name, 0, names, storages, size, made, sid_format)
    if name.startswith("buf"):
        raise PlanError(f"a buffer made by a call this reader cannot size: {stmt[:120]}")
    return 0


def _new(name, nbytes, names, storages, size, made, sid_format):
    sid = sid_format.format(name)
    _bind(name, sid, names, storages)
    size[sid] = nbytes
    made[sid] = name
    return nbytes


def _bind(name, sid, names, storages):
    old = names.get(name)
    if old is not None:
        storages[old].discard(name)
    names[name] = sid
    storages.setdefault(sid, set()).add(name)


def _split_top(text):
    """Split 'a, f(b, c), d' at the top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class PlanCursor:
    """Names the allocations compiled wrappers make in a trace by the buffers of their plans
    (compiled.wrapper_entry's "allocations"). Within each call of a wrapper file the buffers come
    in the plan's order, so the k-th allocation is the k-th buffer when its size is one of
    `sizes(planned bytes)` (what a trace may show: CUDA rounds to 512 B), else "unplanned" (an
    allocation inside a kernel). Feed it the trace's allocations in order."""

    def __init__(self, wrappers, sizes=lambda nbytes: (nbytes,)):
        self.plans = {w["file"]: w for w in wrappers or () if w.get("allocations")}
        self.pos = dict.fromkeys(self.plans, 0)
        self.sizes = sizes

    def file_of(self, frames):
        """The planned wrapper whose `call` the stack is in, else None."""
        return next((f["filename"] for f in frames or () if f.get("name") == "call" and f.get("filename") in self.plans),
                    None)

    def name(self, path, size):
        """"<forward|backward>/<buffer>" for the next allocation of wrapper `path`."""
        w = self.plans[path]
        buf, nbytes = w["allocations"][self.pos[path] % len(w["allocations"])]
        if size in self.sizes(nbytes):
            self.pos[path] += 1
        else:
            buf = "unplanned"
        return f"{w['kind']}/{buf}"
