/*
 * amdgpu_model.c - a SOFTWARE MODEL of the parts of libdrm_amdgpu and of an
 * AMD SDMA engine that vramd's SDMA backend uses.
 *
 *   *** THIS IS A MODEL. IT IS NOT A GPU. ***
 *   Every number it produces (bytes/s, latencies, packet counts) is a model
 *   number, never a hardware number.  See docs/sdma-model.md.
 *
 * Written from public facts only (libdrm's amdgpu.h, which is included below
 * so the compiler checks every signature; the kernel's SDMA packet headers and
 * amdgpu_{cs,ctx,gem,vm,ttm}.c read as reference; CRIU's amdgpu plugin notes).
 * No code was copied from libdrm, the kernel, Mesa or CRIU.
 *
 * Concurrency: one process-wide mutex (G) guards every model data structure;
 * per-device condition variables wake engine threads and fence waiters.  The
 * only work done outside G is the byte copy of a COPY_LINEAR packet (and the
 * optional per-packet delay); the BOs it touches are pinned with internal
 * references while G is released.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Everything declared by these headers and defined here is exported; every
 * other symbol of this file is static or hidden (-fvisibility=hidden). */
#pragma GCC visibility push(default)
#include <amdgpu.h>
#include <amdgpu_drm.h>
#include "vramd_model.h"
#pragma GCC visibility pop

/* ------------------------------------------------------------------------ */
/* Constants (facts, with where they come from)                              */
/* ------------------------------------------------------------------------ */

#define MODEL_DRM_MAJOR 3           /* amdgpu KMS driver major version */
#define MODEL_DRM_MINOR 59          /* arbitrary recent minor; not a claim about a kernel */
#define CS_MAX_RINGS 8              /* libdrm's internal AMDGPU_CS_MAX_RINGS bound check */
#define DMA_ENTITIES 2              /* kernel amdgpu_ctx_num_entities[AMDGPU_HW_IP_DMA] */
#define MAX_ENGINES 32
#define SDMA_IB_ADDR_ALIGN 32       /* kernel masks the INDIRECT packet's IB base with ~0x1f */
#define SDMA_IB_START_ALIGN 256     /* reported by the kernel's hw_ip_info for DMA */
#define SDMA_IB_SIZE_ALIGN 4        /* reported by the kernel's hw_ip_info for DMA */
#define SDMA_OP_NOP 0
#define SDMA_OP_COPY 1
#define SDMA_SUBOP_COPY_LINEAR 0
#define COPY_LINEAR_DW 7

/* Max bytes per COPY_LINEAR packet = the kernel's buffer_funcs.copy_max_bytes. */
#define COPY_MAX_AI 0x400000ull     /* sdma_v4_0 .. v7 (count = bytes - 1, 22-bit field) */
#define COPY_MAX_VI 0x3fffe0ull     /* sdma_v3_0 (Tonga/Fiji/Polaris/Carrizo/Stoney) */
#define COPY_MAX_CI 0x1fffffull     /* cik_sdma (CI/KV); also sdma_v2_4 (Iceland/Topaz) */

/* The model's GPU VA layout (libdrm-like: a 32-bit range, a general range
 * above 4 GiB, and a "high" range in the upper half of a 48-bit space). */
#define VA_LOW_START 0x200000ull
#define VA_LOW_END 0x100000000ull
#define VA_GEN_START 0x100000000ull
#define VA_GEN_END 0x800000000000ull
#define VA_HIGH_START 0xffff800000000000ull
#define VA_HIGH_END 0xfffffffffffff000ull
#define VA_GUARD (1ull << 20)       /* unallocated gap kept around every VA range */

#define GRAVEYARD 1024              /* freed handle structs kept this long before free() */
#define REG_BUCKETS 4096

/* ------------------------------------------------------------------------ */
/* Types                                                                     */
/* ------------------------------------------------------------------------ */

enum htype { H_DEV = 1, H_BO, H_CTX, H_LIST, H_VA };
enum bo_kind { BO_IMPORT, BO_USERPTR, BO_ALLOC };
enum { ST_PACKETS, ST_BYTES, ST_FAULTS, ST_INVALID, ST_JOBS_DONE, ST_JOBS_SKIPPED,
       ST_MAX_BUSY, ST_REJECTED, ST_COUNT };

struct job;

struct engine {
	struct amdgpu_device *dev;
	unsigned idx;
	pthread_t th;
	bool started;
	pthread_cond_t cv;
	struct job *head, *tail;
	unsigned load;              /* jobs queued on or running on this engine */
};

struct mapping {
	uint64_t start, size, offset;
	struct amdgpu_bo *bo;
};

struct amdgpu_device {
	struct amdgpu_device *next; /* process-wide device list */
	int refs;
	dev_t key_dev;
	ino_t key_ino;
	int fd;

	/* configuration (read once, at the first amdgpu_device_initialize) */
	uint32_t family;
	unsigned nrings;
	uint64_t max_copy;
	char gpu_id[64];
	bool log, bo_list_check, reset_on_fault;
	unsigned delay_us;
	char copy_log[PATH_MAX];   /* VRAMD_SDMA_MODEL_COPY_LOG: a line per job, "" = off */

	/* GPU VA: allocated ranges (sorted by start) and mappings (sorted) */
	struct amdgpu_va **ranges;
	size_t nranges, cap_ranges;
	uint64_t cursor[3];
	struct mapping *maps;
	size_t nmaps, cap_maps;

	struct amdgpu_bo *imports;  /* imported dma-bufs, for handle reuse */

	struct engine eng[MAX_ENGINES];
	bool stop;
	pthread_cond_t fence_cv;
	unsigned busy_now;
	uint64_t reset_counter;
	uint32_t next_ctx_id;

	uint64_t st[ST_COUNT];
	char last_err[512];
};

struct amdgpu_bo {
	struct amdgpu_device *dev;
	enum bo_kind kind;
	uint8_t *cpu;
	uint64_t size;              /* page-rounded size the GPU sees */
	uint64_t alloc_size;        /* what libdrm reports */
	uint64_t map_len;           /* bytes to munmap (IMPORT/ALLOC) */
	int urefs;                  /* libdrm handle references (import reuse) */
	int irefs;                  /* model-internal: bo lists, jobs, running copies */
	unsigned cpu_map_count;
	bool readonly;              /* imported fd could only be mapped read-only */
	dev_t key_dev;
	ino_t key_ino;
	uint64_t key_off;           /* window start for a KFD model dmabuf (docs/kfd-model.md), else 0 */
	struct amdgpu_bo *next_import;
	bool in_imports;
	int memfd;                  /* BO_ALLOC in VRAM: the memfd that stands for its dmabuf, else -1 */
};

struct amdgpu_va {
	struct amdgpu_device *dev;
	uint64_t start, size;
};

struct entity {
	uint64_t last_seq;          /* last seq_no handed out */
	uint64_t done_seq;          /* every job with seq <= done_seq has signalled */
	int engine;                 /* engine the entity is bound to while busy */
	unsigned pending;
};

struct amdgpu_context {
	struct amdgpu_device *dev;
	uint32_t id;
	int refs;                   /* user handle + queued jobs + waiters + dependants */
	bool user_alive;
	bool guilty;
	uint64_t reset_seen;
	struct entity ent[DMA_ENTITIES];
};

struct amdgpu_bo_list {
	struct amdgpu_device *dev;
	uint32_t n;
	struct amdgpu_bo **bos;
};

struct dep {
	struct amdgpu_context *ctx;
	unsigned ring;
	uint64_t seq;
};

struct ib {
	uint32_t *dw;
	uint32_t ndw;
	uint64_t va;
	struct amdgpu_bo *bo;       /* holds an iref */
};

struct job {
	struct job *next;
	struct amdgpu_context *ctx; /* holds a ctx ref */
	unsigned ring;
	uint64_t seq;
	unsigned nib;
	struct ib ib[AMDGPU_CS_MAX_IBS_PER_SUBMIT];
	bool has_list;
	uint32_t nbos;
	struct amdgpu_bo **bos;     /* snapshot of the bo_list, each holds an iref */
	struct amdgpu_bo *fence_bo; /* holds an iref */
	uint64_t fence_off;
	uint32_t ndeps;
	struct dep *deps;           /* each holds a ctx ref */
};

/* ------------------------------------------------------------------------ */
/* Process-wide state                                                        */
/* ------------------------------------------------------------------------ */

static pthread_mutex_t G = PTHREAD_MUTEX_INITIALIZER;

struct reg_node {
	struct reg_node *next;
	const void *p;
	int type;
	struct amdgpu_device *dev;
};
static struct reg_node *g_reg[REG_BUCKETS];
static struct amdgpu_device *g_devs;
static void *g_grave[GRAVEYARD];
static unsigned g_grave_pos;

static unsigned reg_hash(const void *p)
{
	uintptr_t v = (uintptr_t)p;
	v ^= v >> 17;
	v *= 0x9e3779b97f4a7c15ull;
	return (unsigned)(v >> 40) % REG_BUCKETS;
}

static int reg_add(const void *p, int type, struct amdgpu_device *dev)
{
	struct reg_node *n = malloc(sizeof(*n));
	if (!n)
		return -ENOMEM;
	unsigned h = reg_hash(p);
	n->p = p;
	n->type = type;
	n->dev = dev;
	n->next = g_reg[h];
	g_reg[h] = n;
	return 0;
}

