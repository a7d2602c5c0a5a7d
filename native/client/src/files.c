/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd: the client's part of an image's files (protocol 2, docs/protocol.md,
 * "Image files: the client's rights").  The daemon never opens, creates, renames
 * or removes a name: this file opens every file of an image with the caller's
 * own rights, creates a dump's files, and does the directory's operations (the
 * lock, the commit's renames and fsyncs, the removals).  The names are those of
 * vramd/image/names.py.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "files.h"

/* Every open of a file in an image directory: never through a symlink, never blocking. */
#define OPEN_FLAGS (O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
#define CREATE_FLAGS (O_RDWR | O_CREAT | O_EXCL | OPEN_FLAGS)
#define FILE_MODE 0600 /* images hold process memory */

/* --- names ----------------------------------------------------------------- */

static bool is_lower_hex(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return false;
    return true;
}

/* Data file names of a given length: stripe 0's (34 bytes) or a further stripe's (36). */
static bool is_data_name_len(size_t n)
{
    return n == VRAMD__DATA_NAME_LEN || n == VRAMD__STRIPE_NAME_LEN;
}

/* format.DATA_FILE_NAME: data-<16 hex>-<8 hex>.vrd (stripe 0), or data-<16 hex>-<8 hex>-<s>.vrd with s one
 * lowercase hex digit other than 0 (stripes 1 to 15; stripe 0 never carries a number) */
bool vramd__is_data_file_name(const char *s)
{
    size_t n = strlen(s);
    if (!is_data_name_len(n) || memcmp(s, "data-", 5) != 0 || !is_lower_hex(s + 5, 16) || s[21] != '-' ||
        !is_lower_hex(s + 22, 8) || memcmp(s + n - 4, ".vrd", 4) != 0)
        return false;
    return n == VRAMD__DATA_NAME_LEN || (s[30] == '-' && s[31] != '0' && is_lower_hex(s + 31, 1));
}

/* format.DATA_FILE_TMP: a data file's name + ".tmp" */
static bool is_data_tmp(const char *s)
{
    char head[VRAMD__STRIPE_NAME_LEN + 1];
    size_t n = strlen(s);
    if (n < 4 || !is_data_name_len(n - 4) || strcmp(s + n - 4, ".tmp") != 0)
        return false;
    memcpy(head, s, n - 4);
    head[n - 4] = '\0';
    return vramd__is_data_file_name(head);
}

/* format.MANIFEST_TMP: .manifest.vrdm.<32 hex>.tmp */
static bool is_manifest_tmp(const char *s)
{
    return strlen(s) == 15 + 32 + 4 && memcmp(s, ".manifest.vrdm.", 15) == 0 && is_lower_hex(s + 15, 32) &&
           strcmp(s + 47, ".tmp") == 0;
}

/* format.CHILD_MARK: .child.<32 hex> */
static bool is_child_mark(const char *s)
{
    return strlen(s) == 7 + 32 && memcmp(s, ".child.", 7) == 0 && is_lower_hex(s + 7, 32);
}

static void id_hex(const uint8_t id[VRAMD__ID_BYTES], char out[2 * VRAMD__ID_BYTES + 1])
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < VRAMD__ID_BYTES; i++) {
        out[2 * i] = hex[id[i] >> 4];
        out[2 * i + 1] = hex[id[i] & 15];
    }
    out[2 * VRAMD__ID_BYTES] = '\0';
}

/* format.data_file_name (stripe below VRAMD__MAX_STRIPES), plus ".tmp" when tmp */
static void data_name(const struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe, bool tmp,
                      char out[VRAMD__NAME_MAX])
{
    static const char digits[] = "0123456789abcdef";
    char hex[2 * VRAMD__ID_BYTES + 1];
    char tail[3] = ""; /* stripe 0: nothing; stripe k: "-" and k as one hex digit */
    id_hex(d->image_id, hex);
    if (stripe) {
        tail[0] = '-';
        tail[1] = digits[stripe % VRAMD__MAX_STRIPES];
    }
    snprintf(out, VRAMD__NAME_MAX, "data-%.16s-%08x%s.vrd%s", hex, gpu_id, tail, tmp ? ".tmp" : "");
}

/* format.manifest_tmp_name */
static void manifest_tmp_name(const struct vramd__dump *d, char out[VRAMD__NAME_MAX])
{
    char hex[2 * VRAMD__ID_BYTES + 1];
    id_hex(d->image_id, hex);
    snprintf(out, VRAMD__NAME_MAX, ".manifest.vrdm.%s.tmp", hex);
}

/* format.child_mark_name */
static void mark_name(const struct vramd__dump *d, char out[VRAMD__NAME_MAX])
{
    char hex[2 * VRAMD__ID_BYTES + 1];
    id_hex(d->image_id, hex);
    snprintf(out, VRAMD__NAME_MAX, ".child.%s", hex);
}

/* --- messages -------------------------------------------------------------- */

