/* Fused CPU kernels for the contract (exactlogp.CONTRACT): row max, exact row record,
 * finalize, gradient; and the chunk maxima of the exact cut (Backend.chunk_max).
 *
 * Every element goes through exactly the IEEE operations of exactlogp/contract.py, in the
 * same order, so the results are bitwise those of the torch reference:
 *
 *   1. y = fp32(x) / tau        fp32 division (skipped for a scalar tau == 1)
 *   2. M = max of valid y       exact in any order
 *   3. e = exp_c(y - M)         binary64 + - * only: Cody-Waite, table, Horner, 2^n from bits
 *   4. (hi, lo) = Q(e), Q(w)    floor and magic-number rint, both exact
 *   5. limb sums                hi: integer-valued doubles summed exactly (< 2^53), then
 *                               int64; lo: the bits of lo + MAGIC summed in uint64
 *   7. finalize                 contract.finalize per row, scalar binary64, the same order
 *   backward                    p = e / fl(S), the formulas of contract.grad_block (one for
 *                               the target column, one for the others), / tau,
 *                               fp64 -> fp32 -> dtype, each a round to nearest even
 *
 * Built with -ffp-contract=off and without -ffast-math: no reassociation, and no FMA but
 * where a product is exact (exact_product_add: there the FMA's one rounding is the add's). The
 * constants come from the header that exactlogp/backends/cpu_build.py generates from
 * contract.py. The arithmetic is written once with GCC vector extensions of DW doubles
 * (FW = 2 DW floats): DW = 8 in the AVX-512 build, 4 in the AVX2 and portable builds; only
 * the data-movement primitives below (widen, narrow, floor, table lookup, 8-, 16- and
 * 32-bit loads) have an ISA-specific form, and they move bits or floor; and the AVX-512 build
 * keeps the forward's term and non-finite masks in mask registers (scaled_term_exps,
 * count_nonfinite: the same compares on the same lanes).
 *
 * Rows are spread over torch's OpenMP threads; a row's result never depends on the thread
 * that ran it. Long rows of 16-bit logits (and fp32 rows whose values are all
 * exactly bf16) take the value-table path (see "value tables" below): the contract is
 * evaluated once per distinct value of the row instead of once per column. When the shard
 * is the whole vocabulary (no TP group), `elp_forward` runs stages 2-7 of each row in one
 * go: through the tables the row is read once, and M is the largest of its distinct
 * values; in the direct loops the max pass also finds what lets the sums skip work that
 * cannot change them (see direct_sums).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "exactlogp_constants.h"

#define ELP_INLINE static inline __attribute__((always_inline))

/* DW doubles per vector; a step handles V4 = 2 V8 such vectors, LANES columns. */
#if defined(__AVX512F__)
#define ELP_DW 8
#else
#define ELP_DW 4
#endif
#define ELP_V8 4
enum { DW = ELP_DW, FW = 2 * ELP_DW, V8 = ELP_V8, V4 = 2 * ELP_V8, LANES = FW * ELP_V8 };

typedef double vd __attribute__((vector_size(8 * ELP_DW)));
typedef int64_t vl __attribute__((vector_size(8 * ELP_DW)));
typedef uint64_t vul __attribute__((vector_size(8 * ELP_DW)));
typedef float vf __attribute__((vector_size(8 * ELP_DW)));
typedef int32_t vi __attribute__((vector_size(8 * ELP_DW)));
typedef uint32_t vu __attribute__((vector_size(8 * ELP_DW)));
typedef uint16_t vh __attribute__((vector_size(4 * ELP_DW)));
typedef uint8_t vb __attribute__((vector_size(2 * ELP_DW)));

enum { ELP_F32 = 0, ELP_BF16 = 1, ELP_F16 = 2 };

/* One shard of logits as the passes see it (mirrored by cpu.py's ctypes struct). */
typedef struct {
    const void *x;          /* [n_rows, row_stride] logits, unit column stride */
    int64_t row_stride;     /* in elements */
    int64_t n_rows, n_cols; /* n_cols = V_local */
    int64_t n_real;         /* columns [0, n_real) are vocabulary, the rest padding */
    const uint8_t *keep;    /* [n_rows, keep_stride] bool, or NULL: every column kept */
    int64_t keep_stride;
    const float *tau_rows; /* [n_rows] fp32 per-row temperature, or NULL */
    double tau;            /* scalar temperature when tau_rows is NULL */
    int32_t dtype;         /* ELP_F32, ELP_BF16, ELP_F16 */
    int32_t num_threads;
    int64_t table_min_cols; /* rows with at least this many real columns take the value-table
                               path (16-bit rows; fp32 rows whose values are exactly bf16);
                               < 0: never */
    const int64_t *target;  /* [n_rows] global target ids (not read by the row max pass) */
    int64_t vocab_start;    /* global id of local column 0 */
    int64_t vocab_size;     /* finalize's range check; < 0: not given */
    int64_t ignore_index;
    /* rows in two levels, as a (B, T, V) view such as logits[:, :-1, :] is read without a
       copy: row r is row r % rows_inner of block r / rows_inner, and row_stride (and
       keep_stride) step within a block, outer_stride (keep_outer_stride) between blocks */
    int64_t rows_inner; /* >= 1; n_rows (or more) for plain (N, V) rows */
    int64_t outer_stride, keep_outer_stride;
} elp_shard;

/* Per-row statistics of backward, all [n_rows] (contract.GradStats). */
typedef struct {
    const float *row_max;
    const double *s_hi, *s_lo, *log_s, *entropy64, *coef_a, *coef_b, *coef_t, *coef_l;
    const uint8_t *row_nan;
} elp_grad_stats;

/* The per-row results of forward (contract.Finalized plus the max and the record), all
   [n_rows]; finalize reads row_max and record, the fused forward writes them. */
typedef struct {
    float *row_max;
    int64_t *record; /* [n_rows, ELP_NUM_COLS] */
    float *logprobs, *entropy, *lse;
    double *s_hi, *s_lo, *log_s, *entropy64;
    int64_t *bad;
    uint8_t *ignored;
} elp_rows;

/* ------------------------------------------------------------------ small vector tools */

ELP_INLINE vd splatd(double v) {
    vd r;
    for (int i = 0; i < DW; ++i) r[i] = v;
    return r;
}
ELP_INLINE vf splatf(float v) {
    vf r;
    for (int i = 0; i < FW; ++i) r[i] = v;
    return r;
}
ELP_INLINE vd selectd(vl m, vd a, vd b) { return (vd)(((vl)a & m) | ((vl)b & ~m)); }
ELP_INLINE vf selectf(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* a > b ? a : b and a < b ? a : b, lane by lane (so b where a is NaN, and b of two equal
   zeros): what vmaxps and vminps compute, one instruction each where the build has them. */
ELP_INLINE vf maxf(vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return selectf(a > b, a, b);
#endif
}
ELP_INLINE vf minf(vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
    return (vf)_mm256_min_ps((__m256)a, (__m256)b);
#else
    return selectf(a < b, a, b);
#endif
}

/* a > b ? a : b of int32 lanes, one instruction where the build has it. */
ELP_INLINE vi maxi(vi a, vi b) {
#if defined(__AVX512F__)
    return (vi)_mm512_max_epi32((__m512i)a, (__m512i)b);
#elif defined(__AVX2__)
    return (vi)_mm256_max_epi32((__m256i)a, (__m256i)b);
#else
    vi m = a > b;
    return (a & m) | (b & ~m);
#endif
}

/* The largest lane of a, which holds no NaN: any order of compares finds it (of two equal
   zeros, either). A shuffle tree where the build has one, else lane by lane. */
ELP_INLINE float lanes_max(vf a) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)a);
#elif defined(__AVX2__)
    __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
    float m = a[0];
    for (int i = 1; i < FW; ++i) m = a[i] > m ? a[i] : m;
    return m;
#endif
}

ELP_INLINE vd andd(vl m, vd a) { return (vd)((vl)a & m); } /* a where m, else +0 */

/* fl(a b + c) for a product a b that is exact, so that fl(fl(a b) + c) is the same value:
   one FMA instruction where the build has FMA (its single rounding is then the add's),
   else the multiply and the add. The only FMA in the kernels (-ffp-contract=off keeps the
   compiler from making others); each caller says why its product is exact. */
ELP_INLINE vd exact_product_add(vd a, vd b, vd c) {
#if defined(__AVX512F__) && defined(__FMA__)
    return (vd)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vd)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return a * b + c;
#endif
}

static const double exp2_table[1 << ELP_TABLE_BITS] = ELP_EXP2_TABLE;
static const double exp_poly[ELP_EXP_POLY_LEN] = ELP_EXP_POLY;
static const double log_poly[ELP_LOG_POLY_LEN] = ELP_LOG_POLY;

/* --- data movement: one definition per ISA, same results (they move bits, or floor) --- */

#if defined(__AVX512F__)
ELP_INLINE vd widen_lo(vf y) { return (vd)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)y)); }
ELP_INLINE vd widen_hi(vf y) {
    return (vd)_mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)y, 1));
}
ELP_INLINE vl widen_mask_lo(vi m) {
    return (vl)_mm512_cvtepi32_epi64(_mm512_castsi512_si256((__m512i)m));
}
ELP_INLINE vl widen_mask_hi(vi m) {
    return (vl)_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64((__m512i)m, 1));
}
ELP_INLINE vl widen_u32_lo(vu u) {
    return (vl)_mm512_cvtepu32_epi64(_mm512_castsi512_si256((__m512i)u));
}
ELP_INLINE vl widen_u32_hi(vu u) {
    return (vl)_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64((__m512i)u, 1));
}
ELP_INLINE vf narrow(vd lo, vd hi) { /* fp64 -> fp32, round to nearest even */
    __m256 a = _mm512_cvtpd_ps((__m512d)lo), b = _mm512_cvtpd_ps((__m512d)hi);
    return (vf)_mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}
ELP_INLINE vu load_u16(const void *p) {
    return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
}
ELP_INLINE vi load_u8(const uint8_t *p) {
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
ELP_INLINE vu load_u32(const uint32_t *p) { return (vu)_mm512_loadu_si512(p); }
ELP_INLINE void store_u16(void *p, vu v) { /* every value fits: truncation is exact */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)v));
}
ELP_INLINE vd floord(vd s) {
    return (vd)_mm512_roundscale_pd((__m512d)s, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
/* table[j mod 32]: two two-register permutes (they read j's low 4 bits) and a blend (on
   bit 4) pick the entries */
ELP_INLINE vd table_lookup(const double *table, vl j) {
    __m512i idx = (__m512i)j;
    __m512d lo = _mm512_permutex2var_pd(_mm512_loadu_pd(table), idx, _mm512_loadu_pd(table + 8));
    __m512d hi =
        _mm512_permutex2var_pd(_mm512_loadu_pd(table + 16), idx, _mm512_loadu_pd(table + 24));
    return (vd)_mm512_mask_blend_pd(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(16)), lo, hi);
}
#elif defined(__AVX2__)
ELP_INLINE vd widen_lo(vf y) { return (vd)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)y)); }
ELP_INLINE vd widen_hi(vf y) { return (vd)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)y, 1)); }
ELP_INLINE vl widen_mask_lo(vi m) {
    return (vl)_mm256_cvtepi32_epi64(_mm256_castsi256_si128((__m256i)m));
}
ELP_INLINE vl widen_mask_hi(vi m) {
    return (vl)_mm256_cvtepi32_epi64(_mm256_extracti128_si256((__m256i)m, 1));
}
ELP_INLINE vl widen_u32_lo(vu u) {
    return (vl)_mm256_cvtepu32_epi64(_mm256_castsi256_si128((__m256i)u));
}
ELP_INLINE vl widen_u32_hi(vu u) {
    return (vl)_mm256_cvtepu32_epi64(_mm256_extracti128_si256((__m256i)u, 1));
}
ELP_INLINE vf narrow(vd lo, vd hi) { /* fp64 -> fp32, round to nearest even */
    __m128 a = _mm256_cvtpd_ps((__m256d)lo), b = _mm256_cvtpd_ps((__m256d)hi);
    return (vf)_mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
}
ELP_INLINE vu load_u16(const void *p) {
    return (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
}
ELP_INLINE vi load_u8(const uint8_t *p) {
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* one 32-byte load: a memcpy into a vector that lives on the stack became two 16-byte
   copies there, and reading them back as one 32-byte vector stalled (no store forwarding) */
ELP_INLINE vu load_u32(const uint32_t *p) { return (vu)_mm256_loadu_si256((const __m256i *)p); }
ELP_INLINE void store_u16(void *p, vu v) { /* every value fits: packus == truncation */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128((__m256i)v),
                                      _mm256_extracti128_si256((__m256i)v, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
ELP_INLINE vd floord(vd s) { return (vd)_mm256_floor_pd((__m256d)s); }
/* Four scalar loads: on the AMD Zen 3 this was tuned on they beat vgatherqpd by about
   13 % in the partials pass (on Zen 5 capped to AVX2, 1.2x slower still). The four
   indices reach the integer registers in one move: the low byte of each lane (the index
   is j's low TABLE_BITS bits) packed into one 32-bit word by a permute and a byte shuffle,
   where extracting the lanes one by one took five moves (two of them two-uop). */
_Static_assert(ELP_TABLE_BITS <= 8, "table_lookup reads one byte of each index");
ELP_INLINE vd table_lookup(const double *table, vl j) {
    const __m256i low_dwords = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    __m128i lo = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32((__m256i)j, low_dwords));
    __m128i bytes = _mm_shuffle_epi8(lo, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1,
                                                       -1, -1, -1, -1, -1));
    uint32_t w = (uint32_t)_mm_cvtsi128_si32(bytes);
    const uint32_t mask = (1 << ELP_TABLE_BITS) - 1;
    return (vd){table[w & mask], table[w >> 8 & mask], table[w >> 16 & mask],
                table[w >> 24 & mask]};
}
#else
ELP_INLINE vd widen_lo(vf y) {
    vd r;
    for (int i = 0; i < DW; ++i) r[i] = y[i];
    return r;
}
ELP_INLINE vd widen_hi(vf y) {
    vd r;
    for (int i = 0; i < DW; ++i) r[i] = y[DW + i];
    return r;
}
ELP_INLINE vl widen_mask_lo(vi m) {
    vl r;
    for (int i = 0; i < DW; ++i) r[i] = m[i];
    return r;
}
ELP_INLINE vl widen_mask_hi(vi m) {
    vl r;
    for (int i = 0; i < DW; ++i) r[i] = m[DW + i];
    return r;
}
ELP_INLINE vl widen_u32_lo(vu u) {
    vl r;
    for (int i = 0; i < DW; ++i) r[i] = u[i];
    return r;
}
ELP_INLINE vl widen_u32_hi(vu u) {
    vl r;
    for (int i = 0; i < DW; ++i) r[i] = u[DW + i];
    return r;
}
ELP_INLINE vf narrow(vd lo, vd hi) {
    vf r;
    for (int i = 0; i < DW; ++i) r[i] = (float)lo[i], r[DW + i] = (float)hi[i];
    return r;
}
ELP_INLINE vu load_u16(const void *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vu);
}
ELP_INLINE vi load_u8(const uint8_t *p) {
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vi);
}
ELP_INLINE vu load_u32(const uint32_t *p) {
    vu u;
    memcpy(&u, p, sizeof u);
    return u;
}
ELP_INLINE void store_u16(void *p, vu v) {
    vh h = __builtin_convertvector(v, vh);
    memcpy(p, &h, sizeof h);
}
ELP_INLINE vd floord(vd s) { /* for 0 <= s < 2^52: nearest integer, then step down */
    vd near = (s + 0x1p52) - 0x1p52;
    return near - andd((vl)(near > s), splatd(1.0));
}
ELP_INLINE vd table_lookup(const double *table, vl j) { /* j's low bits */
    vd r;
    j &= (1 << ELP_TABLE_BITS) - 1;
    for (int i = 0; i < DW; ++i) r[i] = table[j[i]];
    return r;
}
#endif

