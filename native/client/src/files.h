/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals: an image's files on the client's side (files.c): names, opening, a dump's lock,
 * temporaries, commit and abandon.  Needs only base.h: it knows nothing of connections or messages. */
#ifndef VRAMD_FILES_H
#define VRAMD_FILES_H

#include "base.h"

#define VRAMD__ID_BYTES 16               /* an image id */
#define VRAMD__NAME_MAX 64               /* room for any name below */
#define VRAMD__DATA_NAME_LEN 34          /* data-<16 hex>-<8 hex>.vrd (stripe 0) */
#define VRAMD__STRIPE_NAME_LEN 36        /* data-<16 hex>-<8 hex>-<stripe 1-f>.vrd */
#define VRAMD__MAX_STRIPES 16            /* format.MAX_STRIPES: a GPU's data files, numbered by one hex digit */
#define VRAMD__MANIFEST_NAME "manifest.vrdm"
#define VRAMD__LOCK_NAME ".lock"         /* format.LOCK_NAME: an image directory's lock */

/* A name the daemon may ask for: exactly format.DATA_FILE_NAME, either form (no path, no dot-dot). */
bool vramd__is_data_file_name(const char *name);
/* The directory's path for messages (/proc/self/fd), or "the directory of fd N". */
void vramd__dir_label(int dir_fd, char *buf, size_t size);
/* Open `name` in dir_fd O_RDONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC at or above min_fd, and (direct) once more
 * with O_DIRECT where the file system allows (*direct_fd -1 where not).  On failure err names the file
 * (-EACCES with the uid whose rights were missing). */
int vramd__open_image_file(int dir_fd, const char *name, bool direct, int min_fd, int *fd, int *direct_fd,
                           struct vramd_error *err);

enum { VRAMD__DUMP_NONE, VRAMD__DUMP_OPEN, VRAMD__DUMP_COMMITTED, VRAMD__DUMP_ABANDONED };

/* One data file of a dump: data file `stripe` of GPU `gpu_id`. */
struct vramd__data_file {
    uint32_t gpu_id;
    uint32_t stripe;
};

/* What a dump session's client holds between OpenSession and its commit. */
struct vramd__dump {
    int phase;                           /* VRAMD__DUMP_* */
    int min_fd;
    uint8_t image_id[VRAMD__ID_BYTES];
    int dir_fd;                          /* our duplicate of the image directory */
    int lock_fd;                         /* its lock file (.lock), flocked; release_lock (files.c) unlocks */
    int *parent_fds;                     /* duplicates of the parent directories (for the marks) */
    int *parent_locks;                   /* per parent: its lock file, flocked shared, to the end (-1: this
                                            client may not take it, and does not mark that parent) */
    bool *marked;                        /* per parent: this dump's mark is there */
    size_t n_parents;
    uint32_t stripes;                    /* data files per GPU (SessionInfo.data_files_per_gpu, at least 1) */
    struct vramd__data_file *files;      /* the data files (.tmp) this dump created */
    size_t n_files, cap_files;
    size_t n_renamed;                    /* files[0..n_renamed) are renamed into place */
    bool manifest_tmp;                   /* the manifest's temporary exists */
};

/* Duplicate the directories, lock dir_fd, refuse marks (unless replace_parent) and a directory that is its
 * own parent, sweep stale temporaries.  On failure nothing is held. */
int vramd__dump_begin(struct vramd__dump *d, int dir_fd, const int *parents, size_t np, bool replace_parent,
                      int min_fd, struct vramd_error *err);
/* Whether this dump created any data file of the GPU. */
bool vramd__dump_has_gpu(const struct vramd__dump *d, uint32_t gpu_id);
/* Create data file `stripe` of the GPU as its name + ".tmp" (and its O_DIRECT description where allowed). */
int vramd__dump_create_data(struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe, bool direct, int *fd,
                            int *direct_fd, struct vramd_error *err);
/* Remove that .tmp again (its AttachFiles failed). */
void vramd__dump_drop_data(struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe);
/* Data file `stripe` of the GPU: its name, without .tmp. */
void vramd__dump_data_name(const struct vramd__dump *d, uint32_t gpu_id, uint32_t stripe,
                           char out[VRAMD__NAME_MAX]);
/* The manifest's temporary: created the first time, opened again O_RDWR after. */
int vramd__dump_manifest_tmp(struct vramd__dump *d, int *fd, struct vramd_error *err);
/* The commit (the session is DONE): data files into place, parents marked, the manifest renamed, the
 * directory fsynced, the replaced image's data files removed, unlocked.  On failure before the manifest's
 * rename everything this dump created is removed. */
int vramd__dump_commit(struct vramd__dump *d, struct vramd_error *err);
/* Not committed: remove everything this dump created, unlock. */
void vramd__dump_abandon(struct vramd__dump *d);
/* Close what it holds (unlocks); names stay as they are. */
void vramd__dump_release(struct vramd__dump *d);

#endif
