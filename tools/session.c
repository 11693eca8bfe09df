/* One backend bound to one batch in the memory of an exec: context, plan, workspace, metadata. */
#include "session.h"

#include <stdio.h>

void tool_session_close(tool_session *s) {
    if (s->exec) {
        s->exec->release(s->workspace);
        s->exec->release(s->cu_seqlens_q);
        s->exec->release(s->seq_lens);
        s->exec->release(s->block_table);
    }
    msaidx_plan_destroy(s->plan);
    msaidx_context_destroy(s->context);
    *s = (tool_session){0};
}

void tool_session_config(msaidx_config *config, const tool_exec *exec, const tool_batch *batch,
                         msaidx_backend backend, int threads, msaidx_precision precision) {
    msaidx_config_init(config);
    config->num_heads = batch->heads;
    config->dtype = batch->dtype;
    config->backend = backend;
    config->device = exec->device;
    config->num_threads = threads;
    config->precision = precision;
}

bool tool_session_open(tool_session *s, const tool_exec *exec, const tool_batch *batch,
                       msaidx_backend backend, int threads, msaidx_precision precision) {
    *s = (tool_session){0};
    s->exec = exec;
    const msaidx_batch_desc *d = &batch->desc;
    msaidx_config config;
    tool_session_config(&config, exec, batch, backend, threads, precision);
    const size_t bt_bytes =
        sizeof(int32_t) * (size_t)d->bt_stride * (size_t)(d->batch_size > 0 ? d->batch_size : 1);
    bool ok =
        tool_ok(msaidx_context_create(&s->context, &config), "context create") &&
        tool_ok(msaidx_context_backend(s->context, &s->backend), "context backend") &&
        tool_ok(msaidx_plan_create(&s->plan, s->context, d), "plan create") &&
        tool_ok(msaidx_plan_workspace_size(s->plan, &s->workspace_bytes), "workspace size") &&
        exec->alloc(&s->workspace, s->workspace_bytes) &&
        exec->alloc((void **)&s->cu_seqlens_q, sizeof(int32_t) * (size_t)(d->batch_size + 1)) &&
        exec->alloc((void **)&s->seq_lens,
                    sizeof(int32_t) * (size_t)(d->batch_size > 0 ? d->batch_size : 1)) &&
        exec->alloc((void **)&s->block_table, bt_bytes) &&
        exec->upload(s->cu_seqlens_q, batch->cu_seqlens_q,
                     sizeof(int32_t) * (size_t)(d->batch_size + 1)) &&
        exec->upload(s->seq_lens, batch->seq_lens, sizeof(int32_t) * (size_t)d->batch_size) &&
        exec->upload(s->block_table, batch->block_table, bt_bytes) &&
        tool_ok(msaidx_plan_batch(s->plan, s->cu_seqlens_q, s->seq_lens, s->block_table,
                                  s->workspace, s->workspace_bytes, exec->stream),
                "plan batch") &&
        tool_ok(msaidx_plan_nvp(s->plan, &s->nvp), "plan nvp");
    if (!ok) {
        tool_session_close(s);
        return false;
    }
    const int64_t longest = ((int64_t)d->max_seq_len + config.page_size - 1) / config.page_size;
    s->max_nvp = longest < 1 ? 1 : longest < d->pitch ? (int32_t)longest : d->pitch;
    s->heads = config.num_heads;
    s->topk = config.topk;
    return true;
}

bool tool_session_scores(const tool_session *s, const void *q, const void *k_cache, float *scores) {
    return tool_ok(msaidx_prefill_scores(s->plan, q, k_cache, scores, s->exec->stream),
                   "prefill scores");
}

bool tool_session_topk(const tool_session *s, const float *scores, int32_t pitch,
                       int32_t num_tokens, int32_t *out) {
    return tool_ok(msaidx_topk_select_bounded(
                       s->context, scores, pitch, s->max_nvp < pitch ? s->max_nvp : pitch, s->nvp,
                       num_tokens, out, (int64_t)s->heads * s->topk, s->topk, s->exec->stream),
                   "topk select");
}

bool tool_session_check(const tool_session *s) {
    return tool_ok(msaidx_plan_check(s->plan, s->exec->stream), "plan check");
}
