/* A report row's spill line, written in C: the same bytes as `Row.spill_line`.

   `llmp.analysis.rows.Row.spill_line` (Python) defines the line; this module
   writes it for every row of `llmp analyze --json`, where building the row's
   dicts and freeing them cost about a tenth of the run (docs/performance.md,
   "The rows' line in C").  It is exact by construction, not by imitation:

   - it writes itself only what has one spelling: null, true and false, ints of
     64 bits, ASCII strings with nothing to escape, lists of those, and floats
     in the range where Python's repr is orjson's text (1e-4 <= |x| < 1e16, and
     zero: the same shortest digits and the same notation there);
   - any other value (a dict, a big int, a float outside that range, a string
     with an escape or a non-ASCII character, another type) is written by
     orjson.dumps itself, which is what the Python writer calls;
   - where the Python writer would index or format a value of an unexpected
     type (a measured value that is no tuple, a marker field that is no int),
     or orjson refuses a value, `spill_line` returns None and the caller uses
     the Python writer, which then gives its own result or error.

   tests/analysis/test_rowjson.py checks the two writers byte for byte. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

/* ------------------------------------------------------------ the buffer */

typedef struct {
    char *p;
    Py_ssize_t len;
    Py_ssize_t cap;
    char local[4096];
} Buf;

static void buf_init(Buf *b) {
    b->p = b->local;
    b->len = 0;
    b->cap = (Py_ssize_t)sizeof(b->local);
}

static void buf_free(Buf *b) {
    if (b->p != b->local) PyMem_Free(b->p);
}

static int buf_grow(Buf *b, Py_ssize_t need) {
    Py_ssize_t cap = b->cap;
    while (cap < b->len + need) cap *= 2;
    char *p;
    if (b->p == b->local) {
        p = PyMem_Malloc((size_t)cap);
        if (p != NULL) memcpy(p, b->local, (size_t)b->len);
    } else {
        p = PyMem_Realloc(b->p, (size_t)cap);
    }
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->len + n > b->cap && buf_grow(b, n) < 0) return -1;
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, s) put((b), (s), (Py_ssize_t)(sizeof(s) - 1))

/* Results of the writers below: OK, an error is set (ERR), or the Python writer
   must decide (FALLBACK, no error set). */
enum { OK = 0, ERR = -1, FALLBACK = 1 };

/* ------------------------------------------------------------ values */

static PyObject *orjson_dumps; /* orjson.dumps, imported once */

static int put_lld(Buf *b, long long v) {
    char tmp[24];
    char *end = tmp + sizeof(tmp), *o = end;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--o = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *--o = '-';
    return put(b, o, end - o);
}

/* Any value, as orjson.dumps writes it (see the module's comment). */
static int put_delegated(Buf *b, PyObject *v) {
    PyObject *out = PyObject_CallOneArg(orjson_dumps, v);
    if (out == NULL) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) return ERR;
        PyErr_Clear(); /* the Python writer raises its own error for it */
        return FALLBACK;
    }
    int r = put(b, PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out));
    Py_DECREF(out);
    return r;
}

static int put_str(Buf *b, PyObject *s) {
    if (!PyUnicode_IS_ASCII(s)) return put_delegated(b, s);
    const unsigned char *c = (const unsigned char *)PyUnicode_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char ch = c[i];
        if (ch < 0x20 || ch == '"' || ch == '\\' || ch == 0x7f) return put_delegated(b, s);
    }
    if (b->len + n + 2 > b->cap && buf_grow(b, n + 2) < 0) return ERR;
    char *o = b->p + b->len;
    o[0] = '"';
    memcpy(o + 1, c, (size_t)n);
    o[n + 1] = '"';
    b->len += n + 2;
    return OK;
}

static int put_value(Buf *b, PyObject *v, int depth);

static int put_list(Buf *b, PyObject *v, int depth) {
    if (depth > 16) return put_delegated(b, v);
    if (PUT_LIT(b, "[") < 0) return ERR;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++) {
        if (i && PUT_LIT(b, ",") < 0) return ERR;
        PyObject *item = PyList_GET_ITEM(v, i);
        Py_INCREF(item);
        int r = put_value(b, item, depth + 1);
        Py_DECREF(item);
        if (r != OK) return r;
    }
    return PUT_LIT(b, "]");
}

