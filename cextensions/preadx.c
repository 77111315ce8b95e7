/* qnpipe.io._preadx: a batch of preads into caller buffers, on a persistent pthread pool,
 * with the GIL released. Optional: qnpipe/io/ssd.py falls back to os.preadv in a
 * ThreadPoolExecutor when this module is missing; both must produce identical bytes.
 *
 * Pool(nthreads).pread_batch(ops) -> list[int]
 *   ops: sequence of (fd, offset, need, buffers); buffers is one writable buffer or a tuple
 *   of them (scatter: the file range fills them in order, one preadv). Each op reads up to
 *   the buffers' total length at `offset`, resuming after partial reads and EINTR, until at
 *   least `need` bytes arrived, EOF, or an error.
 *   Result per op: bytes read (>= 0; < need means EOF came first) or -errno.
 * Several threads may call pread_batch on one pool at once: their batches queue FIFO and
 * at most `nthreads` preads are in flight in total (the device queue depth).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    int fd;
    off_t offset;
    size_t need;
    struct iovec *iov; /* advanced in place on partial reads */
    int iovcnt;
    Py_ssize_t result;
} op_t;

typedef struct job {
    op_t *ops;
    size_t n;
    atomic_size_t next; /* first op not yet taken: workers claim ops with fetch_add, no lock */
    size_t users;       /* workers inside this job (under the pool mutex) */
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

static Py_ssize_t do_pread(op_t *op) {
    size_t got = 0;
    struct iovec *iov = op->iov;
    int cnt = op->iovcnt;
    while (got < op->need && cnt > 0) {
        ssize_t r = cnt == 1 ? pread(op->fd, iov->iov_base, iov->iov_len, op->offset + (off_t)got)
                             : preadv(op->fd, iov, cnt, op->offset + (off_t)got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(Py_ssize_t)errno;
        }
        if (r == 0) break; /* EOF */
        got += (size_t)r;
        while (cnt > 0 && (size_t)r >= iov->iov_len) { /* skip the filled buffers */
            r -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
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
        job->users++;
        pthread_mutex_unlock(&p->mu);
        /* The hot path takes no lock: claim op indices until the job runs out. */
        for (;;) {
            size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
            if (i >= job->n) break;
            job->ops[i].result = do_pread(&job->ops[i]);
        }
        pthread_mutex_lock(&p->mu);
        if (p->head == job) { /* exhausted: unlink it so the next job's ops get taken */
            p->head = job->link;
            if (p->head == NULL) p->tail = NULL;
        }
        /* Every op is claimed; each claimer finishes its op before leaving, so the last
         * user out means all results are written (the mutex orders them for the caller). */
        if (--job->users == 0) pthread_cond_signal(&job->done_cv);
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
    PyObject *seq = PySequence_Fast(arg, "pread_batch expects a sequence of (fd, offset, need, buffers)");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = NULL;
    op_t *ops = NULL;
    Py_buffer *views = NULL;
    struct iovec *iovs = NULL;
    Py_ssize_t nviews = 0, total_bufs = 0;
    if (n == 0) {
        out = PyList_New(0);
        goto done;
    }
    /* First pass: count the buffers (a tuple of buffers = one iovec each). */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_Format(PyExc_TypeError, "op %zd must be a tuple (fd, offset, need, buffers)", i);
            goto done;
        }
        PyObject *bufs = PyTuple_GET_ITEM(item, 3);
        Py_ssize_t k = PyTuple_Check(bufs) ? PyTuple_GET_SIZE(bufs) : 1;
        if (k < 1 || k > IOV_MAX) {
            PyErr_Format(PyExc_ValueError, "op %zd: %zd buffers, allowed 1..%d", i, k, IOV_MAX);
            goto done;
        }
        total_bufs += k;
    }
    ops = PyMem_Calloc((size_t)n, sizeof(op_t));
    views = PyMem_Calloc((size_t)total_bufs, sizeof(Py_buffer));
    iovs = PyMem_Calloc((size_t)total_bufs, sizeof(struct iovec));
    if (ops == NULL || views == NULL || iovs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int fd;
        long long offset;
        Py_ssize_t need;
        PyObject *bufs;
        if (!PyArg_ParseTuple(item, "iLnO;op must be (fd, offset, need, buffers)", &fd, &offset, &need, &bufs))
            goto done;
        if (fd < 0 || offset < 0 || need < 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: bad op fd=%d offset=%lld need=%zd", i, fd, offset, need);
            goto done;
        }
        int is_tuple = PyTuple_Check(bufs);
        Py_ssize_t k = is_tuple ? PyTuple_GET_SIZE(bufs) : 1;
        ops[i].iov = &iovs[nviews];
        ops[i].iovcnt = (int)k;
        size_t room = 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *b = is_tuple ? PyTuple_GET_ITEM(bufs, j) : bufs;
            if (PyObject_GetBuffer(b, &views[nviews], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
            iovs[nviews].iov_base = views[nviews].buf;
            iovs[nviews].iov_len = (size_t)views[nviews].len;
            room += (size_t)views[nviews].len;
            nviews++;
        }
        if (room < (size_t)need) {
            PyErr_Format(PyExc_ValueError, "op %zd: buffers hold %zu bytes, the read needs %zd", i, room, need);
            goto done;
        }
        ops[i].fd = fd;
        ops[i].offset = (off_t)offset;
        ops[i].need = (size_t)need;
    }

    job_t job;
    memset(&job, 0, sizeof(job));
    job.ops = ops;
    job.n = (size_t)n;
    atomic_init(&job.next, 0);
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
        /* Done when every op was claimed and no worker is still inside the job. */
        while (atomic_load(&job.next) < job.n || job.users > 0) pthread_cond_wait(&job.done_cv, &self->mu);
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
    PyMem_Free(iovs);
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
     "pread_batch(ops) -> list[int]: ops are (fd, offset, need, buffers), buffers one writable buffer or a "
     "tuple of them (scatter); result per op is bytes read or -errno. Blocks (GIL released) until every op "
     "is done."},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "Stop and join the worker threads (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"nthreads", (getter)Pool_get_nthreads, NULL, "worker threads (preads in flight at most)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qnpipe.io._preadx.Pool",
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
    PyModuleDef_HEAD_INIT, "qnpipe.io._preadx", "Batched pread on a pthread pool with the GIL released.", -1, NULL,
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
