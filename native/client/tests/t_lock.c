/* SPDX-License-Identifier: Apache-2.0 */
/* A parent's lock taken shared while siblings take and release it (docs/image-format.md, "The directory's
 * lock"): each sibling, the last holder as it releases, removes .lock, so a taker that opened it just before
 * finds, once it has flocked it, that it locks nothing, and looks again.  That may happen any number of times
 * in a row (children of one image taking and releasing its lock at once); libvramd used to refuse the taker
 * after 8 ("was replaced 8 times in a row", -EBUSY) though nobody excluded it.  Here the replacements are
 * forced one by one in that window, between the taker's open of .lock and its flock, by a real sibling's
 * release, through pipes: no sleep, no chance.  (vramd.imagedir's side: tests/test_image_lock_replacements.py) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "harness.h"

enum { CYCLES = 12 }; /* more than the 8 after which a taker was refused */
enum { RELEASES = 1000 }; /* files.c's bound on removals outlasted (vramd.imagedir.lock.RELEASES) */

/* In the taker process only: its shared flocks say so on pause_out and wait for a byte on pause_in. */
static int pause_in = -1, pause_out = -1;

/* flock for this program and the libvramd it links, which finds this definition first: libc's (the system
 * call), except in a taker, whose every shared flock first stops, between its open of .lock and its flock. */
__attribute__((visibility("default"))) int flock(int fd, int op)
{
    if (pause_out >= 0 && (op & LOCK_SH)) {
        char b = 'O';
        if (write(pause_out, &b, 1) != 1 || read(pause_in, &b, 1) != 1)
            _exit(3);
    }
    return (int)syscall(SYS_flock, fd, op);
}

