/*
 * vramd_model.h - model-only entry points of libdrm_amdgpu_model.so.
 *
 * THIS IS A SOFTWARE MODEL of libdrm_amdgpu + the SDMA engine, written for
 * vramd's tests.  It is not a GPU, not a driver and not libdrm.  Nothing it
 * counts is a hardware number.  See docs/sdma-model.md.
 *
 * These functions exist only in the model; the real libdrm_amdgpu has no such
 * symbols, so code that calls them must look them up with dlsym() and treat a
 * missing symbol as "running on real libdrm".
 */
#ifndef VRAMD_MODEL_H
#define VRAMD_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include <amdgpu.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Indices into the arrays filled by vramd_model_stats / vramd_model_stats_ex. */
enum vramd_model_stat {
	VRAMD_MODEL_STAT_PACKETS = 0,      /* packets executed without error (NOP + COPY_LINEAR) */
	VRAMD_MODEL_STAT_BYTES = 1,        /* bytes copied by COPY_LINEAR packets */
	VRAMD_MODEL_STAT_FAULTS = 2,       /* modelled VM faults (job stopped, context guilty) */
	VRAMD_MODEL_STAT_INVALID = 3,      /* invalid / unsupported packets or IBs (job stopped, context guilty) */
	VRAMD_MODEL_STAT_JOBS_DONE = 4,    /* jobs whose fence signalled (any outcome) */
	VRAMD_MODEL_STAT_JOBS_SKIPPED = 5, /* queued jobs not run because their context was already guilty */
	VRAMD_MODEL_STAT_MAX_BUSY = 6,     /* most engine threads ever running jobs at the same time */
	VRAMD_MODEL_STAT_REJECTED = 7,     /* amdgpu_cs_submit calls refused with an error */
	VRAMD_MODEL_STAT_COUNT = 8
};

/* out[0..3] = packets executed, bytes copied, faults, invalid packets.
 * Returns 0, or -EINVAL for a bad handle / NULL out. MODEL-ONLY. */
int vramd_model_stats(amdgpu_device_handle dev, uint64_t out[4]);

/* Fills out[0..min(n, VRAMD_MODEL_STAT_COUNT)-1] (see enum above); returns
 * the number of entries written, or -EINVAL. MODEL-ONLY. */
int vramd_model_stats_ex(amdgpu_device_handle dev, uint64_t *out, unsigned n);

/* Copies the text of the device's most recent fault / invalid-packet /
 * refused-call diagnosis ("" if none) into buf (NUL-terminated, truncated to
 * len). Returns 0, or -EINVAL. MODEL-ONLY. */
int vramd_model_last_error(amdgpu_device_handle dev, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* VRAMD_MODEL_H */
