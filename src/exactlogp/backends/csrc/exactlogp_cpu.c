/* Fused CPU kernels for the contract (exactlogp.CONTRACT): row max, exact row record, gradient.
 *
 * Every element goes through exactly the IEEE operations of exactlogp/contract.py, in the
 * same order, so the results are bitwise those of the torch reference:
 *
 *   1. y = fp32(x) / tau        fp32 division (skipped for a scalar tau == 1)
 *   3. e = exp_c(y - M)         binary64 + - * only: Cody-Waite, table, Horner, 2^n from bits
 *   4. (hi, lo) = Q(e), Q(w)    floor and magic-number rint, both exact
 *   5. limb sums                integer-valued doubles summed exactly (< 2^53), then int64
 *   backward                    p = e / fl(S), the formulas of contract.grad_block (one for
 *                               the target column, one for the others), / tau,
 *                               fp64 -> fp32 -> dtype, each a round to nearest even
 *
 * Built with -ffp-contract=off and without -ffast-math: no FMA, no reassociation. The
 * constants come from the header that exactlogp/backends/cpu_build.py generates from
 * contract.py. The arithmetic is written once with GCC vector extensions (4 doubles,
 * 8 floats); cpu_build compiles it with -mavx2 where the CPU has AVX2, and then the few
 * data-movement primitives below (widen, narrow, floor, 16- and 8-bit loads) use AVX2.
 * Rows are spread over pthreads; a row's result never depends on the thread that ran it.
 * Long rows of 16-bit logits take the value-table path (see "value tables" below): the
 * contract is evaluated once per distinct value of the row instead of once per column.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "exactlogp_constants.h"

#define ELP_INLINE static inline __attribute__((always_inline))

typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef uint64_t v4ul __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));

enum { ELP_F32 = 0, ELP_BF16 = 1, ELP_F16 = 2 };

/* One shard of logits as the three passes see it (mirrored by cpu.py's ctypes struct). */
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
    int64_t table_min_cols; /* 16-bit rows with at least this many real columns take the
                               value-table path; < 0: never */
} elp_shard;

/* Per-row statistics of backward, all [n_rows] (contract.GradStats plus the target). */
typedef struct {
    const float *row_max;
    const double *s_hi, *s_lo, *log_s, *entropy64, *coef_a, *coef_b, *coef_t, *coef_l;
    const uint8_t *row_nan;
    const int64_t *target_col; /* local column of the target, -1 where not owned */
} elp_grad_stats;

/* ------------------------------------------------------------------ small vector tools */