static struct reg_node *reg_find(const void *p)
{
	if (!p)
		return NULL;
	for (struct reg_node *n = g_reg[reg_hash(p)]; n; n = n->next)
		if (n->p == p)
			return n;
	return NULL;
}

static void reg_del(const void *p)
{
	struct reg_node **pp = &g_reg[reg_hash(p)];
	while (*pp) {
		if ((*pp)->p == p) {
			struct reg_node *n = *pp;
			*pp = n->next;
			free(n);
			return;
		}
		pp = &(*pp)->next;
	}
}

/* Freed handle structs are parked before free() so that a stale handle is
 * not soon reused by malloc for a new object and mistaken for it. */
static void grave_free(void *p)
{
	free(g_grave[g_grave_pos]);
	g_grave[g_grave_pos] = p;
	g_grave_pos = (g_grave_pos + 1) % GRAVEYARD;
}

static uint64_t page_size(void)
{
	long v = sysconf(_SC_PAGESIZE);
	return v > 0 ? (uint64_t)v : 4096;
}

static uint64_t round_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) & ~(a - 1);
}

/* ------------------------------------------------------------------------ */
/* Diagnostics                                                               */
/* ------------------------------------------------------------------------ */

static void note(struct amdgpu_device *d, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Records a diagnosis as the device's last error and, if VRAMD_SDMA_MODEL_LOG
 * is set, prints it as one line on stderr.  Called with G held. */
static void note(struct amdgpu_device *d, const char *fmt, ...)
{
	char msg[sizeof(d->last_err)];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (!d)
		return;
	memcpy(d->last_err, msg, sizeof(msg));
	if (d->log)
		fprintf(stderr, "amdgpu-MODEL[gpu %s family %u]: %s\n",
			d->gpu_id[0] ? d->gpu_id : "?", d->family, msg);
}

/* A call made with a handle the model does not know (never created, freed,
 * or from a deinitialized device).  Real libdrm would dereference it. */
static int bad_handle(const char *fn, const void *h)
{
	if (getenv("VRAMD_SDMA_MODEL_LOG"))
		fprintf(stderr, "amdgpu-MODEL: %s: unknown, freed or wrong-type handle %p\n", fn, h);
	return -EINVAL;
}

static struct amdgpu_device *lookup(const void *h, int type)
{
	struct reg_node *n = reg_find(h);
	return (n && n->type == type) ? n->dev : NULL;
}

/* ------------------------------------------------------------------------ */
/* BO lifetime                                                               */
/* ------------------------------------------------------------------------ */

static void bo_destroy(struct amdgpu_bo *bo)
{
	if (bo->kind != BO_USERPTR && bo->cpu && bo->map_len)
		munmap(bo->cpu, bo->map_len);
	if (bo->kind == BO_ALLOC && bo->memfd >= 0)
		close(bo->memfd);
	grave_free(bo);
}

/* Drops an internal reference; the BO's memory goes when no user handle and
 * no internal reference remain.  G held. */
static void bo_iput(struct amdgpu_bo *bo)
{
	if (--bo->irefs == 0 && bo->urefs == 0)
		bo_destroy(bo);
}

static void remove_import(struct amdgpu_device *d, struct amdgpu_bo *bo)
{
	if (!bo->in_imports)
		return;
	for (struct amdgpu_bo **pp = &d->imports; *pp; pp = &(*pp)->next_import) {
		if (*pp == bo) {
			*pp = bo->next_import;
			break;
		}
	}
	bo->in_imports = false;
}

static void remove_bo_mappings(struct amdgpu_device *d, struct amdgpu_bo *bo)
{
	size_t w = 0;
	for (size_t r = 0; r < d->nmaps; r++)
		if (d->maps[r].bo != bo)
			d->maps[w++] = d->maps[r];
	d->nmaps = w;
}

/* ------------------------------------------------------------------------ */
/* GPU VA: mappings                                                          */
/* ------------------------------------------------------------------------ */

/* Index of the last mapping with start <= va, or -1. */
static ssize_t map_floor(struct amdgpu_device *d, uint64_t va)
{
	ssize_t lo = 0, hi = (ssize_t)d->nmaps - 1, ans = -1;
	while (lo <= hi) {
		ssize_t mid = lo + (hi - lo) / 2;
		if (d->maps[mid].start <= va) {
			ans = mid;
			lo = mid + 1;
		} else {
			hi = mid - 1;
		}
	}
	return ans;
}

static struct mapping *map_find(struct amdgpu_device *d, uint64_t va)
{
	ssize_t i = map_floor(d, va);
	if (i < 0)
		return NULL;
	struct mapping *m = &d->maps[i];
	return (va - m->start < m->size) ? m : NULL;
}

static bool map_overlaps(struct amdgpu_device *d, uint64_t start, uint64_t size)
{
	ssize_t i = map_floor(d, start + size - 1);
	if (i < 0)
		return false;
	struct mapping *m = &d->maps[i];
	return m->start + m->size > start;
}

static int map_insert(struct amdgpu_device *d, struct mapping m)
{
	if (d->nmaps == d->cap_maps) {
		size_t cap = d->cap_maps ? d->cap_maps * 2 : 64;
		struct mapping *n = realloc(d->maps, cap * sizeof(*n));
		if (!n)
			return -ENOMEM;
		d->maps = n;
		d->cap_maps = cap;
	}
	size_t pos = (size_t)(map_floor(d, m.start) + 1);
	memmove(&d->maps[pos + 1], &d->maps[pos], (d->nmaps - pos) * sizeof(*d->maps));
	d->maps[pos] = m;
	d->nmaps++;
	return 0;
}

/* ------------------------------------------------------------------------ */
/* GPU VA: ranges (amdgpu_va_range_alloc)                                    */
/* ------------------------------------------------------------------------ */

static bool range_free_at(struct amdgpu_device *d, uint64_t start, uint64_t size, uint64_t guard)
{
	uint64_t lo = start >= guard ? start - guard : 0;
	uint64_t hi = start + size + guard < start + size ? UINT64_MAX : start + size + guard;
	for (size_t i = 0; i < d->nranges; i++) {
		struct amdgpu_va *r = d->ranges[i];
		if (r->start < hi && r->start + r->size > lo)
			return false;
	}
	return true;
}

/* First fit after a rotating cursor (next fit), so that freed VA is not
 * handed out again at once: a stale address then tends to hit unmapped VA. */
static uint64_t range_find(struct amdgpu_device *d, int region, uint64_t lo, uint64_t hi,
			   uint64_t size, uint64_t align)
{
	for (int pass = 0; pass < 2; pass++) {
		uint64_t from = pass == 0 ? (d->cursor[region] > lo ? d->cursor[region] : lo) : lo;
		uint64_t cand = round_up(from, align);
		while (cand >= from && cand < hi && hi - cand >= size) {
			/* find the first range that conflicts with [cand-G, cand+size+G) */
			struct amdgpu_va *hit = NULL;
			uint64_t clo = cand >= VA_GUARD ? cand - VA_GUARD : 0;
			uint64_t chi = cand + size + VA_GUARD;
			if (chi < cand)
				chi = UINT64_MAX;
			for (size_t i = 0; i < d->nranges; i++) {
				struct amdgpu_va *r = d->ranges[i];
				if (r->start < chi && r->start + r->size > clo) {
					hit = r;
					break;
				}
			}
			if (!hit) {
				d->cursor[region] = cand + size + VA_GUARD;
				return cand;
			}
			uint64_t next = round_up(hit->start + hit->size + VA_GUARD, align);
			if (next <= cand)
				break;
			cand = next;
		}
	}
	return 0;
}

static int range_insert(struct amdgpu_device *d, struct amdgpu_va *va)
{
	if (d->nranges == d->cap_ranges) {
		size_t cap = d->cap_ranges ? d->cap_ranges * 2 : 64;
		struct amdgpu_va **n = realloc(d->ranges, cap * sizeof(*n));
		if (!n)
			return -ENOMEM;
		d->ranges = n;
		d->cap_ranges = cap;
	}
	size_t pos = 0;
	while (pos < d->nranges && d->ranges[pos]->start < va->start)
		pos++;
	memmove(&d->ranges[pos + 1], &d->ranges[pos], (d->nranges - pos) * sizeof(*d->ranges));
	d->ranges[pos] = va;
	d->nranges++;
	return 0;
}

static void range_remove(struct amdgpu_device *d, struct amdgpu_va *va)
{
	for (size_t i = 0; i < d->nranges; i++) {
		if (d->ranges[i] == va) {
			memmove(&d->ranges[i], &d->ranges[i + 1], (d->nranges - i - 1) * sizeof(*d->ranges));
			d->nranges--;
			return;
		}
	}
}

/* ------------------------------------------------------------------------ */
/* Contexts and jobs                                                         */
/* ------------------------------------------------------------------------ */

static void ctx_put(struct amdgpu_context *c)
{
	if (--c->refs == 0)
		grave_free(c);
}

static void job_free(struct job *j)
{
	for (unsigned i = 0; i < j->nib; i++) {
		free(j->ib[i].dw);
		if (j->ib[i].bo)
			bo_iput(j->ib[i].bo);
	}
	for (uint32_t i = 0; i < j->nbos; i++)
		bo_iput(j->bos[i]);
	free(j->bos);
	if (j->fence_bo)
		bo_iput(j->fence_bo);
	for (uint32_t i = 0; i < j->ndeps; i++)
		ctx_put(j->deps[i].ctx);
	free(j->deps);
	if (j->ctx)
		ctx_put(j->ctx);
	free(j);
}

static bool job_has_bo(struct job *j, struct amdgpu_bo *bo)
{
	for (uint32_t i = 0; i < j->nbos; i++)
		if (j->bos[i] == bo)
			return true;
	return false;
}

static const char *op_name(unsigned op)
{
	static const char *names[] = {
		"NOP", "COPY", "WRITE", "op3", "INDIRECT", "FENCE", "TRAP", "SEM", "POLL_REGMEM",
		"COND_EXE", "ATOMIC", "CONST_FILL", "PTEPDE", "TIMESTAMP", "SRBM_WRITE", "PRE_EXE",
		"DUMMY_TRAP",
	};
	return op < sizeof(names) / sizeof(names[0]) ? names[op] : "unknown";
}

enum { EX_OK = 0, EX_FAULT, EX_INVALID };

/* Marks the job's context guilty after a fault / invalid packet.  G held. */
static void job_failed(struct amdgpu_device *d, struct job *j, int kind)
{
	j->ctx->guilty = true;
	if (d->reset_on_fault)
		d->reset_counter++;
	d->st[kind == EX_FAULT ? ST_FAULTS : ST_INVALID]++;
}

#define JOB_TAG "ctx %u ring %u seq %" PRIu64 " ib %u dw %u"

/* Resolves a packet's GPU byte range to host memory.  G held.  On success
 * the BO gets an internal reference the caller must drop. */
static int translate(struct amdgpu_device *d, struct job *j, const char *what, uint64_t va,
		     uint64_t len, bool write, struct amdgpu_bo **bo_out, uint8_t **ptr_out,
		     char *why, size_t whylen)
{
	struct mapping *m = map_find(d, va);
	if (!m) {
		snprintf(why, whylen, "%s 0x%" PRIx64 " is not mapped in the GPU VM", what, va);
		return EX_FAULT;
	}
	uint64_t end = va + len;
	if (end < va || end > m->start + m->size) {
		snprintf(why, whylen,
			 "%s range [0x%" PRIx64 ", 0x%" PRIx64 ") runs past the end of its mapping "
			 "[0x%" PRIx64 ", 0x%" PRIx64 ") by %" PRIu64 " byte(s)",
			 what, va, end, m->start, m->start + m->size,
			 end < va ? UINT64_MAX : end - (m->start + m->size));
		return EX_FAULT;
	}
	struct amdgpu_bo *bo = m->bo;
	if (d->bo_list_check) {
		if (!j->has_list) {
			snprintf(why, whylen,
				 "%s 0x%" PRIx64 ": the submission has no bo_list, so the BO is not "
				 "validated/resident for this job (VRAMD_SDMA_MODEL_BO_LIST_CHECK=0 "
				 "disables this check)", what, va);
			return EX_FAULT;
		}
		if (!job_has_bo(j, bo)) {
			snprintf(why, whylen,
				 "%s 0x%" PRIx64 ": its BO is not in the submission's bo_list, so it is "
				 "not validated/resident for this job", what, va);
			return EX_FAULT;
		}
	}
	if (write && bo->readonly) {
		snprintf(why, whylen,
			 "%s 0x%" PRIx64 ": MODEL LIMITATION: the imported dma-buf fd could only be "
			 "mmapped read-only, so the model cannot write it (hardware would)", what, va);
		return EX_FAULT;
	}
	bo->irefs++;
	*bo_out = bo;
	*ptr_out = bo->cpu + m->offset + (va - m->start);
	return EX_OK;
}

/* Executes one job.  Called WITHOUT G; takes G around every VM lookup. */
/* VRAMD_SDMA_MODEL_COPY_LOG: appends "<pid> <bytes> <ns>" for a job, ns being the CPU time the
 * engine thread spent in the job's copies (CLOCK_THREAD_CPUTIME_ID: what an engine would not
 * cost the host).  Opened per line (O_APPEND: lines of several processes do not mix), so no fd
 * stays open in a process CRIU restores. */
static void log_copies(struct amdgpu_device *d, uint64_t bytes, uint64_t ns)
{
	int fd = open(d->copy_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	char line[96];
	int n = snprintf(line, sizeof(line), "%d %" PRIu64 " %" PRIu64 "\n", (int)getpid(), bytes, ns);
	if (write(fd, line, (size_t)n) != n && d->log)
		fprintf(stderr, "sdma model: %s: short write\n", d->copy_log);
	close(fd);
}

static void run_job(struct amdgpu_device *d, struct job *j)
{
	uint64_t packets = 0, bytes = 0, copy_ns = 0;
	struct timespec c0, c1;
	char why[320], pkt[160] = "";
	int res = EX_OK;
	unsigned k = 0;
	uint32_t i = 0;

	for (k = 0; k < j->nib && res == EX_OK; k++) {
		struct ib *ib = &j->ib[k];
		const uint32_t *dw = ib->dw;
		i = 0;
		if (ib->va & (SDMA_IB_ADDR_ALIGN - 1)) {
			snprintf(why, sizeof(why),
				 "IB address 0x%" PRIx64 " is not 32-byte aligned; the kernel's INDIRECT "
				 "packet drops the low 5 bits, so the engine would fetch other dwords",
				 ib->va);
			res = EX_INVALID;
			break;
		}
		if (ib->ndw % 8) {
			snprintf(why, sizeof(why),
				 "IB size %u dwords is not a multiple of 8 (pad with NOPs)", ib->ndw);
			res = EX_INVALID;
			break;
		}
		if (d->family < AMDGPU_FAMILY_CI && ib->ndw) {
			snprintf(why, sizeof(why),
				 "family %u (SI) uses the SI DMA packet format, which is not modelled",
				 d->family);
			res = EX_INVALID;
			break;
		}
		if (d->bo_list_check && (!j->has_list || !job_has_bo(j, ib->bo))) {
			snprintf(why, sizeof(why),
				 "IB at 0x%" PRIx64 ": its BO is not in the submission's bo_list",
				 ib->va);
			res = EX_FAULT;
			break;
		}
		while (i < ib->ndw) {
			uint32_t h = dw[i];
			unsigned op = h & 0xff, sub = (h >> 8) & 0xff;
			if (op == SDMA_OP_NOP) {
				unsigned cnt = (h >> 16) & 0x3fff;
				if (sub != 0 || (h >> 30)) {
					snprintf(why, sizeof(why),
						 "NOP header 0x%08x has a non-zero sub_op or reserved bits", h);
					res = EX_INVALID;
					break;
				}
				if ((uint64_t)i + 1 + cnt > ib->ndw) {
					snprintf(why, sizeof(why),
						 "NOP with count %u runs past the end of the IB (%u dwords)",
						 cnt, ib->ndw);
					res = EX_INVALID;
					break;
				}
				i += 1 + cnt;
				packets++;
				continue;
			}
			if (op != SDMA_OP_COPY || sub != SDMA_SUBOP_COPY_LINEAR) {
				snprintf(why, sizeof(why),
					 "opcode %u (%s) sub_op %u (header 0x%08x) is not modelled "
					 "(only NOP and COPY_LINEAR are)", op, op_name(op), sub, h);
				res = EX_INVALID;
				break;
			}
			if ((uint64_t)i + COPY_LINEAR_DW > ib->ndw) {
				snprintf(why, sizeof(why),
					 "COPY_LINEAR cut by the end of the IB (%u of 7 dwords present)",
					 ib->ndw - i);
				res = EX_INVALID;
				break;
			}
			if (h >> 16) {
				snprintf(why, sizeof(why),
					 "COPY_LINEAR header 0x%08x sets encrypt/TMZ/broadcast/reserved bits, "
					 "which are not modelled", h);
				res = EX_INVALID;
				break;
			}
			uint32_t count = dw[i + 1], param = dw[i + 2];
			uint64_t src = dw[i + 3] | (uint64_t)dw[i + 4] << 32;
			uint64_t dst = dw[i + 5] | (uint64_t)dw[i + 6] << 32;
			if (param) {
				snprintf(why, sizeof(why),
					 "COPY_LINEAR parameter dword 0x%08x is not 0 (endian swap / cache "
					 "policy bits are not modelled)", param);
				res = EX_INVALID;
				break;
			}
			uint64_t n;
			if (d->family >= AMDGPU_FAMILY_AI) {
				n = (uint64_t)count + 1;  /* SDMA v4+: count field = bytes - 1 */
			} else {
				if (count == 0) {
					snprintf(why, sizeof(why),
						 "COPY_LINEAR count 0 on a pre-AI family (count = bytes there)");
					res = EX_INVALID;
					break;
				}
				n = count;               /* CIK/VI SDMA: count field = bytes */
			}
			if (n > d->max_copy) {
				snprintf(why, sizeof(why),
					 "COPY_LINEAR of %" PRIu64 " bytes (count field %u) exceeds the max "
					 "%" PRIu64 " bytes per packet", n, count, d->max_copy);
				res = EX_INVALID;
				break;
			}
			struct amdgpu_bo *sbo = NULL, *dbo = NULL;
			uint8_t *sp = NULL, *dp = NULL;
			pthread_mutex_lock(&G);
			res = translate(d, j, "src", src, n, false, &sbo, &sp, why, sizeof(why));
			if (res == EX_OK) {
				res = translate(d, j, "dst", dst, n, true, &dbo, &dp, why, sizeof(why));
				if (res != EX_OK)
					bo_iput(sbo);
			}
			pthread_mutex_unlock(&G);
			if (res != EX_OK) {
				snprintf(pkt, sizeof(pkt), "COPY_LINEAR src=0x%" PRIx64 " dst=0x%" PRIx64
					 " bytes=%" PRIu64 " (count field %u): ", src, dst, n, count);
				break;
			}
			if ((uintptr_t)sp < (uintptr_t)dp + n && (uintptr_t)dp < (uintptr_t)sp + n) {
				pthread_mutex_lock(&G);
				bo_iput(sbo);
				bo_iput(dbo);
				pthread_mutex_unlock(&G);
				snprintf(why, sizeof(why),
					 "COPY_LINEAR src=0x%" PRIx64 " dst=0x%" PRIx64 " bytes=%" PRIu64
					 ": source and destination overlap in memory (undefined on hardware)",
					 src, dst, n);
				res = EX_INVALID;
				break;
			}
			if (d->delay_us)
				usleep(d->delay_us);
			if (d->copy_log[0])
				clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
			memcpy(dp, sp, n);
			if (d->copy_log[0]) {
				clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
				copy_ns += (uint64_t)(c1.tv_sec - c0.tv_sec) * 1000000000u +
					   (uint64_t)c1.tv_nsec - (uint64_t)c0.tv_nsec;
			}
			pthread_mutex_lock(&G);
			bo_iput(sbo);
			bo_iput(dbo);
			pthread_mutex_unlock(&G);
			packets++;
			bytes += n;
			i += COPY_LINEAR_DW;
		}
		if (res != EX_OK)
			break;
	}

	if (d->copy_log[0] && bytes)
		log_copies(d, bytes, copy_ns);
	pthread_mutex_lock(&G);
	d->st[ST_PACKETS] += packets;
	d->st[ST_BYTES] += bytes;
	if (res != EX_OK) {
		job_failed(d, j, res);
		note(d, "%s " JOB_TAG ": %s%s; job stopped, nothing of this packet copied, context "
		     "marked guilty", res == EX_FAULT ? "VM FAULT" : "INVALID PACKET",
		     j->ctx->id, j->ring, j->seq, k, i, pkt, why);
	} else if (j->fence_bo) {
		__atomic_store_n((uint64_t *)(j->fence_bo->cpu + j->fence_off), j->seq,
				 __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&G);
}

static void *engine_main(void *arg)
{
	struct engine *e = arg;
	struct amdgpu_device *d = e->dev;

	pthread_mutex_lock(&G);
	for (;;) {
		while (!e->head && !d->stop)
			pthread_cond_wait(&e->cv, &G);
		if (!e->head)
			break;
		struct job *j = e->head;
		e->head = j->next;
		if (!e->head)
			e->tail = NULL;

		/* dependencies always name earlier submissions, so this cannot deadlock */
		for (uint32_t i = 0; i < j->ndeps; i++)
			while (j->deps[i].ctx->ent[j->deps[i].ring].done_seq < j->deps[i].seq)
				pthread_cond_wait(&d->fence_cv, &G);

		bool skip = j->ctx->guilty;
		if (skip) {
			d->st[ST_JOBS_SKIPPED]++;
		} else {
			d->busy_now++;
			if (d->busy_now > d->st[ST_MAX_BUSY])
				d->st[ST_MAX_BUSY] = d->busy_now;
			pthread_mutex_unlock(&G);
			run_job(d, j);
			pthread_mutex_lock(&G);
			d->busy_now--;
		}
		struct entity *ent = &j->ctx->ent[j->ring];
		ent->done_seq = j->seq;
		ent->pending--;
		e->load--;
		d->st[ST_JOBS_DONE]++;
		job_free(j);
		pthread_cond_broadcast(&d->fence_cv);
	}
	pthread_mutex_unlock(&G);
	return NULL;
}

/* ------------------------------------------------------------------------ */
/* Configuration                                                             */
/* ------------------------------------------------------------------------ */

static int env_u64(const char *name, uint64_t def, uint64_t lo, uint64_t hi, uint64_t *out)
{
	const char *s = getenv(name);
	if (!s || !*s) {
		*out = def;
		return 0;
	}
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || *end || v < lo || v > hi || s[0] == '-') {
		fprintf(stderr, "amdgpu-MODEL: %s=%s is invalid (want %" PRIu64 "..%" PRIu64 ")\n",
			name, s, lo, hi);
		return -EINVAL;
	}
	*out = v;
	return 0;
}

static bool env_flag(const char *name, bool def)
{
	const char *s = getenv(name);
	if (!s)
		return def;
	return *s && strcmp(s, "0") != 0;
}

static uint64_t default_max_copy(uint32_t family)
{
	if (family >= AMDGPU_FAMILY_AI)
		return COPY_MAX_AI;
	if (family >= AMDGPU_FAMILY_VI)
		return COPY_MAX_VI;
	return COPY_MAX_CI;
}

static int read_config(struct amdgpu_device *d)
{
	uint64_t v;
	if (env_u64("VRAMD_SDMA_MODEL_FAMILY", AMDGPU_FAMILY_AI, 1, UINT32_MAX, &v))
		return -EINVAL;
	d->family = (uint32_t)v;
	if (env_u64("VRAMD_SDMA_MODEL_RINGS", 2, 1, MAX_ENGINES, &v))
		return -EINVAL;
	d->nrings = (unsigned)v;
	if (env_u64("VRAMD_SDMA_MODEL_MAX_COPY", default_max_copy(d->family), 1, 1ull << 32, &v))
		return -EINVAL;
	d->max_copy = v;
	if (env_u64("VRAMD_SDMA_MODEL_PACKET_DELAY_US", 0, 0, 1000000, &v))
		return -EINVAL;
	d->delay_us = (unsigned)v;
	const char *g = getenv("VRAMD_SDMA_MODEL_GPU_ID");
	snprintf(d->gpu_id, sizeof(d->gpu_id), "%s", g ? g : "");
	d->log = env_flag("VRAMD_SDMA_MODEL_LOG", false);
	d->bo_list_check = env_flag("VRAMD_SDMA_MODEL_BO_LIST_CHECK", true);
	d->reset_on_fault = env_flag("VRAMD_SDMA_MODEL_RESET_ON_FAULT", true);
	const char *cl = getenv("VRAMD_SDMA_MODEL_COPY_LOG");
	snprintf(d->copy_log, sizeof(d->copy_log), "%s", cl ? cl : "");
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Device                                                                    */
/* ------------------------------------------------------------------------ */

static void dev_free_struct(struct amdgpu_device *d)
{
	for (unsigned i = 0; i < MAX_ENGINES; i++)
		pthread_cond_destroy(&d->eng[i].cv);
	pthread_cond_destroy(&d->fence_cv);
	if (d->fd >= 0)
		close(d->fd);
	free(d->ranges);
	free(d->maps);
	grave_free(d);
}

int amdgpu_device_initialize(int fd, uint32_t *major_version, uint32_t *minor_version,
			     amdgpu_device_handle *device_handle)
{
	struct stat stt;
	if (!major_version || !minor_version || !device_handle)
		return -EINVAL;
	if (fstat(fd, &stt) < 0)
		return -errno;

	pthread_mutex_lock(&G);
	for (struct amdgpu_device *d = g_devs; d; d = d->next) {
		if (d->key_dev == stt.st_dev && d->key_ino == stt.st_ino) {
			/* libdrm hands out one refcounted handle per device */
			d->refs++;
			*major_version = MODEL_DRM_MAJOR;
			*minor_version = MODEL_DRM_MINOR;
			*device_handle = d;
			pthread_mutex_unlock(&G);
			return 0;
		}
	}

	struct amdgpu_device *d = calloc(1, sizeof(*d));
	int r = -ENOMEM;
	if (!d)
		goto out;
	d->fd = -1;
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&d->fence_cv, &ca);
	for (unsigned i = 0; i < MAX_ENGINES; i++) {
		pthread_cond_init(&d->eng[i].cv, NULL);
		d->eng[i].dev = d;
		d->eng[i].idx = i;
	}
	pthread_condattr_destroy(&ca);
	r = read_config(d);
	if (r)
		goto fail;
	d->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (d->fd < 0) {
		r = -errno;
		goto fail;
	}
	d->refs = 1;
	d->key_dev = stt.st_dev;
	d->key_ino = stt.st_ino;
	d->cursor[0] = VA_LOW_START;
	d->cursor[1] = VA_GEN_START;
	d->cursor[2] = VA_HIGH_START;
	d->next_ctx_id = 1;
	r = reg_add(d, H_DEV, d);
	if (r)
		goto fail;
	for (unsigned i = 0; i < d->nrings; i++) {
		if (pthread_create(&d->eng[i].th, NULL, engine_main, &d->eng[i])) {
			r = -EAGAIN;
			d->stop = true;
			for (unsigned k = 0; k < i; k++)
				pthread_cond_broadcast(&d->eng[k].cv);
			reg_del(d);
			pthread_mutex_unlock(&G);
			for (unsigned k = 0; k < i; k++)
				pthread_join(d->eng[k].th, NULL);
			pthread_mutex_lock(&G);
			goto fail;
		}
		d->eng[i].started = true;
	}
	d->next = g_devs;
	g_devs = d;
	*major_version = MODEL_DRM_MAJOR;
	*minor_version = MODEL_DRM_MINOR;
	*device_handle = d;
	r = 0;
	goto out;
fail:
	dev_free_struct(d);
out:
	pthread_mutex_unlock(&G);
	return r;
}

/* Like libdrm: the fd the handle holds (its own dup of the one passed to
 * amdgpu_device_initialize); -1 for a bad handle. */
int amdgpu_device_get_fd(amdgpu_device_handle dev)
{
	pthread_mutex_lock(&G);
	int fd = lookup(dev, H_DEV) == dev ? dev->fd : -1;
	pthread_mutex_unlock(&G);
	return fd;
}

int amdgpu_device_deinitialize(amdgpu_device_handle dev)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	struct amdgpu_device *d = dev;
	if (--d->refs > 0) {
		pthread_mutex_unlock(&G);
		return 0;
	}
	for (struct amdgpu_device **pp = &g_devs; *pp; pp = &(*pp)->next) {
		if (*pp == d) {
			*pp = d->next;
			break;
		}
	}
	/* Unregister every handle of this device; keep them to free after the
	 * engines have drained their queues (the kernel flushes entities too). */
	size_t n = 0, cap = 64;
	struct reg_node *objs = malloc(cap * sizeof(*objs));
	for (unsigned b = 0; b < REG_BUCKETS; b++) {
		struct reg_node **pp = &g_reg[b];
		while (*pp) {
			struct reg_node *node = *pp;
			if (node->dev == d && node->p != d) {
				if (n == cap) {
					struct reg_node *o = objs ? realloc(objs, cap * 2 * sizeof(*objs)) : NULL;
					if (o) {
						objs = o;
						cap *= 2;
					}
				}
				if (objs && n < cap)
					objs[n++] = *node;
				*pp = node->next;
				free(node);
			} else {
				pp = &node->next;
			}
		}
	}
	reg_del(d);
	d->stop = true;
	for (unsigned i = 0; i < d->nrings; i++)
		pthread_cond_broadcast(&d->eng[i].cv);
	pthread_mutex_unlock(&G);

	for (unsigned i = 0; i < d->nrings; i++)
		if (d->eng[i].started)
			pthread_join(d->eng[i].th, NULL);

	pthread_mutex_lock(&G);
	/* lists first (they hold internal BO references), then contexts, VA
	 * ranges and finally BOs (freed whatever their reference counts). */
	for (int pass = 0; pass < 3; pass++) {
		for (size_t i = 0; i < n; i++) {
			void *p = (void *)objs[i].p;
			if (pass == 0 && objs[i].type == H_LIST) {
				struct amdgpu_bo_list *l = p;
				for (uint32_t k = 0; k < l->n; k++)
					bo_iput(l->bos[k]);
				free(l->bos);
				grave_free(l);
			} else if (pass == 1 && objs[i].type == H_CTX) {
				struct amdgpu_context *c = p;
				c->user_alive = false;
				ctx_put(c);
			} else if (pass == 1 && objs[i].type == H_VA) {
				grave_free(p);
			} else if (pass == 2 && objs[i].type == H_BO) {
				bo_destroy(p);
			}
		}
	}
	free(objs);
	dev_free_struct(d);
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_query_gpu_info(amdgpu_device_handle dev, struct amdgpu_gpu_info *info)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev || !info) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	memset(info, 0, sizeof(*info));
	info->family_id = dev->family;  /* the only meaningful field */
	pthread_mutex_unlock(&G);
	return 0;
}

