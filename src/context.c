/* Contexts: the config's defaults and validation, the backend table, the admission of a backend
 * for a config (AUTO's choice) and the context's life. Apart from plan.c and dispatch.c because a
 * context is made once per config, before any batch exists. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const msaidx_backend_ops *msaidx_find_backend(msaidx_backend id) {
    switch (id) {
    case MSAIDX_BACKEND_CPU: return &msaidx_cpu_backend;
#ifdef MSAIDX_WITH_CUDA
    case MSAIDX_BACKEND_DENSE: return &msaidx_dense_backend;
    case MSAIDX_BACKEND_SPLIT: return &msaidx_split_backend;
#endif
#ifdef MSAIDX_WITH_PERSISTENT
    case MSAIDX_BACKEND_PERSISTENT: return &msaidx_persistent_backend;
#endif
    default: return NULL;
    }
}

const char *msaidx_version(void) { return MSAIDX_VERSION_STRING; }

const char *msaidx_backend_name(msaidx_backend backend) {
    switch (backend) {
    case MSAIDX_BACKEND_AUTO: return "auto";
    case MSAIDX_BACKEND_CPU: return "cpu";
    case MSAIDX_BACKEND_DENSE: return "dense";
    case MSAIDX_BACKEND_SPLIT: return "split";
    case MSAIDX_BACKEND_PERSISTENT: return "persistent";
    }
    return "unknown";
}

void msaidx_config_init(msaidx_config *config) {
    if (!config) return;
    memset(config, 0, sizeof *config);
    config->struct_size = sizeof *config;
    config->head_dim = 128;
    config->page_size = 128;
    config->num_heads = 4;
    config->topk = 16;
    config->init_blocks = 0;
    config->local_blocks = 1;
    config->dtype = MSAIDX_DTYPE_E4M3;
    config->backend = MSAIDX_BACKEND_AUTO;
    config->device = MSAIDX_DEVICE_HOST;
    config->num_threads = 0;
    config->fast_accumulation = -1;
    config->precision = MSAIDX_PRECISION_DEFAULT;
}

/* The largest config.num_threads: more threads than this only oversubscribe the cores, and
 * OpenMP runtimes fail by aborting (or crash) when asked for a great many. */
static int32_t msaidx_max_threads(void) {
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const long per_cores = cores > 0 ? cores * MSAIDX_THREADS_PER_CORE : MSAIDX_THREADS_PER_CORE;
    return per_cores < MSAIDX_MAX_THREADS ? (int32_t)per_cores : MSAIDX_MAX_THREADS;
}

static msaidx_status check_config(const msaidx_config *c) {
    if (!c) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "config: NULL pointer");
    MSAIDX_CHECK(MSAIDX_CHECK_STRUCT_SIZE("config", c, msaidx_config));
    if (c->head_dim < 16 || c->head_dim > MSAIDX_MAX_HEAD_DIM || c->head_dim % 16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.head_dim = %d: must be a multiple of 16 in [16, %d]",
                           c->head_dim, MSAIDX_MAX_HEAD_DIM);
    if (c->page_size < 16 || c->page_size > 512 || c->page_size % 16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.page_size = %d: must be a multiple of 16 in [16, 512]",
                           c->page_size);
    if (c->num_heads < 1 || c->num_heads > MSAIDX_MAX_HEADS)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.num_heads = %d: must be in [1, %d]", c->num_heads,
                           MSAIDX_MAX_HEADS);
    MSAIDX_CHECK(msaidx_check_topk_params("config", c->topk, c->init_blocks, c->local_blocks));
    if (c->dtype != MSAIDX_DTYPE_E4M3 && c->dtype != MSAIDX_DTYPE_BF16)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "config.dtype = %d: not an msaidx_dtype",
                           (int)c->dtype);
    if ((int)c->backend < MSAIDX_BACKEND_AUTO || c->backend > MSAIDX_BACKEND_PERSISTENT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.backend = %d: not an msaidx_backend", (int)c->backend);
    if (c->device < MSAIDX_DEVICE_HOST)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.device = %d: must be a CUDA ordinal or MSAIDX_DEVICE_HOST",
                           c->device);
    if (c->num_threads < 0)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "config.num_threads = %d: negative",
                           c->num_threads);
    const int32_t max_threads = msaidx_max_threads();
    if (c->num_threads > max_threads)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.num_threads = %d: above %d (at most %d and %d per online core)",
                           c->num_threads, max_threads, MSAIDX_MAX_THREADS,
                           MSAIDX_THREADS_PER_CORE);
    if (c->precision != MSAIDX_PRECISION_DEFAULT && c->precision != MSAIDX_PRECISION_EXACT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.precision = %d: must be MSAIDX_PRECISION_DEFAULT (0) or "
                           "MSAIDX_PRECISION_EXACT (1)",
                           (int)c->precision);
    if (c->fast_accumulation < -1 || c->fast_accumulation > 1)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.fast_accumulation = %d: must be -1 (follow config.precision), 0 "
                           "(exact) or 1 (default precision)",
                           c->fast_accumulation);
    if (c->fast_accumulation == 1 && c->precision == MSAIDX_PRECISION_EXACT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                           "config.fast_accumulation = 1 contradicts config.precision = "
                           "MSAIDX_PRECISION_EXACT");
    return MSAIDX_SUCCESS;
}

