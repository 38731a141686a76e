/* The shim's thread pool: one thread per core (mlxcel_shim_configure sets the count), on which the
 * interposed cblas_sgemm's few-row products run in parts (mlxcel_small_m) and every other source
 * of the library runs its tasks (mlxcel_parallel: block products, the decode runtime's attention,
 * ggml's repacked graphs).
 *
 * A product is cut into parts (bands of weight rows); the calling thread and the workers claim
 * parts until none is left, so a worker that the OS has not scheduled (a busy machine) costs
 * nothing but its share of the speed-up: the caller does its parts. Claiming compares the job's
 * number too, so a late worker can never take a part of the next job. Idle workers wait for the
 * next job by yielding the core (the matmuls of one forward pass come microseconds apart, and any
 * other runnable thread gets the core meanwhile), then sleep on a futex.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "small_m_kernel.h"
#include "thread_pool.h"

#define MAX_THREADS 64
#define PARTS_PER_THREAD 4
#define SPIN_PAUSES 64           /* busy polls before yielding */
#define IDLE_NS (500 * 1000)     /* then yield for up to 0.5 ms before sleeping */

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

struct job {
    mlxcel_task_fn task; /* a task of another source file (mlxcel_parallel), or a product: */
    const void *task_ctx;
    int nn; /* w is K x N (rows_nn), else N x K (rows_nt) */
    int M, N, K;
    const float *x, *w;
    size_t ldx, ldw, ldc;
    float *c;
    float alpha, beta;
    int parts;
};

static struct job job;
static _Atomic unsigned long long ticket; /* job number << 32 | next unclaimed part */
static atomic_int parts_done;
static atomic_uint job_number; /* futex word: bumped once per job */
static atomic_int sleepers;
static int n_workers; /* started */
static int n_threads = 1;
static int n_batch_threads; /* ggml's threads for prompt chunks (-tb); 0: as many as the pool */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Outputs per unit of work: NB_MAX weight rows, or NB_MAX vectors of columns. */
static int unit(int nn) { return nn ? NB_MAX * VL : NB_MAX; }

/* Part p of the N outputs, in whole units. */
static void run_part(const struct job *j, int p) {
    if (j->task) {
        j->task(j->task_ctx, p);
        return;
    }
    int u = unit(j->nn);
    int per = ((j->N + j->parts - 1) / j->parts + u - 1) / u * u;
    int n0 = p * per < j->N ? p * per : j->N;
    int n1 = n0 + per < j->N ? n0 + per : j->N;
    if (n0 >= n1) return;
    if (j->nn) rows_nn(j->M, n0, n1, j->K, j->x, j->ldx, j->w, j->ldw, j->c, j->ldc, j->alpha, j->beta);
    else rows_nt(j->M, n0, n1, j->K, j->x, j->ldx, j->w, j->ldw, j->c, j->ldc, j->alpha, j->beta);
}

/* Claim and run parts of job number `number` until none is left. */
static void work_on(unsigned number) {
    for (;;) {
        unsigned long long t = atomic_load_explicit(&ticket, memory_order_acquire);
        if ((unsigned)(t >> 32) != number || (int)(unsigned)t >= job.parts) return;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        run_part(&job, (int)(unsigned)t); /* the job cannot change before this part is done */
        atomic_fetch_add_explicit(&parts_done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    unsigned seen = (unsigned)(size_t)arg; /* the job number when it was started */
    for (;;) {
        unsigned number;
        int spins = 0;
        long long idle_since = 0;
        while ((number = atomic_load_explicit(&job_number, memory_order_acquire)) == seen) {
            if (++spins < SPIN_PAUSES) {
                cpu_relax();
            } else if (idle_since == 0 || now_ns() - idle_since < IDLE_NS) {
                if (idle_since == 0) idle_since = now_ns();
                sched_yield();
            } else {
                atomic_fetch_add(&sleepers, 1);
                syscall(SYS_futex, &job_number, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                spins = 0;
                idle_since = 0;
            }
        }
        seen = number;
        work_on(number);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    n_workers = 0; /* the workers did not survive the fork: start them again when needed */
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, NULL);
}

static void start_workers(void) {
    static int atfork_registered;
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_registered = 1;
    }
    while (n_workers < n_threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        size_t number = atomic_load(&job_number);
        int ok = pthread_create(&t, &attr, worker, (void *)number) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        n_workers++;
    }
}

/* Below this many multiply-adds a product runs on the calling thread: waking a worker costs more. */
#define PARALLEL_MIN_MACS (1 << 16)

/* Runs `parts` parts of `j` on the calling thread and the workers; 0 if the pool is busy or
 * single-threaded (the caller then runs the parts itself). */
static int run_parallel(struct job j) {
    if (n_threads <= 1 || j.parts <= 1 || pthread_mutex_trylock(&pool_lock) != 0) return 0;
    start_workers();
    int threads = n_threads < n_workers + 1 ? n_threads : n_workers + 1;
    if (threads <= 1) {
        pthread_mutex_unlock(&pool_lock);
        return 0;
    }
    job = j;
    atomic_store_explicit(&parts_done, 0, memory_order_relaxed);
    unsigned number = atomic_load_explicit(&job_number, memory_order_relaxed) + 1;
    atomic_store_explicit(&ticket, (unsigned long long)number << 32, memory_order_release);
    atomic_store_explicit(&job_number, number, memory_order_release);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &job_number, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    work_on(number);
    for (int spins = 0; atomic_load_explicit(&parts_done, memory_order_acquire) < j.parts; spins++) {
        if (spins < SPIN_PAUSES) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool_lock);
    return 1;
}

void mlxcel_small_m(int nn, int M, int N, int K, float alpha, const float *x, size_t ldx, const float *w,
                    size_t ldw, float beta, float *c, size_t ldc) {
    int units = (N + unit(nn) - 1) / unit(nn);
    if ((long)M * N * K >= PARALLEL_MIN_MACS) {
        int parts = n_threads * PARTS_PER_THREAD < units ? n_threads * PARTS_PER_THREAD : units;
        if (run_parallel((struct job){NULL, NULL, nn, M, N, K, x, w, ldx, ldw, ldc, c, alpha, beta, parts})) return;
    }
    if (nn) rows_nn(M, 0, N, K, x, ldx, w, ldw, c, ldc, alpha, beta);
    else rows_nt(M, 0, N, K, x, ldx, w, ldw, c, ldc, alpha, beta);
}

void mlxcel_parallel(int parts, mlxcel_task_fn fn, const void *ctx) {
    struct job j = {0};
    j.task = fn;
    j.task_ctx = ctx;
    j.parts = parts;
    if (!run_parallel(j))
        for (int p = 0; p < parts; p++) fn(ctx, p);
}

int mlxcel_threads(void) { return n_threads; }

int mlxcel_batch_threads(void) { return n_batch_threads > 0 ? n_batch_threads : n_threads; }

void mlxcel_set_batch_threads(int threads) { n_batch_threads = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 0; }

void *mlxcel_scratch(struct mlxcel_scratch *s, size_t size) {
    if (s->size < size) {
        free(s->p);
        s->p = malloc(size);
        if (!s->p) abort();
        s->size = size;
    }
    return s->p;
}

void mlxcel_set_threads(int threads) {
    pthread_mutex_lock(&pool_lock);
    if (threads > 0) n_threads = threads < MAX_THREADS ? threads : MAX_THREADS;
    pthread_mutex_unlock(&pool_lock);
}
