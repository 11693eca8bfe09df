/* The quick part of the conversion tests (the sanitizer build runs it too): all 256 E4M3 and all
 * 65536 BF16 decodes from the bit fields, round trips, SPEC.md section 8 edge values, and random
 * encodes (random bit patterns and exact ties) against convert_oracle.h.
 * tests/slow_e4m3_exhaustive.c covers all 2^32 encodes. */
#include "convert_oracle.h"
#include "harness.h"
#include "msaidx.h"

#include <fenv.h>
#include <stdlib.h>

#ifdef MSAIDX_TEST_SANITIZE
enum { RANDOM_ENCODES = 1 << 18 };
#else
enum { RANDOM_ENCODES = 1 << 22 };
#endif

static uint8_t encode_e4m3(float x) {
    uint8_t code;
    msaidx_e4m3_from_float(&x, &code, 1);
    return code;
}

static uint16_t encode_bf16(float x) {
    uint16_t bits;
    msaidx_bf16_from_float(&x, &bits, 1);
    return bits;
}

static bool same_value(double want, float got) {
    if (isnan(want)) return isnan(got);
    return (double)got == want && !signbit(want) == !signbit(got);
}

static void e4m3_decodes(void) {
    uint8_t codes[256];
    float values[256 + 4];
    for (int i = 0; i < 256; ++i) codes[i] = (uint8_t)i;
    for (int i = 256; i < 260; ++i) values[i] = 12345.0f;
    msaidx_e4m3_to_float(codes, values, 256);
    for (int i = 0; i < 256; ++i)
        CHECK(same_value(bc_e4m3_value((uint8_t)i), values[i]),
              "e4m3 0x%02x decodes to %.9g, want %.9g", i, values[i], bc_e4m3_value((uint8_t)i));
    CHECK(values[256] == 12345.0f, "e4m3_to_float wrote past n");
    /* Anchors that do not rely on bc_e4m3_value. */
    CHECK(values[0x7E] == 448.0f && values[0xFE] == -448.0f, "max finite");
    CHECK(values[0x01] == 0x1p-9f && values[0x07] == 7 * 0x1p-9f, "subnormals");
    CHECK(values[0x08] == 0x1p-6f && values[0x38] == 1.0f && values[0x3A] == 1.25f, "normals");
    CHECK(values[0x80] == 0.0f && signbit(values[0x80]), "0x80 is -0");
    CHECK(isnan(values[0x7F]) && isnan(values[0xFF]), "NaN codes");
    /* Every non-NaN code survives a round trip. */
    uint8_t back[256];
    msaidx_e4m3_from_float(values, back, 256);
    for (int i = 0; i < 256; ++i)
        CHECK(back[i] == ((i & 0x7F) == 0x7F ? 0x7F : i), "e4m3 round trip 0x%02x -> 0x%02x", i,
              back[i]);
}

static void e4m3_edges(void) {
    static const struct {
        float x;
        uint8_t want;
    } edges[] = {
        {464.0f, 0x7E},         {-464.0f, 0xFE},      {465.0f, 0x7E},
        {448.0f, 0x7E},         {460.0f, 0x7E},       {440.0f, 0x7E},
        {1e30f, 0x7E},          {-1e30f, 0xFE},       {INFINITY, 0x7E},
        {-INFINITY, 0xFE},      {NAN, 0x7F},          {-NAN, 0x7F},
        {0x1p-10f, 0x00},       {-0x1p-10f, 0x80},    {0x1.000002p-10f, 0x01},
        {0.0f, 0x00},           {-0.0f, 0x80},        {1e-30f, 0x00},
        {-1e-30f, 0x80},        {3 * 0x1p-10f, 0x02}, {1.0f, 0x38},
        {1.0625f, 0x38},        {1.1875f, 0x3A},      {-1.0625f, 0xB8},
        {0x1.000002p+0f, 0x38}, {1.0625001f, 0x39},   {0x1p-6f, 0x08},
        {15 * 0x1p-10f, 0x08},  {416.0f, 0x7D},       {432.0f, 0x7E},
        {431.99997f, 0x7D},     {0x1p-149f, 0x00},
    };
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; ++i) {
        const uint8_t got = encode_e4m3(edges[i].x);
        CHECK(got == edges[i].want, "e4m3(%.9g) = 0x%02x, want 0x%02x", edges[i].x, got,
              edges[i].want);
    }
}