static uint32_t sdma_major(uint32_t family)
{
	if (family >= 152)
		return 7;                   /* GC 12 */
	if (family == 145 || family == 148 || family == 151)
		return 6;                   /* GC 11 */
	if (family >= AMDGPU_FAMILY_NV)
		return 5;
	if (family >= AMDGPU_FAMILY_AI)
		return 4;
	if (family >= AMDGPU_FAMILY_VI)
		return 3;
	if (family >= AMDGPU_FAMILY_CI)
		return 2;
	return 1;
}

int amdgpu_query_hw_ip_info(amdgpu_device_handle dev, unsigned type, unsigned ip_instance,
			    struct drm_amdgpu_info_hw_ip *info)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	int r = 0;
	if (!info || type >= AMDGPU_HW_IP_NUM || ip_instance >= AMDGPU_HW_IP_INSTANCE_MAX_COUNT) {
		note(dev, "amdgpu_query_hw_ip_info(type %u, instance %u): -EINVAL", type, ip_instance);
		r = -EINVAL;
	} else {
		memset(info, 0, sizeof(*info));
		if (type == AMDGPU_HW_IP_DMA) {
			info->hw_ip_version_major = sdma_major(dev->family);
			info->ib_start_alignment = SDMA_IB_START_ALIGN;
			info->ib_size_alignment = SDMA_IB_SIZE_ALIGN;
			info->available_rings = dev->nrings >= 32 ? 0xffffffffu : (1u << dev->nrings) - 1;
		}
		/* every other IP: present in the query, with no rings */
	}
	pthread_mutex_unlock(&G);
	return r;
}

