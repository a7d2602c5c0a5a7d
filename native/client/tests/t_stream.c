/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Streamed restores (vramd_open_args.supply_fd, vramd_criu_config.supply_fd; docs/protocol.md, "Streamed
 * sessions"): the supply fd's defaults (0: none) and checks, and a 1.1 caller (struct_size short of it)
 * that never streams whatever lies past its struct.
 *
 * Group "stream" needs the driver (tests/test_libvramd_stream.py), which plays the writer:
 * stream_restore dumps a BO, prints "DUMPED <dir>", reads the streamed directory's path from stdin (the
 * driver laid it out: manifest.vrdm, each data file at full length with no byte written yet), opens a
 * restore of it with $VRAMD_TEST_SUPPLY_FD as its supply (unset: a connection to the directory's
 * .vramd-supply.sock, `vramctl pull --serve`'s; tests/test_libvramd_serve.py) (vramd_open_session, or vramd_criu_restore_submit
 * when $VRAMD_TEST_STREAM_VIA is "criu"), checks that the fd is still its own and that the copy waits for
 * its supply,
 * prints "STARTED", then waits: $VRAMD_TEST_STREAM_EXPECT "done" (the BO holds the dumped bytes) or
 * "truncated" (the session fails with TRUNCATED_DATA and says so on stdout).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"

#define SIZE (3u << 20)

static int t_supply_defaults(void)
{
    struct vramd_open_args a;
    vramd_open_args_init(&a);
    struct vramd_open_args b = VRAMD_OPEN_ARGS_INIT;
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    struct vramd_criu_config cfg2 = VRAMD_CRIU_CONFIG_INIT;
    /* 0 (none): a newer header's defaults are zero bytes, which an older library accepts as "not asked for" */
    CHECK(a.supply_fd == 0 && b.supply_fd == 0, "open args: supply_fd %d / %d", a.supply_fd, b.supply_fd);
    CHECK(cfg.supply_fd == 0 && cfg2.supply_fd == 0, "criu config: supply_fd %d / %d", cfg.supply_fd,
          cfg2.supply_fd);
    return 0;
}

/* A supply fd on a dump, a negative one other than -1, a closed one: refused before anything is sent; -1 on a
 * dump is none. */
static int t_supply_refused(void)
{
    char path[PATH_MAX];
    struct vramd_error err;
    struct vramd_conn *c = NULL;
    int dfd = make_image_dir(path);
    int p[2];
    CHECK(dfd >= 0 && pipe2(p, O_CLOEXEC) == 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_token t;
    struct vramd_open_args a = VRAMD_OPEN_ARGS_INIT;
    a.kind = VRAMD_SESSION_DUMP;
    a.dir_fd = dfd;
    a.supply_fd = p[0];
    int r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_LOCAL && strstr(err.message, "supply"), "dump with a supply: %d %s",
          r, err.message);
    a.supply_fd = -1;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err); /* -1: none */
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    a.kind = VRAMD_SESSION_RESTORE;
    a.supply_fd = -7;
    r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EBADF && strstr(err.message, "supply fd -7"), "supply fd -7: %d %s", r, err.message);
    int closed = dup(p[0]);
    close(closed);
    a.supply_fd = closed;
    r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EBADF && strstr(err.message, "supply fd"), "a closed supply fd: %d %s", r, err.message);
    CHECK(!vramd_conn_broken(c), "a local refusal broke the connection");
    vramd_close(c);
    close(p[0]);
    close(p[1]);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* Dump SIZE bytes of pattern `seed` as BO 1 into dfd. */
static int dump_one(int dfd, uint64_t seed)
{
    struct vramd_error err;
    int src = make_memfd(SIZE, seed, 0, SIZE);
    CHECK(src >= 0, "memfd");
    struct vramd_criu_config cfg = VRAMD_CRIU_CONFIG_INIT;
    struct vramd_criu_bo bo = VRAMD_CRIU_BO_INIT;
    bo.id = 1;
    bo.fd = src;
    bo.size = SIZE;
    OK(vramd_criu_dump(&cfg, dfd, &bo, 1, NULL, &err), &err);
    close(src);
    return 0;
}

/*
 * A caller built against the 1.1 header: its struct ends before supply_fd, so whatever its memory holds there
 * (here a pipe's read end, its writer gone: read as a supply, the session would fail with TRUNCATED_DATA) is
 * not read; the restore reads a complete image as it always did.  Both vramd_open_session and
 * vramd_criu_restore_submit.
 */
