/* Compiled core of memory_audit: a plain-data pickle decoder that stores trace entries as
 * columns, and the allocator replay over those columns.
 *
 * scan(path) decodes a snapshot pickle without ever calling into Python code: only the opcodes
 * of plain data (dict, list, tuple, set, str, bytes, int, float, bool, None, memo, framing) are
 * understood. Anything else (a global, a reduce, a persistent id, protocol-0 text opcodes) or
 * any inconsistency makes it return None, and the caller falls back to the restricted
 * pickle.Unpickler, which then refuses or reports the file. So this decoder never decides
 * that a file is bad; it only decides that it can take the fast road.
 *
 * A dict whose first key is "action" (a trace entry, as every torch version writes them) is
 * not built as a dict: it becomes a row of int64 columns (ints kept as they are, other values
 * as indexes into a table of distinct objects). Lists of such rows are returned with their
 * row numbers. Lists used as column values (a traceback's frames) are shared by content, so
 * a million entries do not keep a million equal frames lists alive.
 *
 * replay(action, addr, size, cpu) follows the caching allocator's block rules over a trace
 * (the same rules as allocator_sim.py, which is the reference) and returns, per entry, the
 * bytes memory_allocated() gained or lost and the index of the matching alloc / free.
 *
 * model(alloc, size, id, expandable) plays a predicted sequence of requests and frees through
 * the caching allocator's model (reading/allocator_model.CachingAllocatorModel, the reference), choosing each
 * block's address and making segments as it goes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#if PY_VERSION_HEX < 0x030B0000 /* PyFloat_Unpack8 became public in 3.11 */
#define PyFloat_Unpack8(p, le) _PyFloat_Unpack8((const unsigned char *)(p), (le))
#endif

/* ------------------------------------------------------------------ hash map int64 -> int64 */
/* open addressing, linear probing, backward-shift deletion; keys are any int64 */
typedef struct {
    int64_t *keys;
    int64_t *vals;
    uint8_t *used;
    size_t cap; /* power of two */
    size_t n;
} Map;

static int map_init(Map *m, size_t cap) {
    size_t c = 16;
    while (c < cap * 2) c <<= 1;
    m->keys = calloc(c, sizeof(int64_t));
    m->vals = calloc(c, sizeof(int64_t));
    m->used = calloc(c, 1);
    m->cap = c;
    m->n = 0;
    return (m->keys && m->vals && m->used) ? 0 : -1;
}

static void map_free(Map *m) {
    free(m->keys); free(m->vals); free(m->used);
    m->keys = m->vals = NULL; m->used = NULL; m->cap = m->n = 0;
}