/* ------------------------------------------------------------------ 1. load and scale */

/* fp16 bits -> fp32, exact; a NaN comes out quiet, as the hardware conversion gives it. */
ELP_INLINE vf half_to_float(vu h) {
    vu mag = h & 0x7FFF, sign = (h & 0x8000) << 16;
    vu normal = (mag << 13) + 0x38000000u; /* exponent bias 15 -> 127 */
    vu special = normal + 0x38000000u;     /* exponent 31 -> 255: inf, NaN */
    special |= (vu)((vi)(mag > 0x7C00u)) & 0x00400000u;
    vf tiny = __builtin_convertvector(mag & 0x3FF, vf) * 0x1p-24f; /* zero, subnormal */
    vu exp = mag & 0x7C00;
    vu out = (vu)selectf((vi)(exp == 0), tiny, (vf)normal);
    out = (vu)selectf((vi)(exp == 0x7C00), (vf)special, (vf)out);
    return (vf)(out | sign);
}

/* FW fp16 values as fp32: the F16C conversion where the build has it (exact; a NaN comes
   out quiet with its payload, as half_to_float gives it), else half_to_float. */
ELP_INLINE vf load_half(const void *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    return half_to_float(load_u16(p));
#endif
}

/* FW logits from `p` as fp32 (exact widening). */
ELP_INLINE vf loadf(const void *p, const int dtype) {
    if (dtype == ELP_F32) {
        vf v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    return dtype == ELP_BF16 ? (vf)(load_u16(p) << 16) : load_half(p);
}

ELP_INLINE vi load_keep(const uint8_t *p) { return load_u8(p) != 0; }

/* ------------------------------------------------------------------ 3. contract exp */

/* Every step handles V4 vectors of DW doubles (LANES columns) stage by stage across all of
   them, so that their long dependency chains (Horner, division) interleave: the loop is
   latency-bound otherwise. On Zen 3 (AVX2), V4 = 8 ran 8-13 % faster than 4 and about
   25 % faster than 2; on Zen 5 (AVX-512, 8 doubles per vector) V4 = 8 ran 10-15 % faster
   than 4 and about 40 % faster than 2. */

/* exp_c's reduction and polynomial: the bits kb of tm, and T p = table[k mod 32] p. */
ELP_INLINE void exp_c_parts(const vd d[V4], vul kb[V4], vd tp[V4], const int scale) {
    const double magic = ELP_MAGIC + (double)(scale << ELP_TABLE_BITS);
    vd tm[V4], r[V4], p[V4];
    for (int i = 0; i < V4; ++i) tm[i] = d[i] * ELP_INV_LN2_32 + magic;
    for (int i = 0; i < V4; ++i) {
        vd kd = tm[i] - magic; /* rint_even(d / (ln2/32)) */
        /* kd (-LN2_32_HI) is exact: |kd| < 2^12, LN2_32_HI has 39 significant bits */
        r[i] = exact_product_add(kd, splatd(-ELP_LN2_32_HI), d[i]) - kd * ELP_LN2_32_LO;
    }
    for (int i = 0; i < V4; ++i) p[i] = splatd(exp_poly[0]);
    for (int c = 1; c < ELP_EXP_POLY_LEN; ++c) /* Horner, no FMA */
        for (int i = 0; i < V4; ++i) p[i] = p[i] * r[i] + exp_poly[c];
    for (int i = 0; i < V4; ++i) {
        kb[i] = (vul)tm[i];
        tp[i] = table_lookup(exp2_table, (vl)kb[i]) * p[i];
    }
}

/* (floor(k / 32) + scale) << 52, modulo 2^64, from the bits kb of tm (see exp_c) */
ELP_INLINE vul exp_c_shift(vul kb) { return (kb >> ELP_TABLE_BITS) << 52; }

/* exp(d) 2^scale for d in [CUTOFF, 0]: contract.exp_c, operation for operation, and then
   scaled by 2^scale (exact: every value stays normal), with scale 0 or FRAC_BITS.
   kd = rint_even(t) is (t + MAGIC) - MAGIC; adding the even integer 32 scale to MAGIC moves
   neither kd (rint_even(t + 2j) = rint_even(t) + 2j) nor k mod 32, and leaves the bits of
   tm = t + MAGIC + 32 scale equal to bits(MAGIC) + k + 32 scale (one binade, unit ulp). So
   the table index is tm's low bits, and tm's bits shifted right by TABLE_BITS and left by
   52 are (floor(k / 32) + scale) << 52 modulo 2^64 (bits(MAGIC) << 47 is 0 modulo 2^64):
   added to the bits of T p (a normal number in [0.98, 2.03)) they multiply it by
   2^(floor(k / 32) + scale) exactly, which is fl(fl(T p) 2^(k >> 5)) 2^scale. */
ELP_INLINE void exp_c(const vd d[V4], vd e[V4], const int scale) {
    vul kb[V4];
    vd tp[V4];
    exp_c_parts(d, kb, tp, scale);
    for (int i = 0; i < V4; ++i) e[i] = (vd)((vul)tp[i] + exp_c_shift(kb[i]));
}

/* ------------------------------------------------------------------ 4-5. quantize, sum */

/* The hi limbs are integer-valued doubles of at most 2^FRAC_BITS, V4 per lane and step:
   every partial sum stays <= 2^53, hence exact, for FLUSH_STEPS steps; then the lanes go
   to int64. The lo limbs are summed as the bits of lo + MAGIC (= bits(MAGIC) + lo, lo
   being an integer below 2^51), in uint64 lanes that wrap; a flush takes bits(MAGIC) off
   once per value added. */
enum { FLUSH_STEPS = (1 << (53 - ELP_FRAC_BITS)) / V4 };

typedef struct {
    vd e_hi, w_hi;
    vul e_lo, w_lo;
    uint64_t total[4]; /* flushed sums: E_HI, E_LO, W_HI, W_LO */
    vi nonfinite;      /* minus the count, per lane */
} row_sums;

ELP_INLINE vd exact_sum(const vd v[V4]) { /* integer-valued, < 2^53: any order is exact */
    vd acc = v[0];
    for (int i = 1; i < V4; ++i) acc += v[i];
    return acc;
}

/* contract.quantize of v in [0, 1], given s = v 2^42: hi = floor(s) (the contract truncates
   to int64: the same for s >= 0), lo = rint_even((s - hi) 2^42), added to the sums: hi as
   an integer-valued double, lo as the bits of lo + MAGIC ((s - hi) 2^42 is exact). */
ELP_INLINE void quantize_add(const vd s[V4], vd *sum_hi, vul *sum_lo) {
    vd hi[V4];
    for (int i = 0; i < V4; ++i) {
        hi[i] = floord(s[i]);
        vd lo = exact_product_add(s[i] - hi[i], splatd(ELP_LIMB_SCALE), splatd(ELP_MAGIC));
        *sum_lo += (vul)lo;
    }
    *sum_hi += exact_sum(hi);
}

/* bits(MAGIC): what each lo (and, in the value tables, hi) added as bits carries extra */
ELP_INLINE uint64_t magic_bits(void) {
    union {
        double d;
        uint64_t u;
    } magic = {ELP_MAGIC};
    return magic.u;
}

ELP_INLINE uint64_t lanes_total(vd v) {
    uint64_t t = 0;
    for (int i = 0; i < DW; ++i) t += (uint64_t)(int64_t)v[i];
    return t;
}

ELP_INLINE uint64_t lanes_u64(vul v) {
    uint64_t t = 0;
    for (int i = 0; i < DW; ++i) t += v[i];
    return t;
}

/* Move the lanes to the totals after `steps` steps of LANES values (W's only with
   entropy: without, its lanes hold nothing). */
ELP_INLINE void flush(row_sums *s, int64_t steps, const int entropy) {
    uint64_t offset = (uint64_t)steps * LANES * magic_bits(); /* modulo 2^64, as the sums */
    s->total[0] += lanes_total(s->e_hi);
    s->total[1] += lanes_u64(s->e_lo) - offset;
    s->total[2] += lanes_total(s->w_hi);
    s->total[3] += lanes_u64(s->w_lo) - (entropy ? offset : 0);
    s->e_hi = s->w_hi = splatd(0.0);
    s->e_lo = s->w_lo = (vul)splatd(0.0);
}

/* ------------------------------------------------------------------ the element steps */

ELP_INLINE void widen(const vf y8[V8], const vi valid8[V8], vd y[V4], vl valid[V4]) {
    for (int q = 0; q < V8; ++q) {
        y[2 * q] = widen_lo(y8[q]);
        y[2 * q + 1] = widen_hi(y8[q]);
        valid[2 * q] = widen_mask_lo(valid8[q]);
        valid[2 * q + 1] = widen_mask_hi(valid8[q]);
    }
}

/* d = y - M; term = valid & CUTOFF <= d <= 0 (NaN, +-inf fail a compare); dz = term ? d : 0.
   all_terms: the caller knows every lane is a term (see direct_sums): no compares. */
ELP_INLINE void terms(const vd y[V4], const vl valid[V4], vd m, vl term[V4], vd dz[V4],
                      const int all_terms) {
    for (int i = 0; i < V4; ++i) {
        vd d = y[i] - m;
        term[i] = all_terms ? ~(vl){0} : valid[i] & (d >= ELP_CUTOFF) & (d <= 0.0);
        dz[i] = all_terms ? d : andd(term[i], d);
    }
}

/* e of LANES columns, +0 where a column is not a term, and dz (contract stages 2-3). */
ELP_INLINE void term_exps(const vf y8[V8], const vi valid8[V8], vd m, vd e[V4], vd dz[V4],
                          const int all_terms) {
    vd y[V4];
    vl valid[V4], term[V4];
    widen(y8, valid8, y, valid);
    terms(y, valid, m, term, dz, all_terms);
    exp_c(dz, e, 0);
    if (!all_terms)
        for (int i = 0; i < V4; ++i) e[i] = andd(term[i], e[i]);
}

ELP_INLINE vi nonfinite_lanes(vf y, vi valid) { return valid & ~(y < __builtin_inff()); }

/* e 2^42 of LANES columns, +0 where a column is not a term (contract stages 2-3 and the
   scaling that starts quantize; exp_c scales by 2^42 for free); all_valid: every valid8
   lane is set; all_terms: every lane is a term (see terms). The AVX-512 build keeps the
   term masks in mask registers (a compare chain under the valid lanes, a zeroing move for
   dz, a zeroing add for the exponent): the same operations on the same lanes. */
ELP_INLINE void scaled_term_exps(const vf y8[V8], const vi valid8[V8], vd m, vd sv[V4],
                                 const int all_valid, const int all_terms) {
    vd dz[V4];
#if defined(__AVX512F__)
    vd tp[V4];
    vul kb[V4];
    __mmask8 term[V4];
    if (all_terms) {
        for (int q = 0; q < V8; ++q) {
            dz[2 * q] = widen_lo(y8[q]) - m;
            dz[2 * q + 1] = widen_hi(y8[q]) - m;
        }
        exp_c(dz, sv, ELP_FRAC_BITS);
        return;
    }
    for (int q = 0; q < V8; ++q) {
        __mmask16 ok = all_valid ? (__mmask16)0xFFFF
                                 : _mm512_test_epi32_mask((__m512i)valid8[q], (__m512i)valid8[q]);
        for (int h = 0; h < 2; ++h) {
            __m512d d = _mm512_sub_pd((__m512d)(h ? widen_hi(y8[q]) : widen_lo(y8[q])),
                                      (__m512d)m);
            __mmask8 k = (__mmask8)(h ? ok >> 8 : ok);
            k = _mm512_mask_cmp_pd_mask(k, d, _mm512_set1_pd(ELP_CUTOFF), _CMP_GE_OQ);
            k = _mm512_mask_cmp_pd_mask(k, d, _mm512_setzero_pd(), _CMP_LE_OQ);
            term[2 * q + h] = k;
            dz[2 * q + h] = (vd)_mm512_maskz_mov_pd(k, d);
        }
    }
    exp_c_parts(dz, kb, tp, ELP_FRAC_BITS);
    for (int i = 0; i < V4; ++i)
        sv[i] = (vd)_mm512_maskz_add_epi64(term[i], (__m512i)tp[i], (__m512i)exp_c_shift(kb[i]));
#else
    (void)all_valid; /* the compiler folds the all-ones masks itself */
    vd y[V4];
    vl valid[V4], term[V4];
    widen(y8, valid8, y, valid);
    terms(y, valid, m, term, dz, all_terms);
    exp_c(dz, sv, ELP_FRAC_BITS);
    if (!all_terms)
        for (int i = 0; i < V4; ++i) sv[i] = andd(term[i], sv[i]);
#endif
}

/* minus the count of valid NaN and +inf lanes, added to the per-lane `*acc` */
ELP_INLINE void count_nonfinite(vf y, vi valid, const int all_valid, vi *acc) {
#if defined(__AVX512F__)
    __mmask16 ok = all_valid ? (__mmask16)0xFFFF
                             : _mm512_test_epi32_mask((__m512i)valid, (__m512i)valid);
    __mmask16 bad =
        _mm512_mask_cmp_ps_mask(ok, (__m512)y, _mm512_set1_ps(__builtin_inff()), _CMP_NLT_UQ);
    *acc = (vi)_mm512_mask_sub_epi32((__m512i)*acc, bad, (__m512i)*acc, _mm512_set1_epi32(1));
#else
    (void)all_valid;
    *acc += nonfinite_lanes(y, valid);
#endif
}

/* What quantize takes of LANES columns: sv = e 2^42 and, with entropy, sw = w 2^42
   (w = e (-d)), +0 where a column is not a term; all_valid: every valid8 lane is set;
   all_terms: every lane is a term. */
ELP_INLINE void limb_terms(const vf y8[V8], const vi valid8[V8], vd m, vd sv[V4], vd sw[V4],
                           const int entropy, const int all_valid, const int all_terms) {
    if (!entropy) {
        scaled_term_exps(y8, valid8, m, sv, all_valid, all_terms);
        return;
    }
    vd e[V4], dz[V4];
    term_exps(y8, valid8, m, e, dz, all_terms);
    for (int i = 0; i < V4; ++i) {
        sv[i] = e[i] * ELP_LIMB_SCALE;
        sw[i] = (e[i] * (-dz[i])) * ELP_LIMB_SCALE;
    }
}

/* Add LANES columns to the row sums (contract.partials); all_valid: every valid8 lane is
   set; all_terms: every lane is a term; count_bad: count the NaN and +inf lanes (where
   there may be some). */
ELP_INLINE void partials_step(const vf y8[V8], const vi valid8[V8], vd m, row_sums *s,
                              const int entropy, const int all_valid, const int all_terms,
                              const int count_bad) {
    vd sv[V4], sw[V4];
    limb_terms(y8, valid8, m, sv, sw, entropy, all_valid, all_terms);
    quantize_add(sv, &s->e_hi, &s->e_lo);
    if (entropy) quantize_add(sw, &s->w_hi, &s->w_lo);
    if (count_bad)
        for (int q = 0; q < V8; ++q) count_nonfinite(y8[q], valid8[q], all_valid, &s->nonfinite);
}

typedef struct {
    vd m, s_hi, s_lo, log_s, h, a, b, c, l, tau;
    int divide;
} grad_row;

/* What both gradient formulas need of LANES columns: e (+0 without a term), p = e / fl(S)
   and, with entropy, b q = b ((d - log S) + H). */
ELP_INLINE void grad_terms(const vf y8[V8], const vi valid8[V8], const grad_row *g,
                           const int entropy, vd e[V4], vd p[V4], vd bq[V4]) {
    vd dz[V4];
    term_exps(y8, valid8, g->m, e, dz, 0);
    for (int i = 0; i < V4; ++i) {
        p[i] = e[i] / g->s_hi;
        if (entropy) bq[i] = g->b * ((dz[i] - g->log_s) + g->h);
    }
}

ELP_INLINE void finish_step(vd out[V4], const grad_row *g, vf out8[V8]) {
    for (int i = 0; i < V4; ++i)
        if (g->divide) out[i] = out[i] / g->tau;
    for (int q = 0; q < V8; ++q) out8[q] = narrow(out[2 * q], out[2 * q + 1]);
}

/* LANES gradients of columns that are not the target, in fp32 (contract.grad_block before
   the NaN rows and the cast to dtype): p * (a - b q), or p * a; +0 without a term (there
   term_exps leaves e = +0, and a term's e is at least exp(CUTOFF) > 0). */
ELP_INLINE void grad_step(const vf y8[V8], const vi valid8[V8], const grad_row *g,
                          const int entropy, vf out8[V8]) {
    vd e[V4], p[V4], bq[V4], out[V4];
    grad_terms(y8, valid8, g, entropy, e, p, bq);
    for (int i = 0; i < V4; ++i)
        out[i] = andd((vl)(e[i] > 0.0), entropy ? p[i] * (g->a - bq[i]) : p[i] * g->a);
    finish_step(out, g, out8);
}

/* The target column's gradient (lane 0 of a step loaded at the target): c (1 - p_t) +
   p_t (l - b q_t), with 1 - p_t = ((s_hi - e_t) + s_lo) / s_hi from the exact S. */
ELP_INLINE void target_step(const vf y8[V8], const vi valid8[V8], const grad_row *g,
                            const int entropy, vf out8[V8]) {
    vd e[V4], p[V4], bq[V4], out[V4];
    grad_terms(y8, valid8, g, entropy, e, p, bq);
    for (int i = 0; i < V4; ++i) {
        vd one_minus_p = ((g->s_hi - e[i]) + g->s_lo) / g->s_hi;
        out[i] = g->c * one_minus_p + (entropy ? p[i] * (g->l - bq[i]) : p[i] * g->l);
    }
    finish_step(out, g, out8);
}

/* ------------------------------------------------------------------ casts of the gradient */

ELP_INLINE vu selectu(vi m, vu a, vu b) { return (a & (vu)m) | (b & ~(vu)m); }
ELP_INLINE vu splatu(uint32_t v) {
    vu r;
    for (int i = 0; i < FW; ++i) r[i] = v;
    return r;
}

/* fp32 -> bf16 bits, round to nearest even; every NaN becomes 0xFFFF, as torch's cast. */
ELP_INLINE vu float_to_bf16(vf f) {
    vu u = (vu)f;
    vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return selectu(f != f, splatu(0xFFFF), rounded);
}

/* fp32 -> fp16 bits, round to nearest even, overflow to inf, NaN quiet with its sign. */
ELP_INLINE vu float_to_half(vf f) {
    vu u = (vu)f, mag = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
    /* normal results: rebias the exponent 127 -> 15 and round away 13 bits, ties to even;
       a carry moves into the exponent, and anything past 0x7C00 is an overflow to inf */
    vu normal = ((mag - 0x38000000u) + 0xFFFu + ((mag >> 13) & 1u)) >> 13;
    normal = selectu((vi)normal > 0x7C00, splatu(0x7C00), normal);
    /* subnormal results, |f| < 2^-14: |f| 2^24 rounded to an integer by adding 2^23 */
    vu tiny = (vu)((vf)mag * 0x1p24f + 0x1p23f) - 0x4B000000u;
    vu nan = 0x7E00u | ((mag >> 13) & 0x1FFu);
    vu out = selectu((vi)mag < 0x38800000, tiny, normal);
    out = selectu((vi)mag > 0x7F800000, nan, out);
    return out | sign;
}

/* Store FW fp32 values as `dtype`. */
ELP_INLINE void storef(void *p, vf f, const int dtype) {
    if (dtype == ELP_F32) {
        memcpy(p, &f, sizeof f);
        return;
    }
    store_u16(p, dtype == ELP_BF16 ? float_to_bf16(f) : float_to_half(f));
}

/* ------------------------------------------------------------------ rows */

ELP_INLINE int64_t elem_size(const int dtype) { return dtype == ELP_F32 ? 4 : 2; }
ELP_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

ELP_INLINE vi lanes_below(int64_t count) {
    vi idx;
    for (int i = 0; i < FW; ++i) idx[i] = i;
    int32_t c = count < 0 ? 0 : count > FW ? FW : (int32_t)count;
    return idx < c;
}

/* One row's view of the shard: its logits, keep mask and temperature. */
typedef struct {
    const char *x;
    const uint8_t *keep;
    int64_t n_cols, n_real;
    int divide;   /* 0 for a scalar tau of exactly 1: the contract skips that division */
    float tau32;  /* divides y in fp32 */
    double tau64; /* divides the gradient in fp64 */
} row_view;

ELP_INLINE row_view row_of(const elp_shard *s, int64_t r, const int dtype) {
    row_view v;
    int64_t outer = r / s->rows_inner, inner = r % s->rows_inner;
    v.x = (const char *)s->x + (outer * s->outer_stride + inner * s->row_stride) * elem_size(dtype);
    v.keep = s->keep ? s->keep + outer * s->keep_outer_stride + inner * s->keep_stride : NULL;
    v.n_cols = s->n_cols;
    v.n_real = s->n_real;
    v.divide = s->tau_rows != NULL || s->tau != 1.0;
    v.tau32 = s->tau_rows ? s->tau_rows[r] : (float)s->tau;
    v.tau64 = s->tau_rows ? (double)s->tau_rows[r] : s->tau;
    return v;
}

/* contract.owned_target_columns: the target's local column where this shard holds it as
   a real column of a row that is not ignored, else -1. (Unsigned: a target below
   vocab_start wraps past n_real, as torch's int64 subtraction wraps past n_cols.) */
ELP_INLINE int64_t owned_column(const elp_shard *s, int64_t r) {
    int64_t t = s->target[r];
    uint64_t local = (uint64_t)t - (uint64_t)s->vocab_start;
    return t != s->ignore_index && local < (uint64_t)s->n_real ? (int64_t)local : -1;
}

/* Stage 1 of FW columns: y = fp32(x) / tau32, IEEE division (skipped where tau32 is 1). */
ELP_INLINE vf stage1(const row_view *v, vf x) { return v->divide ? x / splatf(v->tau32) : x; }

/* y and validity (real and kept) of columns [j, j + LANES) of columns [0, end); a short
   last step goes through a zeroed buffer and its missing lanes are invalid. */
ELP_INLINE void load_step(const row_view *v, int64_t j, int64_t end, const int dtype,
                          vf y[V8], vi valid[V8]) {
    int64_t count = min64(LANES, end - j), es = elem_size(dtype);
    const char *px = v->x + j * es;
    const uint8_t *pk = v->keep ? v->keep + j : NULL;
    char xbuf[LANES * 4];
    uint8_t kbuf[LANES];
    if (__builtin_expect(count < LANES, 0)) {
        memset(xbuf, 0, sizeof xbuf);
        memcpy(xbuf, px, count * es);
        px = xbuf;
        if (pk) {
            memset(kbuf, 0, sizeof kbuf);
            memcpy(kbuf, pk, count);
            pk = kbuf;
        }
    }
    int64_t real = min64(count, v->n_real - j);
    for (int q = 0; q < V8; ++q) {
        vi ok = lanes_below(real - FW * q);
        valid[q] = pk ? ok & load_keep(pk + FW * q) : ok;
        y[q] = stage1(v, loadf(px + FW * q * es, dtype));
    }
}

/* Where the whole steps of a row end: every step before has LANES real columns and, with
   no keep mask, every lane valid. */
ELP_INLINE int64_t whole_steps_end(const row_view *v) {
    return v->keep ? 0 : v->n_real - v->n_real % LANES;
}

/* A hint to bring the bytes of a step at p (LANES columns) into the L2 cache; it changes
   no result. */
ELP_INLINE void prefetch_step(const char *p, const int dtype) {
    for (int64_t b = 0; b < LANES * elem_size(dtype); b += 64) __builtin_prefetch(p + b, 0, 2);
}

/* load_step of a whole step (j < whole_steps_end): no bounds, every lane valid. */
ELP_INLINE void load_whole(const row_view *v, int64_t j, const int dtype, vf y[V8],
                           vi valid[V8]) {
    for (int q = 0; q < V8; ++q) {
        y[q] = stage1(v, loadf(v->x + (j + FW * q) * elem_size(dtype), dtype));
        valid[q] = ~(vi){0};
    }
}

/* --- 2. row max over the real, kept columns; NaN and +inf do not take part --- */

/* What the fused forward's max pass also finds of a row: whether a valid column is NaN or
   +inf, and the smallest valid y (meaningful where none is). */
typedef struct {
    int bad;
    float low;
} row_scan;

/* best = the larger of best and y, lane by lane, over the valid lanes whose y is not NaN
   or +inf; with `scan`, bad |= the valid lanes that are, low = the smaller of low and the
   valid y (a NaN lane leaves it as it is: then bad is set) */
ELP_INLINE void max_step(const vf y[V8], const vi valid[V8], vf best[V8], vi *bad, vf low[V8]) {
    for (int q = 0; q < V8; ++q) {
        vi finite = y[q] < __builtin_inff();
        vf cand = selectf(valid[q] & finite, y[q], splatf(-__builtin_inff()));
        best[q] = selectf(cand > best[q], cand, best[q]);
        if (bad) {
            *bad |= valid[q] & ~finite;
            vf lc = selectf(valid[q], y[q], splatf(__builtin_inff()));
            low[q] = selectf(lc < low[q], lc, low[q]);
        }
    }
}

/* max_step of a whole step (every lane valid) in fewer operations: best = maxf(y, best)
   is max_step's best where no y is NaN or +inf (a NaN y leaves best in both, a +inf y
   enters it here), low = minf(y, low) is its low (a NaN y leaves it), and *bad gets the
   NaN and +inf lanes. Where *bad ends up set, the caller does the row again with max_step. */
ELP_INLINE void max_step_whole(const vf y[V8], vf best[V8], vi *bad, vf low[V8]) {
    for (int q = 0; q < V8; ++q) {
        best[q] = maxf(y[q], best[q]);
        low[q] = minf(y[q], low[q]);
        *bad |= ~(y[q] < __builtin_inff());
    }
}

ELP_INLINE int any_lane(vi m) {
    int any = 0;
    for (int i = 0; i < FW; ++i) any |= m[i] != 0;
    return any;
}

/* The max pass prefetches the step MAX_AHEAD columns ahead of the one it reads (16 KiB of
   fp32 logits): in the fused forward the row was prefetched into the L2 cache (see
   direct_sums), but not all of it stays there, and this pass, which does little per
   column, waited on its loads. With it, fp32 rows ran ~5 % faster in all on AVX2,
   unchanged on AVX-512; 4 and 8 KiB ahead did about as well. (A branch leaving out the
   prefetches near the row's end, instead of clamping their address, ran 1.04x slower.) */
enum { MAX_AHEAD = 4096 };

/* The row max of v, and with `scan` (unless NULL) what else it found (see row_scan). Not
   inlined (GCC still makes one copy per dtype): inlined into the fused forward,
   the AVX2 build kept its accumulators on the stack, a store and a load per step; alone
   it keeps all but one in registers, and fp32 rows run ~3.5 % faster (AVX2). */
static __attribute__((noinline)) float view_max_checked(const row_view *v, const int dtype,
                                                       row_scan *scan) {
    vi bad = {0};
    vf low[V8];
    for (int q = 0; q < V8; ++q) low[q] = splatf(__builtin_inff());
    vf best[V8];
    for (int q = 0; q < V8; ++q) best[q] = splatf(-__builtin_inff());
    const int64_t whole = whole_steps_end(v);
    int64_t j = 0;
    for (; j < whole; j += LANES) {
        vf y[V8];
        vi valid[V8];
        /* clamped to the row's last whole step: no pointer past its end */
        prefetch_step(v->x + min64(j + MAX_AHEAD, whole - LANES) * elem_size(dtype), dtype);
        load_whole(v, j, dtype, y, valid);
        max_step_whole(y, best, &bad, low);
    }
    if (any_lane(bad)) { /* a NaN or +inf column: the whole steps again, with max_step */
        for (int q = 0; q < V8; ++q) best[q] = splatf(-__builtin_inff());
        for (j = 0; j < whole; j += LANES) {
            vf y[V8];
            vi valid[V8];
            load_whole(v, j, dtype, y, valid);
            max_step(y, valid, best, NULL, NULL);
        }
    }
    for (; j < v->n_real; j += LANES) {
        vf y[V8];
        vi valid[V8];
        load_step(v, j, v->n_real, dtype, y, valid);
        max_step(y, valid, best, scan ? &bad : NULL, low);
    }
    float out = -__builtin_inff();
    for (int q = 0; q < V8; ++q)
        for (int i = 0; i < FW; ++i) out = best[q][i] > out ? best[q][i] : out;
    if (scan) {
        scan->bad = any_lane(bad);
        scan->low = __builtin_inff();
        for (int q = 0; q < V8; ++q)
            for (int i = 0; i < FW; ++i) scan->low = low[q][i] < scan->low ? low[q][i] : scan->low;
    }
    return out;
}

ELP_INLINE float view_max(const row_view *v, const int dtype) {
    return view_max_checked(v, dtype, NULL);
}

/* --- the chunk maxima of the exact cut (Backend.chunk_max) --- */

/* The max is taken of x, and stage 1 applied to each chunk's max afterwards, as
   Backend.chunk_max does: y = fp32(x) / tau is monotonic in x for a positive tau, so it is
   the max of y; for any other tau (a bad row) it still gives the default's bits; and it
   divides once per chunk instead of once per column. */

/* best = the larger of best and x, lane by lane (a NaN x leaves best as it is); mag = the
   larger of mag and |x|'s bits, which exceed +inf's (0x7F800000) where a NaN went by. */
ELP_INLINE void chunk_step(const vf x[V8], vf best[V8], vi *mag) {
    for (int q = 0; q < V8; ++q) {
        best[q] = maxf(x[q], best[q]);
        *mag = maxi(*mag, (vi)x[q] & 0x7FFFFFFF);
    }
}

/* The largest x of columns [j, end) of v (j a multiple of LANES, end - j <= chunk; NaN
   left out), -inf if they hold none but -inf; their |x| bits go into *mag (chunk_step).
   Only the row's last step may be short: it is read with load_step, its missing lanes as
   -inf. */
ELP_INLINE float chunk_max_of(const row_view *v, int64_t j, int64_t end, const int dtype,
                              vi *mag) {
    vf best[V8], x[V8];
    vi valid[V8];
    for (int q = 0; q < V8; ++q) best[q] = splatf(-__builtin_inff());
    for (; j + LANES <= end; j += LANES) {
        load_whole(v, j, dtype, x, valid);
        chunk_step(x, best, mag);
    }
    if (j < end) {
        load_step(v, j, v->n_real, dtype, x, valid);
        for (int q = 0; q < V8; ++q) x[q] = selectf(valid[q], x[q], splatf(-__builtin_inff()));
        chunk_step(x, best, mag);
    }
    for (int q = 1; q < V8; ++q) best[0] = maxf(best[q], best[0]);
    return lanes_max(best[0]);
}

ELP_INLINE int any_nan_bits(vi mag) { return any_lane(mag > 0x7F800000); }

/* out[c] = the max of y over the real columns [c chunk, min((c + 1) chunk, n_real)) of v,
   c < ceil(n_real / chunk): NaN where one of them is NaN, else +inf where one is +inf, a
   zero max as +0. `chunk` is a multiple of LANES: every step of a chunk but the row's last
   is whole. One read of the row, and a second only where it holds a NaN (mag tells, for
   the whole row): then each chunk is read again to find whether its own columns do. */
static void view_chunk_max(const row_view *v, int64_t chunk, float *out, const int dtype) {
    row_view x = *v;
    x.divide = 0; /* the max of x; stage 1 comes after */
    vi mag = {0};
    int64_t n = 0;
    for (int64_t j = 0; j < v->n_real; j += chunk)
        out[n++] = chunk_max_of(&x, j, min64(j + chunk, v->n_real), dtype, &mag);
    if (__builtin_expect(any_nan_bits(mag), 0)) {
        for (int64_t c = 0; c < n; ++c) {
            vi chunk_mag = {0};
            chunk_max_of(&x, c * chunk, min64((c + 1) * chunk, v->n_real), dtype, &chunk_mag);
            if (any_nan_bits(chunk_mag)) out[c] = __builtin_nanf("");
        }
    }
    for (int64_t c = 0; c < n; ++c) /* stage 1, then -0 -> +0 (and NaN stays NaN) */
        out[c] = (v->divide ? out[c] / v->tau32 : out[c]) + 0.0f;
}

/* What the whole steps of a row may skip, from its max pass's scan (NULL where the max
   came from elsewhere, a TP group's: nothing is known). Where no valid column is NaN or
   +inf there are none to count; and where besides fl(low - M) >= CUTOFF, every lane is a
   term (y <= M gives d <= 0, and rounding is monotonic: d = fl(y - M) >= fl(low - M)),
   so no lane need be compared. */
ELP_INLINE int scan_none_bad(const row_scan *scan) { return scan && !scan->bad; }
ELP_INLINE int scan_all_terms(const row_scan *scan, float row_max) {
    return scan_none_bad(scan) && (double)scan->low - (double)row_max >= ELP_CUTOFF;
}

/* --- 3-5. the exact row record --- */

/* The record's target and count columns, and the limb sums `total` (E_HI, E_LO, W_HI,
   W_LO; uint64 so that a sum wraps like torch's int64 sums instead of being undefined). */
ELP_INLINE void write_record(int64_t *out, const row_view *v, const uint64_t total[4],
                             int64_t nonfinite, int64_t t, const int dtype) {
    memset(out, 0, ELP_NUM_COLS * sizeof *out);
    out[ELP_COL_E_HI] = (int64_t)total[0];
    out[ELP_COL_E_LO] = (int64_t)total[1];
    out[ELP_COL_W_HI] = (int64_t)total[2];
    out[ELP_COL_W_LO] = (int64_t)total[3];
    out[ELP_COL_NONFINITE] = nonfinite;
    if (t >= 0) { /* the owner sends y_t's bits; every shard sends the counts */
        vf y[V8];
        vi valid[V8];
        load_step(v, t, t + 1, dtype, y, valid);
        int32_t bits;
        memcpy(&bits, &y[0][0], sizeof bits);
        out[ELP_COL_TARGET_BITS] = bits; /* sign-extended, as int32 -> int64 */
        out[ELP_COL_OWNERS] = 1;
        out[ELP_COL_TARGET_MASKED] = v->keep != NULL && !v->keep[t];
    }
}

/* One step of direct_sums at column j: prefetch the next row's bytes, load (whole: a
   whole step, see load_whole), add to the sums (see partials_step for all_terms and
   count_bad), flush every FLUSH_STEPS steps. */
ELP_INLINE void direct_step(const row_view *v, int64_t j, const char *ahead, vd m,
                            row_sums *sums, int64_t *steps, const int dtype, const int entropy,
                            const int whole, const int all_terms, const int count_bad) {
    vf y[V8];
    vi valid[V8];
    if (ahead) prefetch_step(ahead + j * elem_size(dtype), dtype);
    if (whole)
        load_whole(v, j, dtype, y, valid);
    else
        load_step(v, j, v->n_real, dtype, y, valid);
    partials_step(y, valid, m, sums, entropy, whole, all_terms, count_bad);
    if (++*steps == FLUSH_STEPS) {
        flush(sums, *steps, entropy);
        *steps = 0;
    }
}

/* The limb sums and non-finite count of a row, column by column. `ahead`, when not NULL,
   is the row this thread takes next, as many bytes long as this one: it is prefetched
   into the L2 cache alongside, so that the next row's max pass reads it from there and
   not from memory (this loop is compute-bound; the max pass would be memory-bound). A
   prefetch is a hint: it changes no result. With `scan` (the fused forward's max pass
   found row_max; else NULL), the whole steps skip what the scan shows they need not do
   (scan_all_terms, scan_none_bad). */
ELP_INLINE void direct_sums(const row_view *v, float row_max, uint64_t total[4],
                            int64_t *nonfinite, const char *ahead, const row_scan *scan,
                            const int dtype, const int entropy) {
    vd m = splatd((double)row_max);
    row_sums sums;
    memset(&sums, 0, sizeof sums);
    const int64_t whole = whole_steps_end(v);
    int64_t steps = 0, j = 0;
    if (scan_all_terms(scan, row_max))
        for (; j < whole; j += LANES)
            direct_step(v, j, ahead, m, &sums, &steps, dtype, entropy, 1, 1, 0);
    else if (scan_none_bad(scan))
        for (; j < whole; j += LANES)
            direct_step(v, j, ahead, m, &sums, &steps, dtype, entropy, 1, 0, 0);
    else
        for (; j < whole; j += LANES)
            direct_step(v, j, ahead, m, &sums, &steps, dtype, entropy, 1, 0, 1);
    for (; j < v->n_real; j += LANES) /* (rows with a keep mask have no whole steps) */
        direct_step(v, j, j + LANES <= v->n_real ? ahead : NULL, /* not past the next row */
                    m, &sums, &steps, dtype, entropy, 0, 0, 1);
    flush(&sums, steps, entropy);
    for (int i = 0; i < 4; ++i) total[i] = sums.total[i];
    *nonfinite = 0;
    for (int i = 0; i < FW; ++i) *nonfinite -= sums.nonfinite[i];
}

/* --- backward --- */

ELP_INLINE grad_row grad_row_of(const elp_grad_stats *st, const row_view *v, int64_t r) {
    grad_row g;
    g.m = splatd((double)st->row_max[r]);
    g.s_hi = splatd(st->s_hi[r]);
    g.s_lo = splatd(st->s_lo[r]);
    g.log_s = splatd(st->log_s[r]);
    g.h = splatd(st->entropy64[r]);
    g.a = splatd(st->coef_a[r]);
    g.b = splatd(st->coef_b[r]);
    g.c = splatd(st->coef_t[r]);
    g.l = splatd(st->coef_l[r]);
    g.tau = splatd(v->tau64);
    g.divide = v->divide;
    return g;
}

/* Store the first `count` of LANES fp32 values as `dtype`. */
ELP_INLINE void store_step(char *p, const vf f[V8], int64_t count, const int dtype) {
    int64_t es = elem_size(dtype);
    if (count == LANES) {
        for (int q = 0; q < V8; ++q) storef(p + FW * q * es, f[q], dtype);
        return;
    }
    char buf[LANES * 4];
    for (int q = 0; q < V8; ++q) storef(buf + FW * q * es, f[q], dtype);
    memcpy(p, buf, count * es);
}

/* The target column t (owned here) overwritten with its own formula. */
ELP_INLINE void grad_target(const row_view *v, const grad_row *g, int64_t t, char *out,
                            const int dtype, const int entropy) {
    vf y[V8], f[V8];
    vi valid[V8];
    load_step(v, t, t + 1, dtype, y, valid);
    target_step(y, valid, g, entropy, f);
    store_step(out + t * elem_size(dtype), f, 1, dtype);
}

/* A row flagged NaN gets NaN in every column, cast like any other value. */
ELP_INLINE void nan_row(char *out, int64_t n, const int dtype) {
    int64_t es = elem_size(dtype);
    vf nan[V8];
    for (int q = 0; q < V8; ++q)
        nan[q] = narrow(splatd(__builtin_nan("")), splatd(__builtin_nan("")));
    for (int64_t j = 0; j < n; j += LANES) store_step(out + j * es, nan, min64(LANES, n - j), dtype);
}

ELP_INLINE void grad_row_direct(const elp_shard *s, const elp_grad_stats *st, char *out,
                                int64_t r, const int dtype, const int entropy) {
    int64_t es = elem_size(dtype), n = s->n_cols;
    row_view v = row_of(s, r, dtype);
    grad_row g = grad_row_of(st, &v, r);
    for (int64_t j = 0; j < n; j += LANES) { /* padding columns too: they get 0 / tau */
        vf y[V8], f[V8];
        vi valid[V8];
        load_step(&v, j, n, dtype, y, valid);
        grad_step(y, valid, &g, entropy, f);
        store_step(out + j * es, f, min64(LANES, n - j), dtype);
    }
    int64_t t = owned_column(s, r);
    if (t >= 0) grad_target(&v, &g, t, out, dtype, entropy);
}

/* ------------------------------------------------------------------ value tables */

/* 16-bit logits take at most 65536 values, and a row of an LLM's logits only a few
   thousand of them (bf16 has 128 values per binade and sign). Once the row is fixed (M,
   tau, the backward statistics), every per-column quantity of the contract -- term, e, w,
   the non-finite flag, the gradient -- is a function of the column's value alone. So on
   long rows the kernels evaluate the contract once per distinct value:
     partials: count each value's columns and list the values that occur; the limb sums
       over columns equal the sums over values of count * limb, the same integers (integer
       addition is exact in any order, and uint64 products wrap like the int64 sums);
       when M is not given yet (no TP group), it is the largest of the listed values;
     grad: each column gets its value's gradient from a table filled on first sight; the
       target column, whose formula differs, is computed on its own afterwards.
   An fp32 row whose values are all exactly bf16 (the low 16 bits of every real column are
   zero, as after `bf16_logits.float()`) is counted by its high halves and takes the bf16
   tables: each value's fp32 bits, and so its y, are the same.
   The element functions are the ones of the direct loops, so the bits are too. */
enum { N_VALUES = 1 << 16, FIX_CAP = 4096 };

/* Per-thread scratch, kept between calls (see "threads"). `slot` is all-zero between
   rows: partials keeps counts in it, grad its table (FILLED | gradient bits, or PENDING
   while a value waits for its batch). */
typedef struct {
    uint32_t slot[N_VALUES + LANES]; /* the tail stays zero: a last batch reads past n */
    uint32_t counts[N_VALUES + LANES]; /* partials: the listed counts; all-zero between rows */
    uint16_t done[N_VALUES];         /* partials: the row's distinct values; grad: the
                                        values whose slots this row set */
    int64_t fix[FIX_CAP];    /* grad: columns stored before their value was computed */
    int64_t wide_rows;       /* fp16 rows this thread still counts in uint16 at once, after
                                a row whose uint8 counts wrapped */
} value_scratch;

enum { FILLED = 1u << 16, PENDING = 1u << 17 };

/* The row view of `n` <= LANES distinct values: no keep mask, every value real. */
ELP_INLINE row_view values_view(const row_view *v, const uint16_t *vals, int64_t n) {
    row_view w = *v;
    w.x = (const char *)vals;
    w.keep = NULL;
    w.n_cols = w.n_real = n;
    return w;
}

/* uint8 and uint16 counts live in the uint32 slots' memory: uint16 is accessed through a
   type that may alias (uint8_t may alias anything) */
typedef uint16_t __attribute__((may_alias)) u16_alias;

/* count_keys_note: each ++count[key] is two loads (the key, the count) and a store; a core
   with two load ports and one store port (Zen 3) then waits on its loads, and reading four
   contiguous keys with one 64-bit load took the counting of an LLM's bf16 row from ~120
   to ~85 us there (a microbenchmark of 64 rows of 151936 keys). In which order the four
   are counted does not matter, so neither does the byte order.
   ++count[key] for the kept columns j < n, key = keys[j * stride]; returns how many were
   counted. Counted first in a narrow type (less cache for the counts, which makes
   counting measurably faster: uint8 for fp16 rows, uint16 for bf16 rows, see
   count_values), where a count may wrap; the sum of the listed counts then falls short of
   the columns counted, and the row is counted again in a wider type. */
#define ELP_COUNT_KEYS(name, count_type)                                                    \
    ELP_INLINE int64_t name(const uint16_t *keys, const int stride, const uint8_t *keep,    \
                            int64_t n, count_type *count) {                                 \
        if (keep) {                                                                          \
            int64_t kept = 0;                                                                \
            for (int64_t j = 0; j < n; ++j) {                                                \
                count[keys[j * stride]] += keep[j] != 0;                                     \
                kept += keep[j] != 0;                                                        \
            }                                                                                \
            return kept;                                                                     \
        }                                                                                    \
        int64_t j = 0;                                                                       \
        if (stride == 1) {                                                                   \
            for (; j + 4 <= n; j += 4) { /* four keys per load (see count_keys_note) */      \
                uint64_t w;                                                                  \
                memcpy(&w, keys + j, sizeof w);                                              \
                ++count[(uint16_t)w];                                                        \
                ++count[(uint16_t)(w >> 16)];                                                \
                ++count[(uint16_t)(w >> 32)];                                                \
                ++count[(uint16_t)(w >> 48)];                                                \
            }                                                                                \
        }                                                                                    \
        for (; j + 4 <= n; j += 4) {                                                         \
            ++count[keys[j * stride]];                                                       \
            ++count[keys[(j + 1) * stride]];                                                 \
            ++count[keys[(j + 2) * stride]];                                                 \
            ++count[keys[(j + 3) * stride]];                                                 \
        }                                                                                    \
        for (; j < n; ++j) ++count[keys[j * stride]];                                        \
        return n;                                                                            \
    }
ELP_COUNT_KEYS(count_keys8, uint8_t)
ELP_COUNT_KEYS(count_keys16, u16_alias)

/* count_keys16 of an fp32 row by the high halves of its values x[j] (kept columns j < n),
   with *low = the OR of the low halves of every column j < n: the row's values are all
   bf16 (and the counts those of its bf16 values) if and only if it is zero. One read of
   the row both checks and counts. */
ELP_INLINE int64_t count_high_halves(const uint32_t *x, const uint8_t *keep, int64_t n,
                                     u16_alias *count, uint32_t *low) {
    uint32_t acc = 0;
    int64_t kept = n;
    if (keep) {
        kept = 0;
        for (int64_t j = 0; j < n; ++j) {
            count[x[j] >> 16] += keep[j] != 0;
            acc |= x[j];
            kept += keep[j] != 0;
        }
    } else {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            uint32_t w0 = x[j], w1 = x[j + 1], w2 = x[j + 2], w3 = x[j + 3];
            ++count[w0 >> 16];
            ++count[w1 >> 16];
            ++count[w2 >> 16];
            ++count[w3 >> 16];
            acc |= w0 | w1 | w2 | w3;
        }
        for (; j < n; ++j) {
            ++count[x[j] >> 16];
            acc |= x[j];
        }
    }
    *low = acc & 0xFFFFu;
    return kept;
}
ELP_COUNT_KEYS(count_keys32, uint32_t)

