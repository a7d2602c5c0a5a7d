/*
 * test_kfd.c - tests of the KFD MODEL (kfd_model.c) together with the SDMA
 * model (libdrm_amdgpu_model.so).
 *
 * THIS TESTS A MODEL, NOT A GPU.  It drives the KFD model through the ioctls
 * CRIU's amdgpu plugin issues, in the plugin's order (GET_VERSION; then
 * PROCESS_INFO, CHECKPOINT, SDMA reads of every dmabuf, UNPAUSE; RESTORE in a
 * fresh process, SDMA writes, RESUME from another process), every error path
 * the model documents (docs/kfd-model.md), failure injection at each op, and
 * the counters.  Real processes: forked children, a ptrace-attached "dumper".
 *
 * Run: python native/model/build.py --test OUT_DIR   (add --asan for ASan+UBSan)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sched.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/capability.h>
#include <linux/kfd_ioctl.h>

#include <amdgpu.h>
#include <amdgpu_drm.h>
#include "kfd_model.h"

/* The header spells WRITABLE as (1 << 31), a signed shift UBSan reports when
 * it is evaluated at run time; the same bit, unsigned: */
#define KFDM_WRITABLE (1u << 31)
_Static_assert(KFDM_WRITABLE == (uint32_t)KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE, "WRITABLE bit");

#define MiB (1024ull * 1024ull)
#define GiB (1024ull * MiB)

#include "test_check.h"

static uint64_t pg;
static char g_dir[256];
static const struct kfdm_gpu GPUS[2] = {
	{ .gpu_id = 0x1a2b, .minor = 128, .vram_size = 8 * GiB },
	{ .gpu_id = 0x3c4d, .minor = 129, .vram_size = 8 * GiB },
};

static void fill(uint8_t *p, uint64_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 1;
	for (uint64_t i = 0; i < n; i++) {
		x ^= x << 13; x ^= x >> 17; x ^= x << 5;
		p[i] = (uint8_t)x;
	}
}

static bool same(const uint8_t *p, uint64_t n, uint32_t seed)
{
	uint8_t *want = malloc(n);
	fill(want, n, seed);
	bool eq = !memcmp(p, want, n);
	free(want);
	return eq;
}

static int open_fds(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/fd");
	for (struct dirent *e; (e = readdir(d));)
		n += e->d_name[0] != '.';
	closedir(d);
	return n - 1;
}

static char *arena_path(unsigned gi)
{
	static char p[2][300];
	snprintf(p[gi], sizeof(p[gi]), "%s/renderD%u", g_dir, GPUS[gi].minor);
	return p[gi];
}

/* ------------------------------------------------------------- the process */

struct proc {
	struct kfdm *m;
	int64_t tok;
	int render[2];
};

static void proc_open(struct proc *p)
{
	p->m = kfdm_attach(g_dir);
	CHECK(p->m != NULL);
	p->tok = kfdm_open(p->m);
	CHECK(p->tok > 0);
	for (unsigned i = 0; i < 2; i++) {
		p->render[i] = open(arena_path(i), O_RDWR | O_CLOEXEC);
		CHECK(p->render[i] >= 0);
	}
}

static void proc_close(struct proc *p)
{
	close(p->render[0]);
	close(p->render[1]);
	kfdm_detach(p->m);
}

static void acquire(struct proc *p)
{
	for (unsigned i = 0; i < 2; i++) {
		struct kfd_ioctl_acquire_vm_args a = { .drm_fd = (uint32_t)p->render[i], .gpu_id = GPUS[i].gpu_id };
		OK(kfdm_ioctl(p->m, p->tok, AMDKFD_IOC_ACQUIRE_VM, &a));
	}
}

struct bo {
	uint64_t va, size, handle, offset;
	uint32_t gi, flags, seed;
	uint8_t *cpu;           /* the process's view: its render node mapped at mmap_offset */
};

#define W KFDM_WRITABLE
#define VRAM KFD_IOC_ALLOC_MEM_FLAGS_VRAM
#define GTT KFD_IOC_ALLOC_MEM_FLAGS_GTT
#define DOORBELL KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL
#define MMIO KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP

static int alloc(struct proc *p, struct bo *b, uint32_t gi, uint64_t va, uint64_t size, uint32_t flags)
{
	struct kfd_ioctl_alloc_memory_of_gpu_args a = {
		.va_addr = va, .size = size, .gpu_id = GPUS[gi].gpu_id, .flags = flags };
	int r = kfdm_ioctl(p->m, p->tok, AMDKFD_IOC_ALLOC_MEMORY_OF_GPU, &a);
	if (r)
		return r;
	memset(b, 0, sizeof(*b));
	b->va = va;
	b->size = size;
	b->gi = gi;
	b->flags = flags;
	b->handle = a.handle;
	b->offset = a.mmap_offset;
	CHECK_EQ(a.handle >> 32, GPUS[gi].gpu_id);
	if (flags & (VRAM | GTT)) {
		b->cpu = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, p->render[gi], (off_t)b->offset);
		CHECK(b->cpu != MAP_FAILED);
	}
	return 0;
}

/* ------------------------------------------------------------ SDMA (model) */

struct sdma {
	amdgpu_device_handle dev;
	int fd;
};

static void sdma_open(struct sdma *s, unsigned gi)
{
	uint32_t maj, min;
	s->fd = open(arena_path(gi), O_RDWR | O_CLOEXEC);
	CHECK(s->fd >= 0);
	OK(amdgpu_device_initialize(s->fd, &maj, &min, &s->dev));
	int dfd = amdgpu_device_get_fd(s->dev);        /* libdrm's own dup of the render fd */
	struct stat a, b;
	CHECK(dfd >= 0 && dfd != s->fd);
	OK(fstat(dfd, &a));
	OK(fstat(s->fd, &b));
	CHECK(a.st_ino == b.st_ino && a.st_dev == b.st_dev);
}