static inline size_t map_hash(int64_t k, size_t cap) {
    uint64_t x = (uint64_t)k;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static inline int64_t *map_find(Map *m, int64_t k) {
    size_t i = map_hash(k, m->cap);
    while (m->used[i]) {
        if (m->keys[i] == k) return &m->vals[i];
        i = (i + 1) & (m->cap - 1);
    }
    return NULL;
}

static int map_put(Map *m, int64_t k, int64_t v);

static int map_grow(Map *m) {
    Map bigger;
    if (map_init(&bigger, m->cap) < 0) { map_free(&bigger); return -1; }
    for (size_t i = 0; i < m->cap; i++)
        if (m->used[i]) map_put(&bigger, m->keys[i], m->vals[i]);
    map_free(m);
    *m = bigger;
    return 0;
}

static int map_put(Map *m, int64_t k, int64_t v) {
    if ((m->n + 1) * 2 > m->cap && map_grow(m) < 0) return -1;
    size_t i = map_hash(k, m->cap);
    while (m->used[i]) {
        if (m->keys[i] == k) { m->vals[i] = v; return 0; }
        i = (i + 1) & (m->cap - 1);
    }
    m->used[i] = 1; m->keys[i] = k; m->vals[i] = v; m->n++;
    return 0;
}

/* remove k; returns 1 and its value in *out when it was there */
static int map_pop(Map *m, int64_t k, int64_t *out) {
    size_t i = map_hash(k, m->cap);
    while (m->used[i]) {
        if (m->keys[i] == k) break;
        i = (i + 1) & (m->cap - 1);
    }
    if (!m->used[i]) return 0;
    if (out) *out = m->vals[i];
    m->used[i] = 0; m->n--;
    size_t j = i;
    for (;;) { /* shift back the entries that probed past the hole */
        j = (j + 1) & (m->cap - 1);
        if (!m->used[j]) break;
        size_t home = map_hash(m->keys[j], m->cap);
        int between = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (between) continue;
        m->keys[i] = m->keys[j]; m->vals[i] = m->vals[j]; m->used[i] = 1; m->used[j] = 0;
        i = j;
    }
    return 1;
}

/* ----------------------------------------------------------------- a column handed over */
/* A malloc'd buffer given to Python without a copy (numpy.frombuffer reads it in place; the
 * buffer is freed with the last view): copying ten million entries' columns out would touch
 * as many fresh pages again as the scan itself. */
typedef struct { PyObject_HEAD void *p; Py_ssize_t len; } Buf;

static int buf_get(PyObject *self, Py_buffer *view, int flags) {
    Buf *b = (Buf *)self;
    return PyBuffer_FillInfo(view, self, b->p, b->len, 1, flags);
}

static void buf_dealloc(PyObject *self) {
    free(((Buf *)self)->p);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs buf_procs = {buf_get, NULL};

static PyTypeObject BufType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "memory_audit._fastcore.Buffer",
    .tp_basicsize = sizeof(Buf),
    .tp_dealloc = buf_dealloc,
    .tp_as_buffer = &buf_procs,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "bytes of a scanned column, read through the buffer protocol",
};

/* takes p (shrunk to len bytes); on failure frees it and returns NULL */
static PyObject *buf_new(void *p, size_t len) {
    void *q = len ? realloc(p, len) : p; /* shrinking a big block gives back its tail in place */
    if (q) p = q;
    Buf *b = PyObject_New(Buf, &BufType);
    if (!b) { free(p); return NULL; }
    b->p = p; b->len = (Py_ssize_t)len;
    return (PyObject *)b;
}

/* ------------------------------------------------------------------------ buffered reader */
typedef struct {
    FILE *f;
    unsigned char *buf;
    size_t cap, len, pos;
    uint64_t left; /* bytes of the file not yet in buf */
} Reader;

/* make n bytes available at r->pos; -1 when the file has fewer */
static int need_more(Reader *r, size_t n) {
    if ((uint64_t)n > (uint64_t)(r->len - r->pos) + r->left) return -1;
    memmove(r->buf, r->buf + r->pos, r->len - r->pos);
    r->len -= r->pos; r->pos = 0;
    if (n > r->cap) {
        unsigned char *b = realloc(r->buf, n);
        if (!b) return -1;
        r->buf = b; r->cap = n;
    }
    size_t want = r->cap - r->len;
    if ((uint64_t)want > r->left) want = (size_t)r->left;
    size_t got = fread(r->buf + r->len, 1, want, r->f);
    r->len += got; r->left -= got;
    return (r->len - r->pos >= n) ? 0 : -1;
}

static inline int need(Reader *r, size_t n) { return (r->len - r->pos >= n) ? 0 : need_more(r, n); }

/* ------------------------------------------------------------------------- decoder state */
/* A stack value is a PyObject* (owned), a row: (row << 1) | 1, or an int not yet boxed:
 * (x << 2) | 2 (|x| < 2**61), so that the ints of a trace entry go to their columns without
 * ever becoming Python objects. */
typedef uintptr_t Val;
#define IS_ROW(v) ((v) & 1)
#define ROW_OF(v) ((int64_t)((v) >> 1))
#define MAKE_ROW(r) ((((Val)(r)) << 1) | 1)
#define IS_INT(v) (((v) & 3) == 2)
#define IS_OBJ(v) ((v) && !((v) & 3))
#define INT_OF(v) (((int64_t)(v)) >> 2)
#define MAKE_INT(x) ((((Val)(x)) << 2) | 2)
#define INT_FITS(x) ((x) >= -(INT64_C(1) << 61) && (x) < (INT64_C(1) << 61))
#define ABSENT INT64_MIN
#define MAX_COLS 64
#define MAX_ROWLISTS 256
#define RECENT 4096 /* direct-mapped: where each recent list/dict sits in the memo */
#define MEMO_CHUNK 4096

typedef struct {
    PyObject *name;   /* str */
    int kind;         /* 1 int, 2 object */
    int64_t *data;    /* kind 1: rows_cap values (ABSENT: no such key in that entry) */
    void *index;      /* kind 2: rows_cap indexes into table (-1: absent), `width` bytes each */
    int width;        /* 1, then 2 from 128 distinct values, 4 from 32,768 (trace._index_dtype) */
    PyObject *table;  /* kind 2: list of distinct values */
    Map ident;        /* kind 2: id(value) -> table index */
    uintptr_t last;   /* kind 2: the value the last row took, and its index */
    int32_t last_index;
} Column;

typedef struct {
    PyObject *list;   /* the (empty) list object standing for the rows */
    int64_t *rows;    /* only once the rows stop following each other: first, first + 1, ... */
    int64_t first;
    size_t n, cap;
} RowList;

typedef struct {
    Reader rd;
    Val *stack; size_t sp, scap;
    size_t *marks; size_t mp, mcap;
    /* The memo in chunks of MEMO_CHUNK slots, each made when a value other than an entry is put
     * in it: an entry (a row) is only marked in `row_bit`, since no reader takes it back (a
     * second reference to an entry is declined), so ten million entries cost 1.25 MB here. */
    Val **memo; size_t memo_chunks; uint8_t *row_bit; size_t row_bits; uint64_t memo_limit, memo_count;
    Column cols[MAX_COLS]; int ncols;
    PyObject *keycache[MAX_COLS]; int keycol[MAX_COLS]; int nkeys;
    struct { uint64_t idx; int col; } keymemo[64]; /* memo index of a key -> its column, + 1 */
    int64_t nrows, rows_cap;
    uint8_t *row_state; /* 0 open, 1 in a list */
    RowList rl[MAX_ROWLISTS]; int nrl;
    struct { uintptr_t ptr; uint64_t idx; } recent[RECENT]; /* recently memoized lists and dicts */
    Map intern;        /* content hash of a list of objects -> index in interned */
    Map canonical;     /* address of a list in interned (kept alive there) -> 1 */
    PyObject *interned;
    Map dict_intern;   /* content hash of a small dict -> index in dicts */
    PyObject *dicts;
    PyObject *action_str;
} Dec;

static void val_decref(Val v) { if (IS_OBJ(v)) Py_DECREF((PyObject *)v); }

/* the stack value *v as a Python object (an unboxed int becomes a PyLong) */
static int box(Val *v) {
    if (IS_INT(*v)) {
        PyObject *o = PyLong_FromLongLong((long long)INT_OF(*v));
        if (!o) return -1;
        *v = (Val)o;
    }
    return IS_ROW(*v) ? -1 : 0;
}

static int box_all(Val *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (box(&v[i]) < 0) return -1;
    return 0;
}

static int push(Dec *d, Val v) {
    if (d->sp == d->scap) {
        size_t c = d->scap ? d->scap * 2 : 256;
        Val *s = realloc(d->stack, c * sizeof(Val));
        if (!s) return -1;
        d->stack = s; d->scap = c;
    }
    d->stack[d->sp++] = v;
    return 0;
}

/* push a new reference; NULL (a failed constructor) is an error */
static int push_obj(Dec *d, PyObject *o) {
    if (!o) return -1;
    if (push(d, (Val)o) < 0) { Py_DECREF(o); return -1; }
    return 0;
}

static size_t mark_base(Dec *d) { return d->mp ? d->marks[d->mp - 1] : 0; }

static int pop_mark(Dec *d, size_t *k) {
    if (!d->mp) return -1;
    *k = d->marks[--d->mp];
    if (*k > d->sp) return -1;
    return 0;
}

static inline Val memo_at(Dec *d, uint64_t idx) {
    size_t c = (size_t)(idx / MEMO_CHUNK);
    return (c < d->memo_chunks && d->memo[c]) ? d->memo[c][idx % MEMO_CHUNK] : 0;
}

static inline int memo_row(Dec *d, uint64_t idx) {
    return idx / 8 < d->row_bits && ((d->row_bit[idx / 8] >> (idx % 8)) & 1);
}

/* the slot of idx, its chunk made (zeroed) if need be; NULL: out of memory */
static Val *memo_slot(Dec *d, uint64_t idx) {
    size_t c = (size_t)(idx / MEMO_CHUNK);
    if (c >= d->memo_chunks) {
        size_t n = d->memo_chunks ? d->memo_chunks : 64;
        while (n <= c) n *= 2;
        Val **m = realloc(d->memo, n * sizeof(Val *));
        if (!m) return NULL;
        memset(m + d->memo_chunks, 0, (n - d->memo_chunks) * sizeof(Val *));
        d->memo = m; d->memo_chunks = n;
    }
    if (!d->memo[c] && !(d->memo[c] = calloc(MEMO_CHUNK, sizeof(Val)))) return NULL;
    return &d->memo[c][idx % MEMO_CHUNK];
}

static int memo_put(Dec *d, uint64_t idx) {
    /* writers number the memo 0, 1, 2, ...: far-off indexes (a memory bomb) go to the slow road */
    if (d->sp <= mark_base(d) || idx > d->memo_limit || idx > d->memo_count + (1u << 20)) return -1;
    Val v = d->stack[d->sp - 1], old = memo_at(d, idx);
    if (old || memo_row(d, idx)) { /* a memo slot written again (no writer does): forget its key's column */
        val_decref(old);
        if (old) *memo_slot(d, idx) = 0;
        if (memo_row(d, idx)) d->row_bit[idx / 8] &= (uint8_t)~(1u << (idx % 8));
        if (d->keymemo[idx & 63].idx == idx) d->keymemo[idx & 63].col = 0;
    } else d->memo_count++;
    if (IS_ROW(v)) {
        if (idx / 8 >= d->row_bits) {
            size_t n = d->row_bits ? d->row_bits : 4096;
            while (n <= idx / 8) n *= 2;
            uint8_t *b = realloc(d->row_bit, n);
            if (!b) return -1;
            memset(b + d->row_bits, 0, n - d->row_bits);
            d->row_bit = b; d->row_bits = n;
        }
        d->row_bit[idx / 8] |= (uint8_t)(1u << (idx % 8));
        return 0;
    }
    Val *slot = memo_slot(d, idx);
    if (!slot) return -1;
    if (IS_OBJ(v)) {
        Py_INCREF((PyObject *)v);
        if (PyList_CheckExact((PyObject *)v) || PyDict_CheckExact((PyObject *)v)) {
            size_t r = (v >> 4) & (RECENT - 1);
            d->recent[r].ptr = v;
            d->recent[r].idx = idx;
        }
    }
    *slot = v;
    return 0;
}

static int memo_get(Dec *d, uint64_t idx) {
    Val v = memo_at(d, idx);
    if (!v) return -1; /* nothing there, or an entry: taken once only */
    if (IS_OBJ(v)) Py_INCREF((PyObject *)v);
    return push(d, v);
}

/* ---------------------------------------------------------------------------- columns */
/* Columns grow by doubling without being filled: a row's cells are set to absent when the row
 * is made (new_row), so the pages past the last row are never touched and cost no memory. */
static int grow_column(Column *c, int64_t cap) {
    if (c->kind == 1) {
        int64_t *p = realloc(c->data, (size_t)cap * sizeof(int64_t));
        if (!p) return -1;
        c->data = p;
    } else {
        void *p = realloc(c->index, (size_t)cap * (size_t)c->width);
        if (!p) return -1;
        c->index = p;
    }
    return 0;
}

static inline void set_index(Column *c, int64_t r, int32_t x) {
    if (c->width == 1) ((int8_t *)c->index)[r] = (int8_t)x;
    else if (c->width == 2) ((int16_t *)c->index)[r] = (int16_t)x;
    else ((int32_t *)c->index)[r] = x;
}

static inline int32_t get_index(const Column *c, int64_t r) {
    return c->width == 1 ? ((int8_t *)c->index)[r] : c->width == 2 ? ((int16_t *)c->index)[r] : ((int32_t *)c->index)[r];
}

/* the column's indexes rewritten `width` bytes wide (its table outgrew the narrower type) */
static int widen(Column *c, int64_t cap, int64_t nrows, int width) {
    Column wide = *c;
    wide.width = width;
    wide.index = malloc((size_t)cap * (size_t)width);
    if (!wide.index) return -1;
    for (int64_t j = 0; j < nrows; j++) set_index(&wide, j, get_index(c, j));
    free(c->index);
    c->index = wide.index;
    c->width = width;
    return 0;
}

static int new_row(Dec *d) {
    if (d->nrows == d->rows_cap) {
        int64_t c = d->rows_cap ? d->rows_cap * 2 : 4096;
        for (int i = 0; i < d->ncols; i++)
            if (grow_column(&d->cols[i], c) < 0) return -1;
        uint8_t *s = realloc(d->row_state, (size_t)c);
        if (!s) return -1;
        d->row_state = s;
        d->rows_cap = c;
    }
    int64_t r = d->nrows++;
    for (int i = 0; i < d->ncols; i++) {
        if (d->cols[i].kind == 1) d->cols[i].data[r] = ABSENT;
        else set_index(&d->cols[i], r, -1);
    }
    d->row_state[r] = 0;
    return push(d, MAKE_ROW(r));
}

static int column_for(Dec *d, PyObject *key, Val first_value) {
    for (int i = 0; i < d->nkeys; i++)
        if (d->keycache[i] == key) return d->keycol[i];
    int col = -1;
    for (int i = 0; i < d->ncols; i++) {
        int eq = PyObject_RichCompareBool(d->cols[i].name, key, Py_EQ);
        if (eq < 0) return -1;
        if (eq) { col = i; break; }
    }
    if (col < 0) {
        if (d->ncols == MAX_COLS) return -1;
        Column *c = &d->cols[d->ncols];
        memset(c, 0, sizeof(*c));
        int overflow = 0;
        PyObject *o = (PyObject *)first_value;
        long long x = IS_OBJ(first_value) && PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : 0;
        c->kind = (IS_INT(first_value) || (IS_OBJ(first_value) && PyLong_CheckExact(o) && !overflow && x != ABSENT)) ? 1 : 2;
        c->width = 1;
        if (PyErr_Occurred()) return -1;
        if (grow_column(c, d->rows_cap) < 0) return -1;
        for (int64_t j = 0; j < d->nrows; j++) {
            if (c->kind == 1) c->data[j] = ABSENT;
            else set_index(c, j, -1);
        }
        if (c->kind == 2) {
            c->table = PyList_New(0);
            if (!c->table || map_init(&c->ident, 64) < 0) return -1;
        }
        Py_INCREF(key);
        c->name = key;
        col = d->ncols++;
    }
    if (d->nkeys < MAX_COLS) {
        Py_INCREF(key);
        d->keycache[d->nkeys] = key;
        d->keycol[d->nkeys++] = col;
    }
    return col;
}

/* The memo's reference to `old` (if it is a recent one) becomes a reference to `canon`, so
 * that `old` is freed once its other users let go of it. */
static void swap_memo(Dec *d, PyObject *old, PyObject *canon) {
    size_t slot = ((uintptr_t)old >> 4) & (RECENT - 1);
    uint64_t idx = d->recent[slot].idx;
    if (d->recent[slot].ptr == (uintptr_t)old && memo_at(d, idx) == (Val)old) {
        Py_INCREF(canon);
        *memo_slot(d, idx) = (Val)canon;
        Py_DECREF(old);
        d->recent[slot].ptr = 0;
    }
}

static int same_value(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) return PyObject_RichCompareBool(a, b, Py_EQ) == 1;
    return 0;
}

