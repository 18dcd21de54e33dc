/* OTLP's protobuf wire format for a SpanRecord tree, in C: the same bytes as
 * otlp.py's encode_tree (field for field, in the same order; the tests compare them),
 * written without running Python per span, per attribute or per byte string.
 *
 * encode_tree(root, trace_id, root_id, caller, offset) -> bytes
 *   root      a SpanRecord (telemetry/spans.py): its fields are read by name
 *   trace_id  16 bytes; root_id: the root's span id, 8 bytes
 *   caller    the root's parent span id (8 bytes; the parent is remote), or None
 *   offset    seconds that turn the records' clock readings into Unix time
 *
 * Spans without an id of their own (bare stages, children whose span_id is None) get
 * one from a xorshift generator seeded from the OS, seeded again in a forked child.
 * Text that is not valid UTF-8 (a lone surrogate a client's JSON can carry) is written
 * with "?" in its place, as otlp.py does: a client cannot drop its own trace.
 * Items of the record's lists are held while they are read, and nesting is bounded by
 * Python's recursion limit: whatever the records hold, a bad one is an exception. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int grow(Buf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *src, size_t n) {
    if (grow(b, n) < 0) return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static size_t varint_to(uint8_t *out, uint64_t n) {
    size_t k = 0;
    while (n >= 0x80) {
        out[k++] = (uint8_t)((n & 0x7F) | 0x80);
        n >>= 7;
    }
    out[k++] = (uint8_t)n;
    return k;
}

static int put_varint(Buf *b, uint64_t n) {
    uint8_t tmp[10];
    return put(b, tmp, varint_to(tmp, n));
}

static int put_fixed64(Buf *b, uint8_t tag, uint64_t v) {
    uint8_t tmp[9];
    tmp[0] = tag;
    for (int i = 0; i < 8; i++) tmp[1 + i] = (uint8_t)(v >> (8 * i));
    return put(b, tmp, 9);
}

/* A length-delimited field whose length is known once its body is written: the tag,
 * room for the longest varint, the body; ``close`` moves the body back over the room
 * its length did not need. */
#define ROOM 5

static Py_ssize_t open_field(Buf *b, uint8_t tag) {
    if (grow(b, 1 + ROOM) < 0) return -1;
    b->data[b->len++] = (char)tag;
    b->len += ROOM;
    return (Py_ssize_t)b->len;
}

static void close_field(Buf *b, Py_ssize_t body) {
    size_t n = b->len - (size_t)body;  /* ROOM's 5 bytes hold lengths below 32 GiB */
    uint8_t tmp[10];
    size_t k = varint_to(tmp, n);
    char *room = b->data + body - ROOM;
    memcpy(room, tmp, k);
    if (k < ROOM) memmove(room + k, b->data + body, n);
    b->len -= ROOM - k;
}

static int put_bytes_field(Buf *b, uint8_t tag, const char *s, Py_ssize_t n) {
    if (put(b, &tag, 1) < 0 || put_varint(b, (uint64_t)n) < 0) return -1;
    return put(b, s, (size_t)n);
}

static int put_str_field(Buf *b, uint8_t tag, PyObject *str) {
    if (!PyUnicode_Check(str)) {
        PyErr_Format(PyExc_TypeError, "a span's text cannot be %.100s", Py_TYPE(str)->tp_name);
        return -1;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(str, &n);
    if (s != NULL) return put_bytes_field(b, tag, s, n);
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
    PyErr_Clear();  /* a lone surrogate: replaced, as otlp.py's _utf8 does */
    PyObject *replaced = PyUnicode_AsEncodedString(str, "utf-8", "replace");
    if (replaced == NULL) return -1;
    int rc = put_bytes_field(b, tag, PyBytes_AS_STRING(replaced), PyBytes_GET_SIZE(replaced));
    Py_DECREF(replaced);
    return rc;
}

/* ids for spans that have none: never zero (not a valid span id) */
static uint64_t rng_state;
static int rng_seeded;

static void forked(void) { rng_seeded = 0; }  /* a child does not repeat its parent's ids */

static void seed_ids(void) {
    uint64_t seed = 0;
    if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) != sizeof seed) {
        struct timespec now;  /* no entropy call: the clock and an address, mixed */
        clock_gettime(CLOCK_REALTIME, &now);
        seed = (uint64_t)now.tv_nsec ^ ((uint64_t)now.tv_sec << 30) ^ (uint64_t)(uintptr_t)&now;
        seed *= 0x9E3779B97F4A7C15u;
    }
    rng_state = seed ? seed : 0x9E3779B97F4A7C15u;
    rng_seeded = 1;
}

