/* A finished request's spans on the gateway, built and encoded from its context in one
 * call: what gateway/spans.py's gateway_span builds and telemetry/otlp.py's encode_tree
 * writes, the same bytes (the tests decode both and compare them span for span), with
 * no SpanRecord, dict or list made on the way. In a loaded gateway each Python step of
 * building the tree cost two to three times what it costs alone; this is what keeps
 * export within its share of a request's CPU (benchmarks/gateway_overhead.py).
 *
 * encode_gateway(ctx, operation, end, own, trace_id, root_id, caller, offset) -> bytes
 *   ctx        a GatewayContext (gateway/context.py): its fields are read by name
 *   operation  the GenAI operation ("chat"); end: when the response ended, if ctx.end
 *              is None
 *   own        {Stage: span name}: the gateway's own stages
 *   trace_id   16 bytes; root_id: the root's span id, 8 bytes; caller: the caller's
 *              span id (8 bytes), or None; offset: clock readings to Unix time
 *
 * Every rule here is gateway_span's (and genai.request_attributes'): a change there is
 * a change here, which tests/gateway/test_spans_native.py holds equal. */

#include "otlp_wire.h"

#include <math.h>
#include <string.h>

#define MAX_MODEL 256 /* genai.MAX_MODEL */
#define MAX_STOP 16   /* genai.MAX_STOP, MAX_STOP_CHARS */
#define MAX_STOP_CHARS 1024

static PyObject *s_end, *s_body, *s_status, *s_error_type, *s_key, *s_name, *s_client_id,
    *s_response_id, *s_finish_reasons, *s_usage, *s_cached_tokens, *s_first_token_at,
    *s_first_token_held, *s_attempts, *s_routing, *s_final, *s_stage_seconds, *s_start,
    *s_request_id, *s_replica, *s_url, *s_span_id, *s_error, *s_attempt, *s_model,
    *s_max_completion_tokens, *s_max_tokens, *s_n, *s_stop;

/* body fields that are numbers, and their attributes (genai._NUMBERS) */
static const char *const NUMBERS[][2] = {
    {"temperature", "gen_ai.request.temperature"},
    {"top_p", "gen_ai.request.top_p"},
    {"top_k", "gen_ai.request.top_k"},
    {"frequency_penalty", "gen_ai.request.frequency_penalty"},
    {"presence_penalty", "gen_ai.request.presence_penalty"},
    {"seed", "gen_ai.request.seed"},
};
/* routing fields kept (spans._ROUTING), and their attributes */
static const char *const ROUTING[][2] = {
    {"policy", "sendpath.routing.policy"},
    {"match", "sendpath.routing.match"},
    {"predicted_cached_tokens", "sendpath.routing.predicted_cached_tokens"},
    {"runs_on", "sendpath.routing.runs_on"},
};

static int is_int(PyObject *v) { return PyLong_Check(v) && !PyBool_Check(v); }

/* two floats, as float() reads them; -1 with the exception of the first that fails */
static int two_doubles(PyObject *a, PyObject *b, double *x, double *y) {
    *x = PyFloat_AsDouble(a);
    if (*x == -1.0 && PyErr_Occurred()) return -1;
    *y = PyFloat_AsDouble(b);
    return *y == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* ctx.<name>, a new reference (NULL: an exception) */
static PyObject *field(PyObject *obj, PyObject *name) { return PyObject_GetAttr(obj, name); }

/* an attribute from a field that is there when not None */
static int attr_if(Buf *b, const char *key, PyObject *obj, PyObject *name) {
    PyObject *v = field(obj, name);
    if (v == NULL) return -1;
    int rc = v == Py_None ? 0 : attr(b, key, v);
    Py_DECREF(v);
    return rc;
}

/* the stop sequences the API takes: a str, or 1-16 of them, each of 1,024 at most */
static int stops_attr(Buf *b, PyObject *stop) {
    if (PyUnicode_Check(stop)) {
        if (PyUnicode_GET_LENGTH(stop) > MAX_STOP_CHARS) return 0;
        PyObject *one = PyList_New(1);
        if (one == NULL) return -1;
        Py_INCREF(stop);
        PyList_SET_ITEM(one, 0, stop);
        int rc = attr(b, "gen_ai.request.stop_sequences", one);
        Py_DECREF(one);
        return rc;
    }
    if (!PyList_Check(stop)) return 0;
    Py_ssize_t n = PyList_GET_SIZE(stop);
    if (n == 0 || n > MAX_STOP) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(stop, i);
        if (!PyUnicode_Check(s) || PyUnicode_GET_LENGTH(s) > MAX_STOP_CHARS) return 0;
    }
    PyObject *copy = PyList_GetSlice(stop, 0, n); /* held while written */
    if (copy == NULL) return -1;
    int rc = attr(b, "gen_ai.request.stop_sequences", copy);
    Py_DECREF(copy);
    return rc;
}

