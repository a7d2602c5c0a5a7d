/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd-tests: the C test suite, run against a real vramd daemon.
 *
 *   VRAMD_SOCKET=/path/vramd.sock libvramd-tests [GROUP|TEST ...]
 *
 * With no argument it runs group "all".  Every test also checks that it left
 * this process with the fds it found (/proc/self/fd counted before and after).
 * Exit status 0 when every test passed, 1 otherwise, 77 (skip) without
 * VRAMD_SOCKET.
 */
#define _GNU_SOURCE
#include "harness.h"
#include "rpc.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <linux/close_range.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *daemon_socket(void)
{
    const char *s = getenv("VRAMD_SOCKET");
    return s ? s : "";
}

long long env_num(const char *name, long long dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    long long n = strtoll(v, &end, 0);
    return *end ? dflt : n;
}

int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory's own fd */
}

int test_connect(struct vramd_conn **c, struct vramd_error *err)
{
    struct vramd_options o;
    vramd_options_init(&o);
    o.timeout_ms = 30000;
    o.client_name = "libvramd-tests";
    return vramd_connect_path(c, daemon_socket(), &o, err);
}

static uint64_t splitmix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void fill_pattern(void *buf, size_t len, uint64_t seed, uint64_t pos)
{
    uint8_t *p = buf;
    for (size_t i = 0; i < len;) {
        uint64_t word = (pos + i) / 8;
        uint64_t v = splitmix(seed * 0x100000001b3ull ^ word);
        size_t k = (pos + i) % 8;
        for (; k < 8 && i < len; k++, i++)
            p[i] = (uint8_t)(v >> (8 * k));
    }
}

int make_memfd(uint64_t size, uint64_t seed, uint64_t data_off, uint64_t data_len)
{
    int fd = memfd_create("vramd-test-bo", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) < 0)
        goto fail;
    static uint8_t buf[1 << 20];
    for (uint64_t done = 0; done < data_len;) {
        size_t n = data_len - done < sizeof buf ? (size_t)(data_len - done) : sizeof buf;
        fill_pattern(buf, n, seed, data_off + done);
        if (pwrite(fd, buf, n, (off_t)(data_off + done)) != (ssize_t)n)
            goto fail;
        done += n;
    }
    return fd;
fail:
    close(fd);
    return -1;
}

/* Next data offset at or after pos in fd, or size if none. */
static uint64_t next_data(int fd, uint64_t pos, uint64_t size)
{
    off_t o = lseek(fd, (off_t)pos, SEEK_DATA);
    return o < 0 || (uint64_t)o > size ? size : (uint64_t)o;
}

#define CMP_CHUNK (1u << 20)

long long compare_fds(int a, int b, uint64_t size)
{
    static uint8_t ba[CMP_CHUNK], bb[CMP_CHUNK];
    uint64_t pos = 0;
    while (pos < size) {
        uint64_t da = next_data(a, pos, size), db = next_data(b, pos, size);
        uint64_t start = da < db ? da : db; /* before it both are holes: zeros */
        if (start >= size)
            break;
        size_t n = size - start < CMP_CHUNK ? (size_t)(size - start) : CMP_CHUNK;
        if (pread(a, ba, n, (off_t)start) != (ssize_t)n || pread(b, bb, n, (off_t)start) != (ssize_t)n)
            return (long long)start;
        if (memcmp(ba, bb, n) != 0)
            for (size_t i = 0; i < n; i++)
                if (ba[i] != bb[i])
                    return (long long)(start + i);
        pos = start + n;
    }
    return -1;
}

long long check_memfd(int fd, uint64_t size, uint64_t seed, uint64_t off, uint64_t len)
{
    static uint8_t got[CMP_CHUNK], want[CMP_CHUNK];
    struct stat st;
    if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < size)
        return 0;
    uint64_t pos = 0;
    while (pos < size) {
        /* the pattern range is read whole; elsewhere only data extents (holes are zeros) */
        uint64_t start = pos >= off && pos < off + len ? pos : next_data(fd, pos, size);
        if (pos < off && start > off && len)
            start = off;
        if (start >= size)
            break;
        size_t n = size - start < CMP_CHUNK ? (size_t)(size - start) : CMP_CHUNK;
        if (pread(fd, got, n, (off_t)start) != (ssize_t)n)
            return (long long)start;
        memset(want, 0, n);
        uint64_t end = start + n;
        uint64_t lo = start > off ? start : off, hi = end < off + len ? end : off + len;
        if (lo < hi)
            fill_pattern(want + (lo - start), (size_t)(hi - lo), seed, lo);
        if (memcmp(got, want, n) != 0)
            for (size_t i = 0; i < n; i++)
                if (got[i] != want[i])
                    return (long long)(start + i);
        pos = end;
    }
    return -1;
}

int make_image_dir(char *path)
{
    const char *base = getenv("VRAMD_TEST_TMP");
    snprintf(path, PATH_MAX, "%s/vramd-ctest-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(path))
        return -1;
    return open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(p);
}

void remove_dir(const char *path)
{
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

int count_entries(const char *dir, const char *prefix, const char *suffix, char *first)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    size_t lp = strlen(prefix), ls = strlen(suffix);
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 || len < lp + ls ||
            strncmp(e->d_name, prefix, lp) != 0 || strcmp(e->d_name + len - ls, suffix) != 0)
            continue;
        if (!n++ && first)
            snprintf(first, PATH_MAX, "%s", e->d_name);
    }
    closedir(d);
    return n;
}