/* ------------------------------------------------------------------------ */
/* BOs                                                                       */
/* ------------------------------------------------------------------------ */

/* A dmabuf exported by the KFD model (native/model/kfd_model.c) is the GPU's
 * arena file opened through a name ending in "@<hex offset>+<hex size>" (then
 * unlinked): the BO is that window of the file, which is also what the
 * emulated process maps through its render node.  Returns 1 with the window,
 * 0 for a plain dmabuf (the whole file), -1 for a window outside the file. */
static int dmabuf_window(int fd, const struct stat *st, uint64_t *off, uint64_t *size)
{
	char link[64], path[4096];
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	ssize_t n = readlink(link, path, sizeof(path) - 1);
	if (n <= 0)
		return 0;
	path[n] = 0;
	char *del = strstr(path, " (deleted)");
	if (del)
		*del = 0;
	char *at = strrchr(path, '@');
	const char *slash = strrchr(path, '/');
	if (!at || !slash || at < slash || strncmp(slash + 1, "kfd-dmabuf.", 11))
		return 0;
	unsigned long long o, z;
	int used = 0;
	if (sscanf(at + 1, "%llx+%llx%n", &o, &z, &used) != 2 || at[1 + used] != 0)
		return 0;
	if (z == 0 || o % page_size() || o + z < o || o + z > (uint64_t)st->st_size)
		return -1;
	*off = o;
	*size = z;
	return 1;
}