/* One object for all equal small dicts (a frame: name, filename, line) whose keys and string
 * values are shared objects. Returns a new reference to the shared dict, or to o itself. */
static PyObject *share_dict(Dec *d, PyObject *o) {
    Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0;
    PyObject *k, *v;
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n;
    if (n > 8) goto keep;
    while (PyDict_Next(o, &pos, &k, &v)) {
        uint64_t x = (uint64_t)(uintptr_t)v;
        if (PyLong_CheckExact(v)) {
            int overflow = 0;
            long long y = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow || (y == -1 && PyErr_Occurred())) { PyErr_Clear(); goto keep; }
            x = (uint64_t)y * 0x9e3779b97f4a7c15ULL + 1;
        }
        h = (h ^ (uint64_t)(uintptr_t)k) * 1099511628211ULL;
        h = (h ^ x) * 1099511628211ULL;
    }
    int64_t *hit = map_find(&d->dict_intern, (int64_t)h);
    if (!hit) {
        if (PyList_Append(d->dicts, o) < 0 || map_put(&d->dict_intern, (int64_t)h, PyList_GET_SIZE(d->dicts) - 1) < 0) {
            PyErr_Clear();
        }
        goto keep;
    }
    PyObject *s = PyList_GET_ITEM(d->dicts, *hit);
    if (s == o || PyDict_GET_SIZE(s) != n) goto keep;
    Py_ssize_t pa = 0, pb = 0;
    PyObject *ka, *va, *kb, *vb;
    while (PyDict_Next(s, &pa, &ka, &va) && PyDict_Next(o, &pb, &kb, &vb))
        if (ka != kb || !same_value(va, vb)) goto keep;
    swap_memo(d, o, s);
    Py_INCREF(s);
    return s;
keep:
    Py_INCREF(o);
    return o;
}

static RowList *rowlist_of(Dec *d, PyObject *list) {
    for (int i = 0; i < d->nrl; i++)
        if (d->rl[i].list == list) return &d->rl[i];
    return NULL;
}

/* One object for all equal lists of the same objects (a traceback's frames), after sharing
 * their frame dicts. Returns a new reference to the shared list, or to v itself. */
static PyObject *share_list(Dec *d, PyObject *v) {
    if (map_find(&d->canonical, (int64_t)(uintptr_t)v)) { /* already the shared one: most entries */
        Py_INCREF(v);
        return v;
    }
    if (rowlist_of(d, v)) { /* a list of entries (kept as rows, empty as an object): never shared */
        Py_INCREF(v);
        return v;
    }
    Py_ssize_t n = PyList_GET_SIZE(v);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(v, i);
        if (!PyDict_CheckExact(item)) continue;
        PyObject *c = share_dict(d, item);
        if (c != item) {
            PyList_SET_ITEM(v, i, c);
            Py_DECREF(item);
        } else {
            Py_DECREF(c);
        }
    }
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) { h ^= (uint64_t)(uintptr_t)PyList_GET_ITEM(v, i); h *= 1099511628211ULL; }
    int64_t *hit = map_find(&d->intern, (int64_t)h);
    if (hit) {
        PyObject *s = PyList_GET_ITEM(d->interned, *hit);
        if (s != v && PyList_GET_SIZE(s) == n) {
            Py_ssize_t i = 0;
            while (i < n && PyList_GET_ITEM(s, i) == PyList_GET_ITEM(v, i)) i++;
            if (i == n) {
                swap_memo(d, v, s);
                Py_INCREF(s);
                return s;
            }
        }
    } else {
        if (PyList_Append(d->interned, v) < 0) return NULL;
        if (map_put(&d->intern, (int64_t)h, PyList_GET_SIZE(d->interned) - 1) < 0) return NULL;
        if (map_put(&d->canonical, (int64_t)(uintptr_t)v, 1) < 0) return NULL;
    }
    Py_INCREF(v);
    return v;
}

/* row[key] = value; 0 ok, -1 give up on the fast road */
static int row_set(Dec *d, int64_t row, PyObject *key, Val *slot) {
    if (!PyUnicode_CheckExact(key)) return -1;
    int col = column_for(d, key, *slot);
    if (col < 0) return -1;
    Column *c = &d->cols[col];
    if (c->kind == 1 && IS_INT(*slot)) {
        c->data[row] = INT_OF(*slot);
        return 0;
    }
    if (box(slot) < 0) return -1;
    PyObject *value = (PyObject *)*slot;
    if (c->kind == 1) {
        if (!PyLong_CheckExact(value)) return -1;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow || x == ABSENT || PyErr_Occurred()) return -1;
        c->data[row] = x;
        return 0;
    }
    if (c->last == (uintptr_t)value && c->last_index >= 0) { /* the same object as the last row's */
        set_index(c, row, c->last_index);
        return 0;
    }
    PyObject *v = PyList_CheckExact(value) ? share_list(d, value) : (Py_INCREF(value), value);
    if (!v) return -1;
    int64_t *hit = map_find(&c->ident, (int64_t)(uintptr_t)v);
    if (hit) {
        set_index(c, row, (int32_t)*hit);
        if (v == value) { c->last = (uintptr_t)value; c->last_index = (int32_t)*hit; }
    } else {
        int64_t idx = PyList_GET_SIZE(c->table);
        if (idx >= INT32_MAX || PyList_Append(c->table, v) < 0) { Py_DECREF(v); return -1; }
        if (map_put(&c->ident, (int64_t)(uintptr_t)v, idx) < 0) { Py_DECREF(v); return -1; }
        if ((idx == 127 && c->width == 1 && widen(c, d->rows_cap, d->nrows, 2) < 0) ||
            (idx == 32767 && c->width == 2 && widen(c, d->rows_cap, d->nrows, 4) < 0)) { Py_DECREF(v); return -1; }
        set_index(c, row, (int32_t)idx);
    }
    Py_DECREF(v);
    return 0;
}


