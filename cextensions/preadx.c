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
 *
 * Pool.submit(ops, notify_fd) -> Batch: the same batch, queued now and not waited for, so an
 *   event loop can hand reads to the device without a thread of its own: when the last op is
 *   done a worker writes an 8-byte 1 to `notify_fd` (an eventfd, or a pipe's write end) and
 *   the loop, woken by it, takes `Batch.wait()`. Ops may carry a fifth item `(skip, dests)`:
 *   after a complete read the worker copies the bytes from `skip` on of the op's one buffer
 *   (a bounce buffer) into `dests` in order, off the GIL, as the reader would have done after.
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
#include <time.h>
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
    const char *bounce; /* copy bounce[skip:] into copy[] after a complete read (NULL: no copy) */
    size_t skip;
    struct iovec *copy;
    int copycnt;
} op_t;

typedef struct job {
    op_t *ops;
    size_t n;
    atomic_size_t next; /* first op not yet taken: workers claim ops with fetch_add, no lock */
    size_t users;       /* workers inside this job (under the pool mutex) */
    pthread_cond_t done_cv;
    struct job *link;
    int notify_fd;      /* submit(): written once the job is done (-1: pread_batch waits on done_cv) */
    int finished;       /* under the pool mutex: every result written */
    double t_done;      /* when it finished, on time.perf_counter's clock */
    double t_first;     /* when its first op was taken by a worker (the device's start), the same clock */
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

static double now_s(void) {
    struct timespec ts;
#ifdef __APPLE__
    clock_gettime(CLOCK_UPTIME_RAW, &ts); /* mach_absolute_time: time.perf_counter's clock there */
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void copy_home(const op_t *op) {
    const char *src = op->bounce + op->skip;
    for (int i = 0; i < op->copycnt; i++) {
        memcpy(op->copy[i].iov_base, src, op->copy[i].iov_len);
        src += op->copy[i].iov_len;
    }
}

static void *worker_main(void *arg) {
    PoolObject *p = (PoolObject *)arg;
    /* Named, so `top -H`, `ps -L` and profilers tell the readers from MLX's and Python's threads. */
#if defined(__APPLE__)
    pthread_setname_np("qnpipe-read");
#elif defined(__linux__)
    pthread_setname_np(pthread_self(), "qnpipe-read");
#endif
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stopping && p->head == NULL) pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->head == NULL) break; /* stopping and nothing queued */
        job_t *job = p->head;
        job->users++;
        /* Waking a thread costs its waker tens of µs on some machines (a VM's IPI): the submitter
         * wakes one worker and each worker that joins a job wakes the next while ops are left over. */
        size_t taken = atomic_load_explicit(&job->next, memory_order_relaxed);
        int more = taken < job->n && job->n - taken > job->users;
        pthread_mutex_unlock(&p->mu);
        if (more) pthread_cond_signal(&p->work_cv);
        /* The hot path takes no lock: claim op indices until the job runs out. */
        for (;;) {
            size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
            if (i >= job->n) break;
            if (i == 0) job->t_first = now_s(); /* read by the caller after the job's mutex-ordered end */
            op_t *op = &job->ops[i];
            op->result = do_pread(op);
            if (op->bounce != NULL && op->result >= (Py_ssize_t)op->need) copy_home(op);
        }
        pthread_mutex_lock(&p->mu);
        if (p->head == job) { /* exhausted: unlink it so the next job's ops get taken */
            p->head = job->link;
            if (p->head == NULL) p->tail = NULL;
        }
        /* Every op is claimed; each claimer finishes its op before leaving, so the last
         * user out means all results are written (the mutex orders them for the caller). */
        if (--job->users == 0) {
            job->t_done = now_s();
            if (job->notify_fd >= 0) {
                /* Before `finished`: the Batch (and the caller's fd) may go as soon as it is set. */
                uint64_t one = 1;
                ssize_t w;
                do w = write(job->notify_fd, &one, sizeof one);
                while (w < 0 && errno == EINTR);
            }
            job->finished = 1;
            pthread_cond_signal(&job->done_cv);
        }
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

/* The ops of one batch, parsed, with the buffers they hold (released by ops_free). */
typedef struct {
    op_t *ops;
    Py_ssize_t n;
    Py_buffer *views;
    Py_ssize_t nviews;
    struct iovec *iovs;
} ops_t;

static void ops_free(ops_t *o) {
    for (Py_ssize_t i = 0; i < o->nviews; i++) PyBuffer_Release(&o->views[i]);
    PyMem_Free(o->iovs);
    PyMem_Free(o->views);
    PyMem_Free(o->ops);
    memset(o, 0, sizeof *o);
}

static Py_ssize_t count_bufs(PyObject *bufs) { return PyTuple_Check(bufs) ? PyTuple_GET_SIZE(bufs) : 1; }

/* Views of `bufs` (one buffer or a tuple of them) appended at o->views / o->iovs; their total length. */
static int take_bufs(ops_t *o, Py_ssize_t i, PyObject *bufs, struct iovec **first, int *cnt, size_t *room) {
    Py_ssize_t k = count_bufs(bufs);
    *first = &o->iovs[o->nviews];
    *cnt = (int)k;
    *room = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *b = PyTuple_Check(bufs) ? PyTuple_GET_ITEM(bufs, j) : bufs;
        if (PyObject_GetBuffer(b, &o->views[o->nviews], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: buffer %zd is not a writable contiguous buffer", i, j);
            return -1;
        }
        o->iovs[o->nviews].iov_base = o->views[o->nviews].buf;
        o->iovs[o->nviews].iov_len = (size_t)o->views[o->nviews].len;
        *room += (size_t)o->views[o->nviews].len;
        o->nviews++;
    }
    return 0;
}

static int ops_parse(PyObject *seq, ops_t *o) {
    memset(o, 0, sizeof *o);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t total_bufs = 0;
    /* First pass: count the buffers (a tuple of buffers = one iovec each). */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t len = PyTuple_Check(item) ? PyTuple_GET_SIZE(item) : 0;
        if (len != 4 && len != 5) {
            PyErr_Format(PyExc_TypeError, "op %zd must be a tuple (fd, offset, need, buffers[, (skip, dests)])", i);
            return -1;
        }
        Py_ssize_t k = count_bufs(PyTuple_GET_ITEM(item, 3));
        if (k < 1 || k > IOV_MAX) {
            PyErr_Format(PyExc_ValueError, "op %zd: %zd buffers, allowed 1..%d", i, k, IOV_MAX);
            return -1;
        }
        total_bufs += k;
        if (len == 5 && PyTuple_GET_ITEM(item, 4) != Py_None) {
            PyObject *cp = PyTuple_GET_ITEM(item, 4);
            if (!PyTuple_Check(cp) || PyTuple_GET_SIZE(cp) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(cp, 1))) {
                PyErr_Format(PyExc_TypeError, "op %zd: the copy must be (skip, tuple of destination buffers)", i);
                return -1;
            }
            Py_ssize_t d = PyTuple_GET_SIZE(PyTuple_GET_ITEM(cp, 1));
            if (d > IOV_MAX) {
                PyErr_Format(PyExc_ValueError, "op %zd: %zd copy destinations, allowed 0..%d", i, d, IOV_MAX);
                return -1;
            }
            total_bufs += d;
        }
    }
    o->n = n;
    if (n == 0) return 0;
    o->ops = PyMem_Calloc((size_t)n, sizeof(op_t));
    o->views = PyMem_Calloc((size_t)total_bufs, sizeof(Py_buffer));
    o->iovs = PyMem_Calloc((size_t)total_bufs, sizeof(struct iovec));
    if (o->ops == NULL || o->views == NULL || o->iovs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int fd;
        long long offset;
        Py_ssize_t need;
        PyObject *bufs, *cp = Py_None;
        if (!PyArg_ParseTuple(item, "iLnO|O;op must be (fd, offset, need, buffers[, (skip, dests)])", &fd, &offset,
                              &need, &bufs, &cp))
            return -1;
        if (fd < 0 || offset < 0 || need < 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: bad op fd=%d offset=%lld need=%zd", i, fd, offset, need);
            return -1;
        }
        op_t *op = &o->ops[i];
        size_t room;
        if (take_bufs(o, i, bufs, &op->iov, &op->iovcnt, &room) < 0) return -1;
        if (room < (size_t)need) {
            PyErr_Format(PyExc_ValueError, "op %zd: buffers hold %zu bytes, the read needs %zd", i, room, need);
            return -1;
        }
        op->fd = fd;
        op->offset = (off_t)offset;
        op->need = (size_t)need;
        if (cp != Py_None) {
            Py_ssize_t skip = PyLong_AsSsize_t(PyTuple_GET_ITEM(cp, 0));
            if (skip < 0) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "op %zd: negative copy skip %zd", i, skip);
                return -1;
            }
            if (op->iovcnt != 1) {
                PyErr_Format(PyExc_ValueError, "op %zd: a copy needs the read to go to one (bounce) buffer", i);
                return -1;
            }
            size_t total;
            if (take_bufs(o, i, PyTuple_GET_ITEM(cp, 1), &op->copy, &op->copycnt, &total) < 0) return -1;
            if ((size_t)skip + total > (size_t)need) {
                PyErr_Format(PyExc_ValueError, "op %zd: the copy takes bytes %zd..%zu of a %zd-byte read", i, skip,
                             (size_t)skip + total, need);
                return -1;
            }
            op->bounce = (const char *)op->iov[0].iov_base;
            op->skip = (size_t)skip;
        }
    }
    return 0;
}

