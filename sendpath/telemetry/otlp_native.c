/* OTLP's protobuf wire format for a SpanRecord tree, in C: the same bytes as
 * otlp.py's encode_tree (field for field, in the same order; the tests compare them),
 * written without running Python per span, per attribute or per byte string. Built
 * with otlp_wire.c (sendpath/native.py), which writes the fields.
 *
 * encode_tree(root, trace_id, root_id, caller, offset) -> bytes
 *   root      a SpanRecord (telemetry/spans.py): its fields are read by name
 *   trace_id  16 bytes; root_id: the root's span id, 8 bytes
 *   caller    the root's parent span id (8 bytes; the parent is remote), or None
 *   offset    seconds that turn the records' clock readings into Unix time
 *
 * Spans without an id of their own (bare stages, children whose span_id is None) get
 * a random one (otlp_wire.c). Items of the record's lists are held while they are
 * read, and nesting is bounded by Python's recursion limit: whatever the records hold,
 * a bad one is an exception. */

#include "otlp_wire.h"

#include <string.h>

/* the SpanRecord fields read, interned once */
static PyObject *s_name, *s_start, *s_end, *s_kind, *s_attributes, *s_span_id, *s_error,
    *s_events, *s_children, *s_stages, *s_server, *s_client;

static int kind_of(PyObject *kind) {
    if (PyUnicode_Check(kind)) {
        if (PyUnicode_Compare(kind, s_server) == 0) return KIND_SERVER;
        if (PyUnicode_Compare(kind, s_client) == 0) return KIND_CLIENT;
    }
    return KIND_INTERNAL; /* and anything unknown */
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
        uint64_t t0, t1;
        int rc = unix_nanos_of(PyTuple_GET_ITEM(stage, 1), t->offset, &t0) < 0 ||
                 unix_nanos_of(PyTuple_GET_ITEM(stage, 2), t->offset, &t1) < 0 ||
                 bare_span(b, t, parent, PyTuple_GET_ITEM(stage, 0), t0, t1) < 0;
        Py_DECREF(stage);
        if (rc) return -1;
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
        int rc = unix_nanos_of(PyTuple_GET_ITEM(event, 1), t->offset, &at) < 0 ||
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
    if (unix_nanos_of(start, t->offset, &t0) < 0 || unix_nanos_of(end, t->offset, &t1) < 0) goto done;
    Py_ssize_t field = span_open(b, t, parent, id, name, NULL, kind_of(kind), t0, t1);
    if (field < 0) goto done;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(attributes, &pos, &key, &value))
        if (key_value(b, key, value) < 0) goto done;
    if (error_attribute(b, error) < 0 || events(b, t, evs) < 0) goto done;
    if (span_close(b, field, error, flags) < 0) goto done;
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
    Place at;
    if (place_of(args + 1, &at) < 0) return NULL;
    Buf b = {NULL, 0, 0};
    uint32_t flags = at.parent != NULL ? HAS_IS_REMOTE | IS_REMOTE : HAS_IS_REMOTE;
    int rc = span(&b, &at.tree, args[0], at.parent, at.id, flags);
    if (rc == 0) rc = children(&b, &at.tree, args[0], at.id);
    if (rc == 0) return bytes_of(&b);
    PyMem_Free(b.data);
    return NULL;
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
    if (wire_init() < 0) return NULL;
    return PyModule_Create(&module);
}
