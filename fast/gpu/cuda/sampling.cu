// The per-step sampling pass over the canvas logits, and the entropy-bound acceptance with renoising.
//
// Upstream (transformers 5.24.0, generation_diffusion_gemma.py): LinearTemperatureScheduleLogitsProcessor,
// torch.softmax, torch.argmax, Categorical.entropy, EntropyBoundSampler.accept_canvas / renoise_canvas;
// the categorical draw is the project's own inverse-CDF rule (reference/sampling.py
// categorical_from_uniform), driven by uniforms drawn on the host from the reference's Philox stream.

#include "common.cuh"
#include "bf16.cuh"

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

// An empty stretch: nothing seen (the argmax past the vocabulary).
__device__ __forceinline__ void dg_stats_start(DgStats& s, int vocab) {
    s.m = -dg_inf(); s.arg = vocab; s.S = 0.0; s.A = 0.0; s.flags = 0;
}

// One more processed logit x at index v (indices increasing within a thread's stretch).
__device__ __forceinline__ void dg_stats_add(DgStats& s, float x, int v) {
    if (x != x) { s.flags |= 1; return; }
    if (x == dg_inf()) { s.flags |= 2; return; }
    if (x == -dg_inf()) return;
    if (x > s.m) { dg_stats_rescale(s, x); s.arg = v; }
    const float d = x - s.m;
    const float e = expf(d);
    s.S += (double)e;
    if (e > 0.0f) s.A += (double)e * (double)d;
}

// Merge the statistics of the 32 lanes of a warp (a butterfly: every lane ends with the warp's).
__device__ __forceinline__ void dg_stats_warp_merge(DgStats& s) {
    for (int o = 16; o > 0; o >>= 1) {
        DgStats other;
        other.m = __shfl_xor_sync(DG_FULL_MASK, s.m, o);
        other.arg = __shfl_xor_sync(DG_FULL_MASK, s.arg, o);
        other.S = __shfl_xor_sync(DG_FULL_MASK, s.S, o);
        other.A = __shfl_xor_sync(DG_FULL_MASK, s.A, o);
        other.flags = __shfl_xor_sync(DG_FULL_MASK, s.flags, o);
        dg_stats_merge(s, other);
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
// The work of one block on one row z of logits (dg_sample_rows, dg_sample_step): u_opt points at the row's
// uniform (NULL: no draw); argmax, entropy, sampled, flags at the row's outputs; part, row_stats and
// chunk_sum are the calling kernel's shared memory.
// bf16_sc_opt (the bf16 flag; NULL: off, the float32 run): a row of vocab floats that receives a bfloat16
// run's self-conditioning input (SPEC B8: upstream casts the processed logits to bfloat16, then softmaxes them
// in float32): with xb = bf16(x) (nearest, ties to even, dg_bf16_round), pb = float32(exp(xb - mb)) / float32(Sb),
// mb and Sb the statistics of xb accumulated exactly as those of x above (the same threads, order and merges).
// Those are the bits the per-step loop computes with dg_softcap, a float32 division, dg_round_bf16 and
// dg_sample_rows (cap = temp = 0) on a copy of the row (fast/gpu/sampling.py _bf16_self_conditioning). The
// row z still receives the float32 probabilities (the draw, the entropy and the argmax are the float32
// run's). If xb flags what x does not (a finite x that rounds to +inf, every xb -inf), the flag is set and
// the row left as it was, as for x.
__device__ __forceinline__ void dg_sample_row(float* z, int vocab, float cap, float temp, const double* u_opt,
                                              long long* argmax, float* entropy, long long* sampled, int* flags,
                                              float* bf16_sc_opt, DgStats* part, DgStats& row_stats,
                                              double* chunk_sum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    // pass 1: statistics, one element at a time per thread (strided, coalesced), then a block merge
    DgStats s, sb;                                   // sb: the statistics of bf16(x) (bf16_sc_opt only)
    dg_stats_start(s, vocab);
    dg_stats_start(sb, vocab);
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float x = dg_processed(z[v], cap, temp);
        dg_stats_add(s, x, v);
        if (bf16_sc_opt) dg_stats_add(sb, dg_bf16_round(x), v);
    }
    dg_stats_warp_merge(s);
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        DgStats t = part[0];
        for (int w = 1; w < warps; ++w) dg_stats_merge(t, part[w]);
        row_stats = t;
        int f = t.flags;
        if (f == 0 && t.m == -dg_inf()) f = 4;
        *flags = f;
        if (f == 0) {
            *argmax = t.arg;
            *entropy = (float)(log(t.S) - t.A / t.S);
        }
    }
    __syncthreads();
    const DgStats t = row_stats;
    float mb = 0.0f, total_b = 1.0f;
    if (bf16_sc_opt) {                               // uniform: a kernel argument
        // the statistics of bf16(x), merged as those of x; part is free again (thread 0 read it before the
        // barrier above), and thread 0 leaves the block's merge in part[0]
        dg_stats_warp_merge(sb);
        if (lane == 0) part[warp] = sb;
        __syncthreads();
        if (threadIdx.x == 0) {
            DgStats tb = part[0];
            for (int w = 1; w < warps; ++w) dg_stats_merge(tb, part[w]);
            part[0] = tb;
            int f = tb.flags;
            if (f == 0 && tb.m == -dg_inf()) f = 4;
            if (t.flags == 0 && t.m != -dg_inf() && f != 0) *flags = f;
        }
        __syncthreads();
        const DgStats tb = part[0];
        if (tb.flags != 0 || tb.m == -dg_inf()) return;   // uniform: the host raises for this row
        mb = tb.m;
        total_b = (float)tb.S;
    }
    if (t.flags != 0 || t.m == -dg_inf()) return;   // uniform: the host raises for this row

    // pass 2: probabilities in place, and the float64 sum of each chunk of the stored values
    const float m = t.m, total = (float)t.S;
    const int n_chunks = (vocab + DG_SAMPLE_CHUNK - 1) / DG_SAMPLE_CHUNK;
    for (int c = warp; c < n_chunks; c += warps) {
        double acc = 0.0;
        for (int k = lane; k < DG_SAMPLE_CHUNK; k += 32) {
            const int v = c * DG_SAMPLE_CHUNK + k;
            if (v >= vocab) break;
            const float x = dg_processed(z[v], cap, temp);
            const float p = expf(x - m) / total;
            z[v] = p;
            if (bf16_sc_opt) bf16_sc_opt[v] = expf(dg_bf16_round(x) - mb) / total_b;
            acc += (double)p;
        }
        acc = dg_warp_sum_d(acc);
        if (lane == 0) chunk_sum[c] = acc;
    }
    if (!u_opt) return;
    __syncthreads();                                 // every probability and chunk sum is stored
    if (warp != 0) return;

    // pass 3 (warp 0): locate the chunk, then scan inside it 32 entries at a time (see the head comment)
    double row_total = 0.0;
    for (int c = 0; c < n_chunks; ++c) row_total += chunk_sum[c];
    const double u = *u_opt;
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
    if (lane == 0) *sampled = found;
}

