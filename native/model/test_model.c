/*
 * test_model.c - tests of the SDMA SOFTWARE MODEL (libdrm_amdgpu_model.so).
 *
 * THIS TESTS A MODEL, NOT A GPU.  It drives the model only through the
 * libdrm_amdgpu API (plus the model-only vramd_model_* counters) and checks
 * the behaviour documented in docs/sdma-model.md.  Nothing measured here is a
 * hardware number.
 *
 * Run: python native/model/build.py --test OUT_DIR   (add --tsan for ThreadSanitizer)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <amdgpu.h>
#include <amdgpu_drm.h>
#include "vramd_model.h"

#define MiB (1024ull * 1024ull)

#include "test_check.h"

static uint64_t page(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

/* ---------------------------------------------------------------- device */

struct gpu {
	int fd; /* stands for a render node */
	amdgpu_device_handle dev;
};

/* Every gpu_open uses a fresh memfd, so the model reads its configuration
 * again (the same fd/file would share one refcounted device handle). */
static void gpu_open(struct gpu *g, const char *family, const char *rings, const char *delay_us)
{
	uint32_t major, minor;
	setenv("VRAMD_SDMA_MODEL_FAMILY", family, 1);
	setenv("VRAMD_SDMA_MODEL_RINGS", rings, 1);
	if (delay_us)
		setenv("VRAMD_SDMA_MODEL_PACKET_DELAY_US", delay_us, 1);
	else
		unsetenv("VRAMD_SDMA_MODEL_PACKET_DELAY_US");
	g->fd = memfd_create("render-node", MFD_CLOEXEC);
	CHECK(g->fd >= 0);
	OK(amdgpu_device_initialize(g->fd, &major, &minor, &g->dev));
	CHECK_EQ(major, 3);
}

static void gpu_close(struct gpu *g)
{
	OK(amdgpu_device_deinitialize(g->dev));
	close(g->fd);
}

static void stats(struct gpu *g, uint64_t out[VRAMD_MODEL_STAT_COUNT])
{
	CHECK_EQ(vramd_model_stats_ex(g->dev, out, VRAMD_MODEL_STAT_COUNT), VRAMD_MODEL_STAT_COUNT);
}

static void last_error_contains(struct gpu *g, const char *needle, int line)
{
	char buf[600];
	OK(vramd_model_last_error(g->dev, buf, sizeof(buf)));
	if (!strstr(buf, needle))
		fail(line, "last error \"%s\" does not contain \"%s\"", buf, needle);
}
#define LAST_ERROR(g, s) last_error_contains(g, s, __LINE__)

/* ------------------------------------------------------------ buffers */

struct buf {
	amdgpu_bo_handle bo;
	amdgpu_va_handle vah;
	uint64_t va, size;
	uint8_t *cpu;   /* host view (userptr memory, dma-buf mmap, or IB mapping) */
	int memfd;      /* for dma-bufs */
};

static void fill(uint8_t *p, uint64_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 1;
	for (uint64_t i = 0; i < n; i++) {
		x ^= x << 13; x ^= x >> 17; x ^= x << 5;
		p[i] = (uint8_t)x;
	}
}

static void map_va(struct gpu *g, struct buf *b)
{
	OK(amdgpu_va_range_alloc(g->dev, amdgpu_gpu_va_range_general, b->size, 0x1000, 0, &b->va,
				 &b->vah, 0));
	OK(amdgpu_bo_va_op(b->bo, 0, b->size, b->va, 0, AMDGPU_VA_OP_MAP));
}

/* A memfd standing for a KFD-exported dma-buf, imported and mapped. */
static struct buf dmabuf(struct gpu *g, uint64_t size, uint32_t seed)
{
	struct buf b = { .size = size };
	struct amdgpu_bo_import_result res;
	b.memfd = memfd_create("dmabuf", MFD_CLOEXEC);
	CHECK(b.memfd >= 0);
	OK(ftruncate(b.memfd, (off_t)size));
	b.cpu = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, b.memfd, 0);
	CHECK(b.cpu != MAP_FAILED);
	if (seed)
		fill(b.cpu, size, seed);
	OK(amdgpu_bo_import(g->dev, amdgpu_bo_handle_type_dma_buf_fd, (uint32_t)b.memfd, &res));
	CHECK_EQ(res.alloc_size, size);
	b.bo = res.buf_handle;
	map_va(g, &b);
	return b;
}

/* Private anonymous host memory wrapped as a userptr BO and mapped. */
static struct buf userptr(struct gpu *g, uint64_t size, uint32_t seed)
{
	struct buf b = { .size = size, .memfd = -1 };
	b.cpu = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(b.cpu != MAP_FAILED);
	if (seed)
		fill(b.cpu, size, seed);
	OK(amdgpu_create_bo_from_user_mem(g->dev, b.cpu, size, &b.bo));
	map_va(g, &b);
	return b;
}

static struct buf ib_alloc(struct gpu *g, uint64_t size)
{
	struct buf b = { .size = size, .memfd = -1 };
	struct amdgpu_bo_alloc_request req = { .alloc_size = size, .phys_alignment = 0x1000,
					       .preferred_heap = AMDGPU_GEM_DOMAIN_GTT };
	OK(amdgpu_bo_alloc(g->dev, &req, &b.bo));
	map_va(g, &b);
	void *p;
	OK(amdgpu_bo_cpu_map(b.bo, &p));
	b.cpu = p;
	return b;
}

/* Unmaps, frees the VA range and the BO.  A dma-buf's memfd and host view
 * go too; userptr memory stays (see userptr_free). */
