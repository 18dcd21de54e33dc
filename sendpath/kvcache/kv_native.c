/* The prefix cache's two hot loops in C: chained block hashes (``hashing.block_hashes``)
 * and the block pool (``block_pool.BlockPool``), the same behaviour as the Python
 * versions beside them, which stay the reference (tests compare the two on random
 * operations). A block is an int id; the pool keeps a ref count, LRU links and, once
 * indexed, a hash and the block's packed token ids per id, in arrays made zeroed (pages
 * of blocks never handed out cost no memory). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "blake2b.h"

/* ------------------------------------------------------------------ block hashes */

/* item ``i`` of a PySequence_Fast result, a new reference, read afresh: an item's
 * __index__ may have changed the list (NULL and RuntimeError if it is shorter now) */
static PyObject *item_at(PyObject *seq, Py_ssize_t i) {
    if (i >= PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_RuntimeError, "the sequence changed while it was read");
        return NULL;
    }
    PyObject *item = PySequence_Fast_ITEMS(seq)[i];
    Py_INCREF(item);
    return item;
}

/* an int (or anything with __index__, as array("q") takes it) as int64; -1 with an
 * error set where it is not one or does not fit */
static int as_int64(PyObject *item, int64_t *out) {
    long long value;
    if (PyLong_Check(item)) {
        value = PyLong_AsLongLong(item);
    } else {
        PyObject *index = PyNumber_Index(item);
        if (index == NULL)
            return -1;
        value = PyLong_AsLongLong(index);
        Py_DECREF(index);
    }
    if (value == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)value;
    return 0;
}

