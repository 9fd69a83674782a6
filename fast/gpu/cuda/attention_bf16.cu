// Grouped-query attention of a bfloat16 run on tensor cores: dg_attention's keys, visibility and layouts, with
// the roundings of upstream's bfloat16 eager attention (reference/layers.py attend with dtype bfloat16; SPEC
// §10.1): the scores q.k are accumulated in float32 and rounded to bfloat16; the softmax runs in float32 over
// the rounded scores (invisible keys -inf); the normalised weights are rounded to bfloat16 before the product
// with V; that product is accumulated in float32 and rounded to bfloat16. No 1/sqrt(d), no soft-cap; a query
// that sees no key gets zeros.
//
// Inputs are float32 arrays holding bfloat16 values (the bf16 mode's layout), so their conversion to bfloat16
// bits for the mma operands is exact; out receives bfloat16 values as float32. Keys are visible exactly as in
// dg_attention (attention.cu): key t is visible from a query at position p iff it is real and
// (!causal || pos_t <= p) and (window <= 0 || pos_t > p - window); cache slot t < n_cache holds position
// slot_pos[t] (real iff cache_real[cache_row, position]), then the call's n_new keys at new_pos (real iff
// new_real[n, i]).
//
// Algorithm: flash-style, two passes over the keys, nothing of size S x T in global memory. A block owns one
// batch row n, one KV head j and R = 16 * row_tiles consecutive (query, head) rows of the S * r rows of that
// head group (row = query * r + head in group; r = n_heads / n_kv), staged once in shared memory as bf16 pairs.
// Keys go through shared memory DG_ATTB_KEYS at a time (a tile whose keys no row of the block can see is
// skipped before its keys and values are read). Per tile, the 8 warps score it with mma.sync m16n8k16 (bf16
// in, float32 accumulate): warp w takes keys 8 (w % 4) .. 8 (w % 4) + 7 against the row tiles of parity w / 4;
// the scores are rounded to bfloat16 and masked.
//   pass 1: the scores go to shared memory, and 256 / R threads per row keep the row's running maximum m and
//           running sum l = sum exp(s - m) (rescaled by exp(m_old - m_new) when the maximum grows);
//   pass 2: the same scores again (the same instructions in the same order: the same bits), the weights
//           p = bf16(exp(s - m) / l) (0 where invisible) go to shared memory as bf16 pairs, the tile's values
//           replace its keys in shared memory, and O += P V on mma, the warps splitting the R x d outputs into
//           16 x 8 tiles (at most DG_ATTB_OUT_TILES per warp, in registers). The output is bf16(O).
// The head dim is padded with zeros to a multiple of 16 in shared memory, so any d <= DG_MAX_HEAD_DIM works.
// Keys that are not real (padding positions, empty slots, the tile's tail past the last key) are staged as zeros:
// their memory may hold anything (a GPU cache is not cleared), and a weight of 0 times a NaN value would be NaN
// on the mma, where the reference never sees those values.
//
// Layouts (as dg_attention): q (N, S, n_heads, d); cache_k/v (B_c, n_kv, slots, d); cache_rows (N,) int32 (NULL:
// the identity); slot_pos (slots,) int64; cache_real (B_c, real_stride) uint8; new_k/v (N, n_kv, n_new, d);
// new_pos (n_new,) int64; new_real (N, n_new) uint8; q_pos (S,) int64; out (N, S, n_heads * d).
// Launch (fast/gpu/launch.py attention_bf16_plan): grid (max(ceil(S * r / R), 1), n_kv, max(N, 1)) (a block past
// N or the rows returns at once), block DG_ATTB_THREADS, row_tiles a power of two <= DG_ATTB_MAX_ROW_TILES with
// row_tiles * d16 / 8 <= 8 * DG_ATTB_OUT_TILES (d16: d rounded up to 16), dynamic shared memory
// 8 * (K + R) + 4 * (K + 2 R) + 4 * (R * (d16 / 2 + 4) + max(K * (d16 / 2 + 4), d16 * (K / 2 + 4)) + R * (K + 1))
// bytes for K = DG_ATTB_KEYS.

#include "common.cuh"
#include "bf16.cuh"

// Threads of a block (8 warps; the kernel assumes exactly this many).
#define DG_ATTB_THREADS 256
// Keys per tile: 4 mma column tiles of 8 keys, each scored by two warps (the even and the odd row tiles).
#define DG_ATTB_KEYS 32
// Most 16-row mma tiles of (query, head) rows in a block.
#define DG_ATTB_MAX_ROW_TILES 8
// Most 16 x 8 output tiles one warp accumulates (4 floats per thread each).
#define DG_ATTB_OUT_TILES 16