static PyObject *results_list(const ops_t *o) {
    PyObject *out = PyList_New(o->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < o->n; i++) {
        PyObject *r = PyLong_FromSsize_t(o->ops[i].result);
        if (r == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, r);
    }
    return out;
}

/* Queue `job` (under the pool mutex); 0 when the pool was closed meanwhile (no worker would take it).
 * The caller wakes one worker after unlocking (the workers wake each other: worker_main). */
static int enqueue(PoolObject *p, job_t *job) {
    if (p->stopping) return 0;
    if (p->tail) p->tail->link = job;
    else p->head = job;
    p->tail = job;
    return 1;
}

static PyObject *Pool_pread_batch(PoolObject *self, PyObject *arg) {
    if (!self->started || self->stopping) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "pread_batch expects a sequence of (fd, offset, need, buffers)");
    if (seq == NULL) return NULL;
    ops_t o;
    PyObject *out = NULL;
    if (ops_parse(seq, &o) < 0) goto done;
    if (o.n == 0) {
        out = PyList_New(0);
        goto done;
    }
    job_t job;
    memset(&job, 0, sizeof(job));
    job.ops = o.ops;
    job.n = (size_t)o.n;
    job.notify_fd = -1;
    atomic_init(&job.next, 0);
    int queued;
    Py_BEGIN_ALLOW_THREADS
    pthread_cond_init(&job.done_cv, NULL);
    pthread_mutex_lock(&self->mu);
    queued = enqueue(self, &job);
    pthread_mutex_unlock(&self->mu);
    if (queued) {
        pthread_cond_signal(&self->work_cv);
        pthread_mutex_lock(&self->mu);
        while (!job.finished) pthread_cond_wait(&job.done_cv, &self->mu);
        pthread_mutex_unlock(&self->mu);
    }
    pthread_cond_destroy(&job.done_cv);
    Py_END_ALLOW_THREADS
    if (!queued) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        goto done;
    }
    out = results_list(&o);