int spawn_holder(struct child *ch)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        /* hold nothing else: another holder's control pipe kept open here would keep that one alive */
        if (p[0] > 3)
            close_range(3, (unsigned)p[0] - 1, 0);
        close_range((unsigned)p[0] + 1, ~0u, 0);
        char c;
        while (read(p[0], &c, 1) < 0 && errno == EINTR)
            ;
        _exit(0);
    }
    close(p[0]);
    ch->pid = pid;
    ch->ctl = p[1];
    return 0;
}

int reap(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -1;
    return st;
}

int release_holder(struct child *ch)
{
    if (ch->pid <= 0)
        return -1;
    close(ch->ctl);
    int st = reap(ch->pid);
    ch->pid = 0;
    return st;
}

/* --- main ------------------------------------------------------------------ */

static bool in_group(const struct test *t, const char *group)
{
    size_t n = strlen(group);
    for (const char *g = t->groups; (g = strstr(g, group)); g += n)
        if ((g == t->groups || g[-1] == ' ') && (g[n] == ' ' || g[n] == '\0'))
            return true;
    return false;
}

static int run_one(const struct test *t)
{
    int before = count_fds();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    printf("RUN  %s\n", t->name);
    fflush(stdout);
    int r = t->fn();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int after = count_fds();
    if (r == 0 && after != before) {
        fprintf(stderr, "  %s left %d fd(s) open (%d before, %d after)\n", t->name, after - before, before, after);
        r = 1;
    }
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("%s %s (%.2f s)\n", r == 0 ? "PASS" : "FAIL", t->name, s);
    fflush(stdout);
    return r;
}

int main(int argc, char **argv)
{
    static const struct test *const lists[] = {roundtrip_tests, criu_tests, failure_tests, files_tests,
                                                abi_tests, hold_tests, lock_tests, stream_tests};
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (size_t l = 0; l < sizeof lists / sizeof lists[0]; l++)
            for (const struct test *t = lists[l]; t->name; t++)
                printf("%s\t%s\n", t->name, t->groups);
        return 0;
    }
    if (!*daemon_socket()) {
        fprintf(stderr, "libvramd-tests: VRAMD_SOCKET is not set (needs a running vramd); skipping\n");
        return 77;
    }
    int failed = 0, ran = 0;
    int nargs = argc > 1 ? argc - 1 : 1;
    for (int a = 0; a < nargs; a++) {
        const char *sel = argc > 1 ? argv[a + 1] : "all";
        int matched = 0;
        for (size_t l = 0; l < sizeof lists / sizeof lists[0]; l++)
            for (const struct test *t = lists[l]; t->name; t++)
                if (strcmp(t->name, sel) == 0 || in_group(t, sel)) {
                    matched++;
                    ran++;
                    failed += run_one(t) != 0;
                }
        if (!matched) {
            fprintf(stderr, "libvramd-tests: no test or group named %s\n", sel);
            return 2;
        }
    }
    printf("%d test(s), %d failed\n", ran, failed);
    return failed ? 1 : 0;
}

size_t frame_response(uint8_t *out, size_t cap, const struct Vramd__Rpc__V1__Response *resp)
{
    size_t n = vramd__rpc__v1__response__get_packed_size(resp);
    if (n + 12 > cap)
        return 0;
    memcpy(out, "VRDP", 4);
    out[4] = 1; /* frame version */
    out[5] = 2; /* a response */
    out[6] = out[7] = 0;
    out[8] = (uint8_t)n, out[9] = (uint8_t)(n >> 8), out[10] = (uint8_t)(n >> 16), out[11] = (uint8_t)(n >> 24);
    vramd__rpc__v1__response__pack(resp, out + 12);
    return n + 12;
}

Vramd__Rpc__V1__Request *fake_request(int s)
{
    static uint8_t in[1 << 16];
    ssize_t n = recv(s, in, sizeof in, 0);
    if (n <= 0)
        return NULL;
    if (n < 12)
        _exit(2);
    Vramd__Rpc__V1__Request *req = vramd__rpc__v1__request__unpack(NULL, (size_t)n - 12, in + 12);
    if (!req)
        _exit(3);
    return req;
}

void fake_reply(int s, const struct Vramd__Rpc__V1__Response *resp)
{
    static uint8_t out[1 << 16];
    size_t len = frame_response(out, sizeof out, resp);
    if (!len || send(s, out, len, MSG_NOSIGNAL) != (ssize_t)len)
        _exit(4);
}

pid_t fork_peer(int *fd)
{
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(sp[0]);
        close(sp[1]);
        return -1;
    }
    close(sp[pid == 0 ? 0 : 1]);
    *fd = sp[pid == 0 ? 1 : 0];
    return pid;
}

int touch_at(int dir_fd, const char *name)
{
    int fd = openat(dir_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    close(fd);
    return 0;
}