static uint64_t next_id(void) {
    if (!rng_seeded) seed_ids();
    uint64_t x;
    do {  /* xorshift64* */
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        x = rng_state * 0x2545F4914F6CDD1Du;
    } while (x == 0);
    return x;
}

static void id_bytes(uint8_t *out, uint64_t id) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(id >> (56 - 8 * i));
}

/* the SpanRecord fields read, interned once */
static PyObject *s_name, *s_start, *s_end, *s_kind, *s_attributes, *s_span_id, *s_error,
    *s_events, *s_children, *s_stages, *s_server, *s_client;

#define HAS_IS_REMOTE 0x100u
#define IS_REMOTE 0x200u

typedef struct {
    const uint8_t *trace;  /* 16 bytes */
    double offset;
} Tree;

static int any_value(Buf *b, PyObject *value);

static int array_value(Buf *b, PyObject *list) {
    Py_ssize_t field = open_field(b, 0x2a);  /* AnyValue.array_value */
    if (field < 0) return -1;
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t item = open_field(b, 0x0a);  /* ArrayValue.values */
        if (item < 0 || any_value(b, PyList_GET_ITEM(list, i)) < 0) return -1;
        close_field(b, item);
    }
    close_field(b, field);
    return 0;
}

static int any_value(Buf *b, PyObject *value) {
    if (PyUnicode_Check(value)) return put_str_field(b, 0x0a, value);
    if (PyBool_Check(value)) {
        uint8_t v[2] = {0x10, value == Py_True};
        return put(b, v, 2);
    }
    if (PyLong_Check(value)) {  /* int64, two's complement */
        uint64_t v = PyLong_AsUnsignedLongLongMask(value);
        if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
        uint8_t tag = 0x18;
        return put(b, &tag, 1) < 0 ? -1 : put_varint(b, v);
    }
    if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return put_fixed64(b, 0x21, bits);
    }
    if (PyList_Check(value)) {
        if (Py_EnterRecursiveCall(" in a span attribute's lists")) return -1;
        int rc = array_value(b, value);
        Py_LeaveRecursiveCall();
        return rc;
    }
    PyErr_Format(PyExc_TypeError, "a span attribute cannot be %.100s", Py_TYPE(value)->tp_name);
    return -1;
}

static int key_value(Buf *b, PyObject *key, PyObject *value) {
    if (!PyUnicode_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "span attribute keys are strings");
        return -1;
    }
    Py_ssize_t field = open_field(b, 0x4a);  /* Span.attributes */
    if (field < 0 || put_str_field(b, 0x0a, key) < 0) return -1;
    Py_ssize_t v = open_field(b, 0x12);
    if (v < 0 || any_value(b, value) < 0) return -1;
    close_field(b, v);
    close_field(b, field);
    return 0;
}

static int unix_nanos(PyObject *seconds, double offset, uint64_t *out) {
    double t = PyFloat_AsDouble(seconds);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    double ns = (t + offset) * 1e9;
    if (!(ns >= 0.0 && ns < 18446744073709551616.0)) {  /* NaN fails too */
        PyErr_SetString(PyExc_OverflowError, "a span's time is not a Unix time in nanoseconds");
        return -1;
    }
    *out = (uint64_t)ns;  /* int(): toward zero, as Python's */
    return 0;
}

