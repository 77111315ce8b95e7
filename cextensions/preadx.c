/* qnpipe._preadx: a batch of preads into caller buffers, on a persistent pthread pool,
 * with the GIL released. Optional: qnpipe/io/ssd.py falls back to os.preadv in a
 * ThreadPoolExecutor when this module is missing; both must produce identical bytes.
 *
 * Pool(nthreads).pread_batch(ops) -> list[int]
 *   ops: sequence of (fd, offset, length, need, buffer); buffer is writable, >= length bytes.
 *   Each op preads up to `length` bytes at `offset` into `buffer`, resuming after partial
 *   reads and EINTR, until at least `need` bytes arrived, EOF, or an error.
 *   Result per op: bytes read (>= 0; < need means EOF came first) or -errno.
 * Several threads may call pread_batch on one pool at once: their batches queue FIFO and
 * at most `nthreads` preads are in flight in total (the device queue depth).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct {
    int fd;
    off_t offset;
    size_t length;
    size_t need;
    char *buf;
    Py_ssize_t result;
} op_t;

typedef struct job {
    op_t *ops;
    size_t n;
    size_t next;     /* first op not yet taken by a worker */
    size_t done;     /* ops finished */
    pthread_cond_t done_cv;
    struct job *link;
} job_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    job_t *head, *tail; /* jobs with ops not yet taken */
    pthread_t *threads;
    int nthreads;
    int started;
    int stopping;
} PoolObject;

static Py_ssize_t do_pread(const op_t *op) {
    size_t got = 0;
    while (got < op->need) {
        ssize_t r = pread(op->fd, op->buf + got, op->length - got, op->offset + (off_t)got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(Py_ssize_t)errno;
        }
        if (r == 0) break; /* EOF */
        got += (size_t)r;
    }
    return (Py_ssize_t)got;
}

static void *worker_main(void *arg) {
    PoolObject *p = (PoolObject *)arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stopping && p->head == NULL) pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->head == NULL) break; /* stopping and nothing queued */
        job_t *job = p->head;
        op_t *op = &job->ops[job->next++];
        if (job->next == job->n) { /* all taken: unlink; the caller still owns it */
            p->head = job->link;
            if (p->head == NULL) p->tail = NULL;
        }
        pthread_mutex_unlock(&p->mu);
        op->result = do_pread(op);
        pthread_mutex_lock(&p->mu);
        if (++job->done == job->n) pthread_cond_signal(&job->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_stop(PoolObject *p) {
    if (!p->started) return;
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    p->started = 0;
}

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"nthreads", NULL};
    int n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &n)) return -1;
    if (n < 1 || n > 1024) {
        PyErr_Format(PyExc_ValueError, "nthreads must be in 1..1024, got %d", n);
        return -1;
    }
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "Pool already initialised");
        return -1;
    }
    self->threads = PyMem_RawCalloc((size_t)n, sizeof(pthread_t));
    if (self->threads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work_cv, NULL);
    self->head = self->tail = NULL;
    self->stopping = 0;
    self->nthreads = 0;
    self->started = 1;
    for (int i = 0; i < n; i++) {
        int rc = pthread_create(&self->threads[i], NULL, worker_main, self);
        if (rc != 0) {
            pool_stop(self);
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->nthreads++;
    }
    return 0;
}

static void Pool_dealloc(PoolObject *self) {
    Py_BEGIN_ALLOW_THREADS
    pool_stop(self);
    Py_END_ALLOW_THREADS
    if (self->threads != NULL) {
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->work_cv);
        PyMem_RawFree(self->threads);
        self->threads = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_close(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    pool_stop(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Pool_pread_batch(PoolObject *self, PyObject *arg) {
    if (!self->started || self->stopping) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "pread_batch expects a sequence of (fd, offset, length, need, buffer)");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = NULL;
    op_t *ops = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t nviews = 0;
    if (n == 0) {
        out = PyList_New(0);
        goto done;
    }
    ops = PyMem_Calloc((size_t)n, sizeof(op_t));
    views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    if (ops == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int fd;
        long long offset;
        Py_ssize_t length, need;
        PyObject *buf;
        if (!PyTuple_Check(item) ||
            !PyArg_ParseTuple(item, "iLnnO;op must be (fd, offset, length, need, buffer)", &fd, &offset, &length,
                              &need, &buf)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "op must be a tuple (fd, offset, length, need, buffer)");
            goto done;
        }
        if (fd < 0 || offset < 0 || length < 0 || need < 0 || need > length) {
            PyErr_Format(PyExc_ValueError, "op %zd: bad op fd=%d offset=%lld length=%zd need=%zd", i, fd, offset, length, need);
            goto done;
        }
        if (PyObject_GetBuffer(buf, &views[i], PyBUF_WRITABLE) < 0) goto done;
        nviews++;
        if (views[i].len < length) {
            PyErr_Format(PyExc_ValueError, "op %zd: buffer has %zd bytes, the read needs %zd", i, views[i].len, length);
            goto done;
        }
        ops[i].fd = fd;
        ops[i].offset = (off_t)offset;
        ops[i].length = (size_t)length;
        ops[i].need = (size_t)need;
        ops[i].buf = (char *)views[i].buf;
    }

    job_t job;
    memset(&job, 0, sizeof(job));
    job.ops = ops;
    job.n = (size_t)n;
    int closed = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_cond_init(&job.done_cv, NULL);
    pthread_mutex_lock(&self->mu);
    if (self->stopping) {
        closed = 1; /* closed by another thread meanwhile: no worker would take the job */
    } else {
        if (self->tail) self->tail->link = &job;
        else self->head = &job;
        self->tail = &job;
        pthread_cond_broadcast(&self->work_cv);
        while (job.done < job.n) pthread_cond_wait(&job.done_cv, &self->mu);
    }
    pthread_mutex_unlock(&self->mu);
    pthread_cond_destroy(&job.done_cv);
    Py_END_ALLOW_THREADS
    if (closed) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        goto done;
    }

    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyLong_FromSsize_t(ops[i].result);
        if (r == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, r);
    }

done:
    for (Py_ssize_t i = 0; i < nviews; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(ops);
    Py_DECREF(seq);
    return out;
}

static PyObject *Pool_get_nthreads(PoolObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->nthreads);
}

static PyMethodDef Pool_methods[] = {
    {"pread_batch", (PyCFunction)Pool_pread_batch, METH_O,
     "pread_batch(ops) -> list[int]: ops are (fd, offset, length, need, buffer); result per op is bytes "
     "read or -errno. Blocks (GIL released) until every op is done."},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "Stop and join the worker threads (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"nthreads", (getter)Pool_get_nthreads, NULL, "worker threads (preads in flight at most)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qnpipe._preadx.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(nthreads): persistent pthreads doing batches of pread into caller buffers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "qnpipe._preadx", "Batched pread on a pthread pool with the GIL released.", -1, NULL,
};

PyMODINIT_FUNC PyInit__preadx(void) {
    if (PyType_Ready(&PoolType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
