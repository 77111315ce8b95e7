/* qnpipe.policy._slot_table: `SlotTable.acquire` of a table whose eviction is LFU, in C.

   The same steps as the Python method (qnpipe/policy/slot_table.py), on the same objects (the table's
   dicts, sets and lists and the LFU's dicts), in the same order: the holds and the hits' accesses in the
   route's order, then the victims (LFU's least keys among the ready experts neither loading, held nor
   pinned: what `LFU.pick_many` and `LFU.pick` return), then each miss's load. Why C: a decode's acquire
   runs right after the layer's compute has pushed the pool's code out of the CPU's caches, and there the
   Python method's many small steps cost ~100 µs (docs/measurements.md). The Python method stays the
   reference; tests/policy/test_slot_table_c.py holds the two equal, state and answers, op by op.

   `acquire(table, experts)` returns (hits, loads, waiting) as tuples, or None, with nothing changed, when
   the table has not the room (the Python method then raises CapacityError with its message). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *READY, *LOADING, *LOAD, *COLD, *CAPACITY; /* set once by `init` */
static PyObject *ONE, *MINUS_ONE;
static int TICK_BITS = 48;
static PyObject *s_slot_of, *s_state, *s_held, *s_eviction, *s_tick, *s_free, *s_loading, *s_ready, *s_pinned,
    *s_seen, *s_expert_of, *s_generation, *s_capacity, *s_count, *s_last, *s_key;

static PyObject *init(PyObject *self, PyObject *args) {
    PyObject *ready, *loading, *load, *cold, *capacity;
    if (!PyArg_ParseTuple(args, "OOOOOi", &ready, &loading, &load, &cold, &capacity, &TICK_BITS)) return NULL;
    Py_XSETREF(READY, Py_NewRef(ready));
    Py_XSETREF(LOADING, Py_NewRef(loading));
    Py_XSETREF(LOAD, Py_NewRef(load));
    Py_XSETREF(COLD, Py_NewRef(cold));
    Py_XSETREF(CAPACITY, Py_NewRef(capacity));
    Py_RETURN_NONE;
}

/* count[e] += 1 (from 0), last[e] = tick, key[e] = (count << TICK_BITS) | tick: `LFU.accessed`. */
static int lfu_access(PyObject *count, PyObject *last, PyObject *key, PyObject *e, long long tick) {
    PyObject *c = PyDict_GetItemWithError(count, e);
    if (c == NULL && PyErr_Occurred()) return -1;
    PyObject *c1 = c == NULL ? PyLong_FromLong(1) : PyNumber_Add(c, ONE);
    if (c1 == NULL) return -1;
    PyObject *t = PyLong_FromLongLong(tick);
    PyObject *k = NULL;
    if (t != NULL) {
        int overflow = 0;
        long long cv = PyLong_AsLongLongAndOverflow(c1, &overflow);
        if (!overflow && cv >= 0 && cv < (1LL << (62 - TICK_BITS)) && tick >= 0 && tick < (1LL << TICK_BITS)) {
            k = PyLong_FromLongLong((cv << TICK_BITS) | tick);
        } else { /* past 64 bits: Python's ints, as the method's */
            PyObject *bits = PyLong_FromLong(TICK_BITS);
            PyObject *sh = bits ? PyNumber_Lshift(c1, bits) : NULL;
            k = sh ? PyNumber_Or(sh, t) : NULL;
            Py_XDECREF(bits);
            Py_XDECREF(sh);
        }
    }
    int rc = (t == NULL || k == NULL || PyDict_SetItem(count, e, c1) < 0 || PyDict_SetItem(last, e, t) < 0 ||
              PyDict_SetItem(key, e, k) < 0) ? -1 : 0;
    Py_DECREF(c1);
    Py_XDECREF(t);
    Py_XDECREF(k);
    return rc;
}