int amdgpu_bo_import(amdgpu_device_handle dev, enum amdgpu_bo_handle_type type,
		     uint32_t shared_handle, struct amdgpu_bo_import_result *output)
{
	struct stat stt;
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	if (!output || type != amdgpu_bo_handle_type_dma_buf_fd) {
		note(dev, "amdgpu_bo_import: only amdgpu_bo_handle_type_dma_buf_fd is modelled "
		     "(type %d): -EINVAL", (int)type);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	int fd = (int)shared_handle;
	if (fstat(fd, &stt) < 0) {
		int r = -errno;
		note(dev, "amdgpu_bo_import: fd %d: %s", fd, strerror(-r));
		pthread_mutex_unlock(&G);
		return r;
	}
	uint64_t win_off = 0, win_size = 0;
	int w = dmabuf_window(fd, &stt, &win_off, &win_size);
	if (w < 0) {
		note(dev, "amdgpu_bo_import: fd %d names a KFD dmabuf window outside its file "
		     "(size %lld): -EINVAL", fd, (long long)stt.st_size);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	if (w > 0)
		stt.st_size = (off_t)win_size;
	for (struct amdgpu_bo *bo = dev->imports; bo; bo = bo->next_import) {
		if (bo->key_dev == stt.st_dev && bo->key_ino == stt.st_ino && bo->key_off == win_off) {
			/* same dma-buf again: libdrm returns the same handle, refcounted */
			bo->urefs++;
			output->buf_handle = bo;
			output->alloc_size = bo->alloc_size;
			pthread_mutex_unlock(&G);
			return 0;
		}
	}
	uint64_t pg = page_size();
	if (stt.st_size <= 0 || (uint64_t)stt.st_size % pg) {
		note(dev, "amdgpu_bo_import: fd %d has size %lld; a dma-buf is a non-zero whole "
		     "number of pages: -EINVAL", fd, (long long)stt.st_size);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	uint64_t size = (uint64_t)stt.st_size;
	bool ro = false;
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)win_off);
	if (p == MAP_FAILED && errno == EACCES && w > 0) {
		/* a KFD BO exported without DRM_RDWR: the mode limits CPU mmaps of
		 * the dmabuf, not the GPU, which still writes the BO it imports */
		char self[64];
		snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
		int rw = open(self, O_RDWR | O_CLOEXEC);
		if (rw >= 0) {
			p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, rw, (off_t)win_off);
			close(rw);
		}
	}
	if (p == MAP_FAILED && errno == EACCES) {
		p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, (off_t)win_off);
		ro = true;
	}
	if (p == MAP_FAILED) {
		int r = -errno;
		note(dev, "amdgpu_bo_import: mmap of fd %d failed: %s", fd, strerror(-r));
		pthread_mutex_unlock(&G);
		return r;
	}
	struct amdgpu_bo *bo = calloc(1, sizeof(*bo));
	if (!bo || reg_add(bo, H_BO, dev)) {
		free(bo);
		munmap(p, size);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	bo->dev = dev;
	bo->kind = BO_IMPORT;
	bo->cpu = p;
	bo->size = bo->alloc_size = bo->map_len = size;
	bo->urefs = 1;
	bo->readonly = ro;
	bo->key_dev = stt.st_dev;
	bo->key_ino = stt.st_ino;
	bo->key_off = win_off;
	bo->next_import = dev->imports;
	bo->in_imports = true;
	dev->imports = bo;
	output->buf_handle = bo;
	output->alloc_size = size;
	pthread_mutex_unlock(&G);
	return 0;
}

