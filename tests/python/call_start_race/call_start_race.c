/* An LD_PRELOAD for a TF master's process that makes one interleaving
 * happen every time: a RunGraph is cancelled while the transport is still
 * starting it, and the start then fails.
 *
 * It wraps the transport's rdev_call_inline (the shim's RunGraph and
 * CleanupGraph calls), steered by the file $CALL_RACE_CTL, read at each
 * RunGraph (method 1):
 * - no file: every call goes to the real function unchanged;
 * - "record": the same, and each RunGraph's peer is appended to
 *   $CALL_RACE_LOG as "call <peer>" (the order TF's master calls a
 *   step's partitions in);
 * - "race <fail peer> <hold peer>": a RunGraph to <fail peer> goes to the
 *   real function, its completion callback wrapped so that its reply is
 *   remembered once the caller's callback returned (TF's master, seeing
 *   the partition failed, cancels the step's other calls inside that
 *   callback; a TF error travels in the reply's body); a RunGraph to
 *   <hold peer> is held until such a reply came (at most 10 s), then fails
 *   to start with RDEV_NOT_VIABLE, as when the connection went away
 *   meanwhile, and "held <peer> after_reply=<0|1>" is appended to
 *   $CALL_RACE_LOG (0: the race did not happen).
 *
 * $CALL_RACE_LIB is the transport library's path (loaded RTLD_LOCAL by
 * the package, so RTLD_NEXT cannot find it). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void (*done_cb)(void *userdata, uint32_t code, const uint8_t *body, size_t len);
typedef int (*call_fn)(const void *ctx, const char *peer, size_t peer_len, uint32_t method,
                       const uint8_t *body, size_t body_len, uint64_t timeout_ms, done_cb cb,
                       void *userdata, uint64_t *out_id);

enum { RDEV_NOT_VIABLE = 2, RUN_GRAPH = 1 };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int replied;

struct wrapped {
  done_cb cb;
  void *userdata;
};

static void on_done(void *userdata, uint32_t code, const uint8_t *body, size_t len) {
  struct wrapped w = *(struct wrapped *)userdata;
  free(userdata);
  w.cb(w.userdata, code, body, len);
  pthread_mutex_lock(&mu);
  replied = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
}

static call_fn real_fn;
static pthread_once_t real_once = PTHREAD_ONCE_INIT;

static void find_real(void) {
  const char *lib = getenv("CALL_RACE_LIB");
  void *h = lib != NULL ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
  if (h == NULL && lib != NULL) h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    fprintf(stderr, "call_start_race: cannot open $CALL_RACE_LIB (%s)\n", lib ? lib : "unset");
    abort();
  }
  real_fn = (call_fn)dlsym(h, "rdev_call_inline");
  if (real_fn == NULL) abort();
}

/* The transport's own rdev_call_inline (looked up once, by any thread). */
static call_fn real(void) {
  pthread_once(&real_once, find_real);
  return real_fn;
}

static void log_line(const char *fmt, const char *peer, size_t peer_len, int n) {
  const char *log = getenv("CALL_RACE_LOG");
  if (log == NULL) return;
  int fd = open(log, O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) return;
  dprintf(fd, fmt, (int)peer_len, peer, n);
  close(fd);
}

/* The control file's first line, without its newline, into buf. */
static void read_ctl(char *buf, size_t size) {
  buf[0] = '\0';
  const char *path = getenv("CALL_RACE_CTL");
  FILE *f = path != NULL ? fopen(path, "r") : NULL;
  if (f == NULL) return;
  if (fgets(buf, (int)size, f) == NULL) buf[0] = '\0';
  fclose(f);
  buf[strcspn(buf, "\n")] = '\0';
}

static int is(const char *want, const char *peer, size_t peer_len) {
  return strlen(want) == peer_len && memcmp(want, peer, peer_len) == 0;
}

int rdev_call_inline(const void *ctx, const char *peer, size_t peer_len, uint32_t method,
                     const uint8_t *body, size_t body_len, uint64_t timeout_ms, done_cb cb,
                     void *userdata, uint64_t *out_id) {
  char ctl[512], fail[240], hold[240];
  if (method == RUN_GRAPH) read_ctl(ctl, sizeof ctl);
  else ctl[0] = '\0';
  if (strcmp(ctl, "record") == 0) log_line("call %.*s\n", peer, peer_len, 0);
  if (sscanf(ctl, "race %239s %239s", fail, hold) == 2) {
    if (is(hold, peer, peer_len)) {
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_sec += 10;
      pthread_mutex_lock(&mu);
      while (!replied && pthread_cond_timedwait(&cv, &mu, &until) != ETIMEDOUT) {
      }
      int seen = replied;
      pthread_mutex_unlock(&mu);
      log_line("held %.*s after_reply=%d\n", peer, peer_len, seen);
      return RDEV_NOT_VIABLE;
    }
    if (is(fail, peer, peer_len)) {
      struct wrapped *w = malloc(sizeof *w);
      if (w == NULL) abort();
      w->cb = cb;
      w->userdata = userdata;
      int rc = real()(ctx, peer, peer_len, method, body, body_len, timeout_ms, on_done, w, out_id);
      if (rc != 0) free(w); /* the callback will not run */
      return rc;
    }
  }
  return real()(ctx, peer, peer_len, method, body, body_len, timeout_ms, cb, userdata, out_id);
}