static int put_value(Buf *b, PyObject *v, int depth) {
    if (v == Py_None) return PUT_LIT(b, "null");
    if (v == Py_True) return PUT_LIT(b, "true");
    if (v == Py_False) return PUT_LIT(b, "false");
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) return put_delegated(b, v); /* orjson's own answer for a big int */
        if (x == -1 && PyErr_Occurred()) return ERR;
        return put_lld(b, x);
    }
    if (PyFloat_CheckExact(v)) {
        double x = PyFloat_AS_DOUBLE(v);
        double a = fabs(x);
        if (!(x == 0.0 || (a >= 1e-4 && a < 1e16))) return put_delegated(b, v);
        if (a < 1e15 && x == (double)(long long)x && !(x == 0.0 && signbit(x))) {
            /* An integral value: repr writes its digits and ".0" (-0.0 goes below). */
            if (put_lld(b, (long long)x) < 0) return ERR;
            return PUT_LIT(b, ".0");
        }
        char *s = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (s == NULL) return ERR;
        int r = put(b, s, (Py_ssize_t)strlen(s));
        PyMem_Free(s);
        return r;
    }
    if (PyUnicode_CheckExact(v)) return put_str(b, v);
    if (PyList_CheckExact(v)) return put_list(b, v, depth);
    return put_delegated(b, v);
}

/* A measured value: `(value, source)` as {"value":…,"source":…}, or null. */
static int put_mv(Buf *b, PyObject *mv) {
    if (mv == Py_None) return PUT_LIT(b, "null");
    if (!PyTuple_CheckExact(mv) || PyTuple_GET_SIZE(mv) < 2) return FALLBACK;
    int r;
    if (PUT_LIT(b, "{\"value\":") < 0) return ERR;
    if ((r = put_value(b, PyTuple_GET_ITEM(mv, 0), 0)) != OK) return r;
    if (PUT_LIT(b, ",\"source\":") < 0) return ERR;
    if ((r = put_value(b, PyTuple_GET_ITEM(mv, 1), 0)) != OK) return r;
    return PUT_LIT(b, "}");
}


/* ------------------------------------------------------------ names */

/* Each field's name, written once: the enum of indices, the names' text and the
   fields each class is read for all come from these lists. */
#define ROW_NAMES(X) \
    X(id) X(api) X(model) X(client) X(recording) X(draft_n) X(draft_n_accepted) \
    X(t_start_ms) X(kind) X(side_call_shape) X(session) X(conversation) X(turn) X(counts) \
    X(composition) X(linked_to) X(new_conversation) X(prefix_tokens) X(break_cause) \
    X(compaction) X(predicted_reuse) X(observed_reuse) X(cause) X(lost_client) \
    X(lost_external) X(side_calls_between) X(other_conversations_between) \
    X(other_domains_between) X(loss_measured) X(changed) X(server) X(cache_read_tokens) \
    X(cache_write_tokens) X(uncached_tokens) X(cost_usd) X(provider_reason)
#define COUNTS_NAMES(X) \
    X(prompt_tokens) X(completion_tokens) X(reused_tokens) X(evaluated_tokens) X(prefill_ms) \
    X(decode_ms) X(load_ms)
#define LOSS_ONLY_NAMES(X) X(tokens) X(ms) X(usd) /* a Loss also has `cause`, a Row field */

#define AS_ENUM(n) A_##n,
#define AS_TEXT(n) #n,

enum { ROW_NAMES(AS_ENUM) COUNTS_NAMES(AS_ENUM) LOSS_ONLY_NAMES(AS_ENUM) N_NAMES };

static const char *const NAME_TEXT[N_NAMES] = {
    ROW_NAMES(AS_TEXT) COUNTS_NAMES(AS_TEXT) LOSS_ONLY_NAMES(AS_TEXT)
};

static PyObject *NAME[N_NAMES];

/* ------------------------------------------------------------ attributes */

/* Where a slotted class keeps each field: `Row`, `Counts` and `Loss` are
   dataclasses with `slots=True`, so each field is a member descriptor at a fixed
   offset in the object, which is read directly, as the interpreter's own
   specialised attribute read does.  The offsets are taken from the class's
   descriptors, and used only for objects of exactly that class while its version
   tag is unchanged (assigning a class attribute changes it); anything else is
   read with the generic getattr. */
typedef struct {
    PyTypeObject *type; /* a strong reference, so its address cannot be reused */
    unsigned int version;
    const int *names; /* the fields read through this layout */
    int n;
    Py_ssize_t offset[N_NAMES]; /* by name */
} Layout;