static PyObject *block_hashes(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"token_ids", "block_size", "salt", "start", "parent", "packed", NULL};
    PyObject *tokens, *salt = Py_None, *parent = Py_None, *packed = Py_None;
    Py_ssize_t bs, start = 0;
    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|OnOO:block_hashes", names, &tokens, &bs,
                                     &salt, &start, &parent, &packed))
        return NULL;
    if (bs < 1)
        return PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", bs);
    if (start < 0)
        return PyErr_Format(PyExc_ValueError, "start must be >= 0, got %zd", start);
    PyObject *seq = PySequence_Fast(tokens, "token_ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t end = PySequence_Fast_GET_SIZE(seq) / bs;
    if (end <= start) { /* no full block from ``start`` on: nothing else is looked at */
        Py_DECREF(seq);
        return PyList_New(0);
    }
    PyObject *out = NULL, *chunks = NULL;
    uint8_t *buf = NULL;
    int64_t *ids = NULL;
    if (packed != Py_None && !PyList_Check(packed)) {
        PyErr_SetString(PyExc_TypeError, "packed must be a list or None");
        goto fail;
    }
    const char *tail = "";
    Py_ssize_t tail_len = 0;
    if (salt != Py_None) { /* salt.encode() if salt else b"" */
        if (!PyUnicode_Check(salt)) {
            PyErr_SetString(PyExc_TypeError, "salt must be str or None");
            goto fail;
        }
        tail = PyUnicode_AsUTF8AndSize(salt, &tail_len);
        if (tail == NULL)
            goto fail;
    }
    static const char zeros[16] = {0};
    const char *link = zeros; /* parent or b"\0" * 16 */
    Py_ssize_t link_len = 16;
    if (parent != Py_None) {
        if (!PyBytes_Check(parent)) {
            PyErr_SetString(PyExc_TypeError, "parent must be bytes or None");
            goto fail;
        }
        if (PyBytes_GET_SIZE(parent) > 0) {
            link = PyBytes_AS_STRING(parent);
            link_len = PyBytes_GET_SIZE(parent);
        }
    }
    /* every token packed before anything is made or appended: ``packed`` may be the
     * token list itself, and an error leaves it as it was */
    Py_ssize_t count = (end - start) * bs, width = 8 * bs;
    ids = PyMem_Malloc((size_t)count * sizeof(int64_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = item_at(seq, start * bs + i);
        int bad = item == NULL || as_int64(item, ids + i) < 0;
        Py_XDECREF(item);
        if (bad)
            goto fail;
    }
    Py_ssize_t head = link_len > 16 ? link_len : 16;
    buf = PyMem_Malloc((size_t)(head + width + tail_len));
    out = PyList_New(end - start);
    chunks = packed != Py_None ? PyList_New(end - start) : NULL;
    if (buf == NULL || out == NULL || (packed != Py_None && chunks == NULL)) {
        if (buf == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    uint8_t chained[16]; /* every block's link but the first: its parent's digest */
    for (Py_ssize_t block = 0; block < end - start; block++) {
        const char *block_ids = (const char *)(ids + block * bs);
        memcpy(buf, link, (size_t)link_len);
        memcpy(buf + link_len, block_ids, (size_t)width);
        memcpy(buf + link_len + width, tail, (size_t)tail_len);
        blake2b_128(buf, (size_t)(link_len + width + tail_len), chained);
        PyObject *hash = PyBytes_FromStringAndSize((const char *)chained, 16);
        if (hash == NULL)
            goto fail;
        PyList_SET_ITEM(out, block, hash);
        if (chunks != NULL) {
            PyObject *chunk = PyBytes_FromStringAndSize(block_ids, width);
            if (chunk == NULL)
                goto fail;
            PyList_SET_ITEM(chunks, block, chunk);
        }
        link = (const char *)chained;
        link_len = 16;
    }
    if (chunks != NULL) {
        Py_ssize_t size = PyList_GET_SIZE(packed);
        if (PyList_SetSlice(packed, size, size, chunks) < 0)
            goto fail;
        Py_DECREF(chunks);
    }
    PyMem_Free(buf);
    PyMem_Free(ids);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(buf);
    PyMem_Free(ids);
    Py_XDECREF(out);
    Py_XDECREF(chunks);
    Py_DECREF(seq);
    return NULL;
}

/* ------------------------------------------------------------------ the block pool */

/* a slot of the prefix index: a block (plus one; 0: empty) and 32 bits of its hash's
 * hash (both halves mixed), so a probe reads the block's bytes only when those match. The index
 * holds no Python objects: no int per entry, and half the cache lines of a dict. */
typedef struct {
    uint32_t tag;
    int32_t block1;
} Slot;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;       /* blocks */
    Py_ssize_t fresh;   /* ids from here on were never handed out */
    Py_ssize_t lru_len; /* freed blocks waiting in the LRU */
    int32_t head, tail; /* the LRU's oldest and newest (-1: empty) */
    int32_t *ref, *prev, *next;
    PyObject **hash, **tokens; /* set while a block is indexed; owned */
    PyObject **ids;            /* each block's id as an int, made once, on first use */
    Slot *index;               /* hash -> block: open addressing, linear probes */
    size_t mask;               /* the index's slots - 1: a power of two, grown to keep
                                * it at most half full (at most n entries) */
    Py_ssize_t num_indexed;
    Py_ssize_t ids_made;       /* ids[i] may be set only below this */
    int caching;
} Pool;

static void lru_unlink(Pool *p, int32_t b) {
    int32_t before = p->prev[b], after = p->next[b];
    if (before >= 0)
        p->next[before] = after;
    else
        p->head = after;
    if (after >= 0)
        p->prev[after] = before;
    else
        p->tail = before;
    p->lru_len--;
}

static void lru_append(Pool *p, int32_t b) {
    p->prev[b] = p->tail;
    p->next[b] = -1;
    if (p->tail >= 0)
        p->next[p->tail] = b;
    else
        p->head = b;
    p->tail = b;
    p->lru_len++;
}

/* 32 bits of bytes' own hash (cached in the object: a block's hash is hashed once),
 * both halves mixed in, so the home slot depends on all of it */
static uint32_t code_of(PyObject *key) {
    uint64_t h = (uint64_t)(size_t)PyObject_Hash(key);
    return (uint32_t)(h ^ (h >> 32));
}

static int same_bytes(PyObject *a, PyObject *b) {
    Py_ssize_t size = PyBytes_GET_SIZE(a);
    return a == b || (size == PyBytes_GET_SIZE(b) &&
                      memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)size) == 0);
}

