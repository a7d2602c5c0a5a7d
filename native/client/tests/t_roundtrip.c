/* SPDX-License-Identifier: Apache-2.0 */
/* Round trips through a real daemon: memfd BOs, a > 4 GiB sparse BO, procmem ranges; API basics. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"

/* Dump bos[] into a fresh image dir, then restore into targets[] (same ids, same order). */
static int dump_then_restore(const struct vramd_bo *bos, const struct vramd_bo *targets, size_t n,
                             const char *compression, struct vramd_session_info *dinfo,
                             struct vramd_session_info *rinfo)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "image dir: %s", strerror(errno));
    int rc = 1;
    struct vramd_token t;
    if (test_connect(&c, &err) < 0) {
        fprintf(stderr, "  connect: %s\n", err.message);
        goto out;
    }
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .compression = compression,
                                .label = "ctest-dump"};
    if (vramd_open_session(c, &a, &t, NULL, &err) < 0 || vramd_add_bos(c, &t, bos, n, NULL, &err) < 0 ||
        vramd_start(c, &t, NULL, &err) < 0 || vramd_wait(c, &t, VRAMD_WAIT_FOREVER, dinfo, &err) < 0 ||
        vramd_close_session(c, &t, NULL, &err) < 0) {
        fprintf(stderr, "  dump: %s: %s\n", vramd_code_name(err.code), err.message);
        goto out;
    }
    a = (struct vramd_open_args){.kind = VRAMD_SESSION_RESTORE, .dir_fd = dfd, .label = "ctest-restore"};
    if (vramd_open_session(c, &a, &t, NULL, &err) < 0 || vramd_add_bos(c, &t, targets, n, NULL, &err) < 0 ||
        vramd_start(c, &t, NULL, &err) < 0 || vramd_wait(c, &t, VRAMD_WAIT_FOREVER, rinfo, &err) < 0 ||
        vramd_close_session(c, &t, NULL, &err) < 0) {
        fprintf(stderr, "  restore: %s: %s\n", vramd_code_name(err.code), err.message);
        goto out;
    }
    rc = 0;
out:
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return rc;
}

static int t_memfd_roundtrip(void)
{
    /* random, zero, odd sizes; two BOs sharing one fd at different offsets */
    static const struct {
        uint64_t size, data_len;
    } spec[] = {{1 << 20, 1 << 20}, {2 << 20, 0}, {4097, 4097}, {1, 1}, {12345, 12345}, {3 << 20, 5000}};
    enum { N = sizeof spec / sizeof spec[0] };
    int src[N], dst[N], shared = -1, shared_dst = -1;
    struct vramd_bo bos[N + 2], tg[N + 2];
    memset(bos, 0, sizeof bos);
    memset(tg, 0, sizeof tg);
    for (size_t i = 0; i < N; i++) {
        src[i] = make_memfd(spec[i].size, 100 + i, 0, spec[i].data_len);
        dst[i] = make_memfd(spec[i].size, 900 + i, 0, spec[i].size); /* garbage the restore must overwrite */
        CHECK(src[i] >= 0 && dst[i] >= 0, "memfd");
        bos[i] = (struct vramd_bo){.id = i + 1, .fd = src[i], .size = spec[i].size, .name = "bo"};
        tg[i] = (struct vramd_bo){.id = i + 1, .fd = dst[i]};
    }
    shared = make_memfd(64 << 10, 77, 0, 64 << 10);
    shared_dst = make_memfd(64 << 10, 78, 0, 64 << 10);
    CHECK(shared >= 0 && shared_dst >= 0, "memfd");
    bos[N] = (struct vramd_bo){.id = 100, .fd = shared, .offset = 0, .size = 4096, .has_gpu_id = true, .gpu_id = 0};
    bos[N + 1] = (struct vramd_bo){.id = 101, .fd = shared, .offset = 8192, .size = 40000, .backend = "mmap"};
    tg[N] = (struct vramd_bo){.id = 100, .fd = shared_dst, .offset = 0};
    tg[N + 1] = (struct vramd_bo){.id = 101, .fd = shared_dst, .offset = 8192, .backend = "mmap"};

    int rc = 0;
    for (int z = 0; z < 2 && !rc; z++) {
        struct vramd_session_info di, ri;
        rc = dump_then_restore(bos, tg, N + 2, z ? "zstd" : "none", &di, &ri);
        if (rc)
            break;
        CHECK(di.state == VRAMD_STATE_DONE && ri.state == VRAMD_STATE_DONE, "states %d %d", di.state, ri.state);
        CHECK(di.has_image && di.image.bo_count == N + 2, "image bo_count %u", di.image.bo_count);
        CHECK(strcmp(di.image.compression, z ? "zstd" : "none") == 0 || z, "compression %s", di.image.compression);
        for (size_t i = 0; i < N; i++) {
            long long bad = compare_fds(src[i], dst[i], spec[i].size);
            CHECK(bad < 0, "BO %zu differs at %lld", i + 1, bad);
        }
        uint8_t a[40000], b[40000];
        CHECK(pread(shared, a, 4096, 0) == 4096 && pread(shared_dst, b, 4096, 0) == 4096, "pread");
        CHECK(memcmp(a, b, 4096) == 0, "BO 100 differs");
        CHECK(pread(shared, a, 40000, 8192) == 40000 && pread(shared_dst, b, 40000, 8192) == 40000, "pread");
        CHECK(memcmp(a, b, 40000) == 0, "BO 101 differs");
        /* bytes of shared_dst outside the two BOs are untouched garbage */
        uint8_t want[4096];
        fill_pattern(want, 4096, 78, 4096);
        CHECK(pread(shared_dst, a, 4096, 4096) == 4096 && memcmp(a, want, 4096) == 0, "restore wrote outside a BO");
        /* a second pass must restore again over garbage */
        for (size_t i = 0; i < N; i++) {
            close(dst[i]);
            dst[i] = make_memfd(spec[i].size, 950 + i, 0, spec[i].size);
            CHECK(dst[i] >= 0, "memfd");
            tg[i].fd = dst[i];
        }
    }
    for (size_t i = 0; i < N; i++) {
        close(src[i]);
        close(dst[i]);
    }
    close(shared);
    close(shared_dst);
    return rc;
}