extern "C" __global__ void __launch_bounds__(DG_SAMPLE_THREADS)
dg_sample_rows(float* logits, const int* rows, int n_rows, int vocab, float cap, float temp,
               const double* uniforms_opt, long long* argmax, float* entropy, long long* sampled, int* flags) {
    extern __shared__ __align__(16) unsigned char dg_smem[];
    __shared__ DgStats part[DG_SAMPLE_THREADS / 32];
    __shared__ DgStats row_stats;
    const int i = blockIdx.x;
    if (i >= n_rows) return;
    dg_sample_row(logits + (long long)rows[i] * vocab, vocab, cap, temp, uniforms_opt ? uniforms_opt + i : nullptr,
                  argmax + i, entropy + i, sampled + i, flags + i, nullptr, part, row_stats, (double*)dg_smem);
}

// dg_sample_rows for one denoising step of a canvas whose step is captured once and replayed (fast/gpu/canvas.py):
// every per-step value is read from device memory at the step index *step (advanced by dg_step_end), so the
// launch's arguments are the same at every step. Row i of the launch is logits row r = rows[i] of (B*C, vocab),
// r = b*C + c; its temperature is temps[*step] (0: none), its uniform uniforms[*step * stride + r]; its outputs
// go to argmax[r], entropy[r], sampled[r] (arrays of B*C) and its flags to flags[*step * stride + r] (stride:
// B*C). The same results as dg_sample_rows with those arguments. bf16_sc_opt (the bf16 flag, a bfloat16 model's
// run; NULL: off): (B*C, vocab), its row r receives B8's self-conditioning probabilities of logits row r
// (dg_sample_row), the next step's self-conditioning input.
extern "C" __global__ void __launch_bounds__(DG_SAMPLE_THREADS)
dg_sample_step(float* logits, const int* rows, int n_rows, int vocab, float cap, const float* temps,
               const int* step, const double* uniforms, long long stride, long long* argmax, float* entropy,
               long long* sampled, int* flags, float* bf16_sc_opt) {
    extern __shared__ __align__(16) unsigned char dg_smem[];
    __shared__ DgStats part[DG_SAMPLE_THREADS / 32];
    __shared__ DgStats row_stats;
    const int i = blockIdx.x;
    if (i >= n_rows) return;
    const long long s = *step;
    const long long r = rows[i];
    dg_sample_row(logits + r * vocab, vocab, cap, temps[s], uniforms + s * stride + r, argmax + r, entropy + r,
                  sampled + r, flags + s * stride + r, bf16_sc_opt ? bf16_sc_opt + r * vocab : nullptr, part,
                  row_stats, (double*)dg_smem);
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

// The ranks of one row's entropies H (C positions) and the acceptance of each rank (the block's shared
// sorted, rank, ok; see dg_accept_renoise). Every thread of the block calls it; ends with a barrier.
__device__ __forceinline__ void dg_accept_ranks(const float* H, int C, float bound, float* sorted, int* rank,
                                                unsigned char* ok) {
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
    dg_accept_ranks(entropy + (long long)b * C, C, bound, sorted, rank, ok);
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const long long at = (long long)b * C + j;
        const unsigned char a = ok[rank[j]];
        accepted[at] = a;
        next_canvas[at] = a ? sampled[at] : noise[at];
    }
}