/* append items[0:n] to the container `target` (a list, or a list of rows) */
static int do_appends(Dec *d, Val target, Val *items, size_t n) {
    if (!IS_OBJ(target) || !PyList_CheckExact((PyObject *)target)) return -1;
    PyObject *list = (PyObject *)target;
    RowList *rl = rowlist_of(d, list);
    int rows = n && IS_ROW(items[0]);
    for (size_t i = 0; i < n; i++)
        if ((IS_ROW(items[i]) != 0) != rows) return -1;
    if (!n) return 0;
    if (!rows) {
        if (rl || box_all(items, n) < 0) return -1;
        for (size_t i = 0; i < n; i++)
            if (PyList_Append(list, (PyObject *)items[i]) < 0) return -1;
        return 0;
    }
    if (!rl) {
        if (PyList_GET_SIZE(list) != 0 || d->nrl == MAX_ROWLISTS) return -1;
        rl = &d->rl[d->nrl++];
        memset(rl, 0, sizeof(*rl));
        Py_INCREF(list);
        rl->list = list;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t r = ROW_OF(items[i]);
        if (d->row_state[r]) return -1; /* the same entry twice: not what torch writes */
        d->row_state[r] = 1;
        if (!rl->rows && (rl->n == 0 || r == rl->first + (int64_t)rl->n)) { /* the usual case: a run */
            if (rl->n == 0) rl->first = r;
            rl->n++;
            continue;
        }
        if (rl->n + 1 > rl->cap) {
            size_t c = rl->cap ? rl->cap : 1024;
            while (c < rl->n + 1) c *= 2;
            int64_t *p = realloc(rl->rows, c * sizeof(int64_t));
            if (!p) return -1;
            if (!rl->rows) /* the run so far, written out */
                for (size_t j = 0; j < rl->n; j++) p[j] = rl->first + (int64_t)j;
            rl->rows = p; rl->cap = c;
        }
        rl->rows[rl->n++] = r;
    }
    return 0;
}

/* setitems on stack[k-1] from the pairs stack[k:sp] */
static int do_setitems(Dec *d, size_t k) {
    if (k == 0 || (d->sp - k) % 2) return -1;
    Val target = d->stack[k - 1];
    for (size_t i = k; i < d->sp; i += 2) {
        if (box(&d->stack[i]) < 0 || IS_ROW(d->stack[i + 1])) return -1;
        PyObject *key = (PyObject *)d->stack[i];
        if (IS_ROW(target)) {
            if (row_set(d, ROW_OF(target), key, &d->stack[i + 1]) < 0) return -1;
        } else {
            if (!IS_OBJ(target) || !PyDict_CheckExact((PyObject *)target) || box(&d->stack[i + 1]) < 0) return -1;
            if (PyDict_SetItem((PyObject *)target, key, (PyObject *)d->stack[i + 1]) < 0) return -1;
        }
    }
    while (d->sp > k) val_decref(d->stack[--d->sp]);
    return 0;
}

/* Is the dict just created a trace entry? Its first key is "action". Looks ahead without
 * consuming: [memo op] MARK <key>, skipping FRAME opcodes. */
static int peek_is_entry(Dec *d) {
    Reader *r = &d->rd;
    need(r, 64); /* best effort: fewer bytes near the end is fine */
    size_t p = r->pos, end = r->len;
    int stage = 0; /* 0: memo op or MARK, 1: key */
    while (p < end) {
        unsigned char op = r->buf[p];
        if (op == 0x95) { p += 9; continue; } /* FRAME */
        if (stage == 0) {
            if (op == 'q') { p += 2; continue; }
            if (op == 'r') { p += 5; continue; }
            if (op == 0x94) { p += 1; continue; }
            if (op != '(') return 0;
            p += 1; stage = 1; continue;
        }
        if (op == 0x8c) {
            return p + 8 <= end && r->buf[p + 1] == 6 && memcmp(r->buf + p + 2, "action", 6) == 0;
        }
        if (op == 'h' || op == 'j') {
            uint64_t idx;
            if (op == 'h') { if (p + 2 > end) return 0; idx = r->buf[p + 1]; }
            else { if (p + 5 > end) return 0; idx = (uint64_t)r->buf[p + 1] | (uint64_t)r->buf[p + 2] << 8 |
                                                   (uint64_t)r->buf[p + 3] << 16 | (uint64_t)r->buf[p + 4] << 24; }
            if (!IS_OBJ(memo_at(d, idx))) return 0;
            PyObject *k = (PyObject *)memo_at(d, idx);
            return PyUnicode_CheckExact(k) && PyUnicode_Compare(k, d->action_str) == 0;
        }
        return 0;
    }
    return 0;
}

static uint64_t le(const unsigned char *p, int n) {
    uint64_t x = 0;
    for (int i = n - 1; i >= 0; i--) x = (x << 8) | p[i];
    return x;
}

static PyObject *long_from_le(const unsigned char *p, size_t n) {
    if (n == 0) return PyLong_FromLong(0);
    if (n <= 8) {
        uint64_t x = le(p, (int)n);
        if (n < 8 && (p[n - 1] & 0x80)) x |= ~(uint64_t)0 << (8 * n); /* sign-extend */
        return PyLong_FromLongLong((long long)x);
    }
    PyObject *b = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
    if (!b) return NULL;
    PyObject *r = PyObject_CallMethod((PyObject *)&PyLong_Type, "from_bytes", "Os", b, "little");
    Py_DECREF(b);
    if (!r) return NULL;
    if (p[n - 1] & 0x80) { /* two's complement */
        PyObject *one = PyLong_FromLong(1), *sh = PyLong_FromSize_t(8 * n), *m = NULL, *out = NULL;
        if (one && sh) m = PyNumber_Lshift(one, sh);
        if (m) out = PyNumber_Subtract(r, m);
        Py_XDECREF(one); Py_XDECREF(sh); Py_XDECREF(m); Py_DECREF(r);
        return out;
    }
    return r;
}

/* One (key value) pair of an entry at b (avail bytes): the key by memo reference to an object,
 * the value an int, None or a memo reference. 0 if it is not such a pair (or is cut short);
 * else its length, with the key's memo index and the value: an unboxed int or None in *v, or
 * its memo index in *vidx (else UINT64_MAX; the memo's object is read when it is used, since
 * sharing an earlier value may have replaced it). */
static size_t entry_pair(Dec *d, const unsigned char *b, size_t avail, uint64_t *idx, Val *v, uint64_t *vidx) {
    if (avail < 2 || (b[0] != 'h' && b[0] != 'j')) return 0;
    size_t w = b[0] == 'h' ? 1 : 4;
    if (avail < 1 + w + 1) return 0;
    *idx = le(b + 1, (int)w);
    if (!IS_OBJ(memo_at(d, *idx))) return 0;
    unsigned char vop = b[1 + w];
    size_t vw = vop == 'K' ? 1 : vop == 'M' ? 2 : vop == 'J' ? 4 : vop == 'h' ? 1 : vop == 'j' ? 4 :
                vop == 0x8a ? 1 : vop == 'N' ? 0 : 99;
    size_t used = 2 + w + vw;
    if (vw == 99 || avail < used) return 0;
    const unsigned char *a = b + 2 + w;
    *vidx = UINT64_MAX;
    if (vop == 'K' || vop == 'M') *v = MAKE_INT((int64_t)le(a, (int)vw));
    else if (vop == 'J') *v = MAKE_INT((int64_t)(int32_t)(uint32_t)le(a, 4));
    else if (vop == 'N') *v = (Val)Py_None;
    else if (vop == 0x8a) {
        size_t n = a[0];
        if (n < 1 || n > 8 || avail < used + n) return 0;
        uint64_t x = le(a + 1, (int)n);
        if (n < 8 && (a[n] & 0x80)) x |= ~(uint64_t)0 << (8 * n); /* sign-extend */
        if (!INT_FITS((int64_t)x)) return 0;
        *v = MAKE_INT((int64_t)x);
        used += n;
    } else if (!memo_at(d, (*vidx = le(a, (int)vw)))) return 0;
    return used;
}

/* A trace entry's fields as torch writes them, after its EMPTY_DICT: [MEMOIZE] MARK, then
 * (key value) pairs (entry_pair), then SETITEMS. Decoded straight into the row's cells, without
 * the stack, but only once every pair up to the SETITEMS has been read (a MARK closed by
 * anything else drops its pairs, as pickle does: run() takes such a dict). 0 ok (whether or not
 * it took the pairs), -1 give up. */
