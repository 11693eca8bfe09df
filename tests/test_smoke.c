/* Smoke test of the public API on the cpu backend (the full suites live beside it). */
#include "harness.h"
#include "msaidx.h"

#include <stdlib.h>

int main(void) {
    msaidx_config config;
    msaidx_config_init(&config);
    config.num_heads = 1;
    msaidx_context *context = NULL;
    CHECK_OK(msaidx_context_create(&context, &config));
    msaidx_backend backend;
    CHECK_OK(msaidx_context_backend(context, &backend));
    CHECK(backend == MSAIDX_BACKEND_CPU, "auto on host resolved to %d", (int)backend);
    msaidx_context_destroy(context);
    return harness_finish("test_smoke");
}