static void sdma_close(struct sdma *s)
{
	OK(amdgpu_device_deinitialize(s->dev));
	close(s->fd);
}

/* One SDMA copy between the dmabuf (imported, as the plugin does) and a
 * host userptr buffer; to_bo picks the direction. */
static void sdma_copy(struct sdma *s, int dmabuf, uint8_t *host, uint64_t n, bool to_bo)
{
	struct amdgpu_bo_import_result imp;
	OK(amdgpu_bo_import(s->dev, amdgpu_bo_handle_type_dma_buf_fd, (uint32_t)dmabuf, &imp));
	CHECK_EQ(imp.alloc_size, n);
	amdgpu_bo_handle user, ib;
	OK(amdgpu_create_bo_from_user_mem(s->dev, host, n, &user));
	struct amdgpu_bo_alloc_request req = { .alloc_size = 4096, .phys_alignment = 4096,
					       .preferred_heap = AMDGPU_GEM_DOMAIN_GTT };
	OK(amdgpu_bo_alloc(s->dev, &req, &ib));
	uint64_t va[3];
	amdgpu_va_handle vah[3];
	amdgpu_bo_handle bos[3] = { imp.buf_handle, user, ib };
	uint64_t sz[3] = { n, n, 4096 };
	for (int i = 0; i < 3; i++) {
		OK(amdgpu_va_range_alloc(s->dev, amdgpu_gpu_va_range_general, sz[i], 4096, 0, &va[i], &vah[i], 0));
		OK(amdgpu_bo_va_op(bos[i], 0, sz[i], va[i], 0, AMDGPU_VA_OP_MAP));
	}
	void *ibp;
	OK(amdgpu_bo_cpu_map(ib, &ibp));
	amdgpu_bo_list_handle list;
	OK(amdgpu_bo_list_create(s->dev, 3, bos, NULL, &list));
	uint64_t src = to_bo ? va[1] : va[0], dst = to_bo ? va[0] : va[1];
	for (uint64_t done = 0; done < n;) {
		uint32_t *dw = ibp, k = 0;
		for (int pk = 0; pk < 16 && done < n; pk++) {
			uint64_t c = n - done < 4 * MiB ? n - done : 4 * MiB;
			dw[k++] = 1;
			dw[k++] = (uint32_t)(c - 1);       /* AI+: count = bytes - 1 */
			dw[k++] = 0;
			dw[k++] = (uint32_t)(src + done);
			dw[k++] = (uint32_t)((src + done) >> 32);
			dw[k++] = (uint32_t)(dst + done);
			dw[k++] = (uint32_t)((dst + done) >> 32);
			done += c;
		}
		while (k & 7)
			dw[k++] = 0;
		struct amdgpu_cs_ib_info ibi = { .ib_mc_address = va[2], .size = k };
		struct amdgpu_cs_request cs = { .ip_type = AMDGPU_HW_IP_DMA, .resources = list,
						.number_of_ibs = 1, .ibs = &ibi };
		amdgpu_context_handle ctx;
		OK(amdgpu_cs_ctx_create(s->dev, &ctx));
		OK(amdgpu_cs_submit(ctx, 0, &cs, 1));
		struct amdgpu_cs_fence f = { .context = ctx, .ip_type = AMDGPU_HW_IP_DMA, .fence = cs.seq_no };
		uint32_t expired = 0;
		OK(amdgpu_cs_query_fence_status(&f, AMDGPU_TIMEOUT_INFINITE, 0, &expired));
		CHECK_EQ(expired, 1);
		uint64_t fl = 0;
		OK(amdgpu_cs_query_reset_state2(ctx, &fl));
		CHECK_EQ(fl, 0);                         /* no fault, no invalid packet */
		OK(amdgpu_cs_ctx_free(ctx));
	}
	OK(amdgpu_bo_list_destroy(list));
	OK(amdgpu_bo_cpu_unmap(ib));
	for (int i = 0; i < 3; i++) {
		OK(amdgpu_bo_va_op(bos[i], 0, sz[i], va[i], 0, AMDGPU_VA_OP_UNMAP));
		OK(amdgpu_va_range_free(vah[i]));
		OK(amdgpu_bo_free(bos[i]));
	}
}

static uint8_t *host_buf(uint64_t n)
{
	uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(p != MAP_FAILED);
	return p;
}

/* ------------------------------------------------------------ CRIU op calls */

static int criu(struct proc *p, int64_t tok, struct kfd_ioctl_criu_args *a, uint32_t op)
{
	a->op = op;
	return kfdm_ioctl(p->m, tok, AMDKFD_IOC_CRIU_OP, a);
}

/* What the dump leaves for the restore: buckets, priv data, BO contents. */
struct image {
	struct kfd_ioctl_criu_args info;
	struct kfd_criu_device_bucket dev[2];
	struct kfd_criu_bo_bucket bo[16];
	uint8_t priv[1024];
	uint8_t *content[16];
};

static void dump_all(struct proc *dumper, int64_t tok, struct image *img, unsigned expect_bos)
{
	struct kfd_ioctl_criu_args a = { 0 };
	OK(criu(dumper, tok, &a, KFD_CRIU_OP_PROCESS_INFO));
	CHECK_EQ(a.num_devices, 2);
	CHECK_EQ(a.num_bos, expect_bos);
	CHECK_EQ(a.num_objects, 0);
	CHECK(a.priv_data_size > 0 && a.priv_data_size <= sizeof(img->priv));
	img->info = a;
	a.devices = (uintptr_t)img->dev;
	a.bos = (uintptr_t)img->bo;
	a.priv_data = (uintptr_t)img->priv;
	OK(criu(dumper, tok, &a, KFD_CRIU_OP_CHECKPOINT));
	struct sdma s[2];
	sdma_open(&s[0], 0);
	sdma_open(&s[1], 1);
	for (unsigned i = 0; i < a.num_bos; i++) {
		struct kfd_criu_bo_bucket *b = &img->bo[i];
		img->content[i] = NULL;
		if (!(b->alloc_flags & (VRAM | GTT))) {
			CHECK_EQ(b->dmabuf_fd, KFD_INVALID_FD);
			continue;
		}
		unsigned gi = b->gpu_id == GPUS[0].gpu_id ? 0 : 1;
		img->content[i] = host_buf(b->size);
		sdma_copy(&s[gi], (int)b->dmabuf_fd, img->content[i], b->size, false);
		close((int)b->dmabuf_fd);
	}
	sdma_close(&s[0]);
	sdma_close(&s[1]);
}

