/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Failure paths: no daemon, refused uid, an impostor daemon (a foreign directory,
 * link or listener), bad fds, a corrupt image, a restored
 * task that dies before CRIU main attaches, a daemon that stops answering or
 * dies during a Wait, and replies that break the protocol (a fake daemon).
 *
 * Tests in groups "grace", "interactive" and "pid" need the driver (tests/test_libvramd.py):
 *   task_dies_attach_in_grace  wants a daemon with a grace period of seconds, not 0.3 s
 *   task_dies_reaped       prints "HANDED-OVER", then waits for a line on stdin
 *                          (sent once the daemon has reaped the session)
 *   daemon_killed_in_wait  blocks in a Wait until the driver kills the daemon
 *   daemon_stopped         SIGSTOPs the daemon at $VRAMD_TEST_DAEMON_PID (and SIGCONTs it)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "rpc.pb-c.h"

static double since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) / 1e9;
}

static int t_no_daemon(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int r = vramd_connect_path(&c, "/nonexistent/vramd.sock", NULL, &err);
    CHECK(r == -ENOENT && c == NULL && err.code == VRAMD_CODE_LOCAL, "missing socket: %d", r);
    CHECK(strstr(err.message, "/nonexistent/vramd.sock"), "message does not name the path: %s", err.message);
    /* a socket file nobody listens on */
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    char sock[PATH_MAX];
    snprintf(sock, sizeof sock, "%s/dead.sock", path);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
    CHECK(s >= 0 && bind(s, (struct sockaddr *)&sa, sizeof sa) == 0, "bind");
    close(s);
    r = vramd_connect_path(&c, sock, NULL, &err);
    CHECK(r == -ECONNREFUSED, "nobody listening: %d %s", r, err.message);
    /* $VRAMD_SOCKET names where vramd_connect goes */
    char *saved = strdup(daemon_socket());
    setenv("VRAMD_SOCKET", sock, 1);
    r = vramd_connect(&c, NULL, &err);
    setenv("VRAMD_SOCKET", saved, 1);
    free(saved);
    CHECK(r == -ECONNREFUSED && strstr(err.message, sock), "vramd_connect: %d %s", r, err.message);
    CHECK(since(&t0) < 2.0, "failing to connect took %.2f s", since(&t0));
    close(dfd);
    remove_dir(path);
    return 0;
}

/* The daemon refuses a uid it does not allow (default: root, its own uid, group vramd). */
static int t_uid_refused(void)
{
    if (geteuid() != 0) {
        printf("  skipped: needs root to drop to uid 65534\n");
        return 0;
    }
    /* open the socket file's mode, so that the daemon's own check is what refuses */
    struct stat st;
    CHECK(stat(daemon_socket(), &st) == 0, "stat socket");
    CHECK(chmod(daemon_socket(), 0666) == 0, "chmod");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
            _exit(10);
        struct vramd_conn *c = NULL;
        struct vramd_error err;
        int before = count_fds();
        int r = vramd_connect_path(&c, daemon_socket(), NULL, &err);
        if (r != -EACCES || err.code != VRAMD_CODE_PERMISSION_DENIED || c) {
            fprintf(stderr, "  as uid 65534: %d %s: %s\n", r, vramd_code_name(err.code), err.message);
            _exit(11);
        }
        if (!strstr(err.message, "65534")) {
            fprintf(stderr, "  refusal does not name the uid: %s\n", err.message);
            _exit(12);
        }
        _exit(count_fds() == before ? 0 : 13);
    }
    int status = reap(pid);
    chmod(daemon_socket(), st.st_mode & 07777);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %#x", status);
    /* root is still served */
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    OK(test_connect(&c, &err), &err);
    vramd_close(c);
    return 0;
}

/* A socket bound at `path` and listening, or -1. */
static int listen_at(const char *path)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    if (s < 0 || bind(s, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(s, 8) < 0) {
        if (s >= 0)
            close(s);
        return -1;
    }
    return s;
}

