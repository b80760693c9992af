/* The daemon's encode loops in one pass each: XOR against a reference fused with the
 * byte-plane split, and the AdamW predictions. Each produces exactly the bytes of its
 * numpy counterpart in codecs.py and predict.py (tests/test_native_kernels.py checks
 * both, NaN payloads included); those remain the fallback where this did not build.
 *
 * Floating point: plain float32 operations in numpy's order, built with
 * -ffp-contract=off (no fused multiply-add) and without -ffast-math, so every
 * operation rounds as IEEE 754 says and as numpy's loops do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

typedef struct { int64_t start, size, elem; } region_t;

/* The one NaN a prediction yields (ADAM_PREDICTED_XOR_ZSTD_V2): IEEE 754 leaves open
 * which payload an operation on two NaNs keeps, and implementations differ. */
static inline float one_nan(float x)
{
    const uint32_t quiet = 0x7FC00000u;
    float nan;
    memcpy(&nan, &quiet, sizeof nan);
    return x != x ? nan : x;
}

/* Byte k of each of n e-byte elements of x = src ^ ref (ref NULL: x = src) goes to
 * out[k * n + i]; a whole number of elements, tail handled by the caller. */
static void split(const uint8_t *src, const uint8_t *ref, uint8_t *out, int64_t n, int64_t e)
{
    if (e == 4) {
        uint8_t *p0 = out, *p1 = out + n, *p2 = out + 2 * n, *p3 = out + 3 * n;
        int64_t i = 0;
#ifdef __SSE2__
        /* 16 elements at a time: three rounds of byte interleaves gather each byte of
         * 8 elements, a 64-bit interleave joins the two halves of each plane. */
        for (; i + 16 <= n; i += 16) {
            __m128i x[4];
            for (int j = 0; j < 4; j++) {
                x[j] = _mm_loadu_si128((const __m128i *)(src + 4 * i + 16 * j));
                if (ref)
                    x[j] = _mm_xor_si128(x[j], _mm_loadu_si128((const __m128i *)(ref + 4 * i + 16 * j)));
            }
            __m128i y0 = _mm_unpacklo_epi8(x[0], x[1]), y1 = _mm_unpackhi_epi8(x[0], x[1]);
            __m128i y2 = _mm_unpacklo_epi8(x[2], x[3]), y3 = _mm_unpackhi_epi8(x[2], x[3]);
            __m128i z0 = _mm_unpacklo_epi8(y0, y1), z1 = _mm_unpackhi_epi8(y0, y1);
            __m128i z2 = _mm_unpacklo_epi8(y2, y3), z3 = _mm_unpackhi_epi8(y2, y3);
            __m128i w0 = _mm_unpacklo_epi8(z0, z1), w1 = _mm_unpackhi_epi8(z0, z1);
            __m128i w2 = _mm_unpacklo_epi8(z2, z3), w3 = _mm_unpackhi_epi8(z2, z3);
            _mm_storeu_si128((__m128i *)(p0 + i), _mm_unpacklo_epi64(w0, w2));
            _mm_storeu_si128((__m128i *)(p1 + i), _mm_unpackhi_epi64(w0, w2));
            _mm_storeu_si128((__m128i *)(p2 + i), _mm_unpacklo_epi64(w1, w3));
            _mm_storeu_si128((__m128i *)(p3 + i), _mm_unpackhi_epi64(w1, w3));
        }
#endif
        for (; i < n; i++) {
            uint32_t w, r = 0;
            memcpy(&w, src + 4 * i, 4);
            if (ref) memcpy(&r, ref + 4 * i, 4);
            w ^= r;
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            p2[i] = (uint8_t)(w >> 16);
            p3[i] = (uint8_t)(w >> 24);
        }
        return;
    }
    if (e == 2) {
        uint8_t *p0 = out, *p1 = out + n;
        int64_t i = 0;
#ifdef __SSE2__
        const __m128i low = _mm_set1_epi16(0xff);
        for (; i + 16 <= n; i += 16) {  /* low and high bytes of 16 elements, packed */
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 2 * i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
            if (ref) {
                a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)(ref + 2 * i)));
                b = _mm_xor_si128(b, _mm_loadu_si128((const __m128i *)(ref + 2 * i + 16)));
            }
            _mm_storeu_si128((__m128i *)(p0 + i),
                             _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
            _mm_storeu_si128((__m128i *)(p1 + i),
                             _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
#endif
        for (; i < n; i++) {
            uint16_t w, r = 0;
            memcpy(&w, src + 2 * i, 2);
            if (ref) memcpy(&r, ref + 2 * i, 2);
            w ^= r;
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
        }
        return;
    }
    if (e == 8) {
        for (int64_t i = 0; i < n; i++) {
            uint64_t w, r = 0;
            memcpy(&w, src + 8 * i, 8);
            if (ref) memcpy(&r, ref + 8 * i, 8);
            w ^= r;
            for (int k = 0; k < 8; k++)
                out[k * n + i] = (uint8_t)(w >> (8 * k));
        }
        return;
    }
    for (int64_t k = 0; k < e; k++) {  /* any other width: one strided pass per plane */
        uint8_t *p = out + k * n;
        const uint8_t *s = src + k, *r = ref ? ref + k : NULL;
        for (int64_t i = 0; i < n; i++)
            p[i] = s[i * e] ^ (r ? r[i * e] : 0);
    }
}