ELP_INLINE v4d splat4(double v) { return (v4d){v, v, v, v}; }
ELP_INLINE v8f splat8(float v) { return (v8f){v, v, v, v, v, v, v, v}; }
ELP_INLINE v4d select4(v4l m, v4d a, v4d b) { return (v4d)(((v4l)a & m) | ((v4l)b & ~m)); }
ELP_INLINE v8f select8(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

ELP_INLINE v4d and4(v4l m, v4d a) { return (v4d)((v4l)a & m); } /* a where m, else +0 */

/* --- data movement: one definition per ISA, same results (they move bits, or floor) --- */

#if defined(__AVX2__)
ELP_INLINE v4d widen_lo(v8f y) { return (v4d)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)y)); }
ELP_INLINE v4d widen_hi(v8f y) { return (v4d)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)y, 1)); }
ELP_INLINE v4l widen_mask_lo(v8i m) {
    return (v4l)_mm256_cvtepi32_epi64(_mm256_castsi256_si128((__m256i)m));
}
ELP_INLINE v4l widen_mask_hi(v8i m) {
    return (v4l)_mm256_cvtepi32_epi64(_mm256_extracti128_si256((__m256i)m, 1));
}
ELP_INLINE v8f narrow(v4d lo, v4d hi) { /* fp64 -> fp32, round to nearest even */
    __m128 a = _mm256_cvtpd_ps((__m256d)lo), b = _mm256_cvtpd_ps((__m256d)hi);
    return (v8f)_mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
}
ELP_INLINE v8u load_u16x8(const void *p) {
    return (v8u)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
}
ELP_INLINE v8i load_u8x8(const uint8_t *p) {
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
ELP_INLINE void store_u16x8(void *p, v8u v) { /* every value fits: packus == truncation */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128((__m256i)v),
                                      _mm256_extracti128_si256((__m256i)v, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
ELP_INLINE v4d floor4(v4d s) { return (v4d)_mm256_floor_pd((__m256d)s); }
#else
ELP_INLINE v4d widen_lo(v8f y) { return (v4d){y[0], y[1], y[2], y[3]}; }
ELP_INLINE v4d widen_hi(v8f y) { return (v4d){y[4], y[5], y[6], y[7]}; }
ELP_INLINE v4l widen_mask_lo(v8i m) { return (v4l){m[0], m[1], m[2], m[3]}; }
ELP_INLINE v4l widen_mask_hi(v8i m) { return (v4l){m[4], m[5], m[6], m[7]}; }
ELP_INLINE v8f narrow(v4d lo, v4d hi) {
    return (v8f){(float)lo[0], (float)lo[1], (float)lo[2], (float)lo[3],
                 (float)hi[0], (float)hi[1], (float)hi[2], (float)hi[3]};
}
ELP_INLINE v8u load_u16x8(const void *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8u);
}
ELP_INLINE v8i load_u8x8(const uint8_t *p) {
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v8i);
}
ELP_INLINE void store_u16x8(void *p, v8u v) {
    v8h h = __builtin_convertvector(v, v8h);
    memcpy(p, &h, sizeof h);
}
ELP_INLINE v4d floor4(v4d s) { /* for 0 <= s < 2^52: nearest integer, then step down */
    v4d near = (s + 0x1p52) - 0x1p52;
    return near - and4((v4l)(near > s), splat4(1.0));
}
#endif

/* ------------------------------------------------------------------ 1. load and scale */

/* fp16 bits -> fp32, exact; a NaN comes out quiet, as the hardware conversion gives it. */
ELP_INLINE v8f half_to_float(v8u h) {
    v8u mag = h & 0x7FFF, sign = (h & 0x8000) << 16;
    v8u normal = (mag << 13) + 0x38000000u; /* exponent bias 15 -> 127 */
    v8u special = normal + 0x38000000u;     /* exponent 31 -> 255: inf, NaN */
    special |= (v8u)((v8i)(mag > 0x7C00u)) & 0x00400000u;
    v8f tiny = __builtin_convertvector(mag & 0x3FF, v8f) * 0x1p-24f; /* zero, subnormal */
    v8u exp = mag & 0x7C00;
    v8u out = (v8u)select8((v8i)(exp == 0), tiny, (v8f)normal);
    out = (v8u)select8((v8i)(exp == 0x7C00), (v8f)special, (v8f)out);
    return (v8f)(out | sign);
}

/* Eight logits from `p` as fp32 (exact widening). */
ELP_INLINE v8f load8(const void *p, const int dtype) {
    if (dtype == ELP_F32) {
        v8f v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    v8u u = load_u16x8(p);
    return dtype == ELP_BF16 ? (v8f)(u << 16) : half_to_float(u);
}

ELP_INLINE v8i load_keep8(const uint8_t *p) { return load_u8x8(p) != 0; }

/* ------------------------------------------------------------------ 3. contract exp */

/* Every step handles V4 vectors of four doubles (LANES columns) stage by stage across all
   of them, so that their long dependency chains (Horner, division) interleave: the loop is
   latency-bound otherwise. On Zen 3, V4 = 8 ran 8-13 % faster than 4 and about 25 %
   faster than 2; 12 and 16 gained nothing more. */
enum { V8 = 4, V4 = 2 * V8, LANES = 8 * V8 };

static const double exp2_table[1 << ELP_TABLE_BITS] = ELP_EXP2_TABLE;
static const double exp_poly[ELP_EXP_POLY_LEN] = ELP_EXP_POLY;

/* Four table entries. Four scalar loads: on the AMD Zen 3 this was tuned on they beat
   vgatherqpd by about 13 % in the partials pass. */
ELP_INLINE v4d gather4(const double *table, v4l j) {
    return (v4d){table[j[0]], table[j[1]], table[j[2]], table[j[3]]};
}

/* exp(d) for d in [CUTOFF, 0]: contract.exp_c, operation for operation. */
ELP_INLINE void exp_c(const v4d d[V4], v4d e[V4]) {
    v4d tm[V4], kd[V4], r[V4], p[V4];
    for (int i = 0; i < V4; ++i) tm[i] = d[i] * ELP_INV_LN2_32 + ELP_MAGIC;
    for (int i = 0; i < V4; ++i) kd[i] = tm[i] - ELP_MAGIC; /* rint_even(d / (ln2/32)) */
    for (int i = 0; i < V4; ++i) r[i] = (d[i] - kd[i] * ELP_LN2_32_HI) - kd[i] * ELP_LN2_32_LO;
    for (int i = 0; i < V4; ++i) p[i] = splat4(exp_poly[0]);
    for (int c = 1; c < ELP_EXP_POLY_LEN; ++c) /* Horner, no FMA */
        for (int i = 0; i < V4; ++i) p[i] = p[i] * r[i] + exp_poly[c];
    for (int i = 0; i < V4; ++i) {
        v4l k = (v4l)tm[i] - (v4l)splat4(ELP_MAGIC); /* the integer kd, from the bits */
        v4d tab = gather4(exp2_table, k & ((1 << ELP_TABLE_BITS) - 1));
        /* 2^(k >> TABLE_BITS) from its bits: k >= -2^12, so with the exponent bias (times
           the table size) added the value is >= 0 and a logical shift is the floor */
        v4ul biased = (v4ul)(k + (1023 << ELP_TABLE_BITS));
        e[i] = (tab * p[i]) * (v4d)((biased >> ELP_TABLE_BITS) << 52);
    }
}

/* ------------------------------------------------------------------ 4-5. quantize, sum */

/* Integer-valued doubles of at most 2^FRAC_BITS, V4 per lane and step: every partial sum
   stays <= 2^53, hence exact, for FLUSH_STEPS steps; then the lanes go to int64. */
enum { FLUSH_STEPS = (1 << (53 - ELP_FRAC_BITS)) / V4 };

typedef struct {
    v4d e_hi, e_lo, w_hi, w_lo;
    int64_t total[4]; /* flushed sums: E_HI, E_LO, W_HI, W_LO */
    v8i nonfinite;    /* minus the count, per lane */
} row_sums;

ELP_INLINE v4d exact_sum(const v4d v[V4]) { /* integer-valued, < 2^53: any order is exact */
    v4d acc = v[0];
    for (int i = 1; i < V4; ++i) acc += v[i];
    return acc;
}

/* contract.quantize of v in [0, 1]: hi = floor(v 2^42), lo = rint_even((v 2^42 - hi) 2^42),
   as integer-valued doubles, added to the lane sums. */
ELP_INLINE void quantize(const v4d v[V4], v4d hi[V4], v4d lo[V4]) {
    for (int i = 0; i < V4; ++i) {
        v4d s = v[i] * ELP_LIMB_SCALE;
        hi[i] = floor4(s); /* the contract truncates to int64: the same for s >= 0 */
        lo[i] = ((s - hi[i]) * ELP_LIMB_SCALE + ELP_MAGIC) - ELP_MAGIC;
    }
}

ELP_INLINE void quantize_add(const v4d v[V4], v4d *sum_hi, v4d *sum_lo) {
    v4d hi[V4], lo[V4];
    quantize(v, hi, lo);
    *sum_hi += exact_sum(hi);
    *sum_lo += exact_sum(lo);
}

ELP_INLINE int64_t lanes_total(v4d v) {
    return (int64_t)v[0] + (int64_t)v[1] + (int64_t)v[2] + (int64_t)v[3];
}

ELP_INLINE void flush(row_sums *s) {
    s->total[0] += lanes_total(s->e_hi);
    s->total[1] += lanes_total(s->e_lo);
    s->total[2] += lanes_total(s->w_hi);
    s->total[3] += lanes_total(s->w_lo);
    s->e_hi = s->e_lo = s->w_hi = s->w_lo = splat4(0.0);
}

/* ------------------------------------------------------------------ the element steps */

ELP_INLINE void widen(const v8f y8[V8], const v8i valid8[V8], v4d y[V4], v4l valid[V4]) {
    for (int q = 0; q < V8; ++q) {
        y[2 * q] = widen_lo(y8[q]);
        y[2 * q + 1] = widen_hi(y8[q]);
        valid[2 * q] = widen_mask_lo(valid8[q]);
        valid[2 * q + 1] = widen_mask_hi(valid8[q]);
    }
}

/* d = y - M; term = valid & CUTOFF <= d <= 0 (NaN, +-inf fail a compare); dz = term ? d : 0 */
ELP_INLINE void terms(const v4d y[V4], const v4l valid[V4], v4d m, v4l term[V4], v4d dz[V4]) {
    for (int i = 0; i < V4; ++i) {
        v4d d = y[i] - m;
        term[i] = valid[i] & (d >= ELP_CUTOFF) & (d <= 0.0);
        dz[i] = and4(term[i], d);
    }
}

/* e of LANES columns, +0 where a column is not a term, and dz (contract stages 2-3). */
ELP_INLINE void term_exps(const v8f y8[V8], const v8i valid8[V8], v4d m, v4d e[V4], v4d dz[V4]) {
    v4d y[V4];
    v4l valid[V4], term[V4];
    widen(y8, valid8, y, valid);
    terms(y, valid, m, term, dz);
    exp_c(dz, e);
    for (int i = 0; i < V4; ++i) e[i] = and4(term[i], e[i]);
}

/* Add LANES columns to the row sums (contract.partials). */
ELP_INLINE void partials_step(const v8f y8[V8], const v8i valid8[V8], v4d m, row_sums *s,
                              const int entropy) {
    v4d dz[V4], e[V4];
    term_exps(y8, valid8, m, e, dz);
    quantize_add(e, &s->e_hi, &s->e_lo);
    if (entropy) {
        v4d w[V4];
        for (int i = 0; i < V4; ++i) w[i] = e[i] * (-dz[i]);
        quantize_add(w, &s->w_hi, &s->w_lo);
    }
    for (int q = 0; q < V8; ++q) s->nonfinite += valid8[q] & ~(y8[q] < __builtin_inff());
}

typedef struct {
    v4d m, s_hi, s_lo, log_s, h, a, b, c, l, tau;
    int divide;
} grad_row;

/* What both gradient formulas need of LANES columns: e (+0 without a term), p = e / fl(S)
   and, with entropy, b q = b ((d - log S) + H). */
ELP_INLINE void grad_terms(const v8f y8[V8], const v8i valid8[V8], const grad_row *g,
                           const int entropy, v4d e[V4], v4d p[V4], v4d bq[V4]) {
    v4d dz[V4];
    term_exps(y8, valid8, g->m, e, dz);
    for (int i = 0; i < V4; ++i) {
        p[i] = e[i] / g->s_hi;
        if (entropy) bq[i] = g->b * ((dz[i] - g->log_s) + g->h);
    }
}

ELP_INLINE void finish_step(v4d out[V4], const grad_row *g, v8f out8[V8]) {
    for (int i = 0; i < V4; ++i)
        if (g->divide) out[i] = out[i] / g->tau;
    for (int q = 0; q < V8; ++q) out8[q] = narrow(out[2 * q], out[2 * q + 1]);
}

/* LANES gradients of columns that are not the target, in fp32 (contract.grad_block before
   the NaN rows and the cast to dtype): p * (a - b q), or p * a; +0 without a term (there
   term_exps leaves e = +0, and a term's e is at least exp(CUTOFF) > 0). */
ELP_INLINE void grad_step(const v8f y8[V8], const v8i valid8[V8], const grad_row *g,
                          const int entropy, v8f out8[V8]) {
    v4d e[V4], p[V4], bq[V4], out[V4];
    grad_terms(y8, valid8, g, entropy, e, p, bq);
    for (int i = 0; i < V4; ++i)
        out[i] = and4((v4l)(e[i] > 0.0), entropy ? p[i] * (g->a - bq[i]) : p[i] * g->a);
    finish_step(out, g, out8);
}

/* The target column's gradient (lane 0 of a step loaded at the target): c (1 - p_t) +
   p_t (l - b q_t), with 1 - p_t = ((s_hi - e_t) + s_lo) / s_hi from the exact S. */
ELP_INLINE void target_step(const v8f y8[V8], const v8i valid8[V8], const grad_row *g,
                            const int entropy, v8f out8[V8]) {
    v4d e[V4], p[V4], bq[V4], out[V4];
    grad_terms(y8, valid8, g, entropy, e, p, bq);
    for (int i = 0; i < V4; ++i) {
        v4d one_minus_p = ((g->s_hi - e[i]) + g->s_lo) / g->s_hi;
        out[i] = g->c * one_minus_p + (entropy ? p[i] * (g->l - bq[i]) : p[i] * g->l);
    }
    finish_step(out, g, out8);
}

/* ------------------------------------------------------------------ casts of the gradient */

ELP_INLINE v8u select8u(v8i m, v8u a, v8u b) { return (a & (v8u)m) | (b & ~(v8u)m); }
ELP_INLINE v8u splat8u(uint32_t v) { return (v8u){v, v, v, v, v, v, v, v}; }

/* fp32 -> bf16 bits, round to nearest even; every NaN becomes 0xFFFF, as torch's cast. */
ELP_INLINE v8u float_to_bf16(v8f f) {
    v8u u = (v8u)f;
    v8u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return select8u(f != f, splat8u(0xFFFF), rounded);
}

/* fp32 -> fp16 bits, round to nearest even, overflow to inf, NaN quiet with its sign. */
ELP_INLINE v8u float_to_half(v8f f) {
    v8u u = (v8u)f, mag = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
    /* normal results: rebias the exponent 127 -> 15 and round away 13 bits, ties to even;
       a carry moves into the exponent, and anything past 0x7C00 is an overflow to inf */
    v8u normal = ((mag - 0x38000000u) + 0xFFFu + ((mag >> 13) & 1u)) >> 13;
    normal = select8u((v8i)normal > 0x7C00, splat8u(0x7C00), normal);
    /* subnormal results, |f| < 2^-14: |f| 2^24 rounded to an integer by adding 2^23 */
    v8u tiny = (v8u)((v8f)mag * 0x1p24f + 0x1p23f) - 0x4B000000u;
    v8u nan = 0x7E00u | ((mag >> 13) & 0x1FFu);
    v8u out = select8u((v8i)mag < 0x38800000, tiny, normal);
    out = select8u((v8i)mag > 0x7F800000, nan, out);
    return out | sign;
}

/* Store eight fp32 values as `dtype`. */
ELP_INLINE void store8(void *p, v8f f, const int dtype) {
    if (dtype == ELP_F32) {
        memcpy(p, &f, sizeof f);
        return;
    }
    store_u16x8(p, dtype == ELP_BF16 ? float_to_bf16(f) : float_to_half(f));
}

/* ------------------------------------------------------------------ rows */

ELP_INLINE int64_t elem_size(const int dtype) { return dtype == ELP_F32 ? 4 : 2; }
ELP_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

ELP_INLINE v8i lanes_below(int64_t count) {
    v8i idx = {0, 1, 2, 3, 4, 5, 6, 7};
    int32_t c = count < 0 ? 0 : count > 8 ? 8 : (int32_t)count;
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
    v.x = (const char *)s->x + r * s->row_stride * elem_size(dtype);
    v.keep = s->keep ? s->keep + r * s->keep_stride : NULL;
    v.n_cols = s->n_cols;
    v.n_real = s->n_real;
    v.divide = s->tau_rows != NULL || s->tau != 1.0;
    v.tau32 = s->tau_rows ? s->tau_rows[r] : (float)s->tau;
    v.tau64 = s->tau_rows ? (double)s->tau_rows[r] : s->tau;
    return v;
}

/* y and validity (real and kept) of columns [j, j + LANES) of columns [0, end); a short
   last step goes through a zeroed buffer and its missing lanes are invalid. */
ELP_INLINE void load_step(const row_view *v, int64_t j, int64_t end, const int dtype,
                          v8f y[V8], v8i valid[V8]) {
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
        v8i ok = lanes_below(real - 8 * q);
        valid[q] = pk ? ok & load_keep8(pk + 8 * q) : ok;
        v8f x = load8(px + 8 * q * es, dtype);
        y[q] = v->divide ? x / splat8(v->tau32) : x; /* stage 1: fp32 division */
    }
}

/* --- 2. row max over the real, kept columns; NaN and +inf do not take part --- */

ELP_INLINE float row_max_row(const elp_shard *s, int64_t r, const int dtype) {
    row_view v = row_of(s, r, dtype);
    v8f best[V8];
    for (int q = 0; q < V8; ++q) best[q] = splat8(-__builtin_inff());
    for (int64_t j = 0; j < v.n_real; j += LANES) {
        v8f y[V8];
        v8i valid[V8];
        load_step(&v, j, v.n_real, dtype, y, valid);
        for (int q = 0; q < V8; ++q) {
            v8f cand = select8(valid[q] & (y[q] < __builtin_inff()), y[q],
                               splat8(-__builtin_inff()));
            best[q] = select8(cand > best[q], cand, best[q]);
        }
    }
    float out = -__builtin_inff();
    for (int q = 0; q < V8; ++q)
        for (int i = 0; i < 8; ++i) out = best[q][i] > out ? best[q][i] : out;
    return out;
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
        v8f y[V8];
        v8i valid[V8];
        load_step(v, t, t + 1, dtype, y, valid);
        int32_t bits;
        memcpy(&bits, &y[0][0], sizeof bits);
        out[ELP_COL_TARGET_BITS] = bits; /* sign-extended, as int32 -> int64 */
        out[ELP_COL_OWNERS] = 1;
        out[ELP_COL_TARGET_MASKED] = v->keep != NULL && !v->keep[t];
    }
}