static int times(Buf *b, uint64_t start, uint64_t end) {
    if (put_fixed64(b, 0x39, start) < 0) return -1;
    return put_fixed64(b, 0x41, end > start ? end : start);
}

static int kind_field(Buf *b, PyObject *kind) {
    uint8_t v[2] = {0x30, 1};  /* internal, and anything unknown */
    if (PyUnicode_Check(kind)) {
        if (PyUnicode_Compare(kind, s_server) == 0) v[1] = 2;
        else if (PyUnicode_Compare(kind, s_client) == 0) v[1] = 3;
    }
    return put(b, v, 2);
}

static int flags_field(Buf *b, uint32_t flags) {
    uint8_t v[6] = {0x85, 0x01, (uint8_t)flags, (uint8_t)(flags >> 8),
                    (uint8_t)(flags >> 16), (uint8_t)(flags >> 24)};
    return put(b, v, 6);
}

/* the fields every span starts with: trace id, parent (if any), span id */
static int span_lead(Buf *b, const Tree *t, const uint8_t *parent, const uint8_t *id) {
    uint8_t lead[2 + 16 + 2 + 8 + 2 + 8];
    size_t n = 0;
    lead[n++] = 0x0a;
    lead[n++] = 16;
    memcpy(lead + n, t->trace, 16);
    n += 16;
    if (parent != NULL) {
        lead[n++] = 0x22;
        lead[n++] = 8;
        memcpy(lead + n, parent, 8);
        n += 8;
    }
    lead[n++] = 0x12;
    lead[n++] = 8;
    memcpy(lead + n, id, 8);
    n += 8;
    return put(b, lead, n);
}

static int span(Buf *b, const Tree *t, PyObject *record, const uint8_t *parent,
                const uint8_t *id, uint32_t flags);

/* item i of a list of ``size``-tuples, held (reading it can run Python code, which may
 * drop it from the list), or NULL with a TypeError naming ``what`` */
static PyObject *held_tuple(PyObject *list, Py_ssize_t i, Py_ssize_t size, const char *what) {
    PyObject *item = PyList_GET_ITEM(list, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != size) {
        PyErr_Format(PyExc_TypeError, "%s", what);
        return NULL;
    }
    Py_INCREF(item);
    return item;
}

static int is_list(PyObject *obj, const char *field) {
    if (PyList_Check(obj)) return 1;
    PyErr_Format(PyExc_TypeError, "SpanRecord.%s is a list", field);
    return 0;
}

static int stages(Buf *b, const Tree *t, PyObject *list, const uint8_t *parent) {
    if (!is_list(list, "stages")) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *stage = held_tuple(list, i, 3, "a stage is (name, start, end)");
        if (stage == NULL) return -1;
        uint8_t id[8];
        id_bytes(id, next_id());
        uint64_t t0, t1;
        uint8_t internal[2] = {0x30, 1}, unset[2] = {0x7a, 0x00};  /* Status: unset */
        Py_ssize_t field = open_field(b, 0x12);  /* ScopeSpans.spans */
        int rc = field < 0 || span_lead(b, t, parent, id) < 0 ||
                 put_str_field(b, 0x2a, PyTuple_GET_ITEM(stage, 0)) < 0 ||
                 put(b, internal, 2) < 0 ||
                 unix_nanos(PyTuple_GET_ITEM(stage, 1), t->offset, &t0) < 0 ||
                 unix_nanos(PyTuple_GET_ITEM(stage, 2), t->offset, &t1) < 0 ||
                 times(b, t0, t1) < 0 || put(b, unset, 2) < 0 ||
                 flags_field(b, HAS_IS_REMOTE) < 0;
        Py_DECREF(stage);
        if (rc) return -1;
        close_field(b, field);
    }
    return 0;
}

