/* SPDX-License-Identifier: Apache-2.0 */
/*
 * client_c: small-BO rate through libvramd, one repetition per run.
 *
 *   client_c SOCKET DIR memfd|procmem BOS BO_SIZE
 *
 * Sets up BOS BOs of BO_SIZE bytes (memfd: one memfd per BO, mmap backend;
 * procmem: ranges of one child process's memory, one /proc/<pid>/mem fd),
 * then times one whole dump session into a fresh image under DIR (open, add,
 * start, wait: image committed, close) and one whole restore session from it
 * into fresh targets, and checks the restored bytes.  Setup is not timed.
 * Prints one JSON object: {"dump_s": ..., "restore_s": ..., "bos": ..., ...}.
 * bench/client_rate.py runs it interleaved with the Python client.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <vramd/client.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec / 1e6;
}

static int die(const char *what, const struct vramd_error *err)
{
    fprintf(stderr, "client_c: %s: %s: %s\n", what, err ? vramd_code_name(err->code) : "", err ? err->message : "");
    exit(1);
}

/* one whole session; returns seconds */
static double session(struct vramd_conn *c, int kind, int dfd, const struct vramd_bo *bos, size_t n)
{
    struct vramd_error err;
    struct vramd_token t;
    struct vramd_open_args a = {.struct_size = sizeof a, .kind = kind, .dir_fd = dfd, .label = "client_c bench"};
    double t0 = now();
    if (vramd_open_session(c, &a, &t, NULL, &err) < 0)
        die("open", &err);
    if (vramd_add_bos(c, &t, bos, n, NULL, &err) < 0)
        die("add", &err);
    if (vramd_start(c, &t, NULL, &err) < 0)
        die("start", &err);
    if (vramd_wait(c, &t, VRAMD_WAIT_FOREVER, NULL, &err) < 0)
        die("wait", &err);
    if (vramd_close_session(c, &t, NULL, &err) < 0)
        die("close", &err);
    return now() - t0;
}

