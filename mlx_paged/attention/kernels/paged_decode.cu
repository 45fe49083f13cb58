// Fused paged decode attention, CUDA body for mx.fast.cuda_kernel (see cuda.py).
//
// MLX generates the signature: the inputs and outputs named in cuda.py's _INPUTS and
// _OUTPUTS, and the template constants (SCALE_BITS: float32 bits of scale * log2(e)).
// Logits live in the log2 domain (exp2f), so sinks are scaled by log2(e) too.
// Everything above the "// ---- body" line is the kernel's header.
#define PD_NEG_INF __int_as_float(0xff800000)
#define PD_LOG2E 1.4426950408889634f
__device__ __forceinline__ float pd_float(float x) { return x; }
__device__ __forceinline__ float pd_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pd_float(__nv_bfloat16 x) { return __bfloat162float(x); }
// ---- body
  constexpr int VEC = 16 / sizeof(T);   // elements per 16-byte load
  constexpr int LK = (DK / VEC) < 32 ? (DK / VEC) : 32;  // lanes per key row
  constexpr int NK = (DK / VEC) / LK;   // 16-byte vectors per lane per key row
  constexpr int RK = 32 / LK;           // key rows per warp load
  constexpr int UK = RS / RK;           // key rows per lane per step
  constexpr int LV = (DV / VEC) < 32 ? (DV / VEC) : 32;
  constexpr int NV = (DV / VEC) / LV;
  constexpr int RV = 32 / LV;
  constexpr int UV = RS / RV;
  constexpr int NT = NW * 32;
  // Same row layout for K and V: a lane's logits are those of the rows its V loads
  // hold; otherwise probabilities go through shared memory.
  constexpr bool SAME = LK == LV;
  __shared__ float sacc[NW * HG * DV];  // each warp's partial output
  __shared__ float sml[2 * NW * HG];    // each warp's max, then its sum
  __shared__ float sp[SAME ? 1 : NW * HG * RS];
  __shared__ int s_last;
  constexpr int MAXS = 32;              // most splits (MAX_SPLITS)
  __shared__ float smm[WH * HG * MAXS], sml2[WH * HG * MAXS], swt[WH * HG * MAXS];
  __shared__ float sden[WH * HG];

  constexpr int WR = NW / WH;           // warps sharing one head group's rows
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // Warp w serves head group blockIdx.x * WH + w % WH, row part w / WH.
  const int hgw = blockIdx.x * WH + warp % WH;
  const int kvh = hgw / (G / HG);
  const int hq0 = kvh * G + (hgw % (G / HG)) * HG;
  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int nsplit = gridDim.z;
  const int M = block_tables_shape[1];
  const int* table = block_tables + (size_t)b * M;

  const int len = lengths[b];
  const int start = starts[b];
  int first = start;
  if (WINDOW > 0) first = max(first, len - WINDOW);
  const int n = max(len - first, 0);
  const int per = (n + nsplit - 1) / nsplit;
  const int lo = min(first + split * per, len);
  const int hi = min(lo + per, len);
  // Each warp takes a contiguous run of whole steps of the split.
  const int pw = ((hi - lo + WR - 1) / WR + RS - 1) / RS * RS;
  const int wlo = min(lo + (warp / WH) * pw, hi);
  const int whi = min(wlo + pw, hi);

  // This lane's slice of each query head, pre-scaled (log2 domain).
  const int rgk = lane / LK, lik = lane % LK;
  const int rgv = lane / LV, liv = lane % LV;
  const float sc = __int_as_float(SCALE_BITS);
  float q[HG][NK * VEC];
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int j = 0; j < NK; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        int d = (j * LK + lik) * VEC + e;
        q[g][j * VEC + e] = pd_float(queries[(size_t)(b * HQ + hq0 + g) * DK + d]) * sc;
      }
    }
  }

  float m[HG], l[HG], acc[HG][NV * VEC];
