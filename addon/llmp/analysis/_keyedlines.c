/* The reader's lines with their sort keys, split and matched in C.

   `llmp.analysis.reader` defines what a line and its key are: `_file_lines` splits
   a file read in blocks at every `\n` (the last line maybe without one), and
   `format.lines.KEY_RE` reads `(t_start_ms, id)` off the start of a line the
   recorder wrote.  On a digest recording those two steps and the generator
   frames around them cost a few microseconds a line, about a twentieth of
   `llmp analyze` (docs/performance.md, "The reader's front in C").  This iterator does the
   same work without a Python frame per line, and decides nothing itself:

   - a line is split exactly as `_file_lines` splits it: `read(block)` until it
     gives no bytes, each line a new bytes object;
   - only the plainest match is taken here: the text `{"v":1,"id":` digits
     `,"conn":` an optional `-` and digits `,"t_start_ms":` an optional `-` and
     digits, then `,` or `}`, with at most 18 digits in each number.  Every such
     line is one `KEY_RE` matches with `v` 1, and its key is the same pair of
     ints;
   - any other line (another `v`, longer numbers, no match, a blank line) goes
     to `slow(line)`, the reader's own code for it, which returns the item to
     yield or None to skip the line.

   Each item is `((t_start_ms, id), line, len(line), file)`, as `in_order` takes
   them.  tests/analysis/test_keyedlines.py checks it against the Python path. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *read;    /* the file's read method */
    PyObject *block;   /* the block size, as an int */
    PyObject *file;    /* the file's index, yielded with every line */
    PyObject *slow;    /* slow(line) -> item or None */
    PyObject *advance; /* advance(n) for a progress bar, or None */
    PyObject *buf;     /* the block being split, or NULL */
    Py_ssize_t pos;    /* where its next line starts */
    PyObject *pending; /* the start of a line that spans blocks: a list, or NULL */
    int done;
} KeyedLines;

static int kl_traverse(KeyedLines *self, visitproc visit, void *arg) {
    Py_VISIT(self->read);
    Py_VISIT(self->block);
    Py_VISIT(self->file);
    Py_VISIT(self->slow);
    Py_VISIT(self->advance);
    Py_VISIT(self->buf);
    Py_VISIT(self->pending);
    return 0;
}

static int kl_clear(KeyedLines *self) {
    Py_CLEAR(self->read);
    Py_CLEAR(self->block);
    Py_CLEAR(self->file);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->advance);
    Py_CLEAR(self->buf);
    Py_CLEAR(self->pending);
    return 0;
}

static void kl_dealloc(KeyedLines *self) {
    PyObject_GC_UnTrack(self);
    kl_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int kl_init(KeyedLines *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"read", "block", "file", "slow", "advance", NULL};
    PyObject *read, *block, *file, *slow, *advance = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OO|O", kwlist, &read, &PyLong_Type,
                                     &block, &file, &slow, &advance))
        return -1;
    kl_clear(self);
    self->read = Py_NewRef(read);
    self->block = Py_NewRef(block);
    self->file = Py_NewRef(file);
    self->slow = Py_NewRef(slow);
    self->advance = advance == Py_None ? NULL : Py_NewRef(advance);
    self->pos = 0;
    self->done = 0;
    return 0;
}

/* Reads digits at *p (at most 18, with an optional sign when `sign`): 1 and the value,
   or 0 when they are not there or are too many for this path. */
static int digits(const char **p, const char *end, int sign, long long *out) {
    const char *s = *p;
    int neg = 0;
    if (sign && s < end && *s == '-') {
        neg = 1;
        s++;
    }
    const char *start = s;
    long long v = 0;
    while (s < end && *s >= '0' && *s <= '9') {
        if (s - start >= 18) return 0;
        v = v * 10 + (*s - '0');
        s++;
    }
    if (s == start) return 0;
    *out = neg ? -v : v;
    *p = s;
    return 1;
}

static int literal(const char **p, const char *end, const char *text, Py_ssize_t n) {
    if (end - *p < n || memcmp(*p, text, (size_t)n) != 0) return 0;
    *p += n;
    return 1;
}

/* The key of the recorder's plainest line start, or 0: the slow path decides. */
static int fast_key(const char *s, Py_ssize_t n, long long *t, long long *id) {
    const char *p = s, *end = s + n;
    long long ignored;
    if (!literal(&p, end, "{\"v\":1,\"id\":", 12)) return 0;
    if (!digits(&p, end, 0, id)) return 0;
    if (!literal(&p, end, ",\"conn\":", 8)) return 0;
    if (!digits(&p, end, 1, &ignored)) return 0;
    if (!literal(&p, end, ",\"t_start_ms\":", 14)) return 0;
    if (!digits(&p, end, 1, t)) return 0;
    return p < end && (*p == ',' || *p == '}');
}