/* a record's children (and theirs, parents first), then its bare stages */
static int children(Buf *b, const Tree *t, PyObject *record, const uint8_t *own) {
    PyObject *kids = PyObject_GetAttr(record, s_children);
    if (kids == NULL) return -1;
    if (!is_list(kids, "children")) {
        Py_DECREF(kids);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(kids); i++) {
        PyObject *child = PyList_GET_ITEM(kids, i);
        Py_INCREF(child);  /* reading it can run Python code */
        PyObject *known = PyObject_GetAttr(child, s_span_id);
        uint64_t value = 0;
        int rc = known == NULL;
        if (!rc && known != Py_None) {
            value = PyLong_AsUnsignedLongLongMask(known);
            rc = value == (uint64_t)-1 && PyErr_Occurred();
        }
        Py_XDECREF(known);
        if (!rc) {
            uint8_t id[8];
            id_bytes(id, value ? value : next_id());
            rc = span(b, t, child, own, id, HAS_IS_REMOTE) < 0;
            if (!rc && Py_EnterRecursiveCall(" in a span's children")) rc = 1;
            else if (!rc) {
                rc = children(b, t, child, id) < 0;
                Py_LeaveRecursiveCall();
            }
        }
        Py_DECREF(child);
        if (rc) goto fail;
    }
    Py_DECREF(kids);
    PyObject *bare = PyObject_GetAttr(record, s_stages);
    if (bare == NULL) return -1;
    int rc = stages(b, t, bare, own);
    Py_DECREF(bare);
    return rc;
fail:
    Py_DECREF(kids);
    return -1;
}

static int events(Buf *b, const Tree *t, PyObject *list) {
    if (!is_list(list, "events")) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *event = held_tuple(list, i, 2, "an event is (name, time)");
        if (event == NULL) return -1;
        uint64_t at;
        Py_ssize_t field = -1;
        int rc = unix_nanos(PyTuple_GET_ITEM(event, 1), t->offset, &at) < 0 ||
                 (field = open_field(b, 0x5a)) < 0 ||  /* Span.events */
                 put_fixed64(b, 0x09, at) < 0 || put_str_field(b, 0x12, PyTuple_GET_ITEM(event, 0)) < 0;
        Py_DECREF(event);
        if (rc) return -1;
        close_field(b, field);
    }
    return 0;
}

/* one Span field of ScopeSpans, as otlp.py's _span writes it */
static int span(Buf *b, const Tree *t, PyObject *record, const uint8_t *parent,
                const uint8_t *id, uint32_t flags) {
    PyObject *name = NULL, *kind = NULL, *start = NULL, *end = NULL, *attributes = NULL,
             *error = NULL, *evs = NULL;
    int rc = -1;
    uint64_t t0, t1;
    if (!(name = PyObject_GetAttr(record, s_name)) || !(kind = PyObject_GetAttr(record, s_kind)) ||
        !(start = PyObject_GetAttr(record, s_start)) || !(end = PyObject_GetAttr(record, s_end)) ||
        !(attributes = PyObject_GetAttr(record, s_attributes)) ||
        !(error = PyObject_GetAttr(record, s_error)) || !(evs = PyObject_GetAttr(record, s_events)))
        goto done;
    if (!PyUnicode_Check(name) || !PyDict_Check(attributes)) {
        PyErr_SetString(PyExc_TypeError, "a SpanRecord's name is a str, its attributes a dict");
        goto done;
    }
    if (error != Py_None && !PyUnicode_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "SpanRecord.error is a str or None");
        goto done;
    }
    Py_ssize_t field = open_field(b, 0x12);
    if (field < 0 || span_lead(b, t, parent, id) < 0) goto done;
    if (put_str_field(b, 0x2a, name) < 0 || kind_field(b, kind) < 0) goto done;
    if (unix_nanos(start, t->offset, &t0) < 0 || unix_nanos(end, t->offset, &t1) < 0) goto done;
    if (times(b, t0, t1) < 0) goto done;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(attributes, &pos, &key, &value))
        if (key_value(b, key, value) < 0) goto done;
    if (error != Py_None) {
        PyObject *error_type = PyUnicode_InternFromString("error.type");
        if (error_type == NULL) goto done;
        int failed = key_value(b, error_type, error) < 0;
        Py_DECREF(error_type);
        if (failed) goto done;
    }
    if (events(b, t, evs) < 0) goto done;
    if (error == Py_None) {
        uint8_t unset[2] = {0x7a, 0x00};
        if (put(b, unset, 2) < 0) goto done;
    } else {  /* Status: its message, and code ERROR (2) */
        Py_ssize_t status = open_field(b, 0x7a);
        if (status < 0 || put_str_field(b, 0x12, error) < 0) goto done;
        uint8_t code[2] = {0x18, 0x02};
        if (put(b, code, 2) < 0) goto done;
        close_field(b, status);
    }
    if (flags_field(b, flags) < 0) goto done;
    close_field(b, field);
    rc = 0;
