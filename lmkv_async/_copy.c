/*
 * lmkv_async._copy -- GIL-free copy kernel for KV-cache layouts.
 *
 * Plain CPython extension: no torch or numpy headers.  Python hands over raw
 * addresses (tensor.data_ptr()) and byte strides of tensors it has already
 * validated; everything that comes from outside the process (chunk addresses
 * taken from the network, block ids) is copied into private arrays and checked
 * here, with the GIL held, before a single byte is written.  The copy itself
 * runs with the GIL released, optionally split over a small persistent pthread
 * pool, using SSE2 streaming stores for large payloads.
 *
 * Layout vocabulary (all strides in bytes):
 *   dense   [P, L, T, D]          strides sP, sL, sT, 1
 *   chunk k [P, L, n_k, D]        C-order; n_k = min(C, T - k*C)
 *   layer l [NB, P, NH, BS, HS]   strides s_nb, s_kv, s_h, s_bs, 1 (per layer)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define LMKV_HAVE_NT 1
#else
#define LMKV_HAVE_NT 0
#endif

#define MAX_THREADS 64

/* Error classes, resolved from lmkv_async.errors at import. */
static PyObject *BoundsError;  /* CopyBoundsError */
static PyObject *LayoutError;  /* LayoutMismatchError */
static PyObject *InputError;    /* InvalidInputError */

/* Tunables (bytes).  Payloads below PAR_THRESHOLD run on the calling thread
 * only; below NT_THRESHOLD they use ordinary stores so that a small result
 * stays in cache for whoever reads it next. */
static int64_t g_par_threshold = 4 << 20;
static int64_t g_nt_threshold = 1 << 20;

/* ------------------------------------------------------------------------ */
/* copy primitives                                                          */
/* ------------------------------------------------------------------------ */

/* Streaming copy: destination-aligned 64-byte body with non-temporal stores,
 * memcpy for the misaligned head and the short tail (a misaligned
 * _mm_stream_si128 faults).  Loads are unaligned-tolerant. */
static inline void copy_nt(char *dst, const char *src, size_t n)
{
#if LMKV_HAVE_NT
    if (n >= 64) {
        size_t head = (size_t)(-(uintptr_t)dst) & 15u;
        if (head) {
            memcpy(dst, src, head);
            dst += head;
            src += head;
            n -= head;
        }
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
            _mm_stream_si128((__m128i *)(void *)dst, a);
            _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(void *)(dst + 48), d);
            dst += 64;
            src += 64;
            n -= 64;
        }
        while (n >= 16) {
            _mm_stream_si128((__m128i *)(void *)dst,
                             _mm_loadu_si128((const __m128i *)(const void *)src));
            dst += 16;
            src += 16;
            n -= 16;
        }
    }
#endif
    if (n)
        memcpy(dst, src, n);
}

static inline void copy_run(char *dst, const char *src, size_t n, int nt)
{
    if (nt)
        copy_nt(dst, src, n);
    else
        memcpy(dst, src, n);
}

static inline void store_fence(int nt)
{
#if LMKV_HAVE_NT
    if (nt)
        _mm_sfence(); /* streaming stores are weakly ordered: publish before signalling */
#else
    (void)nt;
#endif
}