/* genai.request_attributes' gen_ai.request.* for a body (a dict); the model given
 * (truncated) in *model, a new reference, or NULL */
static int request_attrs(Buf *b, PyObject *body, PyObject **model) {
    *model = NULL;
    if (!PyDict_Check(body)) {
        PyErr_SetString(PyExc_TypeError, "GatewayContext.body is a dict or None");
        return -1;
    }
    PyObject *v = PyDict_GetItemWithError(body, s_model); /* borrowed */
    if (v == NULL && PyErr_Occurred()) return -1;
    if (v != NULL && PyUnicode_Check(v)) {
        *model = PyUnicode_GET_LENGTH(v) > MAX_MODEL ? PyUnicode_Substring(v, 0, MAX_MODEL)
                                                     : (Py_INCREF(v), v);
        if (*model == NULL || attr(b, "gen_ai.request.model", *model) < 0) return -1;
    }
    v = PyDict_GetItemWithError(body, s_max_completion_tokens);
    if (v == NULL && !PyErr_Occurred()) v = PyDict_GetItemWithError(body, s_max_tokens);
    if (v == NULL && PyErr_Occurred()) return -1;
    if (v != NULL && is_int(v) && attr(b, "gen_ai.request.max_tokens", v) < 0) return -1;
    for (size_t i = 0; i < sizeof NUMBERS / sizeof NUMBERS[0]; i++) {
        v = PyDict_GetItemString(body, NUMBERS[i][0]);
        if (v != NULL && (is_int(v) || PyFloat_Check(v)) && attr(b, NUMBERS[i][1], v) < 0)
            return -1;
    }
    v = PyDict_GetItemWithError(body, s_n);
    if (v == NULL && PyErr_Occurred()) return -1;
    if (v != NULL && is_int(v)) {
        int overflow;
        long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (n == -1 && PyErr_Occurred()) return -1;
        if ((overflow || n != 1) && attr(b, "gen_ai.request.choice.count", v) < 0) return -1;
    }
    v = PyDict_GetItemWithError(body, s_stop);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(v); /* held: making a list can collect garbage, which runs Python code */
    int rc = stops_attr(b, v);
    Py_DECREF(v);
    return rc;
}