static const int ROW_FIELDS[] = {ROW_NAMES(AS_ENUM)};
static const int COUNTS_FIELDS[] = {COUNTS_NAMES(AS_ENUM)};
static const int LOSS_FIELDS[] = {A_cause, LOSS_ONLY_NAMES(AS_ENUM)};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static Layout ROW = {NULL, 0, ROW_FIELDS, (int)COUNT(ROW_FIELDS), {0}};
static Layout COUNTS = {NULL, 0, COUNTS_FIELDS, (int)COUNT(COUNTS_FIELDS), {0}};
static Layout LOSS = {NULL, 0, LOSS_FIELDS, (int)COUNT(LOSS_FIELDS), {0}};

static int layout_resolve(Layout *L, PyTypeObject *t) {
    Py_CLEAR(L->type);
    if (t->tp_getattro != PyObject_GenericGetAttr) return 0;
    for (int k = 0; k < L->n; k++) {
        int i = L->names[k];
        PyObject *d = PyObject_GetAttr((PyObject *)t, NAME[i]);
        if (d == NULL) {
            PyErr_Clear();
            return 0;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type)
                 && ((PyMemberDescrObject *)d)->d_member->type == Py_T_OBJECT_EX
                 && PyType_IsSubtype(t, ((PyDescrObject *)d)->d_type);
        if (ok) L->offset[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok) return 0;
    }
    if (!PyUnstable_Type_AssignVersionTag(t) || t->tp_version_tag == 0) return 0;
    L->version = t->tp_version_tag;
    L->type = (PyTypeObject *)Py_NewRef(t);
    return 1;
}

/* `o.<NAME[name]>` as a new reference; NULL with *r set when it cannot be had
   (ERR: an error is set; FALLBACK: an unset slot, the Python writer's error). */
static PyObject *field(PyObject *o, Layout *L, int name, int *r) {
    PyTypeObject *t = Py_TYPE(o);
    if (t == L->type && t->tp_version_tag == L->version) { /* 0 once the class changes */
    fast:;
        PyObject *v = *(PyObject **)((char *)o + L->offset[name]);
        if (v == NULL) {
            *r = FALLBACK;
            return NULL;
        }
        return Py_NewRef(v);
    }
    if (layout_resolve(L, t)) goto fast;
    PyObject *v = PyObject_GetAttr(o, NAME[name]);
    if (v == NULL) *r = ERR;
    return v;
}

/* An attribute of `o`, written as a value. */
static int put_attr(Buf *b, PyObject *o, Layout *L, int name) {
    int r = OK;
    PyObject *v = field(o, L, name, &r);
    if (v == NULL) return r;
    r = put_value(b, v, 0);
    Py_DECREF(v);
    return r;
}

static int put_mv_attr(Buf *b, PyObject *o, Layout *L, int name) {
    int r = OK;
    PyObject *v = field(o, L, name, &r);
    if (v == NULL) return r;
    r = put_mv(b, v);
    Py_DECREF(v);
    return r;
}

/* ------------------------------------------------------------ the row */

/* A marker field: `%d` of an int, or nothing for None when `none_ok`. */
static int put_marker_int(Buf *b, PyObject *row, int name, int none_ok) {
    int r = OK;
    PyObject *v = field(row, &ROW, name, &r);
    if (v == NULL) return r;
    r = FALLBACK;
    if (v == Py_None && none_ok) {
        r = OK;
    } else if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) r = ERR;
        else if (!overflow) r = put_lld(b, x);
    }
    Py_DECREF(v);
    return r;
}

/* `api` and `model`: strings (the Python writer caches their JSON by value, which
   only strings keep apart from every other type). */
static int put_head_str(Buf *b, PyObject *row, int name) {
    int r = OK;
    PyObject *v = field(row, &ROW, name, &r);
    if (v == NULL) return r;
    r = PyUnicode_CheckExact(v) ? put_str(b, v) : FALLBACK;
    Py_DECREF(v);
    return r;
}

static int put_loss(Buf *b, PyObject *row, int name) {
    int r = OK;
    PyObject *loss = field(row, &ROW, name, &r);
    if (loss == NULL) return r;
    if (loss == Py_None) {
        r = PUT_LIT(b, "null");
    } else if ((r = PUT_LIT(b, "{\"cause\":")) == OK && (r = put_attr(b, loss, &LOSS, A_cause)) == OK
               && (r = PUT_LIT(b, ",\"tokens\":")) == OK
               && (r = put_attr(b, loss, &LOSS, A_tokens)) == OK
               && (r = PUT_LIT(b, ",\"ms\":")) == OK
               && (r = put_mv_attr(b, loss, &LOSS, A_ms)) == OK
               && (r = PUT_LIT(b, ",\"usd\":")) == OK
               && (r = put_attr(b, loss, &LOSS, A_usd)) == OK) {
        r = PUT_LIT(b, "}");
    }
    Py_DECREF(loss);
    return r;
}

