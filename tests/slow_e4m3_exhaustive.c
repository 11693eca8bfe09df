/* msaidx_e4m3_from_float and msaidx_bf16_from_float on all 2^32 float bit patterns against the
 * oracles of convert_oracle.h (SPEC.md section 8). The sweep walks magnitudes upwards in chunks
 * of 2^16 bit patterns, so the oracle's table position only moves forward. */
#include "convert_oracle.h"
#include "harness.h"
#include "msaidx.h"

#include <stdlib.h>
#include <time.h>

enum { CHUNK = 1 << 16, NUM_CHUNKS = 1 << 15 }; /* 2^31 magnitudes, both signs each */

typedef struct mismatch {
    long count;
    uint32_t first_bits;
    unsigned got, want;
} mismatch;

static void note(mismatch *m, uint32_t bits, unsigned got, unsigned want) {
    if (!m->count++) {
        m->first_bits = bits;
        m->got = got;
        m->want = want;
    }
}

static void merge(mismatch *into, const mismatch *from) {
    if (from->count && !into->count)
        *into = *from;
    else
        into->count += from->count;
}

static void sweep_chunk(const e4m3_table *table, uint32_t chunk, float *values, uint8_t *e4m3,
                        uint16_t *bf16, mismatch *bad_e4m3, mismatch *bad_bf16) {
    const uint32_t first = chunk * CHUNK;
    for (int negative = 0; negative < 2; ++negative) {
        const uint32_t sign = negative ? 0x80000000u : 0u;
        for (uint32_t i = 0; i < CHUNK; ++i) values[i] = float_of_bits(sign | (first + i));
        msaidx_e4m3_from_float(values, e4m3, CHUNK);
        msaidx_bf16_from_float(values, bf16, CHUNK);

        /* E4M3: finite magnitudes below 448 move the table position forward only. */
        int below = -1;
        for (uint32_t i = 0; i < CHUNK; ++i) {
            const uint32_t bits = first + i;
            uint8_t want;
            if (bits > 0x7F800000u) {
                want = 0x7F;
            } else {
                const double magnitude = (double)float_of_bits(bits);
                if (magnitude >= 448.0) {
                    want = 0x7E;
                } else {
                    if (below < 0) below = e4m3_floor_code(table, magnitude);
                    while (table->value[below + 1] <= magnitude) ++below;
                    want = e4m3_round_between(table, below, magnitude);
                }
                want |= negative ? 0x80 : 0;
            }
            if (e4m3[i] != want) note(bad_e4m3, sign | bits, e4m3[i], want);
        }

        /* BF16: the chunk shares its upper 16 bits, so both neighbours are fixed. */
        const uint16_t truncated = (uint16_t)(first >> 16);
        if (first >= 0x7F800000u) {
            for (uint32_t i = 0; i < CHUNK; ++i) {
                const uint32_t bits = first + i;
                const uint16_t got = bf16[i];
                const bool ok = bits == 0x7F800000u ? got == (uint16_t)((sign >> 16) | 0x7F80)
                                                    : (got & 0x7FFF) > 0x7F80 && (got & 0x40) &&
                                                          (got & 0x8000) == (sign >> 16);
                if (!ok) note(bad_bf16, sign | bits, got, 0);
            }
        } else {
            const double low = bc_bf16_value(truncated);
            const double high = truncated + 1 == 0x7F80 ? ldexp(1.0, 128)
                                                        : bc_bf16_value((uint16_t)(truncated + 1));
            for (uint32_t i = 0; i < CHUNK; ++i) {
                const double magnitude = (double)float_of_bits(first + i);
                const double to_low = magnitude - low, to_high = high - magnitude;
                uint16_t want = to_low < to_high   ? truncated
                                : to_low > to_high ? (uint16_t)(truncated + 1)
                                : (truncated & 1)  ? (uint16_t)(truncated + 1)
                                                   : truncated;
                want |= (uint16_t)(sign >> 16);
                if (bf16[i] != want) note(bad_bf16, sign | (first + i), bf16[i], want);
            }
        }
    }
}

int main(void) {
    e4m3_table table;
    e4m3_table_init(&table);
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    mismatch bad_e4m3 = {0}, bad_bf16 = {0};
#pragma omp parallel num_threads(2)
    {
        float *values = malloc(sizeof(float) * CHUNK);
        uint8_t *e4m3 = malloc(CHUNK);
        uint16_t *bf16 = malloc(sizeof(uint16_t) * CHUNK);
        mismatch mine_e4m3 = {0}, mine_bf16 = {0};
        if (!values || !e4m3 || !bf16) abort();
#pragma omp for schedule(dynamic, 64)
        for (int chunk = 0; chunk < NUM_CHUNKS; ++chunk)
            sweep_chunk(&table, (uint32_t)chunk, values, e4m3, bf16, &mine_e4m3, &mine_bf16);
#pragma omp critical
        {
            merge(&bad_e4m3, &mine_e4m3);
            merge(&bad_bf16, &mine_bf16);
        }
        free(values);
        free(e4m3);
        free(bf16);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    printf("2^32 inputs in %.1f s\n",
           (double)(end.tv_sec - start.tv_sec) + 1e-9 * (double)(end.tv_nsec - start.tv_nsec));
    CHECK(bad_e4m3.count == 0,
          "e4m3: %ld of 2^32 wrong; first bits 0x%08x (%.9g): got 0x%02x, want 0x%02x",
          bad_e4m3.count, bad_e4m3.first_bits, float_of_bits(bad_e4m3.first_bits), bad_e4m3.got,
          bad_e4m3.want);
    CHECK(bad_bf16.count == 0,
          "bf16: %ld of 2^32 wrong; first bits 0x%08x (%.9g): got 0x%04x, want 0x%04x",
          bad_bf16.count, bad_bf16.first_bits, float_of_bits(bad_bf16.first_bits), bad_bf16.got,
          bad_bf16.want);
    return harness_finish("slow_e4m3_exhaustive");
}
