/* SPDX-License-Identifier: Apache-2.0 */
/* A small harness for libvramd's C tests: named tests, checks, fd accounting, helpers. */
#ifndef VRAMD_TEST_HARNESS_H
#define VRAMD_TEST_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "vramd/client.h"
#include "vramd/criu.h"

/* Fail the current test (return 1 from it) with a message. */
#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);                          \
            fprintf(stderr, __VA_ARGS__);                                                                          \
            fputc('\n', stderr);                                                                                   \
            return 1;                                                                                              \
        }                                                                                                          \
    } while (0)

/* A libvramd call that must succeed. */
#define OK(call, errp)                                                                                             \
    do {                                                                                                           \
        int ok_r_ = (call);                                                                                        \
        CHECK(ok_r_ == 0, "%s -> %d (%s) code %s: %s", #call, ok_r_, vramd_strerror(ok_r_),                       \
              vramd_code_name((errp)->code), (errp)->message);                                                     \
    } while (0)

struct test {
    const char *name;
    int (*fn)(void);
    const char *groups; /* space-separated: which named groups run it ("all" runs the default ones) */
};

/* Provided by each test file. */
extern const struct test roundtrip_tests[];
extern const struct test criu_tests[];
extern const struct test failure_tests[];
extern const struct test hold_tests[];
extern const struct test files_tests[];
extern const struct test abi_tests[];
extern const struct test lock_tests[];
extern const struct test stream_tests[];

/* A fake daemon's reply as a frame (header + packed message) in `out`: its length, 0 if it does not fit. */
struct Vramd__Rpc__V1__Response;
struct Vramd__Rpc__V1__Request;
size_t frame_response(uint8_t *out, size_t cap, const struct Vramd__Rpc__V1__Response *resp);
/* A fake daemon's next request from its client, unpacked (the caller frees it with
 * vramd__rpc__v1__request__free_unpacked); NULL when the client hung up.  The fds a packet carries are
 * discarded (no control buffer); a packet that is no request ends the fake: _exit(2) too short, _exit(3)
 * not a request. */
struct Vramd__Rpc__V1__Request *fake_request(int s);
/* A fake daemon's reply, as one frame; one it cannot send ends the fake: _exit(4). */
void fake_reply(int s, const struct Vramd__Rpc__V1__Response *resp);
/* A SOCK_SEQPACKET socketpair with a child process on one end: in the child, *fd is its end (the other one
 * closed) and 0 is returned; in the caller, *fd is the other end and the child's pid is returned; -1 on
 * failure, nothing left open. */
pid_t fork_peer(int *fd);

/* A new empty file `name` in the directory dir_fd (O_EXCL, mode 0600): 0, or -errno. */
int touch_at(int dir_fd, const char *name);

/* the daemon's socket ($VRAMD_SOCKET) */
const char *daemon_socket(void);
/* An integer from the environment, or dflt. */
long long env_num(const char *name, long long dflt);
/* fds open in this process (from /proc/self/fd). */
int count_fds(void);
/* A connection with the test's options (timeout 30 s unless given). */
int test_connect(struct vramd_conn **c, struct vramd_error *err);

/* Deterministic bytes: fill/check `len` bytes that belong at `pos` of stream `seed`. */
void fill_pattern(void *buf, size_t len, uint64_t seed, uint64_t pos);
/* A memfd of `size` bytes (sparse), with pattern data written at [data_off, data_off+data_len). */
int make_memfd(uint64_t size, uint64_t seed, uint64_t data_off, uint64_t data_len);
/*
 * Compare fd_a and fd_b over [0, size) without holding either in memory:
 * walks the data extents (SEEK_DATA/SEEK_HOLE) of both, holes read as zeros.
 * Returns -1 if equal, else the first differing offset.
 */
long long compare_fds(int fd_a, int fd_b, uint64_t size);
/* Check that [0, size) of fd holds pattern(seed) in [off, off+len) and zeros elsewhere; -1 or bad offset. */
long long check_memfd(int fd, uint64_t size, uint64_t seed, uint64_t off, uint64_t len);

/* An image directory under $VRAMD_TEST_TMP (or /tmp); path written into path (PATH_MAX). */
int make_image_dir(char *path);
/* rm -rf of a test image directory. */
void remove_dir(const char *path);
/* How many entries of directory `dir` start with `prefix` and end with `suffix` (either may be ""); -1 on error.
 * The first match's name goes into `first` (when not NULL, PATH_MAX bytes). */
int count_entries(const char *dir, const char *prefix, const char *suffix, char *first);

/* A child process that holds memory mapped at the same addresses as the parent's regions. */
struct child {
    pid_t pid;
    int ctl; /* write end: closing it lets the child exit */
};
/* fork a child that sits until released; it dies with the parent (PR_SET_PDEATHSIG). */
int spawn_holder(struct child *ch);
/* release and reap it; returns its exit status or -1 */
int release_holder(struct child *ch);

/* Wait for a child's exit; returns the raw status or -1. */
int reap(pid_t pid);

#endif
