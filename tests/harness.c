#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

long harness_checks_passed;
long harness_checks_failed;

uint64_t harness_seed(void) {
    static uint64_t seed;
    static int chosen;
    if (!chosen) {
        const char *fixed = getenv("MSAIDX_TEST_SEED");
        if (fixed) {
            seed = strtoull(fixed, NULL, 0);
        } else {
            struct timespec now;
            clock_gettime(CLOCK_REALTIME, &now);
            seed = (uint64_t)now.tv_sec * 1000000007ull ^ (uint64_t)now.tv_nsec;
        }
        chosen = 1;
        printf("seed: MSAIDX_TEST_SEED=%llu\n", (unsigned long long)seed);
    }
    return seed;
}

uint64_t harness_next(harness_rng *rng) {
    uint64_t z = (rng->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int64_t harness_int(harness_rng *rng, int64_t lo, int64_t hi) {
    return lo + (int64_t)(harness_next(rng) % (uint64_t)(hi - lo + 1));
}

double harness_uniform(harness_rng *rng, double lo, double hi) {
    return lo + (hi - lo) * ((double)(harness_next(rng) >> 11) * 0x1.0p-53);
}

double harness_normal(harness_rng *rng) {
    double u = harness_uniform(rng, 1e-12, 1.0), v = harness_uniform(rng, 0.0, 1.0);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

int harness_finish(const char *name) {
    printf("%s: %ld passed, %ld failed\n", name, harness_checks_passed, harness_checks_failed);
    return harness_checks_failed ? 1 : 0;
}