/* spans._answer_attributes */
static int answer_attrs(Buf *b, PyObject *ctx, PyObject *start, PyObject *attempts) {
    PyObject *v = field(ctx, s_request_id);
    if (v == NULL) return -1;
    int rc = attr(b, "sendpath.request_id", v);
    Py_DECREF(v);
    if (rc < 0 || attr_if(b, "http.response.status_code", ctx, s_status) < 0) return -1;
    PyObject *key = field(ctx, s_key);
    if (key == NULL) return -1;
    rc = key == Py_None ? 0 : attr_if(b, "sendpath.key.name", key, s_name);
    Py_DECREF(key);
    if (rc < 0 || attr_if(b, "sendpath.client_id", ctx, s_client_id) < 0 ||
        attr_if(b, "gen_ai.response.id", ctx, s_response_id) < 0)
        return -1;
    if ((v = field(ctx, s_finish_reasons)) == NULL) return -1;
    rc = 0;
    int truthy = PyObject_IsTrue(v);
    if (truthy < 0) rc = -1;
    else if (truthy) {
        PyObject *copy = PySequence_List(v);
        rc = copy == NULL ? -1 : attr(b, "gen_ai.response.finish_reasons", copy);
        Py_XDECREF(copy);
    }
    Py_DECREF(v);
    if (rc < 0 || (v = field(ctx, s_usage)) == NULL) return -1;
    if (v != Py_None) {
        if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 2) {
            PyErr_SetString(PyExc_TypeError, "GatewayContext.usage is (prompt, completion)");
            rc = -1;
        } else if (attr(b, "gen_ai.usage.input_tokens", PyTuple_GET_ITEM(v, 0)) < 0 ||
                   attr(b, "gen_ai.usage.output_tokens", PyTuple_GET_ITEM(v, 1)) < 0)
            rc = -1;
    }
    Py_DECREF(v);
    if (rc < 0 || attr_if(b, "gen_ai.usage.cache_read.input_tokens", ctx, s_cached_tokens) < 0)
        return -1;
    if ((v = field(ctx, s_first_token_at)) == NULL) return -1;
    if (v != Py_None) { /* to the microsecond, half to even: as Python's round() */
        double first, begin;
        PyObject *rounded = two_doubles(v, start, &first, &begin) < 0
                                ? NULL
                                : PyFloat_FromDouble(rint((first - begin) * 1e6) / 1e6);
        rc = rounded == NULL ? -1 : attr(b, "gen_ai.response.time_to_first_chunk", rounded);
        Py_XDECREF(rounded);
    }
    Py_DECREF(v);
    if (rc < 0 || attr_if(b, "sendpath.first_token_held", ctx, s_first_token_held) < 0) return -1;
    Py_ssize_t tries = PyList_GET_SIZE(attempts);
    if (tries > 0) { /* ctx.replica_name: the last attempt's */
        PyObject *last = PyList_GET_ITEM(attempts, tries - 1);
        Py_INCREF(last);
        rc = attr_if(b, "sendpath.replica", last, s_replica);
        Py_DECREF(last);
        if (rc < 0) return -1;
    }
    PyObject *routing = field(ctx, s_routing);
    if (routing == NULL) return -1;
    if (routing != Py_None && PyDict_Check(routing)) {
        for (size_t i = 0; i < sizeof ROUTING / sizeof ROUTING[0] && rc == 0; i++) {
            v = PyDict_GetItemString(routing, ROUTING[i][0]);
            if (v != NULL && (PyUnicode_Check(v) || is_int(v))) rc = attr(b, ROUTING[i][1], v);
        }
    } else if (routing != Py_None) {
        int truthy = PyObject_IsTrue(routing); /* ``ctx.routing or {}`` */
        if (truthy != 0) {
            if (truthy > 0)
                PyErr_SetString(PyExc_TypeError, "GatewayContext.routing is a dict or None");
            rc = -1;
        }
    }
    Py_DECREF(routing);
    return rc;
}

/* spans.span_error: the error.type, a new reference (None: it succeeded) */
static PyObject *span_error(PyObject *ctx) {
    PyObject *error = field(ctx, s_error_type);
    if (error == NULL || error != Py_None) return error;
    Py_DECREF(error);
    PyObject *status = field(ctx, s_status);
    if (status == NULL) return NULL;
    if (status == Py_None) {
        Py_DECREF(status);
        return PyUnicode_FromString("internal_error"); /* the app raised before it answered */
    }
    long code = PyLong_AsLong(status);
    PyObject *out = code == -1 && PyErr_Occurred() ? NULL
                    : code >= 400                  ? PyObject_Str(status)
                                                   : (Py_INCREF(Py_None), Py_None);
    Py_DECREF(status);
    return out;
}

/* the root span: its attributes, name and error (the span is opened once its name is
 * known, so the attributes are written to a buffer of their own first) */
static int root_span(Buf *b, const Tree *t, PyObject *ctx, PyObject *operation, PyObject *start,
                     double end, PyObject *attempts, const uint8_t *caller, const uint8_t *id) {
    Buf attrs = {NULL, 0, 0};
    PyObject *model = NULL, *body = NULL, *error = NULL;
    int rc = -1;
    if (attr(&attrs, "gen_ai.operation.name", operation) < 0 ||
        attr_text(&attrs, "gen_ai.provider.name", "sendpath") < 0 || !(body = field(ctx, s_body)))
        goto done;
    if (body != Py_None && request_attrs(&attrs, body, &model) < 0) goto done;
    if (answer_attrs(&attrs, ctx, start, attempts) < 0 || !(error = span_error(ctx))) goto done;
    /* genai.span_name: "{operation} {model}", or the operation alone */
    PyObject *more = model != NULL && PyUnicode_GET_LENGTH(model) > 0 ? model : NULL;
    uint64_t t0, t1;
    if (unix_nanos_of(start, t->offset, &t0) < 0 || unix_nanos(end, t->offset, &t1) < 0)
        goto done;
    uint32_t flags = caller != NULL ? HAS_IS_REMOTE | IS_REMOTE : HAS_IS_REMOTE;
    Py_ssize_t span = span_open(b, t, caller, id, operation, more, KIND_SERVER, t0, t1);
    if (span < 0 || put(b, attrs.data, attrs.len) < 0 || error_attribute(b, error) < 0) goto done;
    rc = span_close(b, span, error, flags);
done:
    PyMem_Free(attrs.data);
    Py_XDECREF(model);
    Py_XDECREF(body);
    Py_XDECREF(error);
    return rc;
}