/* The kernel's userptr path (libdrm always passes ANONONLY|REGISTER|VALIDATE):
 * the first VMA must be anonymous (no vm_file: not a file, memfd, shmem or
 * MAP_SHARED|MAP_ANONYMOUS mapping) else -EPERM; every page must be mapped
 * and writable (pages are pinned for write) else -EFAULT. */
static int check_userptr(uintptr_t start, uint64_t size, char *why, size_t whylen)
{
	FILE *f = fopen("/proc/self/maps", "re");
	if (!f) {
		snprintf(why, whylen, "cannot read /proc/self/maps");
		return -EFAULT;
	}
	char line[4096];
	uintptr_t cur = start, end = start + size;
	bool first = true;
	int r = -EFAULT;
	snprintf(why, whylen, "address 0x%" PRIxPTR " is not mapped", start);
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi, off, inode;
		char perms[8], devs[16];
		if (sscanf(line, "%lx-%lx %7s %lx %15s %lu", &lo, &hi, perms, &off, devs, &inode) != 6)
			continue;
		if (hi <= cur)
			continue;
		if (lo > cur)
			break;  /* hole */
		if (first && inode != 0) {
			char *path = strchr(line, '/');
			if (path)
				path[strcspn(path, "\n")] = 0;
			snprintf(why, whylen,
				 "the memory at 0x%" PRIxPTR " is not private anonymous memory (%s); the "
				 "kernel refuses userptr on it (AMDGPU_GEM_USERPTR_ANONONLY). Use "
				 "mmap(MAP_PRIVATE|MAP_ANONYMOUS) - Python: mmap.mmap(-1, n, "
				 "flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS)", start, path ? path : "file-backed");
			r = -EPERM;
			goto out;
		}
		first = false;
		if (perms[1] != 'w') {
			snprintf(why, whylen,
				 "the memory at 0x%lx is not writable (%s); libdrm registers userptr "
				 "read-write, so the kernel cannot pin it", lo > start ? lo : start, perms);
			r = -EFAULT;
			goto out;
		}
		cur = hi;
		if (cur >= end) {
			r = 0;
			goto out;
		}
		snprintf(why, whylen, "address 0x%" PRIxPTR " (inside the range) is not mapped", cur);
	}
out:
	fclose(f);
	return r;
}

int amdgpu_create_bo_from_user_mem(amdgpu_device_handle dev, void *cpu, uint64_t size,
				   amdgpu_bo_handle *buf_handle)
{
	char why[400];
	uint64_t pg = page_size();
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	if (!cpu || !buf_handle || !size || ((uintptr_t)cpu | size) & (pg - 1) ||
	    (uintptr_t)cpu + size < (uintptr_t)cpu) {
		note(dev, "amdgpu_create_bo_from_user_mem(%p, %" PRIu64 "): address and size must "
		     "be non-zero and page-aligned: -EINVAL", cpu, size);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	int r = check_userptr((uintptr_t)cpu, size, why, sizeof(why));
	if (r) {
		note(dev, "amdgpu_create_bo_from_user_mem(%p, %" PRIu64 "): %s: %s", cpu, size, why,
		     r == -EPERM ? "-EPERM" : "-EFAULT");
		pthread_mutex_unlock(&G);
		return r;
	}
	struct amdgpu_bo *bo = calloc(1, sizeof(*bo));
	if (!bo || reg_add(bo, H_BO, dev)) {
		free(bo);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	bo->dev = dev;
	bo->kind = BO_USERPTR;
	bo->cpu = cpu;
	bo->size = bo->alloc_size = size;
	bo->urefs = 1;
	*buf_handle = bo;
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_bo_alloc(amdgpu_device_handle dev, struct amdgpu_bo_alloc_request *req,
		    amdgpu_bo_handle *buf_handle)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	const uint32_t gpu_domains = AMDGPU_GEM_DOMAIN_GTT | AMDGPU_GEM_DOMAIN_VRAM;
	if (!req || !buf_handle || !req->alloc_size || !(req->preferred_heap & gpu_domains) ||
	    (req->preferred_heap & ~(gpu_domains | AMDGPU_GEM_DOMAIN_CPU))) {
		note(dev, "amdgpu_bo_alloc: size %" PRIu64 " heap 0x%x: need a non-zero size and a "
		     "GTT and/or VRAM domain: -EINVAL", req ? req->alloc_size : 0,
		     req ? req->preferred_heap : 0);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	uint64_t size = round_up(req->alloc_size, page_size());
	/* VRAM is a memfd, so that amdgpu_bo_export can hand it out as a "dmabuf";
	 * GTT (IBs) is private anonymous memory. */
	int memfd = -1;
	void *p;
	if (req->preferred_heap & AMDGPU_GEM_DOMAIN_VRAM) {
		memfd = memfd_create("vramd-model-vram", MFD_CLOEXEC);
		if (memfd < 0 || ftruncate(memfd, (off_t)size) < 0) {
			if (memfd >= 0)
				close(memfd);
			pthread_mutex_unlock(&G);
			return -ENOMEM;
		}
		p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
	} else {
		p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	}
	if (p == MAP_FAILED) {
		if (memfd >= 0)
			close(memfd);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	struct amdgpu_bo *bo = calloc(1, sizeof(*bo));
	if (!bo || reg_add(bo, H_BO, dev)) {
		free(bo);
		munmap(p, size);
		if (memfd >= 0)
			close(memfd);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	bo->memfd = memfd;
	bo->dev = dev;
	bo->kind = BO_ALLOC;
	bo->cpu = p;
	bo->size = bo->map_len = size;
	bo->alloc_size = req->alloc_size;
	bo->urefs = 1;
	*buf_handle = bo;
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_bo_export(amdgpu_bo_handle bo, enum amdgpu_bo_handle_type type, uint32_t *shared_handle)
{
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(bo, H_BO);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, bo);
	}
	int r = 0;
	if (!shared_handle || type != amdgpu_bo_handle_type_dma_buf_fd) {
		note(d, "amdgpu_bo_export: the model exports only as a dma_buf fd: -EINVAL");
		r = -EINVAL;
	} else if (bo->kind != BO_ALLOC || bo->memfd < 0) {
		note(d, "amdgpu_bo_export: the model exports only VRAM BOs it allocated: -EINVAL");
		r = -EINVAL;
	} else {
		int fd = fcntl(bo->memfd, F_DUPFD_CLOEXEC, 0);
		if (fd < 0)
			r = -errno;
		else
			*shared_handle = (uint32_t)fd;
	}
	pthread_mutex_unlock(&G);
	return r;
}

int amdgpu_bo_cpu_map(amdgpu_bo_handle bo, void **cpu)
{
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(bo, H_BO);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, bo);
	}
	int r = 0;
	if (!cpu) {
		r = -EINVAL;
	} else if (bo->kind == BO_USERPTR) {
		note(d, "amdgpu_bo_cpu_map on a userptr BO: the kernel refuses GEM_MMAP: -EPERM");
		r = -EPERM;
	} else {
		bo->cpu_map_count++;
		*cpu = bo->cpu;
	}
	pthread_mutex_unlock(&G);
	return r;
}

int amdgpu_bo_cpu_unmap(amdgpu_bo_handle bo)
{
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(bo, H_BO);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, bo);
	}
	int r = 0;
	if (bo->cpu_map_count == 0) {
		note(d, "amdgpu_bo_cpu_unmap of a BO that is not CPU-mapped: -EINVAL");
		r = -EINVAL;
	} else {
		bo->cpu_map_count--;
	}
	pthread_mutex_unlock(&G);
	return r;
}

int amdgpu_bo_free(amdgpu_bo_handle bo)
{
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(bo, H_BO);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, bo);
	}
	if (--bo->urefs == 0) {
		/* last handle: like GEM close, drop this VM's mappings of the BO */
		reg_del(bo);
		remove_import(d, bo);
		remove_bo_mappings(d, bo);
		if (bo->irefs == 0)
			bo_destroy(bo);
	}
	pthread_mutex_unlock(&G);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* VA                                                                        */
/* ------------------------------------------------------------------------ */