static void image_free(struct image *img)
{
	for (unsigned i = 0; i < img->info.num_bos; i++)
		if (img->content[i])
			munmap(img->content[i], img->bo[i].size);
}

/* ================================================================= tests */

static void test_a_memory_rules(void)
{
	g_test = "a: open, version, acquire, alloc, free";
	struct proc p;
	proc_open(&p);
	CHECK_EQ(kfdm_open(p.m), p.tok);                 /* one KFD process per process */
	struct kfd_ioctl_get_version_args v = { 0 };
	OK(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_GET_VERSION, &v));
	CHECK_EQ(v.major_version, 1);
	CHECK_EQ(v.minor_version, KFD_IOCTL_MINOR_VERSION);
	CHECK_EQ(kfdm_ioctl(p.m, p.tok + 256, AMDKFD_IOC_GET_VERSION, &v), -EBADF);
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_CREATE_QUEUE, &v), -ENOTTY);
	struct bo b;
	CHECK_EQ(alloc(&p, &b, 0, 1 << 30, pg, VRAM | W), -EINVAL);        /* no VM yet */
	int mfd = memfd_create("not-a-render-node", MFD_CLOEXEC);
	struct kfd_ioctl_acquire_vm_args av = { .drm_fd = (uint32_t)mfd, .gpu_id = GPUS[0].gpu_id };
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_ACQUIRE_VM, &av), -EINVAL);
	av.drm_fd = (uint32_t)p.render[1];                                  /* the other GPU's node */
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_ACQUIRE_VM, &av), -EINVAL);
	av.gpu_id = 0x9999;
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_ACQUIRE_VM, &av), -EINVAL);
	close(mfd);
	acquire(&p);
	CHECK_EQ(alloc(&p, &b, 0, 1 << 30, pg + 1, VRAM | W), -EINVAL);
	CHECK_EQ(alloc(&p, &b, 0, (1 << 30) + 1, pg, VRAM | W), -EINVAL);
	CHECK_EQ(alloc(&p, &b, 0, 1 << 30, pg, VRAM | GTT | W), -EINVAL);
	CHECK_EQ(alloc(&p, &b, 0, 1 << 30, pg, KFD_IOC_ALLOC_MEM_FLAGS_USERPTR | W), -EINVAL);
	CHECK_EQ(alloc(&p, &b, 0, 1 << 30, 2 * pg, DOORBELL | W), -EINVAL);
	CHECK_EQ(alloc(&p, &b, 0, 1 << 30, 9 * GiB, VRAM | W), -ENOMEM);
	uint64_t st0[KFDM_STAT_COUNT], st1[KFDM_STAT_COUNT];
	kfdm_counters(p.m, NULL, NULL, st0);
	struct bo big;
	OK(alloc(&p, &big, 1, 1ull << 40, 5 * GiB, VRAM | W));             /* > 4 GiB, sparse */
	big.cpu[5 * GiB - 1] = 0x5a;
	OK(alloc(&p, &b, 0, 1 << 30, pg, GTT | W));
	CHECK(b.offset >= (1ull << 32) && b.offset % pg == 0);
	kfdm_counters(p.m, NULL, NULL, st1);
	CHECK_EQ(st1[KFDM_STAT_BOS_LIVE], st0[KFDM_STAT_BOS_LIVE] + 2);
	CHECK_EQ(st1[KFDM_STAT_BYTES_LIVE], st0[KFDM_STAT_BYTES_LIVE] + 5 * GiB + pg);
	struct kfd_ioctl_free_memory_of_gpu_args f = { .handle = big.handle };
	OK(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_FREE_MEMORY_OF_GPU, &f));
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_FREE_MEMORY_OF_GPU, &f), -EINVAL);
	CHECK_EQ(big.cpu[5 * GiB - 1], 0);                                  /* freed: hole punched */
	munmap(big.cpu, 5 * GiB);
	/* a process that holds a VM and BOs cannot be the target of a restore */
	struct kfd_criu_device_bucket d[2] = { 0 };
	struct kfd_criu_bo_bucket bb[1] = { 0 };
	uint8_t priv[256] = { 0 };
	struct kfd_ioctl_criu_args a = { .devices = (uintptr_t)d, .bos = (uintptr_t)bb, .priv_data = (uintptr_t)priv,
					 .num_devices = 2, .num_bos = 0, .priv_data_size = 56 };
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL);
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_UNPAUSE), -EINVAL);        /* not paused */
	a.pid = 1u << 30;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESUME), -ESRCH);
	a.op = 77;
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_CRIU_OP, &a), -EINVAL);
	munmap(b.cpu, pg);
	f.handle = b.handle;
	OK(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_FREE_MEMORY_OF_GPU, &f));
	proc_close(&p);
}