/* The inverse of split: n e-byte elements out of their byte planes (planes[k * n + i] is
 * byte k of element i), XORed with ref (when not NULL) in element order. */
static void join(const uint8_t *planes, const uint8_t *ref, uint8_t *out, int64_t n, int64_t e)
{
    if (e == 4) {
        const uint8_t *p0 = planes, *p1 = planes + n, *p2 = planes + 2 * n, *p3 = planes + 3 * n;
        int64_t i = 0;
#ifdef __SSE2__
        for (; i + 16 <= n; i += 16) {  /* byte pairs, then pairs of pairs: 16 elements */
            __m128i a = _mm_loadu_si128((const __m128i *)(p0 + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(p1 + i));
            __m128i c = _mm_loadu_si128((const __m128i *)(p2 + i));
            __m128i d = _mm_loadu_si128((const __m128i *)(p3 + i));
            __m128i ab_lo = _mm_unpacklo_epi8(a, b), cd_lo = _mm_unpacklo_epi8(c, d);
            __m128i ab_hi = _mm_unpackhi_epi8(a, b), cd_hi = _mm_unpackhi_epi8(c, d);
            __m128i x[4] = {_mm_unpacklo_epi16(ab_lo, cd_lo), _mm_unpackhi_epi16(ab_lo, cd_lo),
                            _mm_unpacklo_epi16(ab_hi, cd_hi), _mm_unpackhi_epi16(ab_hi, cd_hi)};
            for (int j = 0; j < 4; j++) {
                if (ref)
                    x[j] = _mm_xor_si128(x[j], _mm_loadu_si128((const __m128i *)(ref + 4 * i + 16 * j)));
                _mm_storeu_si128((__m128i *)(out + 4 * i + 16 * j), x[j]);
            }
        }
#endif
        for (; i < n; i++) {
            uint32_t w = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 |
                         (uint32_t)p3[i] << 24, r = 0;
            if (ref) memcpy(&r, ref + 4 * i, 4);
            w ^= r;
            memcpy(out + 4 * i, &w, 4);
        }
        return;
    }
    if (e == 2) {
        const uint8_t *p0 = planes, *p1 = planes + n;
        int64_t i = 0;
#ifdef __SSE2__
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(p0 + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(p1 + i));
            __m128i x[2] = {_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)};
            for (int j = 0; j < 2; j++) {
                if (ref)
                    x[j] = _mm_xor_si128(x[j], _mm_loadu_si128((const __m128i *)(ref + 2 * i + 16 * j)));
                _mm_storeu_si128((__m128i *)(out + 2 * i + 16 * j), x[j]);
            }
        }
#endif
        for (; i < n; i++) {
            uint16_t w = (uint16_t)(p0[i] | p1[i] << 8), r = 0;
            if (ref) memcpy(&r, ref + 2 * i, 2);
            w ^= r;
            memcpy(out + 2 * i, &w, 2);
        }
        return;
    }
    for (int64_t k = 0; k < e; k++) {  /* any other width: one strided pass per plane */
        const uint8_t *p = planes + k * n;
        uint8_t *o = out + k;
        const uint8_t *r = ref ? ref + k : NULL;
        for (int64_t i = 0; i < n; i++)
            o[i * e] = p[i] ^ (r ? r[i * e] : 0);
    }
}