static int put_counts(Buf *b, PyObject *row) {
    static const char *const keys[7] = {
        "{\"prompt_tokens\":", ",\"completion_tokens\":", ",\"reused_tokens\":",
        ",\"evaluated_tokens\":", ",\"prefill_ms\":", ",\"decode_ms\":", ",\"load_ms\":",
    };
    int r = OK;
    PyObject *c = field(row, &ROW, A_counts, &r);
    if (c == NULL) return r;
    for (int i = 0; i < 7 && r == OK; i++) {
        if ((r = put(b, keys[i], (Py_ssize_t)strlen(keys[i]))) == OK)
            r = put_mv_attr(b, c, &COUNTS, A_prompt_tokens + i);
    }
    Py_DECREF(c);
    return r == OK ? PUT_LIT(b, "}") : r;
}

static int put_composition(Buf *b, PyObject *row) {
    static const char *const keys[4] = {
        "{\"system\":", ",\"tools\":", ",\"history\":", ",\"new_content\":",
    };
    int r = OK;
    PyObject *comp = field(row, &ROW, A_composition, &r);
    if (comp == NULL) return r;
    if (!PyTuple_CheckExact(comp) || PyTuple_GET_SIZE(comp) < 4) r = FALLBACK;
    for (int i = 0; i < 4 && r == OK; i++) {
        PyObject *mv = PyTuple_GET_ITEM(comp, i);
        if (mv == Py_None) r = FALLBACK; /* the Python writer indexes it: its error */
        else if ((r = put(b, keys[i], (Py_ssize_t)strlen(keys[i]))) == OK) r = put_mv(b, mv);
    }
    Py_DECREF(comp);
    return r == OK ? PUT_LIT(b, "}") : r;
}

/* Fields after `composition`, each `"name":value`, in the report's order. */
#define PLAIN_TAIL_NAMES \
    A_linked_to, A_new_conversation, A_prefix_tokens, A_break_cause, A_compaction, \
        A_predicted_reuse, A_observed_reuse, A_cause
#define LIST_TAIL_NAMES \
    A_side_calls_between, A_other_conversations_between, A_other_domains_between, \
        A_loss_measured, A_changed, A_server, A_cache_read_tokens, A_cache_write_tokens, \
        A_uncached_tokens, A_cost_usd, A_provider_reason
#define HEAD_TAIL_NAMES A_t_start_ms, A_kind, A_side_call_shape, A_session, A_conversation, A_turn
static const int PLAIN_TAIL[] = {PLAIN_TAIL_NAMES};
static const int LIST_TAIL[] = {LIST_TAIL_NAMES};
static const int HEAD_TAIL[] = {HEAD_TAIL_NAMES};

static int put_key(Buf *b, int name) {
    const char *s = NAME_TEXT[name];
    Py_ssize_t n = (Py_ssize_t)strlen(s);
    if (b->len + n + 4 > b->cap && buf_grow(b, n + 4) < 0) return ERR;
    char *o = b->p + b->len;
    o[0] = ',';
    o[1] = '"';
    memcpy(o + 2, s, (size_t)n);
    o[n + 2] = '"';
    o[n + 3] = ':';
    b->len += n + 4;
    return OK;
}

static int put_fields(Buf *b, PyObject *row, const int *names, size_t count) {
    for (size_t i = 0; i < count; i++) {
        int r;
        if ((r = put_key(b, names[i])) != OK) return r;
        if ((r = put_attr(b, row, &ROW, names[i])) != OK) return r;
    }
    return OK;
}