ELP_INLINE void partials_row(const elp_shard *s, const float *row_max, const int64_t *target_col,
                             int64_t *record, int64_t r, const int dtype, const int entropy) {
    row_view v = row_of(s, r, dtype);
    v4d m = splat4((double)row_max[r]);
    row_sums sums;
    memset(&sums, 0, sizeof sums);
    int64_t steps = 0;
    for (int64_t j = 0; j < v.n_real; j += LANES) {
        v8f y[V8];
        v8i valid[V8];
        load_step(&v, j, v.n_real, dtype, y, valid);
        partials_step(y, valid, m, &sums, entropy);
        if (++steps == FLUSH_STEPS) {
            flush(&sums);
            steps = 0;
        }
    }
    flush(&sums);
    uint64_t total[4];
    for (int i = 0; i < 4; ++i) total[i] = (uint64_t)sums.total[i];
    int64_t nonfinite = 0;
    for (int i = 0; i < 8; ++i) nonfinite -= sums.nonfinite[i];
    write_record(record + r * ELP_NUM_COLS, &v, total, nonfinite, target_col[r], dtype);
}

/* --- backward --- */

ELP_INLINE grad_row grad_row_of(const elp_grad_stats *st, const row_view *v, int64_t r) {
    grad_row g;
    g.m = splat4((double)st->row_max[r]);
    g.s_hi = splat4(st->s_hi[r]);
    g.s_lo = splat4(st->s_lo[r]);
    g.log_s = splat4(st->log_s[r]);
    g.h = splat4(st->entropy64[r]);
    g.a = splat4(st->coef_a[r]);
    g.b = splat4(st->coef_b[r]);
    g.c = splat4(st->coef_t[r]);
    g.l = splat4(st->coef_l[r]);
    g.tau = splat4(v->tau64);
    g.divide = v->divide;
    return g;
}