/* the slot holding ``key`` (exact bytes), or the empty slot where it would go */
static HOT size_t index_find(Pool *p, PyObject *key, uint32_t code) {
    size_t i = code & p->mask;
    for (;;) {
        Slot s = p->index[i];
        if (s.block1 == 0 || (s.tag == code && same_bytes(p->hash[s.block1 - 1], key)))
            return i;
        i = (i + 1) & p->mask;
    }
}

/* take indexed block ``b`` (its hash ``p->hash[b]``) out of the index: the entries
 * after it in its run move back so every probe still finds them */
static void index_remove(Pool *p, int32_t b) {
    size_t i = code_of(p->hash[b]) & p->mask;
    while (p->index[i].block1 != b + 1)
        i = (i + 1) & p->mask;
    for (size_t j = (i + 1) & p->mask; p->index[j].block1 != 0; j = (j + 1) & p->mask) {
        size_t home = p->index[j].tag & p->mask;
        /* j's entry may fill the hole at i unless its home lies in (i, j] */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            p->index[i] = p->index[j];
            i = j;
        }
    }
    p->index[i].block1 = 0;
    p->index[i].tag = 0;
    p->num_indexed--;
}

/* room in the index for one more entry: twice the slots when it would be more than
 * half full (a pool's memory then follows what it caches, not its size); -1 with
 * MemoryError set where that cannot be had */
static int index_reserve(Pool *p) {
    size_t slots = p->mask + 1;
    if ((size_t)(p->num_indexed + 1) * 2 <= slots)
        return 0;
    if (slots > SIZE_MAX / 2 / sizeof(Slot)) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *grown = PyMem_Calloc(slots * 2, sizeof(Slot));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = slots * 2 - 1;
    for (size_t i = 0; i < slots; i++) {
        Slot s = p->index[i];
        if (s.block1 == 0)
            continue;
        size_t j = s.tag & mask;
        while (grown[j].block1 != 0)
            j = (j + 1) & mask;
        grown[j] = s;
    }
    PyMem_Free(p->index);
    p->index = grown;
    p->mask = mask;
    return 0;
}

#define INDEX_SLOTS 64 /* the index's first size */

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"num_blocks", "enable_caching", NULL};
    Py_ssize_t n;
    int caching = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|p:BlockPool", names, &n, &caching))
        return NULL;
    if (n < 1)
        return PyErr_Format(PyExc_ValueError, "num_blocks must be >= 1, got %zd", n);
    if (n > INT32_MAX)
        return PyErr_Format(PyExc_ValueError, "num_blocks must be < 2**31, got %zd", n);
    Pool *p = (Pool *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->head = p->tail = -1; /* before anything can fail: dealloc reads them */
    p->ref = PyMem_Calloc((size_t)n, sizeof(int32_t));
    p->prev = PyMem_Calloc((size_t)n, sizeof(int32_t));
    p->next = PyMem_Calloc((size_t)n, sizeof(int32_t));
    p->hash = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    p->tokens = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    p->ids = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    p->index = PyMem_Calloc(INDEX_SLOTS, sizeof(Slot));
    p->mask = INDEX_SLOTS - 1;
    if (!p->ref || !p->prev || !p->next || !p->hash || !p->tokens || !p->ids || !p->index) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    p->n = n;
    p->caching = caching;
    return (PyObject *)p;
}

