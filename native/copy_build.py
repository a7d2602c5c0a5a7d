"""cffi (API mode) build of vramd's batch copier: vramd.hostmem._copy (native/copy/).

Also holds the byte-plane transform of the planes codec (vramd/image/planes.py).

Built at install time through setup.py's `cffi_modules` wherever a C compiler,
the Python headers and <xxhash.h> (Debian: libxxhash-dev; header only, nothing
is linked) exist.  Without it vramd still works: vramd.hostmem.batchcopy runs
the same loop in Python.
"""
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = r"""
#define VD_HASH ...
#define VD_ZERO ...
#define VD_RECORD ...
#define VD_WHOLE ...
struct vd_copy {
    int32_t src_fd; int32_t dst_fd; uint64_t src; uint64_t dst; uint64_t length; uint64_t rec_at; uint64_t rec_len;
    uint64_t hash; uint64_t done; uint64_t payload_at; int32_t err; int32_t zero;
};
long vd_copy_batch(struct vd_copy *c, size_t n, unsigned flags);
int vd_xxh3_use_avx2(int want);
uint64_t vd_xxh3(uint64_t p, size_t n);
void vd_xor(unsigned char *dst, const unsigned char *src, size_t n);
void vd_planes_split(const uint8_t *src, uint8_t *dst, size_t n, unsigned word);
void vd_planes_merge(const uint8_t *src, uint8_t *dst, size_t n, unsigned word);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "vramd.hostmem._copy", '#include "vd_copy.h"\n',
    sources=[os.path.relpath(os.path.join(HERE, "copy", name)) for name in ("vd_copy.c", "vd_xxh3_avx2.c")],
    include_dirs=[os.path.join(HERE, "copy")],
    extra_compile_args=["-O2", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