/* Slots a step needing `experts` can use (`SlotTable.available_for`); -1 on error. */
static Py_ssize_t available_for(Py_ssize_t capacity, PyObject *pinned, PyObject *held, PyObject *loading,
                                PyObject *experts) {
    if (PySet_GET_SIZE(pinned) == 0 && PyDict_GET_SIZE(held) == 0 && PySet_GET_SIZE(loading) == 0) return capacity;
    PyObject *blocked = PySet_New(pinned);
    if (blocked == NULL) return -1;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(held, &pos, &k, &v))
        if (PySet_Add(blocked, k) < 0) goto fail;
    PyObject *it = PyObject_GetIter(loading);
    if (it == NULL) goto fail;
    while ((k = PyIter_Next(it)) != NULL) {
        int rc = PySet_Add(blocked, k);
        Py_DECREF(k);
        if (rc < 0) break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(experts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PySet_Discard(blocked, PySequence_Fast_GET_ITEM(experts, i)) < 0) goto fail;
    Py_ssize_t room = capacity - PySet_GET_SIZE(blocked);
    Py_DECREF(blocked);
    return room;
fail:
    Py_DECREF(blocked);
    return -1;
}

/* The `n` ready experts of least key, least first, into `out` (a list): those in `key` neither loading, held
   nor pinned. Fewer when fewer are evictable. */
static int least_keys(PyObject *key, PyObject *loading, PyObject *held, PyObject *pinned, Py_ssize_t n,
                      PyObject *out) {
    PyObject *cand = PyList_New(0), *vals = PyList_New(0);
    if (cand == NULL || vals == NULL) goto fail;
    PyObject *e, *k;
    Py_ssize_t pos = 0;
    while (PyDict_Next(key, &pos, &e, &k)) {
        int in;
        if ((in = PySet_Contains(loading, e)) != 0 || (in = PyDict_Contains(held, e)) != 0 ||
            (in = PySet_Contains(pinned, e)) != 0) {
            if (in < 0) goto fail;
            continue;
        }
        if (PyList_Append(cand, e) < 0 || PyList_Append(vals, k) < 0) goto fail;
    }
    Py_ssize_t m = PyList_GET_SIZE(cand);
    char taken[4096];
    char *used = m <= (Py_ssize_t)sizeof taken ? taken : PyMem_Calloc(m, 1);
    if (used == NULL) goto fail;
    if (used == taken) memset(taken, 0, m);
    for (Py_ssize_t j = 0; j < n && j < m; j++) {
        Py_ssize_t best = -1;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (used[i]) continue;
            if (best < 0) { best = i; continue; }
            int lt = PyObject_RichCompareBool(PyList_GET_ITEM(vals, i), PyList_GET_ITEM(vals, best), Py_LT);
            if (lt < 0) { if (used != taken) PyMem_Free(used); goto fail; }
            if (lt) best = i;
        }
        used[best] = 1;
        if (PyList_Append(out, PyList_GET_ITEM(cand, best)) < 0) { if (used != taken) PyMem_Free(used); goto fail; }
    }
    if (used != taken) PyMem_Free(used);
    Py_DECREF(cand);
    Py_DECREF(vals);
    return 0;
fail:
    Py_XDECREF(cand);
    Py_XDECREF(vals);
    return -1;
}

static PyObject *get(PyObject *o, PyObject *name, PyTypeObject *type) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v != NULL && type != NULL && !PyObject_TypeCheck(v, type)) {
        PyErr_Format(PyExc_TypeError, "slot table attribute %R is a %.100s, not a %.100s", name, Py_TYPE(v)->tp_name,
                     type->tp_name);
        Py_CLEAR(v);
    }
    return v;
}