/* Whether a connection waits on listener l (nobody should have connected). */
static bool pending(int l)
{
    struct pollfd p = {.fd = l, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

/*
 * The daemon's authentication (docs/protocol.md): a directory, a link or a listener of another uid, or a
 * socket directly in a sticky directory, is -EPERM with VRAMD_CODE_LOCAL naming the path and the uid, no fd
 * is left, and the impostor gets nothing: no connection where the path is refused, no packet where the
 * listener is.
 */
static int t_untrusted_daemon(void)
{
    if (geteuid() != 0) {
        printf("  skipped: needs root to make uid 65534's directory, link and listener\n");
        return 0;
    }
    const uid_t nobody = 65534;
    char dir[PATH_MAX], sub[PATH_MAX], sock[PATH_MAX], link[PATH_MAX];
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    struct vramd_options o; /* bounded, so that a client which did talk to an impostor fails instead of waiting */
    vramd_options_init(&o);
    o.timeout_ms = 2000;
    int dfd = make_image_dir(dir);
    CHECK(dfd >= 0, "dir");
    close(dfd);
    int before = count_fds();

    /* a directory of uid 65534 */
    snprintf(sub, sizeof sub, "%s/foreign", dir);
    CHECK(mkdir(sub, 0755) == 0 && chown(sub, nobody, nobody) == 0, "foreign dir: %s", strerror(errno));
    snprintf(sock, sizeof sock, "%s/vramd.sock", sub);
    int l1 = listen_at(sock);
    CHECK(l1 >= 0, "listen at %s", sock);
    int r = vramd_connect_path(&c, sock, &o, &err);
    CHECK(r == -EPERM && c == NULL && err.code == VRAMD_CODE_LOCAL, "foreign dir: %d %s", r, err.message);
    CHECK(strstr(err.message, sock) && strstr(err.message, "uid 65534 owns") && strstr(err.message, sub),
          "foreign dir: %s", err.message);
    /* a link owned by uid 65534, in a directory of root's, to that same socket */
    snprintf(link, sizeof link, "%s/link", dir);
    CHECK(symlink(sock, link) == 0 && lchown(link, nobody, nobody) == 0, "link");
    r = vramd_connect_path(&c, link, &o, &err);
    CHECK(r == -EPERM && strstr(err.message, link) && strstr(err.message, "uid 65534 owns") &&
          strstr(err.message, "symbolic link"), "foreign link: %d %s", r, err.message);
    /* root's link into the foreign directory: the target's directories are checked too */
    CHECK(unlink(link) == 0 && symlink("foreign/./../foreign/vramd.sock", link) == 0, "relative link");
    r = vramd_connect_path(&c, link, &o, &err);
    CHECK(r == -EPERM && strstr(err.message, sub) && strstr(err.message, "uid 65534 owns"),
          "link into the foreign dir: %d %s", r, err.message);
    CHECK(!pending(l1), "someone connected to the socket in the foreign directory");
    close(l1);

    /* a socket directly in a sticky directory (root's, 01777), root listening */
    snprintf(sub, sizeof sub, "%s/sticky", dir);
    CHECK(mkdir(sub, 0755) == 0 && chmod(sub, 01777) == 0, "sticky dir");
    snprintf(sock, sizeof sock, "%s/vramd.sock", sub);
    int l2 = listen_at(sock);
    CHECK(l2 >= 0, "listen at %s", sock);
    r = vramd_connect_path(&c, sock, &o, &err);
    CHECK(r == -EPERM && strstr(err.message, sock) && strstr(err.message, "socket's own directory"),
          "sticky dir: %d %s", r, err.message);
    CHECK(!pending(l2), "someone connected to the socket in the sticky directory");
    close(l2);

    /* a listener of uid 65534 on a socket root bound in root's directory: refused after connect, before Hello */
    snprintf(sock, sizeof sock, "%s/peer.sock", dir);
    int ready[2], done[2], result[2];
    CHECK(pipe2(ready, O_CLOEXEC) == 0 && pipe2(done, O_CLOEXEC) == 0 && pipe2(result, O_CLOEXEC) == 0, "pipes");
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
    CHECK(s >= 0 && bind(s, (struct sockaddr *)&sa, sizeof sa) == 0, "bind %s", sock);
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) { /* the impostor: listen as 65534, then count what arrives until told to stop */
        close(ready[0]);
        close(done[1]);
        close(result[0]);
        if (setgroups(0, NULL) < 0 || setgid(nobody) < 0 || setuid(nobody) < 0 || listen(s, 8) < 0)
            _exit(10);
        if (write(ready[1], "r", 1) != 1)
            _exit(11);
        char b;
        if (read(done[0], &b, 1) < 0)
            _exit(12);
        int got[2] = {0, 0}; /* connections, packets */
        int a;
        if (fcntl(s, F_SETFL, O_NONBLOCK) < 0)
            _exit(14);
        while ((a = accept4(s, NULL, NULL, SOCK_NONBLOCK)) >= 0) { /* the client has returned: all is queued */
            got[0]++;
            char buf[4096];
            while (recv(a, buf, sizeof buf, MSG_DONTWAIT) > 0)
                got[1]++;
            close(a);
        }
        _exit(write(result[1], got, sizeof got) == sizeof got ? 0 : 13);
    }
    close(s);
    close(ready[1]);
    close(done[0]);
    close(result[1]);
    char b;
    CHECK(read(ready[0], &b, 1) == 1, "the impostor did not start");
    r = vramd_connect_path(&c, sock, &o, &err);
    close(done[1]);
    int got[2] = {-1, -1};
    ssize_t n = read(result[0], got, sizeof got);
    close(ready[0]);
    close(result[0]);
    int status = reap(pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && n == sizeof got, "impostor status %#x", status);
    CHECK(r == -EPERM && c == NULL && err.code == VRAMD_CODE_LOCAL, "foreign listener: %d %s", r, err.message);
    CHECK(strstr(err.message, sock) && strstr(err.message, "runs as uid 65534"), "foreign listener: %s",
          err.message);
    CHECK(got[0] == 1 && got[1] == 0, "the impostor got %d connection(s), %d packet(s)", got[0], got[1]);

    CHECK(count_fds() == before, "fds: %d before, %d after", before, count_fds());
    remove_dir(dir);
    return 0;
}

static int t_bad_fds(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    OK(test_connect(&c, &err), &err);
    struct vramd_token t;
    /* a directory fd that is not a directory */
    int mf = make_memfd(4096, 1, 0, 4096);
    CHECK(mf >= 0, "memfd");
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = mf};
    int r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -ENOTDIR && err.code == VRAMD_CODE_LOCAL, "memfd as a dump's image dir: %d %s", r,
          vramd_code_name(err.code));
    a.kind = VRAMD_SESSION_RESTORE;
    r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -ENOTDIR && err.code == VRAMD_CODE_LOCAL, "memfd as a restore's image dir: %d %s", r,
          vramd_code_name(err.code));
    a.kind = VRAMD_SESSION_DUMP;
    a.dir_fd = -1;
    CHECK(vramd_open_session(c, &a, &t, NULL, &err) == -EBADF, "dir fd -1");
    a.dir_fd = dfd;
    a.kind = 7;
    r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_LOCAL, "session kind 7: %d %s", r, vramd_code_name(err.code));
    a.kind = VRAMD_SESSION_DUMP;

    a.dir_fd = dfd;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    /* refused here, before anything is sent: fd -1, a closed fd */
    struct vramd_bo bo = {.id = 5, .fd = -1, .size = 4096};
    r = vramd_add_bos(c, &t, &bo, 1, NULL, &err);
    CHECK(r == -EBADF && err.has_bo_id && err.bo_id == 5, "fd -1: %d", r);
    int closed = dup(mf);
    close(closed);
    bo.fd = closed;
    r = vramd_add_bos(c, &t, &bo, 1, NULL, &err);
    CHECK(r == -EBADF && err.code == VRAMD_CODE_LOCAL && err.bo_id == 5, "closed fd: %d %s", r, err.message);
    CHECK(!vramd_conn_broken(c), "a refused fd broke the connection");
    /* refused by the daemon: a directory as a BO fails the session */
    bo.fd = dfd;
    r = vramd_add_bos(c, &t, &bo, 1, NULL, &err);
    CHECK(r == -EBADF && err.code == VRAMD_CODE_BAD_DESCRIPTOR && err.has_bo_id && err.bo_id == 5,
          "directory as BO: %d %s %s", r, vramd_code_name(err.code), err.message);
    OK(vramd_start(c, &t, NULL, &err), &err);
    struct vramd_session_info info;
    r = vramd_wait(c, &t, 10000, &info, &err);
    CHECK(r == -EBADF && info.state == VRAMD_STATE_FAILED, "wait after a bad fd: %d state %d", r, info.state);
    OK(vramd_close_session(c, &t, NULL, &err), &err);

    /* a restore target without write access: the daemon refuses it */
    bo = (struct vramd_bo){.id = 1, .fd = mf, .size = 4096};
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 30000, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", mf);
    int ro = open(p, O_RDONLY | O_CLOEXEC);
    CHECK(ro >= 0, "reopen read-only");
    a = (struct vramd_open_args){.kind = VRAMD_SESSION_RESTORE, .dir_fd = dfd};
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    bo = (struct vramd_bo){.id = 1, .fd = ro};
    r = vramd_add_bos(c, &t, &bo, 1, NULL, &err);
    CHECK(r == -EBADF && err.code == VRAMD_CODE_BAD_DESCRIPTOR, "read-only target: %d %s %s", r,
          vramd_code_name(err.code), err.message);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    /* every fd passed is still ours and still open */
    CHECK(fcntl(mf, F_GETFD) >= 0 && fcntl(ro, F_GETFD) >= 0 && fcntl(dfd, F_GETFD) >= 0, "caller fd closed");
    close(ro);
    close(mf);
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* Data files in dir whose name holds `part` (NULL: every data file). */
static int count_data_files(const char *dir, const char *part)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)))
        n += strncmp(e->d_name, "data-", 5) == 0 && (!part || strstr(e->d_name, part));
    closedir(d);
    return n;
}