static void xor_copy(const uint8_t *src, const uint8_t *ref, uint8_t *out, int64_t n)
{
    if (!ref) {
        memcpy(out, src, (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        out[i] = src[i] ^ ref[i];
}

/* planes(data, reference or None, out, regions): the byte planes of data ^ reference,
 * region by region; unplanes(planes, reference or None, out, regions) the inverse, the
 * reference XORed in element order. `regions` holds int64 (start, size, element size)
 * triples tiling [0, len(data)) in order; bytes past a region's last whole element are
 * copied (and XORed). */
static PyObject *by_regions(PyObject *args, int forward)
{
    Py_buffer src, out, regs, ref = {0};
    PyObject *ref_obj;
    if (!PyArg_ParseTuple(args, "y*Ow*y*", &src, &ref_obj, &out, &regs))
        return NULL;
    PyObject *result = NULL;
    int has_ref = ref_obj != Py_None;
    if (has_ref && PyObject_GetBuffer(ref_obj, &ref, PyBUF_SIMPLE) < 0)
        goto done;
    if (out.len != src.len || (has_ref && ref.len != src.len)) {
        PyErr_Format(PyExc_ValueError, "planes: data of %zd bytes, reference of %zd, out of %zd",
                     src.len, has_ref ? ref.len : src.len, out.len);
        goto done;
    }
    if (regs.len % (Py_ssize_t)sizeof(region_t) || (uintptr_t)regs.buf % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError,
                        "planes: regions must be an aligned array of int64 (start, size, elem) triples");
        goto done;
    }
    const region_t *r = regs.buf;
    Py_ssize_t count = regs.len / (Py_ssize_t)sizeof(region_t);
    int64_t cursor = 0;
    for (Py_ssize_t j = 0; j < count; j++) {
        /* start == cursor keeps start in [0, len]: len - start cannot overflow, and
         * neither can cursor, which never passes len. */
        if (r[j].start != cursor || r[j].size < 0 || r[j].elem < 1 ||
                r[j].size > (int64_t)src.len - r[j].start) {
            PyErr_Format(PyExc_ValueError, "planes: region %zd does not tile the data", j);
            goto done;
        }
        cursor += r[j].size;
    }
    if (cursor != src.len) {
        PyErr_SetString(PyExc_ValueError, "planes: regions do not cover the data");
        goto done;
    }
    const uint8_t *s = src.buf, *f = has_ref ? ref.buf : NULL;
    uint8_t *o = out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < count; j++) {
        int64_t lo = r[j].start, e = r[j].elem, n = e > 1 ? r[j].size / e : 0;
        if (n > 0) {
            if (forward)
                split(s + lo, f ? f + lo : NULL, o + lo, n, e);
            else
                join(s + lo, f ? f + lo : NULL, o + lo, n, e);
        }
        int64_t mid = lo + n * e;
        xor_copy(s + mid, f ? f + mid : NULL, o + mid, lo + r[j].size - mid);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&regs);
    if (has_ref && ref.obj)
        PyBuffer_Release(&ref);
    return result;
}

static PyObject *planes(PyObject *self, PyObject *args)
{
    return by_regions(args, 1);
}

static PyObject *unplanes(PyObject *self, PyObject *args)
{
    return by_regions(args, 0);
}

/* 0: b holds n float32 at an aligned address; 1: misaligned (the caller answers False and
 * numpy does the work); -1: the wrong size (ValueError set). */
static int floats(Py_buffer *b, Py_ssize_t n, const char *what)
{
    if (b->len != n * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not %zd float32", what, b->len, n);
        return -1;
    }
    return ((uintptr_t)b->buf % sizeof(float)) != 0;
}

static void second_moment_loop(const float *v0, const float *m0, const float *m1, float *o,
                               Py_ssize_t n, const float c[4])
{
    const float one_minus_beta1 = c[0], one_minus_beta2 = c[1], beta2 = c[2];
    for (Py_ssize_t i = 0; i < n; i++) {
        float grad = m1[i] - m0[i];
        grad = grad / one_minus_beta1;
        grad = m0[i] + grad;
        float term = one_minus_beta2 * grad;
        term = term * grad;
        float r = v0[i] * beta2;
        o[i] = one_nan(r + term);
    }
}

static void param_loop(const float *p0, const float *m1, const float *v1, float *o,
                       Py_ssize_t n, const float c[4])
{
    const float bc2_sqrt = c[0], eps = c[1], minus_step_size = c[2], decay = c[3];
    for (Py_ssize_t i = 0; i < n; i++) {
        float term = sqrtf(v1[i]);
        term = term / bc2_sqrt;
        term = term + eps;
        term = m1[i] / term;
        term = minus_step_size * term;
        float r = p0[i] * decay;
        o[i] = one_nan(r + term);
    }
}

typedef void (*predict_loop)(const float *, const float *, const float *, float *, Py_ssize_t,
                             const float[4]);

/* A prediction over three float32 inputs into `out`: True, or False (nothing written)
 * where a buffer is not float32-aligned; ValueError where the sizes differ. */
static PyObject *predict(PyObject *args, predict_loop loop, const char *format)
{
    Py_buffer in[3], out;
    float c[4] = {0};
    if (!PyArg_ParseTuple(args, format, &in[0], &in[1], &in[2], &out, &c[0], &c[1], &c[2], &c[3]))
        return NULL;
    Py_ssize_t n = out.len / (Py_ssize_t)sizeof(float);
    static const char *const names[4] = {"first input", "second input", "third input", "out"};
    Py_buffer *bufs[4] = {&in[0], &in[1], &in[2], &out};
    int misaligned = 0;
    PyObject *result = NULL;
    for (int j = 0; j < 4; j++) {
        int got = floats(bufs[j], n, names[j]);
        if (got < 0)
            goto done;
        misaligned |= got;
    }
    if (misaligned) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    loop(in[0].buf, in[1].buf, in[2].buf, out.buf, n, c);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_True);
done:
    for (int j = 0; j < 4; j++)
        PyBuffer_Release(bufs[j]);
    return result;
}

/* second_moment(v0, m0, m1, out, one_minus_beta1, one_minus_beta2, beta2):
 * predict.predict_second_moment's operations in its order, NaNs made one. */
static PyObject *second_moment(PyObject *self, PyObject *args)
{
    return predict(args, second_moment_loop, "y*y*y*w*fff");
}

/* param(p0, m1, v1, out, bc2_sqrt, eps, minus_step_size, decay):
 * predict.predict_param's operations in its order, NaNs made one. */
static PyObject *param(PyObject *self, PyObject *args)
{
    return predict(args, param_loop, "y*y*y*w*ffff");
}

static PyMethodDef methods[] = {
    {"planes", planes, METH_VARARGS, "Byte planes of data ^ reference, region by region."},
    {"unplanes", unplanes, METH_VARARGS, "Elements out of their byte planes, ^ reference."},
    {"second_moment", second_moment, METH_VARARGS, "AdamW's second moment after a step."},
    {"param", param, METH_VARARGS, "A parameter after an AdamW step."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "The daemon's encode loops in C; numpy fallbacks in codecs.py and predict.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
    return PyModule_Create(&module);
}