#pragma unroll
  for (int g = 0; g < HG; ++g) {
    m[g] = PD_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NV * VEC; ++i) acc[g][i] = 0.f;
  }

  // Issue every load of a step at once: K rows, then V rows. Rows past the end read as zero,
  // not garbage: p = 0 times NaN would still be NaN.
  auto load = [&](int r0, uint4 (&kd)[UK][NK], uint4 (&vd)[UV][NV]) {
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int pos = r0 + u * RK + rgk;
      if (pos < whi) {
        const int blk = table[(pos - start) / BS];
        const uint4* src = reinterpret_cast<const uint4*>(
            keys + (((size_t)blk * BS + pos % BS) * HKV + kvh) * DK);
#pragma unroll
        for (int j = 0; j < NK; ++j) kd[u][j] = src[j * LK + lik];
      } else {
#pragma unroll
        for (int j = 0; j < NK; ++j) kd[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int pos = r0 + u * RV + rgv;
      if (pos < whi) {
        const int blk = table[(pos - start) / BS];
        const uint4* src = reinterpret_cast<const uint4*>(
            values + (((size_t)blk * BS + pos % BS) * HKV + kvh) * DV);
#pragma unroll
        for (int j = 0; j < NV; ++j) vd[u][j] = src[j * LV + liv];
      } else {
#pragma unroll
        for (int j = 0; j < NV; ++j) vd[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // With PF, the next step's loads are in flight while this step computes (unused otherwise).
  uint4 kn[UK][NK], vn[UV][NV];
  if (PF && wlo < whi) load(wlo, kn, vn);
  for (int r0 = wlo; r0 < whi; r0 += RS) {
    uint4 kr[UK][NK];
    uint4 vr[UV][NV];
    if (PF) {
#pragma unroll
      for (int u = 0; u < UK; ++u)
#pragma unroll
        for (int j = 0; j < NK; ++j) kr[u][j] = kn[u][j];
#pragma unroll
      for (int u = 0; u < UV; ++u)
#pragma unroll
        for (int j = 0; j < NV; ++j) vr[u][j] = vn[u][j];
      if (r0 + RS < whi) load(r0 + RS, kn, vn);
    } else {
      load(r0, kr, vr);
    }

    // Logits of the step's rows; every lane of a row's lane group ends with the sum.
    float s[UK][HG];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
#pragma unroll
      for (int g = 0; g < HG; ++g) s[u][g] = 0.f;
#pragma unroll
      for (int j = 0; j < NK; ++j) {
        const T* kv = reinterpret_cast<const T*>(&kr[u][j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float kf = pd_float(kv[e]);
#pragma unroll
          for (int g = 0; g < HG; ++g) s[u][g] += q[g][j * VEC + e] * kf;
        }
      }
#pragma unroll
      for (int g = 0; g < HG; ++g) {
#pragma unroll
        for (int off = LK / 2; off > 0; off >>= 1)
          s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], off);
      }
      if (r0 + u * RK + rgk >= whi) {
#pragma unroll
        for (int g = 0; g < HG; ++g) s[u][g] = PD_NEG_INF;
      }
    }

    // Warp-wide online softmax: row r0 is always valid, so the new max is finite.
#pragma unroll
    for (int g = 0; g < HG; ++g) {
      float cm = s[0][g];
#pragma unroll
      for (int u = 1; u < UK; ++u) cm = fmaxf(cm, s[u][g]);
#pragma unroll
      for (int off = LK; off < 32; off <<= 1)
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffff, cm, off));
      const float mn = fmaxf(m[g], cm);
      const float alpha = exp2f(m[g] - mn);
      m[g] = mn;
      float ls = 0.f;
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        s[u][g] = exp2f(s[u][g] - mn);
        ls += s[u][g];
      }
      l[g] = l[g] * alpha + ls;
#pragma unroll
      for (int i = 0; i < NV * VEC; ++i) acc[g][i] *= alpha;
    }

    if (!SAME) {
      if (lik == 0) {
#pragma unroll
        for (int u = 0; u < UK; ++u) {
#pragma unroll
          for (int g = 0; g < HG; ++g) sp[(warp * HG + g) * RS + u * RK + rgk] = s[u][g];
        }
      }
      __syncwarp();
    }

    // acc += p * v.
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      float p[HG];
#pragma unroll
      for (int g = 0; g < HG; ++g)
        p[g] = SAME ? s[u < UK ? u : 0][g] : sp[(warp * HG + g) * RS + u * RV + rgv];
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const T* vv = reinterpret_cast<const T*>(&vr[u][j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float vf = pd_float(vv[e]);
#pragma unroll
          for (int g = 0; g < HG; ++g) acc[g][j * VEC + e] += p[g] * vf;
        }
      }
    }
    if (!SAME) __syncwarp();  // sp is rewritten next step
  }

  // Warp totals: l over K lane groups, acc over V lane groups (m is warp-uniform).
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int off = LK; off < 32; off <<= 1) l[g] += __shfl_xor_sync(0xffffffff, l[g], off);
#pragma unroll
    for (int i = 0; i < NV * VEC; ++i) {
#pragma unroll
      for (int off = LV; off < 32; off <<= 1)
        acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], off);
    }
    if (lane == 0) {
      sml[warp * HG + g] = m[g];
      sml[(NW + warp) * HG + g] = l[g];
    }
    if (rgv == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          sacc[(warp * HG + g) * DV + (j * LV + liv) * VEC + e] = acc[g][j * VEC + e];
      }
    }
  }
  __syncthreads();

  // Merge the row parts of each head group; with one split write the output, else this
  // split's partial.
  for (int idx = threadIdx.x; idx < WH * HG * DV; idx += NT) {
    const int h = idx / (HG * DV), g = (idx / DV) % HG, d = idx % DV;
    const int hg = blockIdx.x * WH + h;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + g;
    float mb = PD_NEG_INF;
#pragma unroll
    for (int w = h; w < NW; w += WH)
      if (sml[(NW + w) * HG + g] > 0.f) mb = fmaxf(mb, sml[w * HG + g]);
    float o = 0.f, lb = 0.f;
#pragma unroll
    for (int w = h; w < NW; w += WH) {
      const float lw = sml[(NW + w) * HG + g];
      if (lw > 0.f) {
        const float a = exp2f(sml[w * HG + g] - mb);
        o += a * sacc[(w * HG + g) * DV + d];
        lb += a * lw;
      }
    }
    const size_t row = (size_t)b * HQ + hq;
    if (nsplit == 1) {
      if (SINKS) {
        const float sk = sinks[hq] * PD_LOG2E;
        const float mx = fmaxf(mb, sk);
        const float a = exp2f(mb - mx);
        o *= a;
        lb = lb * a + exp2f(sk - mx);
      }
      out[row * DV + d] = static_cast<OT>(lb > 0.f ? o / lb : 0.f);
    } else {
      const size_t at = row * nsplit + split;
      part_out[at * DV + d] = o;
      if (d == 0) {
        part_max[at] = mb;
        part_sum[at] = lb;
      }
    }
  }
  if (nsplit == 1) return;

  // Publish this split's partial; the last split of the (sequence, head group) merges.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cnt = const_cast<int*>(counters) + (size_t)b * gridDim.x + blockIdx.x;
    const int done = atomicAdd(cnt, 1);
    s_last = done == nsplit - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // Load every split's max and sum, weigh the splits per head, then sum the partial
  // outputs with all of a thread's loads in flight at once.
  for (int i = threadIdx.x; i < WH * HG * nsplit; i += NT) {
    const int hgi = i / nsplit, sidx = i % nsplit;
    const int hg = blockIdx.x * WH + hgi / HG;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + hgi % HG;
    const size_t at = ((size_t)b * HQ + hq) * nsplit + sidx;
    smm[hgi * MAXS + sidx] = __ldcg(part_max + at);
    sml2[hgi * MAXS + sidx] = __ldcg(part_sum + at);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < WH * HG; i += NT) {
    const int hg = blockIdx.x * WH + i / HG;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + i % HG;
    float mt = PD_NEG_INF;
    for (int sx = 0; sx < nsplit; ++sx)
      if (sml2[i * MAXS + sx] > 0.f) mt = fmaxf(mt, smm[i * MAXS + sx]);
    float den = 0.f;
    if (SINKS) {
      const float sk = sinks[hq] * PD_LOG2E;
      mt = fmaxf(mt, sk);
      den = exp2f(sk - mt);
    }
    for (int sx = 0; sx < nsplit; ++sx) {
      const float ls = sml2[i * MAXS + sx];
      const float w = ls > 0.f ? exp2f(smm[i * MAXS + sx] - mt) : 0.f;
      swt[i * MAXS + sx] = w;
      den += w * ls;
    }
    sden[i] = den;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < WH * HG * DV; idx += NT) {
    const int i = idx / DV, d = idx % DV;
    const int hg = blockIdx.x * WH + i / HG;
    const int hq = (hg / (G / HG)) * G + (hg % (G / HG)) * HG + i % HG;
    const size_t row = (size_t)b * HQ + hq;
    float num = 0.f;
#pragma unroll
    for (int sx = 0; sx < MAXS; ++sx) {
      if (sx < nsplit)
        num += swt[i * MAXS + sx] * __ldcg(part_out + (row * nsplit + sx) * DV + d);
    }
    const float den = sden[i];
    out[row * DV + d] = static_cast<OT>(den > 0.f ? num / den : 0.f);
  }