#if defined(__AVX512F__)
/* Append the counts c32 of the values base + [0, 16) whose lanes m holds to out[n, ...)
   and the values to vals[n, ...); returns the new n. 16 lanes are stored (those past the
   appended ones as zeros): n + 16 <= base + 16 <= N_VALUES must hold. */
ELP_INLINE int64_t append_counts(uint32_t *out, uint16_t *vals, int64_t n, __mmask16 m,
                                 __m512i c32, int64_t base) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)base));
    _mm512_storeu_si512(out + n, _mm512_maskz_compress_epi32(m, c32));
    _mm256_storeu_si256((__m256i *)(vals + n),
                        _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(m, idx)));
    return n + __builtin_popcount(m);
}
#endif

/* Compact the counts: afterwards count[0, n) holds the non-zero counts in value order,
   vals[0, n) their values, and every other slot is zero again; returns n. Each count moves
   down (n <= its value), so a slot is read before anything is written over it. */
#if defined(__AVX512F__)
static int64_t list_values(uint32_t *count, uint16_t *vals) {
    int64_t n = 0;
    for (int64_t b = 0; b < N_VALUES; b += 16) {
        __m512i c = _mm512_loadu_si512(count + b);
        __mmask16 m = _mm512_test_epi32_mask(c, c);
        if (!m) continue;
        _mm512_storeu_si512(count + b, _mm512_setzero_si512());
        n = append_counts(count, vals, n, m, c, b);
    }
    return n;
}
#elif defined(__AVX2__)
static int64_t list_values(uint32_t *count, uint16_t *vals) {
    int64_t n = 0;
    for (int64_t b = 0; b < N_VALUES; b += 8) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(count + b));
        __m256i zero = _mm256_setzero_si256();
        unsigned m = 0xFFu ^ (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c, zero)));
        if (!m) continue;
        uint32_t cs[8];
        _mm256_storeu_si256((__m256i *)cs, c);
        _mm256_storeu_si256((__m256i *)(count + b), zero);
        for (; m; m &= m - 1) {
            int k = __builtin_ctz(m);
            count[n] = cs[k];
            vals[n++] = (uint16_t)(b + k);
        }
    }
    return n;
}
#else
static int64_t list_values(uint32_t *count, uint16_t *vals) {
    int64_t n = 0;
    for (int64_t i = 0; i < N_VALUES; ++i) {
        uint32_t c = count[i];
        count[i] = 0;
        count[n] = c; /* n <= i; a zero written here is overwritten by the next count */
        vals[n] = (uint16_t)i;
        n += c != 0;
    }
    return n;
}
#endif