static void pool_dealloc(Pool *p) {
    if (p->hash != NULL && p->tokens != NULL)
        for (Py_ssize_t i = 0; i < p->fresh; i++) {
            Py_XDECREF(p->hash[i]);
            Py_XDECREF(p->tokens[i]);
        }
    if (p->ids != NULL) /* a failed allocate may have made ids past fresh */
        for (Py_ssize_t i = 0; i < p->ids_made; i++)
            Py_XDECREF(p->ids[i]);
    PyMem_Free(p->ref);
    PyMem_Free(p->prev);
    PyMem_Free(p->next);
    PyMem_Free(p->hash);
    PyMem_Free(p->tokens);
    PyMem_Free(p->ids);
    PyMem_Free(p->index);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* an int (or anything with __index__) as a block id below ``below``, or -1 with an
 * error set (``range_error`` and ``what``, a format taking the item, where it is out of
 * range or too large to be one) */
static Py_ssize_t block_id(PyObject *item, Py_ssize_t below, PyObject *range_error,
                           const char *what) {
    PyObject *index = PyLong_CheckExact(item) ? Py_NewRef(item) : PyNumber_Index(item);
    if (index == NULL)
        return -1;
    int overflow = 0;
    long long b = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (overflow || b < 0 || b >= below) {
        PyErr_Format(range_error, what, item);
        return -1;
    }
    return (Py_ssize_t)b;
}

/* a block id from ``item`` that was handed out before, or -1 with an error set */
static int32_t handed_out(Pool *p, PyObject *item) {
    return (int32_t)block_id(item, p->fresh, PyExc_ValueError, "block %R was never handed out");
}

/* block ``b``'s id as an int, a new reference (one object per block: a million
 * allocations hand out the same few thousand ints) */
static PyObject *id_of(Pool *p, int32_t b) {
    if (p->ids[b] == NULL) {
        p->ids[b] = PyLong_FromLong(b);
        if (p->ids[b] == NULL)
            return NULL;
        if (b >= p->ids_made)
            p->ids_made = (Py_ssize_t)b + 1;
    }
    Py_INCREF(p->ids[b]);
    return p->ids[b];
}

static PyObject *pool_allocate(Pool *p, PyObject *args) {
    Py_ssize_t n;
    PyObject *evicted = Py_None;
    if (!PyArg_ParseTuple(args, "n|O:allocate", &n, &evicted))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "cannot allocate %zd blocks", n);
    if (evicted != Py_None && !PyList_Check(evicted))
        return PyErr_Format(PyExc_TypeError, "evicted must be a list or None");
    if (n > p->n - p->fresh + p->lru_len)
        Py_RETURN_NONE;
    /* the ids first, so a failure leaves the pool as it was: never used ones in id
     * order, then the least recently freed */
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    if (n > p->n - p->fresh + p->lru_len) { /* a finalizer the collector ran took some */
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    Py_ssize_t unused = p->n - p->fresh < n ? p->n - p->fresh : n;
    int32_t b = p->head;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = id_of(p, i < unused ? (int32_t)(p->fresh + i) : b);
        if (id == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, id);
        if (i >= unused)
            b = p->next[b];
    }
    for (Py_ssize_t i = 0; i < unused; i++)
        p->ref[p->fresh + i] = 1;
    p->fresh += unused;
    for (Py_ssize_t i = unused; i < n; i++) {
        b = p->head;
        lru_unlink(p, b);
        PyObject *hash = p->hash[b];
        if (hash != NULL) { /* evicted: its hash leaves the index */
            index_remove(p, b);
            if (evicted != Py_None && PyList_Append(evicted, hash) < 0)
                PyErr_Clear(); /* out of memory: the block is taken all the same */
            Py_CLEAR(p->hash[b]);
            Py_CLEAR(p->tokens[b]);
        }
        p->ref[b] = 1;
    }
    return out;
}

/* ``ids`` as block ids, every one handed out before (else NULL with the error set, so
 * a bad id changes nothing); ``*count`` gets how many. PyMem_Free the result. */
