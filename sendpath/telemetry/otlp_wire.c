/* OTLP's protobuf wire format: the pieces otlp_native.c (SpanRecord trees) and
 * gateway/spans_native.c (the gateway's spans, from its context) both write with
 * (otlp_wire.h says how a Span is put together). The bytes are otlp.py's, field for
 * field; the tests compare them.
 *
 * Spans without an id of their own get one from a xorshift generator seeded from the
 * OS, seeded again in a forked child. Text that is not valid UTF-8 (a lone surrogate a
 * client's JSON can carry) is written with "?" in its place, as otlp.py does: a client
 * cannot drop its own trace. */

#include "otlp_wire.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

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

int put(Buf *b, const void *src, size_t n) {
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

int put_varint(Buf *b, uint64_t n) {
    uint8_t tmp[10];
    return put(b, tmp, varint_to(tmp, n));
}

int put_fixed64(Buf *b, uint8_t tag, uint64_t v) {
    uint8_t tmp[9];
    tmp[0] = tag;
    for (int i = 0; i < 8; i++) tmp[1 + i] = (uint8_t)(v >> (8 * i));
    return put(b, tmp, 9);
}

/* A length-delimited field whose length is known once its body is written: the tag,
 * room for the longest varint, the body; ``close`` moves the body back over the room
 * its length did not need. */
#define ROOM 5

Py_ssize_t open_field(Buf *b, uint8_t tag) {
    if (grow(b, 1 + ROOM) < 0) return -1;
    b->data[b->len++] = (char)tag;
    b->len += ROOM;
    return (Py_ssize_t)b->len;
}

void close_field(Buf *b, Py_ssize_t body) {
    size_t n = b->len - (size_t)body;  /* ROOM's 5 bytes hold lengths below 32 GiB */
    uint8_t tmp[10];
    size_t k = varint_to(tmp, n);
    char *room = b->data + body - ROOM;
    memcpy(room, tmp, k);
    if (k < ROOM) memmove(room + k, b->data + body, n);
    b->len -= ROOM - k;
}

int put_bytes_field(Buf *b, uint8_t tag, const char *s, Py_ssize_t n) {
    if (put(b, &tag, 1) < 0 || put_varint(b, (uint64_t)n) < 0) return -1;
    return put(b, s, (size_t)n);
}

/* str's UTF-8, a lone surrogate as "?" (otlp.py's _utf8); *held: a bytes object to
 * release after, or NULL */
static const char *utf8(PyObject *str, Py_ssize_t *n, PyObject **held) {
    *held = NULL;
    if (!PyUnicode_Check(str)) {
        PyErr_Format(PyExc_TypeError, "a span's text cannot be %.100s", Py_TYPE(str)->tp_name);
        return NULL;
    }
    const char *s = PyUnicode_AsUTF8AndSize(str, n);
    if (s != NULL || !PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return s;
    PyErr_Clear();
    *held = PyUnicode_AsEncodedString(str, "utf-8", "replace");
    if (*held == NULL) return NULL;
    *n = PyBytes_GET_SIZE(*held);
    return PyBytes_AS_STRING(*held);
}

int put_str_field(Buf *b, uint8_t tag, PyObject *str) {
    Py_ssize_t n;
    PyObject *held;
    const char *s = utf8(str, &n, &held);
    int rc = s == NULL ? -1 : put_bytes_field(b, tag, s, n);
    Py_XDECREF(held);
    return rc;
}

/* Span.name: ``first``, or "first second" (second not NULL), as one field */
static int name_field(Buf *b, PyObject *first, PyObject *second) {
    if (second == NULL) return put_str_field(b, 0x2a, first);
    Py_ssize_t n1, n2;
    PyObject *held1, *held2 = NULL;
    const char *s1 = utf8(first, &n1, &held1), *s2 = s1 ? utf8(second, &n2, &held2) : NULL;
    uint8_t tag = 0x2a;
    int rc = s2 == NULL || put(b, &tag, 1) < 0 || put_varint(b, (uint64_t)(n1 + 1 + n2)) < 0 ||
             put(b, s1, (size_t)n1) < 0 || put(b, " ", 1) < 0 || put(b, s2, (size_t)n2) < 0;
    Py_XDECREF(held1);
    Py_XDECREF(held2);
    return rc ? -1 : 0;
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

uint64_t next_id(void) {
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

void id_bytes(uint8_t *out, uint64_t id) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(id >> (56 - 8 * i));
}

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

int any_value(Buf *b, PyObject *value) {
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

int key_value(Buf *b, PyObject *key, PyObject *value) {
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

static int times(Buf *b, uint64_t start, uint64_t end) {
    if (put_fixed64(b, 0x39, start) < 0) return -1;
    return put_fixed64(b, 0x41, end > start ? end : start);
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

int wire_init(void) {
    if (pthread_atfork(NULL, NULL, forked) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return -1;
    }
    return 0;
}

int place_of(PyObject *const *args, Place *out) {
    PyObject *trace = args[0], *root_id = args[1], *caller = args[2];
    if (!PyBytes_Check(trace) || PyBytes_GET_SIZE(trace) != 16 || !PyBytes_Check(root_id) ||
        PyBytes_GET_SIZE(root_id) != 8 ||
        (caller != Py_None && (!PyBytes_Check(caller) || PyBytes_GET_SIZE(caller) != 8))) {
        PyErr_SetString(PyExc_ValueError, "trace id: 16 bytes; span ids: 8 bytes (caller: or None)");
        return -1;
    }
    out->tree.trace = (const uint8_t *)PyBytes_AS_STRING(trace);
    out->tree.offset = PyFloat_AsDouble(args[3]);
    if (out->tree.offset == -1.0 && PyErr_Occurred()) return -1;
    out->id = (const uint8_t *)PyBytes_AS_STRING(root_id);
    out->parent = caller == Py_None ? NULL : (const uint8_t *)PyBytes_AS_STRING(caller);
    return 0;
}

PyObject *bytes_of(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize(b->data, (Py_ssize_t)b->len);
    PyMem_Free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    return out;
}

int attr(Buf *b, const char *key, PyObject *value) {
    Py_ssize_t field = open_field(b, 0x4a); /* Span.attributes */
    if (field < 0 || put_bytes_field(b, 0x0a, key, (Py_ssize_t)strlen(key)) < 0) return -1;
    Py_ssize_t v = open_field(b, 0x12);
    if (v < 0 || any_value(b, value) < 0) return -1;
    close_field(b, v);
    close_field(b, field);
    return 0;
}

int attr_text(Buf *b, const char *key, const char *value) {
    Py_ssize_t field = open_field(b, 0x4a);
    if (field < 0 || put_bytes_field(b, 0x0a, key, (Py_ssize_t)strlen(key)) < 0) return -1;
    Py_ssize_t v = open_field(b, 0x12);
    if (v < 0 || put_bytes_field(b, 0x0a, value, (Py_ssize_t)strlen(value)) < 0) return -1;
    close_field(b, v);
    close_field(b, field);
    return 0;
}

int unix_nanos(double t, double offset, uint64_t *out) {
    double ns = (t + offset) * 1e9;
    if (!(ns >= 0.0 && ns < 18446744073709551616.0)) { /* NaN fails too */
        PyErr_SetString(PyExc_OverflowError, "a span's time is not a Unix time in nanoseconds");
        return -1;
    }
    *out = (uint64_t)ns; /* int(): toward zero, as Python's */
    return 0;
}

int unix_nanos_of(PyObject *seconds, double offset, uint64_t *out) {
    double t = PyFloat_AsDouble(seconds);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    return unix_nanos(t, offset, out);
}

Py_ssize_t span_open(Buf *b, const Tree *t, const uint8_t *parent, const uint8_t *id,
                     PyObject *name, PyObject *more, int kind, uint64_t start, uint64_t end) {
    uint8_t k[2] = {0x30, (uint8_t)kind};
    Py_ssize_t field = open_field(b, 0x12); /* ScopeSpans.spans */
    if (field < 0 || span_lead(b, t, parent, id) < 0 || name_field(b, name, more) < 0 ||
        put(b, k, 2) < 0 || times(b, start, end) < 0)
        return -1;
    return field;
}

int error_attribute(Buf *b, PyObject *error) {
    if (error == Py_None) return 0;
    if (!PyUnicode_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "a span's error is a str or None");
        return -1;
    }
    return attr(b, "error.type", error);
}

int span_close(Buf *b, Py_ssize_t field, PyObject *error, uint32_t flags) {
    if (error == Py_None) {
        uint8_t unset[2] = {0x7a, 0x00}; /* Status: unset */
        if (put(b, unset, 2) < 0) return -1;
    } else { /* Status: its message, and code ERROR (2) */
        Py_ssize_t status = open_field(b, 0x7a);
        if (status < 0 || put_str_field(b, 0x12, error) < 0) return -1;
        uint8_t code[2] = {0x18, 0x02};
        if (put(b, code, 2) < 0) return -1;
        close_field(b, status);
    }
    if (flags_field(b, flags) < 0) return -1;
    close_field(b, field);
    return 0;
}

int bare_span(Buf *b, const Tree *t, const uint8_t *parent, PyObject *name, uint64_t start,
              uint64_t end) {
    uint8_t id[8];
    id_bytes(id, next_id());
    Py_ssize_t field = span_open(b, t, parent, id, name, NULL, KIND_INTERNAL, start, end);
    return field < 0 ? -1 : span_close(b, field, Py_None, HAS_IS_REMOTE);
}
