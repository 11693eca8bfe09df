/* A minimal test harness: CHECK records a failure and goes on; harness_finish prints the
 * summary line ("N passed, N failed") and gives the exit code. Seeds are fresh each run
 * (MSAIDX_TEST_SEED=N repeats one) and printed so a failure can be replayed. */
#ifndef MSAIDX_TEST_HARNESS_H
#define MSAIDX_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>

extern long harness_checks_passed;
extern long harness_checks_failed;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            ++harness_checks_passed;                                                               \
        } else {                                                                                   \
            ++harness_checks_failed;                                                               \
            if (harness_checks_failed <= 50) {                                                     \
                fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);           \
                fprintf(stderr, __VA_ARGS__);                                                      \
                fputc('\n', stderr);                                                               \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Status must be MSAIDX_SUCCESS; prints msaidx_last_error() otherwise. */
#define CHECK_OK(call) CHECK((call) == MSAIDX_SUCCESS, "%s: %s", #call, msaidx_last_error())

/* The run's seed: MSAIDX_TEST_SEED, else from the clock; printed once. */
uint64_t harness_seed(void);

/* splitmix64 stream. */
typedef struct harness_rng {
    uint64_t state;
} harness_rng;
uint64_t harness_next(harness_rng *rng);
/* Uniform integer in [lo, hi]. */
int64_t harness_int(harness_rng *rng, int64_t lo, int64_t hi);
/* Uniform float in [lo, hi). */
double harness_uniform(harness_rng *rng, double lo, double hi);
/* Standard normal. */
double harness_normal(harness_rng *rng);

/* Prints "<name>: N passed, N failed" and returns the process exit code. */
int harness_finish(const char *name);

#endif