static void e4m3_random(harness_rng *rng, const e4m3_table *table) {
    float *x = malloc(sizeof(float) * RANDOM_ENCODES);
    uint8_t *got = malloc(RANDOM_ENCODES + 16);
    if (!x || !got) abort();
    for (int i = 0; i < RANDOM_ENCODES; ++i) {
        switch (i % 4) {
        case 0: x[i] = float_of_bits((uint32_t)harness_next(rng)); break;
        case 1:
            x[i] = (float)(harness_normal(rng) * ldexp(1.0, (int)harness_int(rng, -12, 9)));
            break;
        default: { /* exact midpoints and their float neighbours */
            const int code = (int)harness_int(rng, 0, 125);
            float mid = (float)(0.5 * (table->value[code] + table->value[code + 1]));
            if (i % 4 == 3) mid = nextafterf(mid, harness_int(rng, 0, 1) ? INFINITY : 0.0f);
            x[i] = harness_int(rng, 0, 1) ? -mid : mid;
        }
        }
    }
    for (int i = 0; i < 16; ++i) got[RANDOM_ENCODES + i] = 0xA5;
    msaidx_e4m3_from_float(x, got, RANDOM_ENCODES);
    long bad = 0;
    int first = -1;
    for (int i = 0; i < RANDOM_ENCODES; ++i)
        if (got[i] != e4m3_oracle(table, x[i]) && !bad++) first = i;
    CHECK(bad == 0, "e4m3: %ld of %d random encodes wrong; first %.9g -> 0x%02x, want 0x%02x", bad,
          RANDOM_ENCODES, first >= 0 ? x[first] : 0.0f, first >= 0 ? got[first] : 0,
          first >= 0 ? e4m3_oracle(table, x[first]) : 0);
    CHECK(got[RANDOM_ENCODES] == 0xA5, "e4m3_from_float wrote past n");
    free(x);
    free(got);
}

static void bf16_all(harness_rng *rng) {
    uint16_t *codes = malloc(sizeof(uint16_t) * 65536);
    float *values = malloc(sizeof(float) * 65536);
    uint16_t *back = malloc(sizeof(uint16_t) * 65536);
    if (!codes || !values || !back) abort();
    for (int i = 0; i < 65536; ++i) codes[i] = (uint16_t)i;
    msaidx_bf16_to_float(codes, values, 65536);
    msaidx_bf16_from_float(values, back, 65536);
    long bad_decode = 0, bad_trip = 0;
    for (int i = 0; i < 65536; ++i) {
        bad_decode += !same_value(bc_bf16_value((uint16_t)i), values[i]);
        const bool nan = (i & 0x7F80) == 0x7F80 && (i & 0x7F);
        /* NaN stays NaN, quiet, with its sign. */
        bad_trip += nan ? !((back[i] & 0x7F80) == 0x7F80 && (back[i] & 0x40) &&
                            (back[i] & 0x8000) == (i & 0x8000))
                        : back[i] != i;
    }
    CHECK(bad_decode == 0, "bf16: %ld of 65536 decodes wrong", bad_decode);
    CHECK(bad_trip == 0, "bf16: %ld of 65536 round trips wrong", bad_trip);
    CHECK(values[0x3F80] == 1.0f && values[0xC000] == -2.0f && values[0x0001] == 0x1p-133f,
          "bf16 anchors");

    static const struct {
        float x;
        uint16_t want;
    } edges[] = {
        {1.0f, 0x3F80},           {0x1.01p+0f, 0x3F80},   {0x1.03p+0f, 0x3F82},
        {0x1.010002p+0f, 0x3F81}, {-0x1.01p+0f, 0xBF80},  {INFINITY, 0x7F80},
        {-INFINITY, 0xFF80},      {0x1.ffp+127f, 0x7F80}, {0x1.fep+127f, 0x7F7F},
        {0x1p-149f, 0x0000},      {0x1.8p-133f, 0x0002},  {-0.0f, 0x8000},
    };
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; ++i) {
        const uint16_t got = encode_bf16(edges[i].x);
        CHECK(got == edges[i].want, "bf16(%a) = 0x%04x, want 0x%04x", edges[i].x, got,
              edges[i].want);
    }
    const uint16_t nan = encode_bf16(float_of_bits(0x7F800001u)); /* signalling NaN */
    CHECK((nan & 0x7F80) == 0x7F80 && (nan & 0x40), "bf16 of a signalling NaN = 0x%04x", nan);

    long bad = 0;
    float first = 0;
    for (int i = 0; i < RANDOM_ENCODES; ++i) {
        uint32_t bits = (uint32_t)harness_next(rng);
        if (i % 2) bits = (bits & 0xFFFF0000u) | 0x8000u; /* exact ties */
        const float x = float_of_bits(bits);
        if (isnan(x)) continue;
        if (encode_bf16(x) != bf16_oracle(x) && !bad++) first = x;
    }
    CHECK(bad == 0, "bf16: %ld random encodes wrong; first %a -> 0x%04x, want 0x%04x", bad, first,
          encode_bf16(first), bf16_oracle(first));
    free(codes);
    free(values);
    free(back);
}

int main(void) {
    harness_rng rng = {harness_seed()};
    e4m3_table table;
    e4m3_table_init(&table);
    e4m3_decodes();
    e4m3_edges();
    e4m3_random(&rng, &table);
    bf16_all(&rng);
    /* Round to nearest even whatever rounding mode the caller's thread has set. */
    const int modes[] = {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO};
    for (int m = 0; m < 3; ++m) {
        CHECK(fesetround(modes[m]) == 0, "fesetround(%d)", modes[m]);
        e4m3_random(&rng, &table);
        bf16_all(&rng);
        fesetround(FE_TONEAREST);
    }
    return harness_finish("test_convert");
}
