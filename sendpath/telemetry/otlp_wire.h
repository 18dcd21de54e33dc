/* OTLP's protobuf wire format, the pieces every C span writer here shares (otlp_wire.c):
 * a growing buffer, varints and fields, attribute values, span ids, and the fields a
 * Span starts and ends with. Each writer returns 0, or -1 with a Python exception set.
 *
 * A Span field is written as
 *     field = span_open(b, t, parent, id, name, more, kind, start_ns, end_ns);
 *     ...its attributes (key_value, attr), then error_attribute(b, error);
 *     ...its events, if any;
 *     span_close(b, field, error, flags);
 * which is the order of otlp.py's _span, field for field. */

#ifndef SENDPATH_OTLP_WIRE_H
#define SENDPATH_OTLP_WIRE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

typedef struct {
    const uint8_t *trace; /* 16 bytes */
    double offset;        /* seconds that turn clock readings into Unix time */
} Tree;

/* Span.kind values, and the Span.flags bits the SDK writes (is the parent remote?) */
enum { KIND_INTERNAL = 1, KIND_SERVER = 2, KIND_CLIENT = 3 };
#define HAS_IS_REMOTE 0x100u
#define IS_REMOTE 0x200u

int wire_init(void); /* once per module: reseed span ids in forked children */

/* a module's interned names: ``INTERN(s_name, "name")`` in its init */
#define INTERN(var, text) \
    if (!(var = PyUnicode_InternFromString(text))) return NULL;

/* Where a tree's spans go, from its (trace_id, root_id, caller, offset) arguments: 16
 * and 8 bytes, the caller's 8 or None, seconds; the root's id and parent (NULL: none) */
typedef struct {
    Tree tree;
    const uint8_t *id, *parent;
} Place;
int place_of(PyObject *const *args, Place *out);

int put(Buf *b, const void *src, size_t n);
int put_varint(Buf *b, uint64_t n);
int put_fixed64(Buf *b, uint8_t tag, uint64_t v);
Py_ssize_t open_field(Buf *b, uint8_t tag); /* a length-delimited field, body to come */
void close_field(Buf *b, Py_ssize_t body);
int put_bytes_field(Buf *b, uint8_t tag, const char *s, Py_ssize_t n);
int put_str_field(Buf *b, uint8_t tag, PyObject *str); /* a str, lone surrogates as "?" */
PyObject *bytes_of(Buf *b);                           /* the buffer as bytes; frees it */

uint64_t next_id(void); /* a random span id, never 0 */
void id_bytes(uint8_t *out, uint64_t id);

int any_value(Buf *b, PyObject *value);                    /* str, bool, int, float, list */
int key_value(Buf *b, PyObject *key, PyObject *value);     /* one Span.attributes field */
int attr(Buf *b, const char *key, PyObject *value);        /* the same, a C string key */
int attr_text(Buf *b, const char *key, const char *value); /* a C string value */
int unix_nanos(double seconds, double offset, uint64_t *out);
int unix_nanos_of(PyObject *seconds, double offset, uint64_t *out);

/* a Span field, up to its times; its name is ``name``, or "name more" (more not NULL) */
Py_ssize_t span_open(Buf *b, const Tree *t, const uint8_t *parent, const uint8_t *id,
                     PyObject *name, PyObject *more, int kind, uint64_t start, uint64_t end);
int error_attribute(Buf *b, PyObject *error); /* error.type, unless error is None */
int span_close(Buf *b, Py_ssize_t field, PyObject *error, uint32_t flags);
int bare_span(Buf *b, const Tree *t, const uint8_t *parent, PyObject *name, uint64_t start,
              uint64_t end); /* an internal span without attributes: a stage */

#endif