#if !defined(__AVX512BW__)
#if defined(__AVX2__)
/* pack_index[m]: the positions of m's set bits in increasing order, one byte each, then
   0x80 bytes (pshufb gives 0 for them); pack_index16[m]: the same for 16-bit elements
   (bytes 2i, 2i + 1 for position i) */
static uint64_t pack_index[256];
static uint8_t pack_index16[256][16] __attribute__((aligned(16)));
static pthread_once_t pack_index_once = PTHREAD_ONCE_INIT;
static void pack_index_init(void) {
    for (int m = 0; m < 256; ++m) {
        uint64_t idx = 0x8080808080808080ull;
        memset(pack_index16[m], 0x80, 16);
        int k = 0;
        for (int i = 0; i < 8; ++i)
            if (m >> i & 1) {
                idx = (idx & ~(0xFFull << 8 * k)) | (uint64_t)i << 8 * k;
                pack_index16[m][2 * k] = (uint8_t)(2 * i);
                pack_index16[m][2 * k + 1] = (uint8_t)(2 * i + 1);
                ++k;
            }
        pack_index[m] = idx;
    }
}

/* list_values8 of the AVX2 build: each 8 counts of a 32-byte block that holds any are
   packed at once (pshufb with pack_index of their non-zero mask), 8 written to out[n, n +
   8) and their values to vals[n, n + 8), n advancing by the non-zero ones; the entries past
   the last n are 0 in out (and n + 8 <= N_VALUES: n counts only the values before the
   group). A group of 8 zero counts goes through the same steps (it writes 8 zeros and
   advances n by 0): a branch on it was mispredicted often enough, at the sparse edges of a
   row's values, to cost more. *listed becomes the counts' sum. */
