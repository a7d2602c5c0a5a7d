/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libvramd internals: the ABI 1.0 rules for input structs (abi.c; client.h "ABI 1.0").  Each public call
 * turns the caller's size-versioned struct into the library's own layout first (vramd__abi_in), and walks
 * arrays with the stride their first element's struct_size gives (vramd__abi_stride); the enum choices and
 * their 0.x strings become one wire string (vramd__backend_of, vramd__compression_of).
 */
#ifndef VRAMD_ABI_H
#define VRAMD_ABI_H

#include <stddef.h>

#include "base.h"
#include "vramd/criu.h"

/* sizeof a struct as ABI 1.0 laid it out: the end of its last 1.0 member, rounded up to its alignment. */
#define VRAMD__SIZE_1_0(type, last)                                                                            \
    ((offsetof(type, last) + sizeof(((type *)0)->last) + _Alignof(type) - 1) / _Alignof(type) * _Alignof(type))
/* The largest struct_size looked at: a later 1.x never grows a struct this far, so a larger one (a struct_size
 * never set, in a caller that fills the struct member by member) is refused before any byte past the
 * library's layout is read. */
#define VRAMD__STRUCT_SIZE_MAX 1024
#define VRAMD__OPTIONS_1_0 VRAMD__SIZE_1_0(struct vramd_options, client_name)
#define VRAMD__OPEN_ARGS_1_0 VRAMD__SIZE_1_0(struct vramd_open_args, compression_level)
#define VRAMD__BO_1_0 VRAMD__SIZE_1_0(struct vramd_bo, backend_kind)
#define VRAMD__CRIU_CONFIG_1_0 VRAMD__SIZE_1_0(struct vramd_criu_config, compression_level)
#define VRAMD__CRIU_BO_1_0 VRAMD__SIZE_1_0(struct vramd_criu_bo, va_addr)
/* After 1.0: each appended a uint64_t hold_s (past the 1.0 size: never in a 1.0 caller's padding) */
#define VRAMD__OPEN_ARGS_1_1 VRAMD__SIZE_1_0(struct vramd_open_args, hold_s)
#define VRAMD__CRIU_CONFIG_1_1 VRAMD__SIZE_1_0(struct vramd_criu_config, hold_s)
/* 1.2: each appended an int supply_fd (0 or -1: none) */
#define VRAMD__OPEN_ARGS_1_2 VRAMD__SIZE_1_0(struct vramd_open_args, supply_fd)
#define VRAMD__CRIU_CONFIG_1_2 VRAMD__SIZE_1_0(struct vramd_criu_config, supply_fd)

/*
 * The caller's struct `in` (named `name` in messages) as this library's layout in `out` (`known` bytes,
 * sizeof the struct here): the bytes struct_size covers, the rest zero; out's struct_size is `known`.
 * -EINVAL for a struct_size below size_1_0, -E2BIG for one beyond `known` whose extra bytes are not all zero.
 */
int vramd__abi_in(const void *in, size_t known, size_t size_1_0, const char *name, void *out,
                  struct vramd_error *err);
/* The stride of an array of n such structs (n > 0): its first element's struct_size (0: size_1_0), checked
 * against every element's (-EINVAL for a mix) and, beyond `known`, for zero tails (-E2BIG). */
int vramd__abi_stride(const void *arr, size_t n, size_t known, size_t size_1_0, const char *name, size_t *stride,
                      struct vramd_error *err);
/* Element i of such an array as this library's layout (as vramd__abi_in, already checked). */
void vramd__abi_elem(const void *arr, size_t stride, size_t i, size_t known, void *out);

/* The backend to ask for: the enum (vramd_backend_name) or the 0.x string; NULL: the daemon's choice.
 * -EINVAL (naming `what`) for an enum value not listed or a string that names another backend. */
int vramd__backend_of(const char *str, int kind, const char **out, const char *what, struct vramd_error *err);
/* The compression to ask for, as the wire's "mode[:level]" (in buf) or the 0.x string; NULL: the daemon's
 * default.  -EINVAL for a value not listed, a level without a mode that takes one, or a string that disagrees. */
int vramd__compression_of(const char *str, int kind, int level, char buf[32], const char **out,
                          struct vramd_error *err);

#endif