static void buf_free(struct buf *b)
{
	OK(amdgpu_bo_va_op(b->bo, 0, b->size, b->va, 0, AMDGPU_VA_OP_UNMAP));
	OK(amdgpu_va_range_free(b->vah));
	OK(amdgpu_bo_free(b->bo));
	if (b->memfd >= 0) {
		munmap(b->cpu, b->size);
		close(b->memfd);
	}
}

static void userptr_free(struct buf *b)
{
	buf_free(b);
	munmap(b->cpu, b->size);
}

static void ib_free(struct buf *b)
{
	OK(amdgpu_bo_cpu_unmap(b->bo));
	buf_free(b);
}

/* ------------------------------------------------------------ IB building */

struct ib {
	uint32_t *dw;
	uint32_t n;
};

static void emit(struct ib *ib, uint32_t v) { ib->dw[ib->n++] = v; }

/* count = exactly what goes into the packet's count dword */
static void copy_pkt(struct ib *ib, uint64_t src, uint64_t dst, uint32_t count)
{
	emit(ib, 0x00000001);  /* op COPY, sub_op LINEAR */
	emit(ib, count);
	emit(ib, 0);
	emit(ib, (uint32_t)src);
	emit(ib, (uint32_t)(src >> 32));
	emit(ib, (uint32_t)dst);
	emit(ib, (uint32_t)(dst >> 32));
}

static void pad8(struct ib *ib, bool burst)
{
	uint32_t pad = (8 - (ib->n & 7)) & 7;
	if (!pad)
		return;
	if (burst) {
		emit(ib, (pad - 1) << 16);  /* NOP with count = pad-1 dwords to skip */
		for (uint32_t i = 1; i < pad; i++)
			emit(ib, 0xdeadbeef);    /* skipped payload */
	} else {
		for (uint32_t i = 0; i < pad; i++)
			emit(ib, 0);
	}
}

/* Copies n bytes as packets of at most max bytes; AI encoding: count = bytes-1. */
static void copy_range(struct ib *ib, uint64_t src, uint64_t dst, uint64_t n, uint64_t max,
		       bool ai)
{
	while (n) {
		uint64_t c = n < max ? n : max;
		copy_pkt(ib, src, dst, (uint32_t)(ai ? c - 1 : c));
		src += c;
		dst += c;
		n -= c;
	}
}

static uint64_t submit_ex(struct gpu *g, amdgpu_context_handle ctx, unsigned ring, struct buf *ib,
			  uint32_t ndw, amdgpu_bo_handle *bos, unsigned nbos, int expect)
{
	amdgpu_bo_list_handle list = NULL;
	if (nbos)
		OK(amdgpu_bo_list_create(g->dev, nbos, bos, NULL, &list));
	struct amdgpu_cs_ib_info ibi = { .ib_mc_address = ib->va, .size = ndw };
	struct amdgpu_cs_request req = {
		.ip_type = AMDGPU_HW_IP_DMA, .ring = ring, .resources = list,
		.number_of_ibs = 1, .ibs = &ibi,
	};
	int r = amdgpu_cs_submit(ctx, 0, &req, 1);
	if (r != expect)
		fail(__LINE__, "amdgpu_cs_submit returned %d, expected %d", r, expect);
	if (list)
		OK(amdgpu_bo_list_destroy(list));
	return r ? 0 : req.seq_no;
}

static uint64_t submit(struct gpu *g, amdgpu_context_handle ctx, unsigned ring, struct buf *ib,
		       uint32_t ndw, amdgpu_bo_handle a, amdgpu_bo_handle b)
{
	amdgpu_bo_handle bos[3] = { a, b, ib->bo };
	return submit_ex(g, ctx, ring, ib, ndw, bos, 3, 0);
}

static uint32_t wait_fence(amdgpu_context_handle ctx, unsigned ring, uint64_t seq, uint64_t timeout)
{
	struct amdgpu_cs_fence f = { .context = ctx, .ip_type = AMDGPU_HW_IP_DMA, .ring = ring,
				     .fence = seq };
	uint32_t expired = 7;
	OK(amdgpu_cs_query_fence_status(&f, timeout, 0, &expired));
	return expired;
}

static uint64_t reset_flags(amdgpu_context_handle ctx)
{
	uint64_t f = 99;
	OK(amdgpu_cs_query_reset_state2(ctx, &f));
	return f;
}

#define GUILTY (AMDGPU_CTX_QUERY2_FLAGS_GUILTY | AMDGPU_CTX_QUERY2_FLAGS_RESET)

/* ================================================================= tests */

/* (a) dma-buf -> userptr, AI encoding count = bytes - 1, several max-size packets */
static void test_a_dmabuf_to_userptr(void)
{
	g_test = "a: dmabuf->userptr, AI count=bytes-1";
	struct gpu g;
	gpu_open(&g, "141", "2", NULL);
	uint64_t size = 10 * MiB + 3 * page();  /* not a multiple of the 4 MiB packet max */
	struct buf src = dmabuf(&g, size, 11), dst = userptr(&g, size, 0), ib = ib_alloc(&g, 4096);
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));

	struct ib w = { (uint32_t *)ib.cpu, 0 };
	copy_range(&w, src.va, dst.va, size, 4 * MiB, true);
	pad8(&w, true);
	uint64_t seq = submit(&g, ctx, 0, &ib, w.n, src.bo, dst.bo);
	CHECK_EQ(seq, 1);
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), 0);
	CHECK(memcmp(src.cpu, dst.cpu, size) == 0);
	uint64_t s[VRAMD_MODEL_STAT_COUNT];
	stats(&g, s);
	CHECK_EQ(s[VRAMD_MODEL_STAT_BYTES], size);
	CHECK_EQ(s[VRAMD_MODEL_STAT_PACKETS], 3 + 1);  /* 3 copies + 1 burst NOP */
	CHECK_EQ(s[VRAMD_MODEL_STAT_FAULTS] + s[VRAMD_MODEL_STAT_INVALID], 0);
	uint64_t four[4];
	OK(vramd_model_stats(g.dev, four));
	CHECK_EQ(four[1], size);

	/* exactly the max (count 0x3fffff = 4 MiB) in one packet is fine */
	memset(dst.cpu, 0, size);
	w.n = 0;
	copy_pkt(&w, src.va + 5, dst.va + 7, 0x3fffff);
	pad8(&w, false);
	seq = submit(&g, ctx, 0, &ib, w.n, src.bo, dst.bo);
	CHECK_EQ(seq, 2);
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), 0);
	CHECK(memcmp(src.cpu + 5, dst.cpu + 7, 4 * MiB) == 0);
	CHECK(dst.cpu[7 + 4 * MiB] == 0 && dst.cpu[6] == 0);

	OK(amdgpu_cs_ctx_free(ctx));
	buf_free(&src);
	userptr_free(&dst);
	ib_free(&ib);
	gpu_close(&g);
}

