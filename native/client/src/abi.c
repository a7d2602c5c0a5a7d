/* SPDX-License-Identifier: Apache-2.0 */
/* libvramd: the ABI 1.0 rules for input structs (abi.h), the enum choices, the *_init functions. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"

/* The 1.0 layout is what this library is built with (only the ABI test's build appends a member). */
#ifndef VRAMD_ABI_TEST_EXTRA
_Static_assert(sizeof(struct vramd_open_args) == VRAMD__OPEN_ARGS_1_2, "vramd_open_args grew: name its 1.x size");
_Static_assert(offsetof(struct vramd_open_args, hold_s) >= VRAMD__OPEN_ARGS_1_0, "1.1 member in 1.0 padding");
_Static_assert(offsetof(struct vramd_open_args, supply_fd) >= VRAMD__OPEN_ARGS_1_1, "1.2 member in 1.1 padding");
#endif
_Static_assert(sizeof(struct vramd_options) == VRAMD__OPTIONS_1_0, "vramd_options grew: name its 1.x size");
_Static_assert(sizeof(struct vramd_bo) == VRAMD__BO_1_0, "vramd_bo grew: name its 1.x size");
_Static_assert(sizeof(struct vramd_criu_config) == VRAMD__CRIU_CONFIG_1_2, "vramd_criu_config grew");
_Static_assert(offsetof(struct vramd_criu_config, hold_s) >= VRAMD__CRIU_CONFIG_1_0, "1.1 member in 1.0 padding");
_Static_assert(offsetof(struct vramd_criu_config, supply_fd) >= VRAMD__CRIU_CONFIG_1_1, "1.2 member in 1.1 padding");
_Static_assert(sizeof(struct vramd_criu_bo) == VRAMD__CRIU_BO_1_0, "vramd_criu_bo grew");

static uint32_t struct_size_of(const void *in)
{
    uint32_t size; /* every size-versioned struct begins with it */
    memcpy(&size, in, sizeof size);
    return size;
}

/* 0, or the error for a struct_size this library cannot take. */
static int check_size(const void *in, size_t size, size_t known, size_t size_1_0, const char *name,
                      struct vramd_error *err)
{
    if (size < size_1_0)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "struct %s: struct_size %zu is below its ABI 1.0 size %zu",
                           name, size, size_1_0);
    if (size > VRAMD__STRUCT_SIZE_MAX) /* not read at all: more likely never set than a struct of a later 1.x */
        return vramd__fail(err, -E2BIG, VRAMD_CODE_LOCAL, "struct %s: struct_size %zu is beyond any libvramd's (at "
                           "most %d): set it with the struct's _INIT initialiser or _init() function, or to 0",
                           name, size, VRAMD__STRUCT_SIZE_MAX);
    const unsigned char *p = in;
    for (size_t i = known; i < size; i++)
        if (p[i])
            return vramd__fail(err, -E2BIG, VRAMD_CODE_LOCAL,
                               "struct %s: struct_size %zu, and byte %zu, past the %zu bytes this libvramd knows, is "
                               "not zero (an option of a newer libvramd)", name, size, i, known);
    return 0;
}

int vramd__abi_in(const void *in, size_t known, size_t size_1_0, const char *name, void *out,
                  struct vramd_error *err)
{
    size_t size = struct_size_of(in) ? struct_size_of(in) : size_1_0;
    int r = check_size(in, size, known, size_1_0, name, err);
    if (r < 0)
        return r;
    memset(out, 0, known);
    memcpy(out, in, size < known ? size : known);
    uint32_t k = (uint32_t)known;
    memcpy(out, &k, sizeof k);
    return 0;
}

int vramd__abi_stride(const void *arr, size_t n, size_t known, size_t size_1_0, const char *name, size_t *stride,
                      struct vramd_error *err)
{
    size_t size = struct_size_of(arr) ? struct_size_of(arr) : size_1_0;
    int r = check_size(arr, size, known, size_1_0, name, err);
    if (r < 0)
        return r;
    const unsigned char *p = arr;
    for (size_t i = 1; i < n; i++) {
        size_t s = struct_size_of(p + i * size) ? struct_size_of(p + i * size) : size_1_0;
        if (s != size)
            return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL,
                               "struct %s[%zu]: struct_size %zu, but element 0's is %zu (one size per array)", name,
                               i, s, size);
        if ((r = check_size(p + i * size, size, known, size_1_0, name, err)) < 0)
            return r;
    }
    *stride = size;
    return 0;
}

