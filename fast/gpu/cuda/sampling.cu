// The per-step sampling pass over the canvas logits, and the entropy-bound acceptance with renoising.
//
// Upstream (transformers 5.24.0, generation_diffusion_gemma.py): LinearTemperatureScheduleLogitsProcessor,
// torch.softmax, torch.argmax, Categorical.entropy, EntropyBoundSampler.accept_canvas / renoise_canvas;
// the categorical draw is the project's own inverse-CDF rule (reference/sampling.py
// categorical_from_uniform), driven by uniforms drawn on the host from the reference's Philox stream.

#include "common.cuh"

// Processed logit of one vocabulary entry: soft-cap (cap > 0), then division by the temperature (temp > 0),
// each a float32 operation as in the reference (softcap, then scale_logits).
__device__ __forceinline__ float dg_processed(float z, float cap, float temp) {
    if (cap > 0.0f) z = cap * tanhf(z / cap);
    if (temp > 0.0f) z = z / temp;
    return z;
}

// Running statistics of a stretch of processed logits: maximum m (first index arg), S = sum exp(x - m),
// A = sum exp(x - m) * (x - m), in float64; flags 1 = NaN seen, 2 = +inf seen.
struct DgStats {
    float m;
    int arg;
    double S, A;
    int flags;
};

__device__ __forceinline__ void dg_stats_rescale(DgStats& s, float new_m) {
    if (s.S > 0.0) {
        const double shift = (double)s.m - (double)new_m;   // <= 0
        const double c = exp(shift);
        s.A = c * (s.A + s.S * shift);
        s.S = c * s.S;
    }
    s.m = new_m;
}

__device__ __forceinline__ void dg_stats_merge(DgStats& a, const DgStats& b) {
    a.flags |= b.flags;
    if (b.m == -dg_inf()) return;                   // b saw nothing finite
    if (b.m > a.m || (b.m == a.m && b.arg < a.arg)) a.arg = b.arg;
    if (b.m > a.m) {
        dg_stats_rescale(a, b.m);
        a.S += b.S;
        a.A += b.A;
    } else {
        DgStats c = b;
        dg_stats_rescale(c, a.m);
        a.S += c.S;
        a.A += c.A;
    }
}

// The reference's categorical rule itself (reference/sampling.py categorical_from_uniform) on a finished row
// of probabilities p: Q_v = p_0 + ... + p_v strictly left to right in float64, target = u * Q_{V-1}, the first
// v with Q_v > target, else the last v with p_v > 0. One thread, sequential: only for the rare draws the
// parallel search below cannot decide.
__device__ long long dg_cdf_exact(const float* p, int vocab, double u) {
    double total = 0.0;
    for (int v = 0; v < vocab; ++v) total += (double)p[v];
    const double target = u * total;
    double c = 0.0;
    for (int v = 0; v < vocab; ++v) {
        c += (double)p[v];
        if (c > target) return v;
    }
    for (int v = vocab - 1; v >= 0; --v)
        if (p[v] > 0.0f) return v;
    return 0;
}