/* One BO larger than 4 GiB, sparse, with pattern data across the 4 GiB line and at both ends. */
static int t_big_sparse(void)
{
    uint64_t size = (uint64_t)env_num("VRAMD_TEST_BIG_BYTES", (4ll << 30) + 12345);
    uint64_t off = size > (4ull << 30) ? (4ull << 30) - (300 << 10) : size / 2;
    uint64_t len = 700 << 10;
    if (off + len > size)
        len = size - off;
    int src = make_memfd(size, 4242, off, len);
    int dst = memfd_create("vramd-test-big-target", MFD_CLOEXEC);
    CHECK(src >= 0 && dst >= 0, "memfd");
    CHECK(ftruncate(dst, (off_t)size) == 0, "ftruncate");
    /* garbage in the target where the image has zeros: the restore must clear it */
    uint8_t junk[8192];
    fill_pattern(junk, sizeof junk, 1, 0);
    CHECK(pwrite(dst, junk, sizeof junk, 0) == (ssize_t)sizeof junk, "pwrite");
    CHECK(pwrite(dst, junk, sizeof junk, (off_t)(size - sizeof junk)) == (ssize_t)sizeof junk, "pwrite");
    struct vramd_bo bo = {.id = 7, .fd = src, .size = size, .name = "big"};
    struct vramd_bo tg = {.id = 7, .fd = dst};
    struct vramd_session_info di, ri;
    int rc = dump_then_restore(&bo, &tg, 1, "none", &di, &ri);
    if (!rc) {
        CHECK(di.image.bo_bytes == size, "image bo_bytes %llu", (unsigned long long)di.image.bo_bytes);
        CHECK(di.image.zero_bytes >= size - len - (2u << 20), "zero_bytes %llu: the holes were stored",
              (unsigned long long)di.image.zero_bytes);
        CHECK(ri.progress.bytes_done == size, "restored %llu bytes", (unsigned long long)ri.progress.bytes_done);
        long long bad = check_memfd(dst, size, 4242, off, len);
        CHECK(bad < 0, "big BO differs at %lld", bad);
    }
    close(src);
    close(dst);
    return rc;
}

