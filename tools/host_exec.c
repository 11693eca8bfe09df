/* The host exec: buffers in host memory, wall-clock marks, nothing to flush. With tool_pick_gpu
 * and tool_no_gpu_reason, the choice between it and the GPU exec (gpu_util.c) of a CUDA build. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double host_marks[TOOL_MARKS];

static bool host_alloc(void **pointer, size_t bytes) {
    *pointer = aligned_alloc(256, tool_round256(bytes ? bytes : 1));
    if (!*pointer) fprintf(stderr, "msaidx: out of host memory (%zu bytes)\n", bytes);
    return *pointer != NULL;
}
static void host_release(void *pointer) { free(pointer); }
static bool host_copy(void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
    return true;
}
static bool host_poison(void *dst, size_t bytes) {
    memset(dst, 0xFF, bytes);
    return true;
}
static bool host_sync(void) { return true; }
static bool host_mark(int slot) {
    host_marks[slot] = tool_now_ms();
    return true;
}
static double host_elapsed(int from, int to) { return host_marks[to] - host_marks[from]; }
static bool host_flush(void) { return true; }

const tool_exec *tool_host_exec(void) {
    static const tool_exec host = {
        .name = "host",
        .device = MSAIDX_DEVICE_HOST,
        .stream = NULL,
        .alloc = host_alloc,
        .release = host_release,
        .upload = host_copy,
        .download = host_copy,
        .poison = host_poison,
        .sync = host_sync,
        .mark = host_mark,
        .elapsed_ms = host_elapsed,
        .flush_cache = host_flush,
    };
    return &host;
}

const tool_exec *tool_pick_gpu(void) {
#ifdef MSAIDX_WITH_CUDA
    if (tool_gpu_count() > 0) return tool_gpu_exec();
#endif
    return NULL;
}

void tool_no_gpu_reason(msaidx_backend backend, char *text, size_t size) {
    /* The library's own admission check says it best (no driver, no device, no CUDA build). */
    msaidx_config config;
    msaidx_config_init(&config);
    config.device = 0;
    if (backend == MSAIDX_BACKEND_AUTO || backend == MSAIDX_BACKEND_CPU)
        backend = MSAIDX_BACKEND_DENSE;
    if (msaidx_backend_supported(backend, &config) == MSAIDX_SUCCESS)
        snprintf(text, size, "a CUDA device is usable");
    else
        snprintf(text, size, "%s", msaidx_last_error());
}