static PyObject *acquire(PyObject *self, PyObject *args) {
    PyObject *table, *experts_in;
    if (!PyArg_ParseTuple(args, "OO", &table, &experts_in)) return NULL;
    if (READY == NULL) return PyErr_Format(PyExc_RuntimeError, "qnpipe.policy._slot_table.init was not called");
    PyObject *experts = PySequence_Fast(experts_in, "experts must be a sequence");
    if (experts == NULL) return NULL;
    PyObject *result = NULL, *hits = NULL, *waiting = NULL, *missing = NULL, *victims = NULL, *loads = NULL;
    PyObject *slot_of = get(table, s_slot_of, &PyDict_Type), *state = get(table, s_state, &PyList_Type),
             *held = get(table, s_held, &PyDict_Type), *eviction = get(table, s_eviction, NULL),
             *free_ = get(table, s_free, &PyList_Type), *loading = get(table, s_loading, &PySet_Type),
             *pinned = get(table, s_pinned, &PySet_Type), *seen = get(table, s_seen, &PySet_Type),
             *expert_of = get(table, s_expert_of, &PyList_Type), *generation = get(table, s_generation, &PyList_Type);
    PyObject *count = NULL, *last = NULL, *key = NULL;
    if (!slot_of || !state || !held || !eviction || !free_ || !loading || !pinned || !seen || !expert_of ||
        !generation)
        goto done;
    if (!(count = get(eviction, s_count, &PyDict_Type)) || !(last = get(eviction, s_last, &PyDict_Type)) ||
        !(key = get(eviction, s_key, &PyDict_Type)))
        goto done;
    long long tick, ready;
    Py_ssize_t capacity;
    {
        PyObject *o = PyObject_GetAttr(table, s_tick);
        tick = o ? PyLong_AsLongLong(o) : -1;
        Py_XDECREF(o);
        o = PyObject_GetAttr(table, s_ready);
        ready = o ? PyLong_AsLongLong(o) : -1;
        Py_XDECREF(o);
        o = PyObject_GetAttr(table, s_capacity);
        capacity = o ? PyLong_AsSsize_t(o) : -1;
        Py_XDECREF(o);
        if (PyErr_Occurred()) goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(experts);
    Py_ssize_t room = available_for(capacity, pinned, held, loading, experts);
    if (room < 0 && PyErr_Occurred()) goto done;
    if (n > room) { /* the Python method raises, with its message; nothing changed */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (!(hits = PyList_New(0)) || !(waiting = PyList_New(0)) || !(missing = PyList_New(0))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(experts, i);
        PyObject *h = PyDict_GetItemWithError(held, e);
        if (h == NULL && PyErr_Occurred()) goto done;
        PyObject *h1 = h == NULL ? PyLong_FromLong(1) : PyNumber_Add(h, ONE);
        if (h1 == NULL) goto done;
        int rc = PyDict_SetItem(held, e, h1);
        Py_DECREF(h1);
        if (rc < 0) goto done;
        PyObject *s = PyDict_GetItemWithError(slot_of, e);
        if (s == NULL) {
            if (PyErr_Occurred() || PyList_Append(missing, e) < 0) goto done;
            continue;
        }
        tick += 1;
        if (lfu_access(count, last, key, e, tick) < 0) goto done;
        Py_ssize_t si = PyLong_AsSsize_t(s);
        if (si < 0 || si >= PyList_GET_SIZE(state)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_IndexError, "slot %zd out of the table", si);
            goto done;
        }
        PyObject *pair = PyTuple_Pack(2, e, s);
        if (pair == NULL) goto done;
        rc = PyList_Append(PyList_GET_ITEM(state, si) == READY ? hits : waiting, pair);
        Py_DECREF(pair);
        if (rc < 0) goto done;
    }
    Py_ssize_t nmiss = PyList_GET_SIZE(missing), nfree = PyList_GET_SIZE(free_);
    if (!(victims = PyList_New(0))) goto done;
    if (nmiss > nfree) {
        if (least_keys(key, loading, held, pinned, nmiss - nfree, victims) < 0) goto done;
        if (PyList_GET_SIZE(victims) != nmiss - nfree) {
            PyErr_Format(PyExc_AssertionError, "no evictable slot");
            goto done;
        }
    }
    if (!(loads = PyTuple_New(nmiss))) goto done;
    for (Py_ssize_t i = 0; i < nmiss; i++) {
        PyObject *e = PyList_GET_ITEM(missing, i), *slot, *evicted;
        if (PyList_GET_SIZE(free_) > 0) {
            Py_ssize_t last_i = PyList_GET_SIZE(free_) - 1;
            slot = Py_NewRef(PyList_GET_ITEM(free_, last_i));
            if (PyList_SetSlice(free_, last_i, last_i + 1, NULL) < 0) { Py_DECREF(slot); goto done; }
            evicted = Py_NewRef(MINUS_ONE);
        } else {
            evicted = Py_NewRef(PyList_GET_ITEM(victims, i - nfree));
            slot = PyDict_GetItemWithError(slot_of, evicted);
            if (slot == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, evicted);
                Py_DECREF(evicted);
                goto done;
            }
            Py_INCREF(slot);
            if (PyDict_DelItem(slot_of, evicted) < 0 || PyDict_DelItem(last, evicted) < 0 ||
                PyDict_DelItem(key, evicted) < 0) { /* `LFU.removed` */
                Py_DECREF(slot);
                Py_DECREF(evicted);
                goto done;
            }
            ready -= 1;
        }
        int was_seen = PySet_Contains(seen, e);
        Py_ssize_t si = PyLong_AsSsize_t(slot);
        int bad = was_seen < 0 || (si == -1 && PyErr_Occurred()) || PySet_Add(seen, e) < 0 ||
                  PyDict_SetItem(slot_of, e, slot) < 0 || si < 0 || si >= PyList_GET_SIZE(expert_of) ||
                  si >= PyList_GET_SIZE(generation);
        PyObject *g1 = NULL, *ld = NULL;
        if (!bad) {
            Py_INCREF(e);
            PyList_SetItem(expert_of, si, e);
            Py_INCREF(LOADING);
            PyList_SetItem(state, si, LOADING);
            bad = PySet_Add(loading, e) < 0 ||
                  !(g1 = PyNumber_Add(PyList_GET_ITEM(generation, si), ONE));
        }
        if (!bad) {
            PyList_SetItem(generation, si, g1);
            tick += 1;
            bad = lfu_access(count, last, key, e, tick) < 0 ||
                  !(ld = PyObject_CallFunctionObjArgs(LOAD, e, slot, evicted, was_seen ? CAPACITY : COLD, NULL));
        }
        Py_DECREF(slot);
        Py_DECREF(evicted);
        if (bad) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_IndexError, "slot %zd out of the table", si);
            goto done;
        }
        PyTuple_SET_ITEM(loads, i, ld);
    }
    {
        PyObject *t = PyLong_FromLongLong(tick), *r = PyLong_FromLongLong(ready);
        int bad = !t || !r || PyObject_SetAttr(table, s_tick, t) < 0 || PyObject_SetAttr(table, s_ready, r) < 0;
        Py_XDECREF(t);
        Py_XDECREF(r);
        if (bad) goto done;
    }
    {
        PyObject *th = PyList_AsTuple(hits), *tw = PyList_AsTuple(waiting);
        if (th && tw) result = PyTuple_Pack(3, th, loads, tw);
        Py_XDECREF(th);
        Py_XDECREF(tw);
    }
