/* An LD_PRELOAD allocation counter for measuring real TensorFlow tasks.
 *
 * Every malloc, calloc, realloc, posix_memalign, aligned_alloc, memalign,
 * valloc and C++ operator new is counted per call stack (up to DEPTH
 * frames, glibc's backtrace()), in a fixed open-addressing table of
 * atomics: no lock, no allocation of its own. Counting starts with the
 * first SIGUSR2 (so start-up, imports included, stays out of the table).
 * Each SIGUSR2 writes a snapshot to
 * $MALLOC_COUNT_PREFIX.<pid>.<n>.bin (one record per stack: key, calls,
 * bytes, DEPTH return addresses) and the process's memory map to
 * ...<n>.maps, using only async-signal-safe calls, then renames the pair's
 * marker ...<n>.done into place. tests/python/test_allocs.py diffs two
 * snapshots and attributes each stack to its first frame outside this
 * library, libc, libstdc++ and libgcc.
 *
 * A measurement tool: it only counts, and hands every call to glibc's own
 * allocator (__libc_malloc and friends). */
#define _GNU_SOURCE
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

#define DEPTH 8
#define SLOTS (1u << 18)

struct slot {
    _Atomic uint64_t key;
    _Atomic uint64_t calls;
    _Atomic uint64_t bytes;
    uintptr_t pc[DEPTH];
    _Atomic int ready;
};

static struct slot table[SLOTS];
static _Atomic uint64_t dropped;
static _Atomic int enabled;
static __thread int busy;
static char prefix[512];
static _Atomic unsigned seq;

static void record(size_t size) {
    if (!atomic_load_explicit(&enabled, memory_order_relaxed) || busy)
        return;
    busy = 1; /* backtrace() may allocate (it loads libgcc_s once) */
    void *frames[DEPTH + 1];
    int n = backtrace(frames, DEPTH + 1);
    uintptr_t pc[DEPTH] = {0};
    uint64_t key = 1469598103934665603ull;
    for (int i = 1; i < n; i++) { /* frames[0] is record() itself */
        pc[i - 1] = (uintptr_t)frames[i];
        key = (key ^ (uint64_t)(uintptr_t)frames[i]) * 1099511628211ull;
    }
    if (key == 0)
        key = 1;
    for (uint32_t probe = 0; probe < 64; probe++) {
        struct slot *s = &table[(key + probe) & (SLOTS - 1)];
        uint64_t k = atomic_load(&s->key);
        if (k == 0) {
            uint64_t zero = 0;
            if (atomic_compare_exchange_strong(&s->key, &zero, key)) {
                memcpy(s->pc, pc, sizeof pc);
                atomic_store(&s->ready, 1);
                k = key;
            } else {
                k = zero;
            }
        }
        if (k == key) {
            atomic_fetch_add_explicit(&s->calls, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&s->bytes, size, memory_order_relaxed);
            busy = 0;
            return;
        }
    }
    atomic_fetch_add(&dropped, 1);
    busy = 0;
}

void *malloc(size_t n) { record(n); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { record(a * b); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { record(n); return __libc_realloc(p, n); }
void free(void *p) { __libc_free(p); }
void *memalign(size_t a, size_t n) { record(n); return __libc_memalign(a, n); }
void *aligned_alloc(size_t a, size_t n) { record(n); return __libc_memalign(a, n); }
void *valloc(size_t n) { record(n); return __libc_memalign(sysconf(_SC_PAGESIZE), n); }
int posix_memalign(void **out, size_t a, size_t n) {
    record(n);
    void *p = __libc_memalign(a, n);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}

/* operator new: counted here so the stack starts at its caller. */
static void *new_or_die(size_t n, size_t align) {
    record(n);
    void *p = align ? __libc_memalign(align, n ? n : 1) : __libc_malloc(n ? n : 1);
    if (!p)
        abort(); /* no bad_alloc from C; a measurement run only */
    return p;
}
void *_Znwm(size_t n) { return new_or_die(n, 0); }
void *_Znam(size_t n) { return new_or_die(n, 0); }
void *_ZnwmRKSt9nothrow_t(size_t n, const void *t) { (void)t; record(n); return __libc_malloc(n ? n : 1); }
void *_ZnamRKSt9nothrow_t(size_t n, const void *t) { (void)t; record(n); return __libc_malloc(n ? n : 1); }
void *_ZnwmSt11align_val_t(size_t n, size_t a) { return new_or_die(n, a); }
void *_ZnamSt11align_val_t(size_t n, size_t a) { return new_or_die(n, a); }

static size_t put_u(char *at, unsigned long v) {
    char tmp[24];
    size_t n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (size_t i = 0; i < n; i++)
        at[i] = tmp[n - 1 - i];
    return n;
}

/* prefix.<pid>.<n><ext> into out (async-signal-safe). */
static void path(char *out, unsigned n, const char *ext) {
    size_t at = strlen(prefix);
    memcpy(out, prefix, at);
    out[at++] = '.';
    at += put_u(out + at, (unsigned long)getpid());
    out[at++] = '.';
    at += put_u(out + at, n);
    size_t e = strlen(ext);
    memcpy(out + at, ext, e + 1);
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w <= 0)
            return;
        p += w;
        len -= (size_t)w;
    }
}

static void dump(int sig) {
    (void)sig;
    int saved = errno;
    unsigned n = atomic_fetch_add(&seq, 1);
    char p[600];
    path(p, n, ".bin");
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        uint64_t rec[3 + DEPTH];
        rec[0] = 0; /* the header record: dropped stacks */
        rec[1] = atomic_load(&dropped);
        rec[2] = 0;
        memset(rec + 3, 0, sizeof(uint64_t) * DEPTH);
        write_all(fd, rec, sizeof rec);
        for (uint32_t i = 0; i < SLOTS; i++) {
            struct slot *s = &table[i];
            if (atomic_load(&s->key) == 0 || !atomic_load(&s->ready))
                continue;
            rec[0] = atomic_load(&s->key);
            rec[1] = atomic_load(&s->calls);
            rec[2] = atomic_load(&s->bytes);
            for (int d = 0; d < DEPTH; d++)
                rec[3 + d] = s->pc[d];
            write_all(fd, rec, sizeof rec);
        }
        close(fd);
    }
    path(p, n, ".maps");
    int out = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int in = open("/proc/self/maps", O_RDONLY);
    if (out >= 0 && in >= 0) {
        char buf[4096];
        ssize_t r;
        while ((r = read(in, buf, sizeof buf)) > 0)
            write_all(out, buf, (size_t)r);
    }
    if (in >= 0)
        close(in);
    if (out >= 0)
        close(out);
    path(p, n, ".done");
    fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0)
        close(fd);
    atomic_store(&enabled, 1);
    errno = saved;
}

__attribute__((constructor)) static void start(void) {
    const char *pre = getenv("MALLOC_COUNT_PREFIX");
    if (!pre || strlen(pre) >= sizeof prefix)
        return;
    memcpy(prefix, pre, strlen(pre) + 1);
    void *warm[2];
    busy = 1;
    backtrace(warm, 2); /* loads libgcc_s now, not inside a malloc */
    busy = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = dump;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR2, &sa, NULL);
}
