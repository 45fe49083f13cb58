// CUDA prelude of the paged kernels: maps the PD_ spellings the kernel bodies use
// (paged_decode.kernel) to CUDA. The Metal prelude (prelude_metal.h) maps the same names.
#define PD_INLINE __device__ __forceinline__
#define PD_DEVICE
#define PD_THREAD
#define PD_SHARED __shared__
#define PD_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define PD_BARRIER() __syncthreads()
#define PD_WARP_BARRIER() __syncwarp()
#define PD_EXP2(x) exp2f(x)
#define PD_FMAX(a, b) fmaxf((a), (b))
#define PD_INT_AS_FLOAT(i) __int_as_float(i)
// 2^23 + byte k of w as a float's bits: one byte permute.
#define PD_BYTE_AS_FLOAT(w, k) __int_as_float(__byte_perm((w), 0x4B000000u, 0x7540u | (k)))
#define PD_UINT4(a, b, c, d) make_uint4((a), (b), (c), (d))
#define PD_ZERO4 make_uint4(0u, 0u, 0u, 0u)
#define PD_COLD_BASE cold_base  // a scalar argument, or a template constant
#define PD_LOAD_SHARED_RESULT(p) __ldcg(p)  // read another block's partials past L1
#define PD_NEG_INF __int_as_float(0xff800000)
#define PD_LOG2E 1.4426950408889634f
#define PD_ROPE_IN_KERNEL 1  // a decode launch may rotate its queries and new keys (ROPE)
#define PD_RINT(x) rintf(x)
#define PD_FMA(a, b, c) fmaf((a), (b), (c))
#define PD_SINCOS(x, s, c) __sincosf((x), &(s), &(c))  // accurate in [-pi, pi]
typedef unsigned int pd_uint;
PD_INLINE float pd_float(float x) { return x; }
PD_INLINE float pd_float(__half x) { return __half2float(x); }
PD_INLINE float pd_float(__nv_bfloat16 x) { return __bfloat162float(x); }
// ---- indices
  const int pd_tid = threadIdx.x;
  const int pd_group_x = blockIdx.x, pd_group_y = blockIdx.y, pd_group_z = blockIdx.z;
  const int pd_groups_x = gridDim.x, pd_groups_z = gridDim.z;
  const int pd_threads_x = blockDim.x;
// ---- publish
  // Publish this split's partial; the last split of the (sequence, head group) to finish
  // merges them all in this launch. Each launch zeroes its own counters, and the merging
  // split zeroes its counter again: launches that share one buffer (a compiled graph
  // merges equal fills) each find it zeroed.
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (pd_tid == 0) {
    int* cnt = const_cast<int*>(counters) + (size_t)b * pd_groups_x + pd_group_x;
    s_last = atomicAdd(cnt, 1) == nsplit - 1;
    if (s_last) *cnt = 0;  // every other split of this group has counted
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