done:
    Py_XDECREF(experts);
    Py_XDECREF(hits);
    Py_XDECREF(waiting);
    Py_XDECREF(missing);
    Py_XDECREF(victims);
    Py_XDECREF(loads);
    Py_XDECREF(slot_of);
    Py_XDECREF(state);
    Py_XDECREF(held);
    Py_XDECREF(eviction);
    Py_XDECREF(free_);
    Py_XDECREF(loading);
    Py_XDECREF(pinned);
    Py_XDECREF(seen);
    Py_XDECREF(expert_of);
    Py_XDECREF(generation);
    Py_XDECREF(count);
    Py_XDECREF(last);
    Py_XDECREF(key);
    return result;
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, "init(READY, LOADING, Load, COLD, CAPACITY, tick_bits): the constants acquire uses."},
    {"acquire", acquire, METH_VARARGS,
     "acquire(table, experts) -> (hits, loads, waiting), or None (nothing changed) when the room is short."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slot_table", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slot_table(void) {
#define INTERN(var, s) if (!(var = PyUnicode_InternFromString(s))) return NULL
    INTERN(s_slot_of, "slot_of");
    INTERN(s_state, "state");
    INTERN(s_held, "held");
    INTERN(s_eviction, "eviction");
    INTERN(s_tick, "tick");
    INTERN(s_free, "_free");
    INTERN(s_loading, "_loading");
    INTERN(s_ready, "_ready");
    INTERN(s_pinned, "pinned");
    INTERN(s_seen, "seen");
    INTERN(s_expert_of, "expert_of");
    INTERN(s_generation, "generation");
    INTERN(s_capacity, "capacity");
    INTERN(s_count, "count");
    INTERN(s_last, "last");
    INTERN(s_key, "key");
    if (!(ONE = PyLong_FromLong(1)) || !(MINUS_ONE = PyLong_FromLong(-1))) return NULL;
    return PyModule_Create(&module);
}