/* (b) userptr -> dma-buf; the result is read back through the memfd (pread) */
static void test_b_userptr_to_dmabuf(void)
{
	g_test = "b: userptr->dmabuf";
	struct gpu g;
	gpu_open(&g, "141", "2", NULL);
	uint64_t size = 6 * MiB;
	struct buf src = userptr(&g, size, 22), dst = dmabuf(&g, size, 0), ib = ib_alloc(&g, 4096);
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	struct ib w = { (uint32_t *)ib.cpu, 0 };
	copy_range(&w, src.va, dst.va, size, 4 * MiB, true);
	pad8(&w, false);
	uint64_t seq = submit(&g, ctx, 1, &ib, w.n, src.bo, dst.bo);
	CHECK_EQ(wait_fence(ctx, 1, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), 0);
	uint8_t *back = malloc(size);
	CHECK(back);
	CHECK_EQ(pread(dst.memfd, back, size, 0), (long long)size);
	CHECK(memcmp(back, src.cpu, size) == 0);
	free(back);
	OK(amdgpu_cs_ctx_free(ctx));
	userptr_free(&src);
	buf_free(&dst);
	ib_free(&ib);
	gpu_close(&g);
}

/* (c) CRIU's encoding on AI (count = bytes, 2 MiB packets) copying to the exact
 * end of a mapping: the last packet runs one byte past it -> VM fault. */
static void test_c_criu_encoding_faults(void)
{
	g_test = "c: CRIU count=bytes on AI faults";
	struct gpu g;
	gpu_open(&g, "141", "2", NULL);
	uint64_t size = 3 * MiB;
	struct buf bo = dmabuf(&g, size, 33), stage = userptr(&g, size, 0), ib = ib_alloc(&g, 4096);
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	struct ib w = { (uint32_t *)ib.cpu, 0 };
	copy_range(&w, bo.va, stage.va, size, 2 * MiB, false);  /* count = bytes (CRIU) */
	pad8(&w, false);
	uint64_t seq = submit(&g, ctx, 0, &ib, w.n, bo.bo, stage.bo);

	/* the fence signals (expired) even though the job faulted */
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), GUILTY);
	LAST_ERROR(&g, "VM FAULT");
	LAST_ERROR(&g, "runs past the end of its mapping");
	/* packet 1 (2 MiB + 1 byte, inside the mapping) was copied ... */
	CHECK(memcmp(bo.cpu, stage.cpu, 2 * MiB + 1) == 0);
	/* ... the faulting packet copied nothing */
	for (uint64_t i = 2 * MiB + 1; i < size; i++)
		if (stage.cpu[i] != 0)
			fail(__LINE__, "byte %" PRIu64 " was copied by the faulting packet", i);
	uint64_t s[VRAMD_MODEL_STAT_COUNT];
	stats(&g, s);
	CHECK_EQ(s[VRAMD_MODEL_STAT_FAULTS], 1);
	CHECK_EQ(s[VRAMD_MODEL_STAT_BYTES], 2 * MiB + 1);

	/* a guilty context refuses further work; a new context works */
	submit_ex(&g, ctx, 0, &ib, w.n, (amdgpu_bo_handle[]){ bo.bo, stage.bo, ib.bo }, 3, -ECANCELED);
	amdgpu_context_handle ctx2;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx2));
	CHECK_EQ(reset_flags(ctx2), 0);
	w.n = 0;
	copy_range(&w, bo.va, stage.va, size, 2 * MiB, true);  /* count = bytes - 1 */
	pad8(&w, false);
	seq = submit(&g, ctx2, 0, &ib, w.n, bo.bo, stage.bo);
	CHECK_EQ(wait_fence(ctx2, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx2), 0);
	CHECK(memcmp(bo.cpu, stage.cpu, size) == 0);

	/* with the fault, a context created before it also sees RESET (not GUILTY) */
	amdgpu_context_handle ctx3;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx3));
	w.n = 0;
	copy_pkt(&w, bo.va + size - 16, stage.va, 16);  /* 17 bytes from 16 before the end */
	pad8(&w, false);
	seq = submit(&g, ctx2, 1, &ib, w.n, bo.bo, stage.bo);
	CHECK_EQ(wait_fence(ctx2, 1, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx2), GUILTY);
	CHECK_EQ(reset_flags(ctx3), AMDGPU_CTX_QUERY2_FLAGS_RESET);

	OK(amdgpu_cs_ctx_free(ctx));
	OK(amdgpu_cs_ctx_free(ctx2));
	OK(amdgpu_cs_ctx_free(ctx3));
	buf_free(&bo);
	userptr_free(&stage);
	ib_free(&ib);
	gpu_close(&g);
}

