/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Protocol 2: the client opens, creates, renames and removes every file of an
 * image (docs/protocol.md, "Image files: the client's rights").  A dump's files
 * are the caller's and nothing is in place until its Wait returns OK; a dump
 * that does not commit leaves nothing; one dump per directory; a restore or
 * verify of a file the caller cannot open, or that is not a regular file, fails
 * here, naming the file.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "rpc.pb-c.h"

#define BO_BYTES (1 << 20)

/* One whole dump of `src` (1 MiB) into dfd; rc of the first failing call. */
static int dump_one(struct vramd_conn *c, int dfd, int src, const int *parents, size_t np, bool replace,
                    struct vramd_error *err)
{
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .chunk_size = 1 << 20,
                                .parent_dir_fds = parents, .n_parent_dir_fds = np, .replace_parent = replace};
    struct vramd_bo bo = {.id = 1, .fd = src, .size = BO_BYTES};
    struct vramd_token t;
    int r = vramd_open_session(c, &a, &t, NULL, err);
    if (r < 0)
        return r;
    if ((r = vramd_add_bos(c, &t, &bo, 1, NULL, err)) == 0 && (r = vramd_start(c, &t, NULL, err)) == 0)
        r = vramd_wait(c, &t, 60000, NULL, err);
    struct vramd_error ignored;
    vramd_close_session(c, &t, NULL, &ignored);
    return r;
}

/* One whole restore (or verify, without dst) of the image in dfd; rc of the first failing call. */
static int restore_one(struct vramd_conn *c, int kind, int dfd, int dst, struct vramd_error *err)
{
    struct vramd_open_args a = {.kind = kind, .dir_fd = dfd};
    struct vramd_bo bo = {.id = 1, .fd = dst};
    struct vramd_token t;
    int r = vramd_open_session(c, &a, &t, NULL, err);
    if (r < 0)
        return r;
    if (kind == VRAMD_SESSION_RESTORE && ((r = vramd_add_bos(c, &t, &bo, 1, NULL, err)) < 0 ||
                                          (r = vramd_start(c, &t, NULL, err)) < 0))
        goto out;
    r = vramd_wait(c, &t, 60000, NULL, err);
out:;
    struct vramd_error ignored;
    vramd_close_session(c, &t, NULL, &ignored);
    return r;
}

/* The file `name` in `dir` is a regular file of this uid with mode 0600. */
static int owned_by_me(const char *dir, const char *name)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    CHECK(lstat(p, &st) == 0, "%s: %s", p, strerror(errno));
    CHECK(S_ISREG(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 07777) == 0600,
          "%s: mode %o uid %u (want a regular file, 0600, uid %u)", name, st.st_mode, st.st_uid, geteuid());
    return 0;
}

/* The directory's lock as vramctl and vramd.client take it (vramd.imagedir.take_lock): its .lock file
 * (created 0600 where missing), flocked with `how` (LOCK_SH or LOCK_EX, LOCK_NB added); the fd, or -1. */
static int hold_lock(const char *dir, int how)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/.lock", dir);
    int fd = open(p, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0 && flock(fd, how | LOCK_NB) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int exists(const char *dir, const char *name)
{
    char p[PATH_MAX];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return lstat(p, &st) == 0;
}

/* --- data files ------------------------------------------------------------ */

#define MAX_STRIPES 16 /* format.MAX_STRIPES */

/* Data file `stripe` of GPU `gpu` of the image whose id begins with the 16 hex digits `id16`, plus `suffix`. */
static void data_file(char *out, const char *id16, uint32_t gpu, uint32_t stripe, const char *suffix)
{
    if (stripe)
        snprintf(out, PATH_MAX, "data-%.16s-%08x-%x.vrd%s", id16, gpu, stripe, suffix);
    else
        snprintf(out, PATH_MAX, "data-%.16s-%08x.vrd%s", id16, gpu, suffix);
}

/* The data-* entries of `dir` are exactly data files 0 to n-1 of GPU 0 of one image (their .tmp when tmp), each a
 * regular file of this uid with mode 0600; that image's first 16 hex digits go into id16 (17 bytes). */
static int gpu0_files(const char *dir, int n, bool tmp, char *id16)
{
    char name[PATH_MAX], want[PATH_MAX];
    const char *suffix = tmp ? ".tmp" : "";
    CHECK(count_entries(dir, "data-", tmp ? "-00000000.vrd.tmp" : "-00000000.vrd", name) == 1,
          "no data file 0 of GPU 0%s in %s", suffix, dir);
    snprintf(id16, 17, "%.16s", name + 5);
    CHECK(count_entries(dir, "data-", "", NULL) == n, "%d data-* entries in %s, want %d (data files per GPU)",
          count_entries(dir, "data-", "", NULL), dir, n);
    for (int k = 0; k < n; k++) {
        data_file(want, id16, 0, (uint32_t)k, suffix);
        CHECK(exists(dir, want), "%s is missing in %s", want, dir);
        if (owned_by_me(dir, want))
            return 1;
    }
    return 0;
}

/* Speak the protocol by hand: one request on `s`, its reply (NULL on any failure; free it). */
static Vramd__Rpc__V1__Response *raw_call(int s, Vramd__Rpc__V1__Request *req, uint64_t id)
{
    static uint8_t buf[(1 << 20) + 64];
    req->has_id = 1;
    req->id = id;
    size_t n = vramd__rpc__v1__request__get_packed_size(req);
    if (n + 12 > sizeof buf)
        return NULL;
    memcpy(buf, "VRDP", 4);
    buf[4] = 1, buf[5] = 1, buf[6] = buf[7] = 0; /* frame version 1, a request */
    buf[8] = (uint8_t)n, buf[9] = (uint8_t)(n >> 8), buf[10] = (uint8_t)(n >> 16), buf[11] = (uint8_t)(n >> 24);
    vramd__rpc__v1__request__pack(req, buf + 12);
    if (send(s, buf, n + 12, MSG_NOSIGNAL) != (ssize_t)(n + 12))
        return NULL;
    ssize_t got = recv(s, buf, sizeof buf, 0);
    if (got < 12 || memcmp(buf, "VRDP", 4) != 0 || buf[5] != 2)
        return NULL;
    return vramd__rpc__v1__response__unpack(NULL, (size_t)got - 12, buf + 12);
}

/* How many data files per GPU the daemon asks a dump's client for (SessionInfo.data_files_per_gpu of an
 * OpenSession reply, read off the wire: libvramd keeps it to itself), or -1. */
static int daemon_data_files_per_gpu(void)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", daemon_socket());
    if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof sa) < 0) {
        if (s >= 0)
            close(s);
        return -1;
    }
    int per_gpu = -1;
    uint32_t versions[] = {VRAMD_PROTOCOL_VERSION};
    Vramd__Rpc__V1__Hello h = VRAMD__RPC__V1__HELLO__INIT;
    h.n_versions = 1, h.versions = versions, h.client = "libvramd-tests (by hand)";
    Vramd__Rpc__V1__Request req = VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_HELLO, req.hello = &h;
    Vramd__Rpc__V1__Response *resp = raw_call(s, &req, 1);
    if (!resp || resp->body_case != VRAMD__RPC__V1__RESPONSE__BODY_HELLO)
        goto out;
    vramd__rpc__v1__response__free_unpacked(resp, NULL);
    Vramd__Rpc__V1__OpenSession o = VRAMD__RPC__V1__OPEN_SESSION__INIT;
    o.has_kind = 1, o.kind = VRAMD__RPC__V1__SESSION_KIND__SESSION_DUMP;
    req = (Vramd__Rpc__V1__Request)VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_OPEN_SESSION, req.open_session = &o;
    resp = raw_call(s, &req, 2);
    if (!resp || resp->body_case != VRAMD__RPC__V1__RESPONSE__BODY_SESSION || !resp->session ||
        !resp->session->token)
        goto out;
    per_gpu = (int)resp->session->data_files_per_gpu;
    char token[VRAMD_TOKEN_STRLEN + 1];
    snprintf(token, sizeof token, "%s", resp->session->token);
    vramd__rpc__v1__response__free_unpacked(resp, NULL);
    Vramd__Rpc__V1__CloseSession cs = VRAMD__RPC__V1__CLOSE_SESSION__INIT;
    cs.token = token;
    req = (Vramd__Rpc__V1__Request)VRAMD__RPC__V1__REQUEST__INIT;
    req.body_case = VRAMD__RPC__V1__REQUEST__BODY_CLOSE_SESSION, req.close_session = &cs;
    resp = raw_call(s, &req, 3);