static pid_t holder(int *ctl)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0)
        die("pipe", NULL);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", NULL);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(p[1]);
        char ch;
        while (read(p[0], &ch, 1) < 0 && errno == EINTR)
            ;
        _exit(0);
    }
    close(p[0]);
    *ctl = p[1];
    return pid;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: client_c SOCKET DIR memfd|procmem BOS BO_SIZE\n");
        return 2;
    }
    const char *sock = argv[1], *base = argv[2], *mode = argv[3];
    size_t n = strtoull(argv[4], NULL, 0), size = strtoull(argv[5], NULL, 0);
    bool procmem = strcmp(mode, "procmem") == 0;
    if (!n || !size || (!procmem && strcmp(mode, "memfd") != 0))
        return 2;

    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/client_c-XXXXXX", base);
    if (!mkdtemp(dir))
        die("mkdtemp", NULL);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct vramd_bo *src = calloc(n, sizeof *src), *dst = calloc(n, sizeof *dst);
    int *fds = NULL, mem_src = -1, mem_dst = -1, ctl_a = -1, ctl_b = -1;
    pid_t a = 0, b = 0;
    uint8_t *region = NULL;
    if (dfd < 0 || !src || !dst)
        die("setup", NULL);
    unsigned seed = 12345;
    if (procmem) {
        region = mmap(NULL, n * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (region == MAP_FAILED)
            die("mmap", NULL);
        for (size_t i = 0; i < n * size; i++)
            region[i] = (uint8_t)rand_r(&seed);
        a = holder(&ctl_a);
        memset(region, 0xee, n * size); /* the restore target sees garbage */
        b = holder(&ctl_b);
        char p[64];
        snprintf(p, sizeof p, "/proc/%d/mem", (int)a);
        mem_src = open(p, O_RDONLY | O_CLOEXEC);
        snprintf(p, sizeof p, "/proc/%d/mem", (int)b);
        mem_dst = open(p, O_RDWR | O_CLOEXEC);
        if (mem_src < 0 || mem_dst < 0)
            die("open /proc/pid/mem", NULL);
        for (size_t i = 0; i < n; i++) {
            uint64_t addr = (uint64_t)(uintptr_t)region + i * size;
            src[i] = (struct vramd_bo){.struct_size = sizeof src[i], .id = i + 1, .fd = mem_src, .offset = addr, .size = size};
            dst[i] = (struct vramd_bo){.struct_size = sizeof dst[i], .id = i + 1, .fd = mem_dst, .offset = addr};
        }
    } else {
        fds = calloc(n, sizeof *fds);
        uint8_t *buf = malloc(size);
        if (!fds || !buf)
            die("calloc", NULL);
        for (size_t i = 0; i < n; i++) {
            for (size_t k = 0; k < size; k++)
                buf[k] = (uint8_t)(k * 131 + i * 7 + 1);
            fds[i] = memfd_create("bo", MFD_CLOEXEC);
            if (fds[i] < 0 || pwrite(fds[i], buf, size, 0) != (ssize_t)size)
                die("memfd (raise the fd limit: ulimit -n)", NULL);
            /* the restore writes back into the same memfds, garbage by then (as bench/service.py) */
            src[i] = (struct vramd_bo){.struct_size = sizeof src[i], .id = i + 1, .fd = fds[i], .size = size};
            dst[i] = (struct vramd_bo){.struct_size = sizeof dst[i], .id = i + 1, .fd = fds[i]};
        }
        free(buf);
    }

    struct vramd_conn *c;
    struct vramd_error err;
    struct vramd_options o;
    vramd_options_init(&o);
    o.client_name = "client_c bench";
    if (vramd_connect_path(&c, sock, &o, &err) < 0)
        die("connect", &err);
    double c0 = cpu();
    double dump_s = session(c, VRAMD_SESSION_DUMP, dfd, src, n);
    double dump_cpu = cpu() - c0;
    if (!procmem) { /* untimed: make the targets garbage */
        uint8_t *junk = malloc(size);
        if (!junk)
            die("malloc", NULL);
        memset(junk, 0xee, size);
        for (size_t i = 0; i < n; i++)
            if (pwrite(fds[i], junk, size, 0) != (ssize_t)size)
                die("pwrite", NULL);
        free(junk);
    }
    c0 = cpu();
    double restore_s = session(c, VRAMD_SESSION_RESTORE, dfd, dst, n);
    double restore_cpu = cpu() - c0;
    vramd_close(c);

    /* the restored bytes must be the dumped ones */
    size_t bad = 0;
    uint8_t *x = malloc(size), *y = malloc(size);
    for (size_t i = 0; i < n && x && y; i += (n / 64 ? n / 64 : 1)) {
        if (procmem) {
            if (pread(mem_src, x, size, (off_t)src[i].offset) != (ssize_t)size ||
                pread(mem_dst, y, size, (off_t)dst[i].offset) != (ssize_t)size)
                bad++;
        } else {
            for (size_t k = 0; k < size; k++)
                x[k] = (uint8_t)(k * 131 + i * 7 + 1);
            if (pread(fds[i], y, size, 0) != (ssize_t)size)
                bad++;
        }
        bad += memcmp(x, y, size) != 0;
    }
    free(x);
    free(y);
    printf("{\"client\": \"c\", \"mode\": \"%s\", \"bos\": %zu, \"bo_size\": %zu, \"dump_s\": %.6f, "
           "\"restore_s\": %.6f, \"dump_client_cpu_s\": %.6f, \"restore_client_cpu_s\": %.6f, \"checked_bad\": %zu}\n",
           mode, n, size, dump_s, restore_s, dump_cpu, restore_cpu, bad);
    if (procmem) {
        close(mem_src);
        close(mem_dst);
        close(ctl_a);
        close(ctl_b);
        waitpid(a, NULL, 0);
        waitpid(b, NULL, 0);
        munmap(region, n * size);
    } else {
        for (size_t i = 0; i < n; i++)
            close(fds[i]);
        free(fds);
    }
    free(src);
    free(dst);
    close(dfd);
    /* the image: a manifest and data files */
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "client_c: could not remove %s\n", dir);
    return bad ? 1 : 0;
}