/* one IB, expected to be flagged INVALID with `needle` in the diagnosis */
static void expect_invalid(struct gpu *g, struct buf *ib, uint32_t ndw, amdgpu_bo_handle a,
			   amdgpu_bo_handle b, const char *needle, int line)
{
	amdgpu_context_handle ctx;
	uint64_t before[VRAMD_MODEL_STAT_COUNT], after[VRAMD_MODEL_STAT_COUNT];
	stats(g, before);
	OK(amdgpu_cs_ctx_create(g->dev, &ctx));
	uint64_t seq = submit(g, ctx, 0, ib, ndw, a, b);
	if (wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE) != 1)
		fail(line, "fence did not expire");
	if (reset_flags(ctx) != GUILTY)
		fail(line, "context not guilty");
	stats(g, after);
	if (after[VRAMD_MODEL_STAT_INVALID] != before[VRAMD_MODEL_STAT_INVALID] + 1)
		fail(line, "invalid-packet counter did not move");
	last_error_contains(g, "INVALID PACKET", line);
	last_error_contains(g, needle, line);
	OK(amdgpu_cs_ctx_free(ctx));
}

/* (d) invalid opcode, IB not a multiple of 8 dwords, and friends */
static void test_d_invalid_packets(void)
{
	g_test = "d: invalid packets";
	struct gpu g;
	gpu_open(&g, "141", "2", NULL);
	uint64_t size = 1 * MiB;
	struct buf src = dmabuf(&g, size, 44), dst = userptr(&g, size, 0), ib = ib_alloc(&g, 4096);
	struct ib w = { (uint32_t *)ib.cpu, 0 };

	/* unknown/unmodelled opcode (2 = WRITE) */
	emit(&w, 0x00000002);
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "opcode 2 (WRITE)", __LINE__);

	/* a valid COPY_LINEAR in an IB of 7 dwords (not padded to 8) */
	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 4095);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "not a multiple of 8", __LINE__);
	for (uint64_t i = 0; i < size; i++)
		if (dst.cpu[i])
			fail(__LINE__, "bytes were copied from an invalid IB");

	/* packet cut by the end of the IB */
	w.n = 0;
	emit(&w, 0); emit(&w, 0); emit(&w, 0); emit(&w, 0);
	copy_pkt(&w, src.va, dst.va, 15);
	w.n = 8;
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "cut by the end of the IB", __LINE__);

	/* more than 4 MiB in one packet on AI */
	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 0x400000);  /* = 4 MiB + 1 byte */
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "exceeds the max", __LINE__);

	/* swap bits in the parameter dword */
	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 15);
	w.dw[2] = 2u << 16;
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "parameter", __LINE__);

	/* TMZ bit in the header */
	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 15);
	w.dw[0] |= 1u << 18;
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "TMZ", __LINE__);

	/* burst NOP whose count runs past the IB */
	w.n = 0;
	emit(&w, 9u << 16);
	for (int i = 0; i < 7; i++)
		emit(&w, 0);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "runs past the end of the IB", __LINE__);

	/* overlapping source and destination */
	w.n = 0;
	copy_pkt(&w, src.va, src.va + 8, 63);
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "overlap", __LINE__);

	/* IB not 32-byte aligned */
	w.n = 0;
	for (int i = 0; i < 16; i++)
		emit(&w, 0);
	{
		struct buf off = ib;
		off.va += 4 * 4;
		expect_invalid(&g, &off, 8, src.bo, dst.bo, "32-byte aligned", __LINE__);
	}

	uint64_t s[VRAMD_MODEL_STAT_COUNT];
	stats(&g, s);
	CHECK_EQ(s[VRAMD_MODEL_STAT_INVALID], 9);
	CHECK_EQ(s[VRAMD_MODEL_STAT_BYTES], 0);
	buf_free(&src);
	userptr_free(&dst);
	ib_free(&ib);
	gpu_close(&g);
}

/* (e) two rings in parallel from two submit threads; fences in order per ring */
#define E_JOBS 40
#define E_CHUNK (64 * 1024)
struct e_arg {
	struct gpu *g;
	amdgpu_context_handle ctx;
	unsigned ring;
	struct buf *src, *dst, *ib;
	pthread_barrier_t *bar;
	uint64_t seqs[E_JOBS];
};

static void *e_submitter(void *p)
{
	struct e_arg *a = p;
	amdgpu_bo_handle bos[3] = { a->src->bo, a->dst->bo, a->ib->bo };
	amdgpu_bo_list_handle list;
	OK(amdgpu_bo_list_create(a->g->dev, 3, bos, NULL, &list));
	/* each job has its own 64-dword IB slot: the model copies the IB at submit,
	 * but real hardware reads it later, so slots are never reused here */
	for (unsigned k = 0; k < E_JOBS; k++) {
		unsigned slot = a->ring * E_JOBS + k;
		struct ib w = { (uint32_t *)(a->ib->cpu + slot * 256), 0 };
		uint64_t off = (uint64_t)slot * E_CHUNK;
		copy_range(&w, a->src->va + off, a->dst->va + off, E_CHUNK, E_CHUNK / 4, true);
		pad8(&w, true);
		struct amdgpu_cs_ib_info ibi = { .ib_mc_address = a->ib->va + slot * 256, .size = w.n };
		struct amdgpu_cs_request req = { .ip_type = AMDGPU_HW_IP_DMA, .ring = a->ring,
						 .resources = list, .number_of_ibs = 1, .ibs = &ibi };
		if (k == 0)
			pthread_barrier_wait(a->bar);
		OK(amdgpu_cs_submit(a->ctx, 0, &req, 1));
		a->seqs[k] = req.seq_no;
		if (k)
			CHECK_EQ(a->seqs[k], a->seqs[k - 1] + 1);
	}
	OK(amdgpu_bo_list_destroy(list));
	return NULL;
}