void vramd__dir_label(int dir_fd, char *buf, size_t size)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", dir_fd);
    ssize_t n = readlink(link, buf, size - 1);
    if (n <= 0) {
        snprintf(buf, size, "the directory of fd %d", dir_fd);
        return;
    }
    buf[n] = '\0';
}

static const char *errtext(int e)
{
    const char *s = strerrordesc_np(e);
    return s ? s : "error";
}

/* Fill err for a failed operation `what` on `name` in directory dir_fd; returns -e (-EACCES for EPERM). */
static int fail_name(struct vramd_error *err, int e, const char *what, const char *name, int dir_fd)
{
    char dir[PATH_MAX];
    vramd__dir_label(dir_fd, dir, sizeof dir);
    if (e == EACCES || e == EPERM)
        return vramd__fail(err, -EACCES, VRAMD_CODE_LOCAL, "cannot %s %s in %s: permission denied to uid %u", what,
                           name, dir, (unsigned)geteuid());
    if (e == ELOOP)
        return vramd__fail(err, -ELOOP, VRAMD_CODE_LOCAL, "cannot %s %s in %s: it is a symbolic link (refused)",
                           what, name, dir);
    return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "cannot %s %s in %s: %s", what, name, dir, errtext(e));
}

/* --- opening --------------------------------------------------------------- */

/* openat + placement at min_fd; the fd or -errno (errno-style, nothing filled).  A file this call created
 * (O_CREAT|O_EXCL) that it cannot place (no fd free at or above min_fd) is removed again: a failed call
 * leaves nothing it created. */
static int open_at(int dir_fd, const char *name, int flags, int min_fd)
{
    int fd = openat(dir_fd, name, flags, FILE_MODE);
    if (fd < 0)
        return -errno;
    int placed = vramd__place_fd(fd, min_fd);
    if (placed < 0 && (flags & (O_CREAT | O_EXCL)) == (O_CREAT | O_EXCL))
        (void)unlinkat(dir_fd, name, 0);
    return placed;
}

/* A second description of `fd`'s file opened with O_DIRECT by name, or -1: the file system refuses it
 * (tmpfs: EINVAL), the open fails, or it is not the very file fd has open. */
static int open_direct(int dir_fd, const char *name, int flags, int fd, int min_fd)
{
    int dfd = open_at(dir_fd, name, flags | O_DIRECT | OPEN_FLAGS, min_fd);
    if (dfd < 0)
        return -1;
    struct stat a, b;
    if (fstat(dfd, &a) == 0 && fstat(fd, &b) == 0 && S_ISREG(a.st_mode) && a.st_dev == b.st_dev &&
        a.st_ino == b.st_ino)
        return dfd;
    vramd__close_fd(dfd);
    return -1;
}

int vramd__open_image_file(int dir_fd, const char *name, bool direct, int min_fd, int *fd, int *direct_fd,
                           struct vramd_error *err)
{
    *fd = *direct_fd = -1;
    int f = open_at(dir_fd, name, O_RDONLY | OPEN_FLAGS, min_fd);
    if (f < 0)
        return fail_name(err, -f, "open", name, dir_fd);
    /* an image is data: a FIFO, socket or device under an image file's name is refused, never read */
    struct stat st;
    if (fstat(f, &st) < 0) {
        int e = errno;
        vramd__close_fd(f);
        return fail_name(err, e, "stat", name, dir_fd);
    }
    if (!S_ISREG(st.st_mode)) {
        vramd__close_fd(f);
        char dir[PATH_MAX];
        vramd__dir_label(dir_fd, dir, sizeof dir);
        int code = strcmp(name, VRAMD__MANIFEST_NAME) == 0 ? VRAMD_CODE_CORRUPT_MANIFEST
                                                           : VRAMD_CODE_FOREIGN_DATA_FILE;
        return vramd__fail(err, -EINVAL, code, "%s in %s is not a regular file", name, dir);
    }
    *fd = f;
    if (direct)
        *direct_fd = open_direct(dir_fd, name, O_RDONLY, f, min_fd);
    return 0;
}

/* --- a dump's directory ---------------------------------------------------- */

/* A description of the directory of our own (to read it: fdopendir takes it over), at or above min_fd. */
static int open_self(int dir_fd, int min_fd)
{
    return open_at(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC, min_fd);
}

static int dup_fd(int fd, int min_fd)
{
    int n = fcntl(fd, F_DUPFD_CLOEXEC, min_fd > 0 ? min_fd : 0);
    return n < 0 ? -errno : n;
}

/* Whether `name` in dir_fd is the file `st` describes (AT_SYMLINK_NOFOLLOW unless follow). */
static bool same_file(const struct stat *st, int dir_fd, const char *name, bool follow)
{
    struct stat now;
    return fstatat(dir_fd, name, &now, follow ? 0 : AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == st->st_dev &&
           now.st_ino == st->st_ino;
}

/* Fill err for a refused .lock in dir_fd (`why`: what is wrong with it); returns -e. */
static int lock_refused(struct vramd_error *err, int e, int dir_fd, const char *why)
{
    char path[PATH_MAX];
    vramd__dir_label(dir_fd, path, sizeof path);
    return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "cannot lock %s: its " VRAMD__LOCK_NAME " %s; refused (remove it "
                       "if no dump, rm or gc runs there)", path, why);
}

