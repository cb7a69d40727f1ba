/* An LD_PRELOAD name resolver that is slow on purpose, for measuring what
 * a slow DNS (or a slow route probe) costs a real TensorFlow task.
 *
 * getaddrinfo() of a host ending in $SLOW_RESOLVER_SUFFIX (".slow.test"
 * unless set) sleeps $SLOW_RESOLVER_MS milliseconds, then answers as for
 * 127.0.0.1, so the task is still reachable under that name. Every other
 * name goes to glibc's own getaddrinfo unchanged. gRPC resolves through
 * getaddrinfo when GRPC_DNS_RESOLVER=native.
 *
 * With $SLOW_RESOLVER_THREAD set, only lookups made on threads whose name
 * starts with it wait (e.g. the transport's route threads, "rdev-route",
 * while gRPC resolves the same names at once); every thread gets the same
 * answer.
 *
 * A measurement tool: it only delays, and counts the slow lookups in
 * $SLOW_RESOLVER_COUNT (a file it appends one line to per lookup) when set. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <unistd.h>

typedef int (*getaddrinfo_fn)(const char *, const char *, const struct addrinfo *,
                              struct addrinfo **);

static int is_slow(const char *node) {
    const char *suffix = getenv("SLOW_RESOLVER_SUFFIX");
    if (suffix == NULL || *suffix == '\0') suffix = ".slow.test";
    size_t n = strlen(node), m = strlen(suffix);
    return n > m && strcmp(node + n - m, suffix) == 0;
}

/* Whether this thread's lookups wait (all, unless $SLOW_RESOLVER_THREAD). */
static int waits_here(void) {
    const char *thread = getenv("SLOW_RESOLVER_THREAD");
    if (thread == NULL || *thread == '\0') return 1;
    char name[17] = {0};
    if (prctl(PR_GET_NAME, name, 0, 0, 0) != 0) return 0;
    return strncmp(name, thread, strlen(thread)) == 0;
}

int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res) {
    static getaddrinfo_fn real = NULL;
    if (real == NULL) real = (getaddrinfo_fn)dlsym(RTLD_NEXT, "getaddrinfo");
    if (real == NULL) return EAI_FAIL;
    if (node == NULL || !is_slow(node)) return real(node, service, hints, res);
    const char *ms = getenv("SLOW_RESOLVER_MS");
    long delay = ms != NULL ? strtol(ms, NULL, 10) : 1000;
    if (delay > 0 && waits_here()) {
        struct timespec ts = {delay / 1000, (delay % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0) {
        }
    }
    const char *count = getenv("SLOW_RESOLVER_COUNT");
    if (count != NULL && *count != '\0') {
        int fd = open(count, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            ssize_t unused = write(fd, "1\n", 2);
            (void)unused;
            close(fd);
        }
    }
    return real("127.0.0.1", service, hints, res);
}