/* Store the first `count` of LANES fp32 values as `dtype`. */
ELP_INLINE void store_step(char *p, const v8f f[V8], int64_t count, const int dtype) {
    int64_t es = elem_size(dtype);
    if (count == LANES) {
        for (int q = 0; q < V8; ++q) store8(p + 8 * q * es, f[q], dtype);
        return;
    }
    char buf[LANES * 4];
    for (int q = 0; q < V8; ++q) store8(buf + 8 * q * es, f[q], dtype);
    memcpy(p, buf, count * es);
}

/* The target column t (owned here) overwritten with its own formula. */
ELP_INLINE void grad_target(const row_view *v, const grad_row *g, int64_t t, char *out,
                            const int dtype, const int entropy) {
    v8f y[V8], f[V8];
    v8i valid[V8];
    load_step(v, t, t + 1, dtype, y, valid);
    target_step(y, valid, g, entropy, f);
    store_step(out + t * elem_size(dtype), f, 1, dtype);
}

/* A row flagged NaN gets NaN in every column, cast like any other value. */
ELP_INLINE void nan_row(char *out, int64_t n, const int dtype) {
    int64_t es = elem_size(dtype);
    v8f nan[V8];
    for (int q = 0; q < V8; ++q) nan[q] = narrow(splat4(__builtin_nan("")), splat4(__builtin_nan("")));
    for (int64_t j = 0; j < n; j += LANES) store_step(out + j * es, nan, min64(LANES, n - j), dtype);
}