/* The workload of the dump tests: BOs of every kind on both GPUs. */
static unsigned make_bos(struct proc *p, struct bo *bos)
{
	static const struct { uint32_t gi; uint64_t size; uint32_t flags; } L[] = {
		{ 0, 1, VRAM | W }, { 0, 768, VRAM | W }, { 0, 1, DOORBELL | W }, { 0, 512, GTT | W },
		{ 1, 3 * 256 + 1, VRAM | W }, { 1, 4, GTT }, { 1, 1, MMIO | W }, { 1, 1, DOORBELL | W },
	};
	unsigned n = sizeof(L) / sizeof(L[0]);
	uint64_t va = 1ull << 36;
	for (unsigned i = 0; i < n; i++) {
		OK(alloc(p, &bos[i], L[i].gi, va, L[i].size * pg, L[i].flags));
		va += L[i].size * pg + (1 << 20);
		bos[i].seed = 100 + i;
		if (bos[i].cpu && (L[i].flags & W)) {
			fill(bos[i].cpu, bos[i].size, bos[i].seed);
		} else if (bos[i].cpu) {                 /* not writable by the CPU here: GPU work fills it */
			uint8_t *tmp = malloc(bos[i].size);
			fill(tmp, bos[i].size, bos[i].seed);
			OK(kfdm_queue_write(p->m, p->tok, bos[i].handle, 0, tmp, bos[i].size));
			free(tmp);
		}
	}
	return n;
}

/* bucket order = per GPU, by handle; sizes, flags, user gpu_ids, fds */
static void check_buckets(struct image *img, struct bo *bos, unsigned n)
{
	unsigned k = 0;
	for (unsigned gi = 0; gi < 2; gi++)
		for (unsigned i = 0; i < n; i++) {
			if (bos[i].gi != gi)
				continue;
			struct kfd_criu_bo_bucket *b = &img->bo[k++];
			CHECK_EQ(b->addr, bos[i].va);
			CHECK_EQ(b->size, bos[i].size);
			CHECK_EQ(b->offset, bos[i].offset);
			CHECK_EQ(b->gpu_id, GPUS[gi].gpu_id);
			CHECK_EQ(b->alloc_flags, bos[i].flags);
			if (img->content[k - 1])
				CHECK(same(img->content[k - 1], b->size, bos[i].seed));
		}
	CHECK_EQ(k, n);
	CHECK_EQ(img->dev[0].actual_gpu_id, GPUS[0].gpu_id);
	CHECK_EQ(img->dev[1].user_gpu_id, GPUS[1].gpu_id);
}

static void test_b_dump_in_process(struct image *img)
{
	g_test = "b: PROCESS_INFO, CHECKPOINT, SDMA reads, UNPAUSE";
	struct proc p;
	proc_open(&p);
	acquire(&p);
	struct bo bos[8];
	unsigned n = make_bos(&p, bos);
	struct kfd_ioctl_criu_args a = { 0 };
	uint8_t priv[1024];
	struct kfd_criu_device_bucket d[2];
	struct kfd_criu_bo_bucket bb[16];
	a.devices = (uintptr_t)d;
	a.bos = (uintptr_t)bb;
	a.priv_data = (uintptr_t)priv;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -EINVAL);    /* PROCESS_INFO first */
	CHECK_EQ(kfdm_paused(p.m, getpid()), 0);
	struct kfd_ioctl_criu_args info = { 0 };
	OK(criu(&p, p.tok, &info, KFD_CRIU_OP_PROCESS_INFO));
	CHECK_EQ(info.pid, getpid());
	CHECK_EQ(kfdm_paused(p.m, getpid()), 1);
	uint64_t st[KFDM_STAT_COUNT];
	kfdm_counters(p.m, NULL, NULL, st);
	uint8_t x = 1;
	CHECK_EQ(kfdm_queue_write(p.m, p.tok, bos[0].handle, 0, &x, 1), -EAGAIN);  /* paused */
	uint64_t st2[KFDM_STAT_COUNT];
	kfdm_counters(p.m, NULL, NULL, st2);
	CHECK_EQ(st2[KFDM_STAT_PAUSED_REFUSED], st[KFDM_STAT_PAUSED_REFUSED] + 1);
	/* CHECKPOINT must get exactly what PROCESS_INFO promised */
	a = info;
	a.devices = (uintptr_t)d;
	a.bos = (uintptr_t)bb;
	a.priv_data = 0;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -EINVAL);
	a.priv_data = (uintptr_t)priv;
	a.num_bos--;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -EINVAL);
	a.num_bos++;
	a.priv_data_size--;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -EINVAL);
	a.priv_data_size++;
	a.num_devices = 1;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -EINVAL);
	/* an export that fails (no dmabuf directory) leaves no fd and no count behind */
	char dd[300];
	snprintf(dd, sizeof(dd), "%s/dmabuf", g_dir);
	OK(rmdir(dd));
	int fds = open_fds();
	a.num_devices = 2;
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -ENOENT);
	CHECK_EQ(open_fds(), fds);
	kfdm_counters(p.m, NULL, NULL, st2);
	CHECK_EQ(st2[KFDM_STAT_DMABUFS], st[KFDM_STAT_DMABUFS]);
	OK(mkdir(dd, 0700));
	dump_all(&p, p.tok, img, n);             /* PROCESS_INFO again (still paused), CHECKPOINT, SDMA */
	CHECK_EQ(open_fds(), fds);
	check_buckets(img, bos, n);
	kfdm_counters(p.m, NULL, NULL, st2);
	CHECK_EQ(st2[KFDM_STAT_DMABUFS], st[KFDM_STAT_DMABUFS] + 5);
	/* the non-writable GTT BO was exported read-only: checked through a fresh CHECKPOINT */
	a = img->info;
	a.devices = (uintptr_t)d;
	a.bos = (uintptr_t)bb;
	a.priv_data = (uintptr_t)priv;
	OK(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT));
	for (unsigned i = 0; i < n; i++)
		if (bb[i].dmabuf_fd != KFD_INVALID_FD) {
			int fl = fcntl((int)bb[i].dmabuf_fd, F_GETFL);
			CHECK_EQ(fl & O_ACCMODE, (bb[i].alloc_flags & W) ? O_RDWR : O_RDONLY);
			CHECK(fcntl((int)bb[i].dmabuf_fd, F_GETFD) & FD_CLOEXEC);
			if (i == 1) {                /* SDMA writes into a dmabuf land in the process's view */
				struct sdma s;
				sdma_open(&s, 0);
				uint8_t *h = host_buf(bb[i].size);
				fill(h, bb[i].size, 999);
				sdma_copy(&s, (int)bb[i].dmabuf_fd, h, bb[i].size, true);
				CHECK(same(bos[1].cpu, bos[1].size, 999));
				fill(h, bb[i].size, bos[1].seed);
				sdma_copy(&s, (int)bb[i].dmabuf_fd, h, bb[i].size, true);
				munmap(h, bb[i].size);
				sdma_close(&s);
			}
			close((int)bb[i].dmabuf_fd);
		}
	OK(criu(&p, p.tok, &a, KFD_CRIU_OP_UNPAUSE));
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_UNPAUSE), -EINVAL);
	CHECK_EQ(kfdm_paused(p.m, getpid()), 0);
	OK(kfdm_queue_write(p.m, p.tok, bos[0].handle, 0, bos[0].cpu, 1));   /* runs again */
	for (unsigned i = 0; i < n; i++)
		if (bos[i].cpu)
			CHECK(same(bos[i].cpu, bos[i].size, bos[i].seed));
	proc_close(&p);
}