// NumPy's float32 pairwise summation of a[0..n) (pairwise_sum of numpy/_core/src/umath/loops_utils.h), the
// same float32 additions in the same order as fast/gpu/canvas.py _pairwise_sum: below 8 values one by one from
// 0; up to 128, eight running sums over blocks of 8, combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then
// the remainder; above, the two halves (the first a multiple of 8 long) summed separately.
__device__ float dg_pairwise_sum(const float* a, int n) {
    if (n < 8) {
        float res = 0.0f;
        for (int i = 0; i < n; ++i) res = res + a[i];
        return res;
    }
    if (n <= 128) {
        const int m = n - n % 8;
        float r[8];
        for (int k = 0; k < 8; ++k) r[k] = a[k];
        for (int i = 8; i < m; i += 8)
            for (int k = 0; k < 8; ++k) r[k] = r[k] + a[i + k];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (int i = m; i < n; ++i) res = res + a[i];
        return res;
    }
    int n2 = n / 2;
    n2 -= n2 % 8;
    return dg_pairwise_sum(a, n2) + dg_pairwise_sum(a + n2, n - n2);
}

// The rest of one denoising step after dg_sample_step, for B rows of C positions (one block per row, block
// DG_ACCEPT_THREADS, dynamic shared memory 9 * C bytes as dg_accept_renoise; grid max(B, 1)), at the step
// index s = *step (reference/generate.py denoise_canvas f-i):
//   a row not finished (finished[b] == 0): entropy-bound acceptance of its new entropies entropy[b] (as
//     dg_accept_renoise), canvas[b] = accepted ? sampled[b] : noise[s, b]; draft[b] = argmax[b];
//     entropies[b] = entropy[b]. A finished row keeps its canvas, draft and entropies (SPEC 8.2 h).
//   stop_rule != 0, the stable-and-confident rule: stable = every one of the `stability` rows of history
//     (the last drafts, a ring (stability, B, C), -1 before any) equals the new draft (true for
//     stability == 0); then history[s % stability, b] = draft[b]; confident = float32 mean of entropies[b]
//     (NumPy's pairwise sum, divided in float64) < gamma. A row stable and confident is finished; if it was
//     not yet, finish_step[b] = s.
//   rec_*_opt (all given or none): this step's records at [s, b]: draft, canvas, entropies after the step,
//     sampled (finished rows: their canvas before the step), accepted (0 for finished rows), finished.
// argmax, sampled, canvas, draft, history, rec_draft, rec_sampled, rec_canvas: int64; entropy, entropies,
// rec_entropies float32; finished, rec_accepted, rec_finished uint8; noise (N, B, C); finish_step (B,) int32.
extern "C" __global__ void dg_step_update(const long long* argmax, const float* entropy, const long long* sampled,
                                          const long long* noise, const int* step, int B, int C, float bound,
                                          int stop_rule, int stability, float gamma, long long* canvas,
                                          long long* draft, float* entropies, unsigned char* finished,
                                          int* finish_step, long long* history, long long* rec_draft_opt,
                                          long long* rec_sampled_opt, long long* rec_canvas_opt,
                                          float* rec_entropies_opt, unsigned char* rec_accepted_opt,
                                          unsigned char* rec_finished_opt) {
    extern __shared__ __align__(16) unsigned char dg_smem[];
    float* sorted = (float*)dg_smem;
    int* rank = (int*)(sorted + C);
    unsigned char* ok = (unsigned char*)(rank + C);
    __shared__ int stop, ring;                      // the row stops; the history slot to write (-1: none)
    const int b = blockIdx.x;
    if (b >= B) return;                             // uniform for the block
    const long long s = *step;
    const long long row = (long long)b * C;
    const long long here = s * B * C + row;         // this row of step s in (N, B, C)
    const bool frozen = finished[b] != 0;
    if (!frozen) dg_accept_ranks(entropy + row, C, bound, sorted, rank, ok);
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const long long at = row + j;
        const long long before = canvas[at];
        if (rec_sampled_opt) rec_sampled_opt[here + j] = frozen ? before : sampled[at];
        if (rec_accepted_opt) rec_accepted_opt[here + j] = frozen ? 0 : ok[rank[j]];
        if (!frozen) {
            canvas[at] = ok[rank[j]] ? sampled[at] : noise[here + j];
            draft[at] = argmax[at];
            entropies[at] = entropy[at];
        }
    }
    __syncthreads();
    // (after a barrier, conditions read shared memory only: a kernel parameter tested by thread 0 alone before
    // the barrier and by every thread after it would let the compiler give thread 0 its own copy of the barrier)
    if (threadIdx.x == 0) {
        int stable = 1;
        for (int t = 0; t < stability && stable; ++t) {
            const long long* past = history + (long long)t * B * C + row;
            for (int j = 0; j < C; ++j)
                if (past[j] != draft[row + j]) { stable = 0; break; }
        }
        const float mean = (float)((double)dg_pairwise_sum(entropies + row, C) / (double)C);
        stop = (stop_rule != 0) & (stable != 0) & (mean < gamma);
        ring = stop_rule != 0 && stability > 0 ? (int)(s % stability) : -1;
    }
    __syncthreads();
    const int slot = ring;
    if (slot >= 0) {
        long long* past = history + (long long)slot * B * C + row;
        for (int j = threadIdx.x; j < C; j += blockDim.x) past[j] = draft[row + j];
    }
    if (threadIdx.x == 0) {
        const int stopped = stop;
        if (stopped && !frozen) finish_step[b] = (int)s;
        if (stopped) finished[b] = 1;
        if (rec_finished_opt) rec_finished_opt[s * B + b] = frozen || stopped;
    }
    if (rec_draft_opt) {
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            rec_draft_opt[here + j] = draft[row + j];
            rec_canvas_opt[here + j] = canvas[row + j];
            rec_entropies_opt[here + j] = entropies[row + j];
        }
    }
}

// The end of a captured step (one block of DG_ACCEPT_THREADS threads): status[s] = 1 if any of the step's
// n sampling flags flags[s * n .. s * n + n) is set, else 0; status[s + 1 + b] = finish_step[b] for the B
// rows; then the step index advances: *step = s + 1. After step s, status[i .. s + 1 + B) holds the flags of
// steps i..s followed by every row's finish step (the host's stop flag, fast/gpu/canvas.py); status has
// N + B entries.
extern "C" __global__ void dg_step_end(const int* flags, long long n, const int* finish_step, int B, int* status,
                                       int* step) {
    __shared__ int any;
    const long long s = *step;
    if (threadIdx.x == 0) any = 0;
    __syncthreads();
    int mine = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) mine |= flags[s * n + i] != 0;
    if (mine) atomicMax(&any, 1);
    __syncthreads();
    if (threadIdx.x == 0) status[s] = any;
    for (int b = threadIdx.x; b < B; b += blockDim.x) status[s + 1 + b] = finish_step[b];
    __syncthreads();
    if (threadIdx.x == 0) *step = (int)(s + 1);
}
