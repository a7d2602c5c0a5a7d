/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd internals: the dump sessions a connection keeps client state for (session.c), and the files a
 * session needs handed to the daemon (attach.c). */
#ifndef VRAMD_SESSION_H
#define VRAMD_SESSION_H

#include "conn.h"

/* The connection's entry for this dump session, or NULL (not a dump, or opened on another connection). */
struct dump_entry *vramd__find_dump(struct vramd_conn *c, const struct vramd_token *t);
/* Forget a dump's client state: abandoned first unless committed (removes what it created, unlocks). */
void vramd__drop_dump(struct vramd_conn *c, struct dump_entry *e);
/* Open and attach every file an OpenSession reply asked for (needed[0..n)): image k's in dirs[k] (dirs[0] is
 * -1 for a dump: its own files are made, never asked for).  -EPROTO, and c broken, for a file this client does
 * not open. */
int vramd__attach_needed(struct vramd_conn *c, char *tok, PbFileRef *const *needed, size_t n, const int *dirs,
                         size_t ndirs, struct vramd_session_info *info, struct vramd_error *err);
/* Create and attach the data files of every GPU of bos[] that has none yet. */
int vramd__attach_dump_data(struct vramd_conn *c, struct dump_entry *e, char *tok, const struct vramd_bo *bos,
                            size_t n, struct vramd_error *err);
/* vramd_close_session with its own bound on the reply (-1: none), whatever the connection's timeout_ms. */
int vramd__close_session_within(struct vramd_conn *c, const struct vramd_token *t, int within_ms,
                                struct vramd_session_info *info, struct vramd_error *err);
/* Close every fd of fds[0..n). */
void vramd__close_all(const int *fds, size_t n);

#endif