/* A BO on a GPU the daemon does not know (it listed only GPU 0 at Hello): refused by the daemon, naming
 * the BO; no data file is made for that GPU; the session goes on and commits its other BOs. */
static int t_unknown_gpu(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    OK(test_connect(&c, &err), &err);
    int mf = make_memfd(8192, 9, 0, 8192);
    CHECK(mf >= 0, "memfd");
    struct vramd_token t;
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_session_info info;
    OK(vramd_open_session(c, &a, &t, &info, &err), &err);
    struct vramd_bo bo = {.id = 7, .fd = mf, .size = 4096, .has_gpu_id = true, .gpu_id = 0x2a};
    int r = vramd_add_bos(c, &t, &bo, 1, NULL, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_INVALID_REQUEST && err.has_bo_id && err.bo_id == 7,
          "a BO on gpu 0x2a: %d %s bo %d/%llu: %s", r, vramd_code_name(err.code), err.has_bo_id,
          (unsigned long long)err.bo_id, err.message);
    CHECK(count_data_files(path, "-0000002a") == 0, "a data file was made for gpu 0x2a");
    CHECK(!vramd_conn_broken(c), "the refusal broke the connection");
    bo = (struct vramd_bo){.id = 8, .fd = mf, .offset = 4096, .size = 4096};
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 30000, &info, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    CHECK(info.state == VRAMD_STATE_DONE && info.has_image && info.image.bo_count == 1, "state %d, %u BOs",
          info.state, info.image.bo_count);
    int all = count_data_files(path, NULL), gpu0 = count_data_files(path, "-00000000");
    CHECK(gpu0 >= 1 && all == gpu0, "data files: %d, of gpu 0: %d", all, gpu0);
    close(mf);
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* The largest data file in dir (a GPU's records may be spread over several; the others may hold none). */
static int find_data_file(const char *dir, char *out)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *e;
    int found = -1;
    off_t largest = -1;
    while ((e = readdir(d))) {
        struct stat st;
        if (strncmp(e->d_name, "data-", 5) == 0 && fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
            st.st_size > largest) {
            snprintf(out, PATH_MAX, "%s/%s", dir, e->d_name);
            largest = st.st_size;
            found = 0;
        }
    }
    closedir(d);
    return found;
}

/* Flip one byte of a chunk's payload: verify and restore name the BO and the chunk's offset. */
static int t_corrupt_image(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX], data[PATH_MAX];
    int dfd = make_image_dir(path);
    /* chunk 0 is zeros (no payload), chunk 1 random: the file's last byte is chunk 1's */
    int src = make_memfd(2 << 20, 31, 1 << 20, 1 << 20);
    CHECK(dfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .chunk_size = 1 << 20,
                                .compression = "none"};
    struct vramd_token t;
    struct vramd_bo bo = {.id = 42, .fd = src, .size = 2 << 20};
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 60000, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    CHECK(find_data_file(path, data) == 0, "no data file in %s", path);
    int fd = open(data, O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0, "open %s", data);
    struct stat st;
    CHECK(fstat(fd, &st) == 0 && st.st_size > 1 << 20, "data file size");
    uint8_t byte;
    CHECK(pread(fd, &byte, 1, st.st_size - 100) == 1, "pread");
    byte ^= 0x40;
    CHECK(pwrite(fd, &byte, 1, st.st_size - 100) == 1, "pwrite");
    close(fd);

    a = (struct vramd_open_args){.kind = VRAMD_SESSION_VERIFY, .dir_fd = dfd};
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    struct vramd_session_info info;
    int r = vramd_wait(c, &t, 60000, &info, &err);
    CHECK(r == -EBADMSG && err.code == VRAMD_CODE_CORRUPT_CHUNK, "verify: %d %s: %s", r, vramd_code_name(err.code),
          err.message);
    CHECK(err.has_bo_id && err.bo_id == 42 && err.has_offset && err.offset == 1 << 20, "error names BO %llu offset %llu",
          (unsigned long long)err.bo_id, (unsigned long long)err.offset);
    CHECK(info.state == VRAMD_STATE_FAILED && info.error.code == VRAMD_CODE_CORRUPT_CHUNK, "info state");
    OK(vramd_close_session(c, &t, NULL, &err), &err);

    int dst = make_memfd(2 << 20, 0, 0, 0);
    a.kind = VRAMD_SESSION_RESTORE;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    bo = (struct vramd_bo){.id = 42, .fd = dst};
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    r = vramd_wait(c, &t, 60000, NULL, &err);
    CHECK(r == -EBADMSG && err.bo_id == 42 && err.offset == 1 << 20, "restore: %d %s", r, err.message);
    printf("  %s\n", err.message);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    close(dst);
    close(src);
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/*
 * The restored task submits and dies before CRIU main attaches.  With `start`,
 * the copy finishes; attaching within the grace period gets the result.
 * Without, the session is reaped after the grace period; see task_dies_reaped.
 */
static int task_dies(bool start, struct vramd_criu_ticket *tk, char *path, int *dfd, int *dst)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    *dfd = make_image_dir(path);
    int src = make_memfd(1 << 20, 8, 0, 1 << 20);
    *dst = make_memfd(1 << 20, 0, 0, 0);
    CHECK(*dfd >= 0 && src >= 0 && *dst >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = *dfd};
    struct vramd_token t;
    struct vramd_bo bo = {.id = 1, .fd = src, .size = 1 << 20};
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 60000, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    vramd_close(c);
    close(src);

    int sock;
    pid_t pid = fork_peer(&sock);
    CHECK(pid >= 0, "socketpair, fork");
    if (pid == 0) {
        struct vramd_conn *tc = NULL;
        struct vramd_token tt;
        if (test_connect(&tc, &err) < 0)
            _exit(10);
        a = (struct vramd_open_args){.kind = VRAMD_SESSION_RESTORE, .dir_fd = *dfd};
        bo = (struct vramd_bo){.id = 1, .fd = *dst};
        if (vramd_open_session(tc, &a, &tt, NULL, &err) < 0 || vramd_add_bos(tc, &tt, &bo, 1, NULL, &err) < 0)
            _exit(11);
        if (start && vramd_start(tc, &tt, NULL, &err) < 0)
            _exit(12);
        struct vramd_criu_ticket k = {.pid = (int32_t)getpid(), .token = tt};
        if (vramd_criu_ticket_send(sock, &k, &err) < 0)
            _exit(13);
        _exit(0); /* dies holding its connection: the kernel closes it */
    }
    int st = reap(pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "task status %#x", st);
    struct vramd_error e2;
    int r = vramd_criu_ticket_recv(sock, tk, 10000, &e2);
    close(sock);
    CHECK(r == 0, "ticket: %s", e2.message);
    return 0;
}