int amdgpu_va_range_alloc(amdgpu_device_handle dev, enum amdgpu_gpu_va_range va_range_type,
			  uint64_t size, uint64_t va_base_alignment, uint64_t va_base_required,
			  uint64_t *va_base_allocated, amdgpu_va_handle *va_range_handle,
			  uint64_t flags)
{
	uint64_t pg = page_size();
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	uint64_t align = va_base_alignment ? va_base_alignment : pg;
	if (!va_base_allocated || !va_range_handle || va_range_type != amdgpu_gpu_va_range_general ||
	    !size || size > VA_GEN_END || (align & (align - 1))) {
		note(dev, "amdgpu_va_range_alloc(size %" PRIu64 ", alignment %" PRIu64 "): -EINVAL",
		     size, va_base_alignment);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	if (align < pg)
		align = pg;
	size = round_up(size, pg);
	int region = 1;
	uint64_t lo = VA_GEN_START, hi = VA_GEN_END;
	if (flags & AMDGPU_VA_RANGE_HIGH) {
		region = 2;
		lo = VA_HIGH_START;
		hi = VA_HIGH_END;
	} else if (flags & AMDGPU_VA_RANGE_32_BIT) {
		region = 0;
		lo = VA_LOW_START;
		hi = VA_LOW_END;
	}
	uint64_t va;
	if (va_base_required) {
		va = va_base_required;
		if ((va & (align - 1)) || va < lo || va > hi || hi - va < size ||
		    !range_free_at(dev, va, size, 0)) {
			note(dev, "amdgpu_va_range_alloc: required base 0x%" PRIx64 " (+%" PRIu64
			     ") is not free/aligned in its range: -ENOMEM", va, size);
			pthread_mutex_unlock(&G);
			return -ENOMEM;
		}
	} else {
		va = range_find(dev, region, lo, hi, size, align);
		if (!va) {
			note(dev, "amdgpu_va_range_alloc: no free VA for %" PRIu64 " bytes: -ENOMEM", size);
			pthread_mutex_unlock(&G);
			return -ENOMEM;
		}
	}
	struct amdgpu_va *h = calloc(1, sizeof(*h));
	if (!h || reg_add(h, H_VA, dev)) {
		free(h);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	h->dev = dev;
	h->start = va;
	h->size = size;
	if (range_insert(dev, h)) {
		reg_del(h);
		free(h);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	*va_base_allocated = va;
	*va_range_handle = h;
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_va_range_free(amdgpu_va_handle va_range_handle)
{
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(va_range_handle, H_VA);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, va_range_handle);
	}
	range_remove(d, va_range_handle);
	reg_del(va_range_handle);
	grave_free(va_range_handle);
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_bo_va_op(amdgpu_bo_handle bo, uint64_t offset, uint64_t size, uint64_t addr,
		    uint64_t flags, uint32_t ops)
{
	(void)flags;  /* libdrm ignores it and maps READABLE|WRITEABLE|EXECUTABLE */
	uint64_t pg = page_size();
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(bo, H_BO);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, bo);
	}
	int r = 0;
	size = round_up(size, pg);  /* libdrm rounds the size up to the CPU page size */
	if (ops == AMDGPU_VA_OP_MAP) {
		bool in_hole = addr >= VA_GEN_END && addr < VA_HIGH_START;
		if (!size || (addr | offset) & (pg - 1) || addr + size < addr ||
		    offset + size < offset || offset + size > bo->size || in_hole ||
		    (addr < VA_GEN_END && addr + size > VA_GEN_END) || addr < VA_LOW_START) {
			note(d, "amdgpu_bo_va_op(MAP bo size %" PRIu64 ", offset %" PRIu64 ", size %"
			     PRIu64 ", addr 0x%" PRIx64 "): bad alignment, range or VA: -EINVAL",
			     bo->size, offset, size, addr);
			r = -EINVAL;
		} else if (map_overlaps(d, addr, size)) {
			note(d, "amdgpu_bo_va_op(MAP addr 0x%" PRIx64 " size %" PRIu64 "): overlaps an "
			     "existing mapping: -EINVAL", addr, size);
			r = -EINVAL;
		} else {
			struct mapping m = { .start = addr, .size = size, .offset = offset, .bo = bo };
			r = map_insert(d, m);
		}
	} else if (ops == AMDGPU_VA_OP_UNMAP) {
		/* the kernel finds the mapping by (BO, start address) only */
		ssize_t i = map_floor(d, addr);
		if (i < 0 || d->maps[i].start != addr || d->maps[i].bo != bo) {
			note(d, "amdgpu_bo_va_op(UNMAP addr 0x%" PRIx64 "): no mapping of this BO starts "
			     "there: -ENOENT", addr);
			r = -ENOENT;
		} else {
			memmove(&d->maps[i], &d->maps[i + 1], (d->nmaps - (size_t)i - 1) * sizeof(*d->maps));
			d->nmaps--;
		}
	} else {
		note(d, "amdgpu_bo_va_op: op %u is not modelled (MAP and UNMAP are): -EINVAL", ops);
		r = -EINVAL;
	}
	pthread_mutex_unlock(&G);
	return r;
}

/* ------------------------------------------------------------------------ */
/* Contexts and BO lists                                                     */
/* ------------------------------------------------------------------------ */

int amdgpu_cs_ctx_create(amdgpu_device_handle dev, amdgpu_context_handle *context)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev || !context) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	struct amdgpu_context *c = calloc(1, sizeof(*c));
	if (!c || reg_add(c, H_CTX, dev)) {
		free(c);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	c->dev = dev;
	c->id = dev->next_ctx_id++;
	c->refs = 1;
	c->user_alive = true;
	c->reset_seen = dev->reset_counter;
	for (unsigned i = 0; i < DMA_ENTITIES; i++)
		c->ent[i].engine = -1;
	*context = c;
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_cs_ctx_free(amdgpu_context_handle context)
{
	pthread_mutex_lock(&G);
	if (!lookup(context, H_CTX)) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, context);
	}
	/* queued jobs still run (the kernel flushes the entities) */
	reg_del(context);
	context->user_alive = false;
	ctx_put(context);
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_bo_list_create(amdgpu_device_handle dev, uint32_t number_of_resources,
			  amdgpu_bo_handle *resources, uint8_t *resource_prios,
			  amdgpu_bo_list_handle *result)
{
	(void)resource_prios;
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, dev);
	}
	if (!number_of_resources || !resources || !result) {
		note(dev, "amdgpu_bo_list_create: empty list or NULL pointer: -EINVAL");
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < number_of_resources; i++) {
		if (lookup(resources[i], H_BO) != dev) {
			note(dev, "amdgpu_bo_list_create: entry %u (%p) is not a live BO of this device: "
			     "-EINVAL", i, (void *)resources[i]);
			pthread_mutex_unlock(&G);
			return -EINVAL;
		}
	}
	struct amdgpu_bo_list *l = calloc(1, sizeof(*l));
	struct amdgpu_bo **bos = calloc(number_of_resources, sizeof(*bos));
	if (!l || !bos || reg_add(l, H_LIST, dev)) {
		free(l);
		free(bos);
		pthread_mutex_unlock(&G);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < number_of_resources; i++) {
		bos[i] = resources[i];
		bos[i]->irefs++;
	}
	l->dev = dev;
	l->n = number_of_resources;
	l->bos = bos;
	*result = l;
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_bo_list_destroy(amdgpu_bo_list_handle list)
{
	pthread_mutex_lock(&G);
	if (!lookup(list, H_LIST)) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, list);
	}
	reg_del(list);
	for (uint32_t i = 0; i < list->n; i++)
		bo_iput(list->bos[i]);
	free(list->bos);
	grave_free(list);
	pthread_mutex_unlock(&G);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Command submission                                                        */
/* ------------------------------------------------------------------------ */

static unsigned dma_rings(struct amdgpu_device *d)
{
	return d->nrings < DMA_ENTITIES ? d->nrings : DMA_ENTITIES;
}

/* A userptr BO named by a submission is re-validated by the kernel (its pages
 * are looked up again); memory that was unmapped since fails with -EFAULT. */
static bool userptr_still_mapped(struct amdgpu_bo *bo)
{
	return msync(bo->cpu, bo->size, MS_ASYNC) == 0;
}