static int fast_entry(Dec *d) {
    Reader *r = &d->rd;
    int64_t row = ROW_OF(d->stack[d->sp - 1]);
    for (;;) { /* [FRAME] [MEMOIZE] MARK */
        if (need(r, 1) < 0) return 0;
        unsigned char op = r->buf[r->pos];
        if (op == 0x95) { if (need(r, 9) < 0) return 0; r->pos += 9; continue; } /* FRAME */
        if (op == 0x94) { r->pos++; if (memo_put(d, d->memo_count) < 0) return -1; continue; }
        if (op != '(' || d->mp == d->mcap) return 0; /* (run() grows the marks) */
        r->pos++;
        d->marks[d->mp++] = d->sp;
        break;
    }
    uint64_t left = (uint64_t)(r->len - r->pos) + r->left;
    need(r, left < 1024 ? (size_t)left : 1024); /* an entry's pairs are a few dozen bytes */
    const unsigned char *b = r->buf + r->pos, *end = r->buf + r->len, *p = b;
    enum { MAX_PAIRS = 32 };
    uint64_t idxs[MAX_PAIRS], vidxs[MAX_PAIRS];
    Val vals[MAX_PAIRS];
    int n = 0;
    for (;;) { /* read ahead: pairs only, then SETITEMS */
        if (p >= end) return 0;
        if (*p == 0x95) { p += 9; continue; }
        if (*p == 'u') break;
        size_t used = n < MAX_PAIRS ? entry_pair(d, p, (size_t)(end - p), &idxs[n], &vals[n], &vidxs[n]) : 0;
        if (!used) return 0;
        p += used;
        n++;
    }
    r->pos += (size_t)(p + 1 - b);
    d->mp--;
    for (int k = 0; k < n; k++) { /* every pair into the row */
        uint64_t idx = idxs[k];
        Val v = vidxs[k] == UINT64_MAX ? vals[k] : memo_at(d, vidxs[k]);
        PyObject *key = (PyObject *)memo_at(d, idx);
        size_t slot = idx & 63;
        int col = d->keymemo[slot].idx == idx ? d->keymemo[slot].col - 1 : -1;
        if (col >= 0 && IS_INT(v) && d->cols[col].kind == 1) { /* an int for an int column: most pairs */
            d->cols[col].data[row] = INT_OF(v);
            continue;
        }
        if (IS_OBJ(v)) Py_INCREF((PyObject *)v);
        int rc = row_set(d, row, key, &v);
        val_decref(v);
        if (rc < 0) return -1;
        if (col < 0) { /* remember the key's column (row_set has just made or found it) */
            for (int i = 0; i < d->nkeys; i++)
                if (d->keycache[i] == key) { d->keymemo[slot].idx = idx; d->keymemo[slot].col = d->keycol[i] + 1; break; }
        }
    }
    return 0;
}

/* Run the machine to STOP. 0 ok (result on the stack), -1 give up. */
static int run(Dec *d) {
    Reader *r = &d->rd;
    for (;;) {
        if (need(r, 1) < 0) return -1;
        unsigned char op = r->buf[r->pos++];
        const unsigned char *a;
        size_t k;
        switch (op) {
        case 0x80: if (need(r, 1) < 0 || r->buf[r->pos] > 5) return -1; r->pos += 1; break; /* PROTO */
        case 0x95: if (need(r, 8) < 0) return -1; r->pos += 8; break;                      /* FRAME */
        case '.': return (d->sp > mark_base(d) && box(&d->stack[d->sp - 1]) == 0) ? 0 : -1; /* STOP */
        case '(':                                                                             /* MARK */
            if (d->mp == d->mcap) {
                size_t c = d->mcap ? d->mcap * 2 : 64;
                size_t *m = realloc(d->marks, c * sizeof(size_t));
                if (!m) return -1;
                d->marks = m; d->mcap = c;
            }
            d->marks[d->mp++] = d->sp;
            break;
        case '0':                                                                             /* POP */
            if (d->mp && d->marks[d->mp - 1] == d->sp) { d->mp--; break; }
            if (d->sp <= mark_base(d)) return -1;
            val_decref(d->stack[--d->sp]);
            break;
        case '1':                                                                             /* POP_MARK */
            if (pop_mark(d, &k) < 0) return -1;
            while (d->sp > k) val_decref(d->stack[--d->sp]);
            break;
        case '2': if (d->sp <= mark_base(d)) return -1;                                                      /* DUP */
                  { Val v = d->stack[d->sp - 1]; if (IS_OBJ(v)) Py_INCREF((PyObject *)v);
                    if (push(d, v) < 0) { val_decref(v); return -1; } } break;
        case 'N': Py_INCREF(Py_None); if (push_obj(d, Py_None) < 0) return -1; break;
        case 0x88: Py_INCREF(Py_True); if (push_obj(d, Py_True) < 0) return -1; break;
        case 0x89: Py_INCREF(Py_False); if (push_obj(d, Py_False) < 0) return -1; break;
        case 'J': case 'K': case 'M': {                                                       /* BININT* */
            int w = op == 'J' ? 4 : op == 'K' ? 1 : 2;
            if (need(r, w) < 0) return -1;
            uint64_t x = le(r->buf + r->pos, w);
            r->pos += w;
            int64_t v = op == 'J' ? (int64_t)(int32_t)(uint32_t)x : (int64_t)x;
            if (push(d, MAKE_INT(v)) < 0) return -1;
            break;
        }
        case 0x8a: case 0x8b: {                                                               /* LONG1/4 */
            int w = op == 0x8a ? 1 : 4;
            if (need(r, w) < 0) return -1;
            uint64_t n = le(r->buf + r->pos, w);
            if (op == 0x8b && (n & 0x80000000ULL)) return -1;
            r->pos += w;
            if (need(r, (size_t)n) < 0) return -1;
            a = r->buf + r->pos; r->pos += n;
            if (n >= 1 && n <= 8) {
                uint64_t x = le(a, (int)n);
                if (n < 8 && (a[n - 1] & 0x80)) x |= ~(uint64_t)0 << (8 * n); /* sign-extend */
                if (INT_FITS((int64_t)x)) { if (push(d, MAKE_INT((int64_t)x)) < 0) return -1; break; }
            }
            if (push_obj(d, long_from_le(a, (size_t)n)) < 0) return -1;
            break;
        }
        case 'G': {                                                                           /* BINFLOAT */
            if (need(r, 8) < 0) return -1;
            double x = PyFloat_Unpack8((const char *)(r->buf + r->pos), 0);
            r->pos += 8;
            if (x == -1.0 && PyErr_Occurred()) return -1;
            if (push_obj(d, PyFloat_FromDouble(x)) < 0) return -1;
            break;
        }
        case 0x8c: case 'X': case 0x8d: case 'C': case 'B': case 0x8e: case 0x96: {       /* str, bytes */
            int w = (op == 0x8c || op == 'C') ? 1 : (op == 'X' || op == 'B') ? 4 : 8;
            if (need(r, w) < 0) return -1;
            uint64_t n = le(r->buf + r->pos, w);
            r->pos += w;
            if (n > (uint64_t)PY_SSIZE_T_MAX || need(r, (size_t)n) < 0) return -1;
            a = r->buf + r->pos; r->pos += n;
            PyObject *o;
            if (op == 0x8c || op == 'X' || op == 0x8d)
                o = PyUnicode_DecodeUTF8((const char *)a, (Py_ssize_t)n, "surrogatepass");
            else if (op == 0x96)
                o = PyByteArray_FromStringAndSize((const char *)a, (Py_ssize_t)n);
            else
                o = PyBytes_FromStringAndSize((const char *)a, (Py_ssize_t)n);
            if (push_obj(d, o) < 0) return -1;
            break;
        }
        case ')': if (push_obj(d, PyTuple_New(0)) < 0) return -1; break;                     /* EMPTY_TUPLE */
        case 0x85: case 0x86: case 0x87: case 't': {                                          /* TUPLE* */
            if (op == 't') { if (pop_mark(d, &k) < 0) return -1; }
            else { size_t n = op - 0x84; if (d->sp < n || d->sp - n < mark_base(d)) return -1; k = d->sp - n; }
            if (box_all(d->stack + k, d->sp - k) < 0) return -1;
            PyObject *t = PyTuple_New((Py_ssize_t)(d->sp - k));
            if (!t) return -1;
            for (size_t i = k; i < d->sp; i++) /* the tuple takes over the stack's references */
                PyTuple_SET_ITEM(t, (Py_ssize_t)(i - k), (PyObject *)d->stack[i]);
            d->sp = k;
            if (push_obj(d, t) < 0) return -1;
            break;
        }
        case ']': if (push_obj(d, PyList_New(0)) < 0) return -1; break;                      /* EMPTY_LIST */
        case 'l': {                                                                           /* LIST */
            if (pop_mark(d, &k) < 0) return -1;
            PyObject *l = PyList_New(0);
            if (!l) return -1;
            int rc = do_appends(d, (Val)l, d->stack + k, d->sp - k);
            while (d->sp > k) val_decref(d->stack[--d->sp]);
            if (rc < 0 || push_obj(d, l) < 0) return -1;
            break;
        }
        case '}':                                                                             /* EMPTY_DICT */
            if (peek_is_entry(d)) {
                if (new_row(d) < 0 || fast_entry(d) < 0) return -1;
            } else if (push_obj(d, PyDict_New()) < 0) return -1;
            break;
        case 'd': {                                                                           /* DICT */
            if (pop_mark(d, &k) < 0) return -1;
            PyObject *o = PyDict_New();
            if (!o) return -1;
            /* move the pairs above a new dict and reuse setitems */
            size_t n = d->sp - k;
            if (push(d, 0) < 0) { Py_DECREF(o); return -1; }
            memmove(d->stack + k + 1, d->stack + k, n * sizeof(Val));
            d->stack[k] = (Val)o;
            if (do_setitems(d, k + 1) < 0) return -1;
            break;
        }
        case 0x8f: if (push_obj(d, PySet_New(NULL)) < 0) return -1; break;                   /* EMPTY_SET */
        case 0x90: {                                                                          /* ADDITEMS */
            if (pop_mark(d, &k) < 0 || k <= mark_base(d)) return -1;
            Val s = d->stack[k - 1];
            if (!IS_OBJ(s) || !PySet_CheckExact((PyObject *)s) || box_all(d->stack + k, d->sp - k) < 0) return -1;
            for (size_t i = k; i < d->sp; i++)
                if (PySet_Add((PyObject *)s, (PyObject *)d->stack[i]) < 0) return -1;
            while (d->sp > k) val_decref(d->stack[--d->sp]);
            break;
        }
        case 0x91: {                                                                          /* FROZENSET */
            if (pop_mark(d, &k) < 0) return -1;
            if (box_all(d->stack + k, d->sp - k) < 0) return -1;
            PyObject *s = PyFrozenSet_New(NULL);
            if (!s) return -1;
            for (size_t i = k; i < d->sp; i++)
                if (PySet_Add(s, (PyObject *)d->stack[i]) < 0) { Py_DECREF(s); return -1; }
            while (d->sp > k) val_decref(d->stack[--d->sp]);
            if (push_obj(d, s) < 0) return -1;
            break;
        }
        case 'a':                                                                             /* APPEND */
            if (d->sp < 2 || d->sp - 1 <= mark_base(d)) return -1;
            if (do_appends(d, d->stack[d->sp - 2], d->stack + d->sp - 1, 1) < 0) return -1;
            val_decref(d->stack[--d->sp]);
            break;
        case 'e':                                                                             /* APPENDS */
            if (pop_mark(d, &k) < 0 || k <= mark_base(d)) return -1;
            if (do_appends(d, d->stack[k - 1], d->stack + k, d->sp - k) < 0) return -1;
            while (d->sp > k) val_decref(d->stack[--d->sp]);
            break;
        case 's':                                                                             /* SETITEM */
            if (d->sp < 3 || d->sp - 2 <= mark_base(d)) return -1;
            if (do_setitems(d, d->sp - 2) < 0) return -1;
            break;
        case 'u':                                                                             /* SETITEMS */
            if (pop_mark(d, &k) < 0 || k <= mark_base(d)) return -1;
            if (do_setitems(d, k) < 0) return -1;
            break;
        case 'q': case 'r': case 'h': case 'j': {                                             /* BINPUT, BINGET */
            int w = (op == 'q' || op == 'h') ? 1 : 4;
            if (need(r, w) < 0) return -1;
            uint64_t idx = le(r->buf + r->pos, w);
            r->pos += w;
            if ((op == 'q' || op == 'r' ? memo_put(d, idx) : memo_get(d, idx)) < 0) return -1;
            break;
        }
        case 0x94: if (memo_put(d, d->memo_count) < 0) return -1; break;                   /* MEMOIZE */
        default:
            return -1; /* globals, reduce, persistent ids, text opcodes: the restricted unpickler decides */
        }
    }
}