/* fork() with a pipe each way: in each process, *rfd reads what the other writes to its *wfd (the
 * other ends are closed; a reader sees EOF once the other side has gone). */
static pid_t fork_with_pipes(int *rfd, int *wfd)
{
	int down[2], up[2];
	OK(pipe(down));
	OK(pipe(up));
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0) {
		close(down[1]);
		close(up[0]);
		*rfd = down[0];
		*wfd = up[1];
	} else {
		close(down[0]);
		close(up[1]);
		*rfd = up[0];
		*wfd = down[1];
	}
	return pid;
}

static void wr(int fd, char c) { CHECK_EQ(write(fd, &c, 1), 1); }
static char rd(int fd) { char c = 0; CHECK_EQ(read(fd, &c, 1), 1); return c; }

/* RESTORE in a fresh child, error paths first, SDMA writes, RESUME from the parent. */
static void test_c_restore(struct image *img)
{
	g_test = "c: RESTORE in a clean process, RESUME";
	int rfd, wfd;
	pid_t pid = fork_with_pipes(&rfd, &wfd);
	if (pid == 0) {
		struct proc p;
		proc_open(&p);
		struct kfd_ioctl_criu_args a = img->info;
		struct kfd_criu_device_bucket d[2];
		struct kfd_criu_bo_bucket bb[16];
		uint8_t priv[1024];
		memcpy(priv, img->priv, a.priv_data_size);
		for (unsigned i = 0; i < 2; i++) {
			d[i] = img->dev[i];
			d[i].drm_fd = (uint32_t)p.render[i];
		}
		a.devices = (uintptr_t)d;
		a.bos = (uintptr_t)bb;
		a.priv_data = (uintptr_t)priv;
#define RESET_BOS() do { for (unsigned i = 0; i < a.num_bos; i++) { bb[i] = img->bo[i]; \
	bb[i].dmabuf_fd = 0; bb[i].restored_offset = 0; } } while (0)
		RESET_BOS();
		d[1].actual_gpu_id = 0x7777;                             /* a GPU this host lacks */
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL);
		d[1].actual_gpu_id = GPUS[1].gpu_id;
		d[1].drm_fd = (uint32_t)p.render[0];                     /* the wrong render node */
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL);
		d[1].drm_fd = (uint32_t)p.render[1];
		priv[40] ^= 1;                                           /* priv data it did not write */
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL);
		priv[40] ^= 1;
		a.priv_data_size -= 8;
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL);
		a.priv_data_size += 8;
		bb[2].addr += pg;                                        /* bucket and priv disagree */
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL);
		RESET_BOS();
		int fds = open_fds();
		OK(kfdm_inject(p.m, KFDM_OP_RESTORE, EIO, 0, 1));
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EIO); /* injected: nothing changed */
		OK(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE));
		CHECK_EQ(open_fds(), fds + 5);                           /* one fresh dmabuf per VRAM/GTT BO */
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_RESTORE), -EINVAL); /* no longer clean */
		struct sdma s[2];
		sdma_open(&s[0], 0);
		sdma_open(&s[1], 1);
		for (unsigned i = 0; i < a.num_bos; i++) {
			CHECK_EQ(bb[i].addr, img->bo[i].addr);
			unsigned gi = bb[i].gpu_id == GPUS[0].gpu_id ? 0 : 1;
			if (!img->content[i]) {
				CHECK_EQ(bb[i].dmabuf_fd, KFD_INVALID_FD);
				continue;
			}
			CHECK(bb[i].restored_offset != img->bo[i].offset);    /* fresh memory */
			uint8_t *view = mmap(NULL, bb[i].size, PROT_READ, MAP_SHARED, p.render[gi],
					     (off_t)bb[i].restored_offset);
			CHECK(view != MAP_FAILED);
			for (uint64_t k = 0; k < bb[i].size; k += pg)
				CHECK_EQ(view[k], 0);
			sdma_copy(&s[gi], (int)bb[i].dmabuf_fd, img->content[i], bb[i].size, true);
			close((int)bb[i].dmabuf_fd);
			munmap(view, bb[i].size);
		}
		sdma_close(&s[0]);
		sdma_close(&s[1]);
		CHECK_EQ(kfdm_paused(p.m, getpid()), 1);                 /* until RESUME */
		uint64_t h = (uint64_t)bb[0].gpu_id << 32 | 1;
		uint8_t x = 0;
		CHECK_EQ(kfdm_queue_write(p.m, p.tok, h, 0, &x, 1), -EAGAIN);
		wr(wfd, 'r');
		CHECK_EQ(rd(rfd), 'g');
		CHECK_EQ(kfdm_paused(p.m, getpid()), 0);
		for (unsigned i = 0; i < a.num_bos; i++) {
			if (!img->content[i])
				continue;
			unsigned gi = bb[i].gpu_id == GPUS[0].gpu_id ? 0 : 1;
			uint8_t *view = mmap(NULL, bb[i].size, PROT_READ, MAP_SHARED, p.render[gi],
					     (off_t)bb[i].restored_offset);
			CHECK(view != MAP_FAILED);
			CHECK(!memcmp(view, img->content[i], bb[i].size));  /* byte-exact */
			munmap(view, bb[i].size);
		}
		proc_close(&p);
		_exit(0);
	}
	struct proc me;
	proc_open(&me);
	CHECK_EQ(rd(rfd), 'r');
	struct kfd_ioctl_criu_args a = { .pid = (uint32_t)pid };
	OK(kfdm_inject(me.m, KFDM_OP_RESUME, EIO, 0, 1));
	CHECK_EQ(criu(&me, me.tok, &a, KFD_CRIU_OP_RESUME), -EIO);
	CHECK_EQ(kfdm_paused(me.m, pid), 1);
	OK(criu(&me, me.tok, &a, KFD_CRIU_OP_RESUME));
	OK(criu(&me, me.tok, &a, KFD_CRIU_OP_RESUME));                   /* again: nothing to resume */
	CHECK_EQ(kfdm_paused(me.m, pid), 0);
	wr(wfd, 'g');
	int status;
	CHECK_EQ(waitpid(pid, &status, 0), pid);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	a.pid = (uint32_t)pid;
	CHECK_EQ(criu(&me, me.tok, &a, KFD_CRIU_OP_RESUME), -ESRCH);     /* gone */
	close(wfd);
	close(rfd);
	proc_close(&me);
}