void vramd__abi_elem(const void *arr, size_t stride, size_t i, size_t known, void *out)
{
    memset(out, 0, known);
    memcpy(out, (const unsigned char *)arr + i * stride, stride < known ? stride : known);
    uint32_t k = (uint32_t)known;
    memcpy(out, &k, sizeof k);
}

/* --- the choices ------------------------------------------------------------ */

static const char *const backends[] = {[VRAMD_BACKEND_PROCMEM] = "procmem", [VRAMD_BACKEND_MMAP] = "mmap",
                                       [VRAMD_BACKEND_SDMA] = "sdma"};
static const char *const compressions[] = {[VRAMD_COMPRESSION_NONE] = "none", [VRAMD_COMPRESSION_ZSTD] = "zstd",
                                           [VRAMD_COMPRESSION_BPLANES] = "bplanes",
                                           [VRAMD_COMPRESSION_AUTO] = "auto"};

const char *vramd_backend_name(int backend)
{
    if (backend <= 0 || (size_t)backend >= sizeof backends / sizeof backends[0])
        return NULL;
    return backends[backend];
}

const char *vramd_compression_name(int compression)
{
    if (compression <= 0 || (size_t)compression >= sizeof compressions / sizeof compressions[0])
        return NULL;
    return compressions[compression];
}

int vramd__backend_of(const char *str, int kind, const char **out, const char *what, struct vramd_error *err)
{
    const char *name = vramd_backend_name(kind);
    bool has_str = str && *str;
    *out = has_str ? str : NULL;
    if (kind == VRAMD_BACKEND_AUTO)
        return 0;
    if (!name)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "%s: backend_kind %d (enum vramd_backend: 0 to 3)", what,
                           kind);
    if (has_str && strcmp(str, name) != 0)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "%s: backend \"%.32s\" and backend_kind %s disagree", what,
                           str, name);
    *out = name;
    return 0;
}

/* "mode[:level]" as its mode (into mode[16]) and level (1, the daemon's default, when absent): 0 or -EINVAL. */
static int parse_compression(const char *s, char mode[16], long *level)
{
    size_t n = strcspn(s, ":");
    if (n == 0 || n >= 16)
        return -EINVAL;
    memcpy(mode, s, n);
    mode[n] = '\0';
    *level = 1;
    if (!s[n])
        return 0;
    char *end;
    errno = 0;
    *level = strtol(s + n + 1, &end, 10);
    return errno || end == s + n + 1 || *end ? -EINVAL : 0;
}

int vramd__compression_of(const char *str, int kind, int level, char buf[32], const char **out,
                          struct vramd_error *err)
{
    const char *name = vramd_compression_name(kind);
    bool has_str = str && *str;
    *out = has_str ? str : NULL;
    if (kind == VRAMD_COMPRESSION_DEFAULT && level == 0)
        return 0;
    if (kind == VRAMD_COMPRESSION_DEFAULT)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "compression_level %d without a compression_kind", level);
    if (!name)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "compression_kind %d (enum vramd_compression: 0 to 4)",
                           kind);
    if (level && kind == VRAMD_COMPRESSION_NONE)
        return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "compression_level %d with compression none", level);
    if (level)
        snprintf(buf, 32, "%s:%d", name, level);
    else
        snprintf(buf, 32, "%s", name);
    if (has_str) {
        char mode[16];
        long str_level;
        bool agree = parse_compression(str, mode, &str_level) == 0 && strcmp(mode, name) == 0 &&
                     (kind == VRAMD_COMPRESSION_NONE ? strcmp(str, "none") == 0 : str_level == (level ? level : 1));
        if (!agree)
            return vramd__fail(err, -EINVAL, VRAMD_CODE_LOCAL, "compression \"%.32s\" and compression_kind %s disagree",
                               str, buf);
    }
    *out = buf;
    return 0;
}

/* --- initialisers ------------------------------------------------------------ */

void vramd_options_init(struct vramd_options *opts)
{
    if (opts)
        *opts = (struct vramd_options)VRAMD_OPTIONS_INIT;
}

void vramd_open_args_init(struct vramd_open_args *args)
{
    if (args)
        *args = (struct vramd_open_args)VRAMD_OPEN_ARGS_INIT;
}

void vramd_bo_init(struct vramd_bo *bo)
{
    if (bo)
        *bo = (struct vramd_bo)VRAMD_BO_INIT;
}