static void dec_free(Dec *d) {
    while (d->sp) val_decref(d->stack[--d->sp]);
    free(d->stack); free(d->marks);
    for (size_t c = 0; c < d->memo_chunks; c++) {
        if (!d->memo[c]) continue;
        for (size_t i = 0; i < MEMO_CHUNK; i++) val_decref(d->memo[c][i]);
        free(d->memo[c]);
    }
    free(d->memo); free(d->row_bit);
    for (int i = 0; i < d->ncols; i++) {
        Py_XDECREF(d->cols[i].name); Py_XDECREF(d->cols[i].table);
        free(d->cols[i].data); free(d->cols[i].index); map_free(&d->cols[i].ident);
    }
    for (int i = 0; i < d->nkeys; i++) Py_XDECREF(d->keycache[i]);
    for (int i = 0; i < d->nrl; i++) { Py_XDECREF(d->rl[i].list); free(d->rl[i].rows); }
    free(d->row_state);
    map_free(&d->intern); map_free(&d->dict_intern); map_free(&d->canonical);
    Py_XDECREF(d->interned); Py_XDECREF(d->dicts); Py_XDECREF(d->action_str);
    free(d->rd.buf);
}

/* (root, [(list, rows)], [(name, kind, data, table, itemsize)], nrows); rows: a buffer of
 * int64 row numbers, or (first, count) when they are first, first + 1, ...; column buffers are
 * freed as they are copied out, to keep the peak low. Kind 1: int64 values; kind 2: indexes in
 * the narrowest signed type that holds the table's size (itemsize 1, 2 or 4). */
static PyObject *build_result(Dec *d) {
    PyObject *lists = PyList_New(0), *cols = PyList_New(0), *out = NULL;
    if (!lists || !cols) goto done;
    for (int i = 0; i < d->nrl; i++) {
        PyObject *rows;
        if (d->rl[i].rows) {
            rows = buf_new(d->rl[i].rows, d->rl[i].n * sizeof(int64_t));
            d->rl[i].rows = NULL;
        } else { /* a run: (first, count) */
            rows = Py_BuildValue("(LL)", (long long)d->rl[i].first, (long long)d->rl[i].n);
        }
        if (!rows) goto done;
        PyObject *t = Py_BuildValue("(ON)", d->rl[i].list, rows);
        if (!t || PyList_Append(lists, t) < 0) { Py_XDECREF(t); goto done; }
        Py_DECREF(t);
    }
    for (int i = 0; i < d->ncols; i++) {
        Column *c = &d->cols[i];
        int width = 8;
        PyObject *data;
        if (c->kind == 1) {
            data = buf_new(c->data, (size_t)d->nrows * sizeof(int64_t));
            c->data = NULL;
            if (!data) goto done;
        } else { /* already the narrowest type that holds its table's indexes */
            width = c->width;
            data = buf_new(c->index, (size_t)d->nrows * (size_t)width);
            c->index = NULL;
            if (!data) goto done;
        }
        PyObject *t = Py_BuildValue("(OiNOi)", c->name, c->kind, data, c->table ? c->table : Py_None, width);
        if (!t || PyList_Append(cols, t) < 0) { Py_XDECREF(t); goto done; }
        Py_DECREF(t);
    }
    out = Py_BuildValue("(OOOL)", (PyObject *)d->stack[d->sp - 1], lists, cols, (long long)d->nrows);
done:
    Py_XDECREF(lists); Py_XDECREF(cols);
    return out;
}

static PyObject *py_scan(PyObject *self, PyObject *args) {
    PyObject *pathobj;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &pathobj)) return NULL;
    FILE *f = fopen(PyBytes_AS_STRING(pathobj), "rb");
    Py_DECREF(pathobj);
    if (!f) Py_RETURN_NONE;
    Dec d;
    memset(&d, 0, sizeof d);
    PyObject *result = NULL;
    long long size = -1;
    if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) goto done;
    d.rd.f = f; d.rd.cap = 1 << 20; d.rd.buf = malloc(d.rd.cap); d.rd.left = (uint64_t)size;
    d.memo_limit = (uint64_t)size + 16; /* every memo op takes a byte at least */
    d.interned = PyList_New(0);
    d.dicts = PyList_New(0);
    d.action_str = PyUnicode_FromString("action");
    if (!d.rd.buf || !d.interned || !d.dicts || !d.action_str || map_init(&d.intern, 1024) < 0 ||
        map_init(&d.dict_intern, 1024) < 0 || map_init(&d.canonical, 1024) < 0)
        goto done;
    if (run(&d) == 0) result = build_result(&d);
done:
    dec_free(&d);
    fclose(f);
    if (!result) {
        PyErr_Clear(); /* any failure means: take the restricted unpickler instead */
        Py_RETURN_NONE;
    }
    return result;
}

/* ---------------------------------------------------------------- allocator replay */
enum { A_OTHER, A_ALLOC, A_FREE_REQUESTED, A_FREE_COMPLETED, A_FREE, A_SEG_ALLOC, A_SEG_FREE, A_SEG_MAP, A_SEG_UNMAP };
#define MIN_BLOCK 512
#define SMALL_SIZE (1 << 20)

typedef struct { Map freem, free_by_end, seg_of, segs, used; } Sim;