struct e_watch {
	amdgpu_context_handle ctx;
	volatile int stop;
	unsigned violations, polls;
};

static void *e_watcher(void *p)
{
	struct e_watch *w = p;
	while (!__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) {
		for (unsigned ring = 0; ring < 2; ring++) {
			/* a later fence must never be expired while an earlier one is not */
			uint64_t seq = 1 + (uint64_t)(rand() % E_JOBS);
			struct amdgpu_cs_fence f = { .context = w->ctx, .ip_type = AMDGPU_HW_IP_DMA,
						     .ring = ring, .fence = seq };
			uint32_t hi = 0, lo = 0;
			if (amdgpu_cs_query_fence_status(&f, 0, 0, &hi))
				continue;  /* not submitted yet */
			if (hi) {
				for (uint64_t k = 1; k < seq; k++) {
					f.fence = k;
					OK(amdgpu_cs_query_fence_status(&f, 0, 0, &lo));
					if (!lo)
						w->violations++;
				}
			}
			w->polls++;
		}
	}
	return NULL;
}

static void test_e_two_rings(void)
{
	g_test = "e: two rings in parallel";
	struct gpu g;
	gpu_open(&g, "141", "2", "500");  /* 0.5 ms per packet (model delay, not timing) */
	struct drm_amdgpu_info_hw_ip info;
	OK(amdgpu_query_hw_ip_info(g.dev, AMDGPU_HW_IP_DMA, 0, &info));
	CHECK_EQ(info.available_rings, 0x3);
	uint64_t size = 2ull * E_JOBS * E_CHUNK;
	struct buf src = dmabuf(&g, size, 55), dst = userptr(&g, size, 0);
	struct buf ib = ib_alloc(&g, 2 * E_JOBS * 256);
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	pthread_barrier_t bar;
	pthread_barrier_init(&bar, NULL, 2);
	struct e_arg a0 = { &g, ctx, 0, &src, &dst, &ib, &bar, { 0 } };
	struct e_arg a1 = { &g, ctx, 1, &src, &dst, &ib, &bar, { 0 } };
	struct e_watch wt = { .ctx = ctx };
	pthread_t t0, t1, tw;
	CHECK(pthread_create(&tw, NULL, e_watcher, &wt) == 0);
	CHECK(pthread_create(&t0, NULL, e_submitter, &a0) == 0);
	CHECK(pthread_create(&t1, NULL, e_submitter, &a1) == 0);
	pthread_join(t0, NULL);
	pthread_join(t1, NULL);
	/* not everything can be done yet: 4 packets x 0.5 ms x 40 jobs per ring */
	CHECK_EQ(wait_fence(ctx, 0, a0.seqs[E_JOBS - 1], 0), 0);
	CHECK_EQ(wait_fence(ctx, 0, a0.seqs[E_JOBS - 1], 1000000), 0);  /* 1 ms timeout */
	CHECK_EQ(wait_fence(ctx, 0, a0.seqs[E_JOBS - 1], AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(wait_fence(ctx, 1, a1.seqs[E_JOBS - 1], AMDGPU_TIMEOUT_INFINITE), 1);
	__atomic_store_n(&wt.stop, 1, __ATOMIC_RELEASE);
	pthread_join(tw, NULL);
	CHECK_EQ(wt.violations, 0);
	CHECK(wt.polls > 0);
	for (unsigned k = 0; k < E_JOBS; k++) {
		CHECK_EQ(wait_fence(ctx, 0, a0.seqs[k], 0), 1);
		CHECK_EQ(wait_fence(ctx, 1, a1.seqs[k], 0), 1);
	}
	CHECK_EQ(reset_flags(ctx), 0);
	CHECK(memcmp(src.cpu, dst.cpu, size) == 0);
	uint64_t s[VRAMD_MODEL_STAT_COUNT];
	stats(&g, s);
	CHECK_EQ(s[VRAMD_MODEL_STAT_JOBS_DONE], 2 * E_JOBS);
	CHECK_EQ(s[VRAMD_MODEL_STAT_MAX_BUSY], 2);  /* both engines ran at once */
	pthread_barrier_destroy(&bar);
	OK(amdgpu_cs_ctx_free(ctx));
	buf_free(&src);
	userptr_free(&dst);
	ib_free(&ib);
	gpu_close(&g);

	/* 4 SDMA rings reported, but a context has only 2 DMA entities (ring 0, 1) */
	gpu_open(&g, "141", "4", NULL);
	OK(amdgpu_query_hw_ip_info(g.dev, AMDGPU_HW_IP_DMA, 0, &info));
	CHECK_EQ(info.available_rings, 0xf);
	struct buf ib2 = ib_alloc(&g, 4096);
	memset(ib2.cpu, 0, 64);
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	submit_ex(&g, ctx, 2, &ib2, 8, &ib2.bo, 1, -EINVAL);
	LAST_ERROR(&g, "valid rings are 0..1");
	uint64_t seq = submit_ex(&g, ctx, 1, &ib2, 8, &ib2.bo, 1, 0);
	CHECK_EQ(wait_fence(ctx, 1, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	OK(amdgpu_cs_ctx_free(ctx));
	ib_free(&ib2);
	gpu_close(&g);
}

/* (f) pre-AI families: count = bytes */
static void test_f_pre_ai(void)
{
	g_test = "f: pre-AI count=bytes";
	struct gpu g;
	gpu_open(&g, "130", "2", NULL);  /* VI: sdma v3 max 0x3fffe0 */
	struct amdgpu_gpu_info gi;
	OK(amdgpu_query_gpu_info(g.dev, &gi));
	CHECK_EQ(gi.family_id, AMDGPU_FAMILY_VI);
	uint64_t size = 8 * MiB;
	struct buf src = dmabuf(&g, size, 66), dst = userptr(&g, size, 0), ib = ib_alloc(&g, 4096);
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	struct ib w = { (uint32_t *)ib.cpu, 0 };
	copy_range(&w, src.va, dst.va, size, 0x3fffe0, false);  /* count = bytes, to the end */
	pad8(&w, false);
	uint64_t seq = submit(&g, ctx, 0, &ib, w.n, src.bo, dst.bo);
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), 0);
	CHECK(memcmp(src.cpu, dst.cpu, size) == 0);
	OK(amdgpu_cs_ctx_free(ctx));

	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 0);
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "count 0 on a pre-AI family", __LINE__);
	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 0x3fffe1);
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "exceeds the max", __LINE__);
	buf_free(&src);
	userptr_free(&dst);
	ib_free(&ib);
	gpu_close(&g);

	/* CI: cik_sdma max 0x1fffff; CRIU's pre-AI 2 MiB - 1 packets work */
	gpu_open(&g, "120", "2", NULL);
	src = dmabuf(&g, 4 * MiB, 67);
	dst = userptr(&g, 4 * MiB, 0);
	ib = ib_alloc(&g, 4096);
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	w = (struct ib){ (uint32_t *)ib.cpu, 0 };
	copy_range(&w, src.va, dst.va, 4 * MiB, 2 * MiB - 1, false);
	pad8(&w, false);
	seq = submit(&g, ctx, 0, &ib, w.n, src.bo, dst.bo);
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), 0);
	CHECK(memcmp(src.cpu, dst.cpu, 4 * MiB) == 0);
	OK(amdgpu_cs_ctx_free(ctx));
	w.n = 0;
	copy_pkt(&w, src.va, dst.va, 2 * MiB);
	pad8(&w, false);
	expect_invalid(&g, &ib, w.n, src.bo, dst.bo, "exceeds the max", __LINE__);
	buf_free(&src);
	userptr_free(&dst);
	ib_free(&ib);
	gpu_close(&g);
}