static bool exists_at(int dfd, const char *name)
{
    struct stat st;
    return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

/* What a taker says when its open_session has returned. */
struct outcome {
    int r;
    char message[256];
};

/* A directory holding a mark of a child (.child.<32 zeros>): an open_session of a child dump into it takes
 * its parents' locks (shared), then its own, then refuses it, "the parent of 1 incremental image", and
 * releases both, all locally. */
static int marked_dir(char *path)
{
    int fd = make_image_dir(path);
    if (fd >= 0 && touch_at(fd, ".child.00000000000000000000000000000000") < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A child dump's session opened in cfd (a marked_dir) on parent pfd: 0 where it took and released both locks
 * (refused for its mark), else its result. */
static int child_open(struct vramd_conn *c, int cfd, int pfd, struct vramd_error *err)
{
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = cfd, .chunk_size = 1 << 20,
                                .parent_dir_fds = &pfd, .n_parent_dir_fds = 1};
    struct vramd_token t;
    int r = vramd_open_session(c, &a, &t, NULL, err);
    if (r == -EINVAL && strstr(err->message, "the parent of 1 incremental image"))
        return 0;
    if (r == 0) {
        struct vramd_error ignored;
        vramd_close_session(c, &t, NULL, &ignored);
        snprintf(err->message, sizeof err->message, "the marked directory was not refused");
        return -EPROTO;
    }
    return r;
}

/* A taker process: child_open with its shared flocks paused; then it writes 'R' and its outcome. */
static pid_t start_taker(int cfd, int pfd, int to_taker[2], int from_taker[2])
{
    if (pipe(to_taker) < 0 || pipe(from_taker) < 0)
        return -1;
    pid_t pid = fork();
    if (pid != 0) {
        close(to_taker[0]);
        close(from_taker[1]);
        return pid;
    }
    close(to_taker[1]);
    close(from_taker[0]);
    struct vramd_conn *c = NULL;
    struct vramd_error err = {0};
    struct outcome o = {0};
    if ((o.r = test_connect(&c, &err)) == 0) {
        pause_in = to_taker[0], pause_out = from_taker[1];
        o.r = child_open(c, cfd, pfd, &err);
        pause_out = -1;
        vramd_close(c);
    }
    snprintf(o.message, sizeof o.message, "%s", err.message);
    char tag = 'R';
    _exit(write(from_taker[1], &tag, 1) == 1 && write(from_taker[1], &o, sizeof o) == sizeof o ? 0 : 4);
}

/* The taker's next word: 'O' (it stopped before a flock), or 'R' with its outcome in *o; 0 where none came
 * within a minute (one that looks again for ever). */
static char next_word(int fd, struct outcome *o)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    char tag = 0;
    if (poll(&p, 1, 60000) != 1 || read(fd, &tag, 1) != 1)
        return 0;
    if (tag == 'R' && read(fd, o, sizeof *o) != sizeof *o)
        return 0;
    return tag;
}

static int t_lock_replacements(void)
{
    struct vramd_conn *c = NULL;
    struct vramd_error err;
    char ppath[PATH_MAX], tpath[PATH_MAX], spath[PATH_MAX], mpath[PATH_MAX];
    int pfd = make_image_dir(ppath), tfd = marked_dir(tpath), sfd = marked_dir(spath), mfd = make_image_dir(mpath);
    int src = make_memfd(1 << 20, 23, 0, 1 << 20);
    CHECK(pfd >= 0 && tfd >= 0 && sfd >= 0 && mfd >= 0 && src >= 0, "setup");
    OK(test_connect(&c, &err), &err);
    struct vramd_open_args a = {.kind = VRAMD_SESSION_DUMP, .dir_fd = pfd, .chunk_size = 1 << 20};
    struct vramd_bo bo = {.id = 1, .fd = src, .size = 1 << 20};
    struct vramd_token t;
    OK(vramd_open_session(c, &a, &t, NULL, &err), &err);
    OK(vramd_add_bos(c, &t, &bo, 1, NULL, &err), &err);
    OK(vramd_start(c, &t, NULL, &err), &err);
    OK(vramd_wait(c, &t, 60000, NULL, &err), &err);
    OK(vramd_close_session(c, &t, NULL, &err), &err);
    int to[2], from[2];
    struct outcome o = {0};
    char go = 'g';
    /* 1. twelve siblings' releases, each removing the very .lock the taker opened: it takes the lock */
    pid_t taker = start_taker(tfd, pfd, to, from);
    CHECK(taker > 0, "fork: %s", strerror(errno));
    for (int cycle = 0; cycle < CYCLES; cycle++) {
        char w = next_word(from[0], &o);
        CHECK(w == 'O', "cycle %d: the taker said %c: %d %s", cycle, w ? w : '-', o.r, o.message);
        CHECK(exists_at(pfd, ".lock"), "cycle %d: the taker's .lock is missing", cycle);
        int r = child_open(c, sfd, pfd, &err);
        CHECK(r == 0, "cycle %d: the sibling: %d %s", cycle, r, err.message);
        CHECK(!exists_at(pfd, ".lock"), "cycle %d: the sibling, the last holder, left .lock", cycle);
        CHECK(write(to[1], &go, 1) == 1, "go");
    }
    char w = next_word(from[0], &o);
    CHECK(w == 'O', "after %d cycles the taker said %c: %d %s", CYCLES, w ? w : '-', o.r, o.message);
    CHECK(write(to[1], &go, 1) == 1, "go");
    w = next_word(from[0], &o);
    CHECK(w == 'R' && o.r == 0, "the taker, the lock free at last: %c %d %s", w ? w : '-', o.r, o.message);
    CHECK(reap(taker) == 0, "the taker's exit");
    close(to[1]);
    close(from[0]);
    CHECK(!exists_at(pfd, ".lock"), "the taker left .lock");
    /* 2. the file it opened moved away, still linked, 8 times (no release explains that): refused, no loop */
    taker = start_taker(tfd, pfd, to, from);
    CHECK(taker > 0, "fork: %s", strerror(errno));
    for (int k = 0; k < 8; k++) {
        w = next_word(from[0], &o);
        CHECK(w == 'O', "move %d: the taker said %c: %d %s", k, w ? w : '-', o.r, o.message);
        char name[32];
        snprintf(name, sizeof name, "moved-%d", k);
        CHECK(renameat(pfd, ".lock", mfd, name) == 0, "moving .lock away: %s", strerror(errno));
        CHECK(write(to[1], &go, 1) == 1, "go");
    }
    w = next_word(from[0], &o);
    CHECK(w == 'R' && o.r == -EBUSY && strstr(o.message, "replaced 8 times") && strstr(o.message, ppath),
          "the taker, its .lock moved away 8 times: %c %d %s", w ? w : '-', o.r, o.message);
    CHECK(reap(taker) == 0, "the taker's exit");
    close(to[1]);
    close(from[0]);
    /* 3. a process that may write the directory removes the .lock the taker opened, each time, in that window:
     * refused after RELEASES removals, not looking for ever (a dump inside CRIU spinning) */
    taker = start_taker(tfd, pfd, to, from);
    CHECK(taker > 0, "fork: %s", strerror(errno));
    for (int k = 0; k < RELEASES; k++) {
        w = next_word(from[0], &o);
        CHECK(w == 'O', "removal %d: the taker said %c: %d %s", k, w ? w : '-', o.r, o.message);
        CHECK(unlinkat(pfd, ".lock", 0) == 0, "removing .lock: %s", strerror(errno));
        CHECK(write(to[1], &go, 1) == 1, "go");
    }
    w = next_word(from[0], &o);
    CHECK(w == 'R' && o.r == -EBUSY && strstr(o.message, "removed 1000 times") && strstr(o.message, ppath),
          "the taker, its .lock removed %d times: %c %d %s", RELEASES, w ? w : '-', o.r, o.message);
    CHECK(reap(taker) == 0, "the taker's exit");
    CHECK(!exists_at(pfd, ".lock"), "the refused taker left .lock");
    close(to[1]);
    close(from[0]);
    vramd_close(c);
    close(src);
    close(pfd);
    close(tfd);
    close(sfd);
    close(mfd);
    remove_dir(ppath);
    remove_dir(tpath);
    remove_dir(spath);
    remove_dir(mpath);
    return 0;
}

const struct test lock_tests[] = {
    {"lock_replacements", t_lock_replacements, "all quick"},
    {NULL, NULL, NULL},
};