// One row of logits per block (grid = max(n_rows, 1), block = DG_SAMPLE_THREADS, dynamic shared memory
// 8 * ceil(vocab / DG_SAMPLE_CHUNK) bytes). Row i of the launch is logits row rows[i] of (R_all, vocab).
// With x = processed logits of the row (soft-cap if cap > 0, then / temp if temp > 0):
//   argmax[i]  first index of max x (reference argmax_tokens);
//   entropy[i] entropy of softmax(x) in nats, float32 of log S - A / S (reference softmax_and_entropy);
//   the row of `logits` is overwritten with p = float32(exp(x - m)) / float32(S): the probabilities, which
//              are also the next step's self-conditioning input (softmax of the processed logits);
//   sampled[i] (uniforms_opt given) exactly the id of reference categorical_from_uniform on the stored row
//              p for u = uniforms_opt[i] in [0, 1): the first id whose left-to-right float64 cumulative sum
//              exceeds u * total, else the last id of nonzero probability. Found in parallel: chunk sums
//              (per-lane float64 sums, a warp tree) choose the chunk, warp scans the id. Each running value
//              E_v formed that way is a float64 summation of exactly p_0..p_v, as is the reference's Q_v,
//              so |E_v - Q_v| and the difference of the totals are at most 2 gamma_V X each (X the exact
//              sum, gamma_V = V 2^-53 / (1 - V 2^-53)). The id v is kept when E_{v-1} + delta < u * total <
//              E_v - delta, delta = (vocab + 2) 2^-50 * total (twice the bound on both errors): then
//              Q_{v-1} < u * Q_{V-1} < Q_v. Otherwise (a chunk whose scans miss the target, the target
//              within delta of a cumulative sum or of the total: ~5e-10 of the draws at V = 262144) lane 0
//              recomputes the draw by the reference's rule (dg_cdf_exact). An id of probability 0 is never
//              drawn (its E_v and E_{v-1} sum the same values, so they are closer than 2 delta);
//   flags[i]   1 NaN, 2 +inf, 4 every entry -inf or vocab == 0 (the row is then left as it was; the host
//              raises).
// n_rows == 0 or vocab == 0 write nothing but flags (a grid of one block for n_rows == 0 writes nothing).
extern "C" __global__ void __launch_bounds__(DG_SAMPLE_THREADS)
dg_sample_rows(float* logits, const int* rows, int n_rows, int vocab, float cap, float temp,
               const double* uniforms_opt, long long* argmax, float* entropy, long long* sampled, int* flags) {
    extern __shared__ __align__(16) unsigned char dg_smem[];
    double* chunk_sum = (double*)dg_smem;           // (ceil(vocab / DG_SAMPLE_CHUNK),)
    __shared__ DgStats part[DG_SAMPLE_THREADS / 32];
    __shared__ DgStats row_stats;
    const int i = blockIdx.x;
    if (i >= n_rows) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* z = logits + (long long)rows[i] * vocab;

    // pass 1: statistics, one element at a time per thread (strided, coalesced), then a block merge
    DgStats s;
    s.m = -dg_inf(); s.arg = vocab; s.S = 0.0; s.A = 0.0; s.flags = 0;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float x = dg_processed(z[v], cap, temp);
        if (x != x) { s.flags |= 1; continue; }
        if (x == dg_inf()) { s.flags |= 2; continue; }
        if (x == -dg_inf()) continue;
        if (x > s.m) { dg_stats_rescale(s, x); s.arg = v; }
        const float d = x - s.m;
        const float e = expf(d);
        s.S += (double)e;
        if (e > 0.0f) s.A += (double)e * (double)d;
    }
    for (int o = 16; o > 0; o >>= 1) {
        DgStats other;
        other.m = __shfl_xor_sync(DG_FULL_MASK, s.m, o);
        other.arg = __shfl_xor_sync(DG_FULL_MASK, s.arg, o);
        other.S = __shfl_xor_sync(DG_FULL_MASK, s.S, o);
        other.A = __shfl_xor_sync(DG_FULL_MASK, s.A, o);
        other.flags = __shfl_xor_sync(DG_FULL_MASK, s.flags, o);
        dg_stats_merge(s, other);
    }
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        DgStats t = part[0];
        for (int w = 1; w < warps; ++w) dg_stats_merge(t, part[w]);
        row_stats = t;
        int f = t.flags;
        if (f == 0 && t.m == -dg_inf()) f = 4;
        flags[i] = f;
        if (f == 0) {
            argmax[i] = t.arg;
            entropy[i] = (float)(log(t.S) - t.A / t.S);
        }
    }
    __syncthreads();
    const DgStats t = row_stats;
    if (t.flags != 0 || t.m == -dg_inf()) return;   // uniform: the host raises for this row

    // pass 2: probabilities in place, and the float64 sum of each chunk of the stored values
    const float m = t.m, total = (float)t.S;
    const int n_chunks = (vocab + DG_SAMPLE_CHUNK - 1) / DG_SAMPLE_CHUNK;
    for (int c = warp; c < n_chunks; c += warps) {
        double acc = 0.0;
        for (int k = lane; k < DG_SAMPLE_CHUNK; k += 32) {
            const int v = c * DG_SAMPLE_CHUNK + k;
            if (v >= vocab) break;
            const float p = expf(dg_processed(z[v], cap, temp) - m) / total;
            z[v] = p;
            acc += (double)p;
        }
        acc = dg_warp_sum_d(acc);
        if (lane == 0) chunk_sum[c] = acc;
    }
    if (!uniforms_opt) return;
    __syncthreads();                                 // every probability and chunk sum is stored
    if (warp != 0) return;

    // pass 3 (warp 0): locate the chunk, then scan inside it 32 entries at a time (see the head comment)
    double row_total = 0.0;
    for (int c = 0; c < n_chunks; ++c) row_total += chunk_sum[c];
    const double u = uniforms_opt[i];
    const double target = u * row_total;
    const double margin = ((double)vocab + 2.0) * 8.8817841970012523e-16 * row_total;   // (V + 2) 2^-50 T
    long long found = -1;                            // -1: not located yet; -2: too close to call
    double base = 0.0;
    for (int c = 0; c < n_chunks && found == -1; ++c) {
        if (base + chunk_sum[c] > target) {
            double run = base;
            for (int g = 0; g < DG_SAMPLE_CHUNK && found == -1; g += 32) {
                const int v = c * DG_SAMPLE_CHUNK + g + lane;
                const double p = v < vocab ? (double)z[v] : 0.0;
                double scan = p;                     // inclusive prefix sum over the 32 lanes
                for (int o = 1; o < 32; o <<= 1) {
                    const double up = __shfl_up_sync(DG_FULL_MASK, scan, o);
                    if (lane >= o) scan += up;
                }
                const double left = __shfl_up_sync(DG_FULL_MASK, scan, 1);
                const double at = run + scan;                    // E_v
                const double below = lane > 0 ? run + left : run; // E_{v-1}
                const unsigned hit = __ballot_sync(DG_FULL_MASK, v < vocab && p > 0.0 && at > target);
                if (hit) {
                    const int first = __ffs(hit) - 1;
                    const int sure = target - below > margin && at - target > margin;
                    found = __shfl_sync(DG_FULL_MASK, sure, first) ? c * DG_SAMPLE_CHUNK + g + first : -2;
                }
                run += __shfl_sync(DG_FULL_MASK, scan, 31);
            }
            if (found == -1) found = -2;             // the chunk's sum exceeds the target, its scans do not
        }
        base += chunk_sum[c];
    }
    if (found < 0 && lane == 0) found = dg_cdf_exact(z, vocab, u);   // undecided, or the target at the total
    if (lane == 0) sampled[i] = found;
}