ELP_INLINE void grad_row_fn(const elp_shard *s, const elp_grad_stats *st, char *out, int64_t r,
                            const int dtype, const int entropy) {
    int64_t es = elem_size(dtype), n = s->n_cols;
    row_view v = row_of(s, r, dtype);
    grad_row g = grad_row_of(st, &v, r);
    for (int64_t j = 0; j < n; j += LANES) { /* padding columns too: they get 0 / tau */
        v8f y[V8], f[V8];
        v8i valid[V8];
        load_step(&v, j, n, dtype, y, valid);
        grad_step(y, valid, &g, entropy, f);
        store_step(out + j * es, f, min64(LANES, n - j), dtype);
    }
    if (st->target_col[r] >= 0) grad_target(&v, &g, st->target_col[r], out, dtype, entropy);
}

/* ------------------------------------------------------------------ value tables */

/* 16-bit logits take at most 65536 values, and a row of an LLM's logits only a few
   thousand of them (bf16 has 128 values per binade and sign). Once the row is fixed (M,
   tau, the backward statistics), every per-column quantity of the contract -- term, e, w,
   the non-finite flag, the gradient -- is a function of the column's value alone. So on
   long rows the kernels evaluate the contract once per distinct value:
     partials: count each value's columns; the limb sums over columns equal the sums over
       values of count * limb, the same integers (integer addition is exact in any order);
     grad: each column gets its value's gradient from a table filled on first sight; the
       target column, whose formula differs, is computed on its own afterwards.
   The element functions are the ones of the direct loops, so the bits are too. */