done:
    Py_XDECREF(name);
    Py_XDECREF(kind);
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(attributes);
    Py_XDECREF(error);
    Py_XDECREF(evs);
    return rc;
}

static PyObject *encode_tree(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_tree(root, trace_id, root_id, caller, offset)");
        return NULL;
    }
    PyObject *root = args[0], *trace = args[1], *root_id = args[2], *caller = args[3];
    if (!PyBytes_Check(trace) || PyBytes_GET_SIZE(trace) != 16 || !PyBytes_Check(root_id) ||
        PyBytes_GET_SIZE(root_id) != 8 ||
        (caller != Py_None && (!PyBytes_Check(caller) || PyBytes_GET_SIZE(caller) != 8))) {
        PyErr_SetString(PyExc_ValueError, "trace id: 16 bytes; span ids: 8 bytes (caller: or None)");
        return NULL;
    }
    Tree t = {(const uint8_t *)PyBytes_AS_STRING(trace), PyFloat_AsDouble(args[4])};
    if (t.offset == -1.0 && PyErr_Occurred()) return NULL;
    const uint8_t *id = (const uint8_t *)PyBytes_AS_STRING(root_id);
    Buf b = {NULL, 0, 0};
    int rc;
    if (caller == Py_None)
        rc = span(&b, &t, root, NULL, id, HAS_IS_REMOTE);
    else
        rc = span(&b, &t, root, (const uint8_t *)PyBytes_AS_STRING(caller), id,
                  HAS_IS_REMOTE | IS_REMOTE);
    if (rc == 0) rc = children(&b, &t, root, id);
    PyObject *out = rc == 0 ? PyBytes_FromStringAndSize(b.data, (Py_ssize_t)b.len) : NULL;
    PyMem_Free(b.data);
    return out;
}

static PyMethodDef methods[] = {
    {"encode_tree", (PyCFunction)(void (*)(void))encode_tree, METH_FASTCALL,
     "encode_tree(root, trace_id, root_id, caller, offset) -> bytes: a SpanRecord tree's "
     "Span fields, as otlp.encode_tree writes them"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sendpath_otlp", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sendpath_otlp(void) {
#define INTERN(var, text) \
    if (!(var = PyUnicode_InternFromString(text))) return NULL;
    INTERN(s_name, "name")
    INTERN(s_start, "start")
    INTERN(s_end, "end")
    INTERN(s_kind, "kind")
    INTERN(s_attributes, "attributes")
    INTERN(s_span_id, "span_id")
    INTERN(s_error, "error")
    INTERN(s_events, "events")
    INTERN(s_children, "children")
    INTERN(s_stages, "stages")
    INTERN(s_server, "server")
    INTERN(s_client, "client")
#undef INTERN
    if (pthread_atfork(NULL, NULL, forked) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