/* spans._attempt_span: one client span per try, under the root */
static int attempt_span(Buf *b, const Tree *t, PyObject *attempt, double end,
                        const uint8_t *root) {
    PyObject *replica = NULL, *url = NULL, *start = NULL, *stop = NULL, *status = NULL,
             *error = NULL, *known = NULL;
    int rc = -1;
    if (!(replica = field(attempt, s_replica)) || !(url = field(attempt, s_url)) ||
        !(start = field(attempt, s_start)) || !(stop = field(attempt, s_end)) ||
        !(status = field(attempt, s_status)) || !(error = field(attempt, s_error)) ||
        !(known = field(attempt, s_span_id)))
        goto done;
    if (!PyUnicode_Check(replica)) {
        PyErr_SetString(PyExc_TypeError, "AttemptRecord.replica is a str");
        goto done;
    }
    if (error == Py_None && status != Py_None) {
        long code = PyLong_AsLong(status);
        if (code == -1 && PyErr_Occurred()) goto done;
        if (code >= 400) {
            Py_DECREF(error);
            if (!(error = PyObject_Str(status))) goto done;
        }
    }
    uint64_t value = PyLong_AsUnsignedLongLongMask(known), t0, t1;
    if (value == (uint64_t)-1 && PyErr_Occurred()) goto done;
    uint8_t id[8];
    id_bytes(id, value ? value : next_id());
    if (unix_nanos_of(start, t->offset, &t0) < 0) goto done;
    if (stop == Py_None ? unix_nanos(end, t->offset, &t1) : unix_nanos_of(stop, t->offset, &t1))
        goto done;
    Py_ssize_t span = span_open(b, t, root, id, s_attempt, replica, KIND_CLIENT, t0, t1);
    if (span < 0 || attr(b, "sendpath.replica", replica) < 0 || attr(b, "url.full", url) < 0)
        goto done;
    if (status != Py_None && attr(b, "http.response.status_code", status) < 0) goto done;
    if (error_attribute(b, error) < 0) goto done;
    rc = span_close(b, span, error, HAS_IS_REMOTE);
done:
    Py_XDECREF(replica);
    Py_XDECREF(url);
    Py_XDECREF(start);
    Py_XDECREF(stop);
    Py_XDECREF(status);
    Py_XDECREF(error);
    Py_XDECREF(known);
    return rc;
}

/* the gateway's own stages, as bare spans under the root */
static int stage_spans(Buf *b, const Tree *t, PyObject *ctx, PyObject *own, double begin,
                       const uint8_t *root) {
    PyObject *final = field(ctx, s_final), *stages;
    if (final == NULL) return -1;
    if (final != Py_None) {
        if (!PyTuple_Check(final) || PyTuple_GET_SIZE(final) != 2) {
            Py_DECREF(final);
            PyErr_SetString(PyExc_TypeError, "GatewayContext.final is (stages, timings)");
            return -1;
        }
        stages = PyTuple_GET_ITEM(final, 0);
        Py_INCREF(stages);
    } else
        stages = PyObject_CallMethodNoArgs(ctx, s_stage_seconds);
    Py_DECREF(final);
    if (stages == NULL) return -1;
    int rc = 0;
    if (!PyList_Check(stages)) {
        PyErr_SetString(PyExc_TypeError, "a request's stages are a list");
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(stages); i++) {
        PyObject *stage = PyList_GET_ITEM(stages, i);
        if (!PyTuple_Check(stage) || PyTuple_GET_SIZE(stage) != 3) {
            PyErr_SetString(PyExc_TypeError, "a stage is (stage, start, duration)");
            rc = -1;
            break;
        }
        Py_INCREF(stage);
        PyObject *name = PyDict_GetItemWithError(own, PyTuple_GET_ITEM(stage, 0));
        if (name != NULL) { /* (name, begin + start, begin + start + duration) */
            Py_INCREF(name); /* reading the times can run Python code */
            double from, took;
            uint64_t t0, t1;
            if (two_doubles(PyTuple_GET_ITEM(stage, 1), PyTuple_GET_ITEM(stage, 2), &from, &took) <
                    0 ||
                unix_nanos(begin + from, t->offset, &t0) < 0 ||
                unix_nanos(begin + from + took, t->offset, &t1) < 0 ||
                bare_span(b, t, root, name, t0, t1) < 0)
                rc = -1;
            Py_DECREF(name);
        } else if (PyErr_Occurred())
            rc = -1;
        Py_DECREF(stage);
    }
    Py_DECREF(stages);
    return rc;
}

