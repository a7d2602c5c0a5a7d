"""cffi (API mode) binding of the libdrm_amdgpu subset the SDMA backend uses.

Built at install time through setup.py's `cffi_modules` when pkg-config
finds libdrm_amdgpu (Debian: libdrm-dev); the module is `vramd.backends.sdma._amdgpu`.
It is compiled against the real <amdgpu.h>, so every struct layout and
signature is checked by the compiler, and linked against
libdrm_amdgpu.so.1.  Which library actually serves the calls is decided at
run time: the real one, or the software model (native/model/), loaded first
under the same soname (see vramd/backends/sdma/binding.py).
"""
from cffi import FFI

CDEF = r"""
typedef struct amdgpu_device *amdgpu_device_handle;
typedef struct amdgpu_context *amdgpu_context_handle;
typedef struct amdgpu_bo *amdgpu_bo_handle;
typedef struct amdgpu_bo_list *amdgpu_bo_list_handle;
typedef struct amdgpu_va *amdgpu_va_handle;

enum amdgpu_bo_handle_type { amdgpu_bo_handle_type_dma_buf_fd, ... };
enum amdgpu_gpu_va_range { amdgpu_gpu_va_range_general, ... };

#define AMDGPU_HW_IP_DMA ...
#define AMDGPU_GEM_DOMAIN_GTT ...
#define AMDGPU_GEM_DOMAIN_VRAM ...
#define AMDGPU_GEM_CREATE_CPU_ACCESS_REQUIRED ...
#define AMDGPU_VA_OP_MAP ...
#define AMDGPU_VA_OP_UNMAP ...
#define AMDGPU_VM_PAGE_READABLE ...
#define AMDGPU_VM_PAGE_WRITEABLE ...
#define AMDGPU_FAMILY_AI ...
#define AMDGPU_CTX_QUERY2_FLAGS_RESET ...
#define AMDGPU_CTX_QUERY2_FLAGS_GUILTY ...
#define AMDGPU_CTX_QUERY2_FLAGS_VRAMLOST ...

struct amdgpu_bo_alloc_request { uint64_t alloc_size; uint64_t phys_alignment; uint32_t preferred_heap; uint64_t flags; ...; };
struct amdgpu_bo_import_result { amdgpu_bo_handle buf_handle; uint64_t alloc_size; ...; };
struct amdgpu_gpu_info { uint32_t family_id; uint32_t asic_id; uint32_t chip_rev; uint32_t chip_external_rev; ...; };
struct drm_amdgpu_info_hw_ip { uint32_t hw_ip_version_major; uint32_t hw_ip_version_minor; uint32_t available_rings; ...; };
struct amdgpu_cs_fence { amdgpu_context_handle context; uint32_t ip_type; uint32_t ip_instance; uint32_t ring; uint64_t fence; ...; };
struct amdgpu_cs_ib_info { uint64_t flags; uint64_t ib_mc_address; uint32_t size; ...; };
struct amdgpu_cs_request {
    uint64_t flags; unsigned ip_type; unsigned ip_instance; uint32_t ring; amdgpu_bo_list_handle resources;
    uint32_t number_of_dependencies; struct amdgpu_cs_fence *dependencies; uint32_t number_of_ibs;
    struct amdgpu_cs_ib_info *ibs; uint64_t seq_no; ...;
};

int amdgpu_device_initialize(int fd, uint32_t *major_version, uint32_t *minor_version, amdgpu_device_handle *device_handle);
int amdgpu_device_deinitialize(amdgpu_device_handle device_handle);
int amdgpu_query_gpu_info(amdgpu_device_handle dev, struct amdgpu_gpu_info *info);
int amdgpu_query_hw_ip_info(amdgpu_device_handle dev, unsigned type, unsigned ip_instance, struct drm_amdgpu_info_hw_ip *info);
int amdgpu_bo_import(amdgpu_device_handle dev, enum amdgpu_bo_handle_type type, uint32_t shared_handle, struct amdgpu_bo_import_result *output);
int amdgpu_create_bo_from_user_mem(amdgpu_device_handle dev, void *cpu, uint64_t size, amdgpu_bo_handle *buf_handle);
int amdgpu_bo_alloc(amdgpu_device_handle dev, struct amdgpu_bo_alloc_request *alloc_buffer, amdgpu_bo_handle *buf_handle);
int amdgpu_bo_export(amdgpu_bo_handle buf_handle, enum amdgpu_bo_handle_type type, uint32_t *shared_handle);
int amdgpu_bo_cpu_map(amdgpu_bo_handle buf_handle, void **cpu);
int amdgpu_bo_cpu_unmap(amdgpu_bo_handle buf_handle);
int amdgpu_bo_free(amdgpu_bo_handle buf_handle);
int amdgpu_va_range_alloc(amdgpu_device_handle dev, enum amdgpu_gpu_va_range va_range_type, uint64_t size, uint64_t va_base_alignment, uint64_t va_base_required, uint64_t *va_base_allocated, amdgpu_va_handle *va_range_handle, uint64_t flags);
int amdgpu_va_range_free(amdgpu_va_handle va_range_handle);
int amdgpu_bo_va_op(amdgpu_bo_handle bo, uint64_t offset, uint64_t size, uint64_t addr, uint64_t flags, uint32_t ops);
int amdgpu_cs_ctx_create(amdgpu_device_handle dev, amdgpu_context_handle *context);
int amdgpu_cs_ctx_free(amdgpu_context_handle context);
int amdgpu_bo_list_create(amdgpu_device_handle dev, uint32_t number_of_resources, amdgpu_bo_handle *resources, uint8_t *resource_prios, amdgpu_bo_list_handle *result);
int amdgpu_bo_list_destroy(amdgpu_bo_list_handle handle);
int amdgpu_cs_submit(amdgpu_context_handle context, uint64_t flags, struct amdgpu_cs_request *ibs_request, uint32_t number_of_requests);
int amdgpu_cs_query_fence_status(struct amdgpu_cs_fence *fence, uint64_t timeout_ns, uint64_t flags, uint32_t *expired);
int amdgpu_cs_query_reset_state2(amdgpu_context_handle context, uint64_t *flags);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source_pkgconfig(
    "vramd.backends.sdma._amdgpu", ["libdrm_amdgpu"],
    "#include <stdint.h>\n#include <amdgpu.h>\n#include <amdgpu_drm.h>\n",
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
