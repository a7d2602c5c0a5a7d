/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CRIU process topology: the restored task submits its restore and goes
 * on rebuilding its memory while CRIU main (the parent) attaches by token on
 * its own connection and waits at the barrier.  One task, then three at once.
 *
 *   VRAMD_TEST_TOUCH_MB     memory each restored task rebuilds meanwhile (default 1024)
 *   VRAMD_TEST_RESTORE_MB   BO bytes per restored task (default 64)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define NBO 5

struct task_image {
    char path[PATH_MAX];
    int dir_fd;
    uint64_t sizes[NBO];
    uint64_t seed;
};

static void bo_sizes(uint64_t total, uint64_t sizes[NBO])
{
    /* one big BO, a few small and odd ones */
    sizes[1] = 4096;
    sizes[2] = 12345;
    sizes[3] = 1;
    sizes[4] = 2 << 20;
    sizes[0] = total > sizes[4] + 20000 ? total - sizes[4] - 4096 - 12345 - 1 : 1 << 20;
}

/* CRIU's dump of one task, through the hook adapter. */
static int dump_task(struct task_image *ti, uint64_t seed)
{
    ti->seed = seed;
    ti->dir_fd = make_image_dir(ti->path);
    CHECK(ti->dir_fd >= 0, "image dir");
    bo_sizes((uint64_t)env_num("VRAMD_TEST_RESTORE_MB", 64) << 20, ti->sizes);
    int fds[NBO];
    struct vramd_criu_bo bos[NBO];
    for (int i = 0; i < NBO; i++) {
        fds[i] = make_memfd(ti->sizes[i], seed + i, 0, ti->sizes[i]);
        CHECK(fds[i] >= 0, "memfd");
        bos[i] = (struct vramd_criu_bo){.id = (uint64_t)i, .fd = fds[i], .size = ti->sizes[i], .gpu_id = 0,
                                        .alloc_flags = 1, .va_addr = 0x7f0000000000ull + ((uint64_t)i << 32)};
    }
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.timeout_ms = 30000;
    cfg.label = "ctest criu dump";
    struct vramd_session_info info;
    struct vramd_error err;
    OK(vramd_criu_dump(&cfg, ti->dir_fd, bos, NBO, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_DONE && info.image.bo_count == NBO, "dump state %d", info.state);
    for (int i = 0; i < NBO; i++)
        close(fds[i]);
    return 0;
}

static void drop_image(struct task_image *ti)
{
    close(ti->dir_fd);
    remove_dir(ti->path);
}

/* Touch `mb` MiB of fresh memory (CRIU restoring the task's pages), return a checksum. */
static uint64_t rebuild_memory(long long mb)
{
    size_t len = (size_t)mb << 20;
    uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return 0;
    uint64_t sum = 0;
    for (size_t i = 0; i < len; i += 4096) {
        p[i] = (uint8_t)(i >> 12);
        sum += p[i];
    }
    munmap(p, len);
    return sum + 1;
}

enum handoff { VIA_SOCKET, VIA_TABLE };

/*
 * The restored task: create the target "dmabufs" (memfds), submit the restore,
 * hand the ticket over, close everything the hook opened, rebuild memory,
 * then (once CRIU main releases it) check that its BOs hold the image's bytes.
 * Exit status: 0 ok, 10+ submit failure, 20+ fd leak, 30+ content mismatch.
 */
static void restored_task(const struct task_image *ti, enum handoff how, int ticket_sock,
                          struct vramd_criu_table *table, int notify_w, int go_r)
{
    int fds[NBO];
    struct vramd_criu_bo bos[NBO];
    for (int i = 0; i < NBO; i++) {
        fds[i] = make_memfd(ti->sizes[i], 5555, 0, ti->sizes[i] < 65536 ? ti->sizes[i] : 65536);
        if (fds[i] < 0)
            _exit(10);
        bos[i] = (struct vramd_criu_bo){.id = (uint64_t)i, .fd = fds[i]};
    }
    int before = count_fds();
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.timeout_ms = 30000;
    cfg.min_fd = 300; /* above the fds the task is getting back */
    cfg.label = "ctest restored task";
    struct vramd_criu_ticket tk;
    struct vramd_error err;
    int r = vramd_criu_restore_submit(&cfg, ti->dir_fd, bos, NBO, 0, &tk, &err);
    if (r < 0) {
        fprintf(stderr, "  task %d: submit: %s: %s\n", (int)getpid(), vramd_code_name(err.code), err.message);
        _exit(11);
    }
    if (count_fds() != before)
        _exit(20); /* the hook must leave no fd behind in the restored task */
    if (how == VIA_SOCKET)
        r = vramd_criu_ticket_send(ticket_sock, &tk, &err);
    else
        r = vramd_criu_table_publish(table, &tk);
    if (r < 0)
        _exit(12);
    char one = 1;
    if (notify_w >= 0 && write(notify_w, &one, 1) != 1)
        _exit(13);
    if (!rebuild_memory(env_num("VRAMD_TEST_TOUCH_MB", 1024)))
        _exit(14);
    /* CRIU main releases the task after RESUME_DEVICES_LATE */
    char c;
    while (read(go_r, &c, 1) < 0 && errno == EINTR)
        ;
    for (int i = 0; i < NBO; i++) {
        long long bad = check_memfd(fds[i], ti->sizes[i], ti->seed + i, 0, ti->sizes[i]);
        if (bad >= 0) {
            fprintf(stderr, "  task %d: BO %d differs at %lld\n", (int)getpid(), i, bad);
            _exit(30 + i);
        }
        close(fds[i]);
    }
    _exit(0);
}

static int run_topology(int ntasks, enum handoff how)
{
    struct task_image ti[3];
    for (int k = 0; k < ntasks; k++)
        if (dump_task(&ti[k], 1000 * (k + 1)))
            return 1;

    int sp[2] = {-1, -1}, notify[2], go[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
    CHECK(pipe2(notify, O_CLOEXEC) == 0 && pipe2(go, O_CLOEXEC) == 0, "pipe");
    size_t tsize = vramd_criu_table_size(8);
    void *mem = mmap(NULL, tsize, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(mem != MAP_FAILED, "mmap shared");
    struct vramd_criu_table *table;
    CHECK(vramd_criu_table_init(mem, tsize, 8, &table) == 0, "table init");

    pid_t pids[3];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int k = 0; k < ntasks; k++) {
        pids[k] = fork();
        CHECK(pids[k] >= 0, "fork");
        if (pids[k] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(sp[0]);
            close(notify[0]);
            close(go[1]);
            restored_task(&ti[k], how, sp[1], table, notify[1], go[0]);
        }
    }
    close(sp[1]);
    close(notify[1]);
    close(go[0]);

    /* CRIU main: collect the tickets, attach to every session at once (holders), then the barrier */
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.timeout_ms = 30000;
    cfg.wait_timeout_ms = 120000;
    struct vramd_criu_ticket tk[3];
    struct vramd_conn *conn[3] = {NULL, NULL, NULL};
    struct vramd_error err;
    int rc = 0;
    for (int k = 0; k < ntasks && !rc; k++) {
        char c;
        ssize_t n;
        while ((n = read(notify[0], &c, 1)) < 0 && errno == EINTR)
            ;
        if (n != 1) {
            fprintf(stderr, "  a restored task died before handing its ticket over\n");
            rc = 1;
            break;
        }
        if (how == VIA_SOCKET) {
            if (vramd_criu_ticket_recv(sp[0], &tk[k], 30000, &err) < 0) {
                fprintf(stderr, "  ticket: %s\n", err.message);
                rc = 1;
                break;
            }
        } else {
            /* RESUME_DEVICES_LATE comes per pid; here: whichever published */
            if (vramd_criu_table_take_any(table, &tk[k]) < 0) {
                fprintf(stderr, "  no ticket in the table\n");
                rc = 1;
                break;
            }
        }
        if (vramd_criu_restore_attach(&cfg, &tk[k], &conn[k], &err) < 0) {
            fprintf(stderr, "  attach: %s: %s\n", vramd_code_name(err.code), err.message);
            rc = 1;
        }
    }
    struct vramd_session_info info;
    for (int k = 0; k < ntasks && !rc; k++) {
        bool known = false;
        for (int j = 0; j < ntasks; j++)
            known |= tk[k].pid == pids[j];
        if (!known) {
            fprintf(stderr, "  ticket of unknown pid %d\n", tk[k].pid);
            rc = 1;
            break;
        }
        if (vramd_criu_restore_finish(&cfg, conn[k], &tk[k], &info, &err) < 0) {
            fprintf(stderr, "  barrier for pid %d: %s: %s\n", tk[k].pid, vramd_code_name(err.code), err.message);
            rc = 1;
            break;
        }
        if (info.state != VRAMD_STATE_DONE || info.progress.bos_done != NBO) {
            fprintf(stderr, "  barrier: state %d bos_done %u\n", info.state, info.progress.bos_done);
            rc = 1;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int k = 0; k < ntasks; k++)
        vramd_close(conn[k]);
    if (how == VIA_TABLE) {
        struct vramd_criu_ticket extra;
        if (vramd_criu_table_take_any(table, &extra) != -ENOENT) {
            fprintf(stderr, "  a ticket was left in the table\n");
            rc = 1;
        }
    }
    close(go[1]); /* release the tasks: they check their BOs */
    for (int k = 0; k < ntasks; k++) {
        int st = reap(pids[k]);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "  restored task %d: status %#x (exit %d)\n", (int)pids[k], st,
                    WIFEXITED(st) ? WEXITSTATUS(st) : -1);
            rc = 1;
        }
    }
    printf("  %d task(s): submit..barrier %.2f s\n", ntasks,
           (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
    close(sp[0]);
    close(notify[0]);
    munmap(mem, tsize);
    for (int k = 0; k < ntasks; k++)
        drop_image(&ti[k]);
    return rc;
}

static int t_topology_one(void)
{
    return run_topology(1, VIA_SOCKET);
}

static int t_topology_three(void)
{
    return run_topology(3, VIA_TABLE);
}

/* The hook adapter end to end in one process; and the restore's failure path closes its session. */
static int t_criu_adapter(void)
{
    struct task_image ti;
    if (dump_task(&ti, 77))
        return 1;
    int fds[NBO];
    struct vramd_criu_bo bos[NBO];
    for (int i = 0; i < NBO; i++) {
        fds[i] = make_memfd(ti.sizes[i], 0, 0, 0);
        CHECK(fds[i] >= 0, "memfd");
        bos[i] = (struct vramd_criu_bo){.id = (uint64_t)i, .fd = fds[i]};
    }
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.timeout_ms = 30000;
    struct vramd_criu_ticket tk;
    struct vramd_error err;
    struct vramd_session_info info;
    /* a target for a BO the image lacks fails the session: submit reports it and closes it */
    struct vramd_criu_bo wrong = {.id = 999, .fd = fds[0]};
    int r = vramd_criu_restore_submit(&cfg, ti.dir_fd, &wrong, 1, 0, &tk, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_INVALID_REQUEST, "wrong id: %d %s: %s", r,
          vramd_code_name(err.code), err.message);
    /* only NBO - 1 targets: INCOMPLETE_RESTORE at the barrier, unless allow_partial */
    OK(vramd_criu_restore_submit(&cfg, ti.dir_fd, bos, NBO - 1, 4321, &tk, &err), &err);
    CHECK(tk.pid == 4321, "ticket pid %d", tk.pid);
    r = vramd_criu_restore_barrier(&cfg, &tk, &info, &err);
    CHECK(r == -ENODATA && err.code == VRAMD_CODE_INCOMPLETE_RESTORE && err.has_bo_id && err.bo_id == NBO - 1,
          "partial: %d %s bo %llu", r, vramd_code_name(err.code), (unsigned long long)err.bo_id);
    /* the session is closed: its token is gone */
    r = vramd_criu_restore_barrier(&cfg, &tk, &info, &err);
    CHECK(r == -ENOENT, "closed session still found: %d", r);
    cfg.allow_partial = true;
    OK(vramd_criu_restore_submit(&cfg, ti.dir_fd, bos, NBO - 1, 0, &tk, &err), &err);
    OK(vramd_criu_restore_barrier(&cfg, &tk, &info, &err), &err);
    cfg.allow_partial = false;
    OK(vramd_criu_restore_submit(&cfg, ti.dir_fd, bos, NBO, 0, &tk, &err), &err);
    CHECK(tk.pid == getpid(), "ticket pid");
    OK(vramd_criu_restore_barrier(&cfg, &tk, &info, &err), &err);
    for (int i = 0; i < NBO; i++) {
        long long bad = check_memfd(fds[i], ti.sizes[i], ti.seed + i, 0, ti.sizes[i]);
        CHECK(bad < 0, "BO %d differs at %lld", i, bad);
        close(fds[i]);
    }
    /* a stream socketpair carries tickets too; a pipe is refused (SIGPIPE) */
    int sp[2], p[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) == 0 && pipe2(p, O_CLOEXEC) == 0, "pair");
    struct vramd_criu_ticket back;
    OK(vramd_criu_ticket_send(sp[1], &tk, &err), &err);
    OK(vramd_criu_ticket_recv(sp[0], &back, 1000, &err), &err);
    CHECK(memcmp(&back, &tk, sizeof tk) == 0, "ticket changed in transit");
    r = vramd_criu_ticket_recv(sp[0], &back, 0, &err);
    CHECK(r == -ETIMEDOUT, "empty socket: %d", r);
    CHECK(vramd_criu_ticket_send(p[1], &tk, &err) == -ENOTSOCK, "pipe accepted");
    close(sp[1]);
    CHECK(vramd_criu_ticket_recv(sp[0], &back, 1000, &err) == -ECONNRESET, "closed peer");
    close(sp[0]);
    close(p[0]);
    close(p[1]);
    drop_image(&ti);
    return 0;
}

/* An incremental dump and its restore through the hook adapter, the parent found as a plugin would find it:
 * through the "parent" link CRIU makes in the images directory for --prev-images-dir. */
static int t_criu_incremental(void)
{
    struct task_image base;
    if (dump_task(&base, 77))
        return 1;
    char cpath[PATH_MAX], link[PATH_MAX + 8];
    int cfd = make_image_dir(cpath);
    CHECK(cfd >= 0, "child dir");
    snprintf(link, sizeof link, "%s/parent", cpath);
    CHECK(symlink(base.path, link) == 0, "parent link");
    int pfd = openat(cfd, "parent", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(pfd >= 0, "open the parent link");
    int fds[NBO];
    struct vramd_criu_bo bos[NBO];
    for (int i = 0; i < NBO; i++) { /* BO 0 changed since the parent, the others not */
        fds[i] = make_memfd(base.sizes[i], i ? base.seed + (uint64_t)i : 500, 0, base.sizes[i]);
        CHECK(fds[i] >= 0, "memfd");
        bos[i] = (struct vramd_criu_bo){.id = (uint64_t)i, .fd = fds[i], .size = base.sizes[i]};
    }
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.timeout_ms = 30000;
    cfg.compression = "none";
    cfg.parent_dir_fds = &pfd;
    cfg.n_parent_dir_fds = 1;
    cfg.parent_hint = "parent";
    struct vramd_session_info info;
    struct vramd_error err;
    OK(vramd_criu_dump(&cfg, cfd, bos, NBO, &info, &err), &err);
    CHECK(info.image.stored_bytes == base.sizes[0], "the child stored %llu bytes, not only BO 0's %llu",
          (unsigned long long)info.image.stored_bytes, (unsigned long long)base.sizes[0]);
    for (int i = 0; i < NBO; i++) { /* garbage in the targets */
        close(fds[i]);
        fds[i] = make_memfd(base.sizes[i], 4242, 0, base.sizes[i]);
        CHECK(fds[i] >= 0, "memfd");
        bos[i] = (struct vramd_criu_bo){.id = (uint64_t)i, .fd = fds[i]};
    }
    struct vramd_criu_ticket tk;
    /* without its parent: refused at submit, before any byte is written */
    cfg.n_parent_dir_fds = 0;
    int r = vramd_criu_restore_submit(&cfg, cfd, bos, NBO, 0, &tk, &err);
    CHECK(r < 0 && err.code == VRAMD_CODE_PARENT_MISSING, "no parent: %d %s", r, vramd_code_name(err.code));
    CHECK(check_memfd(fds[1], base.sizes[1], 4242, 0, base.sizes[1]) < 0, "a refused restore wrote a byte");
    cfg.n_parent_dir_fds = 1;
    OK(vramd_criu_restore_submit(&cfg, cfd, bos, NBO, 0, &tk, &err), &err);
    OK(vramd_criu_restore_barrier(&cfg, &tk, &info, &err), &err);
    for (int i = 0; i < NBO; i++) {
        long long bad = check_memfd(fds[i], base.sizes[i], i ? base.seed + (uint64_t)i : 500, 0, base.sizes[i]);
        CHECK(bad < 0, "BO %d differs at %lld", i, bad);
        close(fds[i]);
    }
    close(pfd);
    close(cfd);
    remove_dir(cpath);
    drop_image(&base);
    return 0;
}

static int t_table(void)
{
    size_t size = vramd_criu_table_size(2);
    void *mem = malloc(size);
    struct vramd_criu_table *t;
    CHECK(mem, "malloc");
    CHECK(vramd_criu_table_init(mem, size - 1, 2, &t) == -EINVAL, "short table accepted");
    CHECK(vramd_criu_table_init(mem, size, 2, &t) == 0, "init");
    struct vramd_criu_ticket a = {.pid = 10}, b = {.pid = 20}, c = {.pid = 30}, out;
    a.token.bytes[0] = 1;
    b.token.bytes[0] = 2;
    CHECK(vramd_criu_table_publish(t, &a) == 0 && vramd_criu_table_publish(t, &b) == 0, "publish");
    CHECK(vramd_criu_table_publish(t, &c) == -ENOSPC, "full table");
    CHECK(vramd_criu_table_take(t, 30, &out) == -ENOENT, "unknown pid");
    CHECK(vramd_criu_table_take(t, 20, &out) == 0 && out.token.bytes[0] == 2, "take 20");
    CHECK(vramd_criu_table_take(t, 20, &out) == -ENOENT, "taken twice");
    CHECK(vramd_criu_table_take_any(t, &out) == 0 && out.pid == 10, "take any");
    CHECK(vramd_criu_table_take_any(t, &out) == -ENOENT, "empty");
    free(mem);
    return 0;
}

const struct test criu_tests[] = {
    {"table", t_table, "all unit"},
    {"criu_adapter", t_criu_adapter, "all quick"},
    {"criu_incremental", t_criu_incremental, "all quick"},
    {"topology_one", t_topology_one, "all topology"},
    {"topology_three", t_topology_three, "all topology"},
    {NULL, NULL, NULL},
};
