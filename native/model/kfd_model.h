/*
 * kfd_model.h - the KFD MODEL: a software stand-in for the parts of the
 * amdkfd kernel driver (/dev/kfd) that CRIU's amdgpu plugin uses.
 *
 * THIS IS A MODEL, NOT A GPU and not a driver.  It keeps per-process GPUs and
 * BOs in a state directory shared by every process that attaches to it, and
 * answers the KFD ioctls (the uapi in <linux/kfd_ioctl.h>) with the kernel's
 * rules and errnos.  BO memory is a window of one sparse "arena" file per GPU:
 * the file that stands for the GPU's render node, so a process that mmaps its
 * render node at a BO's mmap_offset sees the BO, and a dmabuf the model
 * exports (a file name ending in "@<offset>+<size>") imports into the SDMA
 * model (libdrm_amdgpu_model.so) as exactly that window.  See docs/kfd-model.md.
 */
#ifndef VRAMD_KFD_MODEL_H
#define VRAMD_KFD_MODEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KFDM_MAX_GPUS 8
#define KFDM_MAX_PROCS 64
#define KFDM_MAX_BOS 16384

/* One emulated GPU: its KFD gpu_id, its render minor (the arena file is
 * <state dir>/renderD<minor>) and its VRAM capacity in bytes. */
struct kfdm_gpu {
	uint32_t gpu_id;
	uint32_t minor;
	uint64_t vram_size;
};

/* Operations, for counters and failure injection. */
enum kfdm_op {
	KFDM_OP_OPEN = 0,        /* open("/dev/kfd") */
	KFDM_OP_GET_VERSION,
	KFDM_OP_ACQUIRE_VM,
	KFDM_OP_ALLOC,
	KFDM_OP_FREE,
	KFDM_OP_PROCESS_INFO,
	KFDM_OP_CHECKPOINT,
	KFDM_OP_UNPAUSE,
	KFDM_OP_RESTORE,
	KFDM_OP_RESUME,
	KFDM_OP_QUEUE,           /* model-only: GPU work of the process (kfdm_queue_write) */
	KFDM_OP_COUNT
};

/* Counters beyond the per-op calls/failures. */
enum kfdm_stat {
	KFDM_STAT_DMABUFS = 0,       /* dmabuf fds exported (CHECKPOINT + RESTORE) */
	KFDM_STAT_PAUSED_REFUSED,    /* GPU work refused because the process's queues were paused */
	KFDM_STAT_BOS_LIVE,          /* BOs that exist now, all processes */
	KFDM_STAT_BYTES_LIVE,        /* their bytes */
	KFDM_STAT_PROCS_LIVE,        /* KFD processes that exist now */
	KFDM_STAT_COUNT
};

struct kfdm;

/* Creates a fresh state directory DIR (must exist and be empty): the shared
 * state file, one arena per GPU (renderD<minor>, sparse) and the kfd
 * stand-in file "kfd".  kfd_minor_version is what GET_VERSION answers (the
 * plugin needs >= 8).  Returns 0 or -errno. */
int kfdm_create(const char *dir, const struct kfdm_gpu *gpus, unsigned ngpus, unsigned kfd_minor_version);

/* Maps the state of DIR into this process.  NULL with errno on failure. */
struct kfdm *kfdm_attach(const char *dir);
void kfdm_detach(struct kfdm *m);
const char *kfdm_dir(const struct kfdm *m);

/* open("/dev/kfd") by the calling process: the process's KFD process (one per
 * process, as the kernel keeps one per mm; a second open gives the same one)
 * as a token, > 0.  Dead processes' KFD processes are released first.
 * Returns the token or -errno. */
int64_t kfdm_open(struct kfdm *m);

/* ioctl(fd, req, arg) on a /dev/kfd fd whose KFD process is TOKEN, made by
 * the calling process.  Returns 0 or -errno (the kernel's). */
int kfdm_ioctl(struct kfdm *m, int64_t token, unsigned long req, void *arg);

/* MODEL-ONLY: GPU work of the process behind TOKEN writes LEN bytes of SRC at
 * OFF into its BO HANDLE (as a kernel running on its queue would).  -EAGAIN
 * (and counted) while the process's queues are paused; -EINVAL for a bad
 * handle or range. */
int kfdm_queue_write(struct kfdm *m, int64_t token, uint64_t handle, uint64_t off,
		     const void *src, size_t len);

/* MODEL-ONLY: the next call of OP after SKIP successful ones fails with
 * -ERRNO_VALUE, COUNT times (0 = clear), before any side effect.  Shared by
 * every process attached to the state. */
int kfdm_inject(struct kfdm *m, enum kfdm_op op, int errno_value, unsigned skip, unsigned count);

/* MODEL-ONLY counters: calls[op], failures[op] (any error, injected or not),
 * stats[KFDM_STAT_*].  Any pointer may be NULL. */
void kfdm_counters(struct kfdm *m, uint64_t calls[KFDM_OP_COUNT], uint64_t fails[KFDM_OP_COUNT],
		   uint64_t stats[KFDM_STAT_COUNT]);

/* MODEL-ONLY: whether the KFD process of live pid PID has its queues paused
 * (1), running (0); -ESRCH if it has none. */
int kfdm_paused(struct kfdm *m, int pid);

const char *kfdm_op_name(enum kfdm_op op);

#ifdef __cplusplus
}
#endif

#endif /* VRAMD_KFD_MODEL_H */
