/* Status names and the thread-local last-error message. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[1024];

const char *msaidx_status_string(msaidx_status status) {
    switch (status) {
    case MSAIDX_SUCCESS: return "MSAIDX_SUCCESS";
    case MSAIDX_ERROR_INVALID_ARGUMENT: return "MSAIDX_ERROR_INVALID_ARGUMENT";
    case MSAIDX_ERROR_NOT_SUPPORTED: return "MSAIDX_ERROR_NOT_SUPPORTED";
    case MSAIDX_ERROR_BAD_METADATA: return "MSAIDX_ERROR_BAD_METADATA";
    case MSAIDX_ERROR_CUDA: return "MSAIDX_ERROR_CUDA";
    case MSAIDX_ERROR_OUT_OF_MEMORY: return "MSAIDX_ERROR_OUT_OF_MEMORY";
    case MSAIDX_ERROR_INTERNAL: return "MSAIDX_ERROR_INTERNAL";
    }
    return "MSAIDX_UNKNOWN_STATUS";
}

const char *msaidx_last_error(void) { return last_error; }

void msaidx_clear_error(void) { last_error[0] = '\0'; }

msaidx_status msaidx_fail(msaidx_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

msaidx_status msaidx_check_struct_size(const char *name, size_t given, size_t expected,
                                       const char *type) {
    if (given == expected) return MSAIDX_SUCCESS;
    return msaidx_fail(MSAIDX_ERROR_INVALID_ARGUMENT,
                       "%s.struct_size = %zu, expected sizeof(%s) = %zu (call %s_init)", name,
                       given, type, expected, type);
}