/* The admission of one concrete backend for a valid config. */
static msaidx_status admit(msaidx_backend id, const msaidx_config *c) {
    const msaidx_backend_ops *ops = msaidx_find_backend(id);
    if (!ops)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: not compiled into this build of msaidx",
                           msaidx_backend_name(id));
    if (ops->on_device && c->device == MSAIDX_DEVICE_HOST)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend %s: needs a CUDA device, but config.device is "
                           "MSAIDX_DEVICE_HOST",
                           ops->name);
    if (!ops->on_device && c->device != MSAIDX_DEVICE_HOST)
        return msaidx_fail(MSAIDX_ERROR_NOT_SUPPORTED,
                           "backend cpu: works on host memory, but config.device = %d", c->device);
    return ops->supports(c);
}

static msaidx_backend resolve_auto(const msaidx_config *c) {
    if (c->device == MSAIDX_DEVICE_HOST) return MSAIDX_BACKEND_CPU;
    if (admit(MSAIDX_BACKEND_PERSISTENT, c) == MSAIDX_SUCCESS) return MSAIDX_BACKEND_PERSISTENT;
    /* The probe's refusal is not the caller's error: a context_create that succeeds on dense
     * must not leave "backend persistent: ..." as msaidx_last_error(). */
    msaidx_clear_error();
    return MSAIDX_BACKEND_DENSE;
}

msaidx_status msaidx_backend_supported(msaidx_backend backend, const msaidx_config *config) {
    msaidx_status status = check_config(config);
    if (status != MSAIDX_SUCCESS) return status;
    if (backend == MSAIDX_BACKEND_AUTO) backend = resolve_auto(config);
    if ((int)backend < MSAIDX_BACKEND_AUTO || backend > MSAIDX_BACKEND_PERSISTENT)
        return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "backend = %d: not an msaidx_backend",
                           (int)backend);
    return admit(backend, config);
}

msaidx_status msaidx_context_create(msaidx_context **context, const msaidx_config *config) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    *context = NULL;
    msaidx_status status = check_config(config);
    if (status != MSAIDX_SUCCESS) return status;
    msaidx_config resolved = *config;
    if (resolved.backend == MSAIDX_BACKEND_AUTO) resolved.backend = resolve_auto(config);
    /* The deprecated field, once read, is folded into precision: backends read precision only. */
    if (resolved.fast_accumulation == 0) resolved.precision = MSAIDX_PRECISION_EXACT;
    resolved.fast_accumulation = -1;
    status = admit(resolved.backend, &resolved);
    if (status != MSAIDX_SUCCESS) return status;

    msaidx_context *created = calloc(1, sizeof *created);
    if (!created) return msaidx_fail(MSAIDX_ERROR_OUT_OF_MEMORY, "context: out of host memory");
    created->config = resolved;
    created->ops = msaidx_find_backend(resolved.backend);
    if (created->ops->init_context) {
        status = created->ops->init_context(created);
        if (status != MSAIDX_SUCCESS) {
            free(created);
            return status;
        }
    }
    *context = created;
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_context_destroy(msaidx_context *context) {
    free(context);
    return MSAIDX_SUCCESS;
}

msaidx_status msaidx_context_backend(const msaidx_context *context, msaidx_backend *backend) {
    if (!context) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "context: NULL pointer");
    if (!backend) return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT, "backend: NULL pointer");
    *backend = context->config.backend;
    return MSAIDX_SUCCESS;
}