static int t_supply_not_read_from_a_1_1_struct(void)
{
    char path[PATH_MAX];
    struct vramd_error err;
    struct vramd_conn *c = NULL;
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "setup");
    if (dump_one(dfd, 51))
        return 1;
    int dst = make_memfd(SIZE, 0, 0, 0);
    int p[2];
    CHECK(dst >= 0 && pipe2(p, O_CLOEXEC) == 0, "setup");
    close(p[1]);
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = VRAMD_OPEN_ARGS_INIT;
    a.struct_size = (uint32_t)offsetof(struct vramd_open_args, supply_fd); /* the 1.1 layout's end */
    a.kind = VRAMD_SESSION_RESTORE;
    a.dir_fd = dfd;
    a.supply_fd = p[0];
    struct vramd_token t;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    struct vramd_bo tg = VRAMD_BO_INIT;
    tg.id = 1;
    tg.fd = dst;
    OK(vramd_add_bos(c, &t, &tg, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, VRAMD_WAIT_FOREVER, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    vramd_close(c);
    long long bad = check_memfd(dst, SIZE, 51, 0, SIZE);
    CHECK(bad < 0, "restored bytes differ at %lld", bad);

    int dst2 = make_memfd(SIZE, 0, 0, 0);
    struct vramd_criu_config cfg = VRAMD_CRIU_CONFIG_INIT;
    cfg.struct_size = (uint32_t)offsetof(struct vramd_criu_config, supply_fd);
    cfg.supply_fd = p[0];
    struct vramd_criu_bo bo = VRAMD_CRIU_BO_INIT;
    bo.id = 1;
    bo.fd = dst2;
    struct vramd_criu_ticket tk;
    OK(vramd_criu_restore_submit(&cfg, dfd, &bo, 1, 0, &tk, &err), &err);
    OK(vramd_criu_restore_barrier(&cfg, &tk, NULL, &err), &err);
    bad = check_memfd(dst2, SIZE, 51, 0, SIZE);
    CHECK(bad < 0, "criu: restored bytes differ at %lld", bad);
    close(p[0]);
    close(dst);
    close(dst2);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* The driven streamed restore (see the top of this file). */
static int t_stream_restore(void)
{
    char path[PATH_MAX], line[PATH_MAX + 2];
    struct vramd_error err;
    const char *via = getenv("VRAMD_TEST_STREAM_VIA");
    const char *expect = getenv("VRAMD_TEST_STREAM_EXPECT");
    int supply = (int)env_num("VRAMD_TEST_SUPPLY_FD", -1);
    bool criu = via && strcmp(via, "criu") == 0;
    bool truncated = expect && strcmp(expect, "truncated") == 0;
    CHECK(supply < 0 || fcntl(supply, F_GETFD) >= 0, "$VRAMD_TEST_SUPPLY_FD is no open fd");
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "setup");
    if (dump_one(dfd, 61))
        return 1;
    printf("DUMPED %s\n", path);
    fflush(stdout);
    CHECK(fgets(line, sizeof line, stdin), "no streamed directory on stdin");
    line[strcspn(line, "\n")] = 0;
    int sfd = open(line, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(sfd >= 0, "open %s: %s", line, strerror(errno));
    if (supply < 0) { /* `vramctl pull --serve`'s socket in the directory, as the CRIU plugin connects to it */
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof sa.sun_path, "/proc/self/fd/%d/.vramd-supply.sock", sfd);
        supply = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        CHECK(supply >= 0 && connect(supply, (struct sockaddr *)&sa, sizeof sa) == 0, "connect %s: %s", sa.sun_path,
              strerror(errno));
    }
    int dst = make_memfd(SIZE, 0, 0, 0);
    CHECK(dst >= 0, "memfd");

    struct vramd_conn *c = NULL;
    struct vramd_token t;
    struct vramd_criu_config cfg = VRAMD_CRIU_CONFIG_INIT;
    struct vramd_criu_ticket tk;
    if (criu) {
        cfg.supply_fd = supply;
        struct vramd_criu_bo bo = VRAMD_CRIU_BO_INIT;
        bo.id = 1;
        bo.fd = dst;
        OK(vramd_criu_restore_submit(&cfg, sfd, &bo, 1, 0, &tk, &err), &err);
        OK(vramd_criu_restore_attach(&cfg, &tk, &c, &err), &err);
        t = tk.token;
    } else {
        OK(test_connect(&c, &err), &err);
        struct vramd_open_args a = VRAMD_OPEN_ARGS_INIT;
        a.kind = VRAMD_SESSION_RESTORE;
        a.dir_fd = sfd;
        a.supply_fd = supply;
        OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
        struct vramd_bo tg = VRAMD_BO_INIT;
        tg.id = 1;
        tg.fd = dst;
        OK(vramd_add_bos(c, &t, &tg, 1, NULL, &err), &err);
        OK(vramd_start(c, &t, NULL, &err), &err);
    }
    CHECK(fcntl(supply, F_GETFD) >= 0, "the caller's supply fd was closed by the call");
    /* nothing supplied yet: the copy cannot finish (a restore reading the holes would fail or end at once) */
    struct vramd_session_info info;
    int r = vramd_wait(c, &t, 300, &info, &err);
    CHECK(r == -ETIMEDOUT, "the restore did not wait for its supply: %d (%s) state %d: %s", r, vramd_strerror(r),
          info.state, err.message);
    printf("STARTED\n");
    fflush(stdout);
    r = vramd_wait(c, &t, VRAMD_WAIT_FOREVER, &info, &err);
    if (truncated) {
        CHECK(r < 0 && err.code == VRAMD_CODE_TRUNCATED_DATA, "want TRUNCATED_DATA: %d %s: %s", r,
              vramd_code_name(err.code), err.message);
        printf("TRUNCATED %s\n", err.message);
    } else {
        OK(r, &err);
        long long bad = check_memfd(dst, SIZE, 61, 0, SIZE);
        CHECK(bad < 0, "restored bytes differ at %lld", bad);
    }
    (void)vramd_close_session(c, &t, NULL, &err);
    vramd_close(c);
    close(dst);
    if (!getenv("VRAMD_TEST_SUPPLY_FD"))
        close(supply);
    close(sfd);
    close(dfd);
    remove_dir(path);
    return 0;
}

const struct test stream_tests[] = {
    {"supply_defaults", t_supply_defaults, "all unit"},
    {"supply_refused", t_supply_refused, "all quick"},
    {"supply_not_read_from_a_1_1_struct", t_supply_not_read_from_a_1_1_struct, "all quick"},
    {"stream_restore", t_stream_restore, "stream"},
    {NULL, NULL, NULL},
};