/* The pieces of a line that spanned blocks, joined (and forgotten). */
static PyObject *join_pending(KeyedLines *self) {
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    if (empty == NULL) return NULL;
    PyObject *line = PyObject_CallMethod(empty, "join", "O", self->pending);
    Py_DECREF(empty);
    Py_CLEAR(self->pending);
    return line;
}

/* The next line, a new reference; NULL with no error at the end, NULL with one set. */
static PyObject *next_line(KeyedLines *self) {
    for (;;) {
        if (self->buf != NULL) {
            const char *b = PyBytes_AS_STRING(self->buf);
            Py_ssize_t len = PyBytes_GET_SIZE(self->buf);
            const char *nl = memchr(b + self->pos, '\n', (size_t)(len - self->pos));
            if (nl != NULL) {
                Py_ssize_t end = nl - b + 1, start = self->pos;
                self->pos = end;
                PyObject *piece = PyBytes_FromStringAndSize(b + start, end - start);
                if (piece == NULL || self->pending == NULL) return piece;
                int err = PyList_Append(self->pending, piece);
                Py_DECREF(piece);
                if (err < 0) return NULL;
                return join_pending(self);
            }
            if (self->pos < len) {
                PyObject *rest = PyBytes_FromStringAndSize(b + self->pos, len - self->pos);
                if (rest == NULL) return NULL;
                if (self->pending == NULL && (self->pending = PyList_New(0)) == NULL) {
                    Py_DECREF(rest);
                    return NULL;
                }
                int err = PyList_Append(self->pending, rest);
                Py_DECREF(rest);
                if (err < 0) return NULL;
            }
            Py_CLEAR(self->buf);
        }
        if (self->done) return NULL;
        PyObject *block = PyObject_CallOneArg(self->read, self->block);
        if (block == NULL) return NULL;
        if (!PyBytes_Check(block)) {
            PyErr_Format(PyExc_TypeError, "read() gave %.100s, not bytes", Py_TYPE(block)->tp_name);
            Py_DECREF(block);
            return NULL;
        }
        if (PyBytes_GET_SIZE(block) == 0) {
            Py_DECREF(block);
            self->done = 1;
            if (self->pending == NULL) return NULL;
            return join_pending(self);
        }
        self->buf = block;
        self->pos = 0;
    }
}

static PyObject *kl_next(KeyedLines *self) {
    for (;;) {
        PyObject *line = next_line(self);
        if (line == NULL) return NULL;
        Py_ssize_t n = PyBytes_GET_SIZE(line);
        if (self->advance != NULL) {
            PyObject *size = PyLong_FromSsize_t(n);
            PyObject *r = size == NULL ? NULL : PyObject_CallOneArg(self->advance, size);
            Py_XDECREF(size);
            if (r == NULL) {
                Py_DECREF(line);
                return NULL;
            }
            Py_DECREF(r);
        }
        long long t, id;
        if (!fast_key(PyBytes_AS_STRING(line), n, &t, &id)) {
            PyObject *item = PyObject_CallOneArg(self->slow, line);
            Py_DECREF(line);
            if (item != Py_None) return item; /* or NULL: its error */
            Py_DECREF(item);
            continue;
        }
        PyObject *key = Py_BuildValue("(LL)", t, id);
        if (key == NULL) {
            Py_DECREF(line);
            return NULL;
        }
        PyObject *size = PyLong_FromSsize_t(n);
        if (size == NULL) {
            Py_DECREF(key);
            Py_DECREF(line);
            return NULL;
        }
        PyObject *item = PyTuple_New(4);
        if (item == NULL) {
            Py_DECREF(key);
            Py_DECREF(line);
            Py_DECREF(size);
            return NULL;
        }
        PyTuple_SET_ITEM(item, 0, key);
        PyTuple_SET_ITEM(item, 1, line);
        PyTuple_SET_ITEM(item, 2, size);
        PyTuple_SET_ITEM(item, 3, Py_NewRef(self->file));
        return item;
    }
}

static PyTypeObject KeyedLinesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "llmp.analysis._keyedlines.KeyedLines",
    .tp_doc = "KeyedLines(read, block, file, slow, advance=None): a file's lines with their "
              "sort keys, as reader._keyed_lines gives them.",
    .tp_basicsize = sizeof(KeyedLines),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)kl_init,
    .tp_dealloc = (destructor)kl_dealloc,
    .tp_traverse = (traverseproc)kl_traverse,
    .tp_clear = (inquiry)kl_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)kl_next,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "llmp.analysis._keyedlines",
    "The reader's lines and their sort keys, split and matched in C.", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyedlines(void) {
    if (PyType_Ready(&KeyedLinesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "KeyedLines", (PyObject *)&KeyedLinesType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