enum { N_VALUES = 1 << 16, FIX_CAP = 4096 };

/* Per-thread scratch. `slot` is all-zero between rows: partials keeps counts in it, grad
   its table (FILLED | gradient bits, or PENDING while a value waits for its batch). */
typedef struct {
    uint32_t slot[N_VALUES];
    uint16_t done[N_VALUES]; /* grad: the values whose slots this row set */
    int64_t fix[FIX_CAP];    /* grad: columns stored before their value was computed */
} value_scratch;

enum { FILLED = 1u << 16, PENDING = 1u << 17 };

ELP_INLINE int wants_tables(const elp_shard *s) { /* counts are uint32 */
    return s->dtype != ELP_F32 && s->table_min_cols >= 0 && s->n_real >= s->table_min_cols &&
           s->n_real < ((int64_t)1 << 32);
}

/* The row view of `n` <= LANES distinct values: no keep mask, every value real. */
ELP_INLINE row_view values_view(const row_view *v, const uint16_t *vals, int64_t n) {
    row_view w = *v;
    w.x = (const char *)vals;
    w.keep = NULL;
    w.n_cols = w.n_real = n;
    return w;
}

/* Add count[i] times value i's limbs and non-finite flag to the row's sums. */
ELP_INLINE void partials_values(const row_view *v, const uint16_t vals[LANES],
                                const uint32_t cnt[LANES], int64_t n, v4d m, uint64_t total[4],
                                int64_t *nonfinite, const int dtype, const int entropy) {
    row_view w = values_view(v, vals, n);
    v8f y8[V8];
    v8i valid8[V8];
    load_step(&w, 0, n, dtype, y8, valid8);
    v4d dz[V4], e[V4], eq[2][V4], wq[2][V4];
    term_exps(y8, valid8, m, e, dz);
    quantize(e, eq[0], eq[1]);
    if (entropy) {
        v4d wv[V4];
        for (int i = 0; i < V4; ++i) wv[i] = e[i] * (-dz[i]);
        quantize(wv, wq[0], wq[1]);
    }
    for (int64_t c = 0; c < n; ++c) { /* lane c % 4 of vector c / 4 holds value c */
        uint64_t k = cnt[c];
        total[0] += k * (uint64_t)(int64_t)eq[0][c / 4][c % 4];
        total[1] += k * (uint64_t)(int64_t)eq[1][c / 4][c % 4];
        if (entropy) {
            total[2] += k * (uint64_t)(int64_t)wq[0][c / 4][c % 4];
            total[3] += k * (uint64_t)(int64_t)wq[1][c / 4][c % 4];
        }
        *nonfinite += (int64_t)k * (valid8[c / 8][c % 8] & !(y8[c / 8][c % 8] < __builtin_inff()));
    }
}

ELP_INLINE int any_nonzero(const void *p) { /* 32 bytes */
    uint64_t w[4];
    memcpy(w, p, sizeof w);
    return (w[0] | w[1] | w[2] | w[3]) != 0;
}

