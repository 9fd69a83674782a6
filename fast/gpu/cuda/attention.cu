// Grouped-query attention of queries over [cached keys ++ fresh keys], scale 1.0, float32 softmax.
//
// Upstream: DiffusionGemmaTextAttention with eager attention and a DynamicCache (SPEC §4.1 step 6,
// §6 step 2 for the encoder, §7.3 for the decoder; traps T2, T5, T6).
//   * scores are <q, k> with no 1/sqrt(d) and no soft-cap;
//   * KV head j serves the r = n_heads / n_kv consecutive query heads j*r .. j*r + r - 1;
//   * key t is visible from a query at position p iff it is a real token (not padding) and
//     (!causal || pos_t <= p) and (window <= 0 || pos_t > p - window);
//     the encoder passes causal = 1 and window = W on sliding layers; the decoder passes causal = 0,
//     window = 0 (every retained cache entry and the whole canvas are visible);
//   * a query that sees no key gets a zero output (the reference's convention; nothing reads it).
//
// The cache of a layer is read in storage order: slot t < n_cache holds position slot_pos[t] (-1 when
// empty; sliding layers keep a ring of W - 1 slots, position p in slot p mod (W - 1)). The order of the
// keys does not matter to the softmax. Padding is cache_real[cache_row, position] == 0.
//
// Algorithm (one pass over the keys, "online softmax"): a block owns one batch row n, one KV head j and
// q_block consecutive queries, i.e. rows = q_block * r (query, head) rows, staged in shared memory.
// Keys and values are streamed through shared memory in tiles of key_tile keys. Inside a tile a warp
// scores key_tile keys at once: lane = key * split + part, split = 32 / key_tile lanes per key, each
// summing the dims part, part + split, ... of the dot product (key rows are padded by `split` floats so
// that the 32 lanes hit 32 different banks). Each warp carries DG_ATT_ROWS_PER_WARP rows: a running
// maximum m, a running sum l and an output accumulator of d values spread over the lanes
// (dim c = lane + 32 e). The output is acc / l.
//
// Layouts: q (N, S, n_heads, d); cache_k/v (B_c, n_kv, slots, d); cache_rows (N,) int32 (cache row of
// each query row; NULL: the identity); slot_pos (slots,) int64; cache_real (B_c, real_stride) uint8;
// new_k/v (N, n_kv, n_new, d); new_pos (n_new,) int64; new_real (N, n_new) uint8; q_pos (S,) int64;
// out (N, S, n_heads * d).
// Launch: grid (max(ceil(S / q_block), 1), n_kv, max(N, 1)) (a block past N or S returns at once), block DG_ATT_THREADS, dynamic shared memory
// key_tile * 12 + 4 * (q_block * r * d + key_tile * (2 d + split)) bytes (fast/gpu_launch.py).

#include "common.cuh"

#define DG_ATT_DIMS_PER_LANE (DG_MAX_HEAD_DIM / 32)

