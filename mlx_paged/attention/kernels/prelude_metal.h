// Metal prelude of the paged kernels: maps the PD_ spellings the kernel bodies use
// (paged_decode.kernel) to Metal. NOT RUN HERE: no Apple-silicon machine was available;
// dispatch.py checks every Metal build against the portable path before it is used.
#define PD_INLINE inline
#define PD_DEVICE device
#define PD_THREAD thread
#define PD_SHARED threadgroup
#define PD_SHFL_XOR(x, m) simd_shuffle_xor((x), ushort(m))
#define PD_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define PD_WARP_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)
#define PD_EXP2(x) metal::exp2(x)
#define PD_ROPE_IN_KERNEL 0  // the Metal build takes queries and keys rotated
#define PD_RINT(x) metal::rint(x)
#define PD_FMA(a, b, c) metal::fma((a), (b), (c))
#define PD_SINCOS(x, s, c) ((s) = metal::sincos((x), (c)))
#define PD_FMAX(a, b) metal::max((a), (b))
#define PD_INT_AS_FLOAT(i) as_type<float>(int(i))
// 2^23 + byte k of w as a float's bits.
#define PD_BYTE_AS_FLOAT(w, k) as_type<float>(0x4B000000u | (((w) >> (8 * (k))) & 0xFFu))
#define PD_UINT4(a, b, c, d) uint4((a), (b), (c), (d))
#define PD_ZERO4 uint4(0u)
#define PD_COLD_BASE cold_base[0]  // a one-element input
#define PD_LOAD_SHARED_RESULT(p) (*(p))
#define PD_NEG_INF (-metal::numeric_limits<float>::infinity())
#define PD_LOG2E 1.4426950408889634f
typedef uint pd_uint;
template <typename X>
PD_INLINE float pd_float(X x) { return float(x); }
// ---- indices
  const int pd_tid = int(thread_index_in_threadgroup);
  const int pd_group_x = int(threadgroup_position_in_grid.x);
  const int pd_group_y = int(threadgroup_position_in_grid.y);
  const int pd_group_z = int(threadgroup_position_in_grid.z);
  const int pd_groups_x = int(threadgroups_per_grid.x), pd_groups_z = int(threadgroups_per_grid.z);
  const int pd_threads_x = int(threads_per_threadgroup.x);