static int t_task_dies_attach_in_grace(void)
{
    char path[PATH_MAX];
    int dfd = -1, dst = -1;
    struct vramd_criu_ticket tk;
    /* CRIU main's connection exists before the task dies; the daemon's grace period
     * (the driver starts one with 30 s) is far longer than the gap */
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    OK(test_connect(&c, &err), &err);
    if (task_dies(true, &tk, path, &dfd, &dst)) {
        vramd_close(c);
        return 1;
    }
    struct vramd_session_info info;
    OK(vramd_progress(c, &tk.token, &info, &err), &err); /* holder from here on */
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    OK(vramd_criu_restore_finish(&cfg, c, &tk, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_DONE, "state %d", info.state);
    vramd_close(c);
    long long bad = check_memfd(dst, 1 << 20, 8, 0, 1 << 20);
    CHECK(bad < 0, "restored bytes differ at %lld", bad);
    close(dst);
    close(dfd);
    remove_dir(path);
    return 0;
}

static int t_task_dies_reaped(void)
{
    char path[PATH_MAX];
    int dfd = -1, dst = -1;
    struct vramd_criu_ticket tk;
    if (task_dies(false, &tk, path, &dfd, &dst))
        return 1;
    char tok[33];
    vramd_token_format(&tk.token, tok);
    printf("HANDED-OVER %s\n", tok);
    fflush(stdout);
    char line[64];
    CHECK(fgets(line, sizeof line, stdin), "no go-ahead on stdin");
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = daemon_socket();
    cfg.timeout_ms = 30000;
    struct vramd_error err;
    struct vramd_conn *c = NULL;
    int r = vramd_criu_restore_attach(&cfg, &tk, &c, &err);
    CHECK(r == -ENOENT && err.code == VRAMD_CODE_NOT_FOUND && c == NULL, "attach after reaping: %d %s", r,
          vramd_code_name(err.code));
    close(dst);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* Blocks in a Wait until the driver kills the daemon: the Wait must fail at once, not hang. */
static int t_daemon_killed_in_wait(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    printf("WAITING\n");
    fflush(stdout);
    int r = vramd_wait(c, &t, VRAMD_WAIT_FOREVER, NULL, &err); /* never started: only the kill ends it */
    CHECK(r == -ECONNRESET && err.code == VRAMD_CODE_LOCAL, "wait: %d %s", r, err.message);
    CHECK(vramd_conn_broken(c) && vramd_conn_fd(c) == -1, "connection not marked broken");
    r = vramd_progress(c, &t, NULL, &err);
    CHECK(r == -ENOTCONN, "call on a broken connection: %d", r);
    printf("WAIT-FAILED %s\n", err.message);
    vramd_close(c);
    /* and a new connection fails at once: refused, or reset if it reached the listening
     * socket in the instant before the dying daemon's last fds were closed */
    r = test_connect(&c, &err);
    CHECK(r == -ECONNREFUSED || r == -ENOENT || r == -ECONNRESET, "connect to a dead daemon: %d %s", r, err.message);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* A daemon that stops answering: the call fails after timeout_ms, the connection is closed. */
static int t_daemon_stopped(void)
{
    pid_t dpid = (pid_t)env_num("VRAMD_TEST_DAEMON_PID", 0);
    CHECK(dpid > 0, "VRAMD_TEST_DAEMON_PID not set");
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    struct vramd_options o;
    vramd_options_init(&o);
    o.timeout_ms = 300;
    OK(vramd_connect_path(&c, daemon_socket(), &o, &err), &err);
    CHECK(kill(dpid, SIGSTOP) == 0, "SIGSTOP");
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct vramd_status st;
    int r = vramd_status(c, &st, &err);
    double took = since(&t0);
    kill(dpid, SIGCONT);
    CHECK(r == -ETIME && vramd_conn_broken(c), "status from a stopped daemon: %d %s", r, err.message);
    CHECK(took >= 0.25 && took < 3.0, "timed out after %.2f s", took);
    /* a Wait with a timeout gets its timeout plus the socket timeout */
    vramd_close(c);
    OK(vramd_connect_path(&c, daemon_socket(), &o, &err), &err);
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    CHECK(kill(dpid, SIGSTOP) == 0, "SIGSTOP");
    clock_gettime(CLOCK_MONOTONIC, &t0);
    r = vramd_wait(c, &t, 200, NULL, &err);
    took = since(&t0);
    kill(dpid, SIGCONT);
    CHECK(r == -ETIME && took >= 0.45 && took < 3.0, "wait on a stopped daemon: %d after %.2f s", r, took);
    vramd_close(c); /* the dump's opener hangs up: nobody else holds it, so the daemon cancels and reaps it */
    OK(test_connect(&c, &err), &err); /* close the session from another connection, unless reaped already */
    r = vramd_close_session(c, &t, NULL, &err);
    CHECK(r == 0 || (r == -ENOENT && err.code == VRAMD_CODE_NOT_FOUND), "close: %d %s", r, err.message);
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* --- a fake daemon: replies that break the protocol ------------------------- */

enum fake { FAKE_BAD_MAGIC, FAKE_BAD_KIND, FAKE_BAD_LENGTH, FAKE_WRONG_ID, FAKE_GARBAGE, FAKE_HANGUP, FAKE_REFUSE,
            FAKE_FD_ATTACHED, FAKE_NO_BODY, FAKE_TRUNCATED };

static void fake_daemon(int s, enum fake how)
{
    static uint8_t out[(1 << 20) + 64];
    Vramd__Rpc__V1__Request *req = fake_request(s);
    if (!req)
        _exit(2);
    Vramd__Rpc__V1__Response resp = VRAMD__RPC__V1__RESPONSE__INIT;
    Vramd__Rpc__V1__Error e = VRAMD__RPC__V1__ERROR__INIT;
    Vramd__Rpc__V1__HelloReply hr = VRAMD__RPC__V1__HELLO_REPLY__INIT;
    resp.has_id = 1;
    resp.id = how == FAKE_WRONG_ID ? req->id + 6 : req->id;
    resp.error = &e;
    e.has_code = 1;
    hr.has_version = 1;
    hr.version = VRAMD_PROTOCOL_VERSION;
    hr.server = "fake";
    resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_HELLO;
    resp.hello = &hr;
    if (how == FAKE_REFUSE) {
        resp.id = 0;
        e.code = VRAMD__RPC__V1__CODE__PERMISSION_DENIED;
        e.message = "peer uid 1234 not allowed";
        resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY__NOT_SET;
    }
    if (how == FAKE_NO_BODY)
        resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY__NOT_SET;
    vramd__rpc__v1__request__free_unpacked(req, NULL);
    size_t len = frame_response(out, sizeof out, &resp);
    switch (how) {
    case FAKE_BAD_MAGIC: out[0] = 'X'; break;
    case FAKE_BAD_KIND: out[5] = 1; break;
    case FAKE_BAD_LENGTH: out[8]++; break;
    case FAKE_GARBAGE: memset(out + 12, 0xff, len - 12); break;
    case FAKE_HANGUP: _exit(0);
    case FAKE_TRUNCATED: /* a packet bigger than any reply may be */
        memset(out + len, 0, sizeof out - len);
        len = sizeof out;
        break;
    default: break;
    }
    struct iovec iov = {.iov_base = out, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    union {
        char buf[CMSG_SPACE(2 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    if (how == FAKE_FD_ATTACHED) { /* a daemon must never send fds: the client closes them */
        int fds[2] = {make_memfd(4096, 1, 0, 0), make_memfd(4096, 1, 0, 0)};
        msg.msg_control = ctl.buf;
        msg.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof fds);
        memcpy(CMSG_DATA(cm), fds, sizeof fds);
    }
    if (sendmsg(s, &msg, MSG_NOSIGNAL) != (ssize_t)len)
        _exit(4);
    /* then answer a GetStatus, if one comes, with garbage-free silence: hang up */
    _exit(0);
}

static int t_fake_daemon(void)
{
    static const struct {
        enum fake how;
        int want;
        const char *name;
    } cases[] = {
        {FAKE_BAD_MAGIC, -EPROTO, "bad magic"},     {FAKE_BAD_KIND, -EPROTO, "request kind in a reply"},
        {FAKE_BAD_LENGTH, -EPROTO, "bad length"},   {FAKE_WRONG_ID, -EPROTO, "wrong id"},
        {FAKE_GARBAGE, -EPROTO, "garbage body"},    {FAKE_HANGUP, -ECONNRESET, "hang-up"},
        {FAKE_REFUSE, -EACCES, "refusal, id 0"},    {FAKE_FD_ATTACHED, 0, "fds attached"},
        {FAKE_NO_BODY, -EPROTO, "no HelloReply"},   {FAKE_TRUNCATED, -EPROTO, "oversized reply"},
    };
    /* SIGPIPE keeps its default action: a send without MSG_NOSIGNAL would kill this process */
    signal(SIGPIPE, SIG_DFL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int sp[2];
        CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
        if (cases[i].how == FAKE_TRUNCATED) {
            int big = 4 << 20;
            if (setsockopt(sp[1], SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big) < 0)
                setsockopt(sp[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
        }
        pid_t pid = fork();
        CHECK(pid >= 0, "fork");
        if (pid == 0) {
            close(sp[0]);
            fake_daemon(sp[1], cases[i].how);
        }
        close(sp[1]);
        int before = count_fds();
        struct vramd_conn *c = NULL;
        struct vramd_error err;
        int r = vramd_connect_fd(&c, sp[0], NULL, &err);
        int st = reap(pid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: fake daemon status %#x", cases[i].name, st);
        CHECK(r == cases[i].want, "%s: got %d (%s: %s), want %d", cases[i].name, r, vramd_code_name(err.code),
              err.message, cases[i].want);
        if (r == 0) {
            CHECK(count_fds() == before, "%s: the fds the daemon sent were not closed", cases[i].name);
            /* the fake hung up: the next call fails without SIGPIPE */
            struct vramd_status s;
            r = vramd_status(c, &s, &err);
            CHECK(r == -ECONNRESET && vramd_conn_broken(c), "%s: status after hang-up: %d", cases[i].name, r);
            vramd_close(c);
        } else {
            CHECK(c == NULL && count_fds() == before - 1, "%s: the socket was not closed", cases[i].name);
        }
        if (cases[i].how == FAKE_REFUSE)
            CHECK(err.code == VRAMD_CODE_PERMISSION_DENIED && strstr(err.message, "1234"), "refusal message");
    }
    return 0;
}

/* One request from the fake daemon's peer: its id and what it asks (the body's case); 0 at hang-up. */
static int fake_recv(int s, uint64_t *id, char *token, size_t cap)
{
    Vramd__Rpc__V1__Request *req = fake_request(s);
    if (!req)
        return 0;
    int which = (int)req->body_case;
    *id = req->id;
    if (token && which == VRAMD__RPC__V1__REQUEST__BODY_CLOSE_SESSION && req->close_session->token)
        snprintf(token, cap, "%s", req->close_session->token);
    vramd__rpc__v1__request__free_unpacked(req, NULL);
    return which;
}

static void fake_send_error(int s, uint64_t id, Vramd__Rpc__V1__SessionInfo *session, int code)
{
    Vramd__Rpc__V1__Response resp = VRAMD__RPC__V1__RESPONSE__INIT;
    Vramd__Rpc__V1__HelloReply hr = VRAMD__RPC__V1__HELLO_REPLY__INIT;
    Vramd__Rpc__V1__Error e = VRAMD__RPC__V1__ERROR__INIT;
    resp.has_id = 1;
    resp.id = id;
    if (code) {
        e.has_code = 1;
        e.code = (Vramd__Rpc__V1__Code)code;
        e.message = "still running";
        resp.error = &e;
    }
    if (session) {
        resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_SESSION;
        resp.session = session;
    } else {
        hr.has_version = 1;
        hr.version = VRAMD_PROTOCOL_VERSION;
        hr.server = "fake";
        resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_HELLO;
        resp.hello = &hr;
    }
    fake_reply(s, &resp);
}

static void fake_send(int s, uint64_t id, Vramd__Rpc__V1__SessionInfo *session)
{
    fake_send_error(s, id, session, 0);
}

#define FAKE_TOKEN "00112233445566778899aabbccddeeff"

/*
 * A restore submit whose AddBos reply never comes (the daemon stalls: the reply times out and the connection
 * is broken): before returning, the library closes the session over a new connection, by its token, so no
 * copy of it writes into the BOs once the caller falls back to copying them itself.  A fake daemon on a
 * socket path checks that the CloseSession comes, with that token.
 */
static int t_submit_closes_its_session_over_a_new_connection(void)
{
    char dir[] = "/tmp/vramd-fake-XXXXXX", sock[PATH_MAX], img[PATH_MAX];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(sock, sizeof sock, "%s/sock", dir);
    int ls = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
    CHECK(ls >= 0 && bind(ls, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(ls, 4) == 0, "listen");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        uint64_t id;
        Vramd__Rpc__V1__SessionInfo si = VRAMD__RPC__V1__SESSION_INFO__INIT;
        si.token = FAKE_TOKEN;
        si.has_state = 1, si.state = VRAMD__RPC__V1__SESSION_STATE__SESSION_OPEN;
        si.has_kind = 1, si.kind = VRAMD__RPC__V1__SESSION_KIND__SESSION_RESTORE;
        int a = accept(ls, NULL, NULL);
        if (a < 0 || fake_recv(a, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_HELLO)
            _exit(10);
        fake_send(a, id, NULL);
        if (fake_recv(a, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_OPEN_SESSION)
            _exit(11);
        fake_send(a, id, &si);
        if (fake_recv(a, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_ADD_BOS)
            _exit(12);
        /* no answer: the client's reply bound runs out, and it must come back on a new connection (within
         * seconds: a client that never does fails the test, not hangs it) */
        struct pollfd pl = {.fd = ls, .events = POLLIN};
        if (poll(&pl, 1, 10000) != 1)
            _exit(16);
        int b = accept(ls, NULL, NULL);
        if (b < 0 || fake_recv(b, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_HELLO)
            _exit(13);
        fake_send(b, id, NULL);
        char token[64] = "";
        if (fake_recv(b, &id, token, sizeof token) != VRAMD__RPC__V1__REQUEST__BODY_CLOSE_SESSION)
            _exit(14);
        if (strcmp(token, FAKE_TOKEN) != 0)
            _exit(15);
        si.state = VRAMD__RPC__V1__SESSION_STATE__SESSION_CANCELLED;
        fake_send(b, id, &si);
        _exit(0);
    }
    close(ls);
    int dfd = make_image_dir(img);
    int bo = make_memfd(4096, 1, 0, 4096);
    CHECK(dfd >= 0 && bo >= 0 && touch_at(dfd, "manifest.vrdm") == 0, "setup");
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.socket_path = sock;
    cfg.timeout_ms = 300;
    struct vramd_criu_bo b = {.id = 1, .fd = bo};
    struct vramd_criu_ticket ticket;
    struct vramd_error err;
    int r = vramd_criu_restore_submit(&cfg, dfd, &b, 1, 0, &ticket, &err);
    int st = reap(pid);
    CHECK(r == -ETIME && err.code == VRAMD_CODE_LOCAL, "submit: %d %s %s", r, vramd_code_name(err.code), err.message);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the fake daemon saw no CloseSession of the token: status %#x",
          st);
    close(bo);
    close(dfd);
    remove_dir(img);
    unlink(sock);
    rmdir(dir);
    return 0;
}

/*
 * The barrier's bound holds even where the copies do not stop: the Wait runs out (the daemon answers
 * TIMEOUT), and the CloseSession that cancels the session gets no answer (its job hangs).  The call returns
 * within about twice wait_timeout_ms, though the connection has no reply bound of its own.
 */
static int t_barrier_bound_holds_when_the_close_hangs(void)
{
    int fd;
    pid_t pid = fork_peer(&fd);
    CHECK(pid >= 0, "socketpair, fork");
    if (pid == 0) {
        uint64_t id;
        Vramd__Rpc__V1__SessionInfo si = VRAMD__RPC__V1__SESSION_INFO__INIT;
        si.token = FAKE_TOKEN;
        si.has_state = 1, si.state = VRAMD__RPC__V1__SESSION_STATE__SESSION_SEALED;
        si.has_kind = 1, si.kind = VRAMD__RPC__V1__SESSION_KIND__SESSION_RESTORE;
        if (fake_recv(fd, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_HELLO)
            _exit(10);
        fake_send(fd, id, NULL);
        if (fake_recv(fd, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_WAIT)
            _exit(11);
        fake_send_error(fd, id, &si, VRAMD__RPC__V1__CODE__TIMEOUT);
        if (fake_recv(fd, &id, NULL, 0) != VRAMD__RPC__V1__REQUEST__BODY_CLOSE_SESSION)
            _exit(12);
        /* no answer: the job does not stop; the client hangs up when its bound runs out (a client that
         * waits on is let go after 10 s, and fails the test, rather than hang it) */
        struct pollfd pl = {.fd = fd, .events = POLLIN};
        if (poll(&pl, 1, 10000) != 1)
            _exit(13);
        char b;
        while (recv(fd, &b, 1, 0) > 0)
            ;
        _exit(0);
    }
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    OK(vramd_connect_fd(&c, fd, NULL, &err), &err);
    struct vramd_criu_config cfg;
    vramd_criu_config_init(&cfg);
    cfg.wait_timeout_ms = 300;
    struct vramd_criu_ticket ticket = {.pid = 1};
    CHECK(vramd_token_parse(FAKE_TOKEN, &ticket.token) == 0, "token");
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int r = vramd_criu_restore_finish(&cfg, c, &ticket, NULL, &err);
    double took = since(&t0);
    CHECK(r == -ETIMEDOUT && err.code == VRAMD_CODE_TIMEOUT, "finish: %d %s %s", r, vramd_code_name(err.code),
          err.message);
    CHECK(took < 3.0, "the barrier took %.2f s with a 0.3 s bound", took);
    vramd_close(c);
    int st = reap(pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fake daemon status %#x", st);
    return 0;
}

const struct test failure_tests[] = {
    {"no_daemon", t_no_daemon, "all quick"},
    {"fake_daemon", t_fake_daemon, "all quick"},
    {"bad_fds", t_bad_fds, "all quick"},
    {"unknown_gpu", t_unknown_gpu, "all quick"},
    {"barrier_bound_holds_when_the_close_hangs", t_barrier_bound_holds_when_the_close_hangs, "all quick"},
    {"submit_closes_its_session_over_a_new_connection", t_submit_closes_its_session_over_a_new_connection, "all quick"},
    {"uid_refused", t_uid_refused, "all quick"},
    {"untrusted_daemon", t_untrusted_daemon, "all quick"},
    {"corrupt_image", t_corrupt_image, "all quick"},
    {"task_dies_attach_in_grace", t_task_dies_attach_in_grace, "grace"},
    {"task_dies_reaped", t_task_dies_reaped, "interactive"},
    {"daemon_stopped", t_daemon_stopped, "pid"},
    {"daemon_killed_in_wait", t_daemon_killed_in_wait, "destructive"},
    {NULL, NULL, NULL},
};