/* (g) API rules the model enforces (see docs/sdma-model.md for sources) */
static void test_g_api_rules(void)
{
	g_test = "g: API rules";
	struct gpu g;
	gpu_open(&g, "141", "2", NULL);
	uint64_t pg = page();
	amdgpu_bo_handle h;

	/* userptr: page-aligned address and size, private anonymous, writable */
	uint8_t *anon = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(anon != MAP_FAILED);
	CHECK_EQ(amdgpu_create_bo_from_user_mem(g.dev, anon + 8, pg, &h), -EINVAL);
	CHECK_EQ(amdgpu_create_bo_from_user_mem(g.dev, anon, pg + 8, &h), -EINVAL);
	void *shared = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	CHECK_EQ(amdgpu_create_bo_from_user_mem(g.dev, shared, 4 * pg, &h), -EPERM);
	LAST_ERROR(&g, "ANONONLY");
	int mfd = memfd_create("x", 0);
	OK(ftruncate(mfd, 4 * (off_t)pg));
	void *filemap = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE, mfd, 0);
	CHECK_EQ(amdgpu_create_bo_from_user_mem(g.dev, filemap, 4 * pg, &h), -EPERM);
	void *ro = mmap(NULL, 4 * pg, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK_EQ(amdgpu_create_bo_from_user_mem(g.dev, ro, 4 * pg, &h), -EFAULT);
	OK(munmap(anon + 2 * pg, pg));  /* a hole inside the range */
	CHECK_EQ(amdgpu_create_bo_from_user_mem(g.dev, anon, 4 * pg, &h), -EFAULT);
	OK(amdgpu_create_bo_from_user_mem(g.dev, anon, 2 * pg, &h));
	void *cpu;
	CHECK_EQ(amdgpu_bo_cpu_map(h, &cpu), -EPERM);
	OK(amdgpu_bo_free(h));
	CHECK_EQ(amdgpu_bo_free(h), -EINVAL);  /* stale handle */
	munmap(anon, 4 * pg);
	munmap(shared, 4 * pg);
	munmap(filemap, 4 * pg);
	munmap(ro, 4 * pg);

	/* import: only dma-buf fds; size must be a non-zero number of pages */
	struct amdgpu_bo_import_result res;
	OK(ftruncate(mfd, 0));
	CHECK_EQ(amdgpu_bo_import(g.dev, amdgpu_bo_handle_type_dma_buf_fd, (uint32_t)mfd, &res), -EINVAL);
	OK(ftruncate(mfd, (off_t)pg + 100));
	CHECK_EQ(amdgpu_bo_import(g.dev, amdgpu_bo_handle_type_dma_buf_fd, (uint32_t)mfd, &res), -EINVAL);
	OK(ftruncate(mfd, 2 * (off_t)pg));
	CHECK_EQ(amdgpu_bo_import(g.dev, amdgpu_bo_handle_type_kms, (uint32_t)mfd, &res), -EINVAL);
	OK(amdgpu_bo_import(g.dev, amdgpu_bo_handle_type_dma_buf_fd, (uint32_t)mfd, &res));
	struct amdgpu_bo_import_result res2;
	OK(amdgpu_bo_import(g.dev, amdgpu_bo_handle_type_dma_buf_fd, (uint32_t)mfd, &res2));
	CHECK(res2.buf_handle == res.buf_handle);  /* same dma-buf, same refcounted handle */

	/* VA map rules */
	uint64_t va, va2;
	amdgpu_va_handle vh, vh2;
	OK(amdgpu_va_range_alloc(g.dev, amdgpu_gpu_va_range_general, 2 * pg, 0, 0, &va, &vh, 0));
	OK(amdgpu_va_range_alloc(g.dev, amdgpu_gpu_va_range_general, 2 * pg, 0, 0, &va2, &vh2, 0));
	CHECK(va2 >= va + 2 * pg + (1 << 20) || va >= va2 + 2 * pg + (1 << 20));  /* guard gap */
	CHECK_EQ(amdgpu_bo_va_op(res.buf_handle, 0, 3 * pg, va, 0, AMDGPU_VA_OP_MAP), -EINVAL);
	CHECK_EQ(amdgpu_bo_va_op(res.buf_handle, 0, pg, va + 8, 0, AMDGPU_VA_OP_MAP), -EINVAL);
	OK(amdgpu_bo_va_op(res.buf_handle, 0, 2 * pg, va, 0, AMDGPU_VA_OP_MAP));
	CHECK_EQ(amdgpu_bo_va_op(res.buf_handle, 0, pg, va + pg, 0, AMDGPU_VA_OP_MAP), -EINVAL);
	CHECK_EQ(amdgpu_bo_va_op(res.buf_handle, 0, pg, va2, 0, AMDGPU_VA_OP_UNMAP), -ENOENT);
	/* libdrm rounds the size up to a page: 100 bytes maps a whole page */
	OK(amdgpu_bo_va_op(res.buf_handle, pg, 100, va2, 0, AMDGPU_VA_OP_MAP));
	OK(amdgpu_bo_free(res2.buf_handle));  /* one of two references */

	/* IB outside any mapping: refused at submit (model rule) */
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	struct buf ib = ib_alloc(&g, 4096);
	struct buf fake = ib;
	fake.va = va2 + 64 * pg;
	submit_ex(&g, ctx, 0, &fake, 8, &ib.bo, 1, -EINVAL);
	LAST_ERROR(&g, "not inside one GPU VA mapping");
	/* IB running past its mapping */
	fake.va = ib.va + 4096 - 16;
	submit_ex(&g, ctx, 0, &fake, 8, &ib.bo, 1, -EINVAL);

	/* a fence that was never submitted */
	struct amdgpu_cs_fence f = { .context = ctx, .ip_type = AMDGPU_HW_IP_DMA, .ring = 0,
				     .fence = 5 };
	uint32_t expired;
	CHECK_EQ(amdgpu_cs_query_fence_status(&f, 0, 0, &expired), -EINVAL);
	/* null submission (no IBs): seq_no 0, always expired */
	struct amdgpu_cs_request nreq = { .ip_type = AMDGPU_HW_IP_DMA };
	OK(amdgpu_cs_submit(ctx, 0, &nreq, 1));
	CHECK_EQ(nreq.seq_no, 0);
	f.fence = 0;
	OK(amdgpu_cs_query_fence_status(&f, 0, 0, &expired));
	CHECK_EQ(expired, 1);

	/* a BO that is mapped but not in the bo_list: not resident -> fault */
	memset(ib.cpu, 0, 4096);
	struct ib w = { (uint32_t *)ib.cpu, 0 };
	copy_pkt(&w, va, va + 64, 15);
	pad8(&w, false);
	uint64_t seq = submit_ex(&g, ctx, 0, &ib, w.n, &ib.bo, 1, 0);
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), GUILTY);
	LAST_ERROR(&g, "not in the submission's bo_list");
	OK(amdgpu_cs_ctx_free(ctx));
	uint64_t fl;
	CHECK_EQ(amdgpu_cs_query_reset_state2(ctx, &fl), -EINVAL);  /* stale context handle */
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));

	/* freeing a mapped BO drops its mappings: a later copy through the VA faults */
	OK(amdgpu_bo_free(res.buf_handle));
	CHECK_EQ(amdgpu_bo_va_op(res.buf_handle, 0, 2 * pg, va, 0, AMDGPU_VA_OP_UNMAP), -EINVAL);
	struct buf dst = userptr(&g, 2 * pg, 0);
	w.n = 0;
	copy_pkt(&w, va, dst.va, 15);
	pad8(&w, false);
	amdgpu_bo_handle bos2[2] = { dst.bo, ib.bo };
	seq = submit_ex(&g, ctx, 0, &ib, w.n, bos2, 2, 0);
	CHECK_EQ(wait_fence(ctx, 0, seq, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), GUILTY);
	LAST_ERROR(&g, "is not mapped in the GPU VM");
	OK(amdgpu_cs_ctx_free(ctx));

	/* userptr memory unmapped behind the BO's back: the next submit naming it fails */
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	OK(munmap(dst.cpu, dst.size));
	submit_ex(&g, ctx, 0, &ib, 8, bos2, 2, -EFAULT);
	OK(amdgpu_bo_va_op(dst.bo, 0, dst.size, dst.va, 0, AMDGPU_VA_OP_UNMAP));
	OK(amdgpu_va_range_free(dst.vah));
	OK(amdgpu_bo_free(dst.bo));
	OK(amdgpu_cs_ctx_free(ctx));

	/* the same fd gives the same refcounted device handle */
	amdgpu_device_handle d2;
	uint32_t ma, mi;
	OK(amdgpu_device_initialize(g.fd, &ma, &mi, &d2));
	CHECK(d2 == g.dev);
	OK(amdgpu_device_deinitialize(d2));
	OK(amdgpu_va_range_free(vh));
	OK(amdgpu_va_range_free(vh2));
	ib_free(&ib);
	close(mfd);
	gpu_close(&g);
	CHECK_EQ(amdgpu_device_deinitialize(g.dev), -EINVAL);  /* stale device handle */
}