done:
    ops_free(&o);
    Py_DECREF(seq);
    return out;
}

/* ------------------------------------------------------------------ Batch: a submitted job */

typedef struct {
    PyObject_HEAD
    PoolObject *pool; /* strong: its workers write into this job */
    job_t job;
    ops_t ops;
    int queued; /* on the pool's queue: must finish before the buffers go */
    PyObject *results;
} BatchObject;

static PyTypeObject BatchType;

/* Block (GIL released) until the workers are done with the batch; then let go of its buffers. */
static void batch_settle(BatchObject *b) {
    if (!b->queued) return;
    pthread_mutex_lock(&b->pool->mu);
    int finished = b->job.finished;
    pthread_mutex_unlock(&b->pool->mu);
    if (!finished) { /* the usual case is done already (its notify_fd was written): no GIL hand-over */
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&b->pool->mu);
        while (!b->job.finished) pthread_cond_wait(&b->job.done_cv, &b->pool->mu);
        pthread_mutex_unlock(&b->pool->mu);
        Py_END_ALLOW_THREADS
    }
    b->queued = 0;
}

static void Batch_dealloc(BatchObject *b) {
    batch_settle(b);
    pthread_cond_destroy(&b->job.done_cv);
    ops_free(&b->ops);
    Py_CLEAR(b->results);
    Py_CLEAR(b->pool);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *Batch_wait(BatchObject *b, PyObject *Py_UNUSED(ignored)) {
    if (b->results == NULL) {
        batch_settle(b);
        b->results = results_list(&b->ops);
        if (b->results == NULL) return NULL;
        ops_free(&b->ops);
    }
    Py_INCREF(b->results);
    return b->results;
}

static PyObject *Batch_get_done(BatchObject *b, void *closure) {
    (void)closure;
    pthread_mutex_lock(&b->pool->mu); /* the GIL kept, as in submit */
    int done = b->job.finished;
    pthread_mutex_unlock(&b->pool->mu);
    return PyBool_FromLong(done);
}

/* t_done and t_started: `closure` names the field ("t_done" or "t_started"), known once the batch is waited for. */
static PyObject *Batch_get_time(BatchObject *b, void *closure) {
    const char *name = (const char *)closure;
    if (b->results == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s is known after wait()", name);
        return NULL;
    }
    return PyFloat_FromDouble(strcmp(name, "t_done") == 0 ? b->job.t_done : b->job.t_first);
}

static PyMethodDef Batch_methods[] = {
    {"wait", (PyCFunction)Batch_wait, METH_NOARGS,
     "wait() -> list[int]: the result per op (bytes read or -errno); blocks (GIL released) until the batch is "
     "done, which is at once after its notify_fd was written."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Batch_getset[] = {
    {"done", (getter)Batch_get_done, NULL, "every op finished", NULL},
    {"t_done", (getter)Batch_get_time, NULL, "when the last op finished, on time.perf_counter's clock", "t_done"},
    {"t_started", (getter)Batch_get_time, NULL,
     "when a worker took the first op (the reads' start), on time.perf_counter's clock", "t_started"},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qnpipe.io._preadx.Batch",
    .tp_basicsize = sizeof(BatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch queued by Pool.submit; wait() for its results once its notify_fd was written.",
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_methods = Batch_methods,
    .tp_getset = Batch_getset,
};

static PyObject *Pool_submit(PoolObject *self, PyObject *args) {
    PyObject *arg;
    int fd;
    if (!PyArg_ParseTuple(args, "Oi:submit", &arg, &fd)) return NULL;
    if (!self->started || self->stopping) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        return NULL;
    }
    if (fd < 0) {
        PyErr_Format(PyExc_ValueError, "notify_fd must be an open file descriptor, got %d", fd);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "submit expects a sequence of (fd, offset, need, buffers[, copy])");
    if (seq == NULL) return NULL;
    BatchObject *b = PyObject_New(BatchObject, &BatchType);
    if (b == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    b->pool = self;
    Py_INCREF(self);
    b->queued = 0;
    b->results = NULL;
    memset(&b->job, 0, sizeof b->job);
    pthread_cond_init(&b->job.done_cv, NULL);
    int rc = ops_parse(seq, &b->ops);
    Py_DECREF(seq);
    if (rc < 0) {
        Py_DECREF(b);
        return NULL;
    }
    b->job.ops = b->ops.ops;
    b->job.n = (size_t)b->ops.n;
    b->job.notify_fd = fd;
    atomic_init(&b->job.next, 0);
    if (b->job.n == 0) { /* nothing to read: done now, and the loop is still told */
        uint64_t one = 1;
        b->job.t_done = now_s();
        b->job.t_first = b->job.t_done;
        b->job.finished = 1;
        if (write(fd, &one, sizeof one) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(b);
            return NULL;
        }
        return (PyObject *)b;
    }
    /* The GIL is kept: the workers never take it, so the mutex is held only for a moment, and
     * releasing it here would let another Python thread take it from the event loop's. */
    pthread_mutex_lock(&self->mu);
    int queued = enqueue(self, &b->job);
    pthread_mutex_unlock(&self->mu);
    if (queued) pthread_cond_signal(&self->work_cv);
    if (!queued) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        Py_DECREF(b);
        return NULL;
    }
    b->queued = 1;
    return (PyObject *)b;
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
    {"submit", (PyCFunction)Pool_submit, METH_VARARGS,
     "submit(ops, notify_fd) -> Batch: queue the batch (ops as pread_batch's, each with an optional fifth item "
     "(skip, dests): copy the read's bytes from skip on into dests) and return at once; when every op is done a "
     "worker writes an 8-byte 1 to notify_fd (an eventfd or a pipe)."},
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
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&BatchType) < 0) return NULL;
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