static void drop_caps(void)
{
	struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct d[2];
	memset(d, 0, sizeof(d));
	OK((int)syscall(SYS_capset, &h, d));
}

/* The dumper is another process: it may use the target's fd only as its
 * ptrace parent, and only for CRIU ops; CRIU ops need the capability. */
static void test_d_dumper_process(void)
{
	g_test = "d: ptrace parent, capability, dead processes";
	int rfd, wfd;
	pid_t pid = fork_with_pipes(&rfd, &wfd);
	if (pid == 0) {
		struct proc p;
		proc_open(&p);
		acquire(&p);
		struct bo bos[8];
		make_bos(&p, bos);
		CHECK_EQ(write(wfd, &p.tok, sizeof(p.tok)), sizeof(p.tok));
		CHECK_EQ(rd(rfd), 'c');
		for (unsigned i = 0; i < 8; i++)      /* what the dump saw is still there */
			if (bos[i].cpu)
				CHECK(same(bos[i].cpu, bos[i].size, bos[i].seed));
		drop_caps();
		struct kfd_ioctl_criu_args a = { 0 };
		CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_PROCESS_INFO), -EACCES);
		struct kfd_ioctl_get_version_args v;
		OK(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_GET_VERSION, &v));     /* not a CRIU op */
		_exit(0);
	}
	struct proc me;
	proc_open(&me);
	int64_t tok;
	CHECK_EQ(read(rfd, &tok, sizeof(tok)), sizeof(tok));
	struct kfd_ioctl_criu_args a = { 0 };
	CHECK_EQ(criu(&me, tok, &a, KFD_CRIU_OP_PROCESS_INFO), -EBADF);  /* not its tracer */
	OK((int)ptrace(PTRACE_SEIZE, pid, 0, 0));
	struct kfd_ioctl_get_version_args v;
	CHECK_EQ(kfdm_ioctl(me.m, tok, AMDKFD_IOC_GET_VERSION, &v), -EBADF); /* CRIU ops only */
	struct image img;
	dump_all(&me, tok, &img, 8);
	CHECK_EQ(kfdm_paused(me.m, pid), 1);
	OK(criu(&me, tok, &a, KFD_CRIU_OP_UNPAUSE));
	CHECK_EQ(kfdm_paused(me.m, pid), 0);
	image_free(&img);
	uint64_t st[KFDM_STAT_COUNT];
	kfdm_counters(me.m, NULL, NULL, st);
	wr(wfd, 'c');
	int status;
	CHECK_EQ(waitpid(pid, &status, 0), pid);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	/* the child is gone: the next open releases its KFD process and BOs */
	uint64_t st2[KFDM_STAT_COUNT];
	CHECK_EQ(kfdm_open(me.m), me.tok);
	kfdm_counters(me.m, NULL, NULL, st2);
	CHECK_EQ(st2[KFDM_STAT_PROCS_LIVE], st[KFDM_STAT_PROCS_LIVE] - 1);
	CHECK_EQ(st2[KFDM_STAT_BOS_LIVE], st[KFDM_STAT_BOS_LIVE] - 8);
	CHECK_EQ(criu(&me, tok, &a, KFD_CRIU_OP_PROCESS_INFO), -EBADF);  /* its token is stale */
	close(wfd);
	close(rfd);
	proc_close(&me);
}

