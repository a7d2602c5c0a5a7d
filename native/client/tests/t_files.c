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
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
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

static int exists(const char *dir, const char *name)
{
    char p[PATH_MAX];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return lstat(p, &st) == 0;
}

/* A dump's files are created by this process (its uid, 0600) and nothing is in place before Wait's OK. */
static int t_dump_commit(void)
{
    struct vramd_conn *c = NULL, *other = NULL;
    struct vramd_error err;
    char path[PATH_MAX], name[PATH_MAX], first[PATH_MAX];
    int dfd = make_image_dir(path);
    int src = make_memfd(BO_BYTES, 5, 0, BO_BYTES), dst = make_memfd(BO_BYTES, 0, 0, 0);
    CHECK(dfd >= 0 && src >= 0 && dst >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    OK(test_connect(&other, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = dfd};
    struct vramd_token t;
    struct vramd_session_info info;
    OK(vramd_open_session(c, &a, &t, &info, &err), &err);
    CHECK(info.state == VRAMD_STATE_OPEN, "state %d", info.state);
    CHECK(count_entries(path, "", "", NULL) == 0, "the directory changed at OpenSession");
    struct vramd_bo bo = {.id = 1, .fd = src, .size = BO_BYTES};
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    CHECK(count_entries(path, "data-", "-00000000.vrd.tmp", name) == 1, "no data file .tmp for GPU 0");
    if (owned_by_me(path, name))
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
    CHECK(count_entries(path, "data-", ".vrd", first) == 1, "data files in place: %d",
          count_entries(path, "data-", ".vrd", NULL));
    if (owned_by_me(path, first))
        return 1;
    CHECK(count_entries(path, "", ".tmp", NULL) == 0, "a .tmp is left after the commit");
    OK(vramd_wait(c, &t, 10000, &info, &err), &err); /* a second Wait: still OK, nothing done twice */
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    /* the lock went with the commit: a new dump replaces the image and removes the old data file */
    OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
    CHECK(count_entries(path, "data-", ".vrd", name) == 1 && strcmp(name, first) != 0,
          "after the replacing dump: %d data file(s), %s (the replaced one was %s)",
          count_entries(path, "data-", ".vrd", NULL), name, first);
    OK(restore_one(c, VRAMD_SESSION_RESTORE, dfd, dst, &err), &err);
    CHECK(compare_fds(src, dst, BO_BYTES) < 0, "restored bytes differ");
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
    char path[PATH_MAX], old[PATH_MAX], now[PATH_MAX];
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
        CHECK(count_entries(path, "", "", now) == (how ? 2 : 0), "case %d: %d entries left, first %s", how,
              count_entries(path, "", "", NULL), now);
        if (how == 0) { /* from here on a committed image is in the directory: it must stay as it is */
            OK(dump_one(c, dfd, src, NULL, 0, false, &err), &err);
            CHECK(count_entries(path, "data-", ".vrd", old) == 1, "no data file");
        } else {
            CHECK(exists(path, "manifest.vrdm") && count_entries(path, "data-", ".vrd", now) == 1 &&
                      strcmp(now, old) == 0,
                  "case %d: the committed image changed (%s, was %s)", how, now, old);
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
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    OK(dump_one(c2, dfd, src, NULL, 0, false, &err), &err);
    /* anyone's flock on the directory counts (vramctl's, another client's) */
    int lk = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(lk >= 0 && flock(lk, LOCK_EX | LOCK_NB) == 0, "flock");
    r = dump_one(c, dfd, src, NULL, 0, false, &err);
    CHECK(r == -EBUSY, "dump into a locked directory: %d %s", r, err.message);
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
    CHECK(count_entries(path, "data-", ".vrd", data) == 1, "no data file");
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
    /* the parent is needed: not replaced unless replace_parent */
    int r = dump_one(c, pfd, src, NULL, 0, false, &err);
    CHECK(r == -EINVAL && err.code == VRAMD_CODE_LOCAL && strstr(err.message, mark), "dump over a parent: %d %s", r,
          err.message);
    /* an image is never its own parent, replace_parent or not */
    for (int replace = 0; replace < 2; replace++) {
        r = dump_one(c, cfd, src, &cfd, 1, replace, &err);
        CHECK(r == -EINVAL && err.code == VRAMD_CODE_LOCAL, "own parent (replace %d): %d %s", replace, r, err.message);
    }
    /* a crashed dump's temporaries go (regular files only), at the next dump's open */
    static const char *const stale[] = {"data-0123456789abcdef-00000000.vrd.tmp",
                                        ".manifest.vrdm.0123456789abcdef0123456789abcdef.tmp"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", cpath, stale[i]);
        int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        CHECK(fd >= 0, "create %s", p);
        close(fd);
    }
    snprintf(p, sizeof p, "%s/data-fedcba9876543210-00000000.vrd.tmp", cpath);
    CHECK(symlink("manifest.vrdm", p) == 0, "symlink");
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = cfd, .chunk_size = 1 << 20,
                                .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
    struct vramd_token t;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    CHECK(!exists(cpath, stale[0]) && !exists(cpath, stale[1]), "stale temporaries left");
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
    int held = open(ppath, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(held >= 0 && flock(held, LOCK_SH) == 0, "a sibling's shared lock");
    OK(dump_one(c, afd, src, &pfd, 1, false, &err), &err);
    CHECK(count_entries(ppath, ".child.", "", NULL) == 1, "the child did not mark its parent");
    CHECK(flock(held, LOCK_EX) == 0, "a dump's exclusive lock");
    int r = dump_one(c, bfd, src, &pfd, 1, false, &err);
    CHECK(r == -EBUSY && err.code == VRAMD_CODE_LOCAL && strstr(err.message, ppath), "child while a dump writes "
          "into its parent: %d %s", r, err.message);
    CHECK(count_entries(ppath, ".child.", "", NULL) == 1, "the failed child left a mark");
    CHECK(!exists(bpath, "manifest.vrdm"), "the failed child committed");
    close(held);
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

/* A daemon (fake) that asks for a file no image holds: the client opens nothing, breaks the connection. */
static void fake_asks(int s, const char *name, uint32_t image)
{
    static uint8_t in[1 << 16], out[1 << 16];
    for (int step = 0; step < 2; step++) {
        ssize_t n = recv(s, in, sizeof in, 0); /* no control buffer: the fds sent are discarded */
        if (n < 12)
            _exit(2);
        Vramd__Rpc__V1__Request *req = vramd__rpc__v1__request__unpack(NULL, (size_t)n - 12, in + 12);
        if (!req)
            _exit(3);
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
        size_t len = vramd__rpc__v1__response__get_packed_size(&resp);
        memcpy(out, "VRDP", 4);
        out[4] = 1, out[5] = 2, out[6] = out[7] = 0;
        out[8] = (uint8_t)len, out[9] = (uint8_t)(len >> 8), out[10] = out[11] = 0;
        vramd__rpc__v1__response__pack(&resp, out + 12);
        if (send(s, out, len + 12, MSG_NOSIGNAL) != (ssize_t)(len + 12))
            _exit(4);
    }
    _exit(0);
}

static int t_fake_asks_for_a_file(void)
{
    char path[PATH_MAX];
    int dfd = make_image_dir(path);
    CHECK(dfd >= 0, "dir");
    /* a manifest to open (the fake never reads it) and a file the fake will try to get */
    static const char *const files[] = {"manifest.vrdm", "secret"};
    for (size_t i = 0; i < 2; i++) {
        char p[PATH_MAX];
        snprintf(p, sizeof p, "%s/%s", path, files[i]);
        int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        CHECK(fd >= 0, "create %s", p);
        close(fd);
    }
    static const struct {
        const char *name;
        uint32_t image;
    } asks[] = {{"secret", 0}, {"../../etc/shadow", 0}, {"data-0123456789abcdef-00000000.vrd/x", 0},
                {"data-0123456789abcdef-00000000.vrd", 1}};
    for (size_t i = 0; i < sizeof asks / sizeof asks[0]; i++) {
        int sp[2];
        CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
        pid_t pid = fork();
        CHECK(pid >= 0, "fork");
        if (pid == 0) {
            close(sp[0]);
            fake_asks(sp[1], asks[i].name, asks[i].image);
        }
        close(sp[1]);
        int before = count_fds();
        struct vramd_conn *c = NULL;
        struct vramd_error err;
        OK(vramd_connect_fd(&c, sp[0], NULL, &err), &err);
        struct vramd_open_args a = {.kind = VRAMD_SESSION_RESTORE, .dir_fd = dfd};
        struct vramd_token t;
        int r = vramd_open_session(c, &a, &t, NULL, &err);
        CHECK(r == -EPROTO && err.code == VRAMD_CODE_PROTOCOL_ERROR && vramd_conn_broken(c),
              "asked for %s of image %u: %d %s: %s", asks[i].name, asks[i].image, r, vramd_code_name(err.code),
              err.message);
        vramd_close(c);
        int st = reap(pid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fake daemon status %#x", st);
        CHECK(count_fds() == before - 1, "fds left open");
    }
    close(dfd);
    remove_dir(path);
    return 0;
}

const struct test files_tests[] = {
    {"dump_commit", t_dump_commit, "all quick"},
    {"dump_no_commit", t_dump_no_commit, "all quick"},
    {"dump_busy", t_dump_busy, "all quick"},
    {"unreadable_image", t_unreadable_image, "all quick"},
    {"marks_and_sweep", t_marks_and_sweep, "all quick"},
    {"sibling_children", t_sibling_children, "all quick"},
    {"fake_asks_for_a_file", t_fake_asks_for_a_file, "all quick"},
    {NULL, NULL, NULL},
};