ELP_INLINE void partials_row_table(const elp_shard *s, const float *row_max,
                                   const int64_t *target_col, int64_t *record, int64_t r,
                                   const int dtype, const int entropy, value_scratch *sc) {
    row_view v = row_of(s, r, dtype);
    const uint16_t *x = (const uint16_t *)v.x;
    uint32_t *count = sc->slot;
    if (v.keep)
        for (int64_t j = 0; j < v.n_real; ++j) count[x[j]] += v.keep[j] != 0;
    else
        for (int64_t j = 0; j < v.n_real; ++j) ++count[x[j]];

    v4d m = splat4((double)row_max[r]);
    uint64_t total[4] = {0, 0, 0, 0};
    int64_t nonfinite = 0, n = 0;
    uint16_t vals[LANES];
    uint32_t cnt[LANES];
    for (int64_t b = 0; b < N_VALUES; b += 8) { /* in value order, clearing as it goes */
        if (!any_nonzero(count + b)) continue;
        for (int64_t i = b; i < b + 8; ++i) {
            if (!count[i]) continue;
            vals[n] = (uint16_t)i;
            cnt[n] = count[i];
            count[i] = 0;
            if (++n == LANES) {
                partials_values(&v, vals, cnt, n, m, total, &nonfinite, dtype, entropy);
                n = 0;
            }
        }
    }
    if (n) partials_values(&v, vals, cnt, n, m, total, &nonfinite, dtype, entropy);
    write_record(record + r * ELP_NUM_COLS, &v, total, nonfinite, target_col[r], dtype);
}

/* slot[vals[i]] = FILLED | the gradient bits of a non-target column holding vals[i]. */
ELP_INLINE void grad_values(const row_view *v, const grad_row *g, const uint16_t *vals,
                            int64_t n, uint32_t *slot, const int dtype, const int entropy) {
    row_view w = values_view(v, vals, n);
    v8f y[V8], f[V8];
    v8i valid[V8];
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
        v8f y[V8], f[V8];
        v8i none[V8];
        for (int q = 0; q < V8; ++q) y[q] = splat8(0.0f), none[q] = (v8i){0};
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

    if (st->target_col[r] >= 0) grad_target(&v, &g, st->target_col[r], out, dtype, entropy);
}

/* ------------------------------------------------------------------ variants */

/* Each pass is compiled once per logits dtype and entropy flag, so that the row loop
   carries no run-time switch on them; `variant` packs them as dtype * 2 + entropy. */
#define ELP_VARIANTS(X) X(0) X(1) X(2) X(3) X(4) X(5)

typedef struct {
    const elp_shard *s;
    const float *row_max;
    const int64_t *target_col;
    const elp_grad_stats *stats;
    void *out;
    int variant;
    int wants_scratch; /* each thread gets a value_scratch (NULL if it cannot): the rows
                          take the value-table path */
} elp_job;

ELP_INLINE void row_max_with(const elp_job *job, int64_t r, void *scratch, const int dtype,
                             const int entropy) {
    (void)scratch, (void)entropy; /* not a variant of this pass */
    ((float *)job->out)[r] = row_max_row(job->s, r, dtype);
}

ELP_INLINE void partials_with(const elp_job *job, int64_t r, void *scratch, const int dtype,
                              const int entropy) {
    if (dtype != ELP_F32 && scratch)
        partials_row_table(job->s, job->row_max, job->target_col, job->out, r, dtype, entropy,
                           scratch);
    else
        partials_row(job->s, job->row_max, job->target_col, job->out, r, dtype, entropy);
}

ELP_INLINE void grad_with(const elp_job *job, int64_t r, void *scratch, const int dtype,
                          const int entropy) {
    const elp_shard *s = job->s;
    char *out = (char *)job->out + r * s->n_cols * elem_size(dtype);
    if (job->stats->row_nan[r])
        nan_row(out, s->n_cols, dtype);
    else if (dtype != ELP_F32 && scratch)
        grad_row_table(s, job->stats, out, r, dtype, entropy, scratch);
    else
        grad_row_fn(s, job->stats, out, r, dtype, entropy);
}

#define ELP_CASE(fn, v)                                                              \
    case v:                                                                          \
        for (int64_t r = r0; r < r1; ++r) fn(job, r, scratch, (v) >> 1, (v) & 1);    \
        break;