static int64_t round_size(int64_t n) { return n < MIN_BLOCK ? MIN_BLOCK : MIN_BLOCK * ((n + MIN_BLOCK - 1) / MIN_BLOCK); }
static int should_split(int64_t block, int64_t rounded) {
    int64_t rem = block - rounded;
    return rounded <= SMALL_SIZE ? rem >= MIN_BLOCK : rem > SMALL_SIZE;
}
static int add_free(Sim *s, int64_t start, int64_t size, int64_t seg) {
    return (map_put(&s->freem, start, size) < 0 || map_put(&s->free_by_end, start + size, start) < 0 ||
            map_put(&s->seg_of, start, seg) < 0) ? -1 : 0;
}
static int64_t take_free(Sim *s, int64_t start) {
    int64_t size = 0;
    map_pop(&s->freem, start, &size);
    map_pop(&s->free_by_end, start + size, NULL);
    return size;
}
static int sim_alloc(Sim *s, int64_t addr, int64_t nbytes, int64_t *out) {
    int64_t rounded = round_size(nbytes);
    if (!map_find(&s->freem, addr)) { *out = rounded; return map_put(&s->used, addr, rounded); }
    int64_t seg = *map_find(&s->seg_of, addr);
    int64_t size = take_free(s, addr);
    if (size >= rounded && should_split(size, rounded)) {
        if (add_free(s, addr + rounded, size - rounded, seg) < 0) return -1;
        size = rounded;
    }
    *out = size;
    return (map_put(&s->used, addr, size) < 0 || map_put(&s->seg_of, addr, seg) < 0) ? -1 : 0;
}
static int sim_complete(Sim *s, int64_t addr) {
    int64_t size;
    if (!map_pop(&s->used, addr, &size)) return 0;
    int64_t *segp = map_find(&s->seg_of, addr);
    if (!segp || !map_find(&s->segs, *segp)) return 0;
    int64_t seg = *segp, start = addr;
    int64_t *prev = map_find(&s->free_by_end, start);
    if (prev) {
        int64_t p = *prev, *ps = map_find(&s->seg_of, p);
        if (ps && *ps == seg) { size += take_free(s, p); start = p; }
    }
    int64_t nxt = start + size, *ns = map_find(&s->seg_of, nxt);
    if (map_find(&s->freem, nxt) && ns && *ns == seg) size += take_free(s, nxt);
    return add_free(s, start, size, seg);
}
static int sim_segment_alloc(Sim *s, int64_t addr, int64_t size) {
    return (map_put(&s->segs, addr, size) < 0) ? -1 : add_free(s, addr, size, addr);
}
static void sim_segment_free(Sim *s, int64_t addr, int64_t size) {
    map_pop(&s->segs, addr, NULL);
    int64_t *f = map_find(&s->freem, addr);
    if (f && *f == size) { take_free(s, addr); map_pop(&s->seg_of, addr, NULL); }
}

/* per_category(delta_i64, cat_i8, sample_i64 ascending, ncat) -> (bytes, present): for each
 * category c and sample j, the sum of delta over the entries i <= sample[j] whose cat is c
 * (int64, ncat rows of len(sample)); present[c] = 1 where some entry of c moves memory. The
 * running sums of timeline._per_category in one pass. */
static PyObject *py_per_category(PyObject *self, PyObject *args) {
    Py_buffer delta, cat, sample;
    int ncat;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &delta, &cat, &sample, &ncat)) return NULL;
    PyObject *result = NULL, *out_b = NULL, *present_b = NULL;
    Py_ssize_t n = cat.len, ns = sample.len / 8;
    if (delta.len != n * 8 || ncat < 1 || ncat > 127) {
        PyErr_SetString(PyExc_ValueError, "per_category: delta and cat differ in length, or ncat is not 1..127");
        goto done;
    }
    out_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)ncat * ns * 8);
    present_b = PyBytes_FromStringAndSize(NULL, ncat);
    if (!out_b || !present_b) goto done;
    const int64_t *dl = delta.buf, *sm = sample.buf;
    const int8_t *ct = cat.buf;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(out_b), run[128] = {0};
    char *present = PyBytes_AS_STRING(present_b);
    memset(present, 0, (size_t)ncat);
    int bad = 0;
    Py_ssize_t j = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        for (; j < ns && sm[j] < i; j++)
            for (int c = 0; c < ncat; c++) out[(Py_ssize_t)c * ns + j] = run[c];
        if (dl[i]) {
            int c = ct[i];
            if (c < 0 || c >= ncat) bad = 1;
            else { run[c] += dl[i]; present[c] = 1; }
        }
    }
    for (; j < ns; j++)
        for (int c = 0; c < ncat; c++) out[(Py_ssize_t)c * ns + j] = run[c];
    Py_END_ALLOW_THREADS
    if (bad) { PyErr_SetString(PyExc_ValueError, "per_category: a category code out of range"); goto done; }
    result = Py_BuildValue("(OO)", out_b, present_b);
done:
    Py_XDECREF(out_b); Py_XDECREF(present_b);
    PyBuffer_Release(&delta); PyBuffer_Release(&cat); PyBuffer_Release(&sample);
    return result;
}

static PyObject *py_replay(PyObject *self, PyObject *args) {
    Py_buffer act, addr, size;
    int cpu;
    if (!PyArg_ParseTuple(args, "y*y*y*p", &act, &addr, &size, &cpu)) return NULL;
    PyObject *result = NULL, *block_b = NULL, *pair_b = NULL;
    Sim s; Map live;
    memset(&s, 0, sizeof s); memset(&live, 0, sizeof live);
    Py_ssize_t n = act.len;
    if (addr.len != n * 8 || size.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "replay: columns differ in length");
        goto done;
    }
    block_b = PyBytes_FromStringAndSize(NULL, n * 8);
    pair_b = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!block_b || !pair_b) goto done;
    if (map_init(&s.freem, 1024) < 0 || map_init(&s.free_by_end, 1024) < 0 || map_init(&s.seg_of, 1024) < 0 ||
        map_init(&s.segs, 64) < 0 || map_init(&s.used, 1024) < 0 || map_init(&live, 1024) < 0) {
        PyErr_NoMemory(); goto done;
    }
    const uint8_t *A = act.buf;
    const int64_t *ad = addr.buf, *sz = size.buf;
    int64_t *block = (int64_t *)PyBytes_AS_STRING(block_b), *pair = (int64_t *)PyBytes_AS_STRING(pair_b);
    int err = 0;
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        block[i] = 0; pair[i] = -1;
        int64_t j;
        switch (A[i]) {
        case A_ALLOC: {
            int64_t *prev = map_find(&live, ad[i]);
            if (prev) pair[*prev] = i; /* overwritten while live: the old one is never freed */
            int64_t b = sz[i];
            if (!cpu) err = sim_alloc(&s, ad[i], sz[i], &b);
            block[i] = b;
            if (!err) err = map_put(&live, ad[i], i);
            break;
        }
        case A_FREE_REQUESTED: case A_FREE:
            if (map_pop(&live, ad[i], &j)) { block[i] = block[j]; pair[i] = j; pair[j] = i; }
            else block[i] = sz[i];
            if (A[i] == A_FREE) err = sim_complete(&s, ad[i]);
            break;
        case A_FREE_COMPLETED: err = sim_complete(&s, ad[i]); break;
        case A_SEG_ALLOC: case A_SEG_MAP: err = sim_segment_alloc(&s, ad[i], sz[i]); break;
        case A_SEG_FREE: case A_SEG_UNMAP: sim_segment_free(&s, ad[i], sz[i]); break;
        default: break;
        }
    }
    if (err) { PyErr_NoMemory(); goto done; }
    result = Py_BuildValue("(OO)", block_b, pair_b);
done:
    Py_XDECREF(block_b); Py_XDECREF(pair_b);
    map_free(&s.freem); map_free(&s.free_by_end); map_free(&s.seg_of); map_free(&s.segs); map_free(&s.used);
    map_free(&live);
    PyBuffer_Release(&act); PyBuffer_Release(&addr); PyBuffer_Release(&size);
    return result;
}


/* --------------------------------------------------- the caching allocator's model */
/* CachingAllocatorModel (reading/allocator_model.py, the reference) line for line: the replay's block
 * bookkeeping above, with the choices a trace would give made here: the smallest cached free
 * block of the request's pool that fits (ties: the lowest address), else a new segment, or with
 * `expandable` the pool's one segment grown at its end by pages. */
#define MODEL_GAP (INT64_C(1) << 30)
typedef struct { int64_t *size, *start; size_t n, cap; } Pool; /* free blocks sorted by (size, start) */

