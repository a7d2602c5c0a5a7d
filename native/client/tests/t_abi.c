/* SPDX-License-Identifier: Apache-2.0 */
/* ABI 1.0 (client.h, "ABI 1.0"): size-versioned input structs old and new, arrays, the enum choices. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"

#define BO_BYTES (256 << 10)

/* A caller built against a later header: the 1.0 struct followed by members this library does not know. */
struct future_bo {
    struct vramd_bo bo;
    uint64_t later[2];
};
struct future_options {
    struct vramd_options o;
    uint64_t later;
};
struct future_open_args {
    struct vramd_open_args a;
    uint64_t later;
};
struct future_criu_config {
    struct vramd_criu_config cfg;
    uint64_t later;
};

/* Dump one memfd through `a` and bos (stride bytes apart), restore it into a fresh memfd, compare. */
static int dump_restore(struct vramd_conn *c, const struct vramd_open_args *a, const void *bos, size_t n,
                        int src, struct vramd_session_info *di, struct vramd_error *err)
{
    struct vramd_token t;
    OK(vramd_open_session(c, a, &t, NULL, err), err);
    OK(vramd_add_bos(c, &t, bos, n, NULL, err), err);
    OK(vramd_start(c, &t, NULL, err), err);
    OK(vramd_wait(c, &t, VRAMD_WAIT_FOREVER, di, err), err);
    OK(vramd_close_session(c, &t, NULL, err), err);
    int dst = make_memfd(BO_BYTES, 99, 0, BO_BYTES);
    CHECK(dst >= 0, "memfd");
    struct vramd_open_args r = VRAMD_OPEN_ARGS_INIT;
    r.kind = VRAMD_SESSION_RESTORE;
    r.dir_fd = a->dir_fd;
    struct vramd_bo tg = VRAMD_BO_INIT;
    tg.id = 1;
    tg.fd = dst;
    OK(vramd_open_session(c, &r, &t, NULL, err), err);
    OK(vramd_add_bos(c, &t, &tg, 1, NULL, err), err);
    OK(vramd_start(c, &t, NULL, err), err);
    OK(vramd_wait(c, &t, VRAMD_WAIT_FOREVER, NULL, err), err);
    OK(vramd_close_session(c, &t, NULL, err), err);
    long long bad = compare_fds(src, dst, BO_BYTES);
    close(dst);
    CHECK(bad < 0, "restored BO differs at %lld", bad);
    return 0;
}

/* struct_size 0 (a 0.x-style designated initialiser), the 1.0 size, and a later header's larger size with a
 * zero tail all work, connect to commit and back. */