ELP_INLINE int64_t list_packed_u8(uint8_t *count, uint16_t *vals, uint32_t *out,
                                  uint64_t *listed) {
    pthread_once(&pack_index_once, pack_index_init);
    const __m256i zero = _mm256_setzero_si256();
    __m256i sums = zero;
    int64_t n = 0;
    for (int64_t b = 0; b < N_VALUES; b += 32) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(count + b));
        unsigned m = ~(unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c, zero));
        if (!m) continue;
        _mm256_storeu_si256((__m256i *)(count + b), zero);
        sums = _mm256_add_epi64(sums, _mm256_sad_epu8(c, zero));
        for (int g = 0; g < 4; ++g) {
            unsigned m8 = m >> 8 * g & 0xFF;
            __m128i idx = _mm_cvtsi64_si128((long long)pack_index[m8]);
            __m128i half = g < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
            __m128i from = g & 1 ? _mm_add_epi8(idx, _mm_set1_epi8(8)) : idx; /* 0x88: 0 */
            __m128i packed = _mm_shuffle_epi8(half, from);
            _mm256_storeu_si256((__m256i *)(out + n), _mm256_cvtepu8_epi32(packed));
            __m128i base = _mm_set1_epi16((short)(b + 8 * g));
            _mm_storeu_si128((__m128i *)(vals + n), _mm_add_epi16(_mm_cvtepu8_epi16(idx), base));
            n += __builtin_popcount(m8);
        }
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, sums);
    *listed = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return n;
}

/* list_values16 of the AVX2 build: list_packed_u8 for uint16 counts, 8 counts (a 16-byte
   half of a 32-byte block that holds any) at a time, with pack_index16. */
ELP_INLINE int64_t list_packed_u16(u16_alias *count, uint16_t *vals, uint32_t *out) {
    pthread_once(&pack_index_once, pack_index_init);
    const __m256i zero = _mm256_setzero_si256();
    int64_t n = 0;
    for (int64_t b = 0; b < N_VALUES; b += 16) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(count + b));
        /* one mask bit per count: bits 0-7 and 16-23 (packs works per 16-byte half) */
        __m256i is_zero = _mm256_packs_epi16(_mm256_cmpeq_epi16(c, zero), zero);
        unsigned m = ~(unsigned)_mm256_movemask_epi8(is_zero) & 0x00FF00FFu;
        if (!m) continue;
        _mm256_storeu_si256((__m256i *)(count + b), zero);
        for (int h = 0; h < 2; ++h) {
            unsigned m8 = m >> 16 * h & 0xFF;
            __m128i half = h ? _mm256_extracti128_si256(c, 1) : _mm256_castsi256_si128(c);
            __m128i packed =
                _mm_shuffle_epi8(half, _mm_load_si128((const __m128i *)pack_index16[m8]));
            _mm256_storeu_si256((__m256i *)(out + n), _mm256_cvtepu16_epi32(packed));
            __m128i idx = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)pack_index[m8]));
            __m128i base = _mm_set1_epi16((short)(b + 8 * h));
            _mm_storeu_si128((__m128i *)(vals + n), _mm_add_epi16(idx, base));
            n += __builtin_popcount(m8);
        }
    }
    return n;
}
#endif