/* (h) dependencies across rings, a user fence, queued jobs of a guilty context
 * skipped, and teardown with work still queued */
static void test_h_deps_and_teardown(void)
{
	g_test = "h: dependencies, user fence, skip, teardown";
	struct gpu g;
	gpu_open(&g, "141", "2", "2000");
	uint64_t size = 1 * MiB;
	struct buf a = dmabuf(&g, size, 77), b = userptr(&g, size, 0), c = userptr(&g, size, 0);
	struct buf ib = ib_alloc(&g, 4096);
	amdgpu_context_handle ctx;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx));
	amdgpu_bo_handle bos[4] = { a.bo, b.bo, c.bo, ib.bo };
	amdgpu_bo_list_handle list;
	OK(amdgpu_bo_list_create(g.dev, 4, bos, NULL, &list));

	/* job 1 on ring 0: a -> b (slow: 4 packets x 2 ms) */
	struct ib w1 = { (uint32_t *)ib.cpu, 0 };
	copy_range(&w1, a.va, b.va, size, size / 4, true);
	pad8(&w1, false);
	struct amdgpu_cs_ib_info i1 = { .ib_mc_address = ib.va, .size = w1.n };
	struct amdgpu_cs_request r1 = { .ip_type = AMDGPU_HW_IP_DMA, .ring = 0, .resources = list,
					.number_of_ibs = 1, .ibs = &i1 };
	OK(amdgpu_cs_submit(ctx, 0, &r1, 1));
	/* job 2 on ring 1: b -> c, must wait for job 1; writes a user fence into the IB BO */
	struct ib w2 = { (uint32_t *)(ib.cpu + 1024), 0 };
	copy_range(&w2, b.va, c.va, size, size, true);
	pad8(&w2, false);
	struct amdgpu_cs_fence dep = { .context = ctx, .ip_type = AMDGPU_HW_IP_DMA, .ring = 0,
				       .fence = r1.seq_no };
	struct amdgpu_cs_ib_info i2 = { .ib_mc_address = ib.va + 1024, .size = w2.n };
	struct amdgpu_cs_request r2 = { .ip_type = AMDGPU_HW_IP_DMA, .ring = 1, .resources = list,
					.number_of_ibs = 1, .ibs = &i2, .number_of_dependencies = 1,
					.dependencies = &dep,
					.fence_info = { .handle = ib.bo, .offset = 4096 / 8 - 1 } };
	OK(amdgpu_cs_submit(ctx, 0, &r2, 1));
	CHECK_EQ(wait_fence(ctx, 1, r2.seq_no, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(wait_fence(ctx, 0, r1.seq_no, 0), 1);
	CHECK(memcmp(a.cpu, c.cpu, size) == 0);
	CHECK_EQ(__atomic_load_n((uint64_t *)(ib.cpu + 4096 - 8), __ATOMIC_ACQUIRE), r2.seq_no);

	/* a faulting job followed by queued jobs of the same context: those are skipped */
	struct ib w3 = { (uint32_t *)(ib.cpu + 2048), 0 };
	copy_pkt(&w3, a.va + size - 4, b.va, 7);  /* 8 bytes from 4 before the end: fault */
	pad8(&w3, false);
	struct amdgpu_cs_ib_info i3 = { .ib_mc_address = ib.va + 2048, .size = w3.n };
	struct amdgpu_cs_request r3 = { .ip_type = AMDGPU_HW_IP_DMA, .ring = 0, .resources = list,
					.number_of_ibs = 1, .ibs = &i3 };
	memset(c.cpu, 0, size);
	OK(amdgpu_cs_submit(ctx, 0, &r1, 1));  /* slow valid job first, so the next ones queue */
	OK(amdgpu_cs_submit(ctx, 0, &r3, 1));
	struct amdgpu_cs_ib_info i4 = { .ib_mc_address = ib.va + 1024, .size = w2.n };
	struct amdgpu_cs_request r4 = { .ip_type = AMDGPU_HW_IP_DMA, .ring = 0, .resources = list,
					.number_of_ibs = 1, .ibs = &i4 };
	int rc = amdgpu_cs_submit(ctx, 0, &r4, 1);
	CHECK(rc == 0);  /* accepted: the context is not guilty yet */
	CHECK_EQ(wait_fence(ctx, 0, r4.seq_no, AMDGPU_TIMEOUT_INFINITE), 1);
	CHECK_EQ(reset_flags(ctx), GUILTY);
	for (uint64_t i = 0; i < size; i++)
		if (c.cpu[i])
			fail(__LINE__, "a job queued behind the fault ran");
	uint64_t s[VRAMD_MODEL_STAT_COUNT];
	stats(&g, s);
	CHECK_EQ(s[VRAMD_MODEL_STAT_JOBS_SKIPPED], 1);
	CHECK_EQ(s[VRAMD_MODEL_STAT_FAULTS], 1);

	/* teardown with queued work and live handles: deinit drains and frees */
	amdgpu_context_handle ctx2;
	OK(amdgpu_cs_ctx_create(g.dev, &ctx2));
	for (int k = 0; k < 3; k++)
		OK(amdgpu_cs_submit(ctx2, 0, &r1, 1));
	OK(amdgpu_bo_list_destroy(list));
	munmap(a.cpu, a.size);
	close(a.memfd);
	gpu_close(&g);  /* leaves BOs, VA ranges and a context to the device teardown */
	munmap(b.cpu, b.size);
	munmap(c.cpu, c.size);
}

int main(void)
{
	alarm(300);
	setenv("VRAMD_SDMA_MODEL_GPU_ID", "test", 1);
	test_a_dmabuf_to_userptr();
	test_b_userptr_to_dmabuf();
	test_c_criu_encoding_faults();
	test_d_invalid_packets();
	test_e_two_rings();
	test_f_pre_ai();
	test_g_api_rules();
	test_h_deps_and_teardown();
	printf("ALL MODEL TESTS PASSED (this tested a software model, not a GPU)\n");
	return 0;
}