// Entropy-bound acceptance and renoising for B batch rows of C positions (one block per row, arrays
// compacted to the rows being denoised; grid max(B, 1): a block past B returns). Per row: sort the entropies
// ascending (stable: ties by position; NaN after every number, as NumPy's argsort), S_k = float32 of the
// float64 running sum of the sorted entropies, accept sorted item k iff float32(S_k - H_(k)) <= bound; then
// next = accepted ? sampled : noise (reference entropy_bound_accept and renoise, bit for bit given the same
// entropies; a NaN entropy makes every later S_k NaN, so nothing from it on is accepted, as there).
// entropy: (B, C) float32; sampled, noise, next_canvas: (B, C) int64; accepted: (B, C) uint8. Dynamic shared
// memory: 9 * C bytes (fast/gpu/launch.py).

// Whether entropy `o` at position i sorts before entropy `h` at position j: a strict total order (NaN
// last, NaNs by position), so the ranks below are a permutation even with NaN (each sorted slot has one
// writer).
__device__ __forceinline__ bool dg_sorts_before(float o, int i, float h, int j) {
    const bool o_nan = o != o, h_nan = h != h;
    if (o_nan || h_nan) return h_nan && (!o_nan || i < j);
    return o < h || (o == h && i < j);
}

extern "C" __global__ void dg_accept_renoise(const float* entropy, const long long* sampled, const long long* noise,
                                             int B, int C, float bound, unsigned char* accepted,
                                             long long* next_canvas) {
    extern __shared__ __align__(16) unsigned char dg_smem[];
    float* sorted = (float*)dg_smem;                // (C,) entropies in ascending order
    int* rank = (int*)(sorted + C);                 // (C,) rank of each position
    unsigned char* ok = (unsigned char*)(rank + C); // (C,) acceptance of each rank
    const int b = blockIdx.x;
    if (b >= B) return;                             // uniform for the block
    const float* H = entropy + (long long)b * C;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float h = H[j];
        int r = 0;
        for (int i = 0; i < C; ++i) {
            const float o = H[i];
            r += dg_sorts_before(o, i, h, j);
        }
        rank[j] = r;
        sorted[r] = h;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double run = 0.0;
        for (int k = 0; k < C; ++k) {
            run += (double)sorted[k];
            const float cumulative = (float)run;
            ok[k] = (cumulative - sorted[k]) <= bound;
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const long long at = (long long)b * C + j;
        const unsigned char a = ok[rank[j]];
        accepted[at] = a;
        next_canvas[at] = a ? sampled[at] : noise[at];
    }
}