/* `.lock` in dir_fd opened read-write, created 0600 where missing (by root: given to the directory's owner)
 * and checked as vramd.imagedir does: a regular file, one link, of the directory's owner or of this uid,
 * nobody else's to open.  0 with *out the fd, or -1 where `optional` and this uid may not create it (an out
 * parameter: any fd number, 0 and 1 too, may be the lock's where min_fd is 0); 1 where it went between the
 * create and the open; or -errno, err filled. */
static int open_lock_file(int dir_fd, const struct stat *owner, bool optional, int min_fd, int *out,
                          struct vramd_error *err)
{
    *out = -1;
    uid_t me = geteuid();
    bool created = true;
    int fd = open_at(dir_fd, VRAMD__LOCK_NAME, O_RDWR | O_CREAT | O_EXCL | OPEN_FLAGS, min_fd);
    if (fd == -EEXIST) {
        created = false;
        fd = open_at(dir_fd, VRAMD__LOCK_NAME, O_RDWR | OPEN_FLAGS, min_fd);
        if (fd == -ENOENT) /* its holder removed it just now: take_lock looks again */
            return 1;
        if (optional && fd == -EROFS)
            return 0;
        if (fd == -ELOOP)
            return lock_refused(err, ELOOP, dir_fd, "is a symbolic link");
        if (fd == -EACCES || fd == -EPERM) {
            struct stat ls;
            char why[96];
            long uid = fstatat(dir_fd, VRAMD__LOCK_NAME, &ls, AT_SYMLINK_NOFOLLOW) == 0 ? (long)ls.st_uid : -1;
            snprintf(why, sizeof why, "is uid %ld's, and uid %u may not open it", uid, (unsigned)me);
            return lock_refused(err, EACCES, dir_fd, why);
        }
        if (fd < 0)
            return fail_name(err, -fd, "open", VRAMD__LOCK_NAME, dir_fd);
    } else if (fd < 0) {
        if (optional && (fd == -EACCES || fd == -EPERM || fd == -EROFS))
            return 0;
        return fail_name(err, -fd, "create", VRAMD__LOCK_NAME, dir_fd);
    }
    struct stat st;
    char why[128] = "";
    if (created && fchmod(fd, FILE_MODE) < 0) /* whatever the umask: its owner may open it read-write again */
        snprintf(why, sizeof why, "cannot be made 0600 (%s)", errtext(errno));
    else if (created && me == 0 && owner->st_uid != 0 && fchown(fd, owner->st_uid, owner->st_gid) < 0)
        snprintf(why, sizeof why, "cannot be given to the directory's owner (%s)", errtext(errno));
    else if (fstat(fd, &st) < 0)
        snprintf(why, sizeof why, "cannot be checked (%s)", errtext(errno));
    else if (!S_ISREG(st.st_mode))
        snprintf(why, sizeof why, "is not a regular file");
    else if (st.st_nlink > 1) /* 0: its last holder removed it just now (take_lock starts again) */
        snprintf(why, sizeof why, "has %lu links", (unsigned long)st.st_nlink);
    else if (st.st_uid != owner->st_uid && st.st_uid != me)
        snprintf(why, sizeof why, "is uid %u's, neither the directory's owner's (uid %u) nor uid %u's",
                 (unsigned)st.st_uid, (unsigned)owner->st_uid, (unsigned)me);
    else if (st.st_mode & 077)
        snprintf(why, sizeof why, "has mode %04o: others may open it", (unsigned)(st.st_mode & 07777));
    if (!why[0]) {
        *out = fd;
        return 0;
    }
    vramd__close_fd(fd);
    if (created)
        (void)unlinkat(dir_fd, VRAMD__LOCK_NAME, 0);
    return lock_refused(err, EPERM, dir_fd, why);
}

/* vramd.imagedir.lock.RELEASE_SPINS, _YIELDS, _PAUSE: how often a shared taker looks again at a lock held
 * exclusively under an unchanged name (a sibling releasing its shared lock holds it so for one unlink, which a
 * preempted releaser may stretch to a time slice): yielding the CPU first, then after 1 ms pauses; a dump's
 * exclusive lock refuses a shared taker after about 0.2 s. */
#define RELEASE_SPINS 300
#define RELEASE_YIELDS 100
/* vramd.imagedir.lock.STRAYS: replacements of .lock no holder's release explains before a taker gives up */
#define STRAYS 8
/* vramd.imagedir.lock.RELEASES: removals of the .lock a taker opened, before it held it, that it outlasts (a
 * holder's release each, or a process that may write the directory removing it in a loop) */
#define RELEASES 1000

/* flock fd (shared or exclusive, never waiting): 0 once held, 1 where .lock is no longer this file (its last
 * holder removed it), -errno (-EWOULDBLOCK: another holds it). */