#define ELP_CASE_row_max(v) ELP_CASE(row_max_with, v)
#define ELP_CASE_partials(v) ELP_CASE(partials_with, v)
#define ELP_CASE_grad(v) ELP_CASE(grad_with, v)
#define ELP_ROWS(pass, variants)                                                          \
    static void pass##_rows(const elp_job *job, int64_t r0, int64_t r1, void *scratch) { \
        switch (job->variant) { variants(ELP_CASE_##pass) }                              \
    }

#define ELP_NO_ENTROPY(X) X(0) X(2) X(4)
ELP_ROWS(row_max, ELP_NO_ENTROPY)
ELP_ROWS(partials, ELP_VARIANTS)
ELP_ROWS(grad, ELP_VARIANTS)

/* ------------------------------------------------------------------ threads */

typedef void (*rows_fn)(const elp_job *job, int64_t r0, int64_t r1, void *scratch);

typedef struct {
    rows_fn fn;
    const elp_job *job;
    int64_t n_rows, grab;
    int64_t next; /* next row to hand out, taken atomically */
} elp_work;

static void *worker(void *arg) {
    elp_work *w = arg;
    /* zeroed once; every row leaves it zeroed again. Without it the rows take the direct
       loops, which give the same bits. */
    void *scratch = w->job->wants_scratch ? calloc(1, sizeof(value_scratch)) : NULL;
    for (;;) {
        int64_t r0 = __atomic_fetch_add(&w->next, w->grab, __ATOMIC_RELAXED);
        if (r0 >= w->n_rows) break;
        w->fn(w->job, r0, min64(r0 + w->grab, w->n_rows), scratch);
    }
    free(scratch);
    return NULL;
}

enum { MAX_THREADS = 256, ROW_GRAB_ELEMENTS = 1 << 14 };

/* Rows are handed out a few at a time to whichever thread is free; each row is computed
   whole by one thread, so the bits never depend on the thread count. */
static void run_rows(rows_fn fn, const elp_job *job) {
    const elp_shard *s = job->s;
    if (s->n_rows == 0) return;
    int64_t threads = s->num_threads < 1 ? 1 : s->num_threads;
    threads = min64(min64(threads, MAX_THREADS), s->n_rows);
    int64_t grab = ROW_GRAB_ELEMENTS / (s->n_cols > 0 ? s->n_cols : 1);
    grab = min64(grab < 1 ? 1 : grab, (s->n_rows + 4 * threads - 1) / (4 * threads));
    elp_work w = {fn, job, s->n_rows, grab < 1 ? 1 : grab, 0};
    pthread_t tid[MAX_THREADS];
    int started = 0;
    for (int64_t i = 1; i < threads; ++i)
        if (pthread_create(&tid[started], NULL, worker, &w) == 0) ++started;
    worker(&w); /* the caller works too; a thread that failed to start is not needed */
    for (int i = 0; i < started; ++i) pthread_join(tid[i], NULL);
}

/* ------------------------------------------------------------------ exported */

static int variant_of(const elp_shard *s, int entropy) { return s->dtype * 2 + (entropy != 0); }

static int bad_shard(const elp_shard *s) {
    return s->dtype < ELP_F32 || s->dtype > ELP_F16 || s->n_rows < 0 || s->n_cols < 0 ||
           s->n_real < 0 || s->n_real > s->n_cols;
}

/* out[n_rows] fp32. Returns 0, or -1 for an invalid shard description. */
int elp_row_max(const elp_shard *s, float *out) {
    if (bad_shard(s)) return -1;
    elp_job job = {s, NULL, NULL, NULL, out, variant_of(s, 0), 0};
    run_rows(row_max_rows, &job);
    return 0;
}

/* record[n_rows, ELP_NUM_COLS] int64, every entry written. */
int elp_partials(const elp_shard *s, const float *row_max, const int64_t *target_col,
                 int32_t with_entropy, int64_t *record) {
    if (bad_shard(s)) return -1;
    elp_job job = {s, row_max, target_col, NULL, record, variant_of(s, with_entropy),
                   wants_tables(s)};
    run_rows(partials_rows, &job);
    return 0;
}

/* Ask for transparent huge pages on a fresh output buffer before its first write: the
   gradient is as large as the logits, and faulting it in 4 KiB pages costs more than
   computing it on small VMs. Only whole 2 MiB pages inside the buffer are affected; a
   kernel without THP ignores the hint. */
static void prefer_huge_pages(void *p, size_t bytes) {
#if defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1), hi = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* out[n_rows, n_cols] in the logits' dtype, contiguous. */
int elp_grad(const elp_shard *s, const elp_grad_stats *stats, int32_t with_entropy, void *out) {
    if (bad_shard(s)) return -1;
    prefer_huge_pages(out, (size_t)(s->n_rows * s->n_cols * (s->dtype == ELP_F32 ? 4 : 2)));
    elp_job job = {s, NULL, NULL, stats, out, variant_of(s, with_entropy),
                   wants_tables(s)};
    run_rows(grad_rows, &job);
    return 0;
}

/* The contract constants as this library uses them, in the order of
   cpu_build.compiled_constant_names(); returns how many there are. */
int elp_constants(double *out, int capacity) {
    double v[128];
    int n = 0;
    v[n++] = ELP_CUTOFF;
    v[n++] = ELP_MAGIC;
    v[n++] = ELP_LIMB_SCALE;
    v[n++] = ELP_INV_LN2_32;
    v[n++] = ELP_LN2_32_HI;
    v[n++] = ELP_LN2_32_LO;
    for (int i = 0; i < (1 << ELP_TABLE_BITS); ++i) v[n++] = exp2_table[i];
    for (int i = 0; i < ELP_EXP_POLY_LEN; ++i) v[n++] = exp_poly[i];
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
    for (int i = 0; i < n && i < capacity; ++i) out[i] = v[i];
    return n;
}

/* 1 when this library was compiled for AVX2. */
int elp_uses_avx2(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