/* An injected failure at each op: the op's errno, no side effect, counted. */
static void test_e_injection(void)
{
	g_test = "e: failure injection at each op";
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid) {
		int status;
		CHECK_EQ(waitpid(pid, &status, 0), pid);
		CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
		return;
	}
	struct proc p;
	proc_open(&p);
	uint64_t c0[KFDM_OP_COUNT], f0[KFDM_OP_COUNT], s0[KFDM_STAT_COUNT];
	uint64_t c1[KFDM_OP_COUNT], f1[KFDM_OP_COUNT], s1[KFDM_STAT_COUNT];
	struct kfd_ioctl_acquire_vm_args av = { .drm_fd = (uint32_t)p.render[0], .gpu_id = GPUS[0].gpu_id };
	OK(kfdm_inject(p.m, KFDM_OP_ACQUIRE_VM, ENOMEM, 0, 1));
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_ACQUIRE_VM, &av), -ENOMEM);
	acquire(&p);
	struct bo b;
	OK(kfdm_inject(p.m, KFDM_OP_ALLOC, ENOSPC, 1, 1));       /* the second alloc fails */
	OK(alloc(&p, &b, 0, 1 << 30, pg, VRAM | W));
	kfdm_counters(p.m, c0, f0, s0);
	struct bo b2;
	CHECK_EQ(alloc(&p, &b2, 0, 2ull << 30, pg, VRAM | W), -ENOSPC);
	kfdm_counters(p.m, c1, f1, s1);
	CHECK_EQ(s1[KFDM_STAT_BOS_LIVE], s0[KFDM_STAT_BOS_LIVE]);
	CHECK_EQ(c1[KFDM_OP_ALLOC], c0[KFDM_OP_ALLOC] + 1);
	CHECK_EQ(f1[KFDM_OP_ALLOC], f0[KFDM_OP_ALLOC] + 1);
	struct kfd_ioctl_get_version_args v;
	OK(kfdm_inject(p.m, KFDM_OP_GET_VERSION, ENODEV, 0, 1));
	CHECK_EQ(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_GET_VERSION, &v), -ENODEV);
	OK(kfdm_ioctl(p.m, p.tok, AMDKFD_IOC_GET_VERSION, &v));
	struct kfd_ioctl_criu_args a = { 0 };
	OK(kfdm_inject(p.m, KFDM_OP_PROCESS_INFO, EIO, 0, 1));
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_PROCESS_INFO), -EIO);
	CHECK_EQ(kfdm_paused(p.m, getpid()), 0);                 /* not paused */
	OK(criu(&p, p.tok, &a, KFD_CRIU_OP_PROCESS_INFO));
	struct kfd_criu_device_bucket d[2];
	struct kfd_criu_bo_bucket bb[2];
	uint8_t priv[256];
	a.devices = (uintptr_t)d;
	a.bos = (uintptr_t)bb;
	a.priv_data = (uintptr_t)priv;
	kfdm_counters(p.m, NULL, NULL, s0);
	OK(kfdm_inject(p.m, KFDM_OP_CHECKPOINT, EFAULT, 0, 1));
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_CHECKPOINT), -EFAULT);
	kfdm_counters(p.m, NULL, NULL, s1);
	CHECK_EQ(s1[KFDM_STAT_DMABUFS], s0[KFDM_STAT_DMABUFS]);  /* nothing exported */
	OK(kfdm_inject(p.m, KFDM_OP_UNPAUSE, EIO, 0, 1));
	CHECK_EQ(criu(&p, p.tok, &a, KFD_CRIU_OP_UNPAUSE), -EIO);
	CHECK_EQ(kfdm_paused(p.m, getpid()), 1);                 /* still paused */
	OK(criu(&p, p.tok, &a, KFD_CRIU_OP_UNPAUSE));
	OK(kfdm_inject(p.m, KFDM_OP_QUEUE, EIO, 0, 1));
	uint8_t x = 3;
	CHECK_EQ(kfdm_queue_write(p.m, p.tok, b.handle, 0, &x, 1), -EIO);
	OK(kfdm_queue_write(p.m, p.tok, b.handle, 0, &x, 1));
	CHECK_EQ(b.cpu[0], 3);
	OK(kfdm_inject(p.m, KFDM_OP_OPEN, EMFILE, 0, 1));
	CHECK_EQ(kfdm_open(p.m), -EMFILE);
	CHECK_EQ(kfdm_open(p.m), p.tok);
	CHECK_EQ(kfdm_inject(p.m, KFDM_OP_COUNT, EIO, 0, 1), -EINVAL);
	_exit(0);
}

/* CRIU restores tasks into a time namespace of their own, where /proc/<pid>/stat
 * start times read shifted by its boottime offset: a process there and one
 * outside must still agree on which KFD process is whose. */
static void test_f_time_namespace(void)
{
	g_test = "f: a process in another time namespace";
	int rfd, wfd;
	pid_t mid = fork_with_pipes(&rfd, &wfd);
	if (mid == 0) {
		if (unshare(CLONE_NEWTIME)) {
			fprintf(stderr, "test_kfd: no time namespaces here (%s): test f skipped\n", strerror(errno));
			pid_t none = 0;
			CHECK_EQ(write(wfd, &none, sizeof(none)), sizeof(none));
			_exit(0);
		}
		int fd = open("/proc/self/timens_offsets", O_WRONLY);
		CHECK(fd >= 0);
		const char *off = "boottime 1000 0\n";
		CHECK_EQ(write(fd, off, strlen(off)), (long)strlen(off));
		close(fd);
		pid_t g = fork();                            /* the child enters the new namespace */
		CHECK(g >= 0);
		if (g == 0) {
			struct proc p;
			proc_open(&p);
			acquire(&p);
			struct bo b;
			OK(alloc(&p, &b, 0, 1ull << 33, pg, VRAM | W));
			CHECK_EQ(kfdm_open(p.m), p.tok);         /* still the same process to itself */
			pid_t me = getpid();
			CHECK_EQ(write(wfd, &me, sizeof(me)), sizeof(me));
			CHECK_EQ(rd(rfd), 'q');
			CHECK_EQ(kfdm_paused(p.m, getpid()), 0);
			_exit(0);
		}
		int st;
		CHECK_EQ(waitpid(g, &st, 0), g);
		_exit(WIFEXITED(st) ? WEXITSTATUS(st) : 1);
	}
	pid_t g;
	CHECK_EQ(read(rfd, &g, sizeof(g)), sizeof(g));
	if (g) {
		struct proc me;
		proc_open(&me);
		CHECK_EQ(kfdm_open(me.m), me.tok);           /* would release g's KFD process if it looked dead */
		CHECK_EQ(kfdm_paused(me.m, g), 0);
		proc_close(&me);
		wr(wfd, 'q');
	}
	int st;
	CHECK_EQ(waitpid(mid, &st, 0), mid);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	close(rfd);
	close(wfd);
}