static int flock_waiting_out_releases(int fd, int dir_fd, bool shared)
{
    for (int spin = 0; spin < (shared ? RELEASE_SPINS : 1); spin++) {
        if (flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) == 0)
            return 0;
        if (errno != EWOULDBLOCK)
            return -errno;
        struct stat st;
        if (fstat(fd, &st) == 0 && !same_file(&st, dir_fd, VRAMD__LOCK_NAME, false))
            return 1;
        if (shared && spin < RELEASE_YIELDS)
            sched_yield();
        else if (shared)
            nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    }
    return -EWOULDBLOCK;
}

/* The directory's lock, as vramd.imagedir.take_lock takes it: its .lock, flocked (shared: a child's lock
 * of its parent), held while the name still is that file.  *lock_fd gets it (-1 where `optional` and this uid
 * may not create it); 0, or -EBUSY when another holds it, or -errno, err filled.  `label`: how messages name
 * the directory before its path. */
static int take_lock(int dir_fd, bool shared, bool optional, const char *label, int min_fd, int *lock_fd,
                     struct vramd_error *err)
{
    struct stat owner;
    *lock_fd = -1;
    if (fstat(dir_fd, &owner) < 0)
        return fail_name(err, errno, "stat", ".", dir_fd);
    /* as vramd.imagedir.take_lock: again while each file opened was removed before we held it (another
     * holder's completed release: the lock was free then), up to RELEASES times; STRAYS replacements no release
     * explains (the file opened still linked, moved away) are refused */
    int releases = 0;
    for (int strays = 0; strays < STRAYS;) {
        if (releases == RELEASES) {
            char path[PATH_MAX];
            vramd__dir_label(dir_fd, path, sizeof path);
            return vramd__fail(err, -EBUSY, VRAMD_CODE_LOCAL, "cannot lock %s%s: its " VRAMD__LOCK_NAME " was "
                               "removed %d times before it could be held (by holders' releases, or a process "
                               "removing it)", label, path, RELEASES);
        }
        int fd;
        int r = open_lock_file(dir_fd, &owner, optional, min_fd, &fd, err);
        if (r < 0)
            return r;
        if (r == 1) {
            releases++; /* removed between our create and our open: a release */
            continue;
        }
        if (fd < 0)
            return 0;
        r = flock_waiting_out_releases(fd, dir_fd, shared);
        if (r < 0) {
            int e = -r;
            char path[PATH_MAX];
            vramd__close_fd(fd);
            vramd__dir_label(dir_fd, path, sizeof path);
            if (e == EWOULDBLOCK)
                return vramd__fail(err, -EBUSY, VRAMD_CODE_LOCAL, "another dump is writing into %s%s (it holds its "
                                   "lock)", label, path);
            return vramd__fail(err, -e, VRAMD_CODE_LOCAL, "cannot lock %s%s: %s", label, path, errtext(e));
        }
        /* r == 1: its last holder, removing it, held it exclusively; or its last holder may have removed the
         * name between our open and our flock: this file then excludes nobody, and the one at the name now is
         * the lock */
        struct stat st;
        bool have = fstat(fd, &st) == 0;
        if (r == 0 && have && same_file(&st, dir_fd, VRAMD__LOCK_NAME, false)) {
            *lock_fd = fd;
            return 0;
        }
        vramd__close_fd(fd);
        if (!have || st.st_nlink > 0)
            strays++;
        else
            releases++;
    }
    char path[PATH_MAX];
    vramd__dir_label(dir_fd, path, sizeof path);
    return vramd__fail(err, -EBUSY, VRAMD_CODE_LOCAL, "cannot lock %s%s: its " VRAMD__LOCK_NAME " was replaced %d "
                       "times while the file opened stayed linked (moved away, not removed by a holder's release)",
                       label, path, STRAYS);
}

/* Unlock: where no other holder is left, the name goes first (it exists only while held, or after a crash).
 * As vramd.imagedir.DirectoryLock.release: an exclusive holder knows it is the only one; a shared one
 * takes the lock exclusively at once, which succeeds only then, after checking the name (nobody removes it
 * while we hold the lock), so that its exclusive hold, which refuses a sibling, covers one unlink. */
static void release_lock(int dir_fd, int lock_fd, bool shared)
{
    if (lock_fd < 0)
        return;
    struct stat st;
    if (dir_fd >= 0 && fstat(lock_fd, &st) == 0 && same_file(&st, dir_fd, VRAMD__LOCK_NAME, false) &&
        (!shared || flock(lock_fd, LOCK_EX | LOCK_NB) == 0))
        (void)unlinkat(dir_fd, VRAMD__LOCK_NAME, 0);
    vramd__close_fd(lock_fd);
}

/* One pass over the directory: refuse children's marks (unless replace_parent), sweep vramd's own
 * temporaries a crashed dump left (regular files only; this dump has created nothing yet). */
