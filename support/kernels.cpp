// support/kernels.cpp: fused CPU kernels for a bf16 forward without gradients (embed.py, evaluate_sts.py), built
// once a machine by support/kernels.py with the system's C++ compiler; torch's operations run wherever they are not.
// Between the dense products of all-MiniLM-L6-v2 on 2,048 tokens, torch's CPU operations make one pass over a batch
// each: q, k and v copied head-major, q k^T, the mask, the softmax, a cast, p v, the heads put back, then the
// residual add, LayerNorm and a cast, twice a layer (docs/measurements.md, issue 55's fifth round). Here each is one:
//   attention_rows  softmax(q k^T / sqrt(hd)) v for rows of up to 64 tokens, read from the q|k|v product as it is
//   add_layer_norm  LayerNorm(x + y) in fp32, rounded to bf16: the residual stream and the next product's input
//   gelu_bf16       GELU in place on the feed-forward's bf16 up product, a cheaper pass than oneDNN's inside it
// Portable C++ with GCC/Clang vector types (AVX-512, AVX2 or NEON as -march=native gives); bf16 is handled as its
// 16 bits (the top half of an fp32), rounded to nearest even as torch rounds it (but for results below fp32's
// smallest normal, which AVX512-BF16's conversion makes zero); every sum is in fp32.
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));   // 16 fp32 lanes
typedef int32_t i16v __attribute__((vector_size(64)));
static const int QB = 4;  // queries at a time in p v: independent chains of multiply-adds
static const int KB = 4;  // keys at a time in q k^T

static inline v16 splat(float x) { return v16{} + x; }
static inline v16 vmax(v16 a, v16 b) {  // a > b ? a : b, one instruction where the compiler will not make it one
#ifdef __AVX512F__
    return (v16)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return a > b ? a : b;
#endif
}
static inline v16 vmin(v16 a, v16 b) {  // a < b ? a : b
#ifdef __AVX512F__
    return (v16)_mm512_min_ps((__m512)a, (__m512)b);
#else
    return a < b ? a : b;
#endif
}

static inline v16 load16(const uint16_t *p) {  // 16 bf16 -> fp32
    uint32_t u[16];
    for (int l = 0; l < 16; l++) u[l] = (uint32_t)p[l] << 16;
    v16 r;
    std::memcpy(&r, u, 64);
    return r;
}

static inline void store16(uint16_t *p, v16 x) {  // 16 fp32 -> bf16, to nearest even (finite values)
#ifdef __AVX512BF16__  // one instruction where the processor has it (every CPU that runs bf16 here: AVX512-BF16 or AMX)
    __m256bh r = _mm512_cvtneps_pbh((__m512)x);
    std::memcpy(p, &r, 32);
#else
    uint32_t u[16];
    std::memcpy(u, &x, 64);
    for (int l = 0; l < 16; l++) p[l] = (uint16_t)((u[l] + 0x7FFFu + ((u[l] >> 16) & 1u)) >> 16);
#endif
}

