/* The tools' own judges of the library, written independently of it: the FP64 reference scores
 * of a batch's tokens, their comparison within SPEC section 3's bounds, and SPEC section 4's
 * selection of one row. Apart from workload.c, which makes the batches these judge. */
#include "tool.h"

#include <math.h>
#include <string.h>

int tool_request_of(const tool_batch *batch, int32_t t) {
    int lo = 0, hi = batch->desc.batch_size - 1;
    while (lo < hi) { /* last b with cu[b] <= t */
        int mid = (lo + hi + 1) / 2;
        if (batch->cu_seqlens_q[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Keys of one physical page as floats: decoded from the stored cache, or the unquantized rows. */
typedef const float *(*page_keys_fn)(const tool_batch *batch, const float *unquantized,
                                     int32_t page, int32_t keys, float *scratch);

static const float *stored_page_keys(const tool_batch *batch, const float *unquantized,
                                     int32_t page, int32_t keys, float *scratch) {
    (void)unquantized;
    tool_load(batch->dtype,
              (const char *)batch->k_cache + (size_t)page * (size_t)batch->desc.page_stride,
              scratch, (size_t)keys * TOOL_HEAD_DIM);
    return scratch;
}

static const float *float_page_keys(const tool_batch *batch, const float *unquantized, int32_t page,
                                    int32_t keys, float *scratch) {
    (void)batch;
    (void)keys;
    (void)scratch;
    return unquantized + (size_t)page * TOOL_PAGE * TOOL_HEAD_DIM;
}

static void reference_scores(const tool_batch *batch, int32_t t, const float *q,
                             page_keys_fn page_keys, const float *unquantized, double *ref,
                             double *abs_dots) {
    const msaidx_batch_desc *d = &batch->desc;
    const int b = tool_request_of(batch, t);
    const int32_t q_len = batch->cu_seqlens_q[b + 1] - batch->cu_seqlens_q[b];
    const int32_t pos = batch->seq_lens[b] - q_len + (t - batch->cu_seqlens_q[b]);
    const int32_t nvp = pos / TOOL_PAGE + 1;
    const int32_t *pages = batch->block_table + (size_t)b * d->bt_stride;
    float scratch[TOOL_PAGE * TOOL_HEAD_DIM];
    for (int32_t p = 0; p < nvp; ++p) {
        const int32_t keys_in_page =
            pos - p * TOOL_PAGE + 1 < TOOL_PAGE ? pos - p * TOOL_PAGE + 1 : TOOL_PAGE;
        const float *keys = page_keys(batch, unquantized, pages[p], keys_in_page, scratch);
        for (int h = 0; h < batch->heads; ++h) {
            const float *qh = q + h * TOOL_HEAD_DIM;
            double best = -INFINITY, largest_abs = 0.0;
            for (int32_t j = 0; j < keys_in_page; ++j) {
                const float *k = keys + j * TOOL_HEAD_DIM;
                double dot = 0.0, abs_dot = 0.0;
                for (int e = 0; e < TOOL_HEAD_DIM; ++e) {
                    const double product = (double)qh[e] * (double)k[e];
                    dot += product;
                    abs_dot += fabs(product);
                }
                if (dot > best) best = dot;
                if (abs_dot > largest_abs) largest_abs = abs_dot;
            }
            ref[(size_t)h * nvp + p] = best;
            if (abs_dots) abs_dots[(size_t)h * nvp + p] = largest_abs;
        }
    }
}

void tool_reference_token(const tool_batch *batch, int32_t t, double *ref, double *abs_dots) {
    const size_t elem = batch->dtype == MSAIDX_DTYPE_BF16 ? 2 : 1;
    float q[16 * TOOL_HEAD_DIM];
    tool_load(batch->dtype,
              (const char *)batch->q + (size_t)t * batch->heads * TOOL_HEAD_DIM * elem, q,
              (size_t)batch->heads * TOOL_HEAD_DIM);
    reference_scores(batch, t, q, stored_page_keys, NULL, ref, abs_dots);
}

void tool_reference_token_float(const tool_batch *batch, int32_t t, const float *q_rows,
                                const float *k_rows, double *ref) {
    reference_scores(batch, t, q_rows + (size_t)t * batch->heads * TOOL_HEAD_DIM, float_page_keys,
                     k_rows, ref, NULL);
}

void tool_topk_row(const float *row, int32_t nvp, int topk, int init_blocks, int local_blocks,
                   int32_t *out) {
    for (int i = 0; i < topk; ++i) out[i] = -1;
    if (nvp <= 0) return;
    if (nvp <= topk) {
        for (int32_t p = 0; p < nvp; ++p) out[p] = p;
        return;
    }
    /* Forced blocks first, then repeatedly the best remaining page (NaN as -inf, ties to the
     * lower id); then sort ascending. O(nvp * topk), plenty for sampled rows. */
    int n = 0;
    for (int32_t p = 0; p < init_blocks; ++p) out[n++] = p;
    for (int32_t p = nvp - local_blocks; p < nvp; ++p) out[n++] = p;
    while (n < topk) {
        int32_t best = -1;
        float best_score = 0.0f;
        for (int32_t p = init_blocks; p < nvp - local_blocks; ++p) {
            bool taken = false;
            for (int i = 0; i < n && !taken; ++i) taken = out[i] == p;
            if (taken) continue;
            const float s = isnan(row[p]) ? -INFINITY : row[p];
            if (best < 0 || s > best_score) {
                best = p;
                best_score = s;
            }
        }
        out[n++] = best;
    }
    for (int i = 1; i < topk; ++i)
        for (int j = i; j > 0 && out[j - 1] > out[j]; --j) {
            int32_t swap = out[j];
            out[j] = out[j - 1];
            out[j - 1] = swap;
        }
}

bool tool_fp8_bound(const tool_batch *batch, msaidx_backend backend, msaidx_precision precision) {
    return batch->dtype == MSAIDX_DTYPE_E4M3 && precision == MSAIDX_PRECISION_DEFAULT &&
           backend == MSAIDX_BACKEND_PERSISTENT;
}

void tool_compare_token(const tool_batch *batch, int32_t t, const float *scores, bool fp8,
                        double *scratch, tool_accuracy *acc) {
    const int H = batch->heads;
    const int32_t nvp = batch->nvp[t], pitch = batch->desc.pitch;
    double *ref = scratch, *abs_dots = scratch + (size_t)H * nvp;
    tool_reference_token(batch, t, ref, abs_dots);
    for (int h = 0; h < H; ++h) {
        const float *row = scores + ((size_t)t * H + h) * (size_t)pitch;
        for (int32_t p = 0; p < nvp; ++p) {
            const double expected = ref[(size_t)h * nvp + p];
            const double error = fabs((double)row[p] - expected);
            const double relative = error / fmax(1.0, fabs(expected));
            const double largest_abs_dot = abs_dots[(size_t)h * nvp + p];
            double bound =
                TOOL_SCORE_TOLERANCE * fmax(1.0, fabs(expected)) + 0x1p-16 * largest_abs_dot;
            if (fp8) bound += MSAIDX_FP8_ACCUMULATION_DOT_BOUND * largest_abs_dot;
            ++acc->cells;
            if (isnan(row[p]) || !(error <= bound)) ++acc->bad_cells;
            if (isnan(row[p])) {
                acc->max_rel_error = acc->max_bound_ratio = INFINITY;
            } else {
                acc->max_rel_error = fmax(acc->max_rel_error, relative);
                acc->max_bound_ratio = fmax(acc->max_bound_ratio, error / bound);
            }
        }
        for (int32_t p = nvp; p < pitch; ++p) {
            uint32_t bits;
            memcpy(&bits, &row[p], sizeof bits);
            if (bits != 0xFFFFFFFFu) ++acc->written_past_nvp; /* the poison must survive */
        }
    }
}