static int scan_dir(struct vramd__dump *d, bool replace_parent, int min_fd, struct vramd_error *err)
{
    int fd = open_self(d->dir_fd, min_fd);
    if (fd < 0)
        return fail_name(err, -fd, "read", ".", d->dir_fd);
    DIR *dir = fdopendir(fd);
    if (!dir) {
        int e = errno;
        vramd__close_fd(fd);
        return fail_name(err, e, "read", ".", d->dir_fd);
    }
    size_t marks = 0;
    char first[VRAMD__NAME_MAX] = "";
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (is_child_mark(e->d_name)) {
            if (!marks++)
                memcpy(first, e->d_name, strlen(e->d_name) + 1); /* a mark's name is 39 bytes */
            continue;
        }
        if (!is_data_tmp(e->d_name) && !is_manifest_tmp(e->d_name))
            continue;
        struct stat st;
        if (fstatat(d->dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
            (void)unlinkat(d->dir_fd, e->d_name, 0); /* a crashed dump's: nobody can hold the lock we hold */
    }
    closedir(dir);
    if (marks && !replace_parent) {
        char path[PATH_MAX];
        vramd__dir_label(d->dir_fd, path, sizeof path);
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL,
                           "the image in %s is the parent of %zu incremental image(s) (marked %s...); replacing it "
                           "would break them: flatten or remove them first (vramctl gc removes stale marks), or "
                           "set replace_parent",
                           path, marks, first);
    }
    return 0;
}

int vramd__dump_begin(struct vramd__dump *d, int dir_fd, const int *parents, size_t np, bool replace_parent,
                      int min_fd, struct vramd_error *err)
{
    memset(d, 0, sizeof *d);
    d->dir_fd = d->lock_fd = -1;
    d->min_fd = min_fd;
    d->stripes = 1;
    struct stat ds;
    int r;
    if (fstat(dir_fd, &ds) < 0)
        return vramd__fail(err, -errno, VRAMD_CODE_LOCAL, "image directory fd %d: %s", dir_fd, errtext(errno));
    if (!S_ISDIR(ds.st_mode))
        return vramd__fail(err, -ENOTDIR, VRAMD_CODE_LOCAL, "image directory fd %d is not a directory", dir_fd);
    if (np) {
        d->parent_fds = calloc(np, sizeof *d->parent_fds);
        d->parent_locks = calloc(np, sizeof *d->parent_locks);
        d->marked = calloc(np, sizeof *d->marked);
        if (!d->parent_fds || !d->parent_locks || !d->marked) {
            r = vramd__fail(err, -ENOMEM, VRAMD_CODE_LOCAL, "dump state: out of memory");
            goto fail;
        }
    }
    for (size_t i = 0; i < np; i++)
        d->parent_fds[i] = d->parent_locks[i] = -1;
    r = dup_fd(dir_fd, min_fd);
    if (r < 0) {
        r = vramd__fail(err, r, VRAMD_CODE_LOCAL, "cannot duplicate the image directory fd: %s", errtext(-r));
        goto fail;
    }
    d->dir_fd = r;
    for (size_t i = 0; i < np; i++) {
        struct stat ps;
        if (fstat(parents[i], &ps) < 0) {
            int e = errno;
            r = vramd__fail(err, -e, VRAMD_CODE_LOCAL, "parent directory fd %d (parent #%zu): %s", parents[i],
                            i + 1, errtext(e));
            goto fail;
        }
        if (!S_ISDIR(ps.st_mode)) {
            r = vramd__fail(err, -ENOTDIR, VRAMD_CODE_LOCAL,
                            "parent directory fd %d (parent #%zu) is not a directory", parents[i], i + 1);
            goto fail;
        }
        if (ps.st_dev == ds.st_dev && ps.st_ino == ds.st_ino) {
            char path[PATH_MAX];
            vramd__dir_label(dir_fd, path, sizeof path);
            r = vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL,
                            "the image directory %s is also parent #%zu of the image: a dump cannot replace its "
                            "own parent", path, i + 1);
            goto fail;
        }
        r = dup_fd(parents[i], min_fd);
        if (r < 0) {
            r = vramd__fail(err, r, VRAMD_CODE_LOCAL, "cannot duplicate parent directory fd %d: %s", parents[i],
                            errtext(-r));
            goto fail;
        }
        d->parent_fds[i] = r;
        d->n_parents = i + 1;
        /* its lock, shared, from before the parent is read (the caller opens its manifest after this) to the
         * end: a dump replacing the parent, or vramctl rm, holds it exclusively, so neither runs between this
         * child's reading of the parent and its mark there; the children of one parent never exclude each
         * other.  Only where this client owns the parent's directory (or is root) and may write it, and the
         * parent's directory has this directory's owner: a lock, like a mark, must never let one user block
         * another's image (a mark lasts as long as its child, which whoever may write its directory keeps). */
        if ((geteuid() == 0 || ps.st_uid == geteuid()) && ps.st_uid == ds.st_uid) {
            char label[48];
            snprintf(label, sizeof label, "the directory of parent #%zu, ", i + 1);
            r = take_lock(d->parent_fds[i], true, true, label, min_fd, &d->parent_locks[i], err);
            if (r < 0) {
                goto fail;
            }
        }
    }
    /* 1. the lock, its .lock file, held to the end */
    r = take_lock(d->dir_fd, false, false, "", min_fd, &d->lock_fd, err);
    if (r < 0) {
        goto fail;
    }
    /* 2. and 3.: children's marks, stale temporaries */
    r = scan_dir(d, replace_parent, min_fd, err);
    if (r < 0) {
        goto fail;
    }
    d->phase = VRAMD__DUMP_OPEN;
    return 0;