static inline float hsum(v16 x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

// exp(x) for x <= 0: 2^n exp(r), |r| <= ln2/2, exp(r) by its series to r^6 (relative error about 2e-7); below -87,
// where fp32 runs out, exp(-87) (a masked key's weight: 1e-38 against a sum of at least 1)
static inline v16 vexp(v16 x) {
    x = vmax(splat(-87.f), x);  // a NaN stays one
    v16 t = x * 1.44269504f + 0.5f;
    v16 n = __builtin_convertvector(__builtin_convertvector(t, i16v), v16);
    n = n > t ? n - 1.f : n;  // floor(t): the conversion rounds toward zero
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts, so that r is exact
    v16 p = splat(1.f / 720);
    p = p * r + 1.f / 120, p = p * r + 1.f / 24, p = p * r + 1.f / 6, p = p * r + 0.5f, p = p * r + 1.f;
    p = p * r + 1.f;
    i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;  // 2^n
    v16 scale;
    std::memcpy(&scale, &bits, 64);
    return p * scale;
}

// One (row, head): T queries, the first L keys. Queries lie along the vectors' lanes, NB blocks of 16, so that the
// softmax over a query's keys is one vector operation a key for 16 queries at once, with no sums across lanes;
// HV vectors of 16 make a head. Q, K, V: the row's first token's q, k, v of this head, W apart from token to token.
template <int NB, int HV>
static void head(const uint16_t *Q, const uint16_t *K, const uint16_t *V, uint16_t *Y, int64_t W, int64_t H,
                 int64_t T, int64_t L, float scale) {
    const int HD = 16 * HV;
    v16 qt[NB * HD], vv[NB * 16 * HV], s[NB * 16 * NB], inv[NB];
    float kf[NB * 16][HD];
    // Queries transposed and scaled: two dimensions of a query are 32 bits, read 16 queries at a time (past T: the
    // last query again, whose scores are never written)
    const uint32_t *Q32 = (const uint32_t *)Q;
    for (int nb = 0; nb < NB; nb++) {
        int32_t at[16];
        for (int l = 0; l < 16; l++) at[l] = (int32_t)((nb * 16 + l < T ? nb * 16 + l : T - 1) * (W / 2));
        for (int m = 0; m < HD / 2; m++) {
            uint32_t pair[16], even[16], odd[16];
            for (int l = 0; l < 16; l++) pair[l] = Q32[at[l] + m];
            for (int l = 0; l < 16; l++) even[l] = pair[l] << 16, odd[l] = pair[l] & 0xFFFF0000u;
            std::memcpy(&qt[nb * HD + 2 * m], even, 64);
            std::memcpy(&qt[nb * HD + 2 * m + 1], odd, 64);
            qt[nb * HD + 2 * m] *= scale, qt[nb * HD + 2 * m + 1] *= scale;
        }
    }
    // Keys and values in fp32
    for (int64_t j = 0; j < L; j++)
        for (int c = 0; c < HV; c++) {
            v16 k = load16(K + j * W + 16 * c);
            std::memcpy(kf[j] + 16 * c, &k, 64);
            vv[j * HV + c] = load16(V + j * W + 16 * c);
        }
    // Scores, KB keys at a time: s[j * NB + nb] is key j's score for queries nb*16 .. nb*16+15
    for (int64_t j0 = 0; j0 < L; j0 += KB)
        for (int nb = 0; nb < NB; nb++) {
            v16 acc[KB];
            const float *k[KB];
            for (int kk = 0; kk < KB; kk++) acc[kk] = v16{}, k[kk] = kf[j0 + kk < L ? j0 + kk : L - 1];
            for (int d = 0; d < HD; d++)
                for (int kk = 0; kk < KB; kk++) acc[kk] += k[kk][d] * qt[nb * HD + d];
            for (int kk = 0; kk < KB && j0 + kk < L; kk++) s[(j0 + kk) * NB + nb] = acc[kk];
        }
    // Softmax over the keys, 16 queries a vector; the division waits for the output
    for (int nb = 0; nb < NB; nb++) {
        v16 m = s[nb], total = v16{};
        for (int64_t j = 1; j < L; j++) m = vmax(m, s[j * NB + nb]);
        for (int64_t j = 0; j < L; j++) s[j * NB + nb] = vexp(s[j * NB + nb] - m), total += s[j * NB + nb];
        inv[nb] = 1.f / total;
    }
    // p v, QB queries at a time, each output rounded once
    for (int64_t i0 = 0; i0 < T; i0 += QB) {
        v16 o[QB][HV];
        for (int qi = 0; qi < QB; qi++)
            for (int c = 0; c < HV; c++) o[qi][c] = v16{};
        for (int64_t j = 0; j < L; j++)
            for (int qi = 0; qi < QB; qi++) {
                int64_t i = i0 + qi < T ? i0 + qi : T - 1;
                float p = s[j * NB + i / 16][i % 16];
                for (int c = 0; c < HV; c++) o[qi][c] += p * vv[j * HV + c];
            }
        for (int qi = 0; qi < QB && i0 + qi < T; qi++) {
            int64_t i = i0 + qi;
            for (int c = 0; c < HV; c++) store16(Y + i * H + 16 * c, o[qi][c] * inv[i / 16][i % 16]);
        }
    }
}

template <int NB, int HV>
static void rows(const uint16_t *qkv, uint16_t *y, const int64_t *lengths, int64_t B, int64_t T, int64_t nh,
                 float scale) {
    const int64_t H = nh * 16 * HV, W = 3 * H;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++) {
            const uint16_t *at = qkv + b * T * W + h * 16 * HV;
            head<NB, HV>(at, at + H, at + 2 * H, y + b * T * H + h * 16 * HV, W, H, T, lengths[b], scale);
        }
}