static int32_t *checked_ids(Pool *p, PyObject *ids, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(ids, "block ids must be a sequence");
    if (seq == NULL)
        return NULL;
    *count = PySequence_Fast_GET_SIZE(seq);
    int32_t *out = PyMem_Malloc((size_t)(*count > 0 ? *count : 1) * sizeof(int32_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *count; i++) {
        PyObject *item = item_at(seq, i);
        out[i] = item != NULL ? handed_out(p, item) : -1;
        Py_XDECREF(item);
        if (out[i] < 0) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *pool_touch(Pool *p, PyObject *ids) {
    Py_ssize_t count;
    int32_t *blocks = checked_ids(p, ids, &count);
    if (blocks == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++)
        if (p->ref[blocks[i]] > INT32_MAX - count) {
            PyMem_Free(blocks);
            return PyErr_Format(PyExc_OverflowError, "block %d taken 2**31 times",
                                (int)blocks[i]);
        }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (p->ref[blocks[i]] == 0)
            lru_unlink(p, blocks[i]);
        p->ref[blocks[i]]++;
    }
    PyMem_Free(blocks);
    Py_RETURN_NONE;
}

static PyObject *pool_release(Pool *p, PyObject *ids) {
    Py_ssize_t count;
    int32_t *blocks = checked_ids(p, ids, &count);
    if (blocks == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        int32_t b = blocks[i];
        if (p->ref[b] <= 0) {
            PyMem_Free(blocks);
            return PyErr_Format(PyExc_RuntimeError, "block %d released more often than taken",
                                (int)b);
        }
        if (--p->ref[b] == 0)
            lru_append(p, b);
    }
    PyMem_Free(blocks);
    Py_RETURN_NONE;
}

/* the longest run of ``hashes[:limit]`` cached with exactly ``packed``'s token ids, as
 * block ids: the prefix-cache hit of a request. The answer list is made first: making
 * it may run the collector, and so any finalizer, which may change the pool or the
 * inputs. After it, nothing runs Python code (lists or tuples read in place, exact bytes
 * only, whose hashes are native; the list only grows), so the walk reads what is. */
static HOT PyObject *pool_longest_hit(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "longest_hit takes 3 arguments (%zd given)", nargs);
    Py_ssize_t limit = PyNumber_AsSsize_t(args[2], NULL); /* clamped, as a slice's end */
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (limit < 0)
        return PyErr_Format(PyExc_ValueError, "limit must be >= 0, got %zd", limit);
    PyObject *hits = PyList_New(0);
    if (hits == NULL)
        return NULL;
    PyObject *h = args[0], *t = args[1];
    if (!(PyList_Check(h) || PyTuple_Check(h)) || !(PyList_Check(t) || PyTuple_Check(t))) {
        Py_DECREF(hits);
        return PyErr_Format(PyExc_TypeError, "hashes and packed must be lists or tuples");
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(h);
    if (PySequence_Fast_GET_SIZE(t) != n) {
        Py_DECREF(hits);
        return PyErr_Format(PyExc_ValueError, "longest_hit: %zd hashes, %zd packed", n,
                            PySequence_Fast_GET_SIZE(t));
    }
    if (n > limit)
        n = limit;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *hash = PySequence_Fast_GET_ITEM(h, i), *ids = PySequence_Fast_GET_ITEM(t, i);
        if (!PyBytes_CheckExact(hash) || !PyBytes_CheckExact(ids))
            break; /* only bytes are ever indexed */
        int32_t b = p->index[index_find(p, hash, code_of(hash))].block1 - 1;
        PyObject *tokens = b >= 0 ? p->tokens[b] : NULL;
        Py_ssize_t size = PyBytes_GET_SIZE(ids);
        if (tokens == NULL || PyBytes_GET_SIZE(tokens) != size ||
            memcmp(PyBytes_AS_STRING(tokens), PyBytes_AS_STRING(ids), (size_t)size) != 0)
            break;
        PyObject *id = id_of(p, b);
        int failed = id == NULL || PyList_Append(hits, id) < 0;
        Py_XDECREF(id);
        if (failed) {
            Py_DECREF(hits);
            return NULL;
        }
    }
    return hits;
}

static PyObject *pool_cache_all(Pool *p, PyObject *args) {
    PyObject *ids, *hashes, *packed, *indexed = Py_None;
    if (!PyArg_ParseTuple(args, "OOO|O:cache_all", &ids, &hashes, &packed, &indexed))
        return NULL;
    if (indexed != Py_None && !PyList_Check(indexed))
        return PyErr_Format(PyExc_TypeError, "indexed must be a list or None");
    if (!p->caching)
        Py_RETURN_NONE;
    Py_ssize_t count;
    int32_t *blocks = checked_ids(p, ids, &count);
    if (blocks == NULL)
        return NULL;
    PyObject *h = PySequence_Fast(hashes, "hashes must be a sequence");
    PyObject *t = h ? PySequence_Fast(packed, "packed must be a sequence") : NULL;
    PyObject *result = NULL;
    if (t == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(h) != count || PySequence_Fast_GET_SIZE(t) != count) {
        PyErr_Format(PyExc_ValueError, "cache_all: %zd blocks, %zd hashes, %zd packed", count,
                     PySequence_Fast_GET_SIZE(h), PySequence_Fast_GET_SIZE(t));
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *hash = PySequence_Fast_GET_ITEM(h, i), *tokens = PySequence_Fast_GET_ITEM(t, i);
        /* exactly bytes: no __hash__, __eq__ or __del__ of ours can run mid-change */
        if (!PyBytes_CheckExact(hash) || !PyBytes_CheckExact(tokens)) {
            PyErr_SetString(PyExc_TypeError, "hashes and packed token ids must be bytes");
            goto done;
        }
        int32_t b = blocks[i];
        int indexes = 0;
        size_t slot = 0;
        uint32_t code = 0;
        if (p->hash[b] == NULL) {
            if (index_reserve(p) < 0) /* before the probe: growing moves the slots */
                goto done;
            code = code_of(hash);
            slot = index_find(p, hash, code);
            indexes = p->index[slot].block1 == 0;
        }
        if (indexes) { /* first writer wins: a duplicate stays private */
            Py_INCREF(hash);
            Py_INCREF(tokens);
            p->hash[b] = hash;
            p->tokens[b] = tokens;
            p->index[slot].tag = code;
            p->index[slot].block1 = b + 1;
            p->num_indexed++;
        }
        if (indexed != Py_None && PyList_Append(indexed, indexes ? Py_True : Py_False) < 0)
            goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(blocks);
    Py_XDECREF(h);
    Py_XDECREF(t);
    return result;
}

static PyObject *pool_num_free_of(Pool *p, PyObject *ids) {
    Py_ssize_t count, free = 0;
    int32_t *blocks = checked_ids(p, ids, &count);
    if (blocks == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++)
        free += p->ref[blocks[i]] == 0;
    PyMem_Free(blocks);
    return PyLong_FromSsize_t(free);
}

/* a block id in range (one never handed out is a free block with no hash) */
static int32_t some_block(Pool *p, PyObject *arg) {
    return (int32_t)block_id(arg, p->n, PyExc_IndexError, "no block %R in this pool");
}

static PyObject *pool_ref_cnt(Pool *p, PyObject *arg) {
    int32_t b = some_block(p, arg);
    return b < 0 ? NULL : PyLong_FromLong(p->ref[b]);
}

static PyObject *pool_block_hash(Pool *p, PyObject *arg) {
    int32_t b = some_block(p, arg);
    if (b < 0)
        return NULL;
    PyObject *hash = p->hash[b] ? p->hash[b] : Py_None;
    Py_INCREF(hash);
    return hash;
}

/* the first `limit` free block ids in allocation order (all of them for None or none) */
static PyObject *pool_free_block_ids(Pool *p, PyObject *args) {
    PyObject *arg = Py_None;
    if (!PyArg_ParseTuple(args, "|O:free_block_ids", &arg))
        return NULL;
    Py_ssize_t limit = arg == Py_None ? PY_SSIZE_T_MAX : PyNumber_AsSsize_t(arg, NULL);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (limit < 0)
        return PyErr_Format(PyExc_ValueError, "limit must be >= 0, got %zd", limit);
    PyObject *out;
    Py_ssize_t count;
    for (;;) { /* made before the pool is read: the collector may run a finalizer */
        Py_ssize_t all = p->n - p->fresh + p->lru_len;
        count = all < limit ? all : limit;
        out = PyList_New(count);
        if (out == NULL)
            return NULL;
        if (all == p->n - p->fresh + p->lru_len)
            break;
        Py_DECREF(out);
    }
    Py_ssize_t i = 0;
    for (Py_ssize_t b = p->fresh; b < p->n && i < count; b++, i++) {
        PyObject *id = PyLong_FromSsize_t(b);
        if (id == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, id);
    }
    for (int32_t b = p->head; b >= 0 && i < count; b = p->next[b], i++) {
        PyObject *id = PyLong_FromLong(b);
        if (id == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, id);
    }
    return out;
}

static PyObject *pool_get_num_blocks(Pool *p, void *c) {
    (void)c;
    return PyLong_FromSsize_t(p->n);
}

static PyObject *pool_get_num_free(Pool *p, void *c) {
    (void)c;
    return PyLong_FromSsize_t(p->n - p->fresh + p->lru_len);
}

static PyObject *pool_get_num_cached(Pool *p, void *c) {
    (void)c;
    return PyLong_FromSsize_t(p->num_indexed);
}

static PyObject *pool_get_usage(Pool *p, void *c) {
    (void)c;
    return PyFloat_FromDouble(1.0 - (double)(p->n - p->fresh + p->lru_len) / (double)p->n);
}

static PyObject *pool_get_caching(Pool *p, void *c) {
    (void)c;
    return PyBool_FromLong(p->caching);
}

static PyMethodDef pool_methods[] = {
    {"allocate", (PyCFunction)pool_allocate, METH_VARARGS, NULL},
    {"touch", (PyCFunction)pool_touch, METH_O, NULL},
    {"release", (PyCFunction)pool_release, METH_O, NULL},
    {"longest_hit", (PyCFunction)(void (*)(void))pool_longest_hit, METH_FASTCALL, NULL},
    {"cache_all", (PyCFunction)pool_cache_all, METH_VARARGS, NULL},
    {"num_free_of", (PyCFunction)pool_num_free_of, METH_O, NULL},
    {"ref_cnt", (PyCFunction)pool_ref_cnt, METH_O, NULL},
    {"block_hash", (PyCFunction)pool_block_hash, METH_O, NULL},
    {"free_block_ids", (PyCFunction)pool_free_block_ids, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"num_blocks", (getter)pool_get_num_blocks, NULL, NULL, NULL},
    {"num_free_blocks", (getter)pool_get_num_free, NULL, NULL, NULL},
    {"num_cached_blocks", (getter)pool_get_num_cached, NULL, NULL, NULL},
    {"usage", (getter)pool_get_usage, NULL, NULL, NULL},
    {"enable_caching", (getter)pool_get_caching, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_sendpath_kv.BlockPool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The block pool in C: block_pool.BlockPool's behaviour.",
    .tp_new = pool_new,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

static PyMethodDef module_methods[] = {
    {"block_hashes", (PyCFunction)(void (*)(void))block_hashes, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_sendpath_kv", NULL, -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sendpath_kv(void) {
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(module, "BlockPool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