#if !defined(__AVX2__)
/* list_values16 (width 2) and list_values8 (width 1) of the portable build (the AVX2
   build's are list_packed_u16 and list_packed_u8); *listed, unless NULL, becomes the
   counts' sum. */
ELP_INLINE int64_t list_narrow_counts(void *count, const int width, uint16_t *vals,
                                      uint32_t *out, uint64_t *listed) {
    int64_t n = 0;
    uint64_t total = 0;
    for (int64_t i = 0; i < N_VALUES; ++i) {
        uint32_t c;
        if (width == 1) {
            c = ((uint8_t *)count)[i];
            ((uint8_t *)count)[i] = 0;
        } else {
            c = ((u16_alias *)count)[i];
            ((u16_alias *)count)[i] = 0;
        }
        total += c;
        out[n] = c; /* a zero written here is overwritten by the next count */
        vals[n] = (uint16_t)i;
        n += c != 0;
    }
    out[n] = 0;
    if (listed) *listed = total;
    return n;
}
#endif
#endif

/* list_values of uint16 counts: afterwards count16 is all-zero again, out[0, n) holds the
   non-zero counts in value order (as uint32) and vals[0, n) their values; returns n. */
#if defined(__AVX512BW__)
static int64_t list_values16(u16_alias *count16, uint16_t *vals, uint32_t *out) {
    int64_t n = 0;
    for (int64_t b = 0; b < N_VALUES; b += 32) {
        __m512i c = _mm512_loadu_si512(count16 + b);
        __mmask32 m = _mm512_test_epi16_mask(c, c);
        if (!m) continue;
        _mm512_storeu_si512(count16 + b, _mm512_setzero_si512());
        const __m256i halves[2] = {_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1)};
        for (int h = 0; h < 2; ++h) {
            __mmask16 mh = (__mmask16)(m >> (16 * h));
            if (mh)
                n = append_counts(out, vals, n, mh, _mm512_cvtepu16_epi32(halves[h]), b + 16 * h);
        }
    }
    return n;
}
#else
static int64_t list_values16(u16_alias *count16, uint16_t *vals, uint32_t *out) {
#if defined(__AVX2__)
    return list_packed_u16(count16, vals, out);
#else
    return list_narrow_counts(count16, 2, vals, out, NULL);
#endif
}
#endif

/* list_values of uint8 counts: afterwards count8 is all-zero again, out[0, n) holds the
   non-zero counts in value order (as uint32), vals[0, n) their values, and *listed their
   sum; returns n. (The AVX-512 build appends each 16 counts of a block that holds any,
   with no branch on whether they do: see list_packed_u8.) */
#if defined(__AVX512BW__)
static int64_t list_values8(uint8_t *count8, uint16_t *vals, uint32_t *out, uint64_t *listed) {
    int64_t n = 0;
    __m512i sum = _mm512_setzero_si512();
    for (int64_t b = 0; b < N_VALUES; b += 64) {
        __m512i c = _mm512_loadu_si512(count8 + b);
        __mmask64 m = _mm512_test_epi8_mask(c, c);
        if (!m) continue;
        _mm512_storeu_si512(count8 + b, _mm512_setzero_si512());
        sum = _mm512_add_epi64(sum, _mm512_sad_epu8(c, _mm512_setzero_si512()));
        for (int q = 0; q < 4; ++q) {
            __mmask16 mq = (__mmask16)(m >> (16 * q));
            n = append_counts(out, vals, n, mq,
                              _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c, q)), b + 16 * q);
        }
    }
    *listed = (uint64_t)_mm512_reduce_add_epi64(sum);
    return n;
}
#else
static int64_t list_values8(uint8_t *count8, uint16_t *vals, uint32_t *out, uint64_t *listed) {
#if defined(__AVX2__)
    return list_packed_u8(count8, vals, out, listed);
#else
    return list_narrow_counts(count8, 1, vals, out, listed);
#endif
}
#endif

/* A sum of count x limb-bits products modulo 2^64, as low + 2^32 high. The AVX2 build
   has no 64-bit vector multiply: with the count below 2^32, count x bits is count x (the
   low 32 bits) + 2^32 count x (the high 32 bits), two 32 x 32 -> 64-bit multiplies, and the
   second sum is shifted once, at the end. The other builds multiply in 64 bits (high
   stays 0). */
typedef struct {
    vul low, high;
} product_sum;

ELP_INLINE void add_product(product_sum *s, vul count, vul bits) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    s->low += (vul)_mm256_mul_epu32((__m256i)count, (__m256i)bits);
    s->high += (vul)_mm256_mul_epu32((__m256i)count, (__m256i)(bits >> 32));
#else
    s->low += count * bits;
#endif
}

ELP_INLINE uint64_t product_sum_lanes(product_sum s) {
    return lanes_u64(s.low) + (lanes_u64(s.high) << 32);
}

typedef struct {
    product_sum e_hi, e_lo, w_hi, w_lo; /* wrap mod 2^64, as the int64 sums */
    vu nonfinite;                       /* at most n_real < 2^32 */
} value_sums;

/* count x the limbs of s = v 2^42 (contract.quantize), each added as count x (its bits +
   bits(MAGIC)): hi + MAGIC and (s - hi) 2^42 + MAGIC are exact (hi, lo < 2^51), their bits
   bits(MAGIC) + hi and bits(MAGIC) + lo; the row's sums take off bits(MAGIC) x the sum of
   the counts once. */
ELP_INLINE void add_counted(const vul c[V4], const vd s[V4], product_sum *sum_hi,
                            product_sum *sum_lo) {
    for (int i = 0; i < V4; ++i) {
        vd hi = floord(s[i]);
        add_product(sum_hi, c[i], (vul)(hi + ELP_MAGIC));
        vd lo = exact_product_add(s[i] - hi, splatd(ELP_LIMB_SCALE), splatd(ELP_MAGIC));
        add_product(sum_lo, c[i], (vul)lo);
    }
}

/* Add count x (limbs, non-finite flag) of the n <= LANES values vals[0, n) to the sums;
   counts[0, LANES) are theirs (0 past n). all_terms (only with n == LANES): every value is
   a term, no compares (see terms); count_bad: count the NaN and +inf values (where there
   may be some). */
ELP_INLINE void sum_values(const row_view *v, const uint16_t *vals, int64_t n,
                           const uint32_t *counts, vd m, value_sums *t, const int dtype,
                           const int entropy, const int all_terms, const int count_bad) {
    vu c32[V8];
    vul c[V4];
    for (int q = 0; q < V8; ++q) {
        c32[q] = load_u32(counts + q * FW);
        c[2 * q] = (vul)widen_u32_lo(c32[q]);
        c[2 * q + 1] = (vul)widen_u32_hi(c32[q]);
    }
    row_view w = values_view(v, vals, n);
    vf y8[V8];
    vi valid8[V8];
    const int whole = n == LANES; /* a whole step: values_view has no keep mask */
    if (whole)
        load_whole(&w, 0, dtype, y8, valid8);
    else
        load_step(&w, 0, n, dtype, y8, valid8);
    vd sv[V4], sw[V4];
    limb_terms(y8, valid8, m, sv, sw, entropy, whole, all_terms);
    add_counted(c, sv, &t->e_hi, &t->e_lo);
    if (entropy) add_counted(c, sw, &t->w_hi, &t->w_lo);
    if (count_bad)
        for (int q = 0; q < V8; ++q)
            t->nonfinite += (vu)nonfinite_lanes(y8[q], valid8[q]) & c32[q];
}

/* The 16-bit keys of a row for the value-table path, or NULL for the direct loops: the row
   itself for 16-bit logits, the high halves of an fp32 row whose first 64 values' low
   halves are all zero (then its values are read as bf16 if the rest's are too: see
   count_values). */
ELP_INLINE const uint16_t *table_keys(const elp_shard *s, const row_view *v,
                                      const value_scratch *sc, const int dtype) {
    if (!sc || s->table_min_cols < 0 || v->n_real < s->table_min_cols ||
        v->n_real >= ((int64_t)1 << 32)) /* counts are uint32 */
        return NULL;
    if (dtype != ELP_F32) return (const uint16_t *)v->x;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* genuine fp32 rows stop here; the rest of the row is checked as it is counted
       (count_high_halves) */
    const uint32_t *x = (const uint32_t *)v->x;
    uint32_t low = 0;
    for (int64_t k = 0; k < min64(64, v->n_real); ++k) low |= x[k];
    return low & 0xFFFFu ? NULL : (const uint16_t *)v->x + 1;
#else
    return NULL;
#endif
}

/* Count the columns of row v by value (keys[j * stride] being column j's) and list them:
   afterwards sc->done[0, n) holds the row's distinct values in order, (*counts)[0, n)
   their counts, *kept the columns counted, and every slot and count outside
   (*counts)[0, n) is zero; returns n. With stride 2 (the high halves of an fp32 row)
   it returns -1, and every slot and count is zero, if a low half is not zero: the row is
   not all bf16 values. */
ELP_INLINE int64_t count_values(const row_view *v, const uint16_t *keys, const int stride,
                                value_scratch *sc, const int vdtype, int64_t *kept,
                                uint32_t **counts) {
    uint64_t listed;
    *counts = sc->counts;
    if (vdtype == ELP_F16 && sc->wide_rows > 0) {
        --sc->wide_rows;
    } else if (vdtype == ELP_F16) {
        /* fp16 rows of LLM logits have ~16 000 distinct values, each in a few dozen
           columns: counted in uint8, the counts stay in L1 (in uint16 they do not). A
           count that wraps at 256 makes the listed sum fall short; then the row is counted
           again, and this thread's next 64 rows go to uint16 at once (how a row is counted
           never moves a bit: the counts are the same). bf16 rows (a few thousand values,
           the common ones in thousands of columns) would wrap uint8 on nearly every row */
        *kept = count_keys8(keys, 1, v->keep, v->n_real, (uint8_t *)sc->slot);
        int64_t n = list_values8((uint8_t *)sc->slot, sc->done, sc->counts, &listed);
        if (listed == (uint64_t)*kept) return n;
        memset(sc->counts, 0, n * sizeof *sc->counts);
        sc->wide_rows = 64;
    }
    u16_alias *count16 = (u16_alias *)sc->slot;
    uint32_t low = 0;
    *kept = stride == 1 ? count_keys16(keys, 1, v->keep, v->n_real, count16)
                        : count_high_halves((const uint32_t *)v->x, v->keep, v->n_real,
                                            count16, &low);
    int64_t n = list_values16(count16, sc->done, sc->counts);
    if (low) {
        memset(sc->counts, 0, n * sizeof *sc->counts);
        return -1;
    }
    if (*kept < 65536) return n; /* no count can have wrapped */
    listed = 0;
    for (int64_t i = 0; i < n; ++i) listed += sc->counts[i];
    if (listed == (uint64_t)*kept) return n;
    memset(sc->counts, 0, n * sizeof *sc->counts);
    *counts = sc->slot; /* count again in uint32; list in place */
    if (stride == 1)
        count_keys32(keys, 1, v->keep, v->n_real, sc->slot);
    else
        count_keys32(keys, 2, v->keep, v->n_real, sc->slot);
    return list_values(sc->slot, sc->done);
}

/* Stages 3-5 of a row through its value table, keys[j * stride] being column j's value
   (decoded as vdtype); with has_max == 0, stage 2 too: *row_max becomes the largest y of
   the values that occur. Returns 0 (having changed nothing) for an fp32 row that turns
   out not to be all bf16 values, else 1. */
ELP_INLINE int table_sums(const row_view *v, const uint16_t *keys, const int stride,
                           const int has_max, float *row_max, value_scratch *sc,
                           uint64_t total[4], int64_t *nonfinite, const int vdtype,
                           const int entropy) {
    uint32_t *count;
    int64_t kept, n = count_values(v, keys, stride, sc, vdtype, &kept, &count);
    if (n < 0) return 0;
    row_scan found, *scan = NULL; /* with the max given (TP), nothing is known */
    if (!has_max) {
        row_view w = values_view(v, sc->done, n);
        *row_max = view_max_checked(&w, vdtype, &found);
        scan = &found;
    }
    vd m = splatd((double)*row_max);
    value_sums t;
    memset(&t, 0, sizeof t);
    /* the whole steps skip what the max pass shows they need not do, as in direct_sums */
    int64_t i = 0;
    const int64_t whole = n - n % LANES;
    if (scan_all_terms(scan, *row_max))
        for (; i < whole; i += LANES)
            sum_values(v, sc->done + i, LANES, count + i, m, &t, vdtype, entropy, 1, 0);
    else if (scan_none_bad(scan))
        for (; i < whole; i += LANES)
            sum_values(v, sc->done + i, LANES, count + i, m, &t, vdtype, entropy, 0, 0);
    for (; i < n; i += LANES)
        sum_values(v, sc->done + i, min64(LANES, n - i), count + i, m, &t, vdtype, entropy, 0,
                   1);
    memset(count, 0, n * sizeof *count); /* all-zero again */
    /* the counts sum to `kept` (checked above where a uint16 count could have wrapped) */
    uint64_t offset = (uint64_t)kept * magic_bits(); /* modulo 2^64, as the sums */
    total[0] = product_sum_lanes(t.e_hi) - offset;
    total[1] = product_sum_lanes(t.e_lo) - offset;
    total[2] = product_sum_lanes(t.w_hi) - (entropy ? offset : 0);
    total[3] = product_sum_lanes(t.w_lo) - (entropy ? offset : 0);
    uint64_t nf = 0;
    for (int i = 0; i < FW; ++i) nf += t.nonfinite[i];
    *nonfinite = (int64_t)nf;
    return 1;
}

