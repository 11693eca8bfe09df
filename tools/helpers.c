/* The small helpers of every subcommand: status printing, the clock, parsing of option values
 * (integers, lists, backend, dtype, precision) and the median. Apart from the workloads because
 * every subcommand uses them, whatever it runs. */
#include "tool.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

bool tool_ok(msaidx_status status, const char *what) {
    if (status == MSAIDX_SUCCESS) return true;
    fprintf(stderr, "msaidx: %s: %s: %s\n", what, msaidx_status_string(status),
            msaidx_last_error());
    return false;
}

double tool_now_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e3 + (double)now.tv_nsec * 1e-6;
}

bool tool_parse_positive(const char *text, const char *option, double *value) {
    char *end = NULL;
    *value = strtod(text, &end);
    const bool ok = end != text && !*end && isfinite(*value) && *value > 0;
    if (!ok) fprintf(stderr, "msaidx: %s = '%s': expected a positive number\n", option, text);
    return ok;
}

bool tool_parse_int(const char *text, const char *option, long lo, long hi, long *value) {
    char *end = NULL;
    errno = 0;
    long parsed = text ? strtol(text, &end, 10) : 0;
    if (!text || errno || end == text || *end || parsed < lo || parsed > hi) {
        fprintf(stderr, "msaidx: %s = '%s': expected an integer in [%ld, %ld]\n", option,
                text ? text : "", lo, hi);
        return false;
    }
    *value = parsed;
    return true;
}

bool tool_parse_list(const char *text, const char *option, int32_t **values, int *count) {
    *values = NULL;
    *count = 0;
    if (!text || !*text) {
        fprintf(stderr, "msaidx: %s: empty list\n", option);
        return false;
    }
    int capacity = 1;
    for (const char *c = text; *c; ++c) capacity += *c == ',';
    int32_t *parsed = malloc(sizeof(int32_t) * (size_t)capacity);
    if (!parsed) return false;
    const char *cursor = text;
    for (int i = 0; i < capacity; ++i) {
        char *end = NULL;
        errno = 0;
        long v = strtol(cursor, &end, 10);
        if (errno || end == cursor || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "msaidx: %s = '%s': expected non-negative integers separated by ','\n",
                    option, text);
            free(parsed);
            return false;
        }
        parsed[i] = (int32_t)v;
        cursor = end + (*end == ',');
    }
    *values = parsed;
    *count = capacity;
    return true;
}

bool tool_parse_backend(const char *text, msaidx_backend *backend) {
    for (int b = MSAIDX_BACKEND_AUTO; b <= MSAIDX_BACKEND_PERSISTENT; ++b)
        if (!strcmp(text, msaidx_backend_name((msaidx_backend)b))) {
            *backend = (msaidx_backend)b;
            return true;
        }
    fprintf(stderr, "msaidx: backend '%s': expected auto, cpu, dense, split or persistent\n", text);
    return false;
}

bool tool_parse_dtype(const char *text, msaidx_dtype *dtype) {
    if (!strcmp(text, "e4m3") || !strcmp(text, "fp8")) {
        *dtype = MSAIDX_DTYPE_E4M3;
        return true;
    }
    if (!strcmp(text, "bf16")) {
        *dtype = MSAIDX_DTYPE_BF16;
        return true;
    }
    fprintf(stderr, "msaidx: dtype '%s': expected e4m3 or bf16\n", text);
    return false;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double tool_median(double *values, int count) {
    if (count <= 0) return 0.0;
    qsort(values, (size_t)count, sizeof *values, compare_doubles);
    return count % 2 ? values[count / 2] : 0.5 * (values[count / 2 - 1] + values[count / 2]);
}

bool tool_parse_precision(const char *text, msaidx_precision *precision) {
    if (!strcmp(text, "default"))
        *precision = MSAIDX_PRECISION_DEFAULT;
    else if (!strcmp(text, "exact"))
        *precision = MSAIDX_PRECISION_EXACT;
    else {
        fprintf(stderr, "msaidx: --precision %s: expected default or exact\n", text);
        return false;
    }
    return true;
}

bool tool_precision_option(const char *option, const char *value, unsigned *seen,
                           msaidx_precision *precision) {
    const bool old_spelling = !strcmp(option, "--fast-accumulation");
    *seen |= old_spelling ? 2u : 1u;
    if (*seen == 3u) {
        fprintf(stderr, "msaidx: give --precision or its old spelling --fast-accumulation, not "
                        "both\n");
        return false;
    }
    if (!old_spelling) return tool_parse_precision(value, precision);
    *precision = MSAIDX_PRECISION_DEFAULT;
    return true;
}

const char *tool_precision_name(msaidx_precision precision) {
    return precision == MSAIDX_PRECISION_EXACT ? "exact" : "default";
}