static int write_row(Buf *b, PyObject *row) {
    int r;
    if ((r = PUT_LIT(b, "{\"id\":")) != OK) return r;
    if ((r = put_marker_int(b, row, A_id, 0)) != OK) return r;
    if ((r = PUT_LIT(b, ",\"api\":")) != OK) return r;
    if ((r = put_head_str(b, row, A_api)) != OK) return r;
    if ((r = PUT_LIT(b, ",\"model\":")) != OK) return r;
    if ((r = put_head_str(b, row, A_model)) != OK) return r;
    if ((r = PUT_LIT(b, ",\"client\":\0")) != OK) return r;
    if ((r = put_marker_int(b, row, A_client, 0)) != OK) return r;
    if ((r = PUT_LIT(b, ",")) != OK) return r;
    if ((r = put_marker_int(b, row, A_recording, 0)) != OK) return r;
    if ((r = PUT_LIT(b, ",")) != OK) return r;
    if ((r = put_marker_int(b, row, A_draft_n, 1)) != OK) return r;
    if ((r = PUT_LIT(b, ",")) != OK) return r;
    if ((r = put_marker_int(b, row, A_draft_n_accepted, 1)) != OK) return r;
    if ((r = PUT_LIT(b, "\0")) != OK) return r;
    /* The rest is `orjson.dumps(row.tail())` without its opening brace. */
    if ((r = put_fields(b, row, HEAD_TAIL, COUNT(HEAD_TAIL))) != OK) return r;
    if ((r = PUT_LIT(b, ",\"counts\":")) != OK) return r;
    if ((r = put_counts(b, row)) != OK) return r;
    if ((r = PUT_LIT(b, ",\"composition\":")) != OK) return r;
    if ((r = put_composition(b, row)) != OK) return r;
    if ((r = put_fields(b, row, PLAIN_TAIL, COUNT(PLAIN_TAIL))) != OK) return r;
    if ((r = PUT_LIT(b, ",\"lost_client\":")) != OK) return r;
    if ((r = put_loss(b, row, A_lost_client)) != OK) return r;
    if ((r = PUT_LIT(b, ",\"lost_external\":")) != OK) return r;
    if ((r = put_loss(b, row, A_lost_external)) != OK) return r;
    if ((r = put_fields(b, row, LIST_TAIL, COUNT(LIST_TAIL))) != OK) return r;
    return PUT_LIT(b, "}\n");
}

static PyObject *spill_line(PyObject *self, PyObject *row) {
    (void)self;
    Buf b;
    buf_init(&b);
    /* The tail's first key is written by put_key with a leading comma, which
       stands for the comma after the marker's closing NUL: `\0,"t_start_ms":`. */
    int r = write_row(&b, row);
    PyObject *out = NULL;
    if (r == OK) {
        out = PyBytes_FromStringAndSize(b.p, b.len);
    } else if (r == FALLBACK) {
        out = Py_NewRef(Py_None);
    } else if (!PyErr_ExceptionMatches(PyExc_MemoryError)) {
        PyErr_Clear(); /* e.g. a missing attribute: the Python writer says what */
        out = Py_NewRef(Py_None);
    }
    buf_free(&b);
    return out;
}

/* ------------------------------------------------------------ the module */

/* `names` as a tuple of str, set as the module's attribute `attr`. */
static int add_names(PyObject *m, const char *attr, const int *names, size_t count) {
    PyObject *t = PyTuple_New((Py_ssize_t)count);
    if (t == NULL) return -1;
    for (size_t i = 0; i < count; i++) PyTuple_SET_ITEM(t, (Py_ssize_t)i, Py_NewRef(NAME[names[i]]));
    int r = PyModule_AddObjectRef(m, attr, t);
    Py_DECREF(t);
    return r;
}

static PyMethodDef methods[] = {
    {"spill_line", spill_line, METH_O,
     "spill_line(row) -> bytes | None\n\n"
     "`Row.spill_line()`'s bytes, or None where the Python writer must decide."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "llmp.analysis._rowjson",
    "A report row's spill line in C: the bytes of Row.spill_line.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowjson(void) {
    PyObject *orjson = PyImport_ImportModule("orjson");
    if (orjson == NULL) return NULL;
    orjson_dumps = PyObject_GetAttrString(orjson, "dumps");
    Py_DECREF(orjson);
    if (orjson_dumps == NULL) return NULL;
    for (int i = 0; i < N_NAMES; i++) {
        NAME[i] = PyUnicode_InternFromString(NAME_TEXT[i]);
        if (NAME[i] == NULL) return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* What this build writes, for rows.py to compare with the Python definition
       at import: a build older than Row refuses itself there instead of writing
       the old schema. */
    static const int WRITES[] = {A_id, A_api, A_model, A_client, HEAD_TAIL_NAMES, A_counts,
                                 A_composition, PLAIN_TAIL_NAMES, A_lost_client,
                                 A_lost_external, LIST_TAIL_NAMES};
    static const int MARKER[] = {A_client, A_recording, A_draft_n, A_draft_n_accepted};
    if (add_names(m, "WRITES", WRITES, COUNT(WRITES)) < 0
        || add_names(m, "MARKER", MARKER, COUNT(MARKER)) < 0
        || add_names(m, "COUNTS", COUNTS_FIELDS, COUNT(COUNTS_FIELDS)) < 0
        || add_names(m, "LOSS", LOSS_FIELDS, COUNT(LOSS_FIELDS)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