fail:
    vramd__dump_release(d);
    return r;
}

int vramd__dump_create_data(struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe, bool direct, int *fd,
                            int *direct_fd, struct vramd_error *err)
{
    *fd = *direct_fd = -1;
    if (stripe >= VRAMD__MAX_STRIPES)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "data file %u of gpu_id %#x: the format numbers a GPU's "
                           "data files 0 to %d", stripe, gpu_id, VRAMD__MAX_STRIPES - 1);
    if (d->n_files == d->cap_files) {
        size_t cap = d->cap_files ? 2 * d->cap_files : 4;
        struct vramd__data_file *f = realloc(d->files, cap * sizeof *f);
        if (!f)
            return vramd__fail(err, -ENOMEM, VRAMD_CODE_LOCAL, "dump state: out of memory");
        d->files = f;
        d->cap_files = cap;
    }
    char name[VRAMD__NAME_MAX];
    data_name(d, gpu_id, stripe, true, name);
    int f = open_at(d->dir_fd, name, CREATE_FLAGS, d->min_fd);
    if (f < 0)
        return fail_name(err, -f, "create", name, d->dir_fd);
    d->files[d->n_files++] = (struct vramd__data_file){.gpu_id = gpu_id, .stripe = stripe};
    *fd = f;
    if (direct)
        *direct_fd = open_direct(d->dir_fd, name, O_WRONLY, f, d->min_fd);
    return 0;
}

bool vramd__dump_has_gpu(const struct vramd__dump *d, uint32_t gpu_id)
{
    for (size_t i = 0; i < d->n_files; i++)
        if (d->files[i].gpu_id == gpu_id)
            return true;
    return false;
}

void vramd__dump_drop_data(struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe)
{
    for (size_t i = 0; i < d->n_files; i++)
        if (d->files[i].gpu_id == gpu_id && d->files[i].stripe == stripe) {
            char name[VRAMD__NAME_MAX];
            data_name(d, gpu_id, stripe, true, name);
            (void)unlinkat(d->dir_fd, name, 0);
            d->files[i] = d->files[--d->n_files]; /* before the commit: nothing is renamed yet */
            return;
        }
}

void vramd__dump_data_name(const struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe,
                           char out[VRAMD__NAME_MAX])
{
    data_name(d, gpu_id, stripe, false, out);
}

int vramd__dump_manifest_tmp(struct vramd__dump *d, int *fd, struct vramd_error *err)
{
    char name[VRAMD__NAME_MAX];
    manifest_tmp_name(d, name);
    /* a second Start passes the same file again */
    int f = open_at(d->dir_fd, name, d->manifest_tmp ? (O_RDWR | OPEN_FLAGS) : CREATE_FLAGS, d->min_fd);
    if (f < 0)
        return fail_name(err, -f, d->manifest_tmp ? "open" : "create", name, d->dir_fd);
    d->manifest_tmp = true;
    *fd = f;
    return 0;
}

/* The path of the directory fd (from /proc/self/fd) in out; false where there is none (or it holds a
 * newline: a mark's line could not hold it). */
static bool dir_path(int fd, char *out, size_t size)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, size - 1);
    if (n <= 0 || (size_t)n >= size - 1)
        return false;
    out[n] = '\0';
    size_t len = (size_t)n;
    return out[0] == '/' && !strchr(out, '\n') &&
           !(len >= 10 && strcmp(out + len - 10, " (deleted)") == 0);
}

/* os.path.relpath(to, from) of two absolute, normalized paths, in out ("" where it does not fit). */
static void rel_path(const char *from, const char *to, char *out, size_t size)
{
    size_t common = 0;
    for (size_t i = 0;; i++) { /* the last component boundary both share */
        char a = from[i], b = to[i];
        if ((a == '/' || a == '\0') && (b == '/' || b == '\0'))
            common = i;
        if (a == '\0' || b == '\0' || a != b)
            break;
    }
    size_t len = 0;
    out[0] = '\0';
    for (const char *p = from + common; *p;) { /* one ".." per component of `from` below the common part */
        while (*p == '/')
            p++;
        if (!*p)
            break;
        len += (size_t)snprintf(out + len, len < size ? size - len : 0, "%s..", len ? "/" : "");
        while (*p && *p != '/')
            p++;
    }
    const char *rest = to + common;
    while (*rest == '/')
        rest++;
    if (*rest)
        len += (size_t)snprintf(out + len, len < size ? size - len : 0, "%s%s", len ? "/" : "", rest);
    if (!len)
        len = (size_t)snprintf(out, size, ".");
    if (len >= size)
        out[0] = '\0';
}