static PyObject *encode_gateway(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "encode_gateway(ctx, operation, end, own, trace_id, "
                                         "root_id, caller, offset)");
        return NULL;
    }
    PyObject *ctx = args[0], *operation = args[1], *own = args[3];
    if (!PyUnicode_Check(operation) || !PyDict_Check(own)) {
        PyErr_SetString(PyExc_TypeError, "the operation is a str, own a dict");
        return NULL;
    }
    Place at;
    if (place_of(args + 4, &at) < 0) return NULL;
    const Tree t = at.tree;
    const uint8_t *id = at.id, *parent = at.parent;
    PyObject *start = NULL, *ended = NULL, *attempts = NULL;
    Buf b = {NULL, 0, 0};
    int rc = -1;
    if (!(start = field(ctx, s_start)) || !(ended = field(ctx, s_end)) ||
        !(attempts = field(ctx, s_attempts)))
        goto done;
    if (!PyList_Check(attempts)) {
        PyErr_SetString(PyExc_TypeError, "GatewayContext.attempts is a list");
        goto done;
    }
    double end, begin;
    if (two_doubles(ended != Py_None ? ended : args[2], start, &end, &begin) < 0) goto done;
    if (root_span(&b, &t, ctx, operation, start, end, attempts, parent, id) < 0) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(attempts); i++) {
        PyObject *attempt = PyList_GET_ITEM(attempts, i);
        Py_INCREF(attempt); /* reading it can run Python code */
        int failed = attempt_span(&b, &t, attempt, end, id) < 0;
        Py_DECREF(attempt);
        if (failed) goto done;
    }
    rc = stage_spans(&b, &t, ctx, own, begin, id);
done:
    Py_XDECREF(start);
    Py_XDECREF(ended);
    Py_XDECREF(attempts);
    if (rc == 0) return bytes_of(&b);
    PyMem_Free(b.data);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_gateway", (PyCFunction)(void (*)(void))encode_gateway, METH_FASTCALL,
     "encode_gateway(ctx, operation, end, own, trace_id, root_id, caller, offset) -> bytes: "
     "a finished request's gateway spans, as gateway_span and otlp.encode_tree make them"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sendpath_gateway_spans", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sendpath_gateway_spans(void) {
    INTERN(s_end, "end")
    INTERN(s_body, "body")
    INTERN(s_status, "status")
    INTERN(s_error_type, "error_type")
    INTERN(s_key, "key")
    INTERN(s_name, "name")
    INTERN(s_client_id, "client_id")
    INTERN(s_response_id, "response_id")
    INTERN(s_finish_reasons, "finish_reasons")
    INTERN(s_usage, "usage")
    INTERN(s_cached_tokens, "cached_tokens")
    INTERN(s_first_token_at, "first_token_at")
    INTERN(s_first_token_held, "first_token_held")
    INTERN(s_attempts, "attempts")
    INTERN(s_routing, "routing")
    INTERN(s_final, "final")
    INTERN(s_stage_seconds, "stage_seconds")
    INTERN(s_start, "start")
    INTERN(s_request_id, "request_id")
    INTERN(s_replica, "replica")
    INTERN(s_url, "url")
    INTERN(s_span_id, "span_id")
    INTERN(s_error, "error")
    INTERN(s_attempt, "attempt")
    INTERN(s_model, "model")
    INTERN(s_max_completion_tokens, "max_completion_tokens")
    INTERN(s_max_tokens, "max_tokens")
    INTERN(s_n, "n")
    INTERN(s_stop, "stop")
    if (wire_init() < 0) return NULL;
    return PyModule_Create(&module);
}