/* The limb sums of row v (with its max given, or found when has_max == 0), through the
   value table where it applies, else column by column. */
ELP_INLINE void row_sums_of(const elp_shard *s, const row_view *v, const int has_max,
                            float *row_max, value_scratch *sc, uint64_t total[4],
                            int64_t *nonfinite, const char *ahead, const int dtype,
                            const int entropy) {
    const uint16_t *keys = table_keys(s, v, sc, dtype);
    const int vdtype = dtype == ELP_F32 ? ELP_BF16 : dtype, stride = dtype == ELP_F32 ? 2 : 1;
    if (keys &&
        table_sums(v, keys, stride, has_max, row_max, sc, total, nonfinite, vdtype, entropy))
        return;
    row_scan scan;
    if (!has_max) *row_max = view_max_checked(v, dtype, &scan);
    direct_sums(v, *row_max, total, nonfinite, ahead, has_max ? NULL : &scan, dtype, entropy);
}

/* slot[vals[i]] = FILLED | the gradient bits of a non-target column holding vals[i]. */
ELP_INLINE void grad_values(const row_view *v, const grad_row *g, const uint16_t *vals,
                            int64_t n, uint32_t *slot, const int dtype, const int entropy) {
    row_view w = values_view(v, vals, n);
    vf y[V8], f[V8];
    vi valid[V8];
    uint16_t bits[LANES];
    load_step(&w, 0, n, dtype, y, valid);
    grad_step(y, valid, g, entropy, f);
    store_step((char *)bits, f, n, dtype);
    for (int64_t i = 0; i < n; ++i) slot[vals[i]] = FILLED | bits[i];
}

typedef struct {
    const uint16_t *x;
    uint16_t *o;
    value_scratch *sc;
    int64_t n_done, n_fix, first_pending; /* done[first_pending, n_done) are pending */
} lazy_table;

/* Compute the pending values, then store the columns that waited for them. */
ELP_INLINE void settle(lazy_table *lt, const row_view *v, const grad_row *g, const int dtype,
                       const int entropy) {
    value_scratch *sc = lt->sc;
    for (int64_t i = lt->first_pending; i < lt->n_done; i += LANES)
        grad_values(v, g, sc->done + i, min64(LANES, lt->n_done - i), sc->slot, dtype, entropy);
    lt->first_pending = lt->n_done;
    for (int64_t i = 0; i < lt->n_fix; ++i) lt->o[sc->fix[i]] = (uint16_t)sc->slot[lt->x[sc->fix[i]]];
    lt->n_fix = 0;
}

/* Column j's value has no gradient in the table yet: queue it (once) and remember j. */
static __attribute__((noinline, cold)) void table_miss(lazy_table *lt, int64_t j,
                                                       const row_view *v, const grad_row *g,
                                                       const int dtype, const int entropy) {
    uint32_t *slot = lt->sc->slot;
    uint16_t val = lt->x[j];
    if (!(slot[val] & PENDING)) {
        slot[val] = PENDING;
        lt->sc->done[lt->n_done++] = val;
    }
    lt->sc->fix[lt->n_fix++] = j;
    if (lt->n_done - lt->first_pending == LANES || lt->n_fix == FIX_CAP)
        settle(lt, v, g, dtype, entropy);
}

/* o[j] = the gradient of column j's value for the real columns [0, n_real); with a keep
   mask, masked columns get `off`. */
ELP_INLINE void table_columns(lazy_table *lt, const uint8_t *keep, uint16_t off, int64_t n_real,
                              const row_view *v, const grad_row *g, const int dtype,
                              const int entropy) {
    const uint16_t *x = lt->x;
    const uint32_t *slot = lt->sc->slot;
    uint16_t *o = lt->o;
    for (int64_t j = 0; j < n_real; ++j) {
        if (keep && !keep[j]) {
            o[j] = off;
            continue;
        }
        uint32_t t = slot[x[j]];
        o[j] = (uint16_t)t;
        if (__builtin_expect(!(t & FILLED), 0)) table_miss(lt, j, v, g, dtype, entropy);
    }
}

ELP_INLINE void grad_row_table(const elp_shard *s, const elp_grad_stats *st, char *out,
                               int64_t r, const int dtype, const int entropy,
                               value_scratch *sc) {
    row_view v = row_of(s, r, dtype);
    grad_row g = grad_row_of(st, &v, r);

    /* what padding and masked columns get: the direct loop's value of an invalid lane */
    uint16_t off;
    {
        vf y[V8], f[V8];
        vi none[V8];
        for (int q = 0; q < V8; ++q) y[q] = splatf(0.0f), none[q] = (vi){0};
        grad_step(y, none, &g, entropy, f);
        store_step((char *)&off, f, 1, dtype);
    }

    lazy_table lt = {(const uint16_t *)v.x, (uint16_t *)out, sc, 0, 0, 0};
    if (v.keep)
        table_columns(&lt, v.keep, off, v.n_real, &v, &g, dtype, entropy);
    else
        table_columns(&lt, NULL, off, v.n_real, &v, &g, dtype, entropy);
    settle(&lt, &v, &g, dtype, entropy);
    for (int64_t j = v.n_real; j < v.n_cols; ++j) lt.o[j] = off;
    for (int64_t i = 0; i < lt.n_done; ++i) sc->slot[sc->done[i]] = 0; /* all-zero again */

    int64_t t = owned_column(s, r);
    if (t >= 0) grad_target(&v, &g, t, out, dtype, entropy);
}

/* ------------------------------------------------------------------ 7. finalize */

/* contract._two_sum: s = fl(a + b) and its exact rounding error. */
static void two_sum(double a, double b, double *s, double *err) {
    double sum = a + b, bb = sum - a;
    *s = sum;
    *err = (a - (sum - bb)) + (b - bb);
}

/* contract.limbs_to_double_double: hi 2^-42 + lo 2^-84 -> (fl(value), exact rest). */
static void limbs_to_double_double(int64_t hi, int64_t lo, double *vh, double *vl) {
    hi = (int64_t)((uint64_t)hi + (uint64_t)(lo >> ELP_FRAC_BITS)); /* carry, wrapping */
    lo &= ((int64_t)1 << ELP_FRAC_BITS) - 1;
    double a = (double)hi;                /* round to nearest even */
    int64_t r = hi - (int64_t)a;          /* exact, |r| <= 2^9 */
    int64_t t = r * ((int64_t)1 << ELP_FRAC_BITS) + lo; /* exact, |t| < 2^53 */
    two_sum(a * ELP_LIMB_UNIT, (double)t * ELP_LIMB2_UNIT, vh, vl);
}

/* torch.frexp of a finite x: x = m 2^k, |m| in [0.5, 1) (m = x, k = 0 for 0, inf, NaN). */
static double frexp_of(double x, int *k) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int e = (int)((bits >> 52) & 0x7FF), shift = 0;
    *k = 0;
    if (e == 0x7FF || x == 0.0) return x;
    if (e == 0) { /* subnormal: scale into the normal range first (exact) */
        x *= 0x1p54;
        memcpy(&bits, &x, sizeof bits);
        e = (int)((bits >> 52) & 0x7FF);
        shift = 54;
    }
    *k = e - 1022 - shift;
    bits = (bits & ~((uint64_t)0x7FF << 52)) | ((uint64_t)1022 << 52);
    double m;
    memcpy(&m, &bits, sizeof m);
    return m;
}

/* contract.log_c: log(sh + sl) = k ln2 + 2 atanh(g / (2 + g)), in the same order. */
static double log_c(double sh, double sl) {
    int k;
    double m = frexp_of(sh, &k);
    if (m < ELP_SQRT_HALF) {
        m = m * 2.0;
        k = k - 1;
    }
    double kd = (double)k, g = m - 1.0; /* exact (Sterbenz) */
    double s = g / (2.0 + g), s2 = s + s, z = s * s;
    double poly = log_poly[0];
    for (int i = 1; i < ELP_LOG_POLY_LEN; ++i) poly = poly * z + log_poly[i];
    double tail = kd * ELP_LN2_LO + sl / sh;
    return kd * ELP_LN2_HI + (s2 + (s2 * (poly * z) + tail));
}

static float finish_output(double v, int ignored, int64_t bad) {
    if (bad != 0) {
        const uint32_t nan_bits = 0x7FC00000u; /* fl32 of the reference's fp64 NaN */
        float nan;
        memcpy(&nan, &nan_bits, sizeof nan);
        return nan;
    }
    return ignored ? 0.0f : (float)v;
}

/* contract.finalize of row r: the flags BAD_*, S, log S and the three outputs. */
static void finalize_row(int64_t r, int64_t target, int64_t vocab_size, int64_t ignore_index,
                         int bad_tau, int disagree, const elp_rows *o) {
    const int64_t *rec = o->record + r * ELP_NUM_COLS;
    float row_max = o->row_max[r];
    int ignored = target == ignore_index;
    int out_of_range = target < 0 || (vocab_size >= 0 && target >= vocab_size);
    int64_t bad = 0;
    if (out_of_range) bad |= ELP_BAD_TARGET_RANGE;
    if (!out_of_range && rec[ELP_COL_OWNERS] != 1) bad |= ELP_BAD_TARGET_OWNER;
    if (rec[ELP_COL_TARGET_MASKED] != 0) bad |= ELP_BAD_TARGET_MASKED;
    if (rec[ELP_COL_NONFINITE] != 0) bad |= ELP_BAD_NONFINITE;
    if (row_max == -__builtin_inff()) bad |= ELP_BAD_NO_VALID_COLUMN;
    if (bad_tau) bad |= ELP_BAD_TEMPERATURE;
    if (ignored) bad = 0;
    if (disagree) bad |= ELP_BAD_RANKS; /* poisons ignored rows too */

    /* bad and ignored rows get S = 1, so that log_c stays in its domain */
    int skip = bad != 0 || ignored;
    double sh, sl, wh, wl;
    limbs_to_double_double(skip ? (int64_t)1 << ELP_FRAC_BITS : rec[ELP_COL_E_HI],
                           skip ? 0 : rec[ELP_COL_E_LO], &sh, &sl);
    double log_s = log_c(sh, sl);
    limbs_to_double_double(rec[ELP_COL_W_HI], rec[ELP_COL_W_LO], &wh, &wl);

    double m64 = (double)row_max;
    int32_t t_bits = (int32_t)rec[ELP_COL_TARGET_BITS]; /* the low 32 bits */
    float y_t;
    memcpy(&y_t, &t_bits, sizeof y_t);
    double entropy64 = log_s + wh / sh;
    o->logprobs[r] = finish_output(((double)y_t - m64) - log_s, ignored, bad);
    o->entropy[r] = finish_output(entropy64, ignored, bad);
    o->lse[r] = finish_output(m64 + log_s, ignored, bad);
    o->s_hi[r] = sh;
    o->s_lo[r] = sl;
    o->log_s[r] = log_s;
    o->entropy64[r] = entropy64;
    o->bad[r] = bad;
    o->ignored[r] = (uint8_t)ignored;
}

/* A per-row temperature that contract.finalize flags: not finite, or not > 0. */
ELP_INLINE int bad_temperature(const elp_shard *s, int64_t r) {
    if (!s->tau_rows) return 0; /* a scalar was checked when the call began */
    float tau = s->tau_rows[r];
    return !(__builtin_isfinite(tau) && tau > 0.0f);
}

/* ------------------------------------------------------------------ variants */

/* Each pass is compiled once per logits dtype and entropy flag, so that the row loop
   carries no run-time switch on them; `variant` packs them as dtype * 2 + entropy. */
#define ELP_VARIANTS(X) X(0) X(1) X(2) X(3) X(4) X(5)

typedef struct elp_job elp_job;
/* Rows [r0, r1) of a pass; `after` is the first row this thread takes after them (-1: none
   or not known), so that a pass may prefetch it. */
typedef void (*rows_fn)(const elp_job *job, int64_t r0, int64_t r1, int64_t after,
                        value_scratch *scratch);

struct elp_job {
    const elp_shard *s;
    const float *row_max; /* partials: the global max */
    const elp_grad_stats *stats;
    const elp_rows *rows; /* forward: the per-row results */
    void *out;            /* row max pass: float[n_rows]; chunk max pass: float[n_rows,
                             ceil(n_real / chunk)]; partials: the record; grad */
    int64_t chunk;        /* chunk max pass: columns per chunk */
    int variant;
    int wants_scratch; /* each thread gets its value_scratch (NULL if it cannot): the rows
                          may take the value-table path */
    int lookahead;     /* the pass prefetches the row after: claim it early */
    rows_fn fn;
    int64_t grab, next; /* rows handed out `grab` at a time; next taken atomically */
    int64_t threads;
};

ELP_INLINE void row_max_with(const elp_job *job, int64_t r, int64_t next, value_scratch *scratch,
                             const int dtype, const int entropy) {
    (void)next, (void)scratch, (void)entropy; /* not a variant of this pass */
    row_view v = row_of(job->s, r, dtype);
    ((float *)job->out)[r] = view_max(&v, dtype);
}

ELP_INLINE void chunk_max_with(const elp_job *job, int64_t r, int64_t next,
                               value_scratch *scratch, const int dtype, const int entropy) {
    (void)next, (void)scratch, (void)entropy; /* not a variant of this pass */
    const elp_shard *s = job->s;
    row_view v = row_of(s, r, dtype);
    int64_t n_chunks = (s->n_real + job->chunk - 1) / job->chunk; /* chunk <= n_real + LANES */
    view_chunk_max(&v, job->chunk, (float *)job->out + r * n_chunks, dtype);
}