static int submit_one(struct amdgpu_context *c, struct amdgpu_cs_request *req)
{
	struct amdgpu_device *d = c->dev;
	struct job *j = NULL;
	int r = -EINVAL;

	if (req->ip_type >= AMDGPU_HW_IP_NUM || req->ring >= CS_MAX_RINGS) {
		note(d, "amdgpu_cs_submit: ip_type %u ring %u out of range: -EINVAL", req->ip_type,
		     req->ring);
		return -EINVAL;
	}
	if (req->number_of_ibs == 0) {
		req->seq_no = 0;  /* libdrm's null submission */
		return 0;
	}
	if (req->number_of_ibs > AMDGPU_CS_MAX_IBS_PER_SUBMIT || !req->ibs) {
		note(d, "amdgpu_cs_submit: %u IBs (max %d): -EINVAL", req->number_of_ibs,
		     AMDGPU_CS_MAX_IBS_PER_SUBMIT);
		return -EINVAL;
	}
	if (req->ip_type != AMDGPU_HW_IP_DMA) {
		note(d, "amdgpu_cs_submit: ip_type %u: only AMDGPU_HW_IP_DMA is modelled: -EINVAL",
		     req->ip_type);
		return -EINVAL;
	}
	if (req->ip_instance != 0 || req->ring >= dma_rings(d)) {
		note(d, "amdgpu_cs_submit: DMA ring %u instance %u: valid rings are 0..%u (the kernel "
		     "has %d DMA entities per context; this device reports %u SDMA rings): -EINVAL",
		     req->ring, req->ip_instance, dma_rings(d) - 1, DMA_ENTITIES, d->nrings);
		return -EINVAL;
	}
	if (c->guilty) {
		note(d, "amdgpu_cs_submit: context %u is guilty (an earlier job faulted): -ECANCELED",
		     c->id);
		return -ECANCELED;
	}
	struct amdgpu_bo_list *list = req->resources;
	if (list && lookup(list, H_LIST) != d) {
		note(d, "amdgpu_cs_submit: resources %p is not a live BO list of this device: -EINVAL",
		     (void *)list);
		return -EINVAL;
	}
	if (req->number_of_dependencies && !req->dependencies) {
		note(d, "amdgpu_cs_submit: dependencies == NULL: -EINVAL");
		return -EINVAL;
	}
	for (uint32_t i = 0; i < req->number_of_dependencies; i++) {
		struct amdgpu_cs_fence *f = &req->dependencies[i];
		struct amdgpu_context *fc = f->context;
		if (lookup(fc, H_CTX) != d || f->ip_type != AMDGPU_HW_IP_DMA || f->ip_instance ||
		    f->ring >= dma_rings(d) || f->fence > fc->ent[f->ring].last_seq) {
			note(d, "amdgpu_cs_submit: dependency %u (ctx %p ip %u ring %u seq %" PRIu64
			     ") does not name a submitted DMA job of this device: -EINVAL", i,
			     (void *)fc, f->ip_type, f->ring, f->fence);
			return -EINVAL;
		}
	}
	struct amdgpu_bo *fbo = req->fence_info.handle;
	if (fbo) {
		if (lookup(fbo, H_BO) != d || fbo->kind == BO_USERPTR ||
		    req->fence_info.offset > (fbo->size - 8) / 8) {
			note(d, "amdgpu_cs_submit: bad user fence BO/offset: -EINVAL");
			return -EINVAL;
		}
	}
	if (list) {
		for (uint32_t i = 0; i < list->n; i++) {
			struct amdgpu_bo *bo = list->bos[i];
			if (bo->kind == BO_USERPTR && !userptr_still_mapped(bo)) {
				note(d, "amdgpu_cs_submit: userptr BO at %p (%" PRIu64 " bytes) is no longer "
				     "mapped in the process: -EFAULT", (void *)bo->cpu, bo->size);
				return -EFAULT;
			}
		}
	}

	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	for (uint32_t k = 0; k < req->number_of_ibs; k++) {
		struct amdgpu_cs_ib_info *ibi = &req->ibs[k];
		uint64_t bytes = (uint64_t)ibi->size * 4;
		struct mapping *m = map_find(d, ibi->ib_mc_address);
		if (ibi->flags) {
			note(d, "amdgpu_cs_submit: IB %u flags 0x%" PRIx64 " are not modelled: -EINVAL", k,
			     ibi->flags);
			goto fail;
		}
		if (!m || ibi->ib_mc_address + bytes > m->start + m->size) {
			note(d, "amdgpu_cs_submit: IB %u [0x%" PRIx64 ", +%" PRIu64 " bytes) is not inside "
			     "one GPU VA mapping: -EINVAL (model rule)", k, ibi->ib_mc_address, bytes);
			goto fail;
		}
		struct ib *ib = &j->ib[k];
		ib->dw = malloc(bytes ? bytes : 1);
		if (!ib->dw) {
			r = -ENOMEM;
			goto fail;
		}
		/* the model reads the IB now; hardware would fetch it when the job runs */
		memcpy(ib->dw, m->bo->cpu + m->offset + (ibi->ib_mc_address - m->start), bytes);
		ib->ndw = ibi->size;
		ib->va = ibi->ib_mc_address;
		ib->bo = m->bo;
		m->bo->irefs++;
		j->nib = k + 1;
	}
	if (list) {
		j->bos = calloc(list->n, sizeof(*j->bos));
		if (!j->bos) {
			r = -ENOMEM;
			goto fail;
		}
		for (uint32_t i = 0; i < list->n; i++) {
			j->bos[i] = list->bos[i];
			j->bos[i]->irefs++;
			j->nbos = i + 1;
		}
		j->has_list = true;
	}
	if (req->number_of_dependencies) {
		j->deps = calloc(req->number_of_dependencies, sizeof(*j->deps));
		if (!j->deps) {
			r = -ENOMEM;
			goto fail;
		}
		for (uint32_t i = 0; i < req->number_of_dependencies; i++) {
			struct amdgpu_cs_fence *f = &req->dependencies[i];
			j->deps[i].ctx = f->context;
			j->deps[i].ring = f->ring;
			j->deps[i].seq = f->fence;
			f->context->refs++;
			j->ndeps = i + 1;
		}
	}
	if (fbo) {
		j->fence_bo = fbo;
		j->fence_off = req->fence_info.offset * 8;
		fbo->irefs++;
	}

	/* queue it: an idle entity is (re)bound to the least-loaded engine, as the
	 * kernel's scheduler load-balances a DMA entity over all SDMA rings */
	struct entity *ent = &c->ent[req->ring];
	if (ent->pending == 0) {
		unsigned best = 0;
		for (unsigned i = 1; i < d->nrings; i++)
			if (d->eng[i].load < d->eng[best].load)
				best = i;
		ent->engine = (int)best;
	}
	struct engine *e = &d->eng[ent->engine];
	j->ctx = c;
	c->refs++;
	j->ring = req->ring;
	j->seq = ++ent->last_seq;
	ent->pending++;
	e->load++;
	if (e->tail)
		e->tail->next = j;
	else
		e->head = j;
	e->tail = j;
	req->seq_no = j->seq;
	pthread_cond_signal(&e->cv);
	return 0;
fail:
	job_free(j);
	return r;
}

int amdgpu_cs_submit(amdgpu_context_handle context, uint64_t flags,
		     struct amdgpu_cs_request *ibs_request, uint32_t number_of_requests)
{
	(void)flags;  /* unused by libdrm too */
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(context, H_CTX);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, context);
	}
	int r = ibs_request ? 0 : -EINVAL;
	for (uint32_t i = 0; r == 0 && i < number_of_requests; i++)
		r = submit_one(context, &ibs_request[i]);
	if (r)
		d->st[ST_REJECTED]++;
	pthread_mutex_unlock(&G);
	return r;
}

int amdgpu_cs_query_fence_status(struct amdgpu_cs_fence *fence, uint64_t timeout_ns,
				 uint64_t flags, uint32_t *expired)
{
	pthread_mutex_lock(&G);
	if (!fence || !expired) {
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	struct amdgpu_context *c = fence->context;
	struct amdgpu_device *d = lookup(c, H_CTX);
	if (!d) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, c);
	}
	if (fence->ip_type >= AMDGPU_HW_IP_NUM || fence->ring >= CS_MAX_RINGS) {
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	if (fence->fence == 0) {
		*expired = 1;  /* libdrm: the null-submission fence */
		pthread_mutex_unlock(&G);
		return 0;
	}
	if (fence->ip_type != AMDGPU_HW_IP_DMA || fence->ip_instance != 0 ||
	    fence->ring >= dma_rings(d) || fence->fence > c->ent[fence->ring].last_seq) {
		note(d, "amdgpu_cs_query_fence_status: ctx %u ip %u ring %u seq %" PRIu64 " was never "
		     "submitted: -EINVAL", c->id, fence->ip_type, fence->ring, fence->fence);
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	*expired = 0;
	struct entity *ent = &c->ent[fence->ring];
	if (ent->done_seq < fence->fence && timeout_ns) {
		c->refs++;  /* keep the context while waiting, even if it is freed meanwhile */
		if (timeout_ns == AMDGPU_TIMEOUT_INFINITE) {
			while (ent->done_seq < fence->fence)
				pthread_cond_wait(&d->fence_cv, &G);
		} else {
			struct timespec now;
			clock_gettime(CLOCK_MONOTONIC, &now);
			uint64_t now_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
			uint64_t deadline = (flags & AMDGPU_QUERY_FENCE_TIMEOUT_IS_ABSOLUTE)
						    ? timeout_ns : now_ns + timeout_ns;
			if (deadline < now_ns && !(flags & AMDGPU_QUERY_FENCE_TIMEOUT_IS_ABSOLUTE))
				deadline = UINT64_MAX;  /* overflow: wait "forever" like libdrm */
			struct timespec ts = {
				.tv_sec = (time_t)(deadline / 1000000000ull),
				.tv_nsec = (long)(deadline % 1000000000ull),
			};
			while (ent->done_seq < fence->fence) {
				if (pthread_cond_timedwait(&d->fence_cv, &G, &ts) == ETIMEDOUT)
					break;
			}
		}
		ctx_put(c);
	}
	/* the kernel reports a signalled fence as expired even when the job
	 * faulted; the failure shows in amdgpu_cs_query_reset_state2 */
	*expired = ent->done_seq >= fence->fence;
	pthread_mutex_unlock(&G);
	return 0;
}

int amdgpu_cs_query_reset_state2(amdgpu_context_handle context, uint64_t *flags)
{
	pthread_mutex_lock(&G);
	struct amdgpu_device *d = lookup(context, H_CTX);
	if (!d || !flags) {
		pthread_mutex_unlock(&G);
		return bad_handle(__func__, context);
	}
	uint64_t f = 0;
	if (context->reset_seen != d->reset_counter)
		f |= AMDGPU_CTX_QUERY2_FLAGS_RESET;
	if (context->guilty)
		f |= AMDGPU_CTX_QUERY2_FLAGS_GUILTY | AMDGPU_CTX_QUERY2_FLAGS_RESET;
	*flags = f;
	pthread_mutex_unlock(&G);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Model-only API                                                            */
/* ------------------------------------------------------------------------ */

int vramd_model_stats_ex(amdgpu_device_handle dev, uint64_t *out, unsigned n)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev || !out) {
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	unsigned k = n < ST_COUNT ? n : ST_COUNT;
	for (unsigned i = 0; i < k; i++)
		out[i] = dev->st[i];
	pthread_mutex_unlock(&G);
	return (int)k;
}

int vramd_model_stats(amdgpu_device_handle dev, uint64_t out[4])
{
	int r = vramd_model_stats_ex(dev, out, 4);
	return r < 0 ? r : 0;
}

int vramd_model_last_error(amdgpu_device_handle dev, char *buf, size_t len)
{
	pthread_mutex_lock(&G);
	if (lookup(dev, H_DEV) != dev || !buf || !len) {
		pthread_mutex_unlock(&G);
		return -EINVAL;
	}
	snprintf(buf, len, "%s", dev->last_err);
	pthread_mutex_unlock(&G);
	return 0;
}