/* procmem: ranges of a child's memory, restored into another child at the same addresses. */
static int t_procmem_roundtrip(void)
{
    static const size_t sizes[] = {256 << 10, 64 << 10, 5000, 4096 * 3 + 17, 1 << 20};
    enum { N = sizeof sizes / sizeof sizes[0] };
    uint8_t *reg[N];
    for (size_t i = 0; i < N; i++) {
        reg[i] = mmap(NULL, sizes[i] + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(reg[i] != MAP_FAILED, "mmap");
        if (i == 1)
            memset(reg[i], 0, sizes[i]); /* a zero BO */
        else
            fill_pattern(reg[i] + 3, sizes[i], 500 + i, 0); /* odd start address */
    }
    struct child a = {0}, b = {0};
    CHECK(spawn_holder(&a) == 0, "fork");
    /* the parent's copies become garbage; the second child sees garbage */
    for (size_t i = 0; i < N; i++)
        fill_pattern(reg[i], sizes[i] + 4096, 7000 + i, 0);
    CHECK(spawn_holder(&b) == 0, "fork");
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/mem", (int)a.pid);
    int mem_a = open(p, O_RDONLY | O_CLOEXEC);
    snprintf(p, sizeof p, "/proc/%d/mem", (int)b.pid);
    int mem_b = open(p, O_RDWR | O_CLOEXEC);
    CHECK(mem_a >= 0 && mem_b >= 0, "open /proc/pid/mem: %s", strerror(errno));
    struct vramd_bo bos[N], tg[N];
    for (size_t i = 0; i < N; i++) {
        uint64_t addr = (uint64_t)(uintptr_t)reg[i] + (i == 1 ? 0 : 3);
        bos[i] = (struct vramd_bo){.id = 10 + i, .fd = mem_a, .offset = addr, .size = sizes[i], .va_addr = addr};
        tg[i] = (struct vramd_bo){.id = 10 + i, .fd = mem_b, .offset = addr, .backend = "procmem"};
    }
    struct vramd_session_info di, ri;
    int rc = dump_then_restore(bos, tg, N, "zstd:3", &di, &ri);
    for (size_t i = 0; !rc && i < N; i++) {
        uint8_t *got = malloc(sizes[i]), *want = malloc(sizes[i]);
        CHECK(got && want, "malloc");
        if (i == 1)
            memset(want, 0, sizes[i]);
        else
            fill_pattern(want, sizes[i], 500 + i, 0);
        ssize_t n = pread(mem_b, got, sizes[i], (off_t)bos[i].offset);
        int same = n == (ssize_t)sizes[i] && memcmp(got, want, sizes[i]) == 0;
        free(got);
        free(want);
        CHECK(same, "procmem BO %zu differs in the target process", i);
    }
    close(mem_a);
    close(mem_b);
    CHECK(release_holder(&a) == 0 && release_holder(&b) == 0, "holder exit");
    for (size_t i = 0; i < N; i++)
        munmap(reg[i], sizes[i] + 4096);
    return rc;
}

/* Many BOs, one memfd each: more fds than one packet carries; and many BOs on few fds. */
static int t_many_fds(void)
{
    enum { N = 600, M = 3000 };
    int *src = calloc(N, sizeof *src), *dst = calloc(N, sizeof *dst);
    struct vramd_bo *bos = calloc(N + M, sizeof *bos), *tg = calloc(N + M, sizeof *tg);
    CHECK(src && dst && bos && tg, "calloc");
    int few_src[4], few_dst[4];
    for (int i = 0; i < 4; i++) {
        few_src[i] = make_memfd(M / 4 * 512, 40 + i, 0, M / 4 * 512);
        few_dst[i] = make_memfd(M / 4 * 512, 60 + i, 0, 0);
        CHECK(few_src[i] >= 0 && few_dst[i] >= 0, "memfd");
    }
    for (int i = 0; i < N; i++) {
        src[i] = make_memfd(4096, 3000 + i, 0, 4096);
        dst[i] = make_memfd(4096, 0, 0, 0);
        CHECK(src[i] >= 0 && dst[i] >= 0, "memfd %d", i);
        bos[i] = (struct vramd_bo){.id = 1000 + i, .fd = src[i], .size = 4096};
        tg[i] = (struct vramd_bo){.id = 1000 + i, .fd = dst[i]};
    }
    for (int j = 0; j < M; j++) {
        int f = j % 4;
        uint64_t o = (uint64_t)(j / 4) * 512;
        bos[N + j] = (struct vramd_bo){.id = 100000 + j, .fd = few_src[f], .offset = o, .size = 512};
        tg[N + j] = (struct vramd_bo){.id = 100000 + j, .fd = few_dst[f], .offset = o};
    }
    struct vramd_session_info di, ri;
    int rc = dump_then_restore(bos, tg, N + M, "none", &di, &ri);
    if (!rc) {
        CHECK(di.image.bo_count == N + M, "bo_count %u", di.image.bo_count);
        CHECK(ri.progress.bos_done == N + M, "bos_done %u", ri.progress.bos_done);
        for (int i = 0; i < N; i++) {
            long long bad = compare_fds(src[i], dst[i], 4096);
            CHECK(bad < 0, "BO %d differs at %lld", 1000 + i, bad);
        }
        for (int i = 0; i < 4; i++) {
            long long bad = compare_fds(few_src[i], few_dst[i], M / 4 * 512);
            CHECK(bad < 0, "shared fd %d differs at %lld", i, bad);
        }
    }
    for (int i = 0; i < N; i++) {
        close(src[i]);
        close(dst[i]);
    }
    for (int i = 0; i < 4; i++) {
        close(few_src[i]);
        close(few_dst[i]);
    }
    free(src);
    free(dst);
    free(bos);
    free(tg);
    return rc;
}

static int t_verify(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(3 << 20, 11, 1 << 20, 1 << 20);
    CHECK(dfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .chunk_size = 1 << 20};
    struct vramd_token t;
    struct vramd_bo bo = {.id = 1, .fd = src, .size = 3 << 20};
    struct vramd_session_info info;
    OK(vramd_open_session(c, &a, &t, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_OPEN && info.kind == VRAMD_SESSION_DUMP, "state %d kind %d", info.state, info.kind);
    OK(vramd_add_bos(c, &t, &bo, 1, &info, &err), &err);
    CHECK(info.progress.bos_total == 1, "bos_total %u", info.progress.bos_total);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 60000, &info, &err), &err);
    CHECK(info.image.chunk_size == 1 << 20 && info.image.zero_bytes == 2 << 20, "chunk %llu zero %llu",
          (unsigned long long)info.image.chunk_size, (unsigned long long)info.image.zero_bytes);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    a = (struct vramd_open_args){.kind = VRAMD_SESSION_VERIFY, .dir_fd = dfd};
    OK(vramd_open_session(c, &a, &t, &info, &err), &err);
    CHECK(info.has_image && info.image.bo_count == 1, "verify image summary");
    OK(vramd_wait(c, &t, VRAMD_WAIT_FOREVER, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_DONE, "verify state %d", info.state);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    /* the token is gone now */
    int r = vramd_progress(c, &t, NULL, &err);
    CHECK(r == -ENOENT && err.code == VRAMD_CODE_NOT_FOUND, "closed token: %d %s", r, vramd_code_name(err.code));
    vramd_close(c);
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

static int t_hello_status(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    OK(test_connect(&c, &err), &err);
    CHECK(vramd_conn_version(c) == VRAMD_PROTOCOL_VERSION && VRAMD_PROTOCOL_VERSION == 2, "version %u",
          vramd_conn_version(c));
    CHECK(strncmp(vramd_conn_server(c), "vramd", 5) == 0, "server %s", vramd_conn_server(c));
    const struct vramd_limits *l = vramd_conn_limits(c);
    CHECK(l->max_message_bytes >= 4096 && l->max_fds_per_message >= 1 && l->max_fds_per_message <= 253, "limits");
    CHECK(vramd_conn_has_backend(c, "procmem") && vramd_conn_has_backend(c, "mmap"), "backends");
    CHECK(!vramd_conn_has_backend(c, "nonesuch"), "unknown backend listed");
    struct vramd_status st;
    OK(vramd_status(c, &st, &err), &err);
    CHECK(st.version == 2 && st.connections >= 1 && !st.draining, "status %u", st.version);
    vramd_close(c);
    return 0;
}

static int t_tokens(void)
{
    struct vramd_token t, u;
    for (int i = 0; i < 16; i++)
        t.bytes[i] = (uint8_t)(i * 17 + 3);
    char s[33];
    vramd_token_format(&t, s);
    CHECK(strlen(s) == 32 && strspn(s, "0123456789abcdef") == 32, "format %s", s);
    CHECK(vramd_token_parse(s, &u) == 0 && memcmp(&t, &u, sizeof t) == 0, "round trip");
    CHECK(vramd_token_parse("00", &u) == -EINVAL, "short");
    CHECK(vramd_token_parse("0123456789abcdef0123456789abcdeg", &u) == -EINVAL, "non-hex");
    CHECK(vramd_token_parse("0123456789abcdef0123456789abcdef0", &u) == -EINVAL, "long");
    CHECK(strcmp(vramd_code_name(VRAMD_CODE_CORRUPT_CHUNK), "CORRUPT_CHUNK") == 0, "code name");
    CHECK(vramd_code_errno(VRAMD_CODE_NOT_FOUND) == -ENOENT && vramd_code_errno(12345) == -EREMOTEIO, "errno map");
    CHECK(strcmp(vramd_strerror(-ENOENT), "No such file or directory") == 0, "strerror");
    return 0;
}

static int setenv_opt(const char *k, const char *v)
{
    return v ? setenv(k, v, 1) : unsetenv(k);
}

static int t_socket_path(void)
{
    char *saved_sock = getenv("VRAMD_SOCKET") ? strdup(getenv("VRAMD_SOCKET")) : NULL;
    char *saved_xdg = getenv("XDG_RUNTIME_DIR") ? strdup(getenv("XDG_RUNTIME_DIR")) : NULL;
    char buf[PATH_MAX], want[PATH_MAX], dir[PATH_MAX];
    struct stat st;
    bool system = stat(VRAMD_SYSTEM_SOCKET, &st) == 0;
    int rc = 1;
    snprintf(dir, sizeof dir, "/tmp/vramd-xdg-XXXXXX");
    CHECK(mkdtemp(dir), "mkdtemp");

    setenv("VRAMD_SOCKET", "/some/where.sock", 1);
    if (vramd_socket_path(buf, sizeof buf) < 0 || strcmp(buf, "/some/where.sock") != 0)
        goto out;
    CHECK(vramd_socket_path(buf, 5) == -ENAMETOOLONG, "short buffer");
    unsetenv("VRAMD_SOCKET");
    setenv("XDG_RUNTIME_DIR", dir, 1);
    snprintf(want, sizeof want, "%s/vramd/vramd.sock", dir);
    /* the system socket first whenever it exists, else the user's: whether the user's exists or not */
    if (vramd_socket_path(buf, sizeof buf) < 0 || strcmp(buf, system ? VRAMD_SYSTEM_SOCKET : want) != 0)
        goto out;
    char sub[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/vramd", dir);
    mkdir(sub, 0700);
    int fd = open(want, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    CHECK(fd >= 0, "create %s", want);
    close(fd);
    if (vramd_socket_path(buf, sizeof buf) < 0 || strcmp(buf, system ? VRAMD_SYSTEM_SOCKET : want) != 0)
        goto out;
    unlink(want);
    rmdir(sub);
    /* without XDG_RUNTIME_DIR: /tmp/vramd-<uid> only for a uid other than root; root gets the system path */
    unsetenv("XDG_RUNTIME_DIR");
    snprintf(want, sizeof want, "/tmp/vramd-%u/vramd.sock", (unsigned)getuid());
    bool root = getuid() == 0 || geteuid() == 0;
    if (vramd_socket_path(buf, sizeof buf) < 0 || strcmp(buf, system || root ? VRAMD_SYSTEM_SOCKET : want) != 0)
        goto out;
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "  socket path resolved to %s\n", buf);
    rmdir(dir);
    setenv_opt("VRAMD_SOCKET", saved_sock);
    setenv_opt("XDG_RUNTIME_DIR", saved_xdg);
    free(saved_sock);
    free(saved_xdg);
    return rc;
}

/* min_fd placement, FD_CLOEXEC, and adopting a socket connected by someone else. */
static int t_fd_placement(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    struct vramd_options o;
    vramd_options_init(&o);
    o.min_fd = 700;
    o.timeout_ms = 10000;
    OK(vramd_connect_path(&c, daemon_socket(), &o, &err), &err);
    int fd = vramd_conn_fd(c);
    CHECK(fd >= 700, "socket at fd %d, wanted >= 700", fd);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC, "no FD_CLOEXEC");
    vramd_close(c);
    CHECK(fcntl(fd, F_GETFD) < 0 && errno == EBADF, "fd %d still open after vramd_close", fd);

    int s = socket(AF_UNIX, SOCK_SEQPACKET, 0); /* no CLOEXEC on purpose: adopt sets it */
    CHECK(s >= 0, "socket");
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", daemon_socket());
    CHECK(connect(s, (struct sockaddr *)&sa, sizeof sa) == 0, "connect: %s", strerror(errno));
    OK(vramd_connect_fd(&c, s, NULL, &err), &err);
    CHECK(vramd_conn_fd(c) == s && (fcntl(s, F_GETFD) & FD_CLOEXEC), "adopted fd");
    struct vramd_status st;
    OK(vramd_status(c, &st, &err), &err);
    vramd_close(c);
    /* adopting something that is not a SEQPACKET socket fails and still takes the fd */
    int p[2];
    CHECK(pipe2(p, O_CLOEXEC) == 0, "pipe");
    int r = vramd_connect_fd(&c, p[0], NULL, &err);
    CHECK(r < 0 && c == NULL, "adopting a pipe: %d", r);
    CHECK(fcntl(p[0], F_GETFD) < 0, "the refused fd was not closed");
    close(p[1]);
    return 0;
}

/* Wait with a timeout: TIMEOUT is its own code, the session goes on, the connection stays usable. */
static int t_wait_timeout(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t;
    struct vramd_session_info info;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    int r = vramd_wait(c, &t, 50, &info, &err); /* never started: cannot end by itself */
    CHECK(r == -ETIMEDOUT && err.code == VRAMD_CODE_TIMEOUT, "wait: %d %s", r, vramd_code_name(err.code));
    CHECK(info.state == VRAMD_STATE_OPEN, "state after TIMEOUT %d", info.state);
    r = vramd_wait(c, &t, 0, &info, &err); /* 0 polls */
    CHECK(r == -ETIMEDOUT, "poll: %d", r);
    CHECK(!vramd_conn_broken(c), "a Wait timeout broke the connection");
    OK(vramd_progress(c, &t, &info, &err), &err);
    OK(vramd_cancel(c, &t, "test cancels", &info, &err), &err);
    r = vramd_wait(c, &t, VRAMD_WAIT_FOREVER, &info, &err);
    CHECK(r == -ECANCELED && err.code == VRAMD_CODE_CANCELLED, "after cancel: %d %s", r, vramd_code_name(err.code));
    CHECK(info.state == VRAMD_STATE_CANCELLED && info.error.code == VRAMD_CODE_CANCELLED, "info after cancel");
    CHECK(strstr(info.error.message, "test cancels"), "reason lost: %s", info.error.message);
    r = vramd_wait(c, &t, 0, &info, &err); /* a poll of an ended session answers its outcome, not TIMEOUT */
    CHECK(r == -ECANCELED && err.code == VRAMD_CODE_CANCELLED, "poll after the end: %d %s", r,
          vramd_code_name(err.code));
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/*
 * The operator's calls: a session that copies a child's memory is listed with that child as its target;
 * another connection cancels it by its session id (without its token); an unknown id is NOT_FOUND.
 */
static int t_cancel_by_id(void)
{
    static uint8_t region[64 << 10];
    fill_pattern(region, sizeof region, 77, 0);
    struct child ch = {0};
    CHECK(spawn_holder(&ch) == 0, "fork");
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/mem", (int)ch.pid);
    int mem = open(p, O_RDONLY | O_CLOEXEC);
    CHECK(mem >= 0, "open %s: %s", p, strerror(errno));
    struct vramd_conn *c = NULL, *op = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    OK(test_connect(&c, &err), &err);
    OK(test_connect(&op, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .label = "ctest cancel_by_id"};
    struct vramd_token t;
    struct vramd_session_info info;
    OK(vramd_open_session(c, &a, &t, &info, &err), &err);
    uint64_t id = info.session_id;
    struct vramd_bo bo = {.id = 1, .fd = mem, .offset = (uint64_t)(uintptr_t)region, .size = sizeof region};
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    close(mem); /* the daemon has its own copy: the target pid comes from that */

    int n = vramd_list_sessions(op, NULL, 0, &err);
    CHECK(n >= 1, "list_sessions(cap 0) -> %d %s", n, err.message);
    struct vramd_session_entry list[16];
    n = vramd_list_sessions(op, list, 16, &err);
    CHECK(n >= 1 && n <= 16, "list_sessions -> %d %s", n, err.message);
    const struct vramd_session_entry *e = NULL;
    for (int i = 0; i < n; i++)
        if (list[i].info.session_id == id)
            e = &list[i];
    CHECK(e, "session %llu not listed", (unsigned long long)id);
    CHECK(e->info.uid == geteuid() && e->info.pid == getpid(), "uid %u pid %d", e->info.uid, e->info.pid);
    CHECK(e->n_target_pids == 1 && e->target_pids[0] == ch.pid, "target pids: %zu, first %d (child %d)",
          e->n_target_pids, e->n_target_pids ? e->target_pids[0] : -1, (int)ch.pid);
    CHECK(e->info.state == VRAMD_STATE_OPEN, "state %d", e->info.state);
    CHECK(e->info.progress.bytes_total == sizeof region, "bytes_total %llu",
          (unsigned long long)e->info.progress.bytes_total);
    CHECK(e->age_s >= 0 && e->rate_bytes_per_s >= 0, "age %g rate %g", e->age_s, e->rate_bytes_per_s);

    /* the operator's connection cancels it by id: the opener's Wait sees CANCELLED with the reason */
    OK(vramd_cancel_by_id(op, id, "ctest operator", &info, &err), &err);
    CHECK(info.session_id == id, "cancel answered session %llu", (unsigned long long)info.session_id);
    int r = vramd_wait(c, &t, VRAMD_WAIT_FOREVER, &info, &err);
    CHECK(r == -ECANCELED && err.code == VRAMD_CODE_CANCELLED, "after cancel by id: %d %s", r,
          vramd_code_name(err.code));
    CHECK(strstr(info.error.message, "ctest operator"), "reason lost: %s", info.error.message);
    r = vramd_cancel_by_id(op, UINT64_MAX, NULL, NULL, &err);
    CHECK(r == -ENOENT && err.code == VRAMD_CODE_NOT_FOUND, "unknown id: %d %s", r, vramd_code_name(err.code));
    CHECK(!vramd_conn_broken(op), "a refused cancel broke the connection");
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    n = vramd_list_sessions(op, list, 16, &err);
    for (int i = 0; i < n; i++)
        CHECK(list[i].info.session_id != id, "closed session %llu still listed", (unsigned long long)id);
    vramd_close(op);
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    CHECK(release_holder(&ch) == 0, "child");
    return 0;
}

/*
 * Against a daemon configured with max_message_bytes 4096 and max_fds_per_message 7
 * (tests/test_libvramd.py starts one): AddBos lists are split to fit, and a BO that
 * cannot fit in any message is refused here without breaking the connection.
 */
static int t_tight_limits(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    OK(test_connect(&c, &err), &err);
    const struct vramd_limits *l = vramd_conn_limits(c);
    CHECK(l->max_message_bytes == 4096 && l->max_fds_per_message == 7, "limits %u %u (start the daemon with them)",
          l->max_message_bytes, l->max_fds_per_message);
    enum { NF = 40, NS = 1500 };
    int src[NF + 3], dst[NF + 3];
    struct vramd_bo bos[NF + NS], tg[NF + NS];
    for (int i = 0; i < NF + 3; i++) {
        uint64_t size = i < NF ? 8192 : NS / 3 * 256;
        src[i] = make_memfd(size, 70 + i, 0, size);
        dst[i] = make_memfd(size, 0, 0, 0);
        CHECK(src[i] >= 0 && dst[i] >= 0, "memfd");
    }
    for (int i = 0; i < NF; i++) { /* 40 fds: at least 6 messages of at most 7 fds */
        bos[i] = (struct vramd_bo){.id = i + 1, .fd = src[i], .size = 8192, .name = "fd-bound"};
        tg[i] = (struct vramd_bo){.id = i + 1, .fd = dst[i]};
    }
    for (int j = 0; j < NS; j++) { /* 1500 BOs on 3 fds: many messages of at most ~3 KiB */
        int f = NF + j % 3;
        uint64_t o = (uint64_t)(j / 3) * 256;
        bos[NF + j] = (struct vramd_bo){.id = 1000 + j, .fd = src[f], .offset = o, .size = 256,
                                        .va_addr = 0x7f0000000000ull + o, .alloc_flags = 0x80000001, .name = "byte-bound"};
        tg[NF + j] = (struct vramd_bo){.id = 1000 + j, .fd = dst[f], .offset = o};
    }
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    struct vramd_token t;
    struct vramd_session_info info;
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    /* a name too long for any message: refused before sending, the session and connection unharmed */
    static char longname[6000];
    memset(longname, 'x', sizeof longname - 1);
    struct vramd_bo huge = {.id = 99999, .fd = src[0], .size = 1, .name = longname};
    int r = vramd_add_bos(c, &t, &huge, 1, NULL, &err);
    CHECK(r == -E2BIG && !vramd_conn_broken(c), "oversized BO: %d %s", r, err.message);
    OK(vramd_add_bos(c, &t, bos, NF + NS, &info, &err), &err);
    CHECK(info.progress.bos_total == NF + NS, "bos_total %u", info.progress.bos_total);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 60000, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    a.kind = VRAMD_SESSION_RESTORE;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    OK(vramd_add_bos(c, &t, tg, NF + NS, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 60000, &info, &err), &err);
    CHECK(info.progress.bos_done == NF + NS, "bos_done %u", info.progress.bos_done);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    struct vramd_status st; /* the metrics text makes this the largest reply (~3 KiB here) */
    OK(vramd_status(c, &st, &err), &err);
    for (int i = 0; i < NF + 3; i++) {
        long long bad = compare_fds(src[i], dst[i], i < NF ? 8192 : NS / 3 * 256);
        CHECK(bad < 0, "fd %d differs at %lld", i, bad);
        close(src[i]);
        close(dst[i]);
    }
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* One session of `kind` over dfd with parents, BOs added, run to its end; returns its rc (err filled). */
static int run_with_parents(struct vramd_conn *c, int kind, int dfd, const int *parents, size_t np,
                            struct vramd_bo *bos, size_t n, struct vramd_session_info *info, struct vramd_error *err)
{
    struct vramd_open_args a = {.kind = kind, .dir_fd = dfd, .chunk_size = 1 << 20, .parent_dir_fds = parents,
                                .n_parent_dir_fds = np, .parent_hint = kind == VRAMD_SESSION_DUMP && np ? "../p" : NULL};
    struct vramd_token t;
    int r = vramd_open_session(c, &a, &t, NULL, err);
    if (r < 0)
        return r;
    if ((r = vramd_add_bos(c, &t, bos, n, NULL, err)) >= 0 && (r = vramd_start(c, &t, NULL, err)) >= 0)
        r = vramd_wait(c, &t, VRAMD_WAIT_FOREVER, info, err);
    struct vramd_error ignored;
    vramd_close_session(c, &t, NULL, &ignored);
    return r;
}

/*
 * Against the tight daemon of tight_limits (max_fds_per_message 7): an image with three parents needs
 * four images' data files (each as many as the daemon asks a dump for per GPU), each attached with its
 * O_DIRECT twin where the file system allows: more files than one AttachFiles carries, for the child's
 * dump (its parents' files) and for its restore.
 */
static int t_tight_limits_chain(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    struct vramd_session_info info;
    OK(test_connect(&c, &err), &err);
    CHECK(vramd_conn_limits(c)->max_fds_per_message == 7, "start the daemon with max_fds_per_message 7");
    enum { N = 4 };
    char path[N][PATH_MAX];
    int dir[N], src[N], dst[N];
    struct vramd_bo bos[N], tg[N];
    for (int k = 0; k < N; k++) {
        dir[k] = make_image_dir(path[k]);
        src[k] = make_memfd(1 << 20, 600 + k, 0, 1 << 20);
        dst[k] = make_memfd(1 << 20, 0, 0, 0);
        CHECK(dir[k] >= 0 && src[k] >= 0 && dst[k] >= 0, "setup");
        bos[k] = (struct vramd_bo){.id = k + 1, .fd = src[k], .size = 1 << 20};
        tg[k] = (struct vramd_bo){.id = k + 1, .fd = dst[k]};
    }
    /* image k holds BOs 1..k+1, the new one only stored; its parents are images k-1..0, nearest first */
    for (int k = 0; k < N; k++) {
        int parents[N];
        for (int j = 0; j < k; j++)
            parents[j] = dir[k - 1 - j];
        OK(run_with_parents(c, VRAMD_SESSION_DUMP, dir[k], parents, (size_t)k, bos, (size_t)k + 1, &info, &err),
           &err);
        CHECK(info.image.stored_bytes == 1 << 20, "image %d stored %llu bytes", k,
              (unsigned long long)info.image.stored_bytes);
    }
    int parents[N - 1] = {dir[2], dir[1], dir[0]};
    OK(run_with_parents(c, VRAMD_SESSION_RESTORE, dir[N - 1], parents, N - 1, tg, N, &info, &err), &err);
    for (int k = 0; k < N; k++)
        CHECK(compare_fds(src[k], dst[k], 1 << 20) < 0, "BO %d differs", k + 1);
    OK(run_with_parents(c, VRAMD_SESSION_VERIFY, dir[N - 1], parents, N - 1, NULL, 0, &info, &err), &err);
    vramd_close(c);
    for (int k = N - 1; k >= 0; k--) {
        close(dir[k]);
        close(src[k]);
        close(dst[k]);
        remove_dir(path[k]);
    }
    return 0;
}

static int t_incremental(void)
{
    /* parent: weights + cache; child: same weights, new cache, dumped with the parent's directory fd */
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    struct vramd_session_info info;
    char ppath[PATH_MAX], cpath[PATH_MAX];
    int pfd = make_image_dir(ppath), cfd = make_image_dir(cpath);
    int w = make_memfd(3 << 20, 21, 0, 3 << 20), k1 = make_memfd(1 << 20, 22, 0, 1 << 20);
    int k2 = make_memfd(1 << 20, 23, 0, 1 << 20);
    int ow = make_memfd(3 << 20, 99, 0, 3 << 20), ok2 = make_memfd(1 << 20, 98, 0, 1 << 20);
    CHECK(pfd >= 0 && cfd >= 0 && w >= 0 && k1 >= 0 && k2 >= 0 && ow >= 0 && ok2 >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_bo bos[2] = {{.id = 1, .fd = w, .size = 3 << 20}, {.id = 2, .fd = k1, .size = 1 << 20}};
    OK(run_with_parents(c, VRAMD_SESSION_DUMP, pfd, NULL, 0, bos, 2, &info, &err), &err);
    bos[1].fd = k2;
    OK(run_with_parents(c, VRAMD_SESSION_DUMP, cfd, &pfd, 1, bos, 2, &info, &err), &err);
    CHECK(info.image.stored_bytes == 1 << 20, "child stored %llu (only the new cache)",
          (unsigned long long)info.image.stored_bytes);
    struct vramd_bo tg[2] = {{.id = 1, .fd = ow}, {.id = 2, .fd = ok2}};
    /* without its parent: PARENT_MISSING at open, before any byte is written */
    int r = run_with_parents(c, VRAMD_SESSION_RESTORE, cfd, NULL, 0, tg, 2, &info, &err);
    CHECK(r == -ENOENT && err.code == VRAMD_CODE_PARENT_MISSING, "no parent: %d %s", r, vramd_code_name(err.code));
    CHECK(check_memfd(ow, 3 << 20, 99, 0, 3 << 20) < 0, "a restore without its parent wrote a byte");
    /* another image as its parent: PARENT_MISMATCH */
    r = run_with_parents(c, VRAMD_SESSION_RESTORE, cfd, &cfd, 1, tg, 2, &info, &err);
    CHECK(r == -EBADMSG && err.code == VRAMD_CODE_PARENT_MISMATCH, "wrong parent: %d %s", r,
          vramd_code_name(err.code));
    int bad = -1;
    r = run_with_parents(c, VRAMD_SESSION_RESTORE, cfd, &bad, 1, tg, 2, &info, &err);
    CHECK(r == -EBADF && err.code == VRAMD_CODE_LOCAL, "negative parent fd: %d", r);
    OK(run_with_parents(c, VRAMD_SESSION_RESTORE, cfd, &pfd, 1, tg, 2, &info, &err), &err);
    CHECK(compare_fds(w, ow, 3 << 20) < 0 && compare_fds(k2, ok2, 1 << 20) < 0, "restored bytes differ");
    OK(run_with_parents(c, VRAMD_SESSION_VERIFY, cfd, &pfd, 1, NULL, 0, &info, &err), &err);
    vramd_close(c);
    int fds[] = {pfd, cfd, w, k1, k2, ow, ok2};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
        close(fds[i]);
    remove_dir(cpath);
    remove_dir(ppath);
    return 0;
}

const struct test roundtrip_tests[] = {
    {"tokens", t_tokens, "all unit"},
    {"socket_path", t_socket_path, "all unit"},
    {"hello_status", t_hello_status, "all quick"},
    {"fd_placement", t_fd_placement, "all quick"},
    {"wait_timeout", t_wait_timeout, "all quick"},
    {"cancel_by_id", t_cancel_by_id, "all quick"},
    {"memfd_roundtrip", t_memfd_roundtrip, "all quick"},
    {"procmem_roundtrip", t_procmem_roundtrip, "all quick"},
    {"many_fds", t_many_fds, "all quick"},
    {"verify", t_verify, "all quick"},
    {"incremental", t_incremental, "all quick"},
    {"big_sparse", t_big_sparse, "all big"},
    {"tight_limits", t_tight_limits, "limits"},
    {"tight_limits_chain", t_tight_limits_chain, "limits"},
    {NULL, NULL, NULL},
};