ELP_INLINE void partials_with(const elp_job *job, int64_t r, int64_t next, value_scratch *scratch,
                              const int dtype, const int entropy) {
    (void)next; /* one read of the row, streamed: no prefetch needed */
    const elp_shard *s = job->s;
    row_view v = row_of(s, r, dtype);
    float m = job->row_max[r];
    uint64_t total[4];
    int64_t nonfinite;
    row_sums_of(s, &v, 1, &m, scratch, total, &nonfinite, NULL, dtype, entropy);
    write_record((int64_t *)job->out + r * ELP_NUM_COLS, &v, total, nonfinite,
                 owned_column(s, r), dtype);
}

/* Stages 2-7 of row r of a shard that is the whole vocabulary; `next` (or -1) is the row
   this thread takes next: the direct loops prefetch it. */
ELP_INLINE void forward_with(const elp_job *job, int64_t r, int64_t next, value_scratch *scratch,
                             const int dtype, const int entropy) {
    const elp_shard *s = job->s;
    const elp_rows *o = job->rows;
    row_view v = row_of(s, r, dtype);
    const char *ahead = next >= 0 ? row_of(s, next, dtype).x : NULL;
    uint64_t total[4];
    int64_t nonfinite;
    row_sums_of(s, &v, 0, &o->row_max[r], scratch, total, &nonfinite, ahead, dtype, entropy);
    write_record(o->record + r * ELP_NUM_COLS, &v, total, nonfinite, owned_column(s, r), dtype);
    finalize_row(r, s->target[r], s->vocab_size, s->ignore_index, bad_temperature(s, r), 0, o);
}

ELP_INLINE void grad_with(const elp_job *job, int64_t r, int64_t next, value_scratch *scratch,
                          const int dtype, const int entropy) {
    (void)next; /* one read of the row, streamed */
    const elp_shard *s = job->s;
    char *out = (char *)job->out + r * s->n_cols * elem_size(dtype);
    if (job->stats->row_nan[r])
        nan_row(out, s->n_cols, dtype);
    else if (dtype != ELP_F32 && scratch && s->table_min_cols >= 0 &&
             s->n_real >= s->table_min_cols && s->n_real < ((int64_t)1 << 32))
        grad_row_table(s, job->stats, out, r, dtype, entropy, scratch);
    else
        grad_row_direct(s, job->stats, out, r, dtype, entropy);
}

#define ELP_CASE(fn, v)                                                                    \
    case v:                                                                                \
        for (int64_t r = r0; r < r1; ++r)                                                  \
            fn(job, r, r + 1 < r1 ? r + 1 : after, scratch, (v) >> 1, (v) & 1);            \
        break;
#define ELP_CASE_row_max(v) ELP_CASE(row_max_with, v)
#define ELP_CASE_chunk_max(v) ELP_CASE(chunk_max_with, v)
#define ELP_CASE_partials(v) ELP_CASE(partials_with, v)
#define ELP_CASE_forward(v) ELP_CASE(forward_with, v)
#define ELP_CASE_grad(v) ELP_CASE(grad_with, v)
#define ELP_ROWS(pass, variants)                                                             \
    static void pass##_rows(const elp_job *job, int64_t r0, int64_t r1, int64_t after,      \
                            value_scratch *scratch) {                                       \
        switch (job->variant) { variants(ELP_CASE_##pass) }                                 \
    }

#define ELP_NO_ENTROPY(X) X(0) X(2) X(4)
ELP_ROWS(row_max, ELP_NO_ENTROPY)
ELP_ROWS(chunk_max, ELP_NO_ENTROPY)
ELP_ROWS(partials, ELP_VARIANTS)
ELP_ROWS(forward, ELP_VARIANTS)
ELP_ROWS(grad, ELP_VARIANTS)

/* ------------------------------------------------------------------ threads */

/* Rows are spread over torch's own OpenMP threads: the library is built with -fopenmp and
   links libgomp by its soname, which the dynamic linker resolves to the copy torch has
   already loaded, so both share one pool of threads (a second pool would compete with
   torch's spinning threads for the same cores). Each thread keeps a value_scratch between
   calls (no call pays for mapping and faulting in fresh scratch). One call at a time uses
   them; a call from another thread meanwhile runs on its own thread alone (the same
   bits). Built without OpenMP, every call runs on the calling thread. */
enum { MAX_THREADS = 256 };

static struct {
    pthread_mutex_t busy; /* held by the call that uses the scratch below */
    int forked;           /* this is a child forked after the library loaded: if the
                             parent (or torch in it) ran an OpenMP region, the child's
                             OpenMP state names the parent's threads and a region would
                             wait for them forever (a child forked after `import
                             exactlogp` but before the load gets one thread from cpu.py) */
    value_scratch *scratch[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, {NULL}};

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pool.forked = 1;
    /* another thread of the parent may have been in the middle of a row: its scratch is
       not all-zero; the child's calls take fresh scratch (the parent's copies are left) */
    for (int i = 0; i < MAX_THREADS; ++i) pool.scratch[i] = NULL;
}

/* registered when the library is loaded, so that every later fork is seen */
__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
}

/* A thread's part of a pass: rows, a few at a time, until none are left. */
static void take_rows(elp_job *job, value_scratch **scratch) {
    value_scratch *sc = NULL;
    if (job->wants_scratch) {
        /* zeroed once, and every row leaves it zeroed again; without it (no memory) the
           rows take the direct loops, which give the same bits */
        if (!*scratch) *scratch = calloc(1, sizeof(value_scratch));
        sc = *scratch;
    }
    /* With `lookahead` and rows enough for every thread several times over, a thread
       claims its next rows when it starts on the current ones, so that the pass knows the
       row that comes after them (to prefetch it); the rows still go to whichever thread
       is free, one claim ahead. */
    int64_t n = job->s->n_rows, grab = job->grab;
    int ahead = job->lookahead && n >= 4 * job->threads * grab;
    int64_t r0 = __atomic_fetch_add(&job->next, grab, __ATOMIC_RELAXED);
    while (r0 < n) {
        int64_t after = ahead ? __atomic_fetch_add(&job->next, grab, __ATOMIC_RELAXED) : -1;
        job->fn(job, r0, min64(r0 + grab, n), after < n ? after : -1, sc);
        r0 = ahead ? after : __atomic_fetch_add(&job->next, grab, __ATOMIC_RELAXED);
    }
}

/* take_rows on `workers` threads (the caller is one of them), each with its own scratch
   slot. Called with pool.busy held. A forked child runs on one thread. */
static void pool_run(elp_job *job, int workers) {
#if defined(_OPENMP)
    if (workers > 1 && !pool.forked) {
#pragma omp parallel num_threads(workers)
        {
            int id = omp_get_thread_num();
            if (id < MAX_THREADS) take_rows(job, &pool.scratch[id]);
        }
        return;
    }
#endif
    (void)workers;
    take_rows(job, &pool.scratch[0]);
}

enum { ROW_GRAB_ELEMENTS = 1 << 14 };

/* Rows are handed out a few at a time to whichever thread is free; each row is computed
   whole by one thread, so the bits never depend on the thread count. */
static void run_rows(rows_fn fn, elp_job *job) {
    const elp_shard *s = job->s;
    if (s->n_rows == 0) return;
    int64_t threads = s->num_threads < 1 ? 1 : s->num_threads;
    threads = min64(min64(threads, MAX_THREADS), s->n_rows);
    int64_t grab = ROW_GRAB_ELEMENTS / (s->n_cols > 0 ? s->n_cols : 1);
    grab = min64(grab < 1 ? 1 : grab, (s->n_rows + 4 * threads - 1) / (4 * threads));
    job->fn = fn;
    job->grab = grab < 1 ? 1 : grab;
    job->next = 0;
    job->threads = threads;
    if (pthread_mutex_trylock(&pool.busy) == 0) {
        pool_run(job, (int)threads);
        pthread_mutex_unlock(&pool.busy);
        return;
    }
    value_scratch *own = NULL; /* the pool is another call's: this one runs alone */
    take_rows(job, &own);
    free(own);
}

/* ------------------------------------------------------------------ exported */

static int variant_of(const elp_shard *s, int entropy) { return s->dtype * 2 + (entropy != 0); }

static int bad_shard(const elp_shard *s) {
    return s->dtype < ELP_F32 || s->dtype > ELP_F16 || s->n_rows < 0 || s->n_cols < 0 ||
           s->n_real < 0 || s->n_real > s->n_cols || s->rows_inner < 1;
}

static int wants_tables(const elp_shard *s) {
    return s->table_min_cols >= 0 && s->n_real >= s->table_min_cols;
}

/* out[n_rows] fp32. Returns 0, or -1 for an invalid shard description. */
int elp_row_max(const elp_shard *s, float *out) {
    if (bad_shard(s)) return -1;
    elp_job job = {.s = s, .out = out, .variant = variant_of(s, 0)};
    run_rows(row_max_rows, &job);
    return 0;
}

/* out[n_rows, ceil(n_real / chunk)] fp32, row-major: the max of y over each chunk of
   `chunk` real columns (view_chunk_max). Returns 0, or -1 for an invalid shard description,
   a keep mask (this pass reads none), or a chunk that is not a positive multiple of LANES
   (64 columns in the AVX-512 build, 32 in the others: a multiple of 64 suits every build). */
int elp_chunk_max(const elp_shard *s, int64_t chunk, float *out) {
    if (bad_shard(s) || s->keep || chunk <= 0 || chunk % LANES != 0) return -1;
    /* a chunk longer than the row makes one chunk of it, as does row_steps (more than
       n_real, a multiple of LANES), with which j + chunk cannot overflow */
    int64_t row_steps = (s->n_real / LANES + 1) * LANES;
    elp_job job = {.s = s, .out = out, .variant = variant_of(s, 0),
                   .chunk = min64(chunk, row_steps)};
    run_rows(chunk_max_rows, &job);
    return 0;
}

/* record[n_rows, ELP_NUM_COLS] int64, every entry written; row_max is the global max. */
int elp_partials(const elp_shard *s, const float *row_max, int32_t with_entropy,
                 int64_t *record) {
    if (bad_shard(s) || (s->n_rows > 0 && !s->target)) return -1;
    elp_job job = {.s = s, .row_max = row_max, .out = record,
                   .variant = variant_of(s, with_entropy), .wants_scratch = wants_tables(s)};
    run_rows(partials_rows, &job);
    return 0;
}

/* Stages 2-7 for a shard that holds the whole vocabulary: every field of `rows` written. */
int elp_forward(const elp_shard *s, int32_t with_entropy, const elp_rows *rows) {
    if (bad_shard(s) || (s->n_rows > 0 && !s->target)) return -1;
    elp_job job = {.s = s, .rows = rows, .variant = variant_of(s, with_entropy),
                   .wants_scratch = wants_tables(s), .lookahead = 1};
    run_rows(forward_rows, &job);
    return 0;
}

/* Stage 7 on the combined record (rows->row_max and rows->record are read, the rest
   written); bad_tau and disagree are [n_rows] flags or NULL. */
int elp_finalize(int64_t n_rows, const int64_t *target, int64_t vocab_size, int64_t ignore_index,
                 const uint8_t *bad_tau, const uint8_t *disagree, const elp_rows *rows) {
    if (n_rows < 0) return -1;
    for (int64_t r = 0; r < n_rows; ++r)
        finalize_row(r, target[r], vocab_size, ignore_index, bad_tau && bad_tau[r],
                     disagree && disagree[r], rows);
    return 0;
}

/* out[n_rows, n_cols] in the logits' dtype, contiguous. */
int elp_grad(const elp_shard *s, const elp_grad_stats *stats, int32_t with_entropy, void *out) {
    if (bad_shard(s) || (s->n_rows > 0 && !s->target)) return -1;
    elp_job job = {.s = s, .stats = stats, .out = out, .variant = variant_of(s, with_entropy),
                   .wants_scratch = s->dtype != ELP_F32 && wants_tables(s)};
    run_rows(grad_rows, &job);
    return 0;
}

/* The contract constants as this library uses them, in the order of
   cpu_build.expected_constants(); returns how many there are. */
int elp_constants(double *out, int capacity) {
    double v[128];
    int n = 0;
    v[n++] = ELP_CUTOFF;
    v[n++] = ELP_MAGIC;
    v[n++] = ELP_LIMB_SCALE;
    v[n++] = ELP_INV_LN2_32;
    v[n++] = ELP_LN2_32_HI;
    v[n++] = ELP_LN2_32_LO;
    v[n++] = ELP_LIMB_UNIT;
    v[n++] = ELP_LIMB2_UNIT;
    v[n++] = ELP_SQRT_HALF;
    v[n++] = ELP_LN2_HI;
    v[n++] = ELP_LN2_LO;
    for (int i = 0; i < (1 << ELP_TABLE_BITS); ++i) v[n++] = exp2_table[i];
    for (int i = 0; i < ELP_EXP_POLY_LEN; ++i) v[n++] = exp_poly[i];
    for (int i = 0; i < ELP_LOG_POLY_LEN; ++i) v[n++] = log_poly[i];
    v[n++] = ELP_FRAC_BITS;
    v[n++] = ELP_NUM_COLS;
    v[n++] = ELP_COL_E_HI;
    v[n++] = ELP_COL_E_LO;
    v[n++] = ELP_COL_W_HI;
    v[n++] = ELP_COL_W_LO;
    v[n++] = ELP_COL_TARGET_BITS;
    v[n++] = ELP_COL_OWNERS;
    v[n++] = ELP_COL_TARGET_MASKED;
    v[n++] = ELP_COL_NONFINITE;
    v[n++] = ELP_BAD_TARGET_RANGE;
    v[n++] = ELP_BAD_TARGET_OWNER;
    v[n++] = ELP_BAD_TARGET_MASKED;
    v[n++] = ELP_BAD_NONFINITE;
    v[n++] = ELP_BAD_NO_VALID_COLUMN;
    v[n++] = ELP_BAD_TEMPERATURE;
    v[n++] = ELP_BAD_RANKS;
    for (int i = 0; i < n && i < capacity; ++i) out[i] = v[i];
    return n;
}

/* The instruction set this library was compiled for: 0 portable, 1 AVX2, 2 AVX-512. */
int elp_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