/* rows x rowbytes, collapsed to one run when both sides are packed. */
static inline void copy_2d(char *dst, int64_t dstride, const char *src, int64_t sstride,
                           int64_t rows, int64_t rowbytes, int nt)
{
    if (rows <= 0 || rowbytes <= 0)
        return;
    if (dstride == rowbytes && sstride == rowbytes) {
        copy_run(dst, src, (size_t)(rows * rowbytes), nt);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        copy_run(dst + r * dstride, src + r * sstride, (size_t)rowbytes, nt);
}

/* ------------------------------------------------------------------------ */
/* jobs                                                                     */
/* ------------------------------------------------------------------------ */

enum { KIND_CHUNKS_DENSE = 0, KIND_PAGED = 1, KIND_STREAM = 2 };

/* A segment is one contiguous token range of the dense side: the whole dense
 * tensor, or one chunk object. */
typedef struct {
    char *base;
    int64_t sP, sL, sT;  /* byte strides of this segment's [P, L, n, D] */
    int64_t tok0, ntok;  /* global first token, token count */
    int64_t item0;       /* first work item of this segment */
    int64_t nblk;        /* paged jobs: blocks covered (>= 1) */
} seg_t;

/* Work is a flat range of items claimed in grains by every participating
 * thread: chunks<->dense items are (segment, kv, layer) planes, paged items
 * are (segment, kv, layer, block), stream items are 256 KiB pieces. */
typedef struct {
    int kind;
    int to_dense; /* 1: chunks->dense / paged->dense side ; 0: the reverse */
    int nt;       /* streaming stores */
    int64_t P, L, NH, BS, hs, row;
    char *dense;            /* KIND_CHUNKS_DENSE: dense base and strides */
    int64_t dsP, dsL, dsT;
    const int64_t *lay;     /* KIND_PAGED: L x {ptr, s_nb, s_kv, s_h, s_bs} */
    const int64_t *bt;      /* KIND_PAGED: checked private copy of the block table */
    seg_t *segs;
    int64_t nsegs;
    char *sdst;             /* KIND_STREAM */
    const char *ssrc;
    int64_t sbytes;
    int64_t nitems, grain;
    atomic_llong next;
} job_t;

#define STREAM_PIECE ((int64_t)1 << 18)
#define GRAIN_BYTES ((int64_t)1 << 20)

static int64_t find_seg(const job_t *j, int64_t item)
{
    int64_t lo = 0, hi = j->nsegs - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (j->segs[mid].item0 <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static void run_chunks_dense(const job_t *j, int64_t i0, int64_t i1)
{
    int64_t s = find_seg(j, i0);
    for (int64_t i = i0; i < i1; i++) {
        while (s + 1 < j->nsegs && j->segs[s + 1].item0 <= i)
            s++;
        const seg_t *g = &j->segs[s];
        int64_t local = i - g->item0;
        int64_t kv = local / j->L, l = local % j->L;
        char *d = j->dense + kv * j->dsP + l * j->dsL + g->tok0 * j->dsT;
        char *c = g->base + kv * g->sP + l * g->sL;
        if (j->to_dense)
            copy_2d(d, j->dsT, c, g->sT, g->ntok, j->row, j->nt);
        else
            copy_2d(c, g->sT, d, j->dsT, g->ntok, j->row, j->nt);
    }
}

typedef struct {
    char *pg;      /* paged block base for (kv, layer) */
    char *dn;      /* dense side: first token of the block */
    int64_t s_h, s_bs, sT, n;
} paged_item;

static inline void paged_decode(const job_t *j, int64_t i, int64_t s, paged_item *it)
{
    const seg_t *g = &j->segs[s];
    int64_t local = i - g->item0;
    int64_t b = local % g->nblk;
    int64_t tmp = local / g->nblk;
    int64_t l = tmp % j->L, kv = tmp / j->L;
    int64_t t0 = b * j->BS;
    const int64_t *ld = j->lay + 5 * l;
    int64_t blk = j->bt[(g->tok0 + t0) / j->BS];
    it->pg = (char *)(intptr_t)ld[0] + blk * ld[1] + kv * ld[2];
    it->s_h = ld[3];
    it->s_bs = ld[4];
    it->dn = g->base + kv * g->sP + l * g->sL + t0 * g->sT;
    it->sT = g->sT;
    it->n = g->ntok - t0 < j->BS ? g->ntok - t0 : j->BS;
}

static void run_paged(const job_t *j, int64_t i0, int64_t i1)
{
    const int64_t NH = j->NH, hs = j->hs;
    const int nt = j->nt;
    int64_t s = find_seg(j, i0);
    paged_item cur, nxt = {0};
    paged_decode(j, i0, s, &cur);
    for (int64_t i = i0; i < i1; i++) {
        /* decode the next item now: a pack prefetches its (randomly placed)
         * block while copying this one, since the hardware prefetcher stops at
         * every block (and 4 KiB page) boundary */
        int have_next = i + 1 < i1;
        if (have_next) {
            while (s + 1 < j->nsegs && j->segs[s + 1].item0 <= i + 1)
                s++;
            paged_decode(j, i + 1, s, &nxt);
        }
        const int64_t s_h = cur.s_h, s_bs = cur.s_bs, sT = cur.sT, n = cur.n;
        char *pg = cur.pg, *dn = cur.dn;
        if (NH == 1) {
            /* one head: an [n, HS] strided plane on both sides */
            if (j->to_dense)
                copy_2d(dn, sT, pg, s_bs, n, hs, nt);
            else
                copy_2d(pg, s_bs, dn, sT, n, hs, nt);
        } else if (j->to_dense) {
            /* read the source block in address order (heads outer); the
             * destination takes HS-sized streaming pieces */
            const char *pf = have_next ? nxt.pg : NULL;
            for (int64_t h = 0; h < NH; h++) {
                char *dh = dn + h * hs;
                const char *sh = pg + h * s_h;
                for (int64_t t = 0; t < n; t++) {
                    if (pf) {
                        const char *p = pf + h * nxt.s_h + t * nxt.s_bs;
                        for (int64_t o = 0; o < hs; o += 64)
                            __builtin_prefetch(p + o, 0, 0);
                    }
                    copy_run(dh + t * sT, sh + t * s_bs, (size_t)hs, nt);
                }
            }
        } else {
            /* read the dense rows in address order (tokens outer) */
            for (int64_t t = 0; t < n; t++) {
                const char *srow = dn + t * sT;
                char *drow = pg + t * s_bs;
                for (int64_t h = 0; h < NH; h++)
                    copy_run(drow + h * s_h, srow + h * hs, (size_t)hs, nt);
            }
        }
        cur = nxt;
    }
}

static void run_stream(const job_t *j, int64_t i0, int64_t i1)
{
    for (int64_t i = i0; i < i1; i++) {
        int64_t off = i * STREAM_PIECE;
        int64_t n = j->sbytes - off;
        if (n > STREAM_PIECE)
            n = STREAM_PIECE;
        copy_run(j->sdst + off, j->ssrc + off, (size_t)n, j->nt);
    }
}

/* Claim grains until the job is exhausted (caller and workers alike). */
static void job_work(job_t *j)
{
    for (;;) {
        int64_t i0 = (int64_t)atomic_fetch_add(&j->next, j->grain);
        if (i0 >= j->nitems)
            break;
        int64_t i1 = i0 + j->grain;
        if (i1 > j->nitems)
            i1 = j->nitems;
        switch (j->kind) {
        case KIND_CHUNKS_DENSE:
            run_chunks_dense(j, i0, i1);
            break;
        case KIND_PAGED:
            run_paged(j, i0, i1);
            break;
        default:
            run_stream(j, i0, i1);
            break;
        }
    }
    store_fence(j->nt);
}

/* ------------------------------------------------------------------------ */
/* persistent worker pool                                                   */
/* ------------------------------------------------------------------------ */

/* One parallel job at a time: a submitter takes `busy` with trylock; if another
 * thread already owns the pool, the job simply runs on the calling thread.
 * Workers join a job only while it is open; the submitter closes it once its
 * own share is done and then waits only for workers that actually joined, so
 * a worker that the OS has not scheduled yet never delays the caller. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_mutex_t busy;
    int nworkers;
    int want;      /* total threads incl. caller; 0 = not decided yet */
    pid_t pid;     /* process that owns the workers */
    job_t *job;    /* the open job, or NULL */
    int max_workers;
    uint64_t gen;
    int joined;    /* workers currently inside `job` */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, NULL, 0, 0, 0};

typedef struct {
    int idx;
    uint64_t gen;
} worker_arg;

static worker_arg worker_args[MAX_THREADS];

static void *worker_main(void *p)
{
    worker_arg *a = (worker_arg *)p;
    int idx = a->idx;
    pthread_mutex_lock(&pool.mu);
    uint64_t seen = a->gen;
    for (;;) {
        while (pool.gen == seen)
            pthread_cond_wait(&pool.cv_work, &pool.mu);
        seen = pool.gen;
        job_t *j = pool.job;
        if (!j || idx >= pool.max_workers)
            continue; /* closed already, or not wanted for this job */
        pool.joined++;
        pthread_mutex_unlock(&pool.mu);
        job_work(j);
        pthread_mutex_lock(&pool.mu);
        if (--pool.joined == 0)
            pthread_cond_signal(&pool.cv_done);
    }
    return NULL;
}

/* In a forked child the workers do not exist any more and the locks may be
 * held by threads that vanished: start from scratch. */
static void atfork_child(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv_work, NULL);
    pthread_cond_init(&pool.cv_done, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pool.nworkers = 0;
    pool.job = NULL;
    pool.joined = 0;
    pool.pid = getpid();
}

static int default_threads(void)
{
    const char *env = getenv("LMKV_COPY_THREADS");
    if (env && *env) {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (end && *end == '\0' && v >= 1)
            return v > MAX_THREADS ? MAX_THREADS : (int)v;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int c = CPU_COUNT(&set);
        if (c > 0 && c < n)
            n = c;
    }
#endif
    if (n < 1)
        n = 1;
    /* a copy saturates memory bandwidth long before it runs out of cores */
    if (n > 8)
        n = 8;
    return (int)n;
}

static int pool_threads(void)
{
    if (pool.want == 0)
        pool.want = default_threads();
    return pool.want;
}

/* Called with `busy` held.  Spawns missing workers; returns how many exist. */
static int pool_ensure(int want_workers)
{
    if (pool.pid != getpid()) {
        /* forked without the atfork handler having run: old workers are gone */
        pool.nworkers = 0;
        pool.pid = getpid();
    }
    if (want_workers > MAX_THREADS - 1)
        want_workers = MAX_THREADS - 1;
    if (pool.nworkers >= want_workers)
        return pool.nworkers;
    sigset_t all, old;
    sigfillset(&all);
    /* workers inherit the mask: they must never take process signals */
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_mutex_lock(&pool.mu);
    while (pool.nworkers < want_workers) {
        pthread_t th;
        pthread_attr_t attr;
        worker_args[pool.nworkers].idx = pool.nworkers;
        worker_args[pool.nworkers].gen = pool.gen; /* so it cannot miss the next job */
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int rc = pthread_create(&th, &attr, worker_main, &worker_args[pool.nworkers]);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool.nworkers++;
    }
    pthread_mutex_unlock(&pool.mu);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.nworkers;
}

static void run_serial(job_t *j)
{
    j->grain = j->nitems;
    job_work(j);
}

/* Run a job; the GIL must be released by the caller. */
static void job_execute(job_t *j, int64_t payload)
{
    int threads = pool_threads();
    atomic_store(&j->next, 0);
    if (j->nitems <= 0)
        return;
    if (threads <= 1 || payload < g_par_threshold || j->nitems < 2 ||
        pthread_mutex_trylock(&pool.busy) != 0) {
        run_serial(j);
        return;
    }
    int workers = pool_ensure(threads - 1);
    if (workers <= 0) {
        pthread_mutex_unlock(&pool.busy);
        run_serial(j);
        return;
    }
    /* ~1 MiB grains: small enough that a preempted thread leaves little tail */
    int64_t per_item = payload / j->nitems;
    int64_t g = per_item > 0 ? GRAIN_BYTES / per_item : j->nitems;
    int64_t cap = j->nitems / (2 * (int64_t)threads);
    if (g > cap)
        g = cap;
    j->grain = g < 1 ? 1 : g;
    pthread_mutex_lock(&pool.mu);
    pool.job = j;
    pool.max_workers = threads - 1;
    pool.gen++;
    pthread_cond_broadcast(&pool.cv_work);
    pthread_mutex_unlock(&pool.mu);
    job_work(j);
    pthread_mutex_lock(&pool.mu);
    pool.job = NULL; /* closed: late wakers skip it */
    while (pool.joined > 0)
        pthread_cond_wait(&pool.cv_done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

static void run_job_nogil(job_t *j, int64_t payload)
{
    j->nt = LMKV_HAVE_NT && payload >= g_nt_threshold;
    Py_BEGIN_ALLOW_THREADS
    job_execute(j, payload);
    Py_END_ALLOW_THREADS
}

/* ------------------------------------------------------------------------ */
/* argument helpers (GIL held)                                              */
/* ------------------------------------------------------------------------ */

static int arg_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

/* An address from the network: any value outside [0, 2**64) is a bounds error. */
static int arg_addr(PyObject *o, uint64_t *out)
{
    PyObject *idx = PyNumber_Index(o);
    if (!idx)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(BoundsError, "chunk address is not a valid 64-bit address");
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* A (int, int) pair as a tuple we own a reference to: converting its items may
 * run __index__, which must not be able to free them under us. */
static PyObject *pair_from(PyObject *item, const char *what)
{
    if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2) {
        Py_INCREF(item);
        return item;
    }
    if (PyList_Check(item) && PyList_GET_SIZE(item) == 2)
        return PyList_AsTuple(item);
    PyErr_Format(InputError, "%s must be (int, int) pairs", what);
    return NULL;
}

typedef struct {
    int mode;            /* 0 none, 1 single region, 2 one region per chunk */
    uint64_t base, size; /* mode 1 */
    PyObject *list;      /* mode 2: fast sequence of (base, size) */
} region_spec;

/* Parse chunk placements into segments; check every range before any copy.
 * T: tokens of the dense side, C: chunk tokens, row: D * itemsize. */
static seg_t *parse_chunks(PyObject *chunks, const region_spec *rg, int64_t P, int64_t L,
                           int64_t T, int64_t C, int64_t row, int64_t *nseg_out)
{
    /* tuples, not the caller's lists: a snapshot that __index__ cannot mutate */
    PyObject *fast = PySequence_Tuple(chunks);
    if (!fast)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    PyObject *rfast = NULL;
    seg_t *segs = NULL;
    if (rg->mode == 2) {
        rfast = PySequence_Tuple(rg->list);
        if (!rfast)
            goto fail;
        if (PyTuple_GET_SIZE(rfast) != n) {
            PyErr_Format(InputError, "got %zd regions for %zd chunks", PyTuple_GET_SIZE(rfast),
                         n);
            goto fail;
        }
    }
    segs = (seg_t *)PyMem_Malloc(sizeof(seg_t) * (size_t)(n > 0 ? n : 1));
    if (!segs) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k;
        uint64_t addr;
        PyObject *pair = pair_from(PyTuple_GET_ITEM(fast, i), "chunks");
        if (!pair)
            goto fail;
        int rc = arg_i64(PyTuple_GET_ITEM(pair, 0), &k);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(BoundsError, "chunk #%zd: index out of range", i);
        }
        if (rc == 0)
            rc = arg_addr(PyTuple_GET_ITEM(pair, 1), &addr);
        Py_DECREF(pair);
        if (rc < 0)
            goto fail;
        if (k < 0 || k > T / C || k * C >= T) {
            PyErr_Format(BoundsError, "chunk #%zd: index %lld outside the %lld-token range", i,
                         (long long)k, (long long)T);
            goto fail;
        }
        int64_t ntok = T - k * C < C ? T - k * C : C;
        int64_t bytes;
        if (__builtin_mul_overflow(P * L, ntok, &bytes) ||
            __builtin_mul_overflow(bytes, row, &bytes)) {
            PyErr_Format(BoundsError, "chunk #%zd: size overflows", i);
            goto fail;
        }
        uint64_t end;
        if (__builtin_add_overflow(addr, (uint64_t)bytes, &end) || addr == 0) {
            PyErr_Format(BoundsError, "chunk #%zd: address %llu is not valid", i,
                         (unsigned long long)addr);
            goto fail;
        }
        uint64_t rbase = 0, rsize = 0;
        int check = 0;
        if (rg->mode == 1) {
            rbase = rg->base;
            rsize = rg->size;
            check = 1;
        } else if (rg->mode == 2) {
            PyObject *rp = pair_from(PyTuple_GET_ITEM(rfast, i), "regions");
            if (!rp)
                goto fail;
            int rrc = arg_addr(PyTuple_GET_ITEM(rp, 0), &rbase);
            if (rrc == 0)
                rrc = arg_addr(PyTuple_GET_ITEM(rp, 1), &rsize);
            Py_DECREF(rp);
            if (rrc < 0) {
                if (PyErr_ExceptionMatches(BoundsError)) {
                    PyErr_Clear();
                    PyErr_Format(InputError, "region #%zd is not (address, size)", i);
                }
                goto fail;
            }
            check = 1;
        }
        if (check) {
            uint64_t rend;
            if (__builtin_add_overflow(rbase, rsize, &rend)) {
                PyErr_Format(InputError, "region #%zd wraps around the address space", i);
                goto fail;
            }
            if (addr < rbase || end > rend) {
                char msg[160]; /* PyErr_Format has no %llx */
                snprintf(msg, sizeof(msg),
                         "chunk #%zd: [%#llx, %#llx) is outside its region [%#llx, %#llx)", i,
                         (unsigned long long)addr, (unsigned long long)end,
                         (unsigned long long)rbase, (unsigned long long)rend);
                PyErr_SetString(BoundsError, msg);
                goto fail;
            }
        }
        seg_t *g = &segs[i];
        g->base = (char *)(uintptr_t)addr;
        g->sT = row;
        g->sL = ntok * row;
        g->sP = L * ntok * row;
        g->tok0 = k * C;
        g->ntok = ntok;
        g->item0 = 0;
        g->nblk = 0;
    }
    Py_XDECREF(rfast);
    Py_DECREF(fast);
    *nseg_out = n;
    return segs;
fail:
    PyMem_Free(segs);
    Py_XDECREF(rfast);
    Py_DECREF(fast);
    return NULL;
}

static int parse_region(PyObject *const *args, region_spec *rg)
{
    int64_t mode;
    if (arg_i64(args[0], &mode) < 0)
        return -1;
    rg->mode = (int)mode;
    rg->list = NULL;
    rg->base = rg->size = 0;
    if (mode == 1) {
        if (arg_addr(args[1], &rg->base) < 0 || arg_addr(args[2], &rg->size) < 0) {
            if (PyErr_ExceptionMatches(BoundsError)) {
                PyErr_Clear();
                PyErr_SetString(InputError, "region must be (address, size) within 64 bits");
            }
            return -1;
        }
        uint64_t end;
        if (__builtin_add_overflow(rg->base, rg->size, &end)) {
            PyErr_SetString(InputError, "region wraps around the address space");
            return -1;
        }
    } else if (mode == 2) {
        rg->list = args[3];
    } else if (mode != 0) {
        PyErr_SetString(PyExc_ValueError, "bad region mode");
        return -1;
    }
    return 0;
}

#define NARGS(n)                                                                     \
    do {                                                                             \
        if (nargs != (n)) {                                                          \
            PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", (n), nargs); \
            return NULL;                                                             \
        }                                                                            \
    } while (0)

/* chunks_dense(to_dense, dense_ptr, P, L, T, row, sP, sL, sT, C, chunks,
 *              region_mode, region_base, region_size, regions) */
static PyObject *py_chunks_dense(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    NARGS(15);
    int64_t v[10];
    for (int i = 0; i < 10; i++)
        if (arg_i64(args[i], &v[i]) < 0)
            return NULL;
    int64_t to_dense = v[0], P = v[2], L = v[3], T = v[4], row = v[5], C = v[9];
    if (P < 0 || L < 0 || T < 0 || row <= 0 || C <= 0 || v[6] < 0 || v[7] < 0 || v[8] < 0) {
        PyErr_SetString(PyExc_ValueError, "bad geometry");
        return NULL;
    }
    region_spec rg;
    if (parse_region(args + 11, &rg) < 0)
        return NULL;
    int64_t nseg = 0;
    seg_t *segs = parse_chunks(args[10], &rg, P, L, T, C, row, &nseg);
    if (!segs)
        return NULL;
    job_t j;
    memset(&j, 0, sizeof(j));
    j.kind = KIND_CHUNKS_DENSE;
    j.to_dense = to_dense != 0;
    j.P = P;
    j.L = L;
    j.row = row;
    j.dense = (char *)(intptr_t)v[1];
    j.dsP = v[6];
    j.dsL = v[7];
    j.dsT = v[8];
    j.segs = segs;
    j.nsegs = nseg;
    int64_t items = 0, payload = 0;
    for (int64_t i = 0; i < nseg; i++) {
        segs[i].item0 = items;
        items += P * L;
        payload += P * L * segs[i].ntok * row;
    }
    j.nitems = items;
    run_job_nogil(&j, payload);
    PyMem_Free(segs);
    Py_RETURN_NONE;
}

/* Copy the block table into a private int64 array, checking [0, NB). */
static int64_t *parse_block_table(PyObject *obj, int64_t ptr, int64_t len, int64_t need,
                                  int64_t NB)
{
    int64_t *bt = (int64_t *)PyMem_Malloc(sizeof(int64_t) * (size_t)(need > 0 ? need : 1));
    if (!bt) {
        PyErr_NoMemory();
        return NULL;
    }
    if (obj != Py_None) {
        PyObject *fast = PySequence_Tuple(obj);
        if (!fast)
            goto fail;
        if (PyTuple_GET_SIZE(fast) < need) {
            PyErr_Format(LayoutError, "block table has %zd entries, %lld needed",
                         PyTuple_GET_SIZE(fast), (long long)need);
            Py_DECREF(fast);
            goto fail;
        }
        for (int64_t i = 0; i < need; i++) {
            if (arg_i64(PyTuple_GET_ITEM(fast, i), &bt[i]) < 0) {
                if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    PyErr_Clear();
                    PyErr_Format(BoundsError, "block id #%lld out of range", (long long)i);
                }
                Py_DECREF(fast);
                goto fail;
            }
        }
        Py_DECREF(fast);
    } else {
        if (len < need) {
            PyErr_Format(LayoutError, "block table has %lld entries, %lld needed",
                         (long long)len, (long long)need);
            goto fail;
        }
        if (need > 0)
            memcpy(bt, (const void *)(intptr_t)ptr, sizeof(int64_t) * (size_t)need);
    }
    for (int64_t i = 0; i < need; i++) {
        if (bt[i] < 0 || bt[i] >= NB) {
            PyErr_Format(BoundsError, "block id %lld at position %lld is outside [0, %lld)",
                         (long long)bt[i], (long long)i, (long long)NB);
            goto fail;
        }
    }
    return bt;
fail:
    PyMem_Free(bt);
    return NULL;
}

/* paged(to_dense, P, L, T, NH, hs, NB, BS, layers, bt_obj, bt_ptr, bt_len,
 *       dense_ptr, sP, sL, sT, C, chunks, region_mode, region_base, region_size,
 *       regions)
 * chunks is None: the dense side is the tensor at dense_ptr; else chunk objects. */
static PyObject *py_paged(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    NARGS(22);
    int64_t v[8];
    for (int i = 0; i < 8; i++)
        if (arg_i64(args[i], &v[i]) < 0)
            return NULL;
    int64_t to_dense = v[0], P = v[1], L = v[2], T = v[3], NH = v[4], hs = v[5], NB = v[6],
            BS = v[7];
    int64_t bt_ptr, bt_len, dptr, sP, sL, sT, C;
    if (arg_i64(args[10], &bt_ptr) < 0 || arg_i64(args[11], &bt_len) < 0 ||
        arg_i64(args[12], &dptr) < 0 || arg_i64(args[13], &sP) < 0 ||
        arg_i64(args[14], &sL) < 0 || arg_i64(args[15], &sT) < 0 || arg_i64(args[16], &C) < 0)
        return NULL;
    if (P < 0 || L < 0 || T < 0 || NH <= 0 || hs <= 0 || NB < 0 || BS <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad geometry");
        return NULL;
    }
    PyObject *chunks = args[17];
    if (chunks != Py_None && (C <= 0 || C % BS != 0)) {
        PyErr_SetString(LayoutError, "chunk_tokens must be a positive multiple of the block size");
        return NULL;
    }
    Py_buffer lay;
    if (PyObject_GetBuffer(args[8], &lay, PyBUF_SIMPLE) < 0)
        return NULL;
    if (lay.len != (Py_ssize_t)(sizeof(int64_t) * 5 * (size_t)L)) {
        PyBuffer_Release(&lay);
        PyErr_SetString(PyExc_ValueError, "layer descriptor has the wrong size");
        return NULL;
    }
    region_spec rg;
    seg_t *segs = NULL;
    int64_t nseg = 0, *bt = NULL;
    if (parse_region(args + 18, &rg) < 0)
        goto fail;
    int64_t need = (T + BS - 1) / BS;
    int64_t row = NH * hs;
    if (chunks == Py_None) {
        segs = (seg_t *)PyMem_Malloc(sizeof(seg_t));
        if (!segs) {
            PyErr_NoMemory();
            goto fail;
        }
        segs[0].base = (char *)(intptr_t)dptr;
        segs[0].sP = sP;
        segs[0].sL = sL;
        segs[0].sT = sT;
        segs[0].tok0 = 0;
        segs[0].ntok = T;
        nseg = 1;
    } else {
        segs = parse_chunks(chunks, &rg, P, L, T, C, row, &nseg);
        if (!segs)
            goto fail;
    }
    bt = parse_block_table(args[9], bt_ptr, bt_len, need, NB);
    if (!bt)
        goto fail;
    job_t j;
    memset(&j, 0, sizeof(j));
    j.kind = KIND_PAGED;
    j.to_dense = to_dense != 0;
    j.P = P;
    j.L = L;
    j.NH = NH;
    j.BS = BS;
    j.hs = hs;
    j.row = row;
    j.lay = (const int64_t *)lay.buf;
    j.bt = bt;
    j.segs = segs;
    j.nsegs = nseg;
    int64_t items = 0, payload = 0;
    for (int64_t i = 0; i < nseg; i++) {
        segs[i].item0 = items;
        segs[i].nblk = (segs[i].ntok + BS - 1) / BS;
        if (segs[i].nblk == 0)
            segs[i].nblk = 1; /* avoid div by zero; contributes no items */
        items += segs[i].ntok > 0 ? P * L * segs[i].nblk : 0;
        payload += P * L * segs[i].ntok * row;
    }
    j.nitems = items;
    run_job_nogil(&j, payload);
    PyMem_Free(bt);
    PyMem_Free(segs);
    PyBuffer_Release(&lay);
    Py_RETURN_NONE;
fail:
    PyMem_Free(bt);
    PyMem_Free(segs);
    PyBuffer_Release(&lay);
    return NULL;
}

/* stream_copy(dst_ptr, src_ptr, nbytes): always streaming, split over the pool. */
static PyObject *py_stream_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    NARGS(3);
    int64_t d, s, n;
    if (arg_i64(args[0], &d) < 0 || arg_i64(args[1], &s) < 0 || arg_i64(args[2], &n) < 0)
        return NULL;
    if (n <= 0)
        Py_RETURN_NONE;
    job_t j;
    memset(&j, 0, sizeof(j));
    j.kind = KIND_STREAM;
    j.sdst = (char *)(intptr_t)d;
    j.ssrc = (const char *)(intptr_t)s;
    j.sbytes = n;
    j.nitems = (n + STREAM_PIECE - 1) / STREAM_PIECE;
    j.nt = LMKV_HAVE_NT;
    Py_BEGIN_ALLOW_THREADS
    job_execute(&j, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_num_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(pool_threads());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg)
{
    (void)self;
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (v < 1)
        v = 1;
    if (v > MAX_THREADS)
        v = MAX_THREADS;
    pool.want = (int)v;
    Py_RETURN_NONE;
}

/* set_thresholds(parallel_bytes, streaming_bytes) -> previous pair; negative keeps. */
static PyObject *py_set_thresholds(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    NARGS(2);
    int64_t p, n;
    if (arg_i64(args[0], &p) < 0 || arg_i64(args[1], &n) < 0)
        return NULL;
    PyObject *prev = Py_BuildValue("(LL)", (long long)g_par_threshold, (long long)g_nt_threshold);
    if (p >= 0)
        g_par_threshold = p;
    if (n >= 0)
        g_nt_threshold = n;
    return prev;
}

static PyMethodDef methods[] = {
    {"chunks_dense", (PyCFunction)(void (*)(void))py_chunks_dense, METH_FASTCALL,
     "Copy between chunk objects and a dense [P, L, T, D] tensor."},
    {"paged", (PyCFunction)(void (*)(void))py_paged, METH_FASTCALL,
     "Copy between a paged HND cache and a dense tensor or chunk objects."},
    {"stream_copy", (PyCFunction)(void (*)(void))py_stream_copy, METH_FASTCALL,
     "Contiguous copy with streaming stores."},
    {"num_threads", py_num_threads, METH_NOARGS, "Threads used for a large copy."},
    {"set_num_threads", py_set_num_threads, METH_O, "Set threads (incl. caller)."},
    {"set_thresholds", (PyCFunction)(void (*)(void))py_set_thresholds, METH_FASTCALL,
     "set_thresholds(parallel_bytes, streaming_bytes) -> previous (testing/tuning)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "lmkv_async._copy", "GIL-free KV-cache copy kernel.", -1, methods,
    NULL, NULL, NULL, NULL,
};

static int atfork_registered;

PyMODINIT_FUNC PyInit__copy(void)
{
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    PyObject *errs = PyImport_ImportModule("lmkv_async.errors");
    if (!errs) {
        Py_DECREF(m);
        return NULL;
    }
    BoundsError = PyObject_GetAttrString(errs, "CopyBoundsError");
    LayoutError = PyObject_GetAttrString(errs, "LayoutMismatchError");
    InputError = PyObject_GetAttrString(errs, "InvalidInputError");
    Py_DECREF(errs);
    if (!BoundsError || !LayoutError || !InputError) {
        Py_DECREF(m);
        return NULL;
    }
    if (!atfork_registered) {
        pool.pid = getpid();
        pthread_atfork(NULL, NULL, atfork_child);
        atfork_registered = 1;
    }
    PyModule_AddIntConstant(m, "HAVE_STREAMING", LMKV_HAVE_NT);
    return m;
}