/* Two states (two model instances, two locks) used by two threads of one
 * process at once: each CHECKPOINT lists its own process's BOs only. */
struct twin { char dir[300]; uint64_t va0; };

static void *twin_dumps(void *arg)
{
	struct twin *t = arg;
	struct kfdm *m = kfdm_attach(t->dir);
	CHECK(m != NULL);
	int64_t tok = kfdm_open(m);
	CHECK(tok > 0);
	char path[400];
	snprintf(path, sizeof(path), "%s/renderD%u", t->dir, GPUS[0].minor);
	int render = open(path, O_RDWR | O_CLOEXEC);
	CHECK(render >= 0);
	struct kfd_ioctl_acquire_vm_args av = { .drm_fd = (uint32_t)render, .gpu_id = GPUS[0].gpu_id };
	OK(kfdm_ioctl(m, tok, AMDKFD_IOC_ACQUIRE_VM, &av));
	enum { N = 64 };
	for (unsigned i = 0; i < N; i++) {
		struct kfd_ioctl_alloc_memory_of_gpu_args a = {
			.va_addr = t->va0 + i * pg, .size = pg, .gpu_id = GPUS[0].gpu_id, .flags = DOORBELL };
		if (i)
			a.flags = GTT | W;
		OK(kfdm_ioctl(m, tok, AMDKFD_IOC_ALLOC_MEMORY_OF_GPU, &a));
	}
	struct kfd_criu_device_bucket d[2];
	struct kfd_criu_bo_bucket bb[N];
	uint8_t priv[4096];
	for (unsigned round = 0; round < 200; round++) {
		struct kfd_ioctl_criu_args a = { .op = KFD_CRIU_OP_PROCESS_INFO };
		OK(kfdm_ioctl(m, tok, AMDKFD_IOC_CRIU_OP, &a));
		CHECK_EQ(a.num_bos, N);
		CHECK(a.priv_data_size <= sizeof(priv));
		a.devices = (uintptr_t)d;
		a.bos = (uintptr_t)bb;
		a.priv_data = (uintptr_t)priv;
		a.op = KFD_CRIU_OP_CHECKPOINT;
		OK(kfdm_ioctl(m, tok, AMDKFD_IOC_CRIU_OP, &a));
		for (unsigned i = 0; i < N; i++) {
			CHECK_EQ(bb[i].addr, t->va0 + i * pg);       /* its own BOs, in handle order */
			if (bb[i].dmabuf_fd != KFD_INVALID_FD)
				close((int)bb[i].dmabuf_fd);
		}
		a.op = KFD_CRIU_OP_UNPAUSE;
		OK(kfdm_ioctl(m, tok, AMDKFD_IOC_CRIU_OP, &a));
	}
	close(render);
	kfdm_detach(m);
	return NULL;
}

static void test_g_two_states_at_once(void)
{
	g_test = "g: two model states checkpointed by two threads at once";
	pid_t pid = fork();                       /* a fresh process: one KFD process per state */
	CHECK(pid >= 0);
	if (pid) {
		int status;
		CHECK_EQ(waitpid(pid, &status, 0), pid);
		CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
		return;
	}
	struct twin t[2];
	pthread_t th[2];
	for (unsigned i = 0; i < 2; i++) {
		snprintf(t[i].dir, sizeof(t[i].dir), "%s/twin%u", g_dir, i);
		OK(mkdir(t[i].dir, 0700));
		OK(kfdm_create(t[i].dir, GPUS, 2, 8));
		t[i].va0 = (i + 1) * 0x100000000ull;
	}
	for (unsigned i = 0; i < 2; i++)
		OK(pthread_create(&th[i], NULL, twin_dumps, &t[i]));
	for (unsigned i = 0; i < 2; i++)
		OK(pthread_join(th[i], NULL));
	_exit(0);
}

int main(int argc, char **argv)
{
	pg = (uint64_t)sysconf(_SC_PAGESIZE);
	const char *base = argc > 1 ? argv[1] : "/dev/shm";
	snprintf(g_dir, sizeof(g_dir), "%s/kfd-model-test.XXXXXX", base);
	CHECK(mkdtemp(g_dir) != NULL);
	int r = kfdm_create(g_dir, GPUS, 2, KFD_IOCTL_MINOR_VERSION);
	if (r)
		fail(__LINE__, "kfdm_create(%s): %s", g_dir, strerror(-r));
	struct kfdm_gpu dup[2] = { GPUS[0], GPUS[0] };
	char other[300];
	snprintf(other, sizeof(other), "%s/other", g_dir);
	OK(mkdir(other, 0700));
	CHECK_EQ(kfdm_create(other, dup, 2, 8), -EINVAL);     /* gpu_ids and minors are unique */
	rmdir(other);
	test_a_memory_rules();
	struct image img;
	test_b_dump_in_process(&img);
	test_c_restore(&img);
	image_free(&img);
	test_d_dumper_process();
	test_e_injection();
	test_f_time_namespace();
	test_g_two_states_at_once();
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
	if (system(cmd))
		fprintf(stderr, "warning: could not remove %s\n", g_dir);
	printf("ALL KFD MODEL TESTS PASSED\n");
	return 0;
}
