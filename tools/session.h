/* One backend bound to one batch in the memory of an exec: context, plan, workspace, metadata. */
#ifndef MSAIDX_TOOL_SESSION_H
#define MSAIDX_TOOL_SESSION_H

#include "tool.h"

typedef struct tool_session {
    const tool_exec *exec;
    msaidx_context *context;
    msaidx_plan *plan;
    msaidx_backend backend; /* what AUTO resolved to */
    void *workspace;
    size_t workspace_bytes;
    int32_t *cu_seqlens_q, *seq_lens, *block_table; /* in the exec's memory */
    const int32_t *nvp;                             /* inside the workspace */
    int32_t max_nvp;     /* the batch's longest row, from desc.max_seq_len (at most the pitch) */
    int32_t heads, topk; /* of the context: the top-k rows' layout */
} tool_session;

/* A config for the batch on the exec's device with `backend` (threads: cpu workers, 0 = all) and
 * `precision` (SPEC section 3). */
void tool_session_config(msaidx_config *config, const tool_exec *exec, const tool_batch *batch,
                         msaidx_backend backend, int threads, msaidx_precision precision);
/* Creates context and plan, uploads the metadata and plans the batch. Prints why on failure. */
bool tool_session_open(tool_session *session, const tool_exec *exec, const tool_batch *batch,
                       msaidx_backend backend, int threads, msaidx_precision precision);
void tool_session_close(tool_session *session);
bool tool_session_scores(const tool_session *session, const void *q, const void *k_cache,
                         float *scores);
/* The top-k of the session's rows as an engine issues it: bounded by the batch's longest row
 * (msaidx_topk_select_bounded), whatever the pitch. */
bool tool_session_topk(const tool_session *session, const float *scores, int32_t pitch,
                       int32_t num_tokens, int32_t *out);
/* Synchronises and reports device-side metadata errors. */
bool tool_session_check(const tool_session *session);

#endif /* MSAIDX_TOOL_SESSION_H */
