/* A C program using only include/rdma_device.h: two contexts (two tasks)
 * in one process move a tensor through the library, zero-copy; errors and
 * introspection behave as documented. Usage: smoke PORT0 PORT1 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rdma_device.h"

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      exit(1);                                             \
    }                                                      \
  } while (0)

static const char *last_error(void) {
  static char buf[1024];
  rdev_last_error(buf, sizeof buf);
  return buf;
}

struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  rdev_status status;
  rdev_buffer *buf;
};

static void wait_done(struct waiter *w) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 10;
  pthread_mutex_lock(&w->mu);
  while (!w->done) {
    if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) != 0) break;
  }
  pthread_mutex_unlock(&w->mu);
  CHECK(w->done, "callback did not run within 10 s");
}

static void on_sent(void *ud, rdev_status st, const char *msg, size_t len) {
  struct waiter *w = ud;
  (void)msg; (void)len;
  pthread_mutex_lock(&w->mu);
  w->status = st;
  w->done = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static void on_recv(void *ud, rdev_status st, const char *msg, size_t len, rdev_buffer *buf) {
  struct waiter *w = ud;
  (void)msg; (void)len;
  pthread_mutex_lock(&w->mu);
  w->status = st;
  w->buf = buf;
  w->done = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

#define S(x) x, strlen(x)

int main(int argc, char **argv) {
  CHECK(argc == 3, "usage: smoke PORT0 PORT1");
  char a0[64], a1[64];
  snprintf(a0, sizeof a0, "localhost:%s", argv[1]);
  snprintf(a1, sizeof a1, "localhost:%s", argv[2]);
  const char *t0 = "/job:worker/replica:0/task:0", *t1 = "/job:worker/replica:0/task:1";

  /* Errors are statuses with a message, never a crash. */
  rdev_context *bad = (rdev_context *)0x1;
  CHECK(rdev_context_new(NULL, 5, S(a0), &bad) == RDEV_INVALID_ARGUMENT, "NULL task accepted");
  CHECK(bad == (rdev_context *)0x1, "out written on failure");
  CHECK(strlen(last_error()) > 0, "no last error");
  CHECK(strcmp(rdev_status_str(RDEV_PEER_LOST), "RDEV_PEER_LOST") == 0, "status_str");
  setenv("RDMA_DEVICE_SLOTS_PER_EDGE", "0", 1);
  CHECK(rdev_context_new(S(t0), S(a0), &bad) == RDEV_CONFIG, "bad env accepted");
  CHECK(strstr(last_error(), "RDMA_DEVICE_SLOTS_PER_EDGE") != NULL, "config error names the variable: %s", last_error());
  unsetenv("RDMA_DEVICE_SLOTS_PER_EDGE");
  rdev_context_free(NULL);
  rdev_buffer_release(NULL);

  rdev_context *c0 = NULL, *c1 = NULL;
  CHECK(rdev_context_new(S(t0), S(a0), &c0) == RDEV_OK, "context 0: %s", last_error());
  CHECK(rdev_context_new(S(t1), S(a1), &c1) == RDEV_OK, "context 1: %s", last_error());
  rdev_transport tr = RDEV_TRANSPORT_NONE;
  CHECK(rdev_context_add_peer(c0, S(t1), S(a1), &tr) == RDEV_OK && tr == RDEV_TRANSPORT_SHM, "peer 1 transport %d: %s", tr, last_error());
  CHECK(rdev_context_add_peer(c1, S(t0), S(a0), &tr) == RDEV_OK && tr == RDEV_TRANSPORT_SHM, "peer 0 transport");

  enum { N = 1 << 20 };
  float *data = malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) data[i] = (float)i * 0.5f;
  int64_t dims[2] = {1024, 1024};
  rdev_tensor_meta meta = {.dtype = 1, .flags = 0, .ndims = 2, .dims = dims};
  const char *key = "/job:worker/replica:0/task:0/device:CPU:0;1;/job:worker/replica:0/task:1/device:CPU:0;w;0:0";

  struct waiter rw = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL};
  struct waiter sw = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL};
  CHECK(rdev_recv(c1, S(t0), S(key), 42, on_recv, &rw) == RDEV_OK, "recv: %s", last_error());
  CHECK(rdev_send(c0, S(t1), S(key), 42, &meta, (const uint8_t *)data, N * sizeof(float), on_sent, &sw) == RDEV_OK, "send: %s", last_error());
  wait_done(&sw);
  CHECK(sw.status == RDEV_OK, "send status %s", rdev_status_str(sw.status));
  wait_done(&rw);
  CHECK(rw.status == RDEV_OK && rw.buf, "recv status %s", rdev_status_str(rw.status));

  rdev_buffer *b = rw.buf;
  CHECK(rdev_buffer_len(b) == N * sizeof(float), "len %zu", rdev_buffer_len(b));
  CHECK(((uintptr_t)rdev_buffer_data(b) % 64) == 0, "payload not 64-byte aligned");
  CHECK(rdev_buffer_in_place(b), "not zero-copy");
  CHECK(memcmp(rdev_buffer_data(b), data, N * sizeof(float)) == 0, "payload differs");
  CHECK(rdev_buffer_dtype(b) == 1 && rdev_buffer_ndims(b) == 2, "meta");
  CHECK(rdev_buffer_dims(b)[0] == 1024 && rdev_buffer_dims(b)[1] == 1024, "dims");
  rdev_buffer_release(b);

  /* An aborted step's receive fails promptly with RDEV_ABORTED. */
  struct waiter aw = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL};
  CHECK(rdev_recv(c1, S(t0), S(key), 43, on_recv, &aw) == RDEV_OK, "recv 43");
  CHECK(rdev_abort_step(c1, 43, 0, S("cancelled"), false) == RDEV_OK, "abort");
  wait_done(&aw);
  CHECK(aw.status == RDEV_ABORTED && aw.buf == NULL, "aborted recv status %s", rdev_status_str(aw.status));

  /* Stats and config are JSON; a too-small buffer says how much is needed. */
  size_t need = 0;
  char tiny[4];
  CHECK(rdev_stats_json(tiny, sizeof tiny, &need) == RDEV_RESOURCE_EXHAUSTED && need > 4, "small buffer");
  char *js = malloc(need + 1);
  CHECK(rdev_stats_json(js, need + 1, &need) == RDEV_OK, "stats");
  CHECK(strstr(js, "\"tensors_pushed\": 1") != NULL, "stats: %s", js);
  CHECK(strstr(js, "\"shm\"") != NULL, "peer transport in stats: %s", js);
  free(js);
  char cfg[8192];
  CHECK(rdev_config_json(cfg, sizeof cfg, &need) == RDEV_OK && strstr(cfg, "RDMA_DEVICE_ARENA_BYTES"), "config");

  /* A second release of a buffer is refused (logged), not a second owner:
     the next two receives get two different buffers, each intact. */
  rdev_buffer_release(b);
  {
    const char *k2[2] = {
        "/job:worker/replica:0/task:0/device:CPU:0;1;/job:worker/replica:0/task:1/device:CPU:0;x;0:0",
        "/job:worker/replica:0/task:0/device:CPU:0;1;/job:worker/replica:0/task:1/device:CPU:0;y;0:0"};
    struct waiter r2[2] = {{PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL},
                           {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL}};
    struct waiter s2[2] = {{PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL},
                           {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, RDEV_OK, NULL}};
    for (int i = 0; i < 2; i++) {
      CHECK(rdev_recv(c1, S(t0), S(k2[i]), 44, on_recv, &r2[i]) == RDEV_OK, "recv %d: %s", i, last_error());
      CHECK(rdev_send(c0, S(t1), S(k2[i]), 44, &meta, (const uint8_t *)data, N * sizeof(float), on_sent, &s2[i]) == RDEV_OK,
            "send %d: %s", i, last_error());
    }
    for (int i = 0; i < 2; i++) {
      wait_done(&s2[i]);
      wait_done(&r2[i]);
      CHECK(s2[i].status == RDEV_OK && r2[i].status == RDEV_OK && r2[i].buf, "transfer %d after a double release", i);
    }
    CHECK(r2[0].buf != r2[1].buf, "a buffer released twice was handed to two receivers");
    for (int i = 0; i < 2; i++) {
      CHECK(memcmp(rdev_buffer_data(r2[i].buf), data, N * sizeof(float)) == 0, "payload %d differs", i);
      rdev_buffer_release(r2[i].buf);
    }
  }

  rdev_context_free(c0);
  rdev_context_free(c1);
  free(data);
  printf("c smoke: ok (rdma_device %s)\n", rdev_version());
  return 0;
}