/* Under parent i's lock (held, shared, since vramd__dump_begin: only where this client owns the parent's
 * directory, or is root, and may write it, and it has this directory's owner): this child's mark in it, naming this image and this directory
 * (format.child_mark_content), fsynced.  0 (also when the caller may not write there) or a negative errno
 * with err filled. */
static int mark_parent(struct vramd__dump *d, size_t i, struct vramd_error *err)
{
    int pfd = d->parent_fds[i];
    char name[VRAMD__NAME_MAX];
    if (d->parent_locks[i] < 0)
        return 0;
    mark_name(d, name);
    int r = 0;
    int m = open_at(pfd, name, O_WRONLY | O_CREAT | O_EXCL | OPEN_FLAGS, d->min_fd);
    if (m < 0) {
        if (m != -EACCES && m != -EPERM && m != -EROFS)
            r = fail_name(err, -m, "create the mark", name, pfd);
        return r;
    }
    d->marked[i] = true;
    struct {
        char here[PATH_MAX], there[PATH_MAX], rel[PATH_MAX], text[3 * PATH_MAX + 64];
    } *buf = malloc(sizeof *buf);
    if (!buf) {
        vramd__close_fd(m);
        return vramd__fail(err, -ENOMEM, VRAMD_CODE_LOCAL, "dump state: out of memory");
    }
    char *here = buf->here, *there = buf->there, *rel = buf->rel, *text = buf->text;
    size_t text_size = sizeof buf->text;
    char hex[2 * VRAMD__ID_BYTES + 1];
    id_hex(d->image_id, hex);
    bool have_here = dir_path(d->dir_fd, here, PATH_MAX);
    if (!have_here)
        here[0] = '\0';
    rel[0] = '\0';
    if (have_here && dir_path(pfd, there, PATH_MAX))
        rel_path(there, here, rel, PATH_MAX);
    int n = snprintf(text, text_size, "vramd child mark 1\nimage %s\npath %s\nabs %s\n", hex, rel, here);
    ssize_t w = n > 0 && (size_t)n < text_size ? write(m, text, (size_t)n) : -1;
    if (w != n)
        r = fail_name(err, w < 0 ? errno : EIO, "write the mark", name, pfd);
    else if (fsync(m) < 0 || fsync(pfd) < 0)
        r = fail_name(err, errno, "fsync the mark", name, pfd);
    vramd__close_fd(m);
    free(buf);
    return r;
}

/* Whether the mark `name` in pfd names the directory `here`, and no other (format.parse_child_mark;
 * vramd.imagedir.mark_names). */
static bool mark_names(int pfd, const char *name, const struct stat *here)
{
    char text[16384 + 2];
    int fd = openat(pfd, name, O_RDONLY | OPEN_FLAGS);
    if (fd < 0)
        return false;
    struct stat st;
    ssize_t n = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) ? read(fd, text, sizeof text - 1) : -1;
    close(fd);
    if (n <= 0 || (size_t)n >= sizeof text - 1)
        return false;
    text[n] = '\0';
    if (strlen(text) != (size_t)n || text[n - 1] != '\n')
        return false;
    static const char head[] = "vramd child mark 1\nimage ";
    if (strncmp(text, head, sizeof head - 1) != 0)
        return false;
    char *id = text + sizeof head - 1;
    if (!is_lower_hex(id, 32) || id[32] != '\n' || strncmp(id, name + 7, 32) != 0)
        return false;
    char *rel = id + 33;
    if (strncmp(rel, "path ", 5) != 0)
        return false;
    rel += 5;
    char *ab = strchr(rel, '\n');
    if (!ab || strncmp(ab + 1, "abs ", 4) != 0)
        return false;
    *ab = '\0';
    ab += 5;
    char *end = strchr(ab, '\n');
    if (!end || end[1] != '\0')
        return false;
    *end = '\0';
    /* one path leads to that very directory, and the other nowhere (a mark whose other path finds a
     * directory, maybe its live child moved along with its parent, is not this directory's to remove) */
    int hits = 0;
    const char *paths[2] = {rel, ab};
    for (int k = 0; k < 2; k++) {
        struct stat now;
        if (!*paths[k])
            continue;
        if (fstatat(pfd, paths[k], &now, 0) < 0) {
            if (errno == ENOENT || errno == ENOTDIR)
                continue;
            return false;
        }
        if (now.st_dev != here->st_dev || now.st_ino != here->st_ino)
            return false;
        hits++;
    }
    return hits > 0;
}

/* After the commit point, in each parent directory this dump marked: the marks that name this directory but
 * another image (the image this one replaced, or a child dump into it that died in its commit) go. */