// The d floats of key `key` (cache slots first, then the call's keys) of KV head j for batch row n.
__device__ __forceinline__ const float* dg_attb_row(const float* cache, const float* fresh, int key, int n_cache,
                                                    int crow, int n, int j, int n_kv, int slots, int n_new, int d) {
    if (key < n_cache) return cache + (((long long)crow * n_kv + j) * slots + key) * d;
    return fresh + (((long long)n * n_kv + j) * n_new + (key - n_cache)) * d;
}

__device__ __forceinline__ unsigned short dg_attb_bits(float x) { return dg_float_to_bf16(x); }

// At most 128 registers a thread (2 blocks of 8 warps fit an SM's 65,536 registers; no spills on sm_80/sm_90).
extern "C" __global__ void __launch_bounds__(DG_ATTB_THREADS, 2)
dg_attention_bf16(const float* q, const long long* q_pos, int N, int S, int n_heads, int d,
                  const float* cache_k_opt, const float* cache_v_opt, const int* cache_rows_opt, int n_cache,
                  int slots, const long long* slot_pos_opt, const unsigned char* cache_real_opt, int real_stride,
                  const float* new_k_opt, const float* new_v_opt, int n_new, const long long* new_pos_opt,
                  const unsigned char* new_real_opt, int n_kv, long long window, int causal, int row_tiles,
                  float* out) {
    constexpr int K = DG_ATTB_KEYS, KP = K / 2, VS = KP + 4, SS = K + 1;
    extern __shared__ __align__(16) unsigned char dg_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kt = warp & 3, parity = warp >> 2;    // the warp's 8 keys of a tile and its row tiles' parity
    const int r = n_heads / n_kv;
    const int n = blockIdx.z, j = blockIdx.y;
    const int R = 16 * row_tiles;
    const long long rows_total = (long long)S * r;
    const long long row0 = (long long)blockIdx.x * R;
    if (n >= N || row0 >= rows_total) return;       // uniform for the block: N == 0 or S == 0 launch one
    const int d16 = (d + 15) & ~15, DP = d16 / 2, QS = DP + 4;   // padded head dim, its pairs, a row's stride
    const int crow = cache_rows_opt ? cache_rows_opt[n] : n;
    const int T = n_cache + n_new;

    long long* kpos = (long long*)dg_smem;          // (K,) positions of the tile's keys
    long long* rqpos = kpos + K;                    // (R,) position of each row's query
    int* kreal = (int*)(rqpos + R);                 // (K,) 1 = a real key
    float* rm = (float*)(kreal + K);                // (R,) row maximum of the rounded scores (-inf: none visible)
    float* rl = rm + R;                             // (R,) row sum of exp(s - m)
    unsigned* qs = (unsigned*)(rl + R);             // (R, QS) queries, bf16 pairs along d
    unsigned* ks = qs + R * QS;                     // (K, QS) keys, bf16 pairs along d
    unsigned* vt = ks;                              // (d16, VS) pass 2, after the scores: values transposed, bf16
                                                    // pairs along the keys (in the keys' place)
    float* ss = (float*)(ks + max(K * QS, d16 * VS));  // (R, SS) pass 1: the tile's scores
    unsigned* ps = (unsigned*)ss;                   // (R, VS) pass 2: the tile's weights, bf16 pairs (aliases ss)

    for (int idx = threadIdx.x; idx < R * DP; idx += blockDim.x) {
        const int row = idx / DP, p = idx - row * DP, c = 2 * p;
        const long long grow = row0 + row;
        float x0 = 0.0f, x1 = 0.0f;
        if (grow < rows_total) {
            const long long qi = grow / r, hl = grow - qi * r;
            const float* src = q + (((long long)n * S + qi) * n_heads + (long long)j * r + hl) * d;
            x0 = c < d ? src[c] : 0.0f;
            x1 = c + 1 < d ? src[c + 1] : 0.0f;
        }
        qs[row * QS + p] = dg_bf16_pair(dg_attb_bits(x0), dg_attb_bits(x1));
    }
    for (int row = threadIdx.x; row < R; row += blockDim.x) {
        const long long grow = row0 + row;
        rqpos[row] = grow < rows_total ? q_pos[grow / r] : 0;
    }
    __syncthreads();
    // the block's query positions, for skipping tiles that no row sees
    const int valid_rows = (int)min((long long)R, rows_total - row0);
    long long qlo = rqpos[0], qhi = rqpos[0];
    for (int row = 1; row < valid_rows; ++row) {
        qlo = min(qlo, rqpos[row]);
        qhi = max(qhi, rqpos[row]);
    }

    // pass 1 statistics: threads tpr per row, each over K / tpr keys of a tile
    const int tpr = DG_ATTB_THREADS / R, srow = threadIdx.x / tpr, part = threadIdx.x - srow * tpr;
    float m_run = -dg_inf(), l_run = 0.0f;
    // pass 2 outputs: tile u = warp + 8 ui of the (R / 16) x (d16 / 8) output tiles, row tile u / (d16 / 8)
    const int dtiles = d16 / 8, units = row_tiles * dtiles;
    float acc[DG_ATTB_OUT_TILES][4];
#pragma unroll
    for (int ui = 0; ui < DG_ATTB_OUT_TILES; ++ui)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[ui][i] = 0.0f;

    for (int pass = 0; pass < 2; ++pass) {
        for (int t0 = 0; t0 < T; t0 += K) {
            __syncthreads();                        // the previous tile is consumed (and rm, rl written)
            for (int tk = threadIdx.x; tk < K; tk += blockDim.x) {
                int real;
                kpos[tk] = dg_att_key(t0 + tk, T, n_cache, slot_pos_opt, cache_real_opt, crow, real_stride, n, n_new,
                                      new_pos_opt, new_real_opt, &real);
                kreal[tk] = real;
            }
            __syncthreads();
            bool any = false;                       // the same answer in every thread: a uniform branch
            for (int tk = 0; tk < K; ++tk) {
                const long long pos = kpos[tk];
                any = any || (kreal[tk] && (!causal || pos <= qhi) && (window <= 0 || pos > qlo - window));
            }
            if (!any) continue;
            for (int idx = threadIdx.x; idx < K * DP; idx += blockDim.x) {
                const int tk = idx / DP, p = idx - tk * DP, c = 2 * p;
                float x0 = 0.0f, x1 = 0.0f;
                if (kreal[tk]) {                    // padding keys and empty slots read as zeros
                    const float* src = dg_attb_row(cache_k_opt, new_k_opt, t0 + tk, n_cache, crow, n, j, n_kv,
                                                   slots, n_new, d);
                    x0 = c < d ? src[c] : 0.0f;
                    x1 = c + 1 < d ? src[c + 1] : 0.0f;
                }
                ks[tk * QS + p] = dg_bf16_pair(dg_attb_bits(x0), dg_attb_bits(x1));
            }
            __syncthreads();

            // scores of the warp's 8 keys (tk = 8 kt + 2t, +1) against its row tiles mi = parity + 2 i:
            // S = Q K^T on mma
            float sacc[DG_ATTB_MAX_ROW_TILES / 2][4];
#pragma unroll
            for (int i2 = 0; i2 < DG_ATTB_MAX_ROW_TILES / 2; ++i2)
#pragma unroll
                for (int i = 0; i < 4; ++i) sacc[i2][i] = 0.0f;
            const unsigned* kb = ks + (kt * 8 + g) * QS + t;
            for (int kk = 0; kk < DP; kk += 8) {
                const unsigned b[2] = {kb[kk], kb[kk + 4]};
#pragma unroll
                for (int i2 = 0; i2 < DG_ATTB_MAX_ROW_TILES / 2; ++i2) {
                    const int mi = parity + 2 * i2;
                    if (mi >= row_tiles) break;     // uniform across the warp
                    const unsigned* top = qs + (mi * 16 + g) * QS + kk + t;
                    const unsigned* bottom = top + 8 * QS;
                    const unsigned a[4] = {top[0], bottom[0], top[4], bottom[4]};
                    dg_mma_bf16_16816(sacc[i2], a, b);
                }
            }
#pragma unroll
            for (int i2 = 0; i2 < DG_ATTB_MAX_ROW_TILES / 2; ++i2) {
                const int mi = parity + 2 * i2;
                if (mi >= row_tiles) break;
#pragma unroll
                for (int h = 0; h < 2; ++h) {       // rows g and g + 8 of the row tile
                    const int row = mi * 16 + g + 8 * h;
                    const bool row_ok = row0 + row < rows_total;
                    const long long qp = rqpos[row];
                    float s[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int tk = kt * 8 + 2 * t + e;
                        const long long pos = kpos[tk];
                        const bool vis = row_ok && kreal[tk] && (!causal || pos <= qp) &&
                                         (window <= 0 || pos > qp - window);
                        s[e] = vis ? dg_bf16_to_float(dg_attb_bits(sacc[i2][2 * h + e])) : -dg_inf();
                    }
                    if (pass == 0) {
                        ss[row * SS + kt * 8 + 2 * t] = s[0];
                        ss[row * SS + kt * 8 + 2 * t + 1] = s[1];
                    } else {
                        const float m = rm[row], l = rl[row];
                        unsigned short w[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            w[e] = s[e] == -dg_inf() ? (unsigned short)0 : dg_attb_bits(expf(s[e] - m) / l);
                        ps[row * VS + kt * 4 + t] = dg_bf16_pair(w[0], w[1]);
                    }
                }
            }
            __syncthreads();

            if (pass == 0) {
                // the running maximum and sum of each row over this tile's scores
                const int per = K / tpr;
                const float* sr = ss + srow * SS + part * per;
                float mx = -dg_inf();
                for (int k = 0; k < per; ++k) mx = fmaxf(mx, sr[k]);
                for (int o = 1; o < tpr; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(DG_FULL_MASK, mx, o));
                const float m_new = fmaxf(m_run, mx);
                float sum = 0.0f;
                if (m_new != -dg_inf())
                    for (int k = 0; k < per; ++k) sum += sr[k] == -dg_inf() ? 0.0f : expf(sr[k] - m_new);
                for (int o = 1; o < tpr; o <<= 1) sum += __shfl_xor_sync(DG_FULL_MASK, sum, o);
                l_run = (m_run == -dg_inf() ? 0.0f : l_run * expf(m_run - m_new)) + sum;
                m_run = m_new;
            } else {
                // the tile's values in the keys' place (every warp has read its keys), then O += P V: the warp's
                // output tiles, 16 keys per mma
                for (int idx = threadIdx.x; idx < KP * d16; idx += blockDim.x) {
                    const int kp = idx / d16, c = idx - kp * d16, tk = 2 * kp;
                    float x0 = 0.0f, x1 = 0.0f;
                    if (c < d && kreal[tk])
                        x0 = dg_attb_row(cache_v_opt, new_v_opt, t0 + tk, n_cache, crow, n, j, n_kv, slots, n_new,
                                         d)[c];
                    if (c < d && kreal[tk + 1])
                        x1 = dg_attb_row(cache_v_opt, new_v_opt, t0 + tk + 1, n_cache, crow, n, j, n_kv, slots,
                                         n_new, d)[c];
                    vt[c * VS + kp] = dg_bf16_pair(dg_attb_bits(x0), dg_attb_bits(x1));
                }
                __syncthreads();
#pragma unroll
                for (int kk = 0; kk < KP; kk += 8) {
#pragma unroll
                    for (int ui = 0; ui < DG_ATTB_OUT_TILES; ++ui) {
                        const int u = warp + 8 * ui;
                        if (u >= units) break;      // uniform
                        const int mi = u / dtiles, ni = u - mi * dtiles;
                        const unsigned* top = ps + (mi * 16 + g) * VS + kk + t;
                        const unsigned* bottom = top + 8 * VS;
                        const unsigned a[4] = {top[0], bottom[0], top[4], bottom[4]};
                        const unsigned* vb = vt + (ni * 8 + g) * VS + kk + t;
                        const unsigned b[2] = {vb[0], vb[4]};
                        dg_mma_bf16_16816(acc[ui], a, b);
                    }
                }
            }
        }
        if (pass == 0 && part == 0) {
            rm[srow] = m_run;
            rl[srow] = l_run;
        }
    }

#pragma unroll
    for (int ui = 0; ui < DG_ATTB_OUT_TILES; ++ui) {
        const int u = warp + 8 * ui;
        if (u >= units) break;
        const int mi = u / dtiles, ni = u - mi * dtiles;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = mi * 16 + g + 8 * (i >> 1), c = ni * 8 + 2 * t + (i & 1);
            const long long grow = row0 + row;
            if (grow >= rows_total || c >= d) continue;
            const long long qi = grow / r, hl = grow - qi * r;
            out[(((long long)n * S + qi) * n_heads + (long long)j * r + hl) * d + c] =
                dg_bf16_to_float(dg_attb_bits(acc[ui][i]));
        }
    }
}