static size_t pool_lower(Pool *p, int64_t size, int64_t start) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (p->size[mid] < size || (p->size[mid] == size && p->start[mid] < start)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
static int pool_insert(Pool *p, int64_t size, int64_t start) {
    if (p->n == p->cap) {
        size_t c = p->cap ? p->cap * 2 : 64;
        int64_t *a = realloc(p->size, c * 8), *b;
        if (!a) return -1;
        p->size = a;
        b = realloc(p->start, c * 8);
        if (!b) return -1;
        p->start = b; p->cap = c;
    }
    size_t i = pool_lower(p, size, start);
    memmove(p->size + i + 1, p->size + i, (p->n - i) * 8);
    memmove(p->start + i + 1, p->start + i, (p->n - i) * 8);
    p->size[i] = size; p->start[i] = start; p->n++;
    return 0;
}
static void pool_remove(Pool *p, int64_t size, int64_t start) {
    size_t i = pool_lower(p, size, start);
    if (i < p->n && p->size[i] == size && p->start[i] == start) {
        memmove(p->size + i, p->size + i + 1, (p->n - i - 1) * 8);
        memmove(p->start + i, p->start + i + 1, (p->n - i - 1) * 8);
        p->n--;
    }
}

typedef struct { Sim s; Map small_seg; Pool pool[2]; int64_t next_segment, reserved, grown[2]; int expandable; } Model;

static int model_add_free(Model *m, int64_t start, int64_t size, int64_t seg) {
    int64_t *small = map_find(&m->small_seg, seg);
    return (add_free(&m->s, start, size, seg) < 0 || pool_insert(&m->pool[*small], size, start) < 0) ? -1 : 0;
}
static int64_t model_take_free(Model *m, int64_t start) {
    int64_t *size = map_find(&m->s.freem, start), *seg = map_find(&m->s.seg_of, start);
    pool_remove(&m->pool[*map_find(&m->small_seg, *seg)], *size, start);
    return take_free(&m->s, start);
}
static int64_t model_new_segment(Model *m, int small, int64_t size) {
    /* each new segment below the last: cudaMalloc hands out lower addresses as it goes, and the
       address breaks best fit's ties (allocator_model.CachingAllocatorModel) */
    m->next_segment -= size + MODEL_GAP;
    int64_t seg = m->next_segment;
    if (map_put(&m->small_seg, seg, small) < 0 || map_put(&m->s.segs, seg, size) < 0 ||
        model_add_free(m, seg, size, seg) < 0) return -1;
    m->reserved += size;
    return seg;
}
static int64_t segment_size(int64_t rounded) {
    if (rounded <= SMALL_SIZE) return 2 * SMALL_SIZE;
    if (rounded < 10 * SMALL_SIZE) return 20 * SMALL_SIZE;
    return 2 * SMALL_SIZE * ((rounded + 2 * SMALL_SIZE - 1) / (2 * SMALL_SIZE));
}
static int64_t model_grow(Model *m, int small, int64_t rounded) {
    if (m->grown[small] < 0) {
        m->next_segment -= INT64_C(1) << 44;  /* room above it to grow into */
        int64_t seg = model_new_segment(m, small, 0);
        if (seg < 0) return -1;
        m->grown[small] = seg;
    }
    int64_t seg = m->grown[small], *segsize = map_find(&m->s.segs, seg);
    int64_t end = seg + *segsize, *tail = map_find(&m->s.free_by_end, end), start = end, have = 0;
    if (tail) { start = *tail; have = model_take_free(m, start); }
    int64_t page = small ? 2 * SMALL_SIZE : 20 * SMALL_SIZE;
    int64_t pages = (rounded - have + page - 1) / page * page;
    *map_find(&m->s.segs, seg) += pages;
    m->reserved += pages;
    return model_add_free(m, start, have + pages, seg) < 0 ? -1 : start;
}
/* the request's block: its address in *addr and bytes in *block */
static int model_alloc(Model *m, int64_t nbytes, int64_t *addr, int64_t *block) {
    int64_t rounded = round_size(nbytes), start;
    int small = rounded <= SMALL_SIZE;
    Pool *p = &m->pool[small];
    size_t i = pool_lower(p, rounded, -1);
    if (i < p->n) start = p->start[i];
    else start = m->expandable ? model_grow(m, small, rounded) : model_new_segment(m, small, segment_size(rounded));
    if (start < 0) return -1;
    int64_t seg = *map_find(&m->s.seg_of, start), size = model_take_free(m, start);
    if (size >= rounded && should_split(size, rounded)) {
        if (model_add_free(m, start + rounded, size - rounded, seg) < 0) return -1;
        size = rounded;
    }
    *addr = start; *block = size;
    return (map_put(&m->s.used, start, size) < 0 || map_put(&m->s.seg_of, start, seg) < 0) ? -1 : 0;
}
static int model_release(Model *m, int64_t addr) {
    int64_t size;
    if (!map_pop(&m->s.used, addr, &size)) return 0;
    int64_t seg = *map_find(&m->s.seg_of, addr), start = addr;
    int64_t *prev = map_find(&m->s.free_by_end, start);
    if (prev) {
        int64_t p = *prev, *ps = map_find(&m->s.seg_of, p);
        if (ps && *ps == seg) { size += model_take_free(m, p); start = p; }
    }
    int64_t nxt = start + size, *ns = map_find(&m->s.seg_of, nxt);
    if (map_find(&m->s.freem, nxt) && ns && *ns == seg) size += model_take_free(m, nxt);
    return model_add_free(m, start, size, seg);
}

static PyObject *py_model(PyObject *self, PyObject *args) {
    Py_buffer act, size, ids;
    int expandable;
    if (!PyArg_ParseTuple(args, "y*y*y*p", &act, &size, &ids, &expandable)) return NULL;
    PyObject *result = NULL, *cols[4] = {NULL, NULL, NULL, NULL};
    Model m; Map placed; /* allocation id -> its event */
    memset(&m, 0, sizeof m); memset(&placed, 0, sizeof placed);
    m.next_segment = INT64_C(1) << 60; m.grown[0] = m.grown[1] = -1; m.expandable = expandable;
    Py_ssize_t n = act.len;
    if (size.len != n * 8 || ids.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "model: columns differ in length");
        goto done;
    }
    for (int c = 0; c < 4; c++)
        if (!(cols[c] = PyBytes_FromStringAndSize(NULL, n * 8))) goto done;
    if (map_init(&m.s.freem, 1024) < 0 || map_init(&m.s.free_by_end, 1024) < 0 || map_init(&m.s.seg_of, 1024) < 0 ||
        map_init(&m.s.segs, 64) < 0 || map_init(&m.s.used, 1024) < 0 || map_init(&m.small_seg, 64) < 0 ||
        map_init(&placed, 1024) < 0) {
        PyErr_NoMemory(); goto done;
    }
    const uint8_t *A = act.buf;
    const int64_t *sz = size.buf, *id = ids.buf;
    int64_t *block = (int64_t *)PyBytes_AS_STRING(cols[0]), *addr = (int64_t *)PyBytes_AS_STRING(cols[1]);
    int64_t *segat = (int64_t *)PyBytes_AS_STRING(cols[2]), *grown = (int64_t *)PyBytes_AS_STRING(cols[3]);
    int err = 0;
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        segat[i] = -1; grown[i] = 0;
        if (A[i]) { /* alloc */
            int64_t before = m.reserved;
            err = model_alloc(&m, sz[i], &addr[i], &block[i]);
            if (!err && m.reserved != before) { segat[i] = *map_find(&m.s.seg_of, addr[i]); grown[i] = m.reserved - before; }
            if (!err) err = map_put(&placed, id[i], i);
        } else { /* free: of the allocation with this id */
            int64_t j;
            if (!map_pop(&placed, id[i], &j)) {
                PyErr_SetString(PyExc_ValueError, "model: a free of an allocation not live");
                goto done;
            }
            addr[i] = addr[j]; block[i] = block[j];
            err = model_release(&m, addr[i]);
        }
    }
    if (err) { PyErr_NoMemory(); goto done; }
    result = Py_BuildValue("(OOOO)", cols[0], cols[1], cols[2], cols[3]);
done:
    for (int c = 0; c < 4; c++) Py_XDECREF(cols[c]);
    map_free(&m.s.freem); map_free(&m.s.free_by_end); map_free(&m.s.seg_of); map_free(&m.s.segs); map_free(&m.s.used);
    map_free(&m.small_seg); map_free(&placed);
    for (int k = 0; k < 2; k++) { free(m.pool[k].size); free(m.pool[k].start); }
    PyBuffer_Release(&act); PyBuffer_Release(&size); PyBuffer_Release(&ids);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", py_scan, METH_VARARGS,
     "scan(path) -> (root, [(list, rows)], [(name, kind, data, table)], nrows), or None: take the slow road"},
    {"per_category", py_per_category, METH_VARARGS,
     "per_category(delta_i64, cat_i8, sample_i64 ascending, ncat) -> (int64 bytes per category and sample, present)"},
    {"replay", py_replay, METH_VARARGS,
     "replay(action_u8, addr_i64, size_i64, cpu) -> (block bytes per entry, matching entry per entry)"},
    {"model", py_model, METH_VARARGS,
     "model(alloc_u8, size_i64, id_i64, expandable) -> (block, address, new segment's start or -1, "
     "reserved bytes added) per event, each int64 bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcore", "memory_audit's compiled core", -1, methods};

PyMODINIT_FUNC PyInit__fastcore(void) {
    if (PyType_Ready(&BufType) < 0) return NULL;
    return PyModule_Create(&module);
}