extern "C" __global__ void __launch_bounds__(DG_ATT_THREADS)
dg_attention(const float* q, const long long* q_pos, int N, int S, int n_heads, int d,
             const float* cache_k_opt, const float* cache_v_opt, const int* cache_rows_opt, int n_cache,
             int slots, const long long* slot_pos_opt, const unsigned char* cache_real_opt, int real_stride,
             const float* new_k_opt, const float* new_v_opt, int n_new, const long long* new_pos_opt,
             const unsigned char* new_real_opt, int n_kv, long long window, int causal, int q_block,
             int key_tile, float* out) {
    extern __shared__ __align__(16) unsigned char dg_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = n_heads / n_kv;
    const int n = blockIdx.z, j = blockIdx.y, q0 = blockIdx.x * q_block;
    if (n >= N || q0 >= S) return;                  // uniform for the block: N == 0 or S == 0 launch one
    const int nq = min(q_block, S - q0);
    const int rows = nq * r;
    const int split = 32 / key_tile;
    const int kd = d + split;                       // padded key row
    const int crow = cache_rows_opt ? cache_rows_opt[n] : n;
    const int T = n_cache + n_new;

    long long* kpos = (long long*)dg_smem;          // (key_tile,) positions of the tile's keys
    int* kreal = (int*)(kpos + key_tile);           // (key_tile,) 1 = a real key of this tile
    float* qs = (float*)(kreal + key_tile);         // (q_block * r, d) queries of the block
    float* ks = qs + q_block * r * d;               // (key_tile, d + split)
    float* vs = ks + key_tile * kd;                 // (key_tile, d)

    for (int idx = threadIdx.x; idx < rows * d; idx += blockDim.x) {
        const int row = idx / d, c = idx - row * d;
        const int i = row / r, hl = row - i * r;
        qs[idx] = q[(((long long)n * S + q0 + i) * n_heads + (long long)j * r + hl) * d + c];
    }

    float m[DG_ATT_ROWS_PER_WARP], l[DG_ATT_ROWS_PER_WARP];
    float acc[DG_ATT_ROWS_PER_WARP][DG_ATT_DIMS_PER_LANE];
#pragma unroll
    for (int ri = 0; ri < DG_ATT_ROWS_PER_WARP; ++ri) {
        m[ri] = -dg_inf();
        l[ri] = 0.0f;
#pragma unroll
        for (int e = 0; e < DG_ATT_DIMS_PER_LANE; ++e) acc[ri][e] = 0.0f;
    }
    const int kt = lane / split, part = lane - kt * split;

    for (int t0 = 0; t0 < T; t0 += key_tile) {
        __syncthreads();                            // the previous tile (and the queries) are in place/consumed
        for (int idx = threadIdx.x; idx < key_tile * d; idx += blockDim.x) {
            const int t = idx / d, c = idx - t * d, key = t0 + t;
            float kv = 0.0f, vv = 0.0f;
            if (key < n_cache) {
                const long long base = (((long long)crow * n_kv + j) * slots + key) * d + c;
                kv = cache_k_opt[base];
                vv = cache_v_opt[base];
            } else if (key < T) {
                const long long base = (((long long)n * n_kv + j) * n_new + (key - n_cache)) * d + c;
                kv = new_k_opt[base];
                vv = new_v_opt[base];
            }
            ks[t * kd + c] = kv;
            vs[t * d + c] = vv;
        }
        for (int t = threadIdx.x; t < key_tile; t += blockDim.x) {
            int real;
            kpos[t] = dg_att_key(t0 + t, T, n_cache, slot_pos_opt, cache_real_opt, crow, real_stride, n, n_new,
                                 new_pos_opt, new_real_opt, &real);
            kreal[t] = real;
        }
        __syncthreads();

#pragma unroll
        for (int ri = 0; ri < DG_ATT_ROWS_PER_WARP; ++ri) {
            const int row = warp * DG_ATT_ROWS_PER_WARP + ri;
            if (row >= rows) break;                  // uniform across the warp
            const long long qp = q_pos[q0 + row / r];
            const float* qr = qs + row * d;
            const float* kr = ks + kt * kd;
            float dot = 0.0f;
            for (int c = part; c < d; c += split) dot += qr[c] * kr[c];
            for (int o = 1; o < split; o <<= 1) dot += __shfl_xor_sync(DG_FULL_MASK, dot, o);
            const long long pos = kpos[kt];
            const bool vis = kreal[kt] && (!causal || pos <= qp) && (window <= 0 || pos > qp - window);
            const float score = vis ? dot : -dg_inf();
            const float tile_max = dg_warp_max(score);
            if (tile_max == -dg_inf()) continue;     // nothing visible in this tile for this row
            const float m_new = fmaxf(m[ri], tile_max);
            const float corr = expf(m[ri] - m_new); // 0 while nothing was seen (m = -inf)
            const float p = vis ? expf(score - m_new) : 0.0f;
            l[ri] = l[ri] * corr + dg_warp_sum(part == 0 ? p : 0.0f);
#pragma unroll
            for (int e = 0; e < DG_ATT_DIMS_PER_LANE; ++e) acc[ri][e] *= corr;
            for (int t = 0; t < key_tile; ++t) {
                const float pt = __shfl_sync(DG_FULL_MASK, p, t * split);
                if (pt == 0.0f) continue;            // uniform: pt is broadcast
                const float* vr = vs + t * d;
#pragma unroll
                for (int e = 0; e < DG_ATT_DIMS_PER_LANE; ++e) {
                    const int c = lane + 32 * e;
                    if (c < d) acc[ri][e] += pt * vr[c];
                }
            }
            m[ri] = m_new;
        }
    }

#pragma unroll
    for (int ri = 0; ri < DG_ATT_ROWS_PER_WARP; ++ri) {
        const int row = warp * DG_ATT_ROWS_PER_WARP + ri;
        if (row >= rows) break;
        const int i = row / r, hl = row - i * r;
        float* o = out + (((long long)n * S + q0 + i) * n_heads + (long long)j * r + hl) * d;
        const float total = l[ri];
#pragma unroll
        for (int e = 0; e < DG_ATT_DIMS_PER_LANE; ++e) {
            const int c = lane + 32 * e;
            if (c < d) o[c] = total > 0.0f ? acc[ri][e] / total : 0.0f;
        }
    }
}