static void unmark_replaced(struct vramd__dump *d)
{
    char mine[VRAMD__NAME_MAX];
    struct stat here;
    mark_name(d, mine);
    if (fstat(d->dir_fd, &here) < 0)
        return;
    for (size_t i = 0; i < d->n_parents; i++) {
        if (!d->marked[i])
            continue;
        int fd = open_self(d->parent_fds[i], d->min_fd);
        DIR *dir = fd < 0 ? NULL : fdopendir(fd);
        if (!dir) {
            vramd__close_fd(fd);
            continue;
        }
        struct dirent *e;
        while ((e = readdir(dir)))
            if (is_child_mark(e->d_name) && strcmp(e->d_name, mine) != 0 &&
                mark_names(d->parent_fds[i], e->d_name, &here))
                (void)unlinkat(d->parent_fds[i], e->d_name, 0);
        closedir(dir);
    }
}

/* After the commit point: the data files of the image this one replaced (data-*.vrd of another id, every
 * stripe's). */
static void remove_replaced(struct vramd__dump *d)
{
    int fd = open_self(d->dir_fd, d->min_fd);
    if (fd < 0)
        return;
    DIR *dir = fdopendir(fd);
    if (!dir) {
        vramd__close_fd(fd);
        return;
    }
    char hex[2 * VRAMD__ID_BYTES + 1];
    id_hex(d->image_id, hex);
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (!vramd__is_data_file_name(e->d_name) || memcmp(e->d_name + 5, hex, 16) == 0)
            continue;
        struct stat st;
        if (fstatat(d->dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
            (void)unlinkat(d->dir_fd, e->d_name, 0); /* best effort: the new image is committed either way */
    }
    closedir(dir);
}

int vramd__dump_commit(struct vramd__dump *d, struct vramd_error *err)
{
    char from[VRAMD__NAME_MAX], to[VRAMD__NAME_MAX];
    int r = 0;
    /* the data files' .tmp into place, every stripe of every GPU */
    for (; d->n_renamed < d->n_files; d->n_renamed++) {
        const struct vramd__data_file *f = &d->files[d->n_renamed];
        data_name(d, f->gpu_id, f->stripe, true, from);
        data_name(d, f->gpu_id, f->stripe, false, to);
        if (renameat(d->dir_fd, from, d->dir_fd, to) < 0) {
            r = fail_name(err, errno, "rename", from, d->dir_fd);
            goto fail;
        }
    }
    /* this child's mark in each parent directory it may write */
    for (size_t i = 0; i < d->n_parents; i++)
        if ((r = mark_parent(d, i, err)) < 0)
            goto fail;
    /* the commit point */
    if (!d->manifest_tmp) {
        r = vramd__fail(err, -EPROTO, VRAMD_CODE_LOCAL, "the dump ended without its manifest (no Start)");
        goto fail;
    }
    manifest_tmp_name(d, from);
    if (renameat(d->dir_fd, from, d->dir_fd, VRAMD__MANIFEST_NAME) < 0) {
        r = fail_name(err, errno, "rename", from, d->dir_fd);
        goto fail;
    }
    d->manifest_tmp = false;
    d->phase = VRAMD__DUMP_COMMITTED;
    if (fsync(d->dir_fd) < 0) {
        char path[PATH_MAX];
        int e = errno;
        vramd__dir_label(d->dir_fd, path, sizeof path);
        r = vramd__fail(err, -e, VRAMD_CODE_LOCAL, "the image is in place but fsync of %s failed: %s", path,
                        errtext(e));
    } else {
        remove_replaced(d);
        unmark_replaced(d);
    }
    vramd__dump_release(d);
    return r;
fail:
    vramd__dump_abandon(d);
    return r;
}

void vramd__dump_abandon(struct vramd__dump *d)
{
    if (d->phase != VRAMD__DUMP_OPEN)
        return;
    char name[VRAMD__NAME_MAX];
    if (d->dir_fd >= 0) {
        for (size_t i = 0; i < d->n_files; i++) {
            data_name(d, d->files[i].gpu_id, d->files[i].stripe, i >= d->n_renamed, name);
            (void)unlinkat(d->dir_fd, name, 0);
        }
        if (d->manifest_tmp) {
            manifest_tmp_name(d, name);
            (void)unlinkat(d->dir_fd, name, 0);
        }
    }
    mark_name(d, name);
    for (size_t i = 0; i < d->n_parents; i++)
        if (d->marked[i])
            (void)unlinkat(d->parent_fds[i], name, 0);
    d->n_files = d->n_renamed = 0;
    d->manifest_tmp = false;
    d->phase = VRAMD__DUMP_ABANDONED;
    vramd__dump_release(d);
}

void vramd__dump_release(struct vramd__dump *d)
{
    release_lock(d->dir_fd, d->lock_fd, false);
    vramd__close_fd(d->dir_fd);
    d->lock_fd = d->dir_fd = -1;
    for (size_t i = 0; i < d->n_parents; i++) {
        release_lock(d->parent_fds[i], d->parent_locks[i], true);
        vramd__close_fd(d->parent_fds[i]);
    }
    free(d->parent_fds);
    free(d->parent_locks);
    free(d->marked);
    free(d->files);
    d->parent_fds = d->parent_locks = NULL;
    d->marked = NULL;
    d->files = NULL;
    d->n_parents = d->n_files = d->cap_files = d->n_renamed = 0;
}