out:
    if (resp)
        vramd__rpc__v1__response__free_unpacked(resp, NULL);
    close(s);
    return per_gpu;
}

/* A dump's files are created by this process (its uid, 0600) and nothing is in place before Wait's OK; as many
 * data files for the GPU as the daemon asks for, all committed, and the image restores. */
static int t_dump_commit(void)
{
    struct vramd_conn *c = NULL, *other = NULL;
    struct vramd_error err;
    char path[PATH_MAX], name[PATH_MAX], first[17], now[17];
    int per_gpu = daemon_data_files_per_gpu();
    CHECK(per_gpu >= 0 && per_gpu <= MAX_STRIPES, "the daemon asks for %d data files per GPU", per_gpu);
    int n = per_gpu ? per_gpu : 1; /* 0: a daemon older than the field, one file */
    printf("  the daemon asks for %d data file(s) per GPU\n", per_gpu);
    int dfd = make_image_dir(path);
    /* 8 chunks of 128 KiB: enough batches for every data file the copy threads take */
    int src = make_memfd(BO_BYTES, 5, 0, BO_BYTES), dst = make_memfd(BO_BYTES, 0, 0, 0);
    CHECK(dfd >= 0 && src >= 0 && dst >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(test_connect(&other, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd, .chunk_size = 128 << 10};
    struct vramd_token t;
    struct vramd_session_info info;
    OK(vramd_open_session(c, &a, &t, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_OPEN, "state %d", info.state);
    CHECK(count_entries(path, "", "", NULL) == 1 && owned_by_me(path, ".lock") == 0,
          "the directory changed at OpenSession (other than its lock file, .lock)");
    struct vramd_bo bo = {.id = 1, .fd = src, .size = BO_BYTES};
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    if (gpu0_files(path, n, true, first))
        return 1;
    OK(vramd_start(c, &t, NULL, &err), &err);
    CHECK(count_entries(path, ".manifest.vrdm.", ".tmp", name) == 1, "no manifest .tmp after Start");
    if (owned_by_me(path, name))
        return 1;
    /* the daemon has written everything; still nothing is in place: only Wait commits, on this connection */
    int r = vramd_wait(other, &t, 60000, &info, &err);
    CHECK(r == -EXDEV && err.code == VRAMD_CODE_LOCAL && info.state == VRAMD_STATE_DONE,
          "Wait on another connection: %d %s (state %d)", r, err.message, info.state);
    CHECK(!exists(path, "manifest.vrdm") && count_entries(path, "data-", ".vrd", NULL) == 0,
          "something was put in place before the opener's Wait");
    OK(vramd_wait(c, &t, 60000, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_DONE, "state %d", info.state);
    if (owned_by_me(path, "manifest.vrdm"))
        return 1;
    if (gpu0_files(path, n, false, now))
        return 1;
    CHECK(strcmp(now, first) == 0, "committed data files of image %s, the dump's is %s", now, first);
    CHECK(info.has_image && info.image.data_files == (uint32_t)n, "the manifest lists %u data files, want %d",
          info.image.data_files, n);
    CHECK(count_entries(path, "", ".tmp", NULL) == 0, "a .tmp is left after the commit");
    OK(vramd_wait(c, &t, 10000, &info, &err), &err); /* a second Wait: still OK, nothing done twice */
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    OK(restore_one(c, VRAMD_SESSION_RESTORE, dfd, dst, &err), &err);
    CHECK(compare_fds(src, dst, BO_BYTES) < 0, "restored bytes differ");
    /* the lock went with the commit: a new dump replaces the image and removes every data file of the old one,
     * and nothing else (a name outside the format, even one that looks like a data file, is not vramd's) */
    data_file(name, first, 0, 0, "");
    memcpy(name + strlen(name) - 4, "-0.vrd", 7); /* data-<old id>-00000000-0.vrd: not a data file name */
    CHECK(touch_at(dfd, name) == 0, "create %s", name);
    OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
    CHECK(exists(path, name) && unlinkat(dfd, name, 0) == 0, "%s was removed", name);
    if (gpu0_files(path, n, false, now))
        return 1;
    CHECK(strcmp(now, first) != 0, "the replacing dump has the replaced one's id %s", now);
    close(dst);
    dst = make_memfd(BO_BYTES, 0, 0, 0);
    CHECK(dst >= 0, "memfd");
    OK(restore_one(c, VRAMD_SESSION_RESTORE, dfd, dst, &err), &err);
    CHECK(compare_fds(src, dst, BO_BYTES) < 0, "restored bytes differ (the replacing image)");
    vramd_close(other);
    vramd_close(c);
    close(src);
    close(dst);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* Nothing of a dump that does not commit is left: failed, cancelled, closed, or its connection closed. */
static int t_dump_no_commit(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX], old[17], now[PATH_MAX];
    int per_gpu = daemon_data_files_per_gpu();
    CHECK(per_gpu >= 0, "the daemon's data files per GPU");
    int n = per_gpu ? per_gpu : 1;
    int dfd = make_image_dir(path);
    int src = make_memfd(BO_BYTES, 6, 0, BO_BYTES);
    CHECK(dfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t;
    struct vramd_session_info info;
    struct vramd_bo bos[2] = {{.id = 1, .fd = src, .size = BO_BYTES}, {.id = 2, .fd = dfd, .size = 4096}};
    for (int how = 0; how < 4; how++) {
        OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
        OK(vramd_add_bos(c, &t, bos, 1, NULL, &err), &err);
        int r;
        switch (how) {
        case 0: /* the session fails: a directory as a BO */
            r = vramd_add_bos(c, &t, &bos[1], 1, NULL, &err);
            CHECK(r == -EBADF && err.code == VRAMD_CODE_BAD_DESCRIPTOR, "directory as BO: %d %s", r, err.message);
            OK(vramd_start(c, &t, NULL, &err), &err);
            r = vramd_wait(c, &t, 60000, &info, &err);
            CHECK(r == -EBADF && info.state == VRAMD_STATE_FAILED, "wait: %d state %d", r, info.state);
            break;
        case 1: /* cancelled */
            OK(vramd_cancel(c, &t, "ctest", NULL, &err), &err);
            r = vramd_wait(c, &t, 60000, &info, &err);
            CHECK(r == -ECANCELED, "wait after cancel: %d", r);
            break;
        case 2: /* started, then closed without a Wait: DONE or not, it is not committed */
            OK(vramd_start(c, &t, NULL, &err), &err);
            break;
        case 3: /* started, then the connection goes */
            OK(vramd_start(c, &t, NULL, &err), &err);
            vramd_close(c);
            c = NULL;
            OK(test_connect(&c, &err), &err);
            break;
        }
        struct vramd_error ignored;
        vramd_close_session(c, &t, NULL, &ignored);
        CHECK(count_entries(path, "", "", now) == (how ? 1 + n : 0), "case %d: %d entries left, first %s", how,
              count_entries(path, "", "", NULL), now);
        if (how == 0) { /* from here on a committed image is in the directory: it must stay as it is */
            OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
            if (gpu0_files(path, n, false, old))
                return 1;
        } else {
            CHECK(exists(path, "manifest.vrdm"), "case %d: the committed manifest went", how);
            if (gpu0_files(path, n, false, now))
                return 1;
            CHECK(strcmp(now, old) == 0, "case %d: the committed image changed (%s, was %s)", how, now, old);
        }
    }
    /* and the directory is not locked by any of them */
    OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
    vramd_close(c);
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* One dump per directory: a second one is -EBUSY, locally, until the first ends. */
static int t_dump_busy(void)
{
    struct vramd_conn *c = NULL, *c2 = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(BO_BYTES, 7, 0, BO_BYTES);
    CHECK(dfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(test_connect(&c2, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t, t2;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    int r = vramd_open_session(c2, &a, &t2, NULL, &err);
    CHECK(r == -EBUSY && err.code == VRAMD_CODE_LOCAL && strstr(err.message, path), "second dump: %d %s: %s", r,
          vramd_code_name(err.code), err.message);
    r = vramd_open_session(c, &a, &t2, NULL, &err);
    CHECK(r == -EBUSY, "second dump on the same connection: %d", r);
    /* vramctl takes the same lock: its rm and gc are refused while this dump holds the directory */
    const char *vramctl = getenv("VRAMD_TEST_VRAMCTL");
    if (vramctl && *vramctl) {
        static const char *const cmds[] = {"rm", "gc"};
        for (int k = 0; k < 2; k++) {
            char cmd[3 * PATH_MAX];
            snprintf(cmd, sizeof cmd, "%s %s '%s' 2>/dev/null >/dev/null", vramctl, cmds[k], path);
            int st = system(cmd);
            CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1, "vramctl %s while a libvramd dump holds %s: status %#x",
                  cmds[k], path, st);
        }
    }
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    OK(dump_one(c2, dfd, src, NULL, 0, false, &err), &err);
    CHECK(!exists(path, ".lock"), "the lock file outlived its holders");
    /* the lock vramctl and vramd.client take (the directory's .lock, flocked) counts */
    int lk = hold_lock(path, LOCK_EX);
    CHECK(lk >= 0, "flock of .lock: %s", strerror(errno));
    r = dump_one(c, dfd, src, NULL, 0, false, &err);
    CHECK(r == -EBUSY, "dump into a locked directory: %d %s", r, err.message);
    close(lk);
    /* a flock on the directory itself, which anyone who may read it can take, blocks nothing */
    lk = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(lk >= 0 && flock(lk, LOCK_EX | LOCK_NB) == 0, "flock of the directory");
    OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
    close(lk);
    OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
    vramd_close(c2);
    vramd_close(c);
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* A restore or verify of a file the caller cannot open fails here, with a local error naming it. */
static int t_unreadable_image(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX], data[PATH_MAX], p[PATH_MAX], q[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(BO_BYTES, 8, 0, BO_BYTES), dst = make_memfd(BO_BYTES, 0, 0, 0);
    CHECK(dfd >= 0 && src >= 0 && dst >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
    /* data file 0 of GPU 0 (a GPU's further data files end -<stripe>.vrd) */
    CHECK(count_entries(path, "data-", "-00000000.vrd", data) == 1, "no data file");
    snprintf(p, sizeof p, "%s/%s", path, data);
    snprintf(q, sizeof q, "%s/moved", path);
    static const int kinds[] = {VRAMD_SESSION_RESTORE, VRAMD_SESSION_VERIFY};
    /* the data file missing */
    CHECK(rename(p, q) == 0, "rename");
    for (int k = 0; k < 2; k++) {
        int r = restore_one(c, kinds[k], dfd, dst, &err);
        CHECK(r == -ENOENT && err.code == VRAMD_CODE_LOCAL && strstr(err.message, data) && strstr(err.message, path),
              "kind %d, data file missing: %d %s: %s", kinds[k], r, vramd_code_name(err.code), err.message);
    }
    /* a symbolic link in its place (to the very file): O_NOFOLLOW refuses it */
    CHECK(symlink("moved", p) == 0, "symlink");
    for (int k = 0; k < 2; k++) {
        int r = restore_one(c, kinds[k], dfd, dst, &err);
        CHECK(r == -ELOOP && err.code == VRAMD_CODE_LOCAL && strstr(err.message, data) &&
                  strstr(err.message, "symbolic link"),
              "kind %d, data file a symlink: %d %s: %s", kinds[k], r, vramd_code_name(err.code), err.message);
    }
    /* a FIFO in its place: refused here as not a regular file, never read, never handed to the daemon */
    CHECK(unlink(p) == 0 && mkfifo(p, 0600) == 0, "mkfifo");
    for (int k = 0; k < 2; k++) {
        int r = restore_one(c, kinds[k], dfd, dst, &err);
        CHECK(r == -EINVAL && err.code == VRAMD_CODE_FOREIGN_DATA_FILE && strstr(err.message, data) &&
                  strstr(err.message, "not a regular file"),
              "kind %d, data file a FIFO: %d %s: %s", kinds[k], r, vramd_code_name(err.code), err.message);
    }
    CHECK(check_memfd(dst, BO_BYTES, 0, 0, 0) < 0, "a refused restore wrote a byte");
    CHECK(unlink(p) == 0 && rename(q, p) == 0, "put back");
    /* no manifest: -ENOENT naming it and the directory */
    snprintf(p, sizeof p, "%s/manifest.vrdm", path);
    CHECK(rename(p, q) == 0, "rename");
    for (int k = 0; k < 2; k++) {
        int r = restore_one(c, kinds[k], dfd, dst, &err);
        CHECK(r == -ENOENT && err.code == VRAMD_CODE_LOCAL && strstr(err.message, "manifest.vrdm") &&
                  strstr(err.message, path),
              "kind %d, no manifest: %d %s: %s", kinds[k], r, vramd_code_name(err.code), err.message);
    }
    CHECK(symlink("moved", p) == 0, "symlink");
    int r = restore_one(c, VRAMD_SESSION_VERIFY, dfd, dst, &err);
    CHECK(r == -ELOOP && strstr(err.message, "manifest.vrdm"), "manifest a symlink: %d %s", r, err.message);
    CHECK(unlink(p) == 0 && mkfifo(p, 0600) == 0, "mkfifo");
    r = restore_one(c, VRAMD_SESSION_VERIFY, dfd, dst, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_CORRUPT_MANIFEST && strstr(err.message, "manifest.vrdm") &&
              strstr(err.message, "not a regular file"),
          "manifest a FIFO: %d %s: %s", r, vramd_code_name(err.code), err.message);
    CHECK(unlink(p) == 0 && rename(q, p) == 0, "put back");
    /* and as it was, it restores */
    OK(restore_one(c, VRAMD_SESSION_VERIFY, dfd, dst, &err), &err);
    OK(restore_one(c, VRAMD_SESSION_RESTORE, dfd, dst, &err), &err);
    CHECK(compare_fds(src, dst, BO_BYTES) < 0, "restored bytes differ");
    vramd_close(c);
    close(src);
    close(dst);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* Children marks, a directory that is its own parent, a crashed dump's temporaries swept. */
static int t_marks_and_sweep(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], cpath[PATH_MAX], mark[PATH_MAX], p[PATH_MAX];
    int pfd = make_image_dir(ppath), cfd = make_image_dir(cpath);
    int src = make_memfd(BO_BYTES, 9, 0, BO_BYTES);
    CHECK(pfd >= 0 && cfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    OK(dump_one(c, cfd, src, &pfd, 1, false, &err), &err);
    CHECK(count_entries(ppath, ".child.", "", mark) == 1 && strlen(mark) == 7 + 32, "parent marks: %d",
          count_entries(ppath, ".child.", "", NULL));
    CHECK(count_entries(cpath, ".child.", "", NULL) == 0, "the child marked itself");
    /* the mark names the child: its image id, its directory from the parent's and its absolute path */
    {
        char want[3 * PATH_MAX], got[3 * PATH_MAX], real[PATH_MAX];
        const char *base = strrchr(cpath, '/') + 1;
        CHECK(realpath(cpath, real) != NULL, "realpath %s", cpath);
        snprintf(want, sizeof want, "vramd child mark 1\nimage %s\npath ../%s\nabs %s\n", mark + 7, base, real);
        snprintf(p, sizeof p, "%s/%s", ppath, mark);
        int mf = open(p, O_RDONLY | O_CLOEXEC);
        ssize_t n = mf >= 0 ? read(mf, got, sizeof got - 1) : -1;
        if (mf >= 0)
            close(mf);
        CHECK(n > 0, "read %s", p);
        got[n] = '\0';
        CHECK(strcmp(got, want) == 0, "the mark holds \"%s\", want \"%s\"", got, want);
    }
    /* a child replaced, twice: its parent holds one mark, the new image's (the old one's went with its commit) */
    for (int k = 0; k < 2; k++) {
        char now[PATH_MAX];
        OK(dump_one(c, cfd, src, &pfd, 1, false, &err), &err);
        CHECK(count_entries(ppath, ".child.", "", now) == 1 && strcmp(now, mark) != 0,
              "replacement %d: %d parent marks (first %s, before %s)", k + 1, count_entries(ppath, ".child.", "", NULL),
              now, mark);
        memcpy(mark, now, strlen(now) + 1);
    }
    /* the parent is needed: not replaced unless replace_parent */
    int r = dump_one(c, pfd, src, NULL, 0, false, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_LOCAL && strstr(err.message, mark), "dump over a parent: %d %s", r,
          err.message);
    /* an image is never its own parent, replace_parent or not */
    for (int replace = 0; replace < 2; replace++) {
        r = dump_one(c, cfd, src, &cfd, 1, replace, &err);
        CHECK(r == -EINVAL && err.code == VRAMD_CODE_LOCAL, "own parent (replace %d): %d %s", replace, r, err.message);
    }
    /* a crashed dump's temporaries go (regular files only, names of the format only), at the next dump's open */
    static const char *const stale[] = {"data-0123456789abcdef-00000000.vrd.tmp",
                                        ".manifest.vrdm.0123456789abcdef0123456789abcdef.tmp",
                                        "data-0123456789abcdef-00000000-1.vrd.tmp",
                                        "data-0123456789abcdef-00000003-f.vrd.tmp"};
    static const char *const foreign[] = {"data-0123456789abcdef-00000000-0.vrd.tmp",
                                          "data-0123456789abcdef-00000000-10.vrd.tmp",
                                          "data-0123456789abcdef-00000000-A.vrd.tmp"};
    enum { NSTALE = sizeof stale / sizeof stale[0], NFOREIGN = sizeof foreign / sizeof foreign[0] };
    for (size_t i = 0; i < NSTALE + NFOREIGN; i++)
        CHECK(touch_at(cfd, i < NSTALE ? stale[i] : foreign[i - NSTALE]) == 0, "create %s",
              i < NSTALE ? stale[i] : foreign[i - NSTALE]);
    snprintf(p, sizeof p, "%s/data-fedcba9876543210-00000000.vrd.tmp", cpath);
    CHECK(symlink("manifest.vrdm", p) == 0, "symlink");
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = cfd, .chunk_size = 1 << 20,
                                .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
    struct vramd_token t;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    for (size_t i = 0; i < NSTALE; i++)
        CHECK(!exists(cpath, stale[i]), "stale temporary %s left", stale[i]);
    for (size_t i = 0; i < NFOREIGN; i++) {
        char q[PATH_MAX];
        snprintf(q, sizeof q, "%s/%s", cpath, foreign[i]);
        CHECK(unlink(q) == 0, "%s (not a name of the format) was swept", foreign[i]);
    }
    CHECK(exists(cpath, "data-fedcba9876543210-00000000.vrd.tmp"), "a symlink was swept");
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    CHECK(exists(cpath, "manifest.vrdm"), "the child's image went");
    CHECK(unlink(p) == 0, "unlink");
    /* replace_parent: the parent is replaced (its child now refers to an image that is gone) */
    OK(dump_one(c, pfd, src, NULL, 0, true, &err), &err);
    r = restore_one(c, VRAMD_SESSION_VERIFY, cfd, -1, &err);
    CHECK(r < 0, "the child of a replaced parent still verifies");
    vramd_close(c);
    close(src);
    close(pfd);
    close(cfd);
    remove_dir(cpath);
    remove_dir(ppath);
    return 0;
}

/* A child marks its parent under a shared lock: a sibling marking it at that moment (a shared flock held on the
 * parent's directory) does not fail its commit; a dump writing there (an exclusive one) does: -EBUSY, no mark. */
static int t_sibling_children(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], apath[PATH_MAX], bpath[PATH_MAX];
    int pfd = make_image_dir(ppath), afd = make_image_dir(apath), bfd = make_image_dir(bpath);
    int src = make_memfd(BO_BYTES, 11, 0, BO_BYTES);
    CHECK(pfd >= 0 && afd >= 0 && bfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    int held = hold_lock(ppath, LOCK_SH);
    CHECK(held >= 0, "a sibling's shared lock");
    OK(dump_one(c, afd, src, &pfd, 1, false, &err), &err);
    CHECK(count_entries(ppath, ".child.", "", NULL) == 1, "the child did not mark its parent");
    CHECK(flock(held, LOCK_EX) == 0, "a dump's exclusive lock");
    int r = dump_one(c, bfd, src, &pfd, 1, false, &err);
    CHECK(r == -EBUSY && err.code == VRAMD_CODE_LOCAL && strstr(err.message, ppath), "child while a dump writes "
          "into its parent: %d %s", r, err.message);
    CHECK(count_entries(ppath, ".child.", "", NULL) == 1, "the failed child left a mark");
    CHECK(!exists(bpath, "manifest.vrdm"), "the failed child committed");
    close(held);
    /* a child being dumped holds its parent directory's lock, shared, from its OpenSession to its end: a dump
     * replacing the parent meanwhile (it would see no mark of this child yet) is refused */
    struct vramd_open_args ca = {.kind = VRAMD_SESSION_DUMP, .dir_fd = bfd, .chunk_size = 1 << 20,
                                 .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
    struct vramd_token ct;
    OK(vramd_open_session(c, &ca, &ct, NULL, &err), &err);
    r = dump_one(c, pfd, src, NULL, 0, true, &err);
    CHECK(r == -EBUSY && strstr(err.message, "another dump is writing into") && strstr(err.message, ppath),
          "replacing a parent while a child of it is being dumped: %d %s", r, err.message);
    OK(vramd_close_session(c, &ct, NULL, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, true, &err), &err); /* the child is gone: now it may (replace_parent) */
    vramd_close(c);
    close(src);
    close(pfd);
    close(afd);
    close(bfd);
    remove_dir(apath);
    remove_dir(bpath);
    remove_dir(ppath);
    return 0;
}

/* A process whose fds 0 and 1 are free (a daemon that closed its stdio) with min_fd 0: the dump's directory
 * duplicate lands on 0 and its .lock on 1, and the lock is still taken and held (a vramctl-style flock of
 * .lock is refused) and released at the end, and fd 1 is not left holding .lock.  (found by review: fd 1 was
 * read as "this uid may not create .lock" and the dump went on unlocked, .lock open on fd 1 for good) */
static int t_lock_on_fd_one(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t;
    int saved0 = fcntl(0, F_DUPFD_CLOEXEC, 100), saved1 = fcntl(1, F_DUPFD_CLOEXEC, 100);
    CHECK(saved0 >= 0 && saved1 >= 0, "saving fds 0 and 1: %s", strerror(errno));
    close(0);
    close(1);
    int r = vramd_open_session(c, &a, &t, NULL, &err);
    int other = hold_lock(path, LOCK_SH); /* as vramctl rm/gc would take it */
    struct stat one;
    bool one_is_lock = fstat(1, &one) == 0 && S_ISREG(one.st_mode);
    if (other >= 0)
        close(other);
    struct vramd_error ignored;
    if (r == 0)
        vramd_close_session(c, &t, NULL, &ignored);
    bool one_open_after = fcntl(1, F_GETFD) >= 0 && fstat(1, &one) == 0 && S_ISREG(one.st_mode);
    dup2(saved0, 0);
    dup2(saved1, 1);
    close(saved0);
    close(saved1);
    CHECK(r == 0, "dump with fds 0 and 1 free: %d %s", r, err.message);
    CHECK(other < 0, "the dump (its .lock on fd %s) did not hold the directory's lock: another took it",
          one_is_lock ? "1" : "?");
    CHECK(!one_open_after, "fd 1 still holds a regular file (.lock) after the session ended");
    CHECK(!exists(path, ".lock"), "the lock file outlived its holder");
    vramd_close(c);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* Children of one image never exclude each other: 4 processes, each on its own connection, begin child dumps
 * of one parent 20,000 times each at once, and none is refused the parent's lock.  Each child directory holds a
 * mark, so each vramd_open_session takes the parent's lock (shared), then its own, then refuses the directory
 * (-EINVAL, "the parent of 1 incremental image") and releases both, all locally: the lock is taken and
 * released at full speed.  The parent is $VRAMD_TEST_CHURN_PARENT where set (one whose lock other processes,
 * vramd.imagedir's, take and release meanwhile: tests/test_libvramd.py), else one made here, whose .lock is
 * gone at the end.  (found by review: a sibling opening .lock as its last holder removed it was refused, "has
 * 0 links", and one flocking it while a releasing sibling held it exclusively for its unlink was -EBUSY) */
static int t_sibling_lock_churn(void)
{
    enum { PROCS = 4, ROUNDS = 20000 };
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], cpath[PROCS][PATH_MAX];
    const char *given = getenv("VRAMD_TEST_CHURN_PARENT");
    int pfd = given && *given ? open(given, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : make_image_dir(ppath), cfd[PROCS];
    int src = make_memfd(BO_BYTES, 17, 0, BO_BYTES);
    CHECK(pfd >= 0 && src >= 0, "setup");
    for (int k = 0; k < PROCS; k++) {
        CHECK((cfd[k] = make_image_dir(cpath[k])) >= 0, "setup");
        int m = openat(cfd[k], ".child.00000000000000000000000000000000", O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        CHECK(m >= 0, "a mark in %s: %s", cpath[k], strerror(errno));
        close(m);
    }
    if (!(given && *given)) {
        OK(test_connect(&c, &err), &err);
        OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
        vramd_close(c);
    }
    int go[2], report[2];
    CHECK(pipe(go) == 0 && pipe(report) == 0, "pipe");
    pid_t pids[PROCS];
    for (int k = 0; k < PROCS; k++) {
        pids[k] = fork();
        CHECK(pids[k] >= 0, "fork");
        if (pids[k] == 0) {
            char line[256] = "";
            struct vramd_conn *cc = NULL;
            int refused = 0, first = 0;
            char byte;
            if (test_connect(&cc, &err) < 0 || read(go[0], &byte, 1) != 1) {
                char out[512];
                int n = snprintf(out, sizeof out, "[no connection: %s] ", err.message);
                (void)!write(report[1], out, (size_t)n);
                _exit(2);
            }
            for (int i = 0; i < ROUNDS; i++) {
                struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = cfd[k], .chunk_size = 1 << 20,
                                            .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
                struct vramd_token t;
                int r = vramd_open_session(cc, &a, &t, NULL, &err);
                if (r == -EINVAL && strstr(err.message, "the parent of 1 incremental image"))
                    continue; /* its own directory refused, after both locks were taken and released */
                if (!refused++)
                    first = r, snprintf(line, sizeof line, "%s", err.message);
                if (r == 0) {
                    struct vramd_error ignored;
                    vramd_close_session(cc, &t, NULL, &ignored);
                }
            }
            char out[512];
            int n = snprintf(out, sizeof out, "[%d refused (first %d: %s)] ", refused, first, line);
            (void)!write(report[1], out, (size_t)n);
            vramd_close(cc);
            _exit(refused ? 1 : 0);
        }
    }
    close(go[0]);
    close(report[1]);
    char all[PROCS] = {0};
    CHECK(write(go[1], all, PROCS) == PROCS, "go"); /* one byte each: all start at once */
    close(go[1]);
    int bad = 0;
    for (int k = 0; k < PROCS; k++) {
        int st;
        CHECK(waitpid(pids[k], &st, 0) == pids[k], "waitpid");
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            bad++, fprintf(stderr, "sibling %d: status %#x\n", k, st);
    }
    char text[4096] = "";
    size_t len = 0;
    for (ssize_t n; len < sizeof text - 1 && (n = read(report[0], text + len, sizeof text - 1 - len)) > 0;)
        len += (size_t)n;
    text[len] = '\0';
    close(report[0]);
    CHECK(!bad, "%d of %d sibling processes were refused the parent's lock: %s", bad, PROCS, text);
    close(src);
    close(pfd);
    for (int k = 0; k < PROCS; k++) {
        close(cfd[k]);
        remove_dir(cpath[k]);
    }
    if (!(given && *given)) {
        CHECK(!exists(ppath, ".lock"), "the parent's lock file outlived its holders");
        remove_dir(ppath);
    }
    return 0;
}

/* Root (CRIU) dumps a child into a directory uid 65534 owns, with a parent in root's directory: the parent is
 * neither locked nor marked, since uid 65534, who keeps the child, would otherwise refuse root's rm and dumps
 * of the parent; a child in a directory of the parent's owner is marked.  (found by review) */
static int t_child_of_another_owner_marks_nothing(void)
{
    if (geteuid() != 0) {
        printf("  skipped: needs root to give a directory to uid 65534\n");
        return 0;
    }
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], cpath[PATH_MAX], mpath[PATH_MAX];
    int pfd = make_image_dir(ppath), cfd = make_image_dir(cpath), mfd = make_image_dir(mpath);
    int src = make_memfd(BO_BYTES, 19, 0, BO_BYTES);
    CHECK(pfd >= 0 && cfd >= 0 && mfd >= 0 && src >= 0, "setup");
    CHECK(chown(cpath, 65534, 65534) == 0, "chown: %s", strerror(errno));
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    OK(dump_one(c, cfd, src, &pfd, 1, false, &err), &err);
    CHECK(exists(cpath, "manifest.vrdm"), "the child committed");
    CHECK(count_entries(ppath, ".child.", "", NULL) == 0, "root's child in uid 65534's directory marked the parent");
    CHECK(!exists(ppath, ".lock"), "a .lock left in the parent");
    OK(dump_one(c, mfd, src, &pfd, 1, false, &err), &err);
    CHECK(count_entries(ppath, ".child.", "", NULL) == 1, "a child in root's own directory did not mark it");
    vramd_close(c);
    close(src);
    close(pfd);
    close(cfd);
    close(mfd);
    remove_dir(cpath);
    remove_dir(mpath);
    remove_dir(ppath);
    return 0;
}

/* Open (creating) the directory `name` under `base`, its path in out. */
static int sub_dir(const char *base, const char *name, char *out)
{
    snprintf(out, PATH_MAX, "%s/%s", base, name);
    if (mkdir(out, 0700) < 0 && errno != EEXIST)
        return -1;
    return open(out, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

/* A parent and its child moved together (base/a renamed to base/b): the child's mark finds it by its relative
 * path; its absolute one names base/a/child, where a new child of base/b/parent is then dumped.  That dump's
 * commit must not remove the moved child's mark as one of its own replaced image's; replacing that new child
 * removes the new child's old mark (both its paths lead to it).  (found by review) */
static int t_moved_childs_mark_kept(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char base[PATH_MAX], a[PATH_MAX], b[PATH_MAX], p[PATH_MAX], k[PATH_MAX], moved[PATH_MAX];
    int bfd = make_image_dir(base);
    int src = make_memfd(BO_BYTES, 23, 0, BO_BYTES);
    CHECK(bfd >= 0 && src >= 0, "setup");
    int afd = sub_dir(base, "a", a);
    int pfd = sub_dir(a, "parent", p), kfd = sub_dir(a, "child", k);
    CHECK(afd >= 0 && pfd >= 0 && kfd >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    OK(dump_one(c, kfd, src, &pfd, 1, false, &err), &err);
    snprintf(b, sizeof b, "%s/b", base);
    CHECK(rename(a, b) == 0, "rename: %s", strerror(errno));
    snprintf(moved, sizeof moved, "%s/parent", b);
    CHECK(count_entries(moved, ".child.", "", NULL) == 1, "the child's mark");
    close(kfd);
    int a2 = sub_dir(base, "a", a);
    int nfd = sub_dir(a, "child", k);
    CHECK(a2 >= 0 && nfd >= 0, "setup");
    OK(dump_one(c, nfd, src, &pfd, 1, false, &err), &err); /* pfd: the moved parent */
    int n = count_entries(moved, ".child.", "", NULL);
    CHECK(n == 2, "the moved parent holds %d mark(s), not 2: the new child at the old path removed the moved "
          "child's", n);
    OK(dump_one(c, nfd, src, &pfd, 1, false, &err), &err); /* replacing the new child: its old mark goes */
    n = count_entries(moved, ".child.", "", NULL);
    CHECK(n == 2, "the moved parent holds %d mark(s) after the new child was replaced, not 2", n);
    vramd_close(c);
    close(src);
    close(pfd);
    close(nfd);
    close(afd);
    close(a2);
    close(bfd);
    remove_dir(base);
    return 0;
}

/* A daemon (fake) that asks for a file no image holds: the client opens nothing, breaks the connection. */
static void fake_asks(int s, const char *name, uint32_t image)
{
    for (int step = 0; step < 2; step++) {
        Vramd__Rpc__V1__Request *req = fake_request(s); /* the fds sent are discarded */
        if (!req)
            _exit(2);
        Vramd__Rpc__V1__Response resp = VRAMD__RPC__V1__RESPONSE__INIT;
        Vramd__Rpc__V1__HelloReply hr = VRAMD__RPC__V1__HELLO_REPLY__INIT;
        Vramd__Rpc__V1__SessionInfo si = VRAMD__RPC__V1__SESSION_INFO__INIT;
        Vramd__Rpc__V1__FileRef ref = VRAMD__RPC__V1__FILE_REF__INIT;
        Vramd__Rpc__V1__FileRef *refs[1] = {&ref};
        resp.has_id = 1;
        resp.id = req->id;
        if (step == 0) {
            hr.has_version = 1;
            hr.version = VRAMD_PROTOCOL_VERSION;
            hr.server = "fake";
            resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_HELLO;
            resp.hello = &hr;
        } else {
            si.token = "0123456789abcdef0123456789abcdef";
            ref.has_image = 1;
            ref.image = image;
            ref.name = (char *)name;
            si.n_files_needed = 1;
            si.files_needed = refs;
            resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_SESSION;
            resp.session = &si;
        }
        vramd__rpc__v1__request__free_unpacked(req, NULL);
        fake_reply(s, &resp);
    }
    _exit(0);
}

/* A restore's OpenSession on dfd against a fake daemon asking for `name` of image `image`: its result in *r,
 * *err and whether it broke the connection; the fake reaped, no fd left open.  0, or 1: a check failed. */
static int open_asked(int dfd, const char *name, uint32_t image, int *r, bool *broken, struct vramd_error *err)
{
    int fd;
    pid_t pid = fork_peer(&fd);
    CHECK(pid >= 0, "socketpair, fork");
    if (pid == 0)
        fake_asks(fd, name, image);
    int before = count_fds();
    struct vramd_conn *c = NULL;
    OK(vramd_connect_fd(&c, fd, NULL, err), err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_RESTORE, .dir_fd = dfd};
    struct vramd_token t;
    *r = vramd_open_session(c, &a, &t, NULL, err);
    *broken = vramd_conn_broken(c);
    vramd_close(c);
    int st = reap(pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fake daemon status %#x", st);
    CHECK(count_fds() == before - 1, "fds left open");
    return 0;
}

static int t_fake_asks_for_a_file(void)
{
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    /* a manifest to open (the fake never reads it) and a file the fake will try to get */
    static const char *const files[] = {"manifest.vrdm", "secret"};
    for (size_t i = 0; i < 2; i++)
        CHECK(touch_at(dfd, files[i]) == 0, "create %s", files[i]);
    static const struct {
        const char *name;
        uint32_t image;
    } asks[] = {{"secret", 0}, {"../../etc/shadow", 0}, {"data-0123456789abcdef-00000000.vrd/x", 0},
                {"data-0123456789abcdef-00000000.vrd", 1}};
    for (size_t i = 0; i < sizeof asks / sizeof asks[0]; i++) {
        int r;
        bool broken;
        struct vramd_error err;
        if (open_asked(dfd, asks[i].name, asks[i].image, &r, &broken, &err))
            return 1;
        CHECK(r == -EPROTO && err.code == VRAMD_CODE_PROTOCOL_ERROR && broken, "asked for %s of image %u: %d %s: %s",
              asks[i].name, asks[i].image, r, vramd_code_name(err.code), err.message);
    }
    close(dfd);
    remove_dir(path);
    return 0;
}

/* The names a daemon may ask a restore's client to open: exactly format.DATA_FILE_NAME, both forms.  One it may
 * not is a protocol error (nothing opened, the connection broken); one it may is opened (here: it is missing). */
static int t_data_file_names(void)
{
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    CHECK(touch_at(dfd, "manifest.vrdm") == 0, "create manifest.vrdm");
    static const struct {
        const char *name;
        bool valid;
    } names[] = {
        {"data-0123456789abcdef-00000001.vrd", true},    {"data-0123456789abcdef-00000001-3.vrd", true},
        {"data-0123456789abcdef-00000001-1.vrd", true},  {"data-0123456789abcdef-00000001-9.vrd", true},
        {"data-0123456789abcdef-00000001-a.vrd", true},  {"data-0123456789abcdef-ffffffff-f.vrd", true},
        {"data-0123456789abcdef-00000001-0.vrd", false}, {"data-0123456789abcdef-00000001-10.vrd", false},
        {"data-0123456789abcdef-00000001-g.vrd", false}, {"data-0123456789abcdef-00000001-A.vrd", false},
        {"data-0123456789ABCDEF-00000001-3.vrd", false}, {"data-0123456789abcdef-0000000A.vrd", false},
        {"data-0123456789abcdef-00000001-.vrd", false},  {"data-0123456789abcdef-00000001x3.vrd", false},
        {"data-0123456789abcdef-00000001-3.vrd.tmp", false}, {"data-0123456789abcdef-00000001-3.VRD", false},
        {"data-0123456789abcdef-00000001-3-4.vrd", false}, {"data-0123456789abcdef-00000001-3.vrd/x", false},
        {"data-0123456789abcdef-000000013.vrd", false},  {"DATA-0123456789abcdef-00000001-3.vrd", false},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        int r;
        bool broken;
        struct vramd_error err;
        if (open_asked(dfd, names[i].name, 0, &r, &broken, &err))
            return 1;
        if (names[i].valid)
            CHECK(r == -ENOENT && err.code == VRAMD_CODE_LOCAL && strstr(err.message, names[i].name),
                  "%s: %d %s: %s (want it opened: -ENOENT)", names[i].name, r, vramd_code_name(err.code),
                  err.message);
        else
            CHECK(r == -EPROTO && err.code == VRAMD_CODE_PROTOCOL_ERROR && broken, "%s: %d %s: %s (want it refused)",
                  names[i].name, r, vramd_code_name(err.code), err.message);
    }
    close(dfd);
    remove_dir(path);
    return 0;
}

/*
 * A fake daemon for a dump: its Hello allows max_fds fds per message, its OpenSession reply asks for
 * per_gpu data files per GPU (0: the field left out, as an older daemon does).  It writes one line to
 * `report` for each FileRef of each AttachFiles:
 *     <message number> <gpu_id> <has_stripe> <stripe> <fds in the message> <indexes ok> <name>
 * and answers everything with the session's info until the client hangs up.
 */
static const uint8_t fake_image_id[16] = {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
                                          0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10};

static void fake_dump(int s, uint32_t per_gpu, uint32_t max_fds, int report)
{
    static uint8_t in[1 << 16];
    for (unsigned number = 0;; number++) {
        union {
            char buf[CMSG_SPACE(sizeof(int) * 253)];
            struct cmsghdr align;
        } ctl;
        struct iovec iov = {.iov_base = in, .iov_len = sizeof in};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                             .msg_controllen = sizeof ctl.buf};
        ssize_t n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
        if (n == 0)
            _exit(0);
        if (n < 12 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
            _exit(2);
        size_t nfds = 0;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
                size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t j = 0; j < k; j++) {
                    int fd;
                    memcpy(&fd, CMSG_DATA(cm) + j * sizeof fd, sizeof fd);
                    close(fd);
                }
                nfds += k;
            }
        Vramd__Rpc__V1__Request *req = vramd__rpc__v1__request__unpack(NULL, (size_t)n - 12, in + 12);
        if (!req)
            _exit(3);
        Vramd__Rpc__V1__Response resp = VRAMD__RPC__V1__RESPONSE__INIT;
        Vramd__Rpc__V1__HelloReply hr = VRAMD__RPC__V1__HELLO_REPLY__INIT;
        Vramd__Rpc__V1__Limits lim = VRAMD__RPC__V1__LIMITS__INIT;
        Vramd__Rpc__V1__SessionInfo si = VRAMD__RPC__V1__SESSION_INFO__INIT;
        resp.has_id = 1;
        resp.id = req->id;
        if (req->body_case == VRAMD__RPC__V1__REQUEST__BODY_HELLO) {
            hr.has_version = 1, hr.version = VRAMD_PROTOCOL_VERSION;
            hr.server = "fake";
            lim.has_max_fds_per_message = 1, lim.max_fds_per_message = max_fds;
            hr.limits = &lim;
            resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_HELLO, resp.hello = &hr;
        } else {
            si.token = "0123456789abcdef0123456789abcdef";
            si.has_state = 1, si.state = VRAMD__RPC__V1__SESSION_STATE__SESSION_OPEN;
            if (req->body_case == VRAMD__RPC__V1__REQUEST__BODY_OPEN_SESSION) {
                si.has_image_id = 1, si.image_id.len = 16, si.image_id.data = (uint8_t *)fake_image_id;
                si.has_data_files_per_gpu = per_gpu != 0, si.data_files_per_gpu = per_gpu;
            }
            if (req->body_case == VRAMD__RPC__V1__REQUEST__BODY_ATTACH_FILES)
                for (size_t i = 0; i < req->attach_files->n_files; i++) {
                    const Vramd__Rpc__V1__FileRef *f = req->attach_files->files[i];
                    bool ok = f->has_gpu_id && f->fd_index < nfds &&
                              (!f->has_direct_fd_index || f->direct_fd_index < nfds);
                    dprintf(report, "%u %u %d %u %zu %d %s\n", number, f->gpu_id, (int)f->has_stripe, f->stripe,
                            nfds, (int)ok, f->name ? f->name : "");
                }
            resp.body_case = VRAMD__RPC__V1__RESPONSE__BODY_SESSION, resp.session = &si;
        }
        vramd__rpc__v1__request__free_unpacked(req, NULL);
        fake_reply(s, &resp);
    }
}

/*
 * A dump's client creates and attaches, for each new GPU of an AddBos, as many data files as the daemon asked
 * for (0: one), stripe 0 first, each with its name (data-<id>-<gpu>[-<k>].vrd), its gpu_id and (k > 0) its
 * stripe, in as many AttachFiles as the fd limit needs; more than the format's 16 is refused.
 */
static int t_data_files_per_gpu(void)
{
    static const struct {
        uint32_t per_gpu, max_fds;
    } cases[] = {{0, 253}, {1, 253}, {3, 253}, {5, 2}, {4, 3}, {16, 7}, {16, 253}, {17, 253}, {1000, 253}};
    static const uint32_t gpus[] = {0, 7};
    enum { NGPUS = sizeof gpus / sizeof gpus[0] };
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(8192, 12, 0, 8192);
    CHECK(dfd >= 0 && src >= 0, "setup");
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        uint32_t per_gpu = cases[ci].per_gpu, max_fds = cases[ci].max_fds;
        uint32_t n = per_gpu ? per_gpu : 1;
        bool refused = n > MAX_STRIPES;
        int sp[2], rep[2];
        CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0 && pipe2(rep, O_CLOEXEC) == 0, "setup");
        pid_t pid = fork();
        CHECK(pid >= 0, "fork");
        if (pid == 0) {
            close(sp[0]);
            close(rep[0]);
            fake_dump(sp[1], per_gpu, max_fds, rep[1]);
        }
        close(sp[1]);
        close(rep[1]);
        struct vramd_conn *c = NULL;
        struct vramd_error err;
        OK(vramd_connect_fd(&c, sp[0], NULL, &err), &err);
        struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
        struct vramd_token t;
        int r = vramd_open_session(c, &a, &t, NULL, &err);
        if (refused) {
            CHECK(r == -EPROTO && err.code == VRAMD_CODE_LOCAL && !vramd_conn_broken(c) && strstr(err.message, "16"),
                  "%u data files per GPU: %d %s: %s (want it refused)", per_gpu, r, vramd_code_name(err.code),
                  err.message);
        } else {
            OK(r, &err);
            /* GPU 0 (gpu_id left out), GPU 7, GPU 0 again: two GPUs' files, each made once */
            struct vramd_bo bos[3] = {{.id = 1, .fd = src, .size = 4096},
                                      {.id = 2, .fd = src, .offset = 4096, .size = 4096, .has_gpu_id = true,
                                       .gpu_id = gpus[1]},
                                      {.id = 3, .fd = src, .size = 4096, .has_gpu_id = true, .gpu_id = gpus[0]}};
            OK(vramd_add_bos(c, &t, bos, 3, NULL, &err), &err);
            OK(vramd_add_bos(c, &t, &bos[1], 1, NULL, &err), &err); /* a GPU with files gets none again */
            CHECK(count_entries(path, "", "", NULL) == (int)(NGPUS * n) + 1, "%u per GPU: %d files in the directory "
                  "(the lock file one of them)", per_gpu, count_entries(path, "", "", NULL));
            for (size_t g = 0; g < NGPUS; g++)
                for (uint32_t k = 0; k < n; k++) {
                    char want[PATH_MAX];
                    data_file(want, "0123456789abcdef", gpus[g], k, ".tmp");
                    CHECK(exists(path, want), "%u per GPU: no %s", per_gpu, want);
                }
            OK(vramd_close_session(c, &t, NULL, &err), &err); /* not committed: every one goes */
        }
        CHECK(count_entries(path, "", "", NULL) == 0, "%u per GPU: %d files left", per_gpu,
              count_entries(path, "", "", NULL));
        int lk = hold_lock(path, LOCK_EX);
        CHECK(lk >= 0, "%u per GPU: the directory is still locked", per_gpu);
        close(lk);
        vramd_close(c);
        int st = reap(pid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fake daemon status %#x", st);
        /* what the fake was given */
        static char text[1 << 16];
        size_t len = 0;
        ssize_t got;
        while ((got = read(rep[0], text + len, sizeof text - 1 - len)) > 0)
            len += (size_t)got;
        close(rep[0]);
        text[len] = '\0';
        unsigned seen[NGPUS][MAX_STRIPES] = {{0}}, next[NGPUS] = {0}, lines = 0;
        for (char *line = text, *end; *line; line = end + 1) {
            end = strchr(line, '\n');
            CHECK(end, "report: %s", line);
            *end = '\0';
            unsigned number, gpu, has, stripe, ok;
            size_t nfds;
            char name[PATH_MAX], want[PATH_MAX];
            CHECK(sscanf(line, "%u %u %u %u %zu %u %255s", &number, &gpu, &has, &stripe, &nfds, &ok, name) == 7,
                  "report: %s", line);
            size_t g = gpu == gpus[0] ? 0 : 1;
            CHECK((gpu == gpus[0] || gpu == gpus[1]) && stripe < n && ok && nfds <= max_fds,
                  "%u per GPU (%u fds a message): %s", per_gpu, max_fds, line);
            CHECK(has == (stripe != 0), "%u per GPU: stripe set for data file 0, or left out for another: %s",
                  per_gpu, line);
            CHECK(stripe == next[g]++, "%u per GPU: data file %u of GPU %u out of turn: %s", per_gpu, stripe, gpu,
                  line);
            data_file(want, "0123456789abcdef", gpu, stripe, "");
            CHECK(strcmp(name, want) == 0, "%u per GPU: %s named %s", per_gpu, want, name);
            seen[g][stripe]++;
            lines++;
        }
        CHECK(lines == (refused ? 0 : NGPUS * n), "%u per GPU: %u files attached", per_gpu, lines);
        for (size_t g = 0; g < NGPUS && !refused; g++)
            for (uint32_t k = 0; k < n; k++)
                CHECK(seen[g][k] == 1, "%u per GPU: data file %u of GPU %u attached %u times", per_gpu, k, gpus[g],
                      seen[g][k]);
    }
    close(src);
    close(dfd);
    remove_dir(path);
    return 0;
}

/* vramctl ($VRAMD_TEST_VRAMCTL) reads the marks libvramd writes: rm of the parent is refused while the child
 * is whole, gc keeps the live mark, rm of the child removes its mark (it names that very directory), and then
 * rm of the parent works. */
static int vramctl_status(const char *vramctl, const char *args, const char *path)
{
    char cmd[3 * PATH_MAX];
    snprintf(cmd, sizeof cmd, "%s %s '%s' >/dev/null 2>&1", vramctl, args, path);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int t_marks_read_by_vramctl(void)
{
    const char *vramctl = getenv("VRAMD_TEST_VRAMCTL");
    if (!vramctl || !*vramctl) {
        printf("  skipped: VRAMD_TEST_VRAMCTL is not set\n");
        return 0;
    }
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], cpath[PATH_MAX];
    int pfd = make_image_dir(ppath), cfd = make_image_dir(cpath);
    int src = make_memfd(BO_BYTES, 19, 0, BO_BYTES);
    CHECK(pfd >= 0 && cfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    OK(dump_one(c, cfd, src, &pfd, 1, false, &err), &err);
    OK(dump_one(c, cfd, src, &pfd, 1, false, &err), &err); /* replaced once: still one mark */
    vramd_close(c);
    CHECK(count_entries(ppath, ".child.", "", NULL) == 1, "%d marks", count_entries(ppath, ".child.", "", NULL));
    CHECK(vramctl_status(vramctl, "rm", ppath) == 1, "vramctl rm of a parent whose child is whole");
    CHECK(vramctl_status(vramctl, "gc", ppath) == 0 && count_entries(ppath, ".child.", "", NULL) == 1,
          "vramctl gc removed a live mark libvramd wrote");
    char rm_child[PATH_MAX + 32];
    snprintf(rm_child, sizeof rm_child, "rm --parent '%s'", ppath); /* these dumps record no parent path */
    CHECK(vramctl_status(vramctl, rm_child, cpath) == 0 && count_entries(ppath, ".child.", "", NULL) == 0,
          "vramctl rm of the child left its mark (%d)", count_entries(ppath, ".child.", "", NULL));
    CHECK(vramctl_status(vramctl, "rm", ppath) == 0 && !exists(ppath, "manifest.vrdm"), "vramctl rm of the parent");
    close(src);
    close(pfd);
    close(cfd);
    remove_dir(cpath);
    remove_dir(ppath);
    return 0;
}

/* A child dump whose client may only read its parent (uid 65534, a parent of root's made readable: a shared
 * base image) takes no lock of the parent's: while its session is open, root takes the parent directory's
 * flock and its .lock exclusively (before, the child held a shared flock on the directory, which any reader
 * can take, and so blocked the parent's owner's dump, rm and gc). */
static int t_reader_child_locks_nothing(void)
{
    if (geteuid() != 0) {
        printf("  skipped: needs root to act as uid 65534\n");
        return 0;
    }
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], cpath[PATH_MAX];
    int pfd = make_image_dir(ppath), cfd = make_image_dir(cpath);
    int src = make_memfd(BO_BYTES, 17, 0, BO_BYTES);
    CHECK(pfd >= 0 && cfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    /* the parent readable by all (a shared base image), the child's directory uid 65534's */
    DIR *dir = opendir(ppath);
    CHECK(dir, "opendir %s", ppath);
    for (struct dirent *e; (e = readdir(dir));)
        if (e->d_name[0] != '.')
            CHECK(fchmodat(pfd, e->d_name, 0644, 0) == 0, "chmod %s", e->d_name);
    closedir(dir);
    CHECK(chmod(ppath, 0755) == 0 && chown(cpath, 65534, 65534) == 0, "chmod/chown");
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = cfd, .chunk_size = 1 << 20,
                                .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
    struct vramd_token t;
    CHECK(setegid(65534) == 0 && seteuid(65534) == 0, "seteuid: %s", strerror(errno));
    int r = vramd_open_session(c, &a, &t, NULL, &err);
    CHECK(seteuid(0) == 0 && setegid(0) == 0, "seteuid back: %s", strerror(errno));
    OK(r, &err);
    int lk = open(ppath, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(lk >= 0 && flock(lk, LOCK_EX | LOCK_NB) == 0, "a child dump of uid 65534 holds its parent's directory flock");
    close(lk);
    CHECK(!exists(ppath, ".lock"), "a child dump of uid 65534 made its parent's lock file");
    lk = hold_lock(ppath, LOCK_EX);
    CHECK(lk >= 0, "a child dump of uid 65534 holds its parent's lock file");
    close(lk);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    vramd_close(c);
    close(src);
    close(pfd);
    close(cfd);
    remove_dir(cpath);
    remove_dir(ppath);
    return 0;
}

/* Fill every fd from `floor` up to RLIMIT_NOFILE (at most `cap`) with duplicates of `fd`; how many. */
static int fill_fds(int fd, int floor, int *fill, int cap)
{
    int n = 0;
    while (n < cap && (fill[n] = fcntl(fd, F_DUPFD_CLOEXEC, floor)) >= 0)
        n++;
    return n;
}

/* With no fd free at or above min_fd, each step of a dump that creates a file fails (AddBos: the data files,
 * Start: the manifest's temporary, Wait: the commit's mark in the parent) and the dump leaves nothing behind:
 * no file it created in its directory or its parent's (criu.h: "nothing this call created is left").  The
 * step that creates runs with the table full from the floor up (RLIMIT_NOFILE lowered, the rest filled);
 * the steps before it, with room. */
static int t_no_fd_left_no_file(void)
{
    enum { FLOOR = 256, ROOM = 48 };
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], cpath[PATH_MAX];
    int pfd = make_image_dir(ppath), cfd = make_image_dir(cpath);
    int src = make_memfd(BO_BYTES, 13, 0, BO_BYTES);
    CHECK(pfd >= 0 && cfd >= 0 && src >= 0 && pfd < FLOOR && cfd < FLOOR && src < FLOOR, "setup");
    struct vramd_options o;
    vramd_options_init(&o);
    o.timeout_ms = 30000;
    o.min_fd = FLOOR;
    OK(vramd_connect_path(&c, daemon_socket(), &o, &err), &err);
    OK(dump_one(c, pfd, src, NULL, 0, false, &err), &err);
    int parent_entries = count_entries(ppath, "", "", NULL);
    struct rlimit old, low;
    CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0 && old.rlim_cur >= FLOOR + ROOM, "RLIMIT_NOFILE %llu",
          (unsigned long long)old.rlim_cur);
    low = old;
    low.rlim_cur = FLOOR + ROOM;
    CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0, "setrlimit: %s", strerror(errno));
    static const char *const steps[] = {"AddBos", "Start", "Wait"};
    int fill[ROOM], bad = -1, rc = 0;
    char why[512] = "";
    for (int step = 0; step < 3 && bad < 0; step++) {
        struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = cfd, .chunk_size = 1 << 20,
                                    .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
        struct vramd_bo bo = {.id = 1, .fd = src, .size = BO_BYTES};
        struct vramd_token t;
        int r = vramd_open_session(c, &a, &t, NULL, &err), n = 0;
        for (int k = 0; r == 0 && k <= step; k++) {
            if (k == step)
                n = fill_fds(src, FLOOR, fill, ROOM);
            r = k == 0 ? vramd_add_bos(c, &t, &bo, 1, NULL, &err)
                : k == 1 ? vramd_start(c, &t, NULL, &err)
                         : vramd_wait(c, &t, 60000, NULL, &err);
        }
        for (int k = 0; k < n; k++)
            close(fill[k]);
        rc = r;
        snprintf(why, sizeof why, "%s", err.message);
        struct vramd_error ignored;
        vramd_close_session(c, &t, NULL, &ignored);
        char first[PATH_MAX] = "";
        if (r == 0 || n == 0 || count_entries(cpath, "", "", first) != 0 ||
            count_entries(ppath, "", "", NULL) != parent_entries)
            bad = step;
    }
    CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0, "setrlimit back: %s", strerror(errno));
    if (bad >= 0) {
        char first[PATH_MAX] = "";
        int left = count_entries(cpath, "", "", first);
        CHECK(0, "%s with no fd free above %d: %d (%s); %d entries left in the image directory (first %s), %d in "
              "the parent's (was %d)", steps[bad], FLOOR, rc, why, left, first, count_entries(ppath, "", "", NULL),
              parent_entries);
    }
    OK(dump_one(c, cfd, src, &pfd, 1, false, &err), &err); /* with room it commits */
    CHECK(exists(cpath, "manifest.vrdm") && count_entries(ppath, ".child.", "", NULL) == 1, "the dump with room");
    vramd_close(c);
    close(src);
    close(pfd);
    close(cfd);
    remove_dir(cpath);
    remove_dir(ppath);
    return 0;
}

const struct test files_tests[] = {
    {"dump_commit", t_dump_commit, "all quick"},
    {"dump_no_commit", t_dump_no_commit, "all quick"},
    {"dump_busy", t_dump_busy, "all quick"},
    {"unreadable_image", t_unreadable_image, "all quick"},
    {"marks_and_sweep", t_marks_and_sweep, "all quick"},
    {"sibling_children", t_sibling_children, "all quick"},
    {"lock_on_fd_one", t_lock_on_fd_one, "all quick"},
    {"moved_childs_mark_kept", t_moved_childs_mark_kept, "all quick"},
    {"child_of_another_owner_marks_nothing", t_child_of_another_owner_marks_nothing, "all quick"},
    {"sibling_lock_churn", t_sibling_lock_churn, "churn"},
    {"no_fd_left_no_file", t_no_fd_left_no_file, "fdlimit"},
    {"reader_child_locks_nothing", t_reader_child_locks_nothing, "all quick"},
    {"marks_read_by_vramctl", t_marks_read_by_vramctl, "all quick"},
    {"fake_asks_for_a_file", t_fake_asks_for_a_file, "all quick"},
    {"data_file_names", t_data_file_names, "all quick"},
    {"data_files_per_gpu", t_data_files_per_gpu, "all quick"},
    {NULL, NULL, NULL},
};