static int t_abi_sizes(void)
{
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(BO_BYTES, 41, 0, BO_BYTES);
    CHECK(dfd >= 0 && src >= 0, "setup");
    struct vramd_error err;
    for (int v = 0; v < 3; v++) {
        struct vramd_conn *c = NULL;
        struct future_options fo;
        memset(&fo, 0, sizeof fo);
        fo.o.timeout_ms = 30000;
        fo.o.struct_size = v == 0 ? 0 : v == 1 ? sizeof fo.o : sizeof fo;
        OK(vramd_connect_path(&c, daemon_socket(), &fo.o, &err), &err);
        struct future_open_args fa;
        memset(&fa, 0, sizeof fa);
        fa.a = (struct vramd_open_args){.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .label = "ctest-abi"};
        fa.a.struct_size = fo.o.struct_size ? (v == 1 ? sizeof fa.a : sizeof fa) : 0;
        struct future_bo fb[2];
        memset(fb, 0, sizeof fb);
        fb[0].bo = (struct vramd_bo){.id = 1, .fd = src, .size = BO_BYTES, .name = "abi"};
        fb[0].bo.struct_size = v == 0 ? 0 : v == 1 ? sizeof fb[0].bo : sizeof fb[0];
        /* v 2: the array's stride is the larger struct's: one element only reaches BO 1 through it */
        const void *bos = &fb[0];
        struct vramd_bo plain[1];
        if (v < 2) {
            plain[0] = fb[0].bo;
            bos = plain;
        }
        struct vramd_session_info di;
        int rc = dump_restore(c, &fa.a, bos, 1, src, &di, &err);
        vramd_close(c);
        CHECK(rc == 0, "struct_size variant %d", v);
        CHECK(di.has_image && di.image.bo_count == 1, "variant %d: image of %u BOs", v, di.image.bo_count);
    }
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* A struct_size beyond what the library knows with a non-zero tail is -E2BIG naming the struct, one below the
 * 1.0 size -EINVAL; an array whose elements disagree on their size -EINVAL; nothing is sent for any of them
 * (the connection stays usable). */
static int t_abi_refusals(void)
{
    struct vramd_error err;
    struct vramd_conn *c = NULL;
    struct future_options fo;
    memset(&fo, 0, sizeof fo);
    fo.o.struct_size = sizeof fo;
    fo.later = 1;
    int r = vramd_connect_path(&c, daemon_socket(), &fo.o, &err);
    CHECK(r == -E2BIG && err.code == VRAMD_CODE_LOCAL && strstr(err.message, "vramd_options") && !c,
          "options with a non-zero tail: %d %s", r, err.message);
    fo.o.struct_size = 4;
    r = vramd_connect_path(&c, daemon_socket(), &fo.o, &err);
    CHECK(r == -EINVAL && strstr(err.message, "vramd_options"), "options of 4 bytes: %d %s", r, err.message);
    fo.o.struct_size = 0xdeadbeef; /* never set: refused before anything past the struct is read */
    r = vramd_connect_path(&c, daemon_socket(), &fo.o, &err);
    CHECK(r == -E2BIG && strstr(err.message, "vramd_options") && strstr(err.message, "beyond any libvramd"),
          "options of 0xdeadbeef bytes: %d %s", r, err.message);

    OK(test_connect(&c, &err), &err);
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "image dir");
    struct future_open_args fa;
    memset(&fa, 0, sizeof fa);
    fa.a = (struct vramd_open_args){.struct_size = sizeof fa, .kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    fa.later = 7;
    struct vramd_token t;
    r = vramd_open_session(c, &fa.a, &t, NULL, &err);
    CHECK(r == -E2BIG && strstr(err.message, "vramd_open_args"), "open args with a tail: %d %s", r, err.message);
    CHECK(count_entries(path, "", "", NULL) == 0, "a refused open left files in the directory");

    struct vramd_open_args a = VRAMD_OPEN_ARGS_INIT;
    a.kind = VRAMD_SESSION_DUMP;
    a.dir_fd = dfd;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    int src = make_memfd(4096, 5, 0, 4096);
    CHECK(src >= 0, "memfd");
    struct future_bo fb[2];
    memset(fb, 0, sizeof fb);
    for (int i = 0; i < 2; i++)
        fb[i].bo = (struct vramd_bo){.struct_size = sizeof fb[0], .id = (uint64_t)i + 1, .fd = src, .size = 4096};
    fb[1].later[1] = 3;
    r = vramd_add_bos(c, &t, &fb[0].bo, 2, NULL, &err);
    CHECK(r == -E2BIG && strstr(err.message, "vramd_bo"), "BO with a tail: %d %s", r, err.message);
    struct vramd_bo mixed[2] = {{.id = 1, .fd = src, .size = 4096}, {.id = 2, .fd = src, .size = 4096}};
    mixed[1].struct_size = sizeof mixed[1] + 8;
    r = vramd_add_bos(c, &t, mixed, 2, NULL, &err);
    CHECK(r == -EINVAL && strstr(err.message, "vramd_bo[1]"), "mixed sizes: %d %s", r, err.message);
    /* nothing was sent: the session takes the BOs when they are right */
    mixed[1].struct_size = 0;
    OK(vramd_add_bos(c, &t, mixed, 2, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, VRAMD_WAIT_FOREVER, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    vramd_close(c);

    /* the CRIU adapter: its config too, and the socket it was handed is closed all the same */
    int sp[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
    struct future_criu_config fc;
    memset(&fc, 0, sizeof fc);
    vramd_criu_config_init(&fc.cfg);
    fc.cfg.struct_size = sizeof fc;
    fc.cfg.sock_fd = sp[0];
    fc.later = 9;
    struct vramd_criu_bo cb = VRAMD_CRIU_BO_INIT;
    cb.id = 1, cb.fd = src, cb.size = 4096;
    r = vramd_criu_dump(&fc.cfg, dfd, &cb, 1, NULL, &err);
    CHECK(r == -E2BIG && strstr(err.message, "vramd_criu_config"), "criu config with a tail: %d %s", r, err.message);
    CHECK(fcntl(sp[0], F_GETFD) < 0 && errno == EBADF, "the handed-over socket is still open");
    close(sp[1]);
    /* a struct_size below the 1.0 layout (-EINVAL) closes it as well: the call takes it over in every case */
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
    struct vramd_criu_config small;
    vramd_criu_config_init(&small);
    small.struct_size = 8;
    small.sock_fd = sp[0];
    struct vramd_criu_ticket ticket;
    r = vramd_criu_restore_submit(&small, dfd, &cb, 1, 0, &ticket, &err);
    CHECK(r == -EINVAL && strstr(err.message, "vramd_criu_config"), "criu config of 8 bytes: %d %s", r, err.message);
    CHECK(fcntl(sp[0], F_GETFD) < 0 && errno == EBADF, "the socket handed over with a short config is still open");
    close(sp[1]);
    /* vramd_criu_restore_finish takes no socket over (attach did, and its connection may own it): a config it
     * refuses leaves sock_fd alone */
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
    fc.cfg.sock_fd = sp[0];
    r = vramd_criu_restore_finish(&fc.cfg, NULL, &ticket, NULL, &err);
    CHECK(r == -E2BIG && strstr(err.message, "vramd_criu_config"), "finish, config with a tail: %d %s", r,
          err.message);
    CHECK(fcntl(sp[0], F_GETFD) >= 0, "vramd_criu_restore_finish closed the config's sock_fd");
    close(sp[0]);
    close(sp[1]);
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* The enums: names, the twin of vramd_conn_has_backend, and a dump asked for by enum as by string; an enum
 * and a string that disagree are -EINVAL. */
static int t_abi_enums(void)
{
    CHECK(strcmp(vramd_backend_name(VRAMD_BACKEND_PROCMEM), "procmem") == 0 &&
          strcmp(vramd_backend_name(VRAMD_BACKEND_MMAP), "mmap") == 0 &&
          strcmp(vramd_backend_name(VRAMD_BACKEND_SDMA), "sdma") == 0 && !vramd_backend_name(VRAMD_BACKEND_AUTO) &&
          !vramd_backend_name(4), "backend names");
    CHECK(strcmp(vramd_compression_name(VRAMD_COMPRESSION_NONE), "none") == 0 &&
          strcmp(vramd_compression_name(VRAMD_COMPRESSION_ZSTD), "zstd") == 0 &&
          strcmp(vramd_compression_name(VRAMD_COMPRESSION_BPLANES), "bplanes") == 0 &&
          strcmp(vramd_compression_name(VRAMD_COMPRESSION_AUTO), "auto") == 0 &&
          !vramd_compression_name(VRAMD_COMPRESSION_DEFAULT) && !vramd_compression_name(5), "compression names");
    struct vramd_error err;
    struct vramd_conn *c = NULL;
    OK(test_connect(&c, &err), &err);
    for (int b = 0; b <= 4; b++) {
        const char *name = vramd_backend_name(b);
        CHECK(vramd_conn_has_backend_kind(c, b) == (name && vramd_conn_has_backend(c, name)), "backend %d", b);
    }
    CHECK(vramd_conn_has_backend_kind(c, VRAMD_BACKEND_MMAP), "the daemon has mmap");

    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(BO_BYTES, 43, 0, BO_BYTES);
    CHECK(dfd >= 0 && src >= 0, "setup");
    struct vramd_open_args a = VRAMD_OPEN_ARGS_INIT;
    a.kind = VRAMD_SESSION_DUMP;
    a.dir_fd = dfd;
    a.compression_kind = VRAMD_COMPRESSION_ZSTD;
    a.compression_level = 3;
    struct vramd_bo bo = VRAMD_BO_INIT;
    bo.id = 1, bo.fd = src, bo.size = BO_BYTES, bo.backend_kind = VRAMD_BACKEND_MMAP;
    struct vramd_session_info di;
    CHECK(dump_restore(c, &a, &bo, 1, src, &di, &err) == 0, "dump by enum");
    CHECK(strcmp(di.image.compression, "zstd:3") == 0, "compression by enum: %s", di.image.compression);
    a.compression = "zstd:3"; /* both spellings, agreeing */
    bo.backend = "mmap";
    CHECK(dump_restore(c, &a, &bo, 1, src, &di, &err) == 0, "dump by enum and string");
    CHECK(strcmp(di.image.compression, "zstd:3") == 0, "compression by both: %s", di.image.compression);

    struct vramd_token t;
    a.compression = "zstd:2";
    int r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EINVAL && strstr(err.message, "disagree"), "zstd:2 vs ZSTD 3: %d %s", r, err.message);
    a.compression = NULL;
    a.compression_kind = VRAMD_COMPRESSION_NONE;
    r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EINVAL, "none with a level: %d %s", r, err.message);
    a.compression_kind = 17;
    r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EINVAL, "compression_kind 17: %d %s", r, err.message);
    a.compression_kind = VRAMD_COMPRESSION_DEFAULT;
    a.compression_level = 0;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    bo.backend = "procmem"; /* disagrees with backend_kind MMAP */
    r = vramd_add_bos(c, &t, &bo, 1, NULL, &err);
    CHECK(r == -EINVAL && err.has_bo_id && err.bo_id == 1 && strstr(err.message, "disagree"), "backend: %d %s", r,
          err.message);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    vramd_close(c);

    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.backend = "sdma";
    cfg.backend_kind = VRAMD_BACKEND_MMAP;
    struct vramd_criu_bo cb = VRAMD_CRIU_BO_INIT;
    cb.id = 1, cb.fd = src, cb.size = BO_BYTES;
    r = vramd_criu_dump(&cfg, dfd, &cb, 1, NULL, &err);
    CHECK(r == -EINVAL && strstr(err.message, "vramd_criu_config"), "criu backend: %d %s", r, err.message);
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

const struct test abi_tests[] = {
    {"abi_sizes", t_abi_sizes, "all quick"},
    {"abi_refusals", t_abi_refusals, "all quick"},
    {"abi_enums", t_abi_enums, "all quick"},
    {NULL, NULL, NULL},
};