// qkv: (B*T, 3*nh*hd) bf16, each token's q, k, v side by side (one product's output); row b's keys are its first
// lengths[b] (1 <= lengths[b] <= T); y: (B*T, nh*hd) bf16, heads side by side. 0, or 1 for a shape not built here.
extern "C" int attention_rows(const uint16_t *qkv, uint16_t *y, const int64_t *lengths, int64_t B, int64_t T,
                              int64_t nh, int64_t hd, float scale) {
    int nb = (int)((T + 15) / 16);
#define SHAPE(NB, HV) \
    if (nb == NB && hd == 16 * HV) return rows<NB, HV>(qkv, y, lengths, B, T, nh, scale), 0;
    SHAPE(1, 2) SHAPE(2, 2) SHAPE(3, 2) SHAPE(4, 2) SHAPE(1, 4) SHAPE(2, 4) SHAPE(3, 4) SHAPE(4, 4)
    return 1;
}

static inline v16 load16(const float *p) {  // 16 fp32
    v16 r;
    std::memcpy(&r, p, 64);
    return r;
}

// out = LayerNorm(x + y) over rows of H, rounded to bf16: x fp32 (the embeddings' output) or bf16 (a layer's, this
// kernel's own), y bf16, gamma and beta fp32. The residual stream stays in bf16 between layers: half the bytes of a
// pass that memory bounds, and no further rounding for the next product, which reads bf16.
template <typename X>
static int add_norm_rows(const X *x, const uint16_t *y, const float *gamma, const float *beta, float eps,
                         uint16_t *out, int64_t N, int64_t H) {
    const int64_t HV = H / 16;
    if (H % 16 || HV > 256) return 1;
    v16 t[256];
    for (int64_t n = 0; n < N; n++) {
        v16 sum = v16{}, squares = v16{};
        for (int64_t c = 0; c < HV; c++) t[c] = load16(x + n * H + 16 * c) + load16(y + n * H + 16 * c), sum += t[c];
        v16 mean = splat(hsum(sum) / H);
        for (int64_t c = 0; c < HV; c++) squares += (t[c] - mean) * (t[c] - mean);
        v16 r = splat(1.f / std::sqrt(hsum(squares) / H + eps));
        for (int64_t c = 0; c < HV; c++) {
            v16 g, b;
            std::memcpy(&g, gamma + 16 * c, 64), std::memcpy(&b, beta + 16 * c, 64);
            store16(out + n * H + 16 * c, (t[c] - mean) * r * g + b);
        }
    }
    return 0;
}

// x_bf16: whether x is bf16 (else fp32). 0, or 1 for an H not built here.
extern "C" int add_layer_norm(const void *x, int x_bf16, const uint16_t *y, const float *gamma, const float *beta,
                              float eps, uint16_t *out, int64_t N, int64_t H) {
    return x_bf16 ? add_norm_rows((const uint16_t *)x, y, gamma, beta, eps, out, N, H)
                  : add_norm_rows((const float *)x, y, gamma, beta, eps, out, N, H);
}

// GELU(x) = x Phi(x), Phi the normal distribution: Phi(x) - 1/2 an odd polynomial of degree 15 on [-4, 4], fitted
// to the least largest error under Phi(+-4) = 1 and 0 exactly, and x clamped there: within 3.3e-5 of Phi everywhere
// (Phi(-4) itself is 3.2e-5), 16 vector instructions for 16 values, bound by memory: the product with it 2.52 ms
// against 3.28 with oneDNN's erf inside (2,048 x 1,536, one thread, support/device.py). x is bf16, the product's
// rounding: GELU of what torch's autocast would hand it.
static inline v16 gelu16(v16 x) {
    v16 c = vmin(vmax(x, splat(-4.f)), splat(4.f));  // a NaN x: -4, and x Phi(x) is NaN again
    v16 z = c * c, p = splat(-1.258268813e-09f);
    p = p * z + 1.032600753e-07f, p = p * z - 3.681293296e-06f, p = p * z + 7.584552598e-05f;
    p = p * z - 1.018805312e-03f, p = p * z + 9.573936235e-03f, p = p * z - 6.605320570e-02f;
    p = p * z + 3.988009576e-01f;
    return x * (c * p + 0.5f);
}

extern "C" int gelu_bf16(uint16_t *x, int64_t n) {
    int64_t whole = n - n % 16;
    for (int64_t i = 0; i < whole; i += 16) store16(x + i, gelu16(load16(x + i)));
    if (whole < n) {  // the last few, through a vector's worth of zeros
        uint16_t tail[16] = {};
        std::memcpy(tail, x + whole, 2 * (n - whole));
        store16(tail, gelu16(load16(tail)));
        std::memcpy(x + whole, tail, 2 * (n - whole));
    }
    return 0;
}
